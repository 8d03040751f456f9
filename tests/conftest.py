"""Shared fixtures: tiny token shards, a tiny model config, and a trainer launcher.

Tests never touch the network: corpora are generated here. Multi-process runs go through
`python -m torch.distributed.run` (torchrun) on the gloo backend, as a user would launch them.
"""

from __future__ import annotations

import contextlib
import getpass
import multiprocessing
import multiprocessing.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

import slowness
from common.errors import run_cli
from data.shards import shard_name, write_shard
from forked_ranks import Started, launch, start
from slowness import guard

REPO = Path(__file__).resolve().parents[1]


# The test run: its hang guards scaled to this machine (tests/slowness.py), and a $TMPDIR of its own
# that must be empty at the end, as must the working tree be of new files.
RUN_TMPDIR = "GPT2_REPRO_TEST_TMPDIR"  # a test run's $TMPDIR; a run inside it (gpu_check's) leaves the working tree to it


def inductor_folder() -> str:
    """The name of Inductor's cache folder in $TMPDIR, made as torch._inductor.runtime.cache_dir_utils does
    (importing it costs seconds)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError, ModuleNotFoundError):
        user = f"uid_{os.getuid()}"
    return "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)


# pytest's basetemp (tmp_path), torchrun's log folders (PET_LOG_DIR), and Inductor's cache (a link, see below)
EXPECTED = ("pytest", "torchrun", inductor_folder())


@dataclass
class RunFiles:
    tmpdir: str  # this run's $TMPDIR
    tree: set[str] | None  # the working tree's untracked and ignored entries at the start (None: not checked)
    left: list[str] = field(default_factory=list)  # what the tests left behind, found at the end
    kept: bool = False  # the run failed: its basetemp stays


RUN_FILES = pytest.StashKey[RunFiles]()


@pytest.hookimpl(tryfirst=True)  # before pytest-timeout reads its per-test limit and tmpdir its basetemp
def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the process that runs pytest (xdist's controller, or the only one)
        if slowness.ENV not in os.environ:
            # pytest-xdist's -n (already resolved from "auto"): workers that share a core run slower
            workers = config.getoption("numprocesses", None) if config.getoption("dist", "no") != "no" else None
            os.environ[slowness.ENV] = str(slowness.calibrate(workers or 1))
        config.stash[RUN_FILES] = start_private_tmpdir(config)
    else:  # an xdist worker: its in-process torch work gets one thread, as each launched rank does
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(config.workerinput["workercount"])))
    # pyproject.toml's per-test limit is for the reference machine; an explicit --timeout or PYTEST_TIMEOUT is kept
    if config.getoption("timeout", None) is None and "PYTEST_TIMEOUT" not in os.environ:
        try:
            base = float(config.getini("timeout") or 0)
        except ValueError:  # pytest-timeout is not installed
            base = 0
        if base > 0:
            config.option.timeout = guard(base)


def inherited_signals() -> tuple[frozenset, frozenset]:
    """(ignored, blocked): what a process started now inherits of this one's signals (exec resets a handler,
    but keeps SIG_IGN and the mask)."""
    ignored = frozenset(s for s in signal.valid_signals() if signal.getsignal(s) is signal.SIG_IGN)
    return ignored, frozenset(signal.pthread_sigmask(signal.SIG_BLOCK, []))


@pytest.fixture(autouse=True)
def signals_left_as_found():
    """A test that leaves this process ignoring or blocking a signal fails, and the signal is restored: every
    later test on the worker would start its processes with it (a bash script ignoring SIGTERM cannot trap it,
    so slurm.sbatch's tests hung after scripts/rendezvous_store.py's import ignored it)."""
    before = inherited_signals()
    yield
    ignored, blocked = inherited_signals()
    if (ignored, blocked) != before:
        for sig in ignored - before[0]:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, before[1])
        names = sorted(signal.Signals(s).name for s in (ignored ^ before[0]) | (blocked ^ before[1]))
        pytest.fail(f"the test changed whether this process ignores or blocks {', '.join(names)}, which every "
                    f"process it starts later would inherit")


def start_private_tmpdir(config) -> RunFiles:
    """$TMPDIR/gpt2-repro-tests-XXXX for this run: the xdist workers (started later) and every process
    they launch inherit it; pytest's basetemp is in it, and torchrun's log folders (which torch never
    deletes). Outermost, it notes the working tree's files (a run inside another leaves that to it)."""
    original = tempfile.gettempdir()
    private = tempfile.mkdtemp(prefix="gpt2-repro-tests-")
    # Inductor keeps compiled kernels and precompiled headers in $TMPDIR/torchinductor_$USER to reuse them
    # across runs (the headers there even when TORCHINDUCTOR_CACHE_DIR says otherwise): a link keeps them there
    cache = os.path.join(original, EXPECTED[2])
    os.makedirs(cache, exist_ok=True)
    os.symlink(cache, os.path.join(private, EXPECTED[2]))
    tree = working_tree_files() if RUN_TMPDIR not in os.environ else None
    os.environ.update({"TMPDIR": private, RUN_TMPDIR: private, "PET_LOG_DIR": os.path.join(private, "torchrun")})
    tempfile.tempdir = private
    if config.option.basetemp is None:
        config.option.basetemp = os.path.join(private, "pytest")
    return RunFiles(private, tree)


def working_tree_files() -> set[str] | None:
    """git status's untracked and ignored entries (folders collapsed), but Python's bytecode caches."""
    try:
        proc = subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None  # not a git checkout (an unpacked release): nothing to compare
    return {line[3:] for line in proc.stdout.splitlines() if line[:2] in ("??", "!!") and "__pycache__" not in line}


@pytest.hookimpl(trylast=True)  # after pytest-xdist has stopped its workers, which clean up as they exit
def pytest_sessionfinish(session):
    """Fail the run on anything left in its $TMPDIR (removed) or new in the working tree (kept: it may be
    yours); remove the $TMPDIR, but for pytest's basetemp when a test failed (kept for inspection)."""
    run = session.config.stash.get(RUN_FILES, None)
    if run is None:
        return
    # Without xdist the tests ran in this process, whose multiprocessing folder (the forkserver's socket) is
    # removed as the process exits (multiprocessing's finalizer of exitpriority -100)
    own = multiprocessing.current_process()._config.get("tempdir")
    run.left = sorted(path for path in (os.path.join(run.tmpdir, name) for name in os.listdir(run.tmpdir)
                                        if name not in EXPECTED) if path != own)
    for path in run.left:
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.unlink(path)
    tree = working_tree_files() if run.tree is not None else None
    run.left += sorted(f"{REPO / name} (in the working tree)" for name in (tree or set()) - (run.tree or set()))
    shutil.rmtree(os.path.join(run.tmpdir, "torchrun"), ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(run.tmpdir, EXPECTED[2]))
    if run.left and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if session.exitstatus == pytest.ExitCode.OK:
        if own and os.path.isdir(own):  # this $TMPDIR goes after it
            multiprocessing.util.Finalize(None, shutil.rmtree, (run.tmpdir, True), exitpriority=-200)
        else:
            shutil.rmtree(run.tmpdir, ignore_errors=True)
    else:
        run.kept = True


def pytest_terminal_summary(terminalreporter, config):
    run = config.stash.get(RUN_FILES, None)
    if run is None:
        return
    if run.left:
        terminalreporter.section("files the tests left behind: the run fails", red=True)
        for path in run.left:
            terminalreporter.line(path, red=True)
    if run.kept:
        terminalreporter.line(f"this run's $TMPDIR, kept for inspection: {run.tmpdir}")
    # which factor the hang guards had, so a slow CI log says whether the machine looked slow
    limit = config.getoption("timeout", None)
    terminalreporter.line(f"time limits x{slowness.slowness():g} ({slowness.ENV})"
                          + (f", {limit:.0f} s per test" if limit else ""))


# A model small enough that a training step takes milliseconds on a CPU core. Its vocabulary is
# small too (TINY_VOCAB): GPT-2's 50,304-row lm_head would be 95% of a step's work. Runs that
# read GPT-2-tokenized text (HellaSwag, samples) or export pass GPT2_VOCAB (make_shards' ids
# are below TINY_VOCAB, so they suit both).
TINY_MODEL = ["--model", "custom", "--n_layer", "2", "--n_head", "2", "--n_embd", "64",
              "--block_size", "32", "--seq_len", "32", "--dropout", "0.0"]
TINY_VOCAB = 512
GPT2_VOCAB = 50304


def make_shards(folder: Path, train_sizes=(3000, 2500, 4000), val_size=2000, seed=0, vocab=TINY_VOCAB,
                prefix="tiny") -> Path:
    """Random token shards with some structure (a repeating motif) so losses fall when training."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    motif = rng.integers(0, vocab, size=97)
    for index, size in enumerate([val_size, *train_sizes]):
        tokens = np.where(rng.random(size) < 0.5, np.resize(motif, size), rng.integers(0, vocab, size=size))
        split = "val" if index == 0 else "train"
        write_shard(folder / shard_name(prefix, split, index), tokens.astype(np.uint16))
    return folder


@pytest.fixture
def shards(tmp_path) -> Path:
    return make_shards(tmp_path / "shards")


@pytest.fixture(scope="module")
def data_options() -> dict:
    """make_shards' keyword arguments for `data`: a module whose runs need other shards overrides this fixture."""
    return {}


@pytest.fixture(scope="module")
def data(request, tmp_path_factory, data_options) -> Path:
    """The tiny shards a module's tests train on, made once for all of them (their runs take the time, not these)."""
    folder = tmp_path_factory.mktemp(request.module.__name__.removeprefix("test_"))
    return make_shards(folder / "shards", **data_options)


def base_args(data_dir: Path, out_dir: Path, **overrides) -> list[str]:
    """Trainer arguments for a fast, deterministic CPU run on the tiny model."""
    settings = dict(
        data_dir=data_dir, out_dir=out_dir, total_batch_size=512, micro_batch_size=4, max_steps=6,
        warmup_steps=2, max_lr=3e-3, min_lr=3e-4, eval_interval=3, val_tokens=256, hellaswag_interval=0,
        sample_interval=0, checkpoint_interval=3, keep_last=10, device="cpu", dtype="float32", compile="false",
        seed=1234, vocab_size=TINY_VOCAB,
    )
    settings.update(overrides)
    args = list(TINY_MODEL)
    for key, value in settings.items():
        args += [f"--{key}", str(value)]
    return args


def trainer_env(extra_env: dict | None = None) -> dict:
    """The environment of a trainer a test starts: the repository first on PYTHONPATH, ahead of what the
    caller put there (packages installed beside the interpreter's own, as on a machine set up by hand)."""
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", WANDB_SILENT="true", PYTHONPATH=path,
                PYTHONFAULTHANDLER="1", **(extra_env or {}))


def target_of(script: str) -> str:
    """tests/forked_ranks.py's target for a script: "train_gpt2.py" -> "train_gpt2:main"."""
    return script.removeprefix("tests/").removesuffix(".py").replace("/", ".") + ":main"


def start_trainer(args: list[str], nproc: int | None = None, script: str = "train_gpt2.py",
                  extra_env: dict | None = None) -> Started:
    """run_trainer's forked launch, returned while its ranks run (tests/forked_ranks.py's Started: poll, send_signal,
    communicate), for a test that signals them as torchrun's agent would forward a signal."""
    return start(list(map(str, args)), nproc, target=target_of(script), extra_env=trainer_env(extra_env))


def run_trainer(args: list[str], nproc: int | None = None, check: bool = True, timeout: float = 300,
                script: str = "train_gpt2.py", extra_env: dict | None = None, torchrun_args=(),
                cwd: Path = REPO, torchrun: bool = False, grace: float | None = None):
    """Run the trainer (or another entry point) as a user would: one process, or nproc ranks.

    By default the ranks are forked from a warm process with torchrun's environment (tests/forked_ranks.py:
    the same trainer code, without seconds of imports per process); torchrun=True, or any
    torchrun_args, runs `python -m torch.distributed.run` itself (its agent, restarts, signals and
    failure report are then part of what is tested). Either way the result has returncode,
    stdout and stderr, and, from a fork launch, each rank's exit code in `exitcodes` (a rank
    still running `grace` seconds after another failed is killed: -9; default launch.GRACE_S).
    `timeout` is a hang guard in seconds on the reference machine (tests/slowness.py).
    """
    env = trainer_env(extra_env)
    if not (torchrun or torchrun_args):
        proc = launch(list(map(str, args)), nproc, target=target_of(script), extra_env=env, timeout=timeout, cwd=cwd,
                      grace=grace)
        if check and proc.returncode != 0:
            raise AssertionError(f"{script} {' '.join(map(str, args))} exited {proc.exitcodes}\n{proc.stdout[-3000:]}\n"
                                 f"{proc.stderr[-5000:]}")
        return proc
    if nproc is None:
        cmd = [sys.executable, str(REPO / script), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               *torchrun_args, str(REPO / script), *args]
    proc = run_and_reap(cmd, env, timeout, cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


LAUNCH_TOKEN = "GPT2_REPRO_TEST_LAUNCH"  # in the environment of every process a test launches, and their children


def launched_processes(token: str) -> list[int]:
    """The live processes whose environment carries LAUNCH_TOKEN=token: a launcher and its workers.

    torchrun starts each worker in a session of its own, so neither the process group nor the
    session finds them; the environment they inherit does.
    """
    return processes_whose_environment(lambda env: env.get(LAUNCH_TOKEN.encode()) == token.encode())


def processes_whose_environment(match) -> list[int]:
    """The live processes (not zombies, not this one) whose environment, a dict of bytes, matches."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
                items = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if match(dict(item.split(b"=", 1) for item in items if b"=" in item)):
                found.append(int(entry.name))
    return found


def kill_all(pids: list[int], sig: int = signal.SIGKILL) -> None:
    """Send sig (SIGKILL) to each process still there."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def wait_until(condition, proc, what: str, timeout: float = 120, report=None) -> None:
    """Until condition() holds, while proc (a Popen, or anything with poll() and communicate()) runs: its ending
    first, or a hang guard of `timeout` seconds (tests/slowness.py) passing, fails the test. report() gives a
    failure's details, and may end what is left running (default: the ended run's output; nothing on a timeout)."""
    timeout = guard(timeout)
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"{what} not reached: the run ended first\n{report() if report else tails(proc)}")
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} not reached in {timeout:.0f}s" + (f"\n{report()}" if report else ""))
        time.sleep(0.02)


def wait_for_step(out: Path, step: int, proc, timeout: float = 120) -> None:
    """wait_until the run in out_dir `out` has logged the train record of `step` or a later one."""
    from runtime.logger import read_log

    log = Path(out) / "log.jsonl"
    wait_until(lambda: log.exists() and any(r.get("kind") == "train" and r["step"] >= step for r in read_log(log)),
               proc, f"step {step}", timeout)


@contextlib.contextmanager
def background(cmd: list[str], env: dict | None = None, cwd: Path | None = REPO, **popen):
    """cmd running in the background for a `with` block, its output piped as text (unless popen says otherwise).
    At the block's end, passed or failed, whatever is left of the launch is killed and cmd reaped: a test that
    failed while it ran must not leave it (or torchrun's workers) holding the CPU for the rest of the suite. Its
    processes are found by the launch's LAUNCH_TOKEN, proc.token, as run_and_reap finds them."""
    token = uuid.uuid4().hex
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **popen}
    proc = subprocess.Popen(cmd, cwd=cwd, env={**(os.environ if env is None else env), LAUNCH_TOKEN: token}, **popen)
    proc.token = token
    try:
        yield proc
    finally:
        kill_all(launched_processes(token))
        proc.kill()  # a launch that ended keeps its return code
        proc.communicate()


def signalled(proc, sig: int, timeout: float = 120) -> tuple[str, str]:
    """Send a running launch (background's Popen, or start_trainer's ranks) sig and wait for it to end: its
    (stdout, stderr). Not ending within a hang guard of `timeout` seconds (tests/slowness.py) fails the test; the
    `with` block it was started in then kills it."""
    proc.send_signal(sig)
    try:
        return proc.communicate(timeout=guard(timeout))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running {guard(timeout):.0f} s after {signal.Signals(sig).name}") from None


def tails(proc) -> str:
    """The end of an ended run's stdout and stderr (either may be None: not captured, or merged into stdout)."""
    stdout, stderr = proc.communicate()
    return f"{(stdout or '')[-3000:]}\n{(stderr or '')[-5000:]}"


def run_and_reap(cmd: list[str], env: dict, timeout: float, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run cmd; on a timeout (guard(timeout): seconds on the reference machine) it and every process it
    started are killed, and the test fails.

    A hung launch must not leave workers behind (they would hold the CPU for the rest of the
    suite), and a finished one must have left none: the test fails if any of its processes
    outlives it.
    """
    token = uuid.uuid4().hex
    timeout = guard(timeout)
    proc = subprocess.Popen(cmd, cwd=cwd, env={**env, LAUNCH_TOKEN: token}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all(launched_processes(token))
        stdout, stderr = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} did not finish in {timeout:.0f} s (killed)\n{stdout[-3000:]}\n"
                             f"{stderr[-5000:]}") from None
    left = launched_processes(token)
    if left:
        kill_all(left)
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode} but left processes {left} running")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def load_weights(out_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The model of checkpoint `step` in out_dir, whichever its format (as saved: float64 stays float64)."""
    from training.checkpoint.folder import list_checkpoints, read_full_state

    (path,) = [p for s, p in list_checkpoints(Path(out_dir) / "checkpoints") if s == step]
    return read_full_state(path)["model"]


def assert_same(a, b, where: str = "") -> None:
    """Equal values, and bitwise equal tensors of the same dtype."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


def crashed_copy(run: Path, out: Path, last_checkpoint: int) -> Path:
    """run's folder copied to out (or out itself, when they are one) as if the run had died just after
    checkpoint `last_checkpoint`: the checkpoints after it deleted, whatever their format."""
    from training.checkpoint.folder import delete_checkpoint, list_checkpoints

    if Path(out) != Path(run):
        shutil.copytree(run, out)
    for step, path in list_checkpoints(Path(out) / "checkpoints"):
        if step > last_checkpoint:
            delete_checkpoint(path)
    return Path(out)


def train_here(argv: list[str], wrap_step=None) -> int:
    """`python train_gpt2.py ARGV` in this process (one rank): its exit status, the error convention included.
    wrap_step(step) -> step wraps the loop's step (tests inject faults). The one place tests reach the entry
    script; the components it is made of come from launch/components.py."""
    import train_gpt2

    return run_cli(lambda args: train_gpt2.main(args, wrap_step=wrap_step), [str(a) for a in argv])


def train_loop(cfg, ctx, run, preemption, record: dict) -> None:
    """train_gpt2.py's loop over a run a test built (build_tiny_run), in this process."""
    import train_gpt2

    train_gpt2.train(cfg, ctx, run, preemption, record)


def lockstep_steps(cfg, ctx, run, count: int, after_each=None) -> list:
    """`count` steps of the trainer's step (launch/components.py's make_lockstep) on a run a test built
    (build_tiny_run), in this process, from where its data stands (run.step + run.data_offset): each step's
    StepResult. after_each() runs after each step."""
    from data.loader import Prefetcher
    from launch.components import make_lockstep

    offset = run.data_offset
    batches = Prefetcher(run.train_loader, run.step + offset, cfg.schedule.max_steps + offset, ctx.runtime.device)
    lockstep, results = make_lockstep(cfg, ctx), []
    try:
        for _ in range(count):
            results.append(lockstep.step(run, run.model, batches, stop_requested=False))
            if after_each:
                after_each()
        return results
    finally:
        batches.close()


def untimed(records) -> list[dict]:
    """log.jsonl records less the time each was written (the one field two runs of the same steps never share)."""
    return [{k: v for k, v in r.items() if k != "time"} for r in records]


def train_losses(out_dir: Path) -> dict[int, float]:
    from runtime.logger import read_log

    return {r["step"]: r["loss"] for r in read_log(Path(out_dir) / "log.jsonl") if r["kind"] == "train"}


def build_tiny_run(data_dir: Path, out_dir: Path, **overrides):
    """A run of the tiny model built in this process (one rank, no process group, a silent logger): its
    configuration, its Context (env, runtime, logger), and the run."""
    from runtime.context import Context
    from runtime.logger import RunLogger
    from runtime.process_group import DistEnv
    from training.distributed.strategies import make_strategy
    from launch.config import parse_args
    from launch.build import build_run
    from training.checkpoint.folder import checkpoints_folder

    cfg = parse_args(base_args(data_dir, out_dir, **overrides))
    runtime = cfg.runtime.make_runtime()
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=runtime.device, distributed=False)
    ctx = Context(env, runtime, RunLogger(enabled=False))
    checkpoints = checkpoints_folder(cfg.run.out_dir, cfg.checkpoint.checkpoint_dir)
    return cfg, ctx, build_run(cfg, ctx, make_strategy(cfg.runtime.strategy, env, runtime), checkpoints)
