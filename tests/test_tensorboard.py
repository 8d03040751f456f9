"""TensorBoard beside log.jsonl: the same records' numbers as `kind/field` scalars against the step."""

from __future__ import annotations

import sys

import pytest

from errors import ConfigError
from training.run_logger import RunLogger


def scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of the event files in log_dir: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_records_become_scalars_and_text_and_nothing_else(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = RunLogger(enabled=True)
    logger.open_run_folder(tmp_path, 0, {})
    logger.start_tensorboard(tmp_path / "tensorboard")
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
        RunLogger(enabled=True).start_tensorboard(tmp_path / "tb")
    RunLogger(enabled=False).start_tensorboard(tmp_path / "tb")  # other ranks: nothing to do
    assert not (tmp_path / "tb").exists()


@pytest.mark.slow
def test_a_run_with_tensorboard_writes_every_step_of_rank_0(tmp_path):
    from conftest import base_args, make_shards, run_trainer

    out = tmp_path / "out"
    run_trainer(base_args(make_shards(tmp_path / "shards"), out, tensorboard="true", max_steps=4), nproc=2)
    found = scalars(out / "tensorboard")
    assert [step for step, _ in found["train/loss"]] == [0, 1, 2, 3]
    assert [step for step, _ in found["val/loss"]] == [0, 3, 4]  # before training, every eval_interval, the end
