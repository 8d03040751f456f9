"""Faults injected into real runs: each must lose nothing saved, never hang, and resume exactly.

Preemption (SIGTERM), a worker SIGKILLed under torchrun --max-restarts, damaged checkpoints, a
full disk, a NaN loss, and a checkpoint of another model size: bad input or a fault never loses
saved work or hangs, and resuming afterwards is exact.
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

import numpy as np
import pytest
import torch

from conftest import (GPT2_VOCAB, REPO, background, base_args, build_tiny_run, crashed_copy, kill_all,
                      launched_processes, load_weights, make_shards, run_trainer, signalled, start_trainer,
                      train_losses, untimed, train_loop, wait_for_step, wait_until)
from slowness import guard
from data.shards import shard_name, write_shard
from training.checkpoint.folder import list_checkpoints, load_checkpoint
from runtime.logger import read_log

STEPS = 12
ARGS = dict(max_steps=STEPS, checkpoint_interval=3, eval_interval=0, val_tokens=64)  # checkpoints 3, 6, 9, 12
PREEMPTIBLE = {**ARGS, "checkpoint_interval": 0}  # every checkpoint of such a run is a preemption's


@pytest.fixture(scope="module")
def data_options() -> dict:
    """conftest's `data` with longer train shards."""
    return dict(train_sizes=(6000, 5000, 8000))


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


def torchrun_cmd(args: list[str], *torchrun_args: str, script: str = "train_gpt2.py") -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *torchrun_args,
            str(REPO / script), *args]


def start_torchrun(args: list[str], *torchrun_args: str, step_pause: float = 0.0, extra_env: dict | None = None,
                   script: str = "train_gpt2.py"):
    """A 2-rank torchrun of the trainer (or of tests/inject_fault.py's, its faults set by extra_env) running in the
    background for a `with` block (conftest's background: what is left of it is killed at the block's end).

    step_pause: seconds rank 0 sleeps before every step (tests/inject_fault.py's FAULT=slow; the
    other rank waits for it in the step's all-reduce). A tiny run takes a few ms a step and can
    finish before a signal sent at step 3 reaches it; paused steps leave the signal time to land
    mid-run, and change no bit of the training.
    """
    env = {**env_for_workers(), **(extra_env or {})}
    if step_pause:
        env.update(slow_steps(step_pause))
        script = "tests/inject_fault.py"
    if script != "train_gpt2.py":
        env["PYTHONPATH"] = str(REPO)
    return background(torchrun_cmd(args, *torchrun_args, script=script), env)


def slow_steps(step_pause: float) -> dict[str, str]:
    """tests/inject_fault.py's environment for rank 0 to sleep step_pause seconds before every step."""
    return {"FAULT": "slow", "FAULT_RANK": "0", "FAULT_SLEEP": str(step_pause)}


def env_for_workers() -> dict:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


SIGNAL_PAUSE = 0.1  # step_pause for runs signalled mid-run: their 12 steps take over a second


def launcher_killed(proc: subprocess.Popen, sig: int) -> tuple[str, str]:
    """Send torchrun (start_torchrun's) sig, which ends it at once (SIGKILL, or a signal it does not handle); its
    workers must end within seconds of it (they are found by the launch's token: they are no longer its children).
    Their output. A worker still running fails the test, and is killed."""
    proc.send_signal(sig)
    deadline = time.time() + guard(10)
    while launched_processes(proc.token) and time.time() < deadline:
        time.sleep(0.05)
    left = launched_processes(proc.token)
    kill_all(left)
    assert not left, f"workers {left} outlived their killed launcher"
    return proc.communicate(timeout=guard(10))  # the pipes close when the workers are gone too


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


@pytest.mark.slow
def test_sigterm_checkpoints_at_the_next_step_and_resume_matches(data, straight, tmp_path):
    out = tmp_path / "preempted"
    args = base_args(data, out, **PREEMPTIBLE)
    with start_torchrun(args, step_pause=SIGNAL_PAUSE) as proc:
        wait_for_step(out, 3, proc)
        stdout, stderr = signalled(proc, signal.SIGTERM)  # what SLURM / the cloud sends to the launcher
    assert "SIGTERM received: saved step" in stdout, stdout + stderr
    # torchrun itself exits 1 and prints its SignalException, although both workers exited 0
    # after the checkpoint: docs/OPERATIONS.md's failure table says so
    assert proc.returncode == 1 and "SignalException" in stderr, (proc.returncode, stderr[-2000:])
    assert "torchrun itself exits 1" in (REPO / "docs" / "OPERATIONS.md").read_text()
    (saved,) = [s for s, _ in list_checkpoints(out / "checkpoints")]
    assert 3 < saved < STEPS  # the preemption's checkpoint, at the next step boundary
    run_trainer(args, nproc=2)  # the same command again
    assert_same_run(out, straight)


@pytest.mark.slow
def test_worker_killed_under_max_restarts_recovers_and_matches(data, straight, tmp_path):
    out = tmp_path / "killed"
    args = base_args(data, out, **ARGS)
    with start_torchrun(args, "--max-restarts=1", step_pause=SIGNAL_PAUSE) as proc:  # the kill lands mid-run
        wait_for_step(out, 7, proc)  # past the step-6 checkpoint
        workers = children(proc.pid)
        assert len(workers) == 2, workers
        os.kill(max(workers), signal.SIGKILL)  # a GPU falls off the bus
        stdout, stderr = proc.communicate(timeout=guard(180))
    assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
    assert "resumed from" in stdout
    assert_same_run(out, straight)


@pytest.mark.slow
def test_auto_resume_falls_back_past_damaged_checkpoints(data, straight, tmp_path):
    out = tmp_path / "damaged"
    args = base_args(data, out, **ARGS)
    crashed_copy(straight, out, last_checkpoint=9)  # checkpoints 3, 6, 9
    newest = out / "checkpoints" / "step_00000009.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated by a crash mid-copy
    (out / "checkpoints" / "step_00000006.pt").write_bytes(b"\x00" * 4096)  # garbage
    proc = run_trainer(args, nproc=2)
    assert "warning: skipping" in proc.stderr and "step_00000009.pt" in proc.stderr
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout
    assert_same_run(out, straight)


@pytest.mark.slow
def test_checkpoint_of_another_model_size_is_refused_by_name(data, straight, tmp_path):
    args = base_args(data, tmp_path / "other", resume=straight / "checkpoints" / "step_00000012.pt", **ARGS)
    args[args.index("--n_layer") + 1] = "3"
    proc = run_trainer(args, nproc=2, check=False)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1  # rank 0's, for both ranks
    assert "checkpoint has n_layer=2 but this run has n_layer=3" in lines[0]
    assert "from scratch in a new out_dir" in lines[0] and "resume=never" not in lines[0]  # a way out, not a circle
    assert proc.exitcodes == [2, 2]


@pytest.mark.slow
def test_full_disk_keeps_previous_checkpoint_and_the_run_resumes(data, straight, tmp_path):
    out = tmp_path / "full"
    args = base_args(data, out, **ARGS)
    crashed_copy(straight, out, last_checkpoint=3)
    before = (out / "checkpoints" / "step_00000003.pt").read_bytes()

    def small_files_only():  # files above 1 MB fail with EFBIG, as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    # rank 0, which prints the error for both, ends last (a slow teardown, until torchrun's SIGTERM after rank 1
    # has ended): that SIGTERM must not keep it from printing (issue 53)
    slow_exit = {"FAULT": "slow_exit", "FAULT_RANK": "0", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(torchrun_cmd(args, script="tests/inject_fault.py"), cwd=REPO,
                          env={**env_for_workers(), **slow_exit}, capture_output=True, text=True, timeout=guard(180),
                          preexec_fn=small_files_only)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]  # rank 0's, for both workers
    assert "step_00000006.pt: could not write checkpoint (File too large); earlier checkpoints are intact" in errors[0]
    # torchrun's failure report names each worker's error (its error file), and exits 1 itself
    assert proc.returncode == 1 and proc.stderr.count(f"traceback : {errors[0]}") >= 1, proc.stderr[-3000:]
    assert (out / "checkpoints" / "step_00000003.pt").read_bytes() == before
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000003.pt"]  # no temp file left
    run_trainer(args, nproc=2)
    assert_same_run(out, straight)


@pytest.mark.slow
def test_nan_loss_stops_before_the_update_and_keeps_the_last_good_checkpoint(data, straight, tmp_path):
    out = tmp_path / "nan"
    args = base_args(data, out, **ARGS)
    proc = run_trainer(args, nproc=2, check=False, script="tests/inject_fault.py",
                       extra_env={"FAULT": "nan", "FAULT_STEP": "7", "FAULT_RANK": "1"})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "step 7: loss nan" in errors[0], proc.stderr[-3000:]
    assert proc.exitcodes == [3, 3]
    assert [s for s, _ in list_checkpoints(out / "checkpoints")] == [3, 6]
    assert max(r["step"] for r in read_log(out / "log.jsonl") if r["kind"] == "train") == 6
    # the checkpoint is the last good state: resuming (without the fault) matches the straight run
    run_trainer(args, nproc=2)
    assert_same_run(out, straight)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_preemption_signals_only_set_a_flag(sig):
    from training.distributed.preemption import PreemptionFlag

    before = signal.getsignal(sig)
    flag = PreemptionFlag().install()
    try:
        assert not flag.requested
        os.kill(os.getpid(), sig)  # handled: the process keeps running
        assert flag.requested and flag.signal_name == sig.name
    finally:
        flag.restore()
    assert signal.getsignal(sig) is before  # the previous handler is back


@pytest.mark.parametrize("torchrun", [False, True])
def test_a_second_ctrl_c_raises_stop_now_and_torchruns_sigterm_after_one_counts_as_it(torchrun, monkeypatch):
    """In this process: a second SIGINT raises StopNow (a KeyboardInterrupt); under torchrun, whose second Ctrl-C
    reaches the workers as SIGTERM, a SIGTERM after a SIGINT does too. A SIGTERM alone, or before a SIGINT, is a
    preemption: it only sets the flag."""
    from training.distributed.preemption import PreemptionFlag, StopNow

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    if torchrun:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    flag = PreemptionFlag().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # a preemption first: no Ctrl-C yet
        os.kill(os.getpid(), signal.SIGINT)
        assert flag.signal_name == "SIGTERM"
        with pytest.raises(StopNow, match="stops at once: nothing was saved since the last checkpoint"):
            os.kill(os.getpid(), signal.SIGTERM if torchrun else signal.SIGINT)
            time.sleep(1)  # the handler runs in this thread, between bytecodes
        if not torchrun:
            os.kill(os.getpid(), signal.SIGTERM)  # outside torchrun a SIGTERM is a preemption, Ctrl-C or not
    finally:
        flag.restore()


# --- reproduced fault paths: each of these lost work, mixed runs or hung before it was fixed ------


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.mark.slow
def test_resuming_past_max_steps_is_a_clear_message_not_a_hang(data, straight, tmp_path):
    out = tmp_path / "done"
    crashed_copy(straight, out, last_checkpoint=STEPS)
    below = run_trainer(base_args(data, out, **{**ARGS, "max_steps": 5}), nproc=2, check=False, timeout=60)
    errors = error_lines(below.stderr)
    assert len(errors) == 1 and "max_steps: 5 is below step 12 of" in errors[0], below.stderr[-2000:]
    assert below.exitcodes == [2, 2]
    at = run_trainer(base_args(data, out, **ARGS), nproc=2, timeout=60)  # a requeued job that had finished
    assert "nothing to do" in at.stdout and "differ" not in at.stdout
    other_seed = run_trainer(base_args(data, out, **{**ARGS, "seed": 7}), nproc=2, timeout=60)  # meant a new run
    assert "nothing to do" in other_seed.stdout and "settings differ from that run's (seed 1234 -> 7)" in \
        other_seed.stdout and "new out_dir" in other_seed.stdout, other_seed.stdout[-2000:]
    assert_same_run(out, straight)  # the log and the final checkpoint are untouched


@pytest.mark.slow
def test_a_stop_in_the_last_step_leaves_the_final_evaluations_to_the_relaunch_and_only_them(data, straight, tmp_path):
    """A SIGTERM during the last step: the ranks save step 12 before its final evaluations, and the checkpoint says
    it is not finished. A relaunch stopped before they ran saves and amends nothing; the same command then runs
    them, and only them (no step, no train record twice), so the log ends with the val record of step 12 that the
    uninterrupted run logged, and the checkpoint carries that run's final figures, finished (once more, the
    command has nothing to do: test_resuming_past_max_steps_is_a_clear_message_not_a_hang)."""
    from training.distributed.preemption import PreemptionFlag
    from launch import resume

    out = tmp_path / "stopped"
    args = base_args(data, out, **ARGS)
    final = out / "checkpoints" / f"step_{STEPS:08d}.pt"
    stopped = run_trainer(args, nproc=2, script="tests/inject_fault.py",
                          extra_env={"FAULT": "signal", "FAULT_STEP": str(STEPS - 1), "FAULT_RANK": "1"})
    assert f"saved step {STEPS}; run the same command again to run the final evaluations" in stopped.stdout
    assert [r for r in read_log(out / "log.jsonl") if r["kind"] == "val"] == []  # eval_interval 0: only the final
    assert load_checkpoint(final)["finished_at"] is None

    cfg, ctx, run = build_tiny_run(data, out, **ARGS)  # in this process: a stop before the final evaluations
    said, flag = [], PreemptionFlag()
    flag.signal_name, ctx.logger.console = "SIGTERM", said.append
    before = final.read_bytes()
    train_loop(cfg, ctx, run, flag, record={})
    assert said[-1] == "SIGTERM received with no new step to save; run the same command again to run the final evaluations"
    assert final.read_bytes() == before

    relaunch = run_trainer(args, nproc=2)
    assert "its final evaluations were not run (a stop came first): running them" in relaunch.stdout
    assert f"recorded the final evaluations in {final}" in relaunch.stdout
    assert_same_run(out, straight)  # one train record per step, the same losses and weights
    log, reference = untimed(read_log(out / "log.jsonl")), untimed(read_log(straight / "log.jsonl"))
    assert log[-1] == [r for r in reference if r["kind"] == "val"][-1] and log[-1]["step"] == STEPS
    amended, finished = load_checkpoint(final), load_checkpoint(straight / "checkpoints" / final.name)
    assert amended["metrics"] == finished["metrics"] and amended["finished_at"] == finished["finished_at"] == STEPS
    assert resume.finished(amended)


@pytest.mark.slow
def test_a_fresh_start_never_mixes_with_the_run_in_out_dir(data, straight, tmp_path):
    out = tmp_path / "used"
    crashed_copy(straight, out, last_checkpoint=9)
    log_before = (out / "log.jsonl").read_bytes()
    proc = run_trainer(base_args(data, out, **{**ARGS, "resume": "never", "checkpoint_interval": 2}),
                       nproc=2, check=False, timeout=60)
    errors = error_lines(proc.stderr)
    assert len(errors) == 1 and "resume: " in errors[0] and "already holds a run" in errors[0], proc.stderr[-2000:]
    assert "--resume auto" in errors[0]
    assert [s for s, _ in list_checkpoints(out / "checkpoints")] == [3, 6, 9] and (out / "log.jsonl").read_bytes() == log_before


@pytest.mark.slow
def test_fallback_past_a_truncated_checkpoint_with_keep_last_1_keeps_what_it_writes(data, straight, tmp_path):
    out = tmp_path / "keep1"
    crashed_copy(straight, out, last_checkpoint=9)
    newest = out / "checkpoints" / "step_00000009.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    proc = run_trainer(base_args(data, out, **{**ARGS, "keep_last": 1}), nproc=2)
    assert "renamed it to step_00000009.pt.unreadable" in proc.stderr
    assert [s for s, _ in list_checkpoints(out / "checkpoints")] == [STEPS]
    assert_same_run(out, straight)


@pytest.mark.slow
def test_resume_path_repeated_by_a_requeue_continues_from_the_newest_descendant(data, straight, tmp_path):
    out = tmp_path / "branch"
    args = base_args(data, out, **{**ARGS, "resume": straight / "checkpoints" / "step_00000003.pt"})
    first = run_trainer(args[:-2] + ["--max_steps", "8"] + args[-2:], nproc=2)  # preempted at 8, say
    assert "resuming from" in first.stdout and "step_00000003.pt (resume)" in first.stdout
    again = run_trainer(args, nproc=2)  # the same arguments again, as a SLURM requeue repeats them
    assert f"resuming from {out / 'checkpoints' / 'step_00000008.pt'}" in again.stdout
    assert "continued from" in again.stdout
    assert [r["step"] for r in read_log(out / "log.jsonl") if r["kind"] == "train"] == list(range(3, STEPS))


@pytest.mark.slow
def test_changed_settings_and_data_on_resume_apply_and_are_named(data, straight, tmp_path):
    moved = tmp_path / "data"
    shutil.copytree(data, moved)
    write_shard(moved / shard_name("tiny", "train", 4), np.arange(2000, dtype=np.uint16) % 512)  # more data arrived
    out = tmp_path / "changed"
    crashed_copy(straight, out, last_checkpoint=9)
    proc = run_trainer(base_args(moved, out, **{**ARGS, "weight_decay": 0.5, "beta2": 0.5, "adam_eps": 1e-3,
                                                "seed": 7}), nproc=2)
    (warning,) = [line for line in proc.stderr.splitlines() if "differ from the checkpoint" in line]
    for change in ("weight_decay 0.1 -> 0.5", "beta2 0.95 -> 0.5", "adam_eps 1e-08 -> 0.001", "seed 1234 -> 7",
                   f"data_dir '{data}' -> '{moved}'"):
        assert change in warning
    (warning,) = [line for line in proc.stderr.splitlines() if "changed since" in line]
    assert f"the shards in {moved} changed since" in warning and "data fingerprint" in warning
    groups = torch.load(out / "checkpoints" / f"step_{STEPS:08d}.pt", weights_only=True)["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.5, 0.0]  # decay on the 2-D weights only
    assert all(g["betas"] == (0.9, 0.5) and g["eps"] == 1e-3 for g in groups)


@pytest.mark.slow
def test_rank_zero_write_failures_reach_every_rank_as_one_line(data, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    proc = run_trainer(base_args(data, blocker / "run", **ARGS), nproc=2, check=False, timeout=60)
    errors = error_lines(proc.stderr)
    assert len(errors) == 1, proc.stderr[-3000:]
    assert f"out_dir: cannot create {blocker / 'run'} (Not a directory)" in errors[0]
    assert proc.exitcodes == [2, 2] and "train_gpt2.py\", line" not in proc.stderr

    # a full disk: config.yaml (about 1.6 KB with these paths) and run.json fit in 2.5 KB; the log of 24
    # steps (about 200 bytes a step) outgrows it first, before the only checkpoint, at the end
    def small_files_only():
        resource.setrlimit(resource.RLIMIT_FSIZE, (2500, 2500))

    out = tmp_path / "full_log"
    full_log = {**ARGS, "checkpoint_interval": 0, "max_steps": 24}
    proc = subprocess.run(torchrun_cmd(base_args(data, out, **full_log)), cwd=REPO,
                          env=env_for_workers(), capture_output=True, text=True, timeout=guard(120), preexec_fn=small_files_only)
    errors = error_lines(proc.stderr)
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "log.jsonl: could not append a record (File too large)" in errors[0]
    assert "exitcode  : 1" in proc.stderr and "train_gpt2.py\", line" not in proc.stderr
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())


@pytest.mark.slow
def test_signal_during_an_eval_saves_right_after_it_and_skips_the_rest(tmp_path):
    """The stop is agreed before each eval and after the last one: no extra step, no sample.

    The ranks are forked (start_trainer) and each gets the SIGTERM that torchrun forwards to its
    workers; what torchrun itself does with the signal is the test above's."""
    data = make_shards(tmp_path / "shards", val_size=40000)
    out = tmp_path / "evals"
    # val (about 2 s) and a sample are due every 6 steps; the signal comes while step 5 ends or during val
    args = base_args(data, out, max_steps=STEPS, eval_interval=6, val_tokens=16384, sample_interval=6, vocab_size=GPT2_VOCAB,
                     sample_count=1, sample_tokens=4, checkpoint_interval=0, resume="never")
    with start_trainer(args, nproc=2) as proc:
        wait_for_step(out, 5, proc)
        stdout, stderr = signalled(proc, signal.SIGTERM)
    assert proc.returncode == 0, stderr[-3000:]
    assert "SIGTERM received: saved step 6; run the same command with --resume auto to resume" in stdout, stderr
    assert [s for s, _ in list_checkpoints(out / "checkpoints")] == [6]
    records = read_log(out / "log.jsonl")
    assert max(r["step"] for r in records if r["kind"] == "train") == 5
    assert not any(r["kind"] == "sample" and r["step"] == 6 for r in records)


@pytest.mark.slow
def test_a_torchrun_killed_at_start_up_or_mid_run_leaves_no_worker_running(data, straight, tmp_path):
    """torchrun killed at once (kill -9, or a SIGUSR1 outside its --signals-to-handle: it forwards nothing
    either way) leaves no worker running for more than seconds, whenever it comes. At start-up, while they
    import (before the trainer handles SIGTERM), they end with nothing to save; mid-run they take their
    parent-death signal (SIGTERM) for a preemption: the steps since the last checkpoint are saved, and the
    same command resumes exactly."""
    out = tmp_path / "orphans"
    args = base_args(data, out, **PREEMPTIBLE)
    with start_torchrun(args) as proc:
        wait_until(lambda: len(children(proc.pid)) >= 2, proc, "torchrun's 2 workers", 60)
        assert len(children(proc.pid)) == 2, proc.communicate()
        launcher_killed(proc, signal.SIGKILL)  # the workers have just started
    assert not (out / "checkpoints").exists()

    with start_torchrun(args, step_pause=SIGNAL_PAUSE) as proc:
        wait_for_step(out, 3, proc)
        stdout, stderr = launcher_killed(proc, signal.SIGUSR1)
    assert proc.returncode == -signal.SIGUSR1  # it died at once, forwarding nothing
    assert "SIGTERM received: saved step" in stdout, stdout[-2000:] + stderr[-2000:]
    (saved,) = [s for s, _ in list_checkpoints(out / "checkpoints")]
    assert 3 < saved < STEPS
    run_trainer(args, nproc=2)  # the same command again
    assert_same_run(out, straight)


@pytest.mark.slow
def test_an_empty_sample_prompt_samples_unconditionally_on_rank_zero(data, tmp_path):
    out = tmp_path / "unconditional"
    run_trainer(base_args(data, out, **{**ARGS, "max_steps": 2, "sample_interval": 2, "sample_count": 1, "vocab_size": GPT2_VOCAB,
                                        "sample_tokens": 4, "checkpoint_interval": 0}) + ["--sample_prompt", ""],
                nproc=2, timeout=120)
    (sample,) = [r for r in read_log(out / "log.jsonl") if r["kind"] == "sample"]
    assert sample["step"] == 2 and sample["text"].startswith("<|endoftext|>")


@pytest.mark.slow
def test_a_large_seed_with_dropout_trains_across_an_epoch_boundary(tmp_path):
    data = make_shards(tmp_path / "shards", train_sizes=(600, 700))  # 2 steps per epoch
    out = tmp_path / "seeded"
    run_trainer(base_args(data, out, max_steps=3, eval_interval=0, val_tokens=64, checkpoint_interval=0,
                          dropout=0.1, seed=5_000_000_000), timeout=120)
    assert sorted(train_losses(out)) == [0, 1, 2]


@pytest.mark.slow
def test_a_batch_one_rank_cannot_read_stops_every_rank_before_the_update(data, tmp_path):
    out = tmp_path / "unreadable_batch"
    args = base_args(data, out, **ARGS)
    proc = run_trainer(args, nproc=2, check=False, script="tests/inject_fault.py",
                       extra_env={"FAULT": "batch", "FAULT_STEP": "7", "FAULT_RANK": "1"})
    errors = error_lines(proc.stderr)
    assert errors == ["error: injected: rank 1 could not read step 7"], proc.stderr[-3000:]  # rank 0 prints rank 1's
    assert proc.exitcodes == [2, 2] and "train_gpt2.py\", line" not in proc.stderr
    assert max(r["step"] for r in read_log(out / "log.jsonl") if r["kind"] == "train") == 6
    assert [s for s, _ in list_checkpoints(out / "checkpoints")] == [3, 6]  # the last good state (resuming from it: the NaN test)


@pytest.mark.slow
def test_a_hung_rank_fails_the_run_within_the_hang_timeout(data, tmp_path):
    """After the first step a collective waits hang_timeout_minutes, not the 30 start-up minutes."""
    args = base_args(data, tmp_path / "hung", **{**ARGS, "hang_timeout_minutes": 0.1})
    started = time.time()
    proc = run_trainer(args, nproc=2, check=False, timeout=120, script="tests/inject_fault.py", grace=1,
                       extra_env={"FAULT": "hang", "FAULT_STEP": "1", "FAULT_RANK": "1"})
    assert proc.returncode != 0 and "Timed out waiting 6000ms" in proc.stderr, proc.stderr[-3000:]
    assert proc.exitcodes[0] == 1 and proc.exitcodes[1] == -9  # rank 0 gave up; the hung rank 1 was killed
    assert time.time() - started < guard(45)  # start-up, one step, the 6 s timeout, the teardown: not 30 minutes


# --- Ctrl-C (issue 44: it lost everything since the last checkpoint, all of the demo's 400 steps) -----------

def paused_from(step: int, seconds: float) -> dict[str, str]:
    """tests/inject_fault.py's environment for rank 0 to sleep `seconds` before step `step` and every later one:
    a run that reaches `step` at full speed, then leaves a signal sent just after step - 1 time to land in a step."""
    return {**slow_steps(seconds), "FAULT_STEP": str(step)}


def checkpoint_steps(out: Path) -> list[int]:
    return [s for s, _ in list_checkpoints(out / "checkpoints")] if (out / "checkpoints").exists() else []


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_at_the_next_step_like_sigterm(data, tmp_path):
    """`python train_gpt2.py`, one process (forked: tests/forked_ranks.py), Ctrl-C once: it says at once what it will do,
    stops at the next step boundary with a checkpoint, and exits 0. Before: exit 130, nothing saved."""
    out, mark = tmp_path / "ctrl-c", tmp_path / "step-4-paused"
    with start_trainer(base_args(data, out, **PREEMPTIBLE), script="tests/inject_fault.py",
                       extra_env={**paused_from(4, 0.5), "FAULT_MARK": str(mark)}) as proc:
        # step 4 is in its pause: not merely step 3 logged, which a loaded machine may signal before step 4 begins
        # (the flag then votes at step 4, and the save is step 5's)
        wait_until(mark.exists, proc, "step 4's pause")
        stdout, stderr = signalled(proc, signal.SIGINT)
    assert proc.returncode == 0, stderr[-3000:]
    assert "SIGINT received: saving a checkpoint after this step (Ctrl-C again stops at once, without saving)" \
        in stderr.splitlines()
    assert checkpoint_steps(out) == [6]  # set during step 4, the flag is voted at step 5's all-reduce
    assert "SIGINT received: saved step 6; run the same command again to resume" in stdout.splitlines()


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_and_says_that_nothing_was_saved(data, tmp_path):
    """The user who will not wait for the step and the save: the second Ctrl-C ends the process at once (its
    step 4 would pause 30 s), exit 130, saving nothing after the last checkpoint, and says so."""
    out = tmp_path / "twice"
    with start_trainer(base_args(data, out, **ARGS), script="tests/inject_fault.py",
                       extra_env=paused_from(4, 30.0)) as proc:
        wait_for_step(out, 3, proc)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
        started = time.monotonic()
        stdout, stderr = signalled(proc, signal.SIGINT, timeout=60)
        stopped_in = time.monotonic() - started
    assert proc.returncode == 130 and stopped_in < guard(10), (proc.returncode, stopped_in, stderr[-3000:])
    assert stderr.splitlines()[-1] == \
        "interrupted: a second SIGINT stops at once: nothing was saved since the last checkpoint"
    assert checkpoint_steps(out) == [3]
    assert max(r["step"] for r in read_log(out / "log.jsonl") if r["kind"] == "train") == 3


@pytest.mark.slow
def test_ctrl_c_twice_under_torchrun_stops_the_workers_at_once(data, tmp_path):
    """Under torchrun the terminal's Ctrl-C reaches torchrun alone (its workers run in sessions of their own).
    It forwards SIGINT to each worker (rank 0 says it will save at the next step boundary; with no second
    Ctrl-C they do, as for SIGTERM: torchrun then exits 1 with its SignalException). At a second Ctrl-C torchrun
    sends its workers SIGTERM and waits for them, up to 30 s: a worker that had a SIGINT takes that SIGTERM for
    the second Ctrl-C and stops at once, saving nothing. Before issue 44 the first Ctrl-C lost the steps."""
    out = tmp_path / "twice"
    with start_torchrun(base_args(data, out, **ARGS), script="tests/inject_fault.py",
                        extra_env=paused_from(4, 30.0)) as proc:
        wait_for_step(out, 3, proc)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)  # torchrun forwards it
        started = time.monotonic()
        stdout, stderr = signalled(proc, signal.SIGINT, timeout=60)
        assert time.monotonic() - started < guard(15)  # not after step 4's 30 s pause, nor torchrun's 30 s wait
    assert proc.returncode == 1 and "SignalException" in stderr  # torchrun's own
    assert stderr.count("SIGINT received: saving a checkpoint after this step") == 1, stderr[-3000:]  # rank 0's
    assert stderr.count("interrupted: a second Ctrl-C (torchrun's SIGTERM after its SIGINT) stops at once: "
                        "nothing was saved since the last checkpoint") == 1, stderr[-3000:]  # local rank 0's
    assert checkpoint_steps(out) == [3]
