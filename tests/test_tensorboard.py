"""TensorBoard beside log.jsonl: the same records' numbers as `kind/field` scalars against the step."""

from __future__ import annotations

import struct
import sys

import pytest

from common.errors import ConfigError
from runtime.logger import RunLogger


def scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of the event files in log_dir that TensorBoard shows: tag -> [(step, value)].

    Read as TensorBoard's EventAccumulator reads them, purges included (a tag whose every value was
    purged is still listed, with none: left out here).
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    series = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    return {tag: values for tag, values in series.items() if values}


def scalars_of_the_log(path) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard should show: every number of log.jsonl's records as `kind/field` against the step
    (as the float32 that a scalar event holds)."""
    from test_observability import numbers_of_the_log

    def float32(value: float) -> float:
        return struct.unpack("f", struct.pack("f", value))[0]

    return {tag: [(step, float32(v)) for step, v in values] for tag, values in numbers_of_the_log(path).items()}


def train_steps(logger: RunLogger, steps, offset: float) -> None:
    for step in steps:
        logger.log({"kind": "train", "step": step, "loss": offset + step, "lr": 1e-3})


def test_records_become_scalars_and_text_and_nothing_else(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = RunLogger(enabled=True)
    logger.open_run_folder(tmp_path, 0, {})
    logger.start_tensorboard(tmp_path / "tensorboard", 0)
    for step, loss in enumerate([6.5, 6.25, 6.0]):
        logger.log({"kind": "train", "step": step, "loss": loss, "lr": 1e-3, "tokens": 512 * (step + 1)})
    logger.log({"kind": "skip", "step": 2, "loss": 6.0, "grad_norm": None, "reason": "a spike", "flag": True})
    logger.log({"kind": "val", "step": 3, "loss": float("nan")})  # non-finite: null in the log, no scalar
    logger.log({"kind": "sample", "step": 3, "text": "ROMEO: hello"})
    logger.close()
    found = scalars(tmp_path / "tensorboard")
    assert found["train/loss"] == [(0, 6.5), (1, 6.25), (2, 6.0)]
    assert found["train/tokens"] == [(0, 512.0), (1, 1024.0), (2, 1536.0)]
    assert found["skip/loss"] == [(2, 6.0)]
    assert not {"skip/reason", "skip/flag", "skip/grad_norm", "val/loss"} & set(found)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert "sample/text/text_summary" in events.Tags()["tensors"]


def test_a_missing_tensorboard_package_is_one_line_naming_the_key(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with pytest.raises(ConfigError, match=r"^tensorboard: needs the tensorboard package"):
        RunLogger(enabled=True).start_tensorboard(tmp_path / "tb", 0)
    RunLogger(enabled=False).start_tensorboard(tmp_path / "tb", 0)  # other ranks: nothing to do
    assert not (tmp_path / "tb").exists()


def test_a_resumed_run_shows_each_step_once_with_the_value_kept_in_the_log(tmp_path):
    """A resume from the checkpoint of step 5 redoes steps 5-7: TensorBoard drops the first values, as
    log.jsonl does, and also drops records of those steps that the resumed run does not make again."""
    first = RunLogger(enabled=True)
    first.open_run_folder(tmp_path, 0, {})
    first.start_tensorboard(tmp_path / "tensorboard", 0)
    train_steps(first, range(8), 0.0)
    first.log({"kind": "val", "step": 6, "loss": 3.5})
    first.log({"kind": "sample", "step": 6, "text": "ROMEO: hello"})
    first.close()  # the run stopped after step 7; its newest checkpoint is step 5's
    resumed = RunLogger(enabled=True)
    resumed.open_run_folder(tmp_path, 5, {})
    resumed.start_tensorboard(tmp_path / "tensorboard", 5)
    train_steps(resumed, range(5, 8), 100.0)
    resumed.close()
    found = scalars(tmp_path / "tensorboard")
    assert found["train/loss"] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 105.0), (6, 106.0), (7, 107.0)]
    assert found == scalars_of_the_log(tmp_path / "log.jsonl") and "val/loss" not in found


def test_a_rollback_shows_each_step_once_with_the_value_kept_in_the_log(tmp_path):
    """A rollback from step 8 to the checkpoint of step 6, twice: each rewind drops what the log drops
    (the steps to redo, and a skip that the redo does not make again), in the event file already open."""
    logger = RunLogger(enabled=True)
    logger.open_run_folder(tmp_path, 0, {})
    logger.start_tensorboard(tmp_path / "tensorboard", 0)
    train_steps(logger, range(9), 0.0)
    logger.log({"kind": "skip", "step": 7, "loss": 70.0})
    for attempt in (1, 2):
        logger.rewind(6)
        logger.log({"kind": "rollback", "step": 6, "from_step": 8, "tokens": 3072 * attempt})
        train_steps(logger, range(6, 9), 100.0 * attempt)
    logger.close()
    found = scalars(tmp_path / "tensorboard")
    assert found["train/loss"] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0), (6, 206.0), (7, 207.0), (8, 208.0)]
    assert "skip/loss" not in found
    assert found["rollback/tokens"] == [(6, 6144.0)]  # one value per step: the newest of the log's two records
    assert len(list((tmp_path / "tensorboard").iterdir())) == 1


@pytest.mark.slow
def test_a_run_with_tensorboard_writes_every_step_of_rank_0(tmp_path):
    from conftest import base_args, make_shards, run_trainer

    out = tmp_path / "out"
    run_trainer(base_args(make_shards(tmp_path / "shards"), out, tensorboard="true", max_steps=4), nproc=2)
    found = scalars(out / "tensorboard")
    assert [step for step, _ in found["train/loss"]] == [0, 1, 2, 3]
    assert [step for step, _ in found["val/loss"]] == [0, 3, 4]  # before training, every eval_interval, the end
