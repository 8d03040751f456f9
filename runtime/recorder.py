"""The metrics of the step in progress: recorded by name from wherever they are computed, taken by the step's one
collective.

Code that runs during training on any rank (the step's math, a hook on the model or on the optimizer, the host)
records a metric, declared once with common/log_fields.py's train_metric, by `record_metric(METRIC, value)`: value
a 0-d tensor on the device, or a number. Nothing is read from the device then. The ranks' values ride the step's one
all-gather (training/run/lockstep.py), are combined over the ranks as the metric declares, and become fields of the
step's train record: log.jsonl, train/<name> in W&B and TensorBoard, and the step line where the metric shows itself.

Which step a value is a field of: everything recorded since the previous step's all-gather is taken by the next one.
A value recorded during step s (its forwards, backwards, the clipping) is step s's. One recorded after step s's
all-gather, after its update (a hook on optimizer.step), rides step s + 1's and is a field of step s + 1's record:
a figure of the update that made the weights step s + 1 starts from, and its name should say so. A metric recorded
several times before one all-gather (each micro-step, a recomputed forward) is their mean. A hook on the model records
in the evaluations' forwards too, unless it checks model.training.
"""

from __future__ import annotations

from common.log_fields import TRAIN_METRICS, Metric

_recorded: dict[Metric, list] = {}  # metric -> [the sum of its values so far, how many]


def record_metric(metric: Metric, value) -> None:
    """Record value (a 0-d tensor, on any device, or a number) of a declared metric for the step in progress."""
    if TRAIN_METRICS.get(metric.name) is not metric:
        raise ValueError(f"metric {metric.name!r} is not declared (common/log_fields.py's train_metric)")
    if metric.over_ranks is None:
        raise ValueError(f"metric {metric.name!r} is a field rank 0 writes after the step, not one recorded")
    if metric in _recorded:
        _recorded[metric][0] = _recorded[metric][0] + value  # on the device, for a tensor: no host sync
        _recorded[metric][1] += 1
    else:
        _recorded[metric] = [value, 1]


def take_recorded() -> dict[Metric, object]:
    """Each metric recorded since the last take, and the mean of its values; forgotten here."""
    taken = {metric: total / count if count > 1 else total for metric, (total, count) in _recorded.items()}
    _recorded.clear()
    return taken


def forget_recorded() -> None:
    """Drop what was recorded outside a run's steps (a micro-batch probe's step, an earlier run in this process)."""
    _recorded.clear()
