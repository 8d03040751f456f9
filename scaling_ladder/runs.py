"""A ladder's rungs run: each an ordinary run of train_gpt2.py from its own config, one after another (python,
torchrun) with the ladder's signals passed on, or submitted to Slurm; and a finished rung's final figures read."""

from __future__ import annotations

import getpass
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

from common.cpu_malloc import CPU_MALLOC
from common.errors import ConfigError, DataError, ReproError
from common.log_fields import BPB
from evals.run_comparison import run_figures
from launch.estimate import duration
from scaling_ladder.plan import REPO, Rung
from runtime.logger import LOG_NAME, read_log, write_text_file

TRAINER = REPO / "train_gpt2.py"
SBATCH = REPO / "scripts" / "slurm.sbatch"
METRICS = {"loss": "final val loss", "bpb": "final val bpb"}  # run_figures()'s names of a run's final figures
LOGGED = {"loss": "loss", "bpb": BPB}  # their fields in the final val record


class RungFailed(ReproError):
    """A rung's trainer failed; its own error line is above. The ladder's exit code is the trainer's."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def rung_environment() -> dict:
    """The environment a rung runs in: this one, and on a machine without CUDA the CPU's malloc settings."""
    return dict(os.environ) if torch.cuda.is_available() else {**CPU_MALLOC, **os.environ}


def finite(value) -> bool:
    """Whether a final figure is one the law can be fitted to: a number, neither NaN nor infinite (a log may hold
    either as json's NaN and Infinity, or as null)."""
    return isinstance(value, (int, float)) and math.isfinite(value)


def final_figures(rung: Rung, out: Path) -> dict[str, float | None] | None:
    """A finished rung's final val loss and bpb (evals/run_comparison.py reads them, and refuses inconsistent
    ones), each None where it is not finite (report() names it, and the fit leaves it out); None while its folder
    holds no val record at its max_steps."""
    folder = out / rung.name
    log = folder / LOG_NAME
    finals = [r for r in read_log(log) if r.get("kind") == "val" and r.get("step") == rung.max_steps] \
        if log.exists() else []
    if not finals:
        return None
    logged = {metric: finals[0][field] for metric, field in LOGGED.items() if field in finals[0]}
    if not all(finite(value) for value in logged.values()):  # run_figures() refuses NaN: read here
        return {metric: value if finite(value) else None for metric, value in logged.items()}
    figures = run_figures(folder)
    if figures.step != rung.max_steps:
        raise DataError(f"{folder}: its figures are of step {figures.step}, past the rung's max_steps "
                        f"{rung.max_steps}")
    return {metric: figures.metrics[name][0] for metric, name in METRICS.items() if name in figures.metrics}


def write_rung_config(rung: Rung, out: Path) -> Path:
    """OUT/configs/RUNG.yaml, the rung's complete config; one already there that says otherwise is refused (its run
    folder was trained with it)."""
    path = out / "configs" / f"{rung.name}.yaml"
    if path.exists():
        old = path.read_text()
        if old != rung.config:
            before, after = yaml.safe_load(old) or {}, yaml.safe_load(rung.config)
            key = next((k for k in after if before.get(k) != after[k]), "a key")
            raise ConfigError(f"{path}: rung {rung.name} was set up with other settings ({key}: "
                              f"{before.get(key)!r}, now {after.get(key)!r}), and {out / rung.name} holds that run: "
                              f"give another --out, or remove both to train it again")
        return path
    make_folder(path.parent)
    write_text_file(path, rung.config)
    return path


def make_folder(path: Path) -> None:
    """A folder of the ladder's --out, made with its parents where missing; one that cannot be (a file in the way,
    no permission) is one error line, as the trainer says of an out_dir."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out: cannot create {path} ({e.strerror or e})") from None


def rung_command(args, config: Path) -> list[str]:
    if args.launch == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={args.nproc_per_node}", str(TRAINER), "--config", str(config)]
    return [sys.executable, str(TRAINER), "--config", str(config)]


# Passed on to the running rung, once each. The signals the trainer stops at, taken as the trainer takes them (even
# where the ladder was started ignoring them, as a script's `&` ignores SIGINT): SIGINT (Ctrl-C), SIGTERM and SIGUSR1
# (a scheduler's warning), at which it saves its state after its step and exits (at a second SIGINT, at once).
STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
# And those that end a terminal's job, where the ladder was not started ignoring them (nohup's SIGHUP): the rung
# ends as it would have ended in the job
ENDS = (signal.SIGHUP, signal.SIGQUIT)


def run_rung(command: list[str], env: dict) -> tuple[int, str | None]:
    """Run a rung to its end: (its exit code, the name of the first signal the ladder was sent meanwhile, or None).

    The rung runs in a session of its own, as torchrun runs its workers, so that only the ladder signals it: a
    Ctrl-C in the terminal (which signals the ladder's process group) and `kill -INT` to the ladder's pid alike
    reach the rung once, through the ladder (STOPS, ENDS), as a Ctrl-C reaches a run in a terminal. Ctrl-Z stops
    the rung with the ladder, and `fg` goes on with both."""
    running: list[subprocess.Popen] = []
    received: list[tuple[int, bool]] = []  # each signal, and whether it was passed on at once (the rung running)

    def forward(signum, frame):
        received.append((signum, bool(running)))
        if running:
            running[0].send_signal(signum)

    def suspend(signum, frame):
        # SIGSTOP, not SIGTSTP: the kernel discards SIGTSTP sent to a process group with no parent in its session
        # (an orphaned one), as the rung's own session's is
        if running:
            running[0].send_signal(signal.SIGSTOP)
        os.kill(os.getpid(), signal.SIGSTOP)  # the shell sees its job stop; its SIGCONT goes on here
        if running:
            running[0].send_signal(signal.SIGCONT)

    handlers = {s: forward for s in STOPS}
    for s, handler in [*((s, forward) for s in ENDS), (signal.SIGTSTP, suspend)]:
        if signal.getsignal(s) != signal.SIG_IGN:
            handlers[s] = handler
    previous = {s: signal.signal(s, handler) for s, handler in handlers.items()}
    try:
        running.append(subprocess.Popen(command, cwd=REPO, env=env, start_new_session=True))
        for signum, passed in list(received):  # those that came while it started
            if not passed:
                running[0].send_signal(signum)
        code = running[0].wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return code, signal.Signals(received[0][0]).name if received else None


def train_rungs(args, rungs: list[Rung]) -> bool:
    """Launch each unfinished rung, one after another (python, torchrun); whether all finished (False: stopped). A
    signal to the ladder stops the rung (run_rung), and the ladder: a KeyboardInterrupt, one `interrupted` line."""
    env = rung_environment()
    todo = [r for r in rungs if final_figures(r, args.out) is None]
    for number, rung in enumerate(todo, 1):
        config = write_rung_config(rung, args.out)
        resuming = (args.out / rung.name / LOG_NAME).exists()
        print(f"ladder: rung {number}/{len(todo)}{' (resuming)' if resuming else ''}: {rung.name}, {rung.params:,} "
              f"parameters, {rung.tokens:,} tokens, {rung.flops:.3e} FLOPs", flush=True)
        command = rung_command(args, config)
        print(" ".join(map(shlex.quote, command)), flush=True)
        start = time.monotonic()
        code, signalled = run_rung(command, env)
        finished = final_figures(rung, args.out) is not None
        if signalled:
            what = ("finished" if finished else "saved its state") if code == 0 else \
                f"stopped at once ({TRAINER.name} exited {code}; its last checkpoint stands)"
            raise KeyboardInterrupt(f"{signalled}: the ladder stopped in rung {rung.name}, which {what}: the same "
                                    f"command resumes the ladder")
        if code != 0:
            raise RungFailed(f"rung {rung.name}: train_gpt2.py exited {code} (its error is above; "
                             f"{args.out / rung.name}): the same command resumes the ladder from there", code)
        if not finished:  # the rung alone was stopped (a signal to its own pid)
            print(f"ladder: stopped in rung {rung.name}, which saved its checkpoint; the same command resumes it",
                  flush=True)
            return False
        print(f"ladder: {rung.name} trained in {duration(time.monotonic() - start)}", flush=True)
    return True


def slurm(command: list[str], env: dict | None = None) -> str:
    """A Slurm command's output; its failure is one error line."""
    try:
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    except FileNotFoundError:
        raise ConfigError(f"--launch: {command[0]} is not on PATH (launch Slurm rungs where Slurm's commands are)") \
            from None
    if proc.returncode != 0:
        raise ReproError(f"{command[0]} exited {proc.returncode}: {' '.join(proc.stderr.split())}")
    return proc.stdout


def submit_rungs(args, rungs: list[Rung]) -> None:
    """--launch slurm / slurm-jobs: submit the unfinished rungs, unless the ladder's earlier jobs are still queued
    or running; record the jobs in OUT/slurm/jobs.json, and return."""
    jobs_file = args.out / "slurm" / "jobs.json"
    jobs = json.loads(jobs_file.read_text()) if jobs_file.exists() else []
    queued = slurm(["squeue", "-h", "-u", getpass.getuser(), "-o", "%F"]).split()  # array tasks by their job's id
    if waiting := [job["job"] for job in jobs if job["job"] in queued]:
        print(f"ladder: job(s) {', '.join(waiting)} still queued or running; run this command again when they end")
        return
    todo = [r for r in rungs if final_figures(r, args.out) is None]
    folder = args.out / "slurm" / str(len(jobs) + 1)  # this submission's task configs and job outputs
    make_folder(folder)
    options = shlex.split(args.sbatch_args)
    if args.launch == "slurm":  # one array job: task i's CONFIG is folder/i.yaml (slurm.sbatch reads %a as i)
        for index, rung in enumerate(todo):
            write_text_file(folder / f"{index}.yaml", write_rung_config(rung, args.out).read_text())
        submissions = [(["--array", f"0-{len(todo) - 1}", f"--output={folder}/%A_%a.out"], folder / "%a.yaml", todo)]
    else:
        submissions = [([f"--output={folder}/{r.name}-%j.out"], write_rung_config(r, args.out), [r]) for r in todo]
    for own, config, members in submissions:
        output = slurm(["sbatch", "--parsable", *own, *options, str(SBATCH)], {**os.environ, "CONFIG": str(config)})
        job = output.strip().split(";")[0]
        jobs.append({"job": job, "rungs": [r.name for r in members]})
        write_text_file(jobs_file, json.dumps(jobs, indent=2) + "\n")
        print(f"ladder: submitted job {job}: {', '.join(r.name for r in members)}", flush=True)
    print("ladder: run this command again when the job(s) end: finished rungs are read, unfinished ones submitted "
          "again (they resume)")

