"""scripts/slurm.sbatch's own logic, run by bash outside Slurm: squeue, scontrol, srun and python are fakes.

tests/test_slurm.py submits the script to a real Slurm; here each moment a signal can come, and each
failing Slurm query, is reached at will, in well under a second each. The fakes (written by `job`):
squeue answers the job's time limit and state, scontrol its node and `requeue` (which, as Slurm does,
then sends the batch script a TERM), srun runs nothing but sleeps as the step would (the health check
until stopped, or FAKE_HEALTH_CHECK_S; the trainer until a USR1 or TERM, which it "saves" on), and python
(the rendezvous store) sleeps until the script's SIGHUP ends it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from conftest import LAUNCH_TOKEN, REPO, kill_all, launched_processes, wait_until
from slowness import guard

pytestmark = pytest.mark.slow  # starts bash

FAKES = {
    "squeue": r"""
case "$*" in
    *%l*) [[ -z ${FAKE_SQUEUE_FAILS:-} ]] || { echo "slurm_load_jobs error: Unable to contact slurm controller" >&2; exit 1; }
          [[ ${FAKE_SIGNAL_AT:-} != squeue ]] || kill -USR1 "$(batch_pid)"
          echo "${FAKE_TIME_LIMIT:-1-00:00:00}"
          # an array's id names every task: Slurm answers for each (FAKE_ARRAY_TASKS of them)
          [[ " $* " != *" -j $SLURM_JOB_ID "* ]] || for ((i = 1; i < ${FAKE_ARRAY_TASKS:-1}; i++)); do
              echo "${FAKE_TIME_LIMIT:-1-00:00:00}"; done ;;
    *%T*) [[ -e $FAKE_DIR/requeued ]] && echo COMPLETING || echo "${FAKE_STATE:-RUNNING}" ;;
esac
""",
    "scontrol": r"""
case $1 in
    show) echo "NodeName=$3 Arch=x86_64 CoresPerSocket=1"; echo "   NodeAddr=127.0.0.1 NodeHostName=$3" ;;
    requeue) echo "requeue $2" >> "$FAKE_DIR/calls"; touch "$FAKE_DIR/requeued"
             kill -TERM "$(batch_pid)" ;;  # Slurm ends the requeued job's batch script
esac
""",
    "srun": r"""
echo "srun $*" >> "$FAKE_DIR/calls"
if [[ $* == *slurm_preflight.py* ]]; then
    touch "$FAKE_DIR/running-health-check"
    exec sleep "${FAKE_HEALTH_CHECK_S:-600}"
fi
trap 'echo "trainer: USR1, saved"; kill $sleeper; exit 0' USR1
trap 'echo "trainer: TERM, saved"; kill $sleeper; exit 0' TERM
sleep 600 &
sleeper=$!
touch "$FAKE_DIR/running-torchrun"
wait $sleeper
""",
    "torchrun": "exit 3  # srun runs it: never here\n",
    "python": "exec sleep 600  # the rendezvous store, which the script's SIGHUP must end\n",
}
# in every fake: the batch script's pid, which the test writes once bash has started
BATCH_PID = 'batch_pid() { until [[ -s $FAKE_DIR/batch.pid ]]; do sleep 0.01; done; cat "$FAKE_DIR/batch.pid"; }\n'


class Job:
    """slurm.sbatch started by bash as Slurm's batch step would start it, with the fakes first on PATH."""

    def __init__(self, folder: Path, **fake_env: str):
        self.folder = folder
        bin_dir = folder / "bin"
        bin_dir.mkdir(parents=True)
        for name, body in FAKES.items():
            (bin_dir / name).write_text("#!/bin/bash\n" + BATCH_PID + body)
        for path in bin_dir.iterdir():
            path.chmod(0o755)
        self.token = uuid.uuid4().hex
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_DIR": str(folder), LAUNCH_TOKEN: self.token,
               "SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n1", "SLURMD_NODENAME": "n1", "SLURM_JOB_NUM_NODES": "1",
               "GPUS_PER_NODE": "1", "CONFIG": "configs/demo.yaml", **fake_env}
        env.pop("SLURM_RESTART_COUNT", None)
        self.proc = subprocess.Popen(["bash", str(REPO / "scripts" / "slurm.sbatch"), "--max_steps", "4"], cwd=REPO,
                                     env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        (folder / "batch.pid").write_text(str(self.proc.pid))

    def wait_until_running(self, step: str) -> None:
        wait_until((self.folder / f"running-{step}").exists, self.proc, f"running-{step}", 30, report=self.finish)

    def finish(self) -> tuple[int, str, str]:
        """Its exit status, stdout and stderr, once it ends; a script that has not ended, or has left a process
        running, fails the test (and nothing of it is left running)."""
        try:
            out, err = self.proc.communicate(timeout=guard(20))
        except subprocess.TimeoutExpired:
            kill_all(launched_processes(self.token))
            out, err = self.proc.communicate()
            raise AssertionError(f"slurm.sbatch did not end\n{out}\n{err}") from None
        left = launched_processes(self.token)
        kill_all(left)
        assert not left, f"slurm.sbatch exited {self.proc.returncode} but left processes {left} running\n{out}\n{err}"
        return self.proc.returncode, out, err

    def calls(self) -> list[str]:
        path = self.folder / "calls"
        return path.read_text().splitlines() if path.exists() else []


def test_a_failed_squeue_is_one_line_saying_so(tmp_path):
    job = Job(tmp_path, FAKE_SQUEUE_FAILS="1")
    status, out, err = job.finish()
    assert status == 2 and err == ("error: squeue -h -j 5 -o %l failed: slurm_load_jobs error: Unable to contact "
                                   "slurm controller; cannot start the job without it (is slurmctld reachable?)\n")
    assert job.calls() == []  # nothing started


@pytest.mark.parametrize("signal_name,state,requeued", [
    ("USR1", "", True),  # the time limit is near: the next start resumes from the newest checkpoint
    ("TERM", "COMPLETING", False),  # scancel: the job ends
    ("TERM", "RUNNING", True),  # a preemption's grace period: the job goes on later
])
def test_a_signal_during_the_health_check_stops_it_and_requeues_or_ends_the_job(tmp_path, signal_name, state,
                                                                               requeued):
    """The health check may take longer than the minute before the USR1 that the --time check keeps."""
    job = Job(tmp_path, FAKE_STATE=state)
    job.wait_until_running("health-check")
    job.proc.send_signal(getattr(signal, f"SIG{signal_name}"))
    status, out, err = job.finish()
    assert status == 0 and err == "", (out, err)
    said = f"{signal_name}{f' (job {state})' if state else ''} before the trainer started: nothing to save; stopping " \
           "the health check"
    assert said in out, out
    assert ("requeued job 5" in out) == requeued and ("job 5 ends" in out) == (not requeued), out
    assert [call for call in job.calls() if "torchrun" in call or "requeue" in call] == (["requeue 5"] if requeued
                                                                                         else [])


def test_a_usr1_before_the_health_check_starts_requeues_the_job_without_starting_it(tmp_path):
    job = Job(tmp_path, FAKE_SIGNAL_AT="squeue")  # USR1 while the script reads its time limit
    status, out, err = job.finish()
    assert status == 0 and err == "", (out, err)
    assert "USR1 before the trainer started: nothing to save\n" in out.replace("\r", "") and "requeued job 5" in out
    assert job.calls() == ["requeue 5"]


def test_usr1_during_training_saves_requeues_and_says_so_though_slurm_then_ends_the_script(tmp_path):
    job = Job(tmp_path, FAKE_HEALTH_CHECK_S="0")
    job.wait_until_running("torchrun")
    job.proc.send_signal(signal.SIGUSR1)
    status, out, err = job.finish()
    assert status == 0 and err == "", (out, err)
    lines = [line.split("slurm.sbatch: ")[-1] for line in out.splitlines()]
    assert lines[-3:] == ["USR1: the time limit is near; asking the trainer to save a checkpoint", "trainer: USR1, saved",
                          "requeued job 5"], out
    assert job.calls()[-1] == "requeue 5"


def test_an_array_task_asks_and_requeues_itself_not_its_array(tmp_path):
    """ladder.py's rungs are the tasks of one array job, and a task's own id may be the array's, which names every
    task: squeue then answered with each task's time limit (the job failed at its start), and `scontrol requeue`
    would have requeued the whole array. The task is ARRAY_TASK to both."""
    job = Job(tmp_path, FAKE_HEALTH_CHECK_S="0", SLURM_ARRAY_JOB_ID="5", SLURM_ARRAY_TASK_ID="1", FAKE_ARRAY_TASKS="2")
    job.wait_until_running("torchrun")
    job.proc.send_signal(signal.SIGUSR1)
    status, out, err = job.finish()
    assert status == 0 and err == "", (out, err)
    assert job.calls()[-1] == "requeue 5_1" and out.rstrip().endswith("requeued job 5_1"), out


def test_signals_that_keep_coming_while_it_requeues_change_nothing_it_does(tmp_path):
    """Slurm TERMs the batch script of a job it has just requeued, and a scancel or a preemption may add more. Bash
    (5.2) that runs a trap while it parses a $(...) loses that command with 'unexpected EOF while looking for
    matching )': the 'requeued job' line went missing in a real Slurm so, and the requeue itself could have. The
    flood here, a thousand signals or more, also made bash crash mid-trap, leaving the rendezvous store running."""
    job = Job(tmp_path, FAKE_HEALTH_CHECK_S="0")
    job.wait_until_running("torchrun")
    job.proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + guard(20)
    while not (tmp_path / "requeued").exists() and time.monotonic() < deadline:
        pass  # no sleep: the storm must begin while the script still runs
    sent = 0
    while job.proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(ProcessLookupError):
            os.kill(job.proc.pid, (signal.SIGTERM, signal.SIGUSR1)[sent % 2])
            sent += 1
    status, out, err = job.finish()
    assert status == 0 and err == "", (sent, out, err)
    assert out.rstrip().endswith("requeued job 5") and job.calls()[-1] == "requeue 5", (sent, out)
