"""scripts/slurm.sbatch submitted to a real Slurm: two nodes of one CPU worker each.

`make test-slurm` (which CI runs after `make test`) installs Slurm where it is missing and runs
this file; `make test` leaves it out (the `slurm` marker). One cluster serves the module
(tests/slurm_cluster.py). Every interrupted job must end with the same losses and weights, bit
for bit, as the uninterrupted one.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, TINY_MODEL, TINY_VOCAB, kill_all, load_weights, processes_whose_environment, train_losses
from forked_ranks import free_port
from slurm_cluster import SlurmCluster, missing_commands
from training.checkpoint.folder import list_checkpoints
from runtime.logger import read_log

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 24
SCRIPT = Path(os.environ.get("SLURM_SBATCH_UNDER_TEST", REPO / "scripts" / "slurm.sbatch"))  # another script: to
# see which of these tests an older version of it fails


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = missing_commands()
    if missing:  # make test-slurm installs it first, and asks for these tests to run (REQUIRE_SLURM)
        message = f"Slurm is not installed ({', '.join(missing)} missing): run `make test-slurm`, which installs it"
        if os.environ.get("REQUIRE_SLURM"):
            pytest.fail(message)
        pytest.skip(message)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def data_options() -> dict:
    """conftest's `data` with long train shards: the jobs' runs read 2,048 tokens a step."""
    return dict(train_sizes=(60000, 60000))


def trainer_args(data: Path, out: Path, **overrides) -> list[str]:
    """configs/demo.yaml (the job's CONFIG) with the suite's tiny model: STEPS steps of 2,048 tokens, 8 micro-steps
    of 4 rows on each of the 2 ranks (about 0.1 s a step: a signal sent at one step lands a few steps later),
    checkpoints every 8 steps."""
    settings = dict(data_dir=data, out_dir=out, vocab_size=TINY_VOCAB, dtype="float32", max_steps=STEPS,
                    micro_batch_size=4, total_batch_size=2048, warmup_steps=4, checkpoint_interval=8,
                    eval_interval=0, val_tokens=1024, sample_interval=0, log_interval=1)
    settings.update(overrides)
    return [*TINY_MODEL, *(arg for key, value in settings.items() for arg in (f"--{key}", str(value)))]


def submit(cluster: SlurmCluster, out: Path, args: list[str], *options: str, **env: str) -> str:
    """sbatch scripts/slurm.sbatch as a user on a CPU partition would (one worker per node)."""
    job_env = {"CONFIG": "configs/demo.yaml", "GPUS_PER_NODE": "1", "OMP_NUM_THREADS": "1",
               "RDZV_PORT": str(free_port()), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               "PYTHONUNBUFFERED": "1", **env}
    out.mkdir(parents=True, exist_ok=True)
    return cluster.sbatch(SCRIPT, *args, env=job_env, cwd=REPO,
                          options=("--gpus-per-node=0", "--cpus-per-task=1", f"--output={out}.slurm-%j.out", *options))


def job_output(out: Path, job_id: str) -> str:
    path = Path(f"{out}.slurm-{job_id}.out")
    return path.read_text(errors="replace") if path.exists() else ""


def steps_logged(out: Path) -> list[int]:
    log = out / "log.jsonl"
    return [r["step"] for r in read_log(log) if r["kind"] == "train"] if log.exists() else []


def wait_for_step(cluster: SlurmCluster, out: Path, job_id: str, step: int) -> None:
    cluster.wait_until(lambda: any(s >= step for s in steps_logged(out)), 120,
                       f"step {step} in {out}/log.jsonl\n{job_output(out, job_id)[-3000:]}")


def finished(cluster: SlurmCluster, out: Path, job_id: str, timeout: float = 120) -> dict[str, str]:
    job = cluster.wait_for_job(job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"},
                               timeout)
    assert job["JobState"] == "COMPLETED", (job, job_output(out, job_id)[-5000:])
    return job


def assert_same_run(run: Path, reference: Path) -> None:
    assert steps_logged(run) == list(range(STEPS)), steps_logged(run)
    assert train_losses(run) == train_losses(reference)
    a, b = load_weights(run, STEPS), load_weights(reference, STEPS)
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def straight(cluster, data, tmp_path_factory) -> Path:
    """A two-node job that nothing interrupts: the reference."""
    out = tmp_path_factory.mktemp("straight") / "run"
    job_id = submit(cluster, out, trainer_args(data, out))
    STRAIGHT_JOB.update(finished(cluster, out, job_id))
    return out


STRAIGHT_JOB: dict[str, str] = {}


def test_a_two_node_job_trains_to_the_end(straight):
    text = job_output(straight, STRAIGHT_JOB["JobId"])
    assert steps_logged(straight) == list(range(STEPS))
    assert "world size 2" in text and "preflight: 2 node(s)" in text, text[-3000:]
    assert STRAIGHT_JOB["Restarts"] == "0"
    assert (straight / ".slurm-job").read_text() == f"{STRAIGHT_JOB['JobId']}\n"  # what a requeued start looks for
    assert "Traceback" not in text and "exit barrier" not in text, text[-5000:]  # the store outlived the agents


def test_usr1_before_the_time_limit_saves_requeues_and_resumes_bitwise(cluster, data, straight, tmp_path):
    out = tmp_path / "run"
    job_id = submit(cluster, out, trainer_args(data, out))
    wait_for_step(cluster, out, job_id, 3)
    cluster.run("scancel", "--signal=USR1", "--batch", job_id)  # what --signal=B:USR1@300 sends
    job = finished(cluster, out, job_id)
    text = job_output(out, job_id)
    assert job["Restarts"] == "1" and "requeued job" in text, text[-4000:]
    assert "SIGUSR1 received: saved step" in text and "resumed from" in text, text[-4000:]
    assert_same_run(out, straight)


def test_a_worker_killed_on_one_node_restarts_under_torchrun_on_both(cluster, data, straight, tmp_path):
    out = tmp_path / "run"
    job_id = submit(cluster, out, trainer_args(data, out))
    wait_for_step(cluster, out, job_id, 10)  # past the step-8 checkpoint
    (worker,) = processes_whose_environment(lambda env: env.get(b"SLURMD_NODENAME") == b"n2" and b"LOCAL_RANK" in env)
    kill_all([worker])  # node n2's GPU falls off the bus: torchrun (--max-restarts=3) restarts both
    job = finished(cluster, out, job_id)
    text = job_output(out, job_id)
    assert job["Restarts"] == "0" and "resumed from" in text, text[-4000:]
    assert_same_run(out, straight)


def test_scancel_saves_and_cancels_and_a_new_submission_resumes_bitwise(cluster, data, straight, tmp_path):
    out = tmp_path / "run"
    args = trainer_args(data, out)
    job_id = submit(cluster, out, args)
    wait_for_step(cluster, out, job_id, 3)
    cluster.run("scancel", job_id)
    job = cluster.wait_for_job(job_id, {"CANCELLED", "PENDING", "RUNNING", "COMPLETED", "FAILED"} - {"RUNNING"}, 60)
    time.sleep(2)  # a requeue would show by now
    job = cluster.job(job_id)
    text = job_output(out, job_id)
    assert job["JobState"] == "CANCELLED" and job["Restarts"] == "0", (job, text[-4000:])
    assert "SIGTERM received: saved step" in text, text[-4000:]
    saved = [step for step, _ in list_checkpoints(out / "checkpoints")]
    assert saved and 3 <= max(saved) < STEPS, saved

    again = submit(cluster, out, args)  # the same command
    finished(cluster, out, again)
    assert "resumed from" in job_output(out, again)
    assert_same_run(out, straight)


def test_a_time_limit_shorter_than_the_signal_lead_is_refused_at_once(cluster, data, tmp_path):
    out = tmp_path / "run"
    job_id = submit(cluster, out, trainer_args(data, out), "--time=5")  # 5 minutes: the USR1 lead is 300 s
    job = cluster.wait_for_job(job_id, {"FAILED", "COMPLETED", "CANCELLED"}, 60)
    text = job_output(out, job_id)
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert job["JobState"] == "FAILED" and job["ExitCode"] == "2:0" and job["Restarts"] == "0", (job, text)
    assert len(errors) == 1 and "--time of 300 s leaves 0 s before the USR1" in errors[0], text
    assert not (out / "log.jsonl").exists()


def test_a_failed_node_makes_slurm_requeue_and_the_job_resumes_bitwise(cluster, data, straight, tmp_path):
    out = tmp_path / "run"
    job_id = submit(cluster, out, trainer_args(data, out))
    wait_for_step(cluster, out, job_id, 10)  # past the step-8 checkpoint
    cluster.freeze_node("n2")  # n2 stops answering: its slurmd, slurmstepd, torchrun and worker
    cluster.wait_until(lambda: cluster.node_states().get("n2", "").startswith("down"), 60, "node n2 down")
    cluster.restart_node("n2")  # the node reboots and comes back (ReturnToService=2)
    job = finished(cluster, out, job_id, timeout=180)
    text = job_output(out, job_id)
    assert int(job["Restarts"]) >= 1 and "resumed from" in text, (job, text[-4000:])
    # the batch script did not try to requeue what Slurm had requeued already, nor fail on it
    assert not [line for line in text.splitlines() if line.startswith("error:") or "pending execution" in line], text
    assert_same_run(out, straight)


def test_a_ladder_trains_two_rungs_as_an_array_job(cluster, data, tmp_path):
    """ladder.py --launch slurm: its two rungs as one array job, a task each (CONFIG=.../%a.yaml, a rendezvous port
    each), on the two nodes at once; the same command again, once the job has ended, reads them and submits nothing."""
    import json
    import subprocess

    import yaml

    from slowness import guard

    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({
        "data_dir": str(data), "vocab_size": TINY_VOCAB, "block_size": 32, "seq_len": 32, "micro_batch_size": 16,
        "total_batch_size": 512, "max_steps": 20, "warmup_steps": 2, "eval_interval": 0, "val_tokens": 512,
        "hellaswag_interval": 0, "sample_interval": 0, "dtype": "float32", "log_interval": 1}))
    out = tmp_path / "ladder"
    command = [sys.executable, str(REPO / "ladder.py"), "--config", str(base), "--depths", "1", "2", "--flops",
               "1.6e9", "2.9e10", "--out", str(out), "--launch", "slurm",
               "--sbatch_args=--nodes=1 --gpus-per-node=0 --cpus-per-task=1"]
    # each task has one node: its health check meets no other node, and reads the folder's filesystem instead;
    # this cluster's nodes are processes of one machine, which share its /tmp (where the test's folders are)
    env = {**cluster.env, "GPUS_PER_NODE": "1", "OMP_NUM_THREADS": "1", "RDZV_PORT": str(free_port()),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONUNBUFFERED": "1",
           "NODE_LOCAL_DIRS": "/var/tmp"}
    first = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=guard(120))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    (job,) = json.loads((out / "slurm" / "jobs.json").read_text())
    assert job["rungs"] == ["d1_faithful_s1337", "d2_faithful_s1337"], job
    for task, rung in enumerate(job["rungs"]):
        state = cluster.wait_for_job(f"{job['job']}_{task}", {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 180)
        output = (out / "slurm" / "1" / f"{job['job']}_{task}.out").read_text(errors="replace")
        assert state["JobState"] == "COMPLETED", (state, output[-4000:])
        assert "preflight: 1 node(s)" in output and "Traceback" not in output, output[-3000:]
        assert steps_logged(out / rung) == list(range((6, 20)[task])), output[-3000:]

    again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=guard(120))
    assert again.returncode == 0 and "submitted" not in again.stdout, again.stdout[-3000:] + again.stderr[-3000:]
    rungs = json.loads((out / "ladder.json").read_text())["rungs"]
    assert [r["name"] for r in rungs if r["final"]] == job["rungs"]  # both read; the law needs a third budget
    assert "No fit" in (out / "ladder.md").read_text()
