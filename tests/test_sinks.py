"""What log.jsonl, TensorBoard and W&B keep when a run goes back to an earlier step: a resume, a rollback."""

from __future__ import annotations

import time

import pytest

from conftest import untimed
from common.log_fields import val_set_names
from runtime.logger import RunLogger, read_log


def train(step: int, loss: float) -> dict:
    return {"kind": "train", "step": step, "loss": loss}


def rollback(step: int, from_step: int) -> dict:
    return {"kind": "rollback", "step": step, "from_step": from_step, "reason": "2 spikes in a row"}


def test_every_record_carries_the_time_it_was_written_and_the_sinks_their_own(tmp_path):
    """log.jsonl's `time`, unix seconds, added by the logger to every kind of record; TensorBoard (and W&B, which
    gets the same numbers) keeps its own clock, so no `*/time` series."""
    from test_tensorboard import scalars

    logger = RunLogger(enabled=True)
    logger.open_run_folder(tmp_path, 0, {})
    logger.start_tensorboard(tmp_path / "tensorboard", 0)
    times = [time.time()]
    for record in (train(0, 6.5), {"kind": "val", "step": 1, "loss": 6.0, "bpb": 2.5},
                   {"kind": "checkpoint", "step": 1, "path": "checkpoints/step_00000001.pt"}):
        logger.log(record)
        times.append(time.time())
    logger.close()
    records = read_log(tmp_path / "log.jsonl")
    assert all(isinstance(r["time"], float) and times[i] <= r["time"] <= times[i + 1] for i, r in enumerate(records))
    assert untimed(records) == [train(0, 6.5), {"kind": "val", "step": 1, "loss": 6.0, "bpb": 2.5},
                                {"kind": "checkpoint", "step": 1, "path": "checkpoints/step_00000001.pt"}]
    assert sorted(scalars(tmp_path / "tensorboard")) == ["train/loss", "val/bpb", "val/loss"]
    assert val_set_names(records[1]) == []  # a field of every record, no val set (plot_log.py, compare_runs.py)


def test_a_rollbacks_rewind_keeps_the_rollback_records_a_resume_drops_them(tmp_path):
    """Two rollbacks to the checkpoint of step 6: the second rewind drops the steps redone since the
    first, not the first rollback's record, which says what happened. A resume from the checkpoint of
    step 6 drops both: they happened after that checkpoint and will happen again."""
    logger = RunLogger(enabled=True)
    logger.open_run_folder(tmp_path, 0, {})
    for step in range(9):
        logger.log(train(step, 10.0 - step))
    logger.rewind(6)
    logger.log(rollback(6, 8))
    for step in range(6, 9):
        logger.log(train(step, 20.0 - step))
    logger.rewind(6)
    logger.log(rollback(6, 8))
    logger.log(train(6, 30.0))
    logger.close()
    records = untimed(read_log(tmp_path / "log.jsonl"))
    assert records == [train(s, 10.0 - s) for s in range(6)] + [rollback(6, 8), rollback(6, 8), train(6, 30.0)]

    resumed = RunLogger(enabled=True)
    resumed.open_run_folder(tmp_path, 6, {})
    resumed.close()
    assert untimed(read_log(tmp_path / "log.jsonl")) == [train(s, 10.0 - s) for s in range(6)]


@pytest.mark.slow
def test_two_rollbacks_to_one_checkpoint_leave_two_records_and_each_sink_the_kept_steps(tmp_path):
    """2 ranks, spikes at data positions 7 and 8, then (data offset 3) 10 and 11: steps 7-8 spike twice,
    and the run rolls back to the checkpoint of step 6 twice, then finishes past those batches."""
    from conftest import base_args, make_shards, run_trainer
    from test_observability import kept_rows, numbers_of_the_log, wandb_history
    from test_tensorboard import scalars, scalars_of_the_log
    from training.checkpoint import folder as ckpt
    out = tmp_path / "out"
    args = base_args(make_shards(tmp_path / "shards"), out, max_steps=12, checkpoint_interval=3, eval_interval=0,
                     spike_skip="true", spike_window=4, rollback_after=2, tensorboard="true", wandb="true",
                     wandb_mode="offline", wandb_project="test")
    proc = run_trainer(args, nproc=2, script="tests/inject_fault.py",
                       extra_env={"FAULT": "spike", "FAULT_POSITIONS": "7,8,10,11"})
    assert "(rollback 2 of at most 3)" in proc.stderr
    records = read_log(out / "log.jsonl")
    assert [(r["step"], r["from_step"], r["skipped_batches"]) for r in records if r["kind"] == "rollback"] == [
        (6, 8, [6, 8]), (6, 8, [6, 11])]
    final = ckpt.load_checkpoint(ckpt.list_checkpoints(out / "checkpoints")[-1][1])
    assert final["step"] == 12 and final["rollbacks"] == 2
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(12))

    in_log = scalars_of_the_log(out / "log.jsonl")
    in_tensorboard = scalars(out / "tensorboard")
    assert in_tensorboard["rollback/from_step"] == [(6, 8.0)]  # one value per step: the newest rollback's
    assert {tag: v for tag, v in in_tensorboard.items() if not tag.startswith("rollback/")} == {
        tag: v for tag, v in in_log.items() if not tag.startswith("rollback/")}
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    rows = wandb_history(run_dir)
    assert [row["rewind/to_step"] for row in rows if "rewind/to_step" in row] == [6, 6]
    assert kept_rows(rows) == numbers_of_the_log(out / "log.jsonl")
