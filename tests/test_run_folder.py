"""One run folder, one line of history: concurrent launches, another run's files, leftover temp files.

The trainer runs in this process (one rank, `train_gpt2.main` through run_cli as its __main__
does) where a second process is not the point; concurrent launches are real processes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, background, base_args, run_trainer, signalled, train_losses, train_here, wait_for_step
from common.errors import ConfigError
from training.checkpoint import folder as ckpt
from training.checkpoint.run_folder import LOCK_NAME, FolderLock

RUN = dict(max_steps=3, checkpoint_interval=3, eval_interval=0, val_tokens=64)


def train(data: Path, out: Path, capfd=None, **overrides) -> int:
    return train_here(base_args(data, out, **{**RUN, **overrides}))


def error_line(capfd) -> str:
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, lines
    return lines[0]


def test_a_copied_in_checkpoint_of_another_run_is_refused_and_nothing_changes(data, tmp_path, capfd):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    assert train(data, ours) == 0 and train(data, theirs, max_steps=6, checkpoint_interval=6) == 0
    shutil.copy(ckpt.checkpoint_path(theirs / "checkpoints", 6), ckpt.checkpoint_path(ours / "checkpoints", 6))
    log_before = (ours / "log.jsonl").read_bytes()
    capfd.readouterr()
    assert train(data, ours, max_steps=9) == 2
    message = error_line(capfd)
    assert f"resume: {ours} holds more than one run" in message and "step_00000006.pt" in message, message
    assert (ours / "log.jsonl").read_bytes() == log_before
    assert [s for s, _ in ckpt.list_checkpoints(ours / "checkpoints")] == [3, 6]


def test_resume_path_into_a_folder_of_a_third_run_is_refused(data, tmp_path, capfd):
    source, third = tmp_path / "source", tmp_path / "third"
    assert train(data, source) == 0
    assert train(data, third, checkpoint_interval=0, final_checkpoint="false") == 0  # a log, no checkpoint
    log_before = (third / "log.jsonl").read_bytes()
    capfd.readouterr()
    assert train(data, third, max_steps=6, resume=ckpt.checkpoint_path(source / "checkpoints", 3)) == 2
    message = error_line(capfd)
    assert "step_00000003.pt belongs to run" in message and f"but {third} holds run" in message, message
    assert (third / "log.jsonl").read_bytes() == log_before and not (third / "checkpoints").exists()


def test_resume_path_into_a_new_folder_and_again_continues_one_history(data, tmp_path):
    """The lineage check must not refuse the legitimate uses: fork into a new folder, requeue there."""
    source, fork = tmp_path / "source", tmp_path / "fork"
    assert train(data, source) == 0
    assert train(data, fork, max_steps=5, checkpoint_interval=5, resume=ckpt.checkpoint_path(source / "checkpoints", 3)) == 0
    assert train(data, fork, max_steps=6, checkpoint_interval=6, resume=ckpt.checkpoint_path(source / "checkpoints", 3)) == 0
    assert sorted(train_losses(fork)) == [3, 4, 5]
    run_ids = {json.loads((d / "run.json").read_text())["run_id"] for d in (source, fork)}
    assert len(run_ids) == 1


def test_temporaries_of_a_killed_save_are_removed_before_the_first_save(data, tmp_path, capfd):
    out = tmp_path / "out"
    assert train(data, out) == 0
    folder = out / "checkpoints"
    stale = folder / ".step_00000006.pt.tmp"
    stale.write_bytes(b"half a checkpoint")  # a writer SIGKILLed mid-save
    unrelated = folder / ".notes.tmp"
    unrelated.write_text("not ours")
    capfd.readouterr()
    assert train(data, out, max_steps=4, checkpoint_interval=0) == 0
    assert "removed what 1 interrupted checkpoint save(s) left: .step_00000006.pt.tmp" in capfd.readouterr().out
    assert not stale.exists() and unrelated.exists()
    assert sorted(p.name for p in folder.iterdir()) == [".notes.tmp", "step_00000003.pt", "step_00000004.pt"]


def test_the_lock_is_exclusive_and_dies_with_its_holder(tmp_path):
    warnings = []
    lock = FolderLock(tmp_path / "out", "out_dir", warnings.append)
    with pytest.raises(ConfigError, match=f"out_dir: {tmp_path / 'out'} is in use by another launch \\(pid {os.getpid()} "):
        FolderLock(tmp_path / "out", "out_dir", warnings.append)
    lock.release()
    assert not (tmp_path / "out").exists()  # it created the folder and left nothing in it
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from training.checkpoint.run_folder import FolderLock; "
                               f"lock = FolderLock({str(tmp_path / 'out')!r}, 'out_dir', print); print('locked', flush=True); "
                               "time.sleep(600)"], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(ConfigError, match=f"pid {holder.pid} on"):
        FolderLock(tmp_path / "out", "out_dir", warnings.append)
    holder.kill()  # a crashed run: the kernel drops its lock
    holder.wait()
    FolderLock(tmp_path / "out", "out_dir", warnings.append).release()
    assert (tmp_path / "out" / LOCK_NAME).exists() and warnings == []


def test_a_launch_that_loses_the_race_into_a_new_folder_removes_nothing_of_the_winners(tmp_path, monkeypatch):
    """Forced timing: launch A creates and locks the new out_dir just as launch B starts (B saw no folder, and
    A's mkdir comes first). B is refused and removes nothing; a third launch is refused while A holds it; A,
    which created the folder, removes it on release."""
    out = tmp_path / "new"
    real_mkdir, held = Path.mkdir, []

    def mkdir(self, *args, **kwargs):
        if self == out and not held:  # B's first look at the folder: A gets in first
            held.append(None)
            held[0] = FolderLock(out, "out_dir", print)
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(ConfigError, match=f"out_dir: {out} is in use by another launch \\(pid {os.getpid()} "):
        FolderLock(out, "out_dir", print)  # B
    monkeypatch.undo()
    (a,) = held
    assert a.created_folder and os.path.samestat(os.fstat(a._file.fileno()), os.stat(out / LOCK_NAME))
    with pytest.raises(ConfigError, match="is in use by another launch"):
        FolderLock(out, "out_dir", print)  # C
    a.release()
    assert not out.exists()


def test_a_launch_that_locks_the_lock_file_its_holder_just_removed_starts_over(tmp_path, monkeypatch):
    """Forced timing: launch C opens out_dir/.lock, then its holder A (which created the folder) releases and
    removes it, then C locks the file it opened. C must hold the lock on the file at the path, so that a launch
    D coming next is refused."""
    import fcntl

    out = tmp_path / "new"
    a = FolderLock(out, "out_dir", print)
    real_flock, released = fcntl.flock, []

    def flock(fd, operation):
        if not released:  # C's first flock: A's release comes between C's open and its lock
            released.append(a.release())
        return real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    c = FolderLock(out, "out_dir", print)
    monkeypatch.undo()
    assert os.path.samestat(os.fstat(c._file.fileno()), os.stat(out / LOCK_NAME))
    with pytest.raises(ConfigError, match="is in use by another launch"):
        FolderLock(out, "out_dir", print)  # D
    c.release()
    assert not out.exists()


@pytest.mark.slow
def test_a_second_launch_into_a_busy_folder_is_refused_and_the_first_goes_on(data, tmp_path):
    out = tmp_path / "busy"
    args = base_args(data, out, **{**RUN, "max_steps": 100_000, "checkpoint_interval": 0})
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    with background([sys.executable, str(REPO / "train_gpt2.py"), *args], env) as first:
        wait_for_step(out, 0, first, 60)
        second = run_trainer(args, check=False, timeout=120)
        assert second.returncode == 2, second.stderr[-2000:]
        assert second.stderr.strip() == (f"error: out_dir: {out} is in use by another launch (pid {first.pid} on "
                                          + second.stderr.split(f"pid {first.pid} on ", 1)[1].strip())
        stdout, _ = signalled(first, signal.SIGTERM)  # the first run is untouched: it saves and stops as usual
        assert first.returncode == 0 and "SIGTERM received: saved step" in stdout
    (saved,) = ckpt.list_checkpoints(out / "checkpoints")
    assert torch.load(saved[1], weights_only=True)["run_id"] == json.loads((out / "run.json").read_text())["run_id"]
