"""Start the trainer's ranks for a test by forking a warm process, with the environment torchrun gives.

A trainer process spends seconds before its first step on imports alone (torch, then
torch._dynamo, which torch.optim imports on first use), and torchrun adds an agent process
that imports torch too. The suite launches the trainer a few hundred times, so here the
ranks are forked from a forkserver that has imported those modules once (tests/rank_preload.py;
it runs no torch op, so forking it is safe). Each rank gets what torchrun gives a worker: RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT and the rest, its own stdout and stderr (file
descriptors 1 and 2, so C-level output is kept), and runs `target(argv)` through
errors.run_cli as the script's __main__ does. The trainer code runs unchanged; what torchrun itself does (its agent, restarts,
signal forwarding, its failure report) is tested through real torchrun launches.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from slowness import guard

REPO = Path(__file__).resolve().parents[1]
# Imported once in the forkserver: what every rank would otherwise import itself, then gc.freeze().
PRELOAD = ["rank_preload"]
GRACE_S = 10.0  # after one rank fails, how long the others get to end on their own before they are killed (guard()ed)

_context = None


def forkserver() -> multiprocessing.context.BaseContext:
    """This process's forkserver context, its preloads set before the server first starts."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
        # Python 3.11's forkserver ignores this process's sys.path (3.12's applies it) and skips a preload
        # it cannot import: it starts here, with the folders PRELOAD needs on its PYTHONPATH.
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), *([saved] if saved else [])])
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            os.environ.pop("PYTHONPATH") if saved is None else os.environ.update(PYTHONPATH=saved)
    return _context


@dataclass
class Launched:
    """What a launch did, shaped like subprocess.CompletedProcess for the tests."""

    args: list[str]
    returncode: int  # 0 if every rank exited 0, else the first non-zero exit code in rank order
    stdout: str  # the ranks' outputs, rank 0 first
    stderr: str
    exitcodes: list[int] = field(default_factory=list)  # per rank; -9 for a rank killed after the others failed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(rank: int, nproc: int, port: int) -> dict[str, str]:
    """What torchrun --standalone puts in a worker's environment (not its agent's store variables,
    which tell the trainer it runs under a real torchrun agent)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc),
            "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}


def run_rank(target: str, argv: list[str], env: dict[str, str], stdout: str, stderr: str, cwd: str,
             script: str) -> None:
    """A rank's body, in the forked child: its files, environment and signals, then target through run_cli."""
    for fd, path in ((1, stdout), (2, stderr)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(handle, fd)
        os.close(handle)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)
    os.chdir(cwd)
    os.environ.clear()  # the caller's environment at the launch, not the forkserver's from its start
    os.environ.update(env)
    sys.argv = [script, *argv]
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    from common.errors import run_cli

    module, function = target.split(":")
    main = getattr(importlib.import_module(module), function)
    try:
        code = run_cli(main, argv)
    finally:
        # A script's process runs its atexit handlers as it ends; a forked rank ends in os._exit, which
        # skips them. wandb removes its temp folders ($TMPDIR/tmp*wandb-media, tmp*wandb-artifacts) in one.
        atexit._run_exitfuncs()
    sys.exit(code)


class Started:
    """A launch's ranks while they run, shaped like subprocess.Popen for the tests: poll(), send_signal()
    (to every rank still running, as torchrun's agent forwards a signal it handles: SIGTERM, SIGINT) and
    communicate(); finish() gives the Launched. A `with` block kills what still runs at its end."""

    def __init__(self, argv: list[str], script: str, procs: list, outputs: list[tuple[str, str]],
                 folder: tempfile.TemporaryDirectory, grace: float):
        self.args, self.procs, self.outputs, self.folder, self.grace = [script, *argv], procs, outputs, folder, grace
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """None while a rank runs; then the launch's return code (Launched.returncode)."""
        if any(p.exitcode is None for p in self.procs):
            return None
        self.returncode = next((p.exitcode for p in self.procs if p.exitcode != 0), 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        for p in self.procs:
            if p.exitcode is None:
                os.kill(p.pid, sig)

    def finish(self, timeout: float) -> Launched:
        """Wait until every rank ended (`timeout` seconds as given, not guard()ed; then every rank is
        killed and AssertionError raised), read their outputs and remove their folder."""
        try:
            killed = wait_for(self.procs, timeout, self.grace)
            texts = [(read(out), read(err)) for out, err in self.outputs]
        finally:
            self.close()
        stdout, stderr = "".join(t[0] for t in texts), "".join(t[1] for t in texts)
        if killed == "timeout":
            raise AssertionError(f"{' '.join(self.args)} did not finish in {timeout:.0f} s (killed)\n"
                                 f"{stdout[-3000:]}\n{stderr[-5000:]}")
        return Launched(self.args, self.poll(), stdout, stderr, [p.exitcode for p in self.procs])

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Popen.communicate: timeout in seconds as given; None, the reference machine's 300 s guard()ed."""
        launched = self.finish(guard(300) if timeout is None else timeout)
        return launched.stdout, launched.stderr

    def close(self) -> None:
        for p in self.procs:
            if p.exitcode is None:
                p.kill()
                p.join()
        self.folder.cleanup()

    def __enter__(self) -> Started:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start(argv: list[str], nproc: int | None = None, *, target: str = "train_gpt2:main", extra_env: dict | None = None,
          cwd: Path = REPO, grace: float | None = None) -> Started:
    """Start target(argv) as `python SCRIPT argv` (nproc None) or as torchrun's nproc workers would, and return.

    The ranks see this process's environment, with extra_env on top. A rank that fails leaves the
    others `grace` seconds to end (they may be waiting for it in a collective; default GRACE_S,
    guard()ed), then they are killed, as torchrun tears a failed group down.
    """
    grace = guard(GRACE_S) if grace is None else grace
    script = target.split(":")[0].replace(".", "/") + ".py"
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    ranks = range(nproc or 1)
    folder = tempfile.TemporaryDirectory(prefix="launch-")
    outputs = [(os.path.join(folder.name, f"{r}.out"), os.path.join(folder.name, f"{r}.err")) for r in ranks]
    procs = []
    for rank, (out, err) in zip(ranks, outputs):
        rank_env = {**env, **(rank_environment(rank, nproc, port) if nproc else {})}
        procs.append(forkserver().Process(target=run_rank, args=(target, argv, rank_env, out, err, str(cwd), script),
                                          name=f"rank{rank}", daemon=True))
        procs[-1].start()
    return Started(argv, script, procs, outputs, folder, grace)


def launch(argv: list[str], nproc: int | None = None, *, target: str = "train_gpt2:main", extra_env: dict | None = None,
           timeout: float = 300, cwd: Path = REPO, grace: float | None = None) -> Launched:
    """start(), then wait for the ranks to end: they must in `timeout` seconds on the reference machine
    (a hang guard: guard() scales it to this one), or they are killed and AssertionError raised."""
    return start(argv, nproc, target=target, extra_env=extra_env, cwd=cwd, grace=grace).finish(guard(timeout))


def read(path: str) -> str:
    """A rank's output file; empty if the rank died before it opened it."""
    try:
        return Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return ""


def wait_for(procs: list, timeout: float, grace: float) -> str | None:
    """Wait until every process ended; "timeout" if they had to be killed for it, else None."""
    deadline = time.monotonic() + timeout
    failed_at = None
    while True:
        alive = [p for p in procs if p.exitcode is None]
        if not alive:
            return None
        now = time.monotonic()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = now
        if now >= deadline or (failed_at is not None and now - failed_at >= grace):
            for p in alive:
                p.kill()
            for p in alive:
                p.join()
            return "timeout" if now >= deadline else None
        until = deadline if failed_at is None else min(deadline, failed_at + grace)
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=max(until - now, 0.01))
