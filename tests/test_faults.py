"""Faults injected into real runs: each must lose nothing saved, never hang, and resume exactly.

Preemption (SIGTERM), a worker SIGKILLed under torchrun --max-restarts, damaged checkpoints, a
full disk, a NaN loss, and a checkpoint of another model size (DESIGN.md properties 3, 6, 7).
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, base_args, load_weights, make_shards, run_trainer, train_losses
from training.checkpoint import list_checkpoints
from training.run_logger import read_log

STEPS = 24
ARGS = dict(max_steps=STEPS, checkpoint_interval=5, eval_interval=0, val_tokens=64)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("faults") / "shards", train_sizes=(6000, 5000, 8000))


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory) -> Path:
    """The uninterrupted 2-rank reference run."""
    out = tmp_path_factory.mktemp("straight")
    run_trainer(base_args(data, out, **ARGS), nproc=2)
    return out


def assert_same_run(run: Path, reference: Path) -> None:
    """Bitwise-equal losses for every step (one record each) and bitwise-equal final weights."""
    steps = [r["step"] for r in read_log(run / "log.jsonl") if r["kind"] == "train"]
    assert steps == list(range(STEPS)), steps
    assert train_losses(run) == train_losses(reference)
    a, b = load_weights(run, STEPS), load_weights(reference, STEPS)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def torchrun_cmd(args: list[str], *torchrun_args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *torchrun_args,
            str(REPO / "train_gpt2.py"), *args]


def env_for_workers() -> dict:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (out / "log.jsonl").exists() and any(
                r.get("kind") == "train" and r["step"] >= step for r in read_log(out / "log.jsonl")):
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early: {proc.communicate()}")
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def children(pid: int) -> list[int]:
    """Processes whose parent is pid (torchrun's workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def test_sigterm_checkpoints_at_the_next_step_and_resume_matches(data, straight, tmp_path):
    out = tmp_path / "preempted"
    args = base_args(data, out, **ARGS)
    proc = subprocess.Popen(torchrun_cmd(args), cwd=REPO, env=env_for_workers(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(out, 6, proc)
    proc.send_signal(signal.SIGTERM)  # what SLURM / the cloud sends to the launcher
    stdout, stderr = proc.communicate(timeout=120)
    assert "SIGTERM received: saved step" in stdout, stdout + stderr
    saved = [s for s, _ in list_checkpoints(out)]
    assert saved[-1] not in (5, 10, 15, 20) and 6 < saved[-1] < STEPS  # an off-interval, preemption checkpoint
    run_trainer(args, nproc=2)  # the same command again
    assert_same_run(out, straight)


def test_worker_killed_under_max_restarts_recovers_and_matches(data, straight, tmp_path):
    out = tmp_path / "killed"
    args = base_args(data, out, **ARGS)
    proc = subprocess.Popen(torchrun_cmd(args, "--max-restarts=1"), cwd=REPO, env=env_for_workers(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(out, 12, proc)  # past the step-10 checkpoint
    workers = children(proc.pid)
    assert len(workers) == 2, workers
    os.kill(max(workers), signal.SIGKILL)  # a GPU falls off the bus
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
    assert "resumed from" in stdout
    assert_same_run(out, straight)


def crashed_copy(straight: Path, out: Path, last_checkpoint: int) -> None:
    """The reference run's folder as if the run had died just after checkpoint `last_checkpoint`."""
    shutil.copytree(straight, out)
    for step, path in list_checkpoints(out):
        if step > last_checkpoint:
            path.unlink()


def test_auto_resume_falls_back_past_damaged_checkpoints(data, straight, tmp_path):
    out = tmp_path / "damaged"
    args = base_args(data, out, **ARGS)
    crashed_copy(straight, out, last_checkpoint=15)  # checkpoints 5, 10, 15
    newest = out / "checkpoints" / "step_00000015.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated by a crash mid-copy
    (out / "checkpoints" / "step_00000010.pt").write_bytes(b"\x00" * 4096)  # garbage
    proc = run_trainer(args, nproc=2)
    assert "warning: skipping" in proc.stderr and "step_00000015.pt" in proc.stderr
    assert "resumed from" in proc.stdout and "at step 5" in proc.stdout
    assert_same_run(out, straight)


def test_checkpoint_of_another_model_size_is_refused_by_name(data, straight, tmp_path):
    args = base_args(data, tmp_path / "other", resume=straight / "checkpoints" / "step_00000024.pt", **ARGS)
    args[args.index("--n_layer") + 1] = "3"
    proc = run_trainer(args, nproc=2, check=False)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 2  # one per rank
    assert "checkpoint has n_layer=2 but this run has n_layer=3" in lines[0]
    assert "exitcode  : 2" in proc.stderr


def test_full_disk_keeps_previous_checkpoint_and_the_run_resumes(data, straight, tmp_path):
    out = tmp_path / "full"
    args = base_args(data, out, **ARGS)
    crashed_copy(straight, out, last_checkpoint=5)
    before = (out / "checkpoints" / "step_00000005.pt").read_bytes()

    def small_files_only():  # files above 1 MB fail with EFBIG, as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    proc = subprocess.run(torchrun_cmd(args), cwd=REPO, env=env_for_workers(), capture_output=True, text=True,
                          timeout=180, preexec_fn=small_files_only)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2, proc.stderr[-3000:]
    assert "step_00000010.pt: could not write checkpoint (File too large); earlier checkpoints are intact" in errors[0]
    assert (out / "checkpoints" / "step_00000005.pt").read_bytes() == before
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000005.pt"]  # no temp file left
    run_trainer(args, nproc=2)
    assert_same_run(out, straight)


def test_nan_loss_stops_before_the_update_and_keeps_the_last_good_checkpoint(data, straight, tmp_path):
    out = tmp_path / "nan"
    args = base_args(data, out, **ARGS)
    proc = run_trainer(args, nproc=2, check=False, script="tests/inject_nan.py",
                       extra_env={"NAN_STEP": "7", "NAN_RANK": "1", "GRAD_ACCUM": "2"})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and "step 7: loss nan" in errors[0], proc.stderr[-3000:]
    assert "exitcode  : 3" in proc.stderr
    assert [s for s, _ in list_checkpoints(out)] == [5]
    assert max(r["step"] for r in read_log(out / "log.jsonl") if r["kind"] == "train") == 6
    # the checkpoint is the last good state: resuming (without the fault) matches the straight run
    run_trainer(args, nproc=2)
    assert_same_run(out, straight)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_preemption_signals_only_set_a_flag(sig):
    from training.preemption import PreemptionFlag

    before = signal.getsignal(sig)
    flag = PreemptionFlag().install()
    try:
        assert not flag.requested
        os.kill(os.getpid(), sig)  # handled: the process keeps running
        assert flag.requested and flag.signal_name == sig.name
    finally:
        flag.restore()
    assert signal.getsignal(sig) is before  # the previous handler is back
