"""Names that users choose and that become fields of log.jsonl records: the one rule they all follow.

Two kinds of name become fields:

- a val set's name (val_sets, or by default each mixture source's folder name): the val record holds
  that set's loss under the name, its bits per byte under `bpb_<name>` (evals/val_loss.py), and the EMA
  weights' figures under `ema_<field>` (evals/periodic.py);
- a mixture source's name (its folder's last part): the train record holds its tokens so far under
  `tokens_<name>`.

A name may make no field that its record has for another reason: none of the record's own fields
(VAL_RECORD_FIELDS; the train record's are the metrics declared with train_metric, where each is written), and no
val set name starting with a prefix that another
figure's field is made with (`ema_`: the EMA of set `x` is `ema_x`, so a set named `ema_x` would be
overwritten by it, and every reader takes `ema_*` fields for EMA figures; `bpb_` likewise). Such a name
is refused before any work starts, with one `error:` line naming the key that gave it; nothing is renamed silently, so
each field of the log means what its name says. A field added to the val record joins its list; a train record
field is declared with train_metric beside the code that writes or records it, and a source's name is checked
against them once every module of the trainer is imported (launch/build.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

EMA_PREFIX = "ema_"  # of the fields an evaluation of the EMA weights adds to its record (evals/periodic.py)
BPB = "bpb"  # the val record's bits per byte of its first set (evals/val_loss.py)
BPB_PREFIX = "bpb_"  # of each named set's bits per byte
# the fields of every record that are not figures: what it is, its step, and when it was written (unix seconds, float;
# added by runtime/logger.py)
RECORD_FIELDS = ("kind", "step", "time")
VAL_RECORD_FIELDS = (*RECORD_FIELDS, "tokens", "loss", BPB)  # a val record's own fields (evals/val_loss.py)
VAL_SET_PREFIXES = (EMA_PREFIX, BPB_PREFIX)  # prefixes of the fields made from a val set's name
SOURCE_TOKENS_PREFIX = "tokens_"  # a mixture source's train tokens: tokens_<source>


class Metric(NamedTuple):
    """A field of the train record (train/<name> in W&B and TensorBoard), on the step line as the text show(value)
    gives, if any. Either recorded during training, a 0-d tensor on the device or a number, from wherever it is
    computed (runtime/recorder.py's record_metric), its ranks' values combined as over_ranks says (mean, sum
    or max); or, over_ranks None, written by rank 0 after the step (training/run/step_records.py)."""

    name: str
    over_ranks: str | None
    show: Callable[[float], str] | None = None


TRAIN_METRICS: dict[str, Metric] = {}  # every field of the train record declared so far, by name


def train_metric(name: str, over_ranks: str | None, show: Callable[[float], str] | None = None) -> Metric:
    """Declare a field of the train record, once (at import, beside the code that records or writes it)."""
    if name in (*RECORD_FIELDS, *TRAIN_METRICS) or over_ranks not in ("mean", "sum", "max", None):
        raise ValueError(f"train_metric({name!r}, {over_ranks!r}): the name is a field already, or over_ranks is "
                         f"not mean, sum, max or None")
    TRAIN_METRICS[name] = Metric(name, over_ranks, show)
    return TRAIN_METRICS[name]


def val_set_names(record: dict) -> list[str]:
    """The named val sets of a val record ([] for the one default set): its fields that are neither the
    record's own nor another figure of a set (bpb_<name>, ema_<field>)."""
    return [k for k in record if k not in VAL_RECORD_FIELDS and not k.startswith(VAL_SET_PREFIXES)]


def val_set_name_problem(name: str) -> str | None:
    """Why `name` cannot name a val set (a field of the val record), or None where it can."""
    if not name:
        return "an empty name"
    if name in VAL_RECORD_FIELDS:
        return f"{name!r} is a field of the val record itself ({', '.join(VAL_RECORD_FIELDS)})"
    for prefix in VAL_SET_PREFIXES:
        if name.startswith(prefix):
            return (f"{name!r} starts with {prefix!r}, the prefix of "
                    + ("the EMA weights' figures" if prefix == EMA_PREFIX else "each set's bits per byte")
                    + f" ({prefix}<set> is set <set>'s)")
    return None


def source_name_problem(name: str) -> str | None:
    """Why `name` cannot name a mixture source (its train record field tokens_<name>), or None where it can: judged
    by the train record fields declared so far (all of them, once the trainer's modules are imported)."""
    if not name:
        return "an empty name"
    field = SOURCE_TOKENS_PREFIX + name
    if field in TRAIN_METRICS:
        return f"its tokens field {field!r} is a field of the train record itself"
    return None
