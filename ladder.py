"""A scaling ladder: a family of model sizes trained on one budget rule, the law L(C) = E + A * (C / C0)^-alpha
fitted to their final val losses, the next size's loss predicted with an interval, and (--check) trained.

    python prep/shakespeare.py
    python ladder.py --tokens_per_param 0.01 --seeds 1337 1 --dry_run       # the plan, and its time, before anything
    python ladder.py --tokens_per_param 0.01 --seeds 1337 1 --check         # configs/demo.yaml at depths 1-4, then 5
    python ladder.py --tokens_per_param 0.01 --recipes faithful,modern      # both recipes at every size
    python ladder.py --config configs/gpt2_124m.yaml --depths 3 4 6 8 --next 12 --tokens_per_param 20 \\
        --launch torchrun --nproc_per_node 8 --out out/ladder_124m             # docs/SCALING.md: its cost
    python ladder.py ... --launch slurm --sbatch_args="--nodes=1"               # one array task per rung

Sizes: --depths D... is GPT-2's aspect ratio turned by one dial (n_layer = n_head = D, n_embd = 64 x D: depth 12
is GPT-2 124M), --presets NAME... model.py's presets. Everything else is --config's (default configs/demo.yaml),
and --set KEY=VALUE sets any trainer key for every rung. Budget: --tokens_per_param R trains each size on R tokens
per parameter (Chinchilla's rule is about 20), or --flops C... gives each size its FLOPs. Either way a rung's
max_steps is its tokens / total_batch_size, rounded; its warmup keeps the base config's share of max_steps, and it
saves --checkpoints_per_rung checkpoints. FLOPs are counted as the trainer's MFU counts them:
C = (6 N + 12 L H Q T) x tokens trained (model.py's estimate_flops_per_token): N the parameters but the position
table, L layers, H heads of size Q, T = seq_len.

Every rung is an ordinary run of train_gpt2.py in its own folder, OUT/RUNG/, from its own complete config,
OUT/configs/RUNG.yaml; --launch python (one process), torchrun (--nproc_per_node), slurm (scripts/slurm.sbatch, an
array job, one task per rung: CONFIG=OUT/slurm/N/%a.yaml) or slurm-jobs (one job per rung). Python and torchrun
rungs run one after another; Slurm's are submitted and the command returns: run it again once they end. A rung
whose folder holds its final val record (at max_steps) is done and read; any other is launched with the same
command again, which the trainer resumes exactly from its newest checkpoint. So a killed ladder, run again,
reuses its finished rungs, resumes the one it was in, and ends as an uninterrupted one would, bit for bit.
A rung runs in a session of its own, and the ladder passes on to it each signal it gets: Ctrl-C, or SIGINT or SIGTERM
to the ladder's pid, makes the rung save its state after its step and exit, as a Ctrl-C does a run in a terminal (a
second Ctrl-C stops it at once), and the ladder then exits interrupted (one line, 130); Ctrl-Z stops both. A rung
config that differs from the one its folder was trained with is refused.

The fit is evals/scaling_law.py's: L(C), not L(N, D). On one budget rule the tokens are a function of the
parameters (D = R N, or D = C / (6 N)), so the rungs lie on one curve through the (N, D) plane, along which a
loss term in N and one in D are both powers of N: the rungs cannot tell them apart. What the ladder determines
is the loss along that curve, one variable, compute; separating N from D takes several sizes at each budget (an
isoFLOP grid). The law is fitted by least squares on the loss, with 95% intervals from a residual
bootstrap over rungs and seeds (--bootstrap replicates), to each recipe's final val loss and bpb; it predicts
the next size (--next: by default the next depth by the ladder's last step, or the next preset) with the law's
interval and a single run's. The prediction is written before --check trains that size, which then says
whether each of its runs landed inside; --check is refused where there is no law (fewer budgets than its three
parameters: before anything trains). A rung whose final figure is not finite (NaN, inf, or null in its log) is
named, and left out of the fit. --recipes faithful,modern trains both at every size (modern: the keys
configs/gpt2_124m_modern.yaml sets beyond configs/gpt2_124m.yaml), compares them per size with compare_runs.py's
statistics, and fits how their difference moves with log10 C (a slope with its t interval).

--dry_run prints each rung's size, tokens, FLOPs and estimated time, and trains nothing. The time is the trainer's
--estimate of the rung's config (launch/estimate.py: its steps, evaluations, checkpoints and, where measured, its
start-up) at a throughput it states: on a GPU model of the table, its bf16 peak x --gpus x the MFU measured for
that configuration on that GPU model, else --mfu (40%, assumed); on the CPU one measured: scripts/bench.py times
the trainer's step on the ladder's largest rung.

Writes OUT/ladder.md, OUT/ladder.json (no timings: the same rungs give the same bytes) and OUT/ladder.png, which
ladder.json alone draws again (redraw(): scripts/pictures.py draws docs/ladder.png so).
"""

from __future__ import annotations

import common.startup  # noqa: F401 - first: a Ctrl-C while the modules below load is one line

import dataclasses
import getpass
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import yaml

from common.errors import ArgumentParser, ConfigError, DataError, ReproError, run_cli
from common.log_fields import BPB
from common.settings import require
from evals.run_comparison import compare, format_rows, run_figures, summary
from evals.scaling_law import PARAMETERS, LawFit, fit_with_bootstrap, trend
from evals.stats import format_p
from model_size import PRESETS
from training.core.logger import LOG_NAME, read_log, write_text_file
from launch.config import TrainConfig, coerce, config_yaml, load_yaml
from launch.estimate import duration, estimate, find_gpu, gpu_hardware, measured_hardware, model_shape

if TYPE_CHECKING:
    from matplotlib.figure import Figure  # matplotlib loads where a picture is drawn, not for --dry_run

REPO = Path(__file__).resolve().parent
TRAINER = REPO / "train_gpt2.py"
SBATCH = REPO / "scripts" / "slurm.sbatch"
# a recipe: the keys it sets beyond the faithful one (configs/gpt2_124m_modern.yaml's own header explains them)
RECIPE_FILES = {"faithful": None, "modern": REPO / "configs" / "gpt2_124m_modern.yaml"}
FAITHFUL_FILE = REPO / "configs" / "gpt2_124m.yaml"
OWNED = ("model", "n_layer", "n_head", "n_embd", "max_steps", "seed", "out_dir")  # set per rung by the ladder
# glibc returns a large tensor's memory to the OS after each step and faults it back in on the next: CPU training
# is about 1.7x faster with it kept mapped (the Makefile's CPU_MALLOC)
CPU_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "17179869184", "MALLOC_TRIM_THRESHOLD_": "17179869184"}
METRICS = {"loss": "final val loss", "bpb": "final val bpb"}  # compare_runs.py's names of a run's final figures
LOGGED = {"loss": "loss", "bpb": BPB}  # their fields in the final val record


class RungFailed(ReproError):
    """A rung's trainer failed; its own error line is above. The ladder's exit code is the trainer's."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


# --- the plan: sizes, budgets, rungs ----------------------------------------------------------------

@dataclass(frozen=True)
class Size:
    label: str  # d4, gpt2-medium
    keys: dict  # the model keys of the trainer


def depth_size(depth: int) -> Size:
    """GPT-2's shape at another depth: heads of 64 wide, as many as layers (depth 12: GPT-2 124M)."""
    return Size(f"d{depth}", {"model": "custom", "n_layer": depth, "n_head": depth, "n_embd": 64 * depth})


def preset_size(name: str) -> Size:
    return Size(name, {"model": name, "n_layer": None, "n_head": None, "n_embd": None})


@dataclass(frozen=True)
class Rung:
    name: str  # d2_faithful_s1337: its run folder's name
    size: Size
    n_layer: int
    n_head: int
    n_embd: int
    recipe: str
    seed: int
    params: int  # N: every parameter but the position table (those of 6N)
    flops_per_token: int  # 6N + 12 L H Q T
    max_steps: int
    tokens: int  # max_steps x total_batch_size
    flops: float  # flops_per_token x tokens
    config: str  # the complete config, YAML
    check: bool  # the next size, trained by --check

    def describe(self) -> dict:
        """Every field but the config, the size by its label (what ladder.json keeps; redraw() reads it back)."""
        return {f.name: self.size.label if f.name == "size" else getattr(self, f.name)
                for f in dataclasses.fields(self) if f.name != "config"}


def recipe_keys(recipe: str) -> dict:
    """The keys a recipe sets: none for faithful; modern's config's keys that differ from the faithful one's."""
    path = RECIPE_FILES[recipe]
    if path is None:
        return {}
    faithful = load_yaml(FAITHFUL_FILE)
    return {k: v for k, v in load_yaml(path).items() if k != "out_dir" and faithful.get(k) != v}


def parse_sets(pairs: list[str]) -> dict:
    """--set KEY=VALUE ..., each value converted by its key's type; the keys the ladder sets per rung refused."""
    values = {}
    for pair in pairs:
        key, equals, value = pair.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        require(equals == "=", "--set", f"expected KEY=VALUE, got {pair!r}")
        require(key not in OWNED, "--set", f"{key} is set per rung by the ladder (the sizes, the budget rule, --seeds, "
                                           f"--out)")
        values[key] = coerce(key, value)  # an unknown key: one line naming it
    return values


def plan(args, sizes: list[Size], next_size: Size) -> list[Rung]:
    """Every rung, the next size's too (check: trained by --check alone), sizes in order, each size's seeds and
    recipes."""
    sets = parse_sets(args.set)
    base = {**load_yaml(args.config), **sets}  # --set wins over the base config and over a recipe
    schedule = TrainConfig(**base).schedule  # the base's own max_steps and warmup: the warmup's share
    budgets = flop_budgets(args, len(sizes))
    recipe_sets = {recipe: recipe_keys(recipe) for recipe in args.recipes}
    rungs = []
    for index, size in enumerate([*sizes, next_size]):
        # the model and the batch: the same for every seed and recipe of the size
        cfg = TrainConfig(**{**base, **size.keys, "max_steps": 1, "warmup_steps": 0})
        shape = model_shape(cfg)  # counted as the trainer's MFU and --estimate count it (model_size.py)
        params, per_token = shape.non_embedding_params, shape.flops_per_token()
        batch = cfg.data.total_batch_size
        tokens = args.tokens_per_param * params if budgets is None else budgets[index] / per_token
        max_steps = rung_steps(tokens, batch, per_token, "--tokens_per_param" if budgets is None else "--flops",
                               size.label)
        for seed in args.seeds:
            for recipe in args.recipes:
                name = f"{size.label}_{recipe}_s{seed}"
                keys = {**base, **recipe_sets[recipe], **sets, **size.keys, "seed": seed, "max_steps": max_steps,
                        "out_dir": str(args.out / name)}
                if "warmup_steps" not in sets:  # the base's share of its steps
                    keys["warmup_steps"] = round(schedule.warmup_steps * max_steps / schedule.max_steps)
                if "checkpoint_interval" not in sets:
                    keys["checkpoint_interval"] = max(1, math.ceil(max_steps / args.checkpoints_per_rung))
                config = config_yaml(TrainConfig(**keys))
                rungs.append(Rung(name, size, shape.n_layer, shape.n_head, shape.n_embd, recipe, seed, params,
                                  per_token, max_steps, max_steps * batch, float(per_token * max_steps * batch), config,
                                  index == len(sizes)))
    return rungs


def rung_steps(tokens: float, batch: int, per_token: int, flag: str, label: str) -> int:
    """A rung's max_steps: its tokens over the batch, rounded, at least 1. A budget whose FLOPs are past what a float
    holds (the FLOPs the ladder reports and fits) is refused, naming the flag that set it."""
    if math.isfinite(tokens):
        max_steps = max(1, round(tokens / batch))
        if per_token * max_steps * batch <= sys.float_info.max:
            return max_steps
    raise ConfigError(f"{flag}: {label} would train {tokens:.3g} tokens of {per_token:,} FLOPs each: more FLOPs than "
                      f"a float holds ({sys.float_info.max:.2g})")


def flop_budgets(args, n_sizes: int) -> list[float] | None:
    """--flops, one per size and one for the next: given, or the ladder's last ratio once more."""
    if args.flops is None:
        return None
    budgets = list(args.flops)
    if len(budgets) == n_sizes:
        require(n_sizes >= 2, "--flops", "with one size, give the next size's budget too (two values)")
        budgets.append(budgets[-1] * (budgets[-1] / budgets[-2]))
        require(budgets[-1] < math.inf, "--flops", f"the next size's budget, the last ratio once more, is past a "
                                                   f"float's range ({sys.float_info.max:.2g}): give it (one more)")
    require(len(budgets) == n_sizes + 1, "--flops",
            f"one budget per size ({n_sizes}), and optionally the next size's, got {len(args.flops)}")
    return budgets


def ladder_sizes(args) -> tuple[list[Size], Size]:
    """The sizes and the next one (--next, or by default: the depth after the last by the last step between two,
    or the next preset)."""
    if args.presets:
        for flag, name in [*(("--presets", p) for p in args.presets), ("--next", args.next or args.presets[0])]:
            require(name in PRESETS, flag, f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
        names = list(PRESETS)
        require(args.next is not None or args.presets[-1] != names[-1], "--next",
                f"no preset after {args.presets[-1]}; name the size to predict")
        following = args.next or names[names.index(args.presets[-1]) + 1]
        sizes, next_size = [preset_size(p) for p in args.presets], preset_size(following)
    else:
        depths = args.depths
        require(all(d >= 1 for d in depths) and depths == sorted(set(depths)), "--depths",
                f"increasing positive depths, got {' '.join(map(str, depths))}")
        try:
            following = int(args.next) if args.next else depths[-1] + (depths[-1] - depths[-2] if len(depths) > 1
                                                                       else 1)
        except ValueError:
            raise ConfigError(f"--next: a depth with --depths, got {args.next!r}") from None
        sizes, next_size = [depth_size(d) for d in depths], depth_size(following)
    require(next_size.label not in [s.label for s in sizes], "--next",
            f"{next_size.label} is a size of the ladder; predict another")
    return sizes, next_size


# --- the time a plan takes --------------------------------------------------------------------------

def rung_hardware(args, rungs: list[Rung]):
    """What the dry run times the rungs on, for each rung (launch/estimate.py's Hardware: its rate and where that
    comes from): on the CPU one rate measured on the ladder's largest rung; on a GPU model of the table, the
    trainer's --estimate's for each rung's config (its MFU measured for that configuration on that GPU model, else
    --mfu or the default, assumed)."""
    hardware = args.hardware
    if hardware == "auto":
        hardware = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    if hardware == "cpu":
        # the largest rung of the ladder: the largest take most of its time (and a CPU's FLOP/s grows with width)
        rate, how = measured_cpu_throughput(max((r for r in rungs if not r.check), key=lambda r: r.flops_per_token))
        return {r.name: measured_hardware("this CPU", rate, how) for r in rungs}
    gpu = find_gpu(hardware, "--hardware")
    gpus = args.gpus or args.nproc_per_node
    return {r.name: gpu_hardware(rung_config(r), gpu, gpus, args.mfu) for r in rungs}


def rung_config(rung: Rung) -> TrainConfig:
    return TrainConfig(**yaml.safe_load(rung.config))


def rung_times(args, rungs: list[Rung]) -> tuple[dict[str, float], list[str]]:
    """{rung: seconds} of the trainer's estimate of each rung (train_gpt2.py --estimate's hours: steps, evaluations,
    checkpoints, start-up), and where their speeds come from (each source once)."""
    hardware = rung_hardware(args, rungs)
    times = {r.name: estimate(rung_config(r), hardware[r.name]).total_s for r in rungs}
    sources = list(dict.fromkeys(f"{h.name}: {h.source}" for h in hardware.values()))
    return times, sources


def measured_cpu_throughput(rung: Rung) -> tuple[float, str]:
    """FLOP/s of this CPU on a rung: scripts/bench.py times the trainer's own step (the median of 3, after one),
    with a micro-batch of at most 2,048 tokens and one micro-step a step."""
    cfg = rung_config(rung)
    rows = max(1, min(cfg.data.micro_batch_size or 1, 2048 // cfg.data.seq_len))
    with tempfile.TemporaryDirectory(prefix="ladder-bench-") as work:
        config, figures = Path(work) / "rung.yaml", Path(work) / "bench.json"
        config.write_text(rung.config)
        command = [sys.executable, str(REPO / "scripts" / "bench.py"), "--warmup", "1", "--steps", "3", "--json",
                   str(figures), "--config", str(config), "--micro_batch_size", str(rows), "--total_batch_size",
                   str(rows * cfg.data.seq_len)]
        proc = subprocess.run(command, cwd=REPO, env=rung_environment(), capture_output=True, text=True)
        if proc.returncode != 0:
            raise ReproError(f"measuring this CPU: scripts/bench.py exited {proc.returncode}: "
                             f"{(proc.stderr.strip().splitlines() or [''])[-1]}")
        tokens_per_sec = json.loads(figures.read_text())["tokens_per_sec"]
    rate = tokens_per_sec * rung.flops_per_token
    return rate, (f"measured: {rate / 1e9:.1f} GFLOP/s, scripts/bench.py's median step of {rung.size.label} on this "
                  f"CPU ({rows * cfg.data.seq_len:,} tokens a step)")


def rung_environment() -> dict:
    """The environment a rung runs in: this one, and on a machine without CUDA the CPU's malloc settings."""
    return dict(os.environ) if torch.cuda.is_available() else {**CPU_MALLOC, **os.environ}


def plan_table(rungs: list[Rung], times: dict[str, float] | None = None) -> str:
    lines = ["| rung | n_layer | n_embd | params N | steps | tokens | tokens / N | FLOPs C |"
             + (" estimated time |" if times else ""),
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if times else "")]
    for r in rungs:
        label = r.name + (" (check)" if r.check else "")
        lines.append(f"| {label} | {r.n_layer} | {r.n_embd} | {r.params:,} | {r.max_steps:,} | {r.tokens:,} "
                     f"| {r.tokens / r.params:.3g} | {r.flops:.3e} |" + (f" {duration(times[r.name])} |" if times
                                                                         else ""))
    return "\n".join(lines)


# --- the rungs' runs ----------------------------------------------------------------------------------

def finite(value) -> bool:
    """Whether a final figure is one the law can be fitted to: a number, neither NaN nor infinite (a log may hold
    either as json's NaN and Infinity, or as null)."""
    return isinstance(value, (int, float)) and math.isfinite(value)


def final_figures(rung: Rung, out: Path) -> dict[str, float | None] | None:
    """A finished rung's final val loss and bpb (compare_runs.py reads them, and refuses inconsistent ones), each
    None where it is not finite (report() names it, and the fit leaves it out); None while its folder holds no val
    record at its max_steps."""
    folder = out / rung.name
    log = folder / LOG_NAME
    finals = [r for r in read_log(log) if r.get("kind") == "val" and r.get("step") == rung.max_steps] \
        if log.exists() else []
    if not finals:
        return None
    logged = {metric: finals[0][field] for metric, field in LOGGED.items() if field in finals[0]}
    if not all(finite(value) for value in logged.values()):  # compare_runs.py refuses NaN: read here
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


# --- the law, the prediction, the recipes compared ------------------------------------------------------

def fit_recipe(rungs: list[Rung], results: dict[str, dict], recipe: str, metric: str, replicates: int) -> dict | None:
    """The law through a recipe's finished ladder rungs (not the next size's), its prediction of the next size, and
    how the next size's runs, where trained, landed: a JSON-ready dict, or None with fewer than 3 budgets."""
    ladder = [r for r in rungs if r.recipe == recipe and not r.check and finite(results.get(r.name, {}).get(metric))]
    if len({r.flops for r in ladder}) < PARAMETERS:
        return None
    fit = fit_with_bootstrap([r.flops for r in ladder], [results[r.name][metric] for r in ladder], replicates)
    following = [r for r in rungs if r.recipe == recipe and r.check]
    prediction = fit.predict(following[0].flops)
    checked = [{"name": r.name, "seed": r.seed, "value": results[r.name][metric],
                "inside": None if prediction.run is None else prediction.run.contains(results[r.name][metric])}
               for r in following if finite(results.get(r.name, {}).get(metric))]
    error = float(np.mean([c["value"] for c in checked])) - prediction.loss if checked else None
    return {"law": dataclasses.asdict(fit.law), "formula": fit.law.formula(),
            "intervals": {name: interval_list(fit.interval(name)) for name in ("E", "A", "alpha")},
            "runs": fit.n, "budgets": fit.budgets, "residual_sd": fit.residual_sd, "at_bound": list(fit.at_bound),
            "bootstrap_replicates": 0 if fit.replicates is None else replicates,
            "prediction": {"size": following[0].size.label, "flops": prediction.compute, "value": prediction.loss,
                           "law_interval": interval_list(prediction.law),
                           "run_interval": interval_list(prediction.run)},
            "check": {"runs": checked, "mean_error": error,
                      "relative_error": None if error is None else error / prediction.loss,
                      "inside": None if not checked or prediction.run is None else all(c["inside"] for c in checked)}
            if checked else None, "_fit": fit}


def interval_list(interval) -> list[float] | None:
    return None if interval is None else [interval.low, interval.high]


def compare_recipes(args, rungs: list[Rung], results: dict[str, dict]) -> dict | None:
    """With two recipes: at each size where both have every seed, compare_runs.py's comparison (B - A, Welch's
    t-test); then how B - A moves with log10 C across those sizes (least squares, t interval)."""
    if len(args.recipes) != 2:
        return None
    names = tuple(args.recipes)
    sizes = []
    for label in dict.fromkeys(r.size.label for r in rungs):
        groups = [[r for r in rungs if r.size.label == label and r.recipe == recipe] for recipe in names]
        if all(r.name in results and all(map(finite, results[r.name].values())) for group in groups for r in group):
            rows = compare(*[[args.out / r.name for r in group] for group in groups], names=names)
            sizes.append({"size": label, "flops": groups[0][0].flops, "summary": summary(rows, names),
                          "table": format_rows(rows, names),
                          "rows": {row.metric: {"a_mean": row.result.mean_a, "b_mean": row.result.mean_b,
                                                "difference": row.result.diff,
                                                "interval": None if row.result.interval is None
                                                else list(row.result.interval),
                                                "p": row.result.p, "verdict": row.verdict} for row in rows}})
    trends = {}
    for metric in METRICS.values():
        points = [(math.log10(s["flops"]), s["rows"][metric]["difference"]) for s in sizes if metric in s["rows"]]
        if len({x for x, _ in points}) >= 2:
            t = trend(*zip(*points))
            trends[metric] = {"slope_per_decade": t.slope, "interval": interval_list(t.interval), "p": t.p,
                              "sizes": t.n, "words": trend_words(t, names)}
    return {"names": list(names), "sizes": sizes, "trends": trends}


def trend_words(t, names: tuple[str, str]) -> str:
    a, b = names
    if t.interval is None:
        return "two sizes: a slope without an interval (a third size gives one)"
    if t.interval.low <= 0 <= t.interval.high:
        return f"no trend the sizes can tell (p = {format_p(t.p)})"
    towards = b if t.slope < 0 else a  # a loss or bpb: a falling B - A favours B
    return f"it moves in {towards}'s favour as the compute grows (p = {format_p(t.p)})"


# --- the report -------------------------------------------------------------------------------------------

def shown(path: Path) -> str:
    """A path as the report names it: from the repository's root where it lies inside."""
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def budget_words(budget: dict) -> str:
    """The budget rule as ladder.json holds it ({"flops": [...]} or {"tokens_per_param": R}), in words."""
    if "flops" in budget:
        return "FLOP budgets " + ", ".join(f"{c:.3g}" for c in budget["flops"])
    return f"{budget['tokens_per_param']:g} tokens per parameter"


FLOPS_WORDS = ("FLOPs: C = (6 N + 12 L H Q T) x tokens trained, as the trainer's MFU counts them (model.py's "
               "estimate_flops_per_token): N the parameters but the position table, L layers, H heads of size Q, "
               "T = seq_len.")


def report(args, rungs: list[Rung], results: dict[str, dict], sizes: list[Size]) -> tuple[str, dict, dict]:
    """(ladder.md, ladder.json's content, the fits for the picture)."""
    fits = {recipe: {metric: fit_recipe(rungs, results, recipe, metric, args.bootstrap) for metric in METRICS}
            for recipe in args.recipes}
    comparison = compare_recipes(args, rungs, results)
    described = ", ".join(s.label for s in sizes)
    budget = {"flops": args.flops} if args.flops is not None else {"tokens_per_param": args.tokens_per_param}
    lines = [f"# Scaling ladder: {shown(args.config)}, sizes {described}, {budget_words(budget)}, "
             f"seeds {', '.join(map(str, args.seeds))}", "", FLOPS_WORDS, "",
             "| rung | recipe | seed | params N | steps | tokens | FLOPs C | final val loss | final val bpb |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rungs:
        got = results.get(r.name)
        if got is None and r.check and not args.check:
            continue
        figures = " | ".join("-" if got is None or m not in got else f"{got[m]:.4f}" if finite(got[m])
                             else "not finite" for m in METRICS)
        lines.append(f"| {r.size.label}{' (next)' if r.check else ''} | {r.recipe} | {r.seed} | {r.params:,} "
                     f"| {r.max_steps:,} | {r.tokens:,} | {r.flops:.3e} | {figures} |")
    lines += not_finite_lines(rungs, results, comparison is not None)
    for recipe in args.recipes:
        for metric, name in METRICS.items():
            fit = fits[recipe][metric]
            lines += ["", f"## {recipe}: {name} against compute", ""]
            if fit is None:
                lines.append(f"No fit: the law has {PARAMETERS} parameters and needs at least {PARAMETERS} budgets "
                             f"with a finished run whose {name} is finite.")
                continue
            lines += law_lines(fit, name)
    if comparison:
        a, b = comparison["names"]
        lines += ["", f"## {a} against {b}, size by size (compare_runs.py)", ""]
        for size in comparison["sizes"]:
            lines += [f"{size['size']} (C = {size['flops']:.3e}): {size['summary']}", "", size["table"], ""]
        for metric, t in comparison["trends"].items():
            interval = "" if t["interval"] is None else f" (95% interval {t['interval'][0]:+.4f} to " \
                                                        f"{t['interval'][1]:+.4f})"
            lines.append(f"{metric}, {b} - {a} against log10 C over {t['sizes']} sizes: {t['slope_per_decade']:+.4f} "
                         f"per decade of compute{interval}: {t['words']}.")
    data = {"config": shown(args.config), "sizes": [s.label for s in sizes],
            "next": next(r.size.label for r in rungs if r.check),
            "budget": budget,
            "seeds": args.seeds, "recipes": args.recipes, "flops_counted_as": FLOPS_WORDS,
            "rungs": [{**r.describe(), "final": results.get(r.name)} for r in rungs],
            "fits": {recipe: {metric: None if fit is None else {k: v for k, v in fit.items() if k != "_fit"}
                              for metric, fit in by_metric.items()} for recipe, by_metric in fits.items()},
            "comparison": comparison}
    return "\n".join(lines) + "\n", data, fits


def not_finite_lines(rungs: list[Rung], results: dict[str, dict], compared: bool) -> list[str]:
    """A line for each finished rung with a final figure that is not finite, naming it: what it leaves out of."""
    lines = []
    for r in rungs:
        names = [METRICS[m] for m, value in results.get(r.name, {}).items() if not finite(value)]
        if names:
            what = "the check" if r.check else "the fit" + (" and the recipes' comparison at its size" if compared
                                                             else "")
            lines.append(f"Not finite: {r.name}'s {' and '.join(names)} (NaN, inf or null in its log): left out of "
                         f"{what}.")
    return ["", *lines] if lines else []


def law_lines(fit: dict, name: str) -> list[str]:
    law, iv = fit["law"], fit["intervals"]

    def with_interval(key: str, digits: int) -> str:
        bounds = iv[key]
        return f"{law[key]:.{digits}f}" + ("" if bounds is None else
                                           f" (95% interval {bounds[0]:.{digits}f} to {bounds[1]:.{digits}f})")

    how = (f"a residual bootstrap of {fit['bootstrap_replicates']} replicates over the rungs and seeds"
           if fit["bootstrap_replicates"] else "no intervals: as many runs as parameters, no residual to resample")
    bounds = {"E": "at its bound, 0: these rungs do not determine the loss's floor",
              "A": "at its bound, 0: the loss does not fall with compute here",
              "alpha": "at an end of its search range: these rungs do not pin down a power law"}
    lines = [f"{fit['formula']}, least squares on the {name} of {fit['runs']} runs at {fit['budgets']} budgets "
             f"({how}; the runs' residual sd {fit['residual_sd']:.4f}):", ""]
    lines += [f"- {key} = {with_interval(key, 4)}" + (f"; {bounds[key]}" if key in fit["at_bound"] else "")
              for key in ("alpha", "E", "A")]
    p = fit["prediction"]
    law_iv = "" if p["law_interval"] is None else f"; the law there {p['law_interval'][0]:.4f} to " \
                                                 f"{p['law_interval'][1]:.4f}"
    run_iv = "" if p["run_interval"] is None else f"; one run, 95%: {p['run_interval'][0]:.4f} to " \
                                                 f"{p['run_interval'][1]:.4f}"
    lines += ["", f"Predicted for {p['size']} (C = {p['flops']:.3e}): {p['value']:.4f}{law_iv}{run_iv}."]
    if check := fit["check"]:
        runs = ", ".join(f"seed {c['seed']} {c['value']:.4f}" + ("" if c["inside"] is None else
                                                                  " (inside)" if c["inside"] else " (outside)")
                         for c in check["runs"])
        inside = sum(bool(c["inside"]) for c in check["runs"])
        verdict = "" if check["inside"] is None else f" {inside} of {len(check['runs'])} landed inside the interval."
        lines.append(f"Trained ({p['size']}): {runs}; mean minus prediction {check['mean_error']:+.4f} "
                     f"({check['relative_error']:+.2%}).{verdict}")
    return lines


def draw(path: Path, rungs: list[Rung], results: dict[str, dict], fits: dict, title: str) -> Figure:
    """Final val loss against FLOPs, log-log: each recipe's runs, its law with the law's 95% band, and at the next
    size the prediction with one run's 95% interval (and the runs trained there, where --check trained them). The
    PNG carries what it draws as its Description text (plot_log.py's describe()); the figure is returned."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, MaxNLocator, NullFormatter, NullLocator, ScalarFormatter

    from plot_log import describe

    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    for index, (recipe, by_metric) in enumerate(fits.items()):
        colour = f"C{index}"
        own = [r for r in rungs if r.recipe == recipe and finite(results.get(r.name, {}).get("loss"))]
        ladder = [r for r in own if not r.check]
        ax.scatter([r.flops for r in ladder], [results[r.name]["loss"] for r in ladder], color=colour, s=22,
                   zorder=3, label=f"{recipe}: rungs")
        fit = by_metric["loss"]
        if fit is None:
            continue
        law: LawFit = fit["_fit"]
        p = fit["prediction"]
        grid = np.geomspace(min(r.flops for r in ladder) / 1.3, p["flops"] * 1.3, 200)
        ax.plot(grid, law.law(grid), color=colour, lw=1.4,
                label=rf"{recipe}: $E + A\,(C/C_0)^{{-\alpha}}$, $\alpha$ = {law.law.alpha:.3f}")
        band = law.band(grid)
        if band is not None:
            ax.fill_between(grid, *band, color=colour, alpha=0.15, lw=0)
        low, high = p["run_interval"] or (p["value"], p["value"])  # no interval from as many runs as parameters
        ax.errorbar([p["flops"]], [p["value"]], yerr=[[p["value"] - low], [high - p["value"]]], fmt="s",
                    color=colour, ms=6, capsize=4, mfc="white", zorder=4, label=f"{recipe}: {p['size']} predicted")
        if checked := [r for r in own if r.check]:
            # a little to the right of the prediction, which they would hide
            ax.scatter([r.flops * 1.08 for r in checked], [results[r.name]["loss"] for r in checked], marker="*", s=90,
                       color=colour, edgecolor="black", lw=0.5, zorder=5, label=f"{recipe}: {p['size']} trained")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())
    # a ladder's losses span far less than a decade: plain ticks over their range, not powers of ten
    ax.yaxis.set_major_locator(FixedLocator(MaxNLocator(6).tick_values(*ax.get_ylim())))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel("final val loss (nats)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7.5)
    fig.tight_layout()
    fig.savefig(path, metadata={"Description": describe(fig)})
    plt.close(fig)
    return fig


def picture_title(data: dict) -> str:
    """ladder.png's title, from ladder.json's content."""
    return f"{data['config']}: {', '.join(data['sizes'])} ({budget_words(data['budget'])})"


def redraw(data: dict, path: Path) -> Figure:
    """ladder.png again, from ladder.json's content `data` alone: its rungs with their final figures, and each
    recipe's law fitted to them again as report() fitted it (the same numbers: the bootstrap is seeded, and as
    many replicates as ladder.json records). scripts/pictures.py draws docs/ladder.png so."""
    # a rung as describe() wrote it; its model keys and config are not in ladder.json, nor in the picture
    rungs = [Rung(**{**{k: v for k, v in r.items() if k != "final"}, "size": Size(r["size"], {}), "config": ""})
             for r in data["rungs"]]
    results = {r["name"]: r["final"] for r in data["rungs"] if r["final"] is not None}
    fits = {recipe: {"loss": fit_recipe(rungs, results, recipe, "loss",
                                        (data["fits"][recipe]["loss"] or {}).get("bootstrap_replicates", 0))}
            for recipe in data["recipes"]}
    return draw(path, rungs, results, fits, picture_title(data))


def write_report(args, rungs: list[Rung], sizes: list[Size]) -> str:
    results = {r.name: got for r in rungs if (got := final_figures(r, args.out)) is not None}
    text, data, fits = report(args, rungs, results, sizes)
    write_text_file(args.out / "ladder.md", text)
    write_text_file(args.out / "ladder.json", json.dumps(data, indent=2) + "\n")
    draw(args.out / "ladder.png", rungs, results, fits, picture_title(data))
    return text


# --- the command ----------------------------------------------------------------------------------------

def parse(argv: list[str]):
    parser = ArgumentParser(prog="ladder.py", description=__doc__)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "demo.yaml",
                        help="the base config every rung starts from (default configs/demo.yaml)")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3, 4],
                       help="n_layer = n_head = D, n_embd = 64 x D (default 1 2 3 4)")
    sizes.add_argument("--presets", nargs="+", help=f"model presets instead: {', '.join(PRESETS)}")
    parser.add_argument("--next", help="the size to predict (and train with --check): a depth, or a preset")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--tokens_per_param", type=float, default=20.0,
                        help="tokens trained per parameter N at every size (default 20)")
    budget.add_argument("--flops", type=float, nargs="+",
                        help="FLOPs of each size instead (and of the next; default: the last ratio once more)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337])
    parser.add_argument("--recipes", default="faithful", help=f"one or two of {', '.join(RECIPE_FILES)}, "
                                                              f"comma-separated (default faithful)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a trainer key for every rung (repeat it for more)")
    parser.add_argument("--checkpoints_per_rung", type=int, default=4,
                        help="checkpoints each rung saves, evenly spaced: what a killed rung resumes from (default 4)")
    parser.add_argument("--out", type=Path, default=REPO / "out" / "ladder")
    parser.add_argument("--launch", default="python", choices=["python", "torchrun", "slurm", "slurm-jobs"])
    parser.add_argument("--nproc_per_node", type=int, default=1, help="--launch torchrun: processes per rung")
    parser.add_argument("--sbatch_args", default="", help="--launch slurm: sbatch's options, given with = (they start "
                                                          "with -): --sbatch_args=\"--nodes=1 --gpus-per-node=8\"")
    parser.add_argument("--check", action="store_true", help="then train the next size and check the prediction")
    parser.add_argument("--dry_run", action="store_true", help="print the plan and its estimated time; train nothing")
    parser.add_argument("--hardware", default="auto",
                        help="--dry_run's hardware: cpu (measured) or a GPU name of the MFU table, e.g. H100 "
                             "(default: this machine's)")
    parser.add_argument("--gpus", type=int, default=None, help="--dry_run: GPUs per rung (default --nproc_per_node)")
    parser.add_argument("--mfu", type=float, default=None,
                        help="--dry_run: the MFU assumed on a GPU (default: the one measured for a rung's "
                             "configuration on that GPU model, else 0.4; training/core/gpus.py)")
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap replicates of the fit (default 2000)")
    args = parser.parse_args(argv)
    args.recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    if not 1 <= len(args.recipes) <= 2 or len(set(args.recipes)) != len(args.recipes) \
            or any(r not in RECIPE_FILES for r in args.recipes):
        raise ConfigError(f"--recipes: one or two of {', '.join(RECIPE_FILES)}, got {','.join(args.recipes)!r}")
    for name in ("checkpoints_per_rung", "nproc_per_node"):
        require(getattr(args, name) >= 1, f"--{name}", f"must be at least 1, got {getattr(args, name)}")
    require(args.flops is not None or 0 < args.tokens_per_param < math.inf, "--tokens_per_param",
            f"must be a positive finite number, got {args.tokens_per_param}")
    if args.flops is not None:
        bad = [c for c in args.flops if not 0 < c < math.inf]
        require(not bad, "--flops", f"every budget must be a positive finite number, got {' '.join(map(str, bad))}")
    require(len(set(args.seeds)) == len(args.seeds), "--seeds",
            f"a seed given twice ({' '.join(map(str, args.seeds))})")
    require(args.mfu is None or 0 < args.mfu <= 1, "--mfu", f"must be in (0, 1], got {args.mfu}")
    require(args.bootstrap >= 0, "--bootstrap", f"must be >= 0, got {args.bootstrap}")
    require(args.config.is_file(), "--config", f"no such file {args.config}")
    args.out = args.out.resolve()
    require(args.out.is_dir() or not args.out.exists(), "--out", f"{args.out} is not a folder")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    sizes, next_size = ladder_sizes(args)
    rungs = plan(args, sizes, next_size)
    ladder = [r for r in rungs if not r.check]
    budgets = len({r.flops for r in ladder})
    require(not args.check or budgets >= PARAMETERS, "--check",
            f"the law has {PARAMETERS} parameters and needs rungs at {PARAMETERS} budgets at least; "
            f"{', '.join(s.label for s in sizes)} give {budgets}: there is no prediction to check (add sizes, or "
            f"leave --check out)")
    if args.dry_run:
        times, sources = rung_times(args, rungs)
        print(f"{FLOPS_WORDS}\nTime: each rung's run as train_gpt2.py --estimate works it out (its steps, evaluations, "
              f"checkpoints, and start-up where measured), at a speed that says where it comes from:\n"
              + "\n".join(f"- {source}" for source in sources) + "\n")
        print(plan_table(rungs, times))
        print(f"\nthe ladder: {len(ladder)} runs, {sum(r.flops for r in ladder):.3e} FLOPs, about "
              f"{duration(sum(times[r.name] for r in ladder))}; --check adds {next_size.label}: "
              f"{duration(sum(times[r.name] for r in rungs if r.check))}")
        return 0
    chosen = [r for r in rungs if args.check or not r.check]
    make_folder(args.out)  # before anything trains: an --out that cannot be a folder is one line
    print(plan_table(chosen), flush=True)
    for rung in chosen:  # each rung's config, or a refusal where one differs from the config its folder was made with
        write_rung_config(rung, args.out)
    submit = args.launch in ("slurm", "slurm-jobs")
    if submit:
        if any(final_figures(r, args.out) is None for r in ladder):
            submit_rungs(args, ladder)
            return 0
    elif not train_rungs(args, ladder):
        return 0
    text = write_report(args, rungs, sizes)
    if args.check:
        predictions = [line for line in text.splitlines() if line.startswith("Predicted")]
        for line in text.splitlines():
            if line.startswith("Not finite: "):
                print(line, flush=True)
        if not predictions:  # finished rungs left out as not finite: fewer budgets than the law has parameters
            raise DataError(f"--check: no law to check {next_size.label} against: fewer than {PARAMETERS} budgets "
                            f"have a rung with a finite final val loss ({args.out / 'ladder.md'} names those left "
                            f"out); nothing was trained for the check")
        # the prediction is on disk (ladder.md, ladder.json) before the next size trains
        print(f"ladder: {args.out / 'ladder.md'} holds the prediction for {next_size.label} before it trains:\n"
              + "\n".join(predictions), flush=True)
        if submit:
            if any(final_figures(r, args.out) is None for r in rungs if r.check):
                submit_rungs(args, [r for r in rungs if r.check])
                return 0
        elif not train_rungs(args, [r for r in rungs if r.check]):
            return 0
        text = write_report(args, rungs, sizes)
    print(text, end="")
    print(f"ladder: {args.out / 'ladder.md'}, ladder.json and ladder.png written", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
