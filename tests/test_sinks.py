"""What log.jsonl keeps when a run goes back to an earlier step: a resume's truncation, a rollback's rewind."""

from __future__ import annotations

from training.run_logger import RunLogger, read_log


def train(step: int, loss: float) -> dict:
    return {"kind": "train", "step": step, "loss": loss}


def rollback(step: int, from_step: int) -> dict:
    return {"kind": "rollback", "step": step, "from_step": from_step, "reason": "2 spikes in a row"}


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
    records = read_log(tmp_path / "log.jsonl")
    assert records == [train(s, 10.0 - s) for s in range(6)] + [rollback(6, 8), rollback(6, 8), train(6, 30.0)]

    resumed = RunLogger(enabled=True)
    resumed.open_run_folder(tmp_path, 6, {})
    resumed.close()
    assert read_log(tmp_path / "log.jsonl") == [train(s, 10.0 - s) for s in range(6)]
