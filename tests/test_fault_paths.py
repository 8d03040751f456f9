"""Where features meet: shared checkpoint folders, relaunches that would restart a run, failed
background saves, incomplete resume paths, unshared storage, float16 overflows, rollbacks into
the checkpoint a launch resumed from, and weights that blew up just before a checkpoint.

Each test is a regression test of a defect an audit reproduced: it fails on the code before the
fix. Most runs are one process in this one (`train_gpt2.main` through run_cli, as its __main__
does), with the fault injected through `wrap_step` or by replacing one function; the ones whose
point is several ranks are launched as two.
"""

from __future__ import annotations

import concurrent.futures
import shutil
from pathlib import Path

import pytest
import torch
from launch import components
from conftest import base_args, run_trainer, train_losses, train_here
from training.checkpoint import folder as ckpt
from training.checkpoint import sharded_format as sharded
from runtime.logger import read_log

RUN = dict(max_steps=12, checkpoint_interval=3, eval_interval=0, val_tokens=64)


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory) -> Path:
    """The uninterrupted one-process run, in the file format."""
    out = tmp_path_factory.mktemp("straight")
    assert train(data, out) == 0
    return out


def train(data: Path, out: Path, wrap_step=None, **overrides) -> int:
    return train_here(base_args(data, out, **{**RUN, **overrides}), wrap_step=wrap_step)


def error_line(capfd) -> str:
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, lines
    return lines[0]


def records(out: Path, kind: str) -> list[dict]:
    return [r for r in read_log(out / "log.jsonl") if r["kind"] == kind]


def steps_saved(folder: Path) -> list[int]:
    return [s for s, _ in ckpt.list_checkpoints(folder)]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file's bytes, but the lock's (each launch writes who holds it)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".lock"}


# --- one checkpoint folder, one run -----------------------------------------------------------------


def test_a_checkpoint_dir_shared_by_two_run_folders_is_refused_and_left_as_it_was(data, tmp_path, capfd):
    shared = tmp_path / "shared_ckpt"
    assert train(data, tmp_path / "first", checkpoint_dir=shared, max_steps=6) == 0
    in_flight = shared / ".step_00000009.pt.tmp"  # the first run's next save, being written
    in_flight.write_bytes(b"half a checkpoint")
    before = snapshot(shared)
    capfd.readouterr()
    assert train(data, tmp_path / "second", checkpoint_dir=shared, max_steps=6) == 2
    assert error_line(capfd) == (
        f"error: checkpoint_dir: {shared} holds the checkpoints of the run in {tmp_path / 'first'}, not of out_dir "
        f"{tmp_path / 'second'}; one checkpoint folder holds one run: give this run its own checkpoint_dir (or, if "
        f"that run folder was moved here, delete owner.json there)")
    assert snapshot(shared) == before  # nothing pruned, resumed or cleaned
    assert not (tmp_path / "second").exists()
    assert train(data, tmp_path / "first", checkpoint_dir=shared, max_steps=9) == 0  # its own run goes on
    assert steps_saved(shared) == [3, 6, 9]


def test_a_checkpoint_dir_in_use_by_a_launch_is_refused(data, tmp_path, capfd):
    from training.checkpoint.run_folder import FolderLock

    shared = tmp_path / "shared_ckpt"
    holder = FolderLock(shared, "checkpoint_dir", print)  # a launch of another out_dir, before its first save
    try:
        assert train(data, tmp_path / "second", checkpoint_dir=shared) == 2
        assert error_line(capfd).startswith(f"error: checkpoint_dir: {shared} is in use by another launch (pid ")
    finally:
        holder.release()


# --- an error one rank alone sees -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_step(data, tmp_path_factory) -> Path:
    """A run of one step: its checkpoint of step 1."""
    out = tmp_path_factory.mktemp("one_step")
    assert train(data, out, max_steps=1) == 0
    return ckpt.checkpoint_path(out / "checkpoints", 1)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["unreadable_checkpoint", "missing_init_from"])
def test_an_error_only_rank_1_sees_during_start_up_is_the_one_error_line(data, one_step, tmp_path, fault):
    """Rank 1 cannot read the tensors of the checkpoint it resumes, or does not find the init_from file: its error
    reaches every rank, and rank 0 prints it, once. It was rank 0's traceback of a broken connection, its reason
    only in torchrun's report."""
    key = "resume" if fault == "unreadable_checkpoint" else "init_from"
    proc = run_trainer(base_args(data, tmp_path / "out", **{**RUN, "max_steps": 2, key: one_step}), nproc=2,
                       script="tests/inject_fault.py", extra_env={"FAULT": fault, "FAULT_RANK": "1"}, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    expected = (f"error: {one_step}: could not read the checkpoint's tensors (injected on rank 1)"
                if fault == "unreadable_checkpoint" else
                f"error: init_from: '{one_step}' is not scratch, a checkpoint file, a GPT-2 preset or a HF folder")
    assert errors == [expected], proc.stderr[-3000:]
    assert proc.exitcodes == [2, 2] and "Traceback" not in proc.stderr


# --- a relaunch never starts a run over ----------------------------------------------------------------


@pytest.mark.parametrize("damage", ["changed_checkpoint_dir", "unreadable_only_checkpoint"])
def test_a_relaunch_that_finds_no_checkpoint_of_a_run_that_saved_some_is_refused(data, tmp_path, capfd, damage):
    out = tmp_path / "out"
    assert train(data, out, max_steps=3) == 0  # one checkpoint: step 3
    overrides = {}
    if damage == "changed_checkpoint_dir":
        overrides["checkpoint_dir"] = tmp_path / "mistyped"
    else:
        ckpt.checkpoint_path(out / "checkpoints", 3).write_bytes(b"not a checkpoint any more")
    log, record = (out / "log.jsonl").read_bytes(), (out / "run.json").read_bytes()
    capfd.readouterr()
    assert train(data, out, max_steps=6, **overrides) == 2
    message = error_line(capfd)
    assert message.startswith(f"error: resume: {out} holds a run that saved checkpoints ("), message
    if damage == "changed_checkpoint_dir":
        assert f"its log records checkpoint {out / 'checkpoints' / 'step_00000003.pt'}" in message
    else:
        assert "step_00000003.pt.unreadable (set aside as unreadable)" in message
    assert (out / "log.jsonl").read_bytes() == log and (out / "run.json").read_bytes() == record
    assert not (tmp_path / "mistyped").exists()


def test_a_launch_that_saved_no_checkpoint_starts_over_with_a_warning(data, tmp_path, capfd):
    out = tmp_path / "out"
    assert train(data, out, max_steps=2, checkpoint_interval=0, final_checkpoint="false") == 0
    capfd.readouterr()
    assert train(data, out, max_steps=3) == 0
    assert f"warning: {out} holds the log of a launch that saved no checkpoint (steps 0-1)" in capfd.readouterr().err
    assert sorted(train_losses(out)) == [0, 1, 2]


def test_the_log_keeps_the_record_of_the_checkpoint_a_run_resumed_from(data, tmp_path, capfd):
    out = tmp_path / "out"
    assert train(data, out, max_steps=3) == 0
    assert train(data, out, max_steps=5, checkpoint_interval=0, final_checkpoint="false") == 0
    assert [r["step"] for r in records(out, "checkpoint")] == [3]  # the resume from 3 kept its record
    shutil.rmtree(out / "checkpoints")
    assert train(data, out, max_steps=6) == 2  # so losing step 3 is still noticed
    assert "its log records checkpoint" in error_line(capfd)


def test_resume_path_to_an_incomplete_sharded_folder_is_refused_and_kept(data, tmp_path, capfd):
    out = tmp_path / "out"
    assert train(data, out, max_steps=6, checkpoint_format="sharded", checkpoint_async="false") == 0
    incomplete = out / "checkpoints" / "step_00000003"
    (incomplete / sharded.COMMIT_NAME).unlink()  # a copy not finished, or a save killed before its commit
    before = snapshot(out)
    capfd.readouterr()
    assert train(data, out, max_steps=9, checkpoint_format="sharded", resume=incomplete) == 2
    assert error_line(capfd) == (f"error: {incomplete}: incomplete checkpoint (no checkpoint.json: its save did not "
                                 f"finish)")
    assert snapshot(out) == before


# --- failed background saves ---------------------------------------------------------------------------


def failing_background_save(monkeypatch, steps: set[int]):
    """The background save of those steps fails (an EIO, as a disk or an object store would report it)."""
    real = sharded.start_save

    def start_save(parts, location, asynchronous, process_group=None):
        if asynchronous and ckpt.step_of(location) in steps:
            failed = concurrent.futures.Future()
            failed.set_exception(OSError(5, "Input/output error"))
            return failed
        return real(parts, location, asynchronous, process_group)

    monkeypatch.setattr(sharded, "start_save", start_save)


ASYNC = dict(checkpoint_format="sharded", checkpoint_async="true")


def test_a_failed_background_save_is_replaced_by_a_save_at_the_next_step(data, straight, tmp_path, capfd,
                                                                          monkeypatch):
    out = tmp_path / "out"
    failing_background_save(monkeypatch, {3})
    capfd.readouterr()
    assert train(data, out, **ASYNC) == 0
    captured = capfd.readouterr()
    assert (f"warning: {out / 'checkpoints' / 'step_00000003'}: could not write checkpoint (Input/output error); "
            f"earlier checkpoints are intact; {out / 'checkpoints' / 'step_00000003'} is not a checkpoint: saving the "
            f"next step's state in its place") in captured.err
    assert f"saved step 4 in place of {out / 'checkpoints' / 'step_00000003'}" in captured.out
    assert steps_saved(out / "checkpoints") == [4, 6, 9, 12]  # trained no further than one step past the loss
    assert train_losses(out) == train_losses(straight)  # saving changes nothing of the training


def test_a_stop_signal_after_a_failed_background_save_still_writes_its_checkpoint(data, tmp_path, capfd, monkeypatch):
    out = tmp_path / "out"
    failing_background_save(monkeypatch, {3})

    def stop_at_step_3(step):  # SIGTERM arrives during step 3, right after the save of step 3 failed
        return lambda run, model, batches, stop: step(run, model, batches, stop or run.step == 3)

    capfd.readouterr()
    assert train(data, out, wrap_step=stop_at_step_3, **ASYNC) == 0
    assert "received: saved step 4" in capfd.readouterr().out
    assert steps_saved(out / "checkpoints") == [4]


def test_a_part_that_rank_0_cannot_see_after_the_save_is_not_called_saved(data, tmp_path, capfd, monkeypatch):
    out = tmp_path / "out"
    real = sharded.start_save

    def start_save(parts, location, asynchronous, process_group=None):
        result = real(parts, location, asynchronous, process_group)
        if ckpt.step_of(location) == 6:
            for part in Path(location).glob("*.distcp"):
                part.unlink()  # written where rank 0 cannot see it (another node's disk)
        return result

    monkeypatch.setattr(sharded, "start_save", start_save)
    assert train(data, out, checkpoint_format="sharded", checkpoint_async="false") == 1
    assert error_line(capfd) == (f"error: {out / 'checkpoints' / 'step_00000006'}: could not write checkpoint "
                                 f"(checkpoint part __0_0.distcp is missing after the save); earlier checkpoints are "
                                 f"intact")
    assert steps_saved(out / "checkpoints") == [3]


@pytest.mark.slow
def test_a_process_local_filesystem_is_refused_for_several_ranks(data, tmp_path):
    proc = run_trainer(base_args(data, tmp_path / "out", **RUN, checkpoint_dir="memory://ckpt/run"), nproc=2,
                       check=False)
    assert proc.exitcodes == [2, 2], proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert lines == ["error: checkpoint_dir: memory://ckpt/run is a filesystem inside each process, which the 2 ranks "
                     "do not share: use a shared path or an object store URL"]


# --- float16, rollbacks, non-finite weights ---------------------------------------------------------------


def overflow_at(step_number: int):
    """The gradients of that step overflow float16 (inf), its loss stays finite: what GradScaler exists for."""
    def wrap(step):
        def overflowing(run, model, batches, stop):
            if run.step != step_number:
                return step(run, model, batches, stop)
            hook = run.model.lm_head.weight.register_hook(lambda grad: torch.full_like(grad, float("inf")))
            try:
                return step(run, model, batches, stop)
            finally:
                hook.remove()
        return overflowing
    return wrap


def test_a_float16_overflow_is_not_a_spike(data, tmp_path, capfd):
    out = tmp_path / "out"
    assert train(data, out, wrap_step=overflow_at(8), dtype="float16", spike_skip="true", spike_window=4,
                 rollback_after=1) == 0
    train_records = {r["step"]: r for r in records(out, "train")}
    assert train_records[8].get("skipped") is True  # the scaler skipped it, as it should
    assert records(out, "skip") == [] and records(out, "rollback") == []
    assert "spike" not in capfd.readouterr().err
    assert sorted(train_records) == list(range(12))


class ScaledLoss(torch.nn.Module):
    """The training model with its loss (and so its gradients) multiplied by a factor."""

    def __init__(self, model, factor: float):
        super().__init__()
        self.model, self.factor = model, factor

    def forward(self, *args, **kwargs):
        logits, loss = self.model(*args, **kwargs)
        return logits, loss * self.factor


def spike_at(position: int, factor: float = 1000.0):
    """The step reading the batch of that data position has its loss (and gradients) scaled up: a spike
    that is a property of the data (tests/inject_fault.py's FAULT=spike, in this process)."""
    def wrap(step):
        def spiking(run, model, batches, stop):
            if run.step + run.data_offset == position:
                model = ScaledLoss(model, factor)
            return step(run, model, batches, stop)
        return spiking
    return wrap


def test_a_run_continued_into_a_new_folder_rolls_back_to_the_checkpoint_it_resumed(data, tmp_path):
    spiky = dict(spike_skip="true", spike_window=4, rollback_after=1)
    source, fork = tmp_path / "source", tmp_path / "fork"
    assert train(data, source, max_steps=6, **spiky) == 0
    resumed = ckpt.checkpoint_path(source / "checkpoints", 6)
    assert train(data, fork, wrap_step=spike_at(8), resume=resumed, checkpoint_interval=0, **spiky) == 0
    (rollback,) = records(fork, "rollback")
    assert rollback["step"] == 6 and rollback["skipped_batches"] == [6, 8]
    assert len(records(fork, "startup")) == 1  # one launch, one startup record, rollbacks or not
    assert sorted(train_losses(fork)) == list(range(6, 12))


def poisoned_after(step_number: int):
    """The update of that step leaves a NaN in the weights (its loss, computed before, was finite)."""
    def wrap(step):
        def poisoning(run, model, batches, stop):
            result = step(run, model, batches, stop)
            if run.step == step_number + 1 and run.data_offset == 0:
                with torch.no_grad():
                    run.model.lm_head.weight[0, 0] = float("nan")
            return result
        return poisoning
    return wrap


def test_weights_that_are_not_finite_are_never_saved(data, tmp_path, capfd):
    out = tmp_path / "out"
    capfd.readouterr()
    assert train(data, out, wrap_step=poisoned_after(5)) == 3
    assert error_line(capfd) == (f"error: step 5: the weights after the update of step 5 are not finite; they were not "
                                 f"saved, and the newest checkpoint in {out / 'checkpoints'} is the last good state")
    assert steps_saved(out / "checkpoints") == [3]
    assert train(data, out, wrap_step=poisoned_after(5), rollback_on_nonfinite="true") == 0  # rolls back instead
    (rollback,) = records(out, "rollback")
    assert rollback["step"] == 3 and rollback["skipped_batches"] == [3, 5]
    state = ckpt.load_checkpoint(ckpt.checkpoint_path(out / "checkpoints", 12))
    assert all(torch.isfinite(t).all() for t in state["model"].values())


def test_the_step_vote_carries_the_failed_save_without_another_sync(data, tmp_path):
    """The vote for a retry rides on the step's one all-reduce: no extra collective, no extra sync."""
    from conftest import build_tiny_run
    from data.loader import Prefetcher

    cfg, ctx, run = build_tiny_run(data, tmp_path / "out")
    batches = Prefetcher(run.train_loader, 0, cfg.schedule.max_steps, ctx.runtime.device)
    try:
        result = components.make_lockstep(cfg, ctx, save_failed=lambda: True).step(run, run.model, batches, False)
        assert result.save_failed and run.step == 1
        result = components.make_lockstep(cfg, ctx).step(run, run.model, batches, False)
        assert not result.save_failed and run.step == 2
    finally:
        batches.close()


def test_the_log_records_each_checkpoint_where_it_was_saved(data, tmp_path):
    out = tmp_path / "out"
    assert train(data, out, max_steps=3) == 0
    (saved,) = records(out, "checkpoint")
    assert saved["step"] == 3 and saved["path"] == str(ckpt.checkpoint_path(out / "checkpoints", 3))
