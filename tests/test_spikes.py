"""Loss spikes skipped and rolled back, the same on every rank, and resumed exactly.

Spikes are injected by tests/inject_fault.py (FAULT=spike) as a property of the data: the steps
that read the batches of chosen data positions get their loss and gradients multiplied by 1000 on
every rank. Real 2-rank runs of the tiny model show that such a step is not applied, that spikes
in a row roll the run back past those batches, that a resume on either side of a skip or a
rollback trains exactly like the straight run, and that the bound on rollbacks stops the run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import assert_same, base_args, crashed_copy, run_trainer, train_losses
from training.checkpoint import folder as ckpt
from runtime.logger import read_log
from training.optim.spikes import SpikeWindow

# a full window after 4 applied steps; checkpoints every 3 steps; val loss only at the end
SPIKY = dict(max_steps=12, checkpoint_interval=3, eval_interval=0, spike_skip="true", spike_window=4)
INJECT = "tests/inject_fault.py"


def spiky_run(data: Path, out: Path, positions: str, check: bool = True, factor: str = "1000", **overrides):
    return run_trainer(base_args(data, out, **{**SPIKY, **overrides}), nproc=2, script=INJECT, check=check,
                       extra_env={"FAULT": "spike", "FAULT_POSITIONS": positions, "FAULT_FACTOR": factor})


def records(out: Path, kind: str) -> list[dict]:
    return [r for r in read_log(out / "log.jsonl") if r["kind"] == kind]


def resumed_from(run: Path, out: Path, checkpoint_step: int, data: Path, positions: str, **overrides):
    """The same command as `run`, relaunched after a crash just after checkpoint `checkpoint_step`."""
    crashed_copy(run, out, checkpoint_step)
    return spiky_run(data, out, positions, **overrides)


def final_state(out: Path) -> dict:
    """What the training made of the run: weights, AdamW state, the spike window and the long-run counters (not the
    lineage)."""
    state = ckpt.read_full_state(ckpt.list_checkpoints(out / "checkpoints")[-1][1])
    return {key: state[key] for key in ("model", "optimizer", "step", "tokens_seen", "spike_window",
                                            "skips_in_a_row", "rollbacks", "data_offset")}


# --- the window ---------------------------------------------------------------------------------------


def test_the_window_judges_only_when_full_and_its_state_survives_json_exactly():
    window = SpikeWindow(3, threshold=2.0, device=torch.device("cpu"), dtype=torch.float32)
    for loss, norm in [(4.1, 1.0), (4.0, 1.2), (3.9, 0.9)]:
        assert not window.full
        window.add(torch.tensor(loss), torch.tensor(norm))
    assert window.full
    assert window.judge(torch.tensor(4.0), torch.tensor(1.0))[0] == 0
    assert window.judge(torch.tensor(9.0), torch.tensor(1.0))[0] == 1  # the loss alone
    assert window.judge(torch.tensor(4.0), torch.tensor(5.0))[0] == 1  # the grad norm alone
    window.add(torch.tensor(1 / 3), torch.tensor(0.7))  # replaces the oldest; 1/3 is not exact in float32
    again = SpikeWindow(3, threshold=2.0, device=torch.device("cpu"), dtype=torch.float32)
    again.load_state_dict(json.loads(json.dumps(window.state_dict())))  # as a sharded checkpoint keeps it
    assert torch.equal(again.values, window.values) and (again.filled, again.position) == (3, 1)


# --- skipping -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_spike_is_skipped_on_both_ranks_and_leaves_the_weights_as_they_were(data, tmp_path):
    """Under FSDP every rank holds only its shard: equal sharded states before and after the
    spike mean both ranks left theirs untouched."""
    out = tmp_path / "fsdp"
    proc = spiky_run(data, out, "7", strategy="fsdp", max_steps=9, checkpoint_interval=1)
    (skip,) = records(out, "skip")
    assert skip["step"] == 7 and "loss" in skip["reason"] and "grad norm" in skip["reason"]
    assert "step 7: loss spike, the update was not applied" in proc.stderr
    assert sorted(train_losses(out)) == list(range(9))  # the skipped step is logged like any other
    before, after = (ckpt.read_full_state(dict(ckpt.list_checkpoints(out / "checkpoints"))[s]) for s in (7, 8))
    assert_same(before["model"], after["model"])
    assert_same(before["optimizer"]["state"], after["optimizer"]["state"])
    assert after["tokens_seen"] == before["tokens_seen"] + 512  # the step and its data went on


@pytest.fixture(scope="module")
def straight_skip(data, tmp_path_factory) -> Path:
    """2 ranks, DDP, a spike at data position 7: skipped, no rollback."""
    out = tmp_path_factory.mktemp("straight") / "skip"
    spiky_run(data, out, "7")
    assert [r["step"] for r in records(out, "skip")] == [7]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint_step", [6, 9], ids=["before-the-skip", "after-the-skip"])
def test_a_resume_on_either_side_of_a_skip_is_bitwise_the_straight_run(data, straight_skip, tmp_path, checkpoint_step):
    out = tmp_path / "resumed"
    resumed_from(straight_skip, out, checkpoint_step, data, "7")
    assert train_losses(out) == train_losses(straight_skip)
    assert [r["step"] for r in records(out, "skip")] == [7]
    assert_same(final_state(out), final_state(straight_skip))


# --- rolling back -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def straight_rollback(data, tmp_path_factory) -> Path:
    """Spikes at data positions 7 and 8 with rollback_after 2: back to checkpoint 6, past positions 6-8."""
    out = tmp_path_factory.mktemp("straight") / "rollback"
    proc = spiky_run(data, out, "7,8", rollback_after=2)
    assert "rolled back to" in proc.stderr and "(rollback 1 of at most 3)" in proc.stderr
    return out


@pytest.mark.slow
def test_spikes_in_a_row_roll_back_past_their_batches_and_the_run_finishes(straight_rollback):
    (rollback,) = records(straight_rollback, "rollback")
    assert rollback["step"] == 6 and rollback["from_step"] == 8 and rollback["skipped_batches"] == [6, 8]
    assert rollback["tokens"] == 6 * 512 and "2 spikes in a row" in rollback["reason"]
    assert sorted(train_losses(straight_rollback)) == list(range(12))  # one train record per step
    assert records(straight_rollback, "skip") == []  # the skips before the rollback went with their steps
    final = ckpt.load_checkpoint(ckpt.list_checkpoints(straight_rollback / "checkpoints")[-1][1])
    assert final["step"] == 12 and final["rollbacks"] == 1 and final["data_offset"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint_step", [6, 9], ids=["before-the-rollback", "after-the-rollback"])
def test_a_resume_on_either_side_of_a_rollback_is_bitwise_the_straight_run(data, straight_rollback, tmp_path,
                                                                            checkpoint_step):
    out = tmp_path / "resumed"
    resumed_from(straight_rollback, out, checkpoint_step, data, "7,8", rollback_after=2)
    assert train_losses(out) == train_losses(straight_rollback)
    assert [(r["step"], r["from_step"]) for r in records(out, "rollback")] == [(6, 8)]
    assert_same(final_state(out), final_state(straight_rollback))


@pytest.mark.slow
def test_rollbacks_past_max_rollbacks_stop_the_run_with_one_line_and_exit_3(data, tmp_path):
    # after the rollback to 6 (data offset 3), steps 7 and 8 read positions 10 and 11: spikes again
    out = tmp_path / "diverged"
    proc = spiky_run(data, out, "7,8,10,11", check=False, rollback_after=2, max_rollbacks=1)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.exitcodes == [3, 3] and len(errors) == 1, proc.stderr[-3000:]
    assert "step 8: 2 spikes in a row" in errors[0] and "rolled back 1 time(s) already (max_rollbacks 1)" in errors[0]
    assert [s for s, _ in ckpt.list_checkpoints(out / "checkpoints")] == [3, 6]  # nothing after the last good state


@pytest.mark.slow
def test_a_nan_rolls_back_when_asked_instead_of_stopping_the_run(data, tmp_path):
    out = tmp_path / "nan"
    proc = spiky_run(data, out, "5", factor="nan", spike_skip="false", rollback_on_nonfinite="true", max_steps=8)
    assert "step 5: loss nan" in proc.stderr and "rolled back to" in proc.stderr
    (rollback,) = records(out, "rollback")
    assert (rollback["step"], rollback["from_step"], rollback["skipped_batches"]) == (3, 5, [3, 5])
    assert sorted(train_losses(out)) == list(range(8))


@pytest.mark.slow
def test_under_fsdp_a_rollback_reloads_every_ranks_shard_from_either_format(data, tmp_path):
    for checkpoint_format in ("sharded", "file"):
        out = tmp_path / checkpoint_format
        spiky_run(data, out, "7,8", rollback_after=2, strategy="fsdp", checkpoint_format=checkpoint_format)
        assert [(r["step"], r["from_step"]) for r in records(out, "rollback")] == [(6, 8)]
        assert sorted(train_losses(out)) == list(range(12))


@pytest.mark.slow
def test_with_the_modern_recipe_a_spike_leaves_muon_and_adamw_state_as_they_were(data, tmp_path):
    out = tmp_path / "muon"
    spiky_run(data, out, "7", optimizer="muon", lr_schedule="wsd", max_steps=9, checkpoint_interval=1)
    assert [r["step"] for r in records(out, "skip")] == [7]
    before, after = (ckpt.read_full_state(dict(ckpt.list_checkpoints(out / "checkpoints"))[s]) for s in (7, 8))
    assert_same(before["model"], after["model"])
    assert_same(before["optimizer"]["state"], after["optimizer"]["state"])  # momentum buffers too
