"""Evaluate a checkpoint with EleutherAI's lm-evaluation-harness (`pip install lm_eval`), or make its report card.

    python eval_lm.py out/gpt2_124m --tasks hellaswag,arc_easy,piqa --batch_size 32
    python eval_lm.py out/demo/checkpoints/step_00000400.pt --tasks lambada_openai --limit 500 --device cpu
    python eval_lm.py out/gpt2_124m --card              # the report card: RUN/report.md and report.json
    python eval_lm.py gpt2 --card --data_dir data/edu_fineweb10B --out_dir out/gpt2_card   # OpenAI's GPT-2
    python eval_lm.py out/demo --card --tasks none      # the card's val loss and bits per byte alone

--card scores a fixed zero-shot suite (evals/report_card.py: hellaswag acc_norm, arc_easy acc,
arc_challenge acc_norm, piqa acc, winogrande acc, lambada_openai acc) and the val loss and bits per
byte of the run's own val sets (a checkpoint's config: data_dir or val_sets, seq_len, val_tokens;
--data_dir, --seq_len and --val_tokens change them), each figure with its 95% interval and the
number of examples or val rows. It writes report.md and report.json (report_ema.* for --weights
ema) into the run folder (or --out_dir) and prints the card. Its checkpoint may also be a GPT-2
preset name (gpt2, gpt2-medium, gpt2-large, gpt2-xl: OpenAI's weights, downloaded once into the
Hugging Face cache) or a Hugging Face GPT-2 folder: give --data_dir and --out_dir, and your run's
seq_len and val_tokens, for figures comparable with your run's card. `--tasks a,b` replaces the
suite, `--tasks task:metric` shows another metric of a task, `--tasks none` leaves the tasks out.

The checkpoint (a .pt file, or a run folder: its newest readable checkpoint) is scored by
evals/lm_eval_harness.py, an lm_eval model class around our GPT: no export step, and it scores
exactly as the trainer's in-loop HellaSwag does (see that module for why). Results are

- printed as a table (task, metric, value, standard error, examples scored);
- written to RUN_FOLDER/lm_eval/step_XXXXXXXX.json, one entry per task with its metrics, the
  lm_eval version, limit and few-shot count; evaluating the same checkpoint on other tasks
  later adds to the file, and re-running a task replaces its entry;
- logged into the run's own W&B run when it used W&B (its config has wandb true and the
  checkpoint a W&B run id): `lm_eval/<task>/<metric>`, plotted against `lm_eval/step`, the
  checkpoint's step. W&B's own step only moves forward, so a separate step key is what lets an
  evaluation of an older checkpoint land at its step.

lm_eval downloads each task's data from the Hugging Face Hub on first use, into the datasets
cache (HF_DATASETS_CACHE); on an offline node fill the cache elsewhere. Where the Hub cannot be
reached, eval_lm.py says so in one line and reads the cache alone (no retries). Every task's data
is loaded before anything is scored (the card: before its val figures): the tasks whose data is
not there are one error line naming them all. The model is evaluated in the precision its run
trained in (the checkpoint config's dtype; `auto` as the trainer resolves it on this device;
--dtype chooses another). Long evaluations print a progress line about every 30 seconds, and the
card a line per task; progress bars (lm_eval's, the datasets library's) only where stderr is a
terminal. A card cut short (Ctrl-C, a task that fails as it is scored) is written with what it
has, naming the figures it lacks. `--include_path DIR` adds task YAML files of your own, such as
tests/fixtures/lm_eval/ (HellaSwag-format data from a local file, and the trainer's
token-normalised acc_norm as an lm_eval metric).
"""

from __future__ import annotations

# ruff: noqa: E402 (the arguments are checked before the imports that take seconds)
import common.startup  # noqa: F401 - first: a Ctrl-C while the modules below load is one line

import argparse
from pathlib import Path

from common.errors import ArgumentParser, check_before_imports
from common.settings import path_argument, require
from training.checkpoint.settings import WEIGHTS


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    """The arguments, with every check that needs nothing but them: made before the imports below (torch, the
    training stack: seconds) as the script starts, and again by main (tests call it directly)."""
    parser = ArgumentParser(prog="eval_lm.py", description=__doc__)
    parser.add_argument("ckpt", type=path_argument,
                        help="checkpoint .pt file, or a run folder (its newest readable checkpoint); with "
                             "--card also a GPT-2 preset name (gpt2, ...) or a Hugging Face GPT-2 folder")
    parser.add_argument("--tasks", default=None,
                        help="comma-separated lm_eval task, group or tag names (`lm-eval ls tasks` lists them); "
                             "needed without --card. With --card: the suite's tasks unless given, none for no task, "
                             "task:metric for the metric its card row shows (default acc)")
    parser.add_argument("--card", action="store_true",
                        help="the report card: val loss and bpb and the zero-shot suite, with 95%% intervals, into "
                             "report.md and report.json")
    parser.add_argument("--data_dir", default=None, type=path_argument,
                        help="with --card: the folder (or val shard) whose val split to score (default: the run's own "
                             "val sets; needed for a Hugging Face model); none: no val figures")
    parser.add_argument("--seq_len", type=int, default=None,
                        help="with --card: tokens per val row (default: the run's seq_len; for a Hugging Face model "
                             "the trainer's default, 1024)")
    parser.add_argument("--val_tokens", type=int, default=None,
                        help="with --card: tokens of the val window (default: the run's val_tokens; for a Hugging Face "
                             "model the trainer's default, 10,485,760)")
    parser.add_argument("--batch_size", type=int, default=16, help="rows per forward pass (default 16)")
    parser.add_argument("--device", default="auto", help="auto, cuda, cuda:N, mps or cpu")
    parser.add_argument("--dtype", default=None, choices=["auto", "bfloat16", "float16", "float32", "float64"],
                        help="default: the run's own (its config's dtype, so the figures are those its run logs; "
                             "auto for a Hugging Face model); auto: as the trainer picks it on this device "
                             "(bfloat16 autocast on CUDA and on CPUs with native bf16, float32 elsewhere)")
    parser.add_argument("--limit", type=int, default=None, help="score only the first N examples of each task")
    parser.add_argument("--num_fewshot", type=int, default=None, help="few-shot examples (default: each task's own)")
    parser.add_argument("--include_path", default=None, type=path_argument, help="a folder of extra task YAML files")
    parser.add_argument("--out_dir", default=None, type=path_argument,
                        help="where lm_eval/step_XXXXXXXX.json goes (default: the checkpoint's run folder)")
    parser.add_argument("--weights", default="live", choices=WEIGHTS,
                        help="live (the trained weights) or ema (the checkpoint's EMA of them: its results are "
                             "keyed ema/<task>)")
    parser.add_argument("--wandb_mode", default=None, choices=["online", "offline", "disabled"],
                        help="W&B mode for runs that used W&B (default: the run's own)")
    args = parser.parse_args(argv)
    for name, low in (("batch_size", 1), ("limit", 1), ("num_fewshot", 0), ("seq_len", 1), ("val_tokens", 1)):
        value = getattr(args, name)
        require(value is None or value >= low, f"--{name}", f"must be >= {low}, got {value}")
    require(not args.include_path or Path(args.include_path).is_dir(), "--include_path",
            f"{args.include_path} is not a folder")
    if not args.card:
        for name in ("data_dir", "seq_len", "val_tokens"):
            require(getattr(args, name) is None, f"--{name}", "only for the report card (--card)")
        require(args.tasks is not None, "--tasks", "needed without --card (comma-separated lm_eval task names)")
        require(any(name.strip() for name in args.tasks.split(",")), "--tasks", "no task names given")
    return args


check_before_imports(__name__, parse_arguments)  # as a script: a mistake in the arguments is one line now

import datetime
import difflib
import functools
import json
import math
import os
import socket
import sys
import time
from importlib import metadata
from urllib.parse import urlparse

from data.loader import ValLoader
from data.settings import parse_val_sets
from data.tokenizer import GPT2_VOCAB_SIZE, get_tokenizer, token_byte_lengths
from common.errors import CheckpointError, ConfigError, DataError, WriteError, first_line, run_cli
from evals.report_card import DEFAULT_METRIC, SUITE, build_card, card_markdown, task_figure, val_figures
from evals.val_loss import val_row_losses
from hf_interop.convert import load_hf_gpt2
from model import PRESETS
from runtime import storage
from training.checkpoint.folder import CHECKPOINT_DIR, read_model
from runtime.process_group import DistEnv
from runtime.logger import format_duration, wandb_mode_of, write_text_file
from launch.config import parse_args as trainer_defaults
from runtime.runtime import resolve_runtime

RESULTS_DIR = "lm_eval"  # inside the run folder
WANDB_PREFIX = "lm_eval"
REPORT = "report"  # the card's files: RUN/report.md and RUN/report.json (report_ema.* for the EMA weights)
HUB_PROBE_TIMEOUT_S = 5.0
PROGRESS_EVERY_S = 30.0


def main(argv: list[str]) -> int:
    args = parse_arguments(argv)
    if args.card:
        return report_card(args)
    tasks = [name.strip() for name in args.tasks.split(",") if name.strip()]
    require(not is_hf_model(args.ckpt), args.ckpt, "a Hugging Face model is evaluated with --card here, or with "
                                                   "lm_eval's own `--model hf` (docs/INTEROP.md)")
    check_checkpoint_argument(args)

    lm_eval = import_lm_eval()
    from lm_eval.tasks import TaskManager
    from evals.lm_eval_harness import GPTLM

    task_manager = task_manager_for(tasks, args.include_path, TaskManager)
    check_tasks(tasks, task_manager.all_tasks)
    loaded = load_tasks({name: name for name in tasks}, task_manager, hub_offline())  # before the model: one line
    model, state, path = read_model(args.ckpt, "eval_lm.py", args.weights)
    state.pop("model", None)  # the model holds the weights now
    if model.config.vocab_size < GPT2_VOCAB_SIZE:
        raise CheckpointError(f"{path}: the model has vocab_size {model.config.vocab_size}; lm-eval tasks are "
                              f"tokenized with GPT-2's tokenizer, which needs {GPT2_VOCAB_SIZE}")
    runtime = resolve_runtime(args.device, eval_dtype(args.dtype, state.get("config")), compile=False,
                              loss_chunk_size=0)
    model.to(runtime.device, dtype=runtime.weights_dtype)
    print(f"# evaluating step {state['step']} of {path} on {', '.join(tasks)} ({runtime.device}, {runtime.dtype})",
          flush=True)
    lm = GPTLM(model, get_tokenizer(), runtime.device, batch_size=args.batch_size, autocast=runtime.autocast(),
               progress=ProgressLine(", ".join(tasks)))
    results = evaluate_tasks(lm_eval, lm, [task for name in tasks for task in loaded[name]], task_manager,
                             args.limit, args.num_fewshot)
    settings = eval_settings(args, runtime)
    entries = task_entries(results, settings)
    if args.weights == "ema":  # beside the live weights' figures in the same file and W&B run, never over them
        entries = {f"ema/{task}": {**entry, "weights": "ema"} for task, entry in entries.items()}
    out_dir = Path(args.out_dir) if args.out_dir else run_folder(path)
    written = write_results(out_dir, path, state, entries)
    print(format_table(entries))
    print(f"results: {written}")
    if run_id := log_to_wandb(state, entries, out_dir, args.wandb_mode):
        print(f"logged to W&B run {run_id}")
    return 0


def check_checkpoint_argument(args) -> None:
    """A checkpoint that is not there, or one at a URL without --out_dir: one line, before the slow task index."""
    if not storage.exists(storage.as_location(args.ckpt)):
        raise CheckpointError(f"{args.ckpt}: no such checkpoint file or run folder")
    require(args.out_dir or not storage.is_url(args.ckpt), "--out_dir",
            f"needed for a checkpoint at a URL ({args.ckpt}): where the results go")


def is_hf_model(ckpt: str) -> bool:
    """A GPT-2 preset name (OpenAI's weights) or a Hugging Face GPT-2 folder, rather than one of our checkpoints."""
    return ckpt in PRESETS or (not storage.is_url(ckpt) and (Path(ckpt) / "config.json").is_file())


def eval_settings(args, runtime) -> dict:
    """How the evaluation ran, stored beside its figures."""
    return dict(lm_eval_version=metadata.version("lm_eval") if lm_eval_installed() else None, limit=args.limit,
                batch_size=args.batch_size, device=str(runtime.device), dtype=runtime.dtype,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def lm_eval_installed() -> bool:
    try:
        metadata.version("lm_eval")
    except metadata.PackageNotFoundError:
        return False
    return True


def hub_offline() -> bool:
    """Whether task data comes from the datasets cache alone: HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set,
    or the Hub (HF_ENDPOINT, default huggingface.co) cannot be reached.

    Unreachable, both are set here, in the environment and in the libraries' settings where already
    imported: datasets would otherwise retry each of a task's files for about half a minute before it
    gives up, and with them a task whose data is cached loads at once and one that is not fails at once.
    """
    flags = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    if any(os.environ.get(flag, "").upper() in ("1", "ON", "YES", "TRUE") for flag in flags):
        return True
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=HUB_PROBE_TIMEOUT_S).close()
        return False
    except OSError as e:
        reason = e.strerror or type(e).__name__
    for flag in flags:
        os.environ[flag] = "1"
    for module, names in (("huggingface_hub.constants", flags[:1]), ("datasets.config", flags)):
        for name in names if module in sys.modules else ():
            setattr(sys.modules[module], name, True)
    print(f"note: {endpoint.hostname} cannot be reached ({reason}): task data comes from the datasets cache alone",
          flush=True)
    return True


def eval_dtype(requested: str | None, config: dict | None) -> str:
    """The precision to evaluate in: --dtype, else the run's own (its config's dtype: what its logged figures were
    computed in; `auto` resolves as the trainer resolves it, for this device), else auto (a Hugging Face model)."""
    return requested if requested is not None else (config or {}).get("dtype", "auto")


def load_tasks(tasks: dict[str, str], task_manager, offline: bool, spare: str = "") -> dict[str, list]:
    """Each task's lm_eval objects with their data loaded, before anything is scored: {name: [Task or Group]}.

    tasks: {name: how --tasks writes it}. Loading a task loads its data (from the datasets cache alone where
    offline). Every task whose data cannot be had is named in one DataError line, which ends with what still
    works: the --tasks of the others, and spare (the card's "--tasks none")."""
    loaded, uncached, problems, reason = {}, [], [], ""
    for name in tasks:
        try:
            found = task_manager.load([name])
        except ConnectionError as e:  # datasets' "Couldn't reach ... on the Hub": offline, and not in the cache
            uncached.append(name)
            reason = reason or first_line(e, 120)
        except FileNotFoundError as e:  # a task YAML's data_files that do not resolve (from the working directory)
            problems.append(f"{name}: data file not found ({e}); a relative data_files path in a task YAML is read "
                            f"from the working directory ({Path.cwd()})")
        else:  # a group stays one (its own figures aggregate its tasks'); a task or a tag's tasks, each
            loaded[name] = [found["groups"][name]] if name in found["groups"] else list(found["tasks"].values())
    if uncached:
        cache = os.environ.get("HF_DATASETS_CACHE") or "the datasets cache"
        where = "the Hugging Face Hub cannot be reached" if offline else "it could not be downloaded"
        data = "the task's data is" if len(uncached) == 1 else "their data is"
        problems.insert(0, f"{', '.join(uncached)}: {data} not in {cache} and {where} ({reason}); run once where "
                           f"the Hub is reachable to fill the cache, then HF_DATASETS_OFFLINE=1 works")
    if problems:
        instead = ([f"--tasks {','.join(tasks[name] for name in loaded)} scores the others"] if loaded else []) + \
            ([spare] if spare else [])
        raise DataError("--tasks: " + "; ".join(problems + ([", ".join(instead)] if instead else [])))
    return loaded


def evaluate_tasks(lm_eval, lm, tasks: list, task_manager, limit: int | None, num_fewshot: int | None) -> dict:
    """lm_eval.simple_evaluate on loaded tasks (load_tasks): their data is there already."""
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=task_manager, limit=limit,
                                   num_fewshot=num_fewshot, log_samples=False)


class ProgressLine:
    """GPTLM's progress callback: a console line at most every `every` seconds while requests are scored,
    with what is done, the time so far and an estimate of the time left."""

    def __init__(self, label: str, every: float = PROGRESS_EVERY_S, clock=time.monotonic, out=print):
        self.label, self.every, self.clock, self.out = label, every, clock, out
        self.start = self.last = clock()

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if now - self.last < self.every or not 0 < done < total:
            return
        self.last = now
        elapsed = now - self.start
        self.out(f"{self.label}: {done:,} of {total:,} requests scored ({done / total:.0%}), "
                 f"{format_duration(elapsed)} so far, about {format_duration(elapsed * (total - done) / done)} left",
                 flush=True)


def card_tasks(text: str | None) -> dict[str, str]:
    """--tasks of the card as {task: metric}: the suite by default, {} for none."""
    if text is None:
        return dict(SUITE)
    if text.strip() == "none":
        return {}
    tasks = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        task, _, metric = part.partition(":")
        tasks[task.strip()] = metric.strip() or SUITE.get(task.strip(), DEFAULT_METRIC)
    require(tasks, "--tasks", "no task names given (none: the card without tasks)")
    return tasks


def load_card_model(args):
    """(model on the CPU, the card's description of it, the trainer config it was trained with or None,
    the folder its report goes to)."""
    if is_hf_model(args.ckpt):
        require(args.weights == "live", "--weights",
                f"{args.weights} needs one of our checkpoints; {args.ckpt} has its weights only")
        require(args.out_dir, "--out_dir", f"needed for {args.ckpt}: where report.md and report.json go")
        model = load_hf_gpt2(args.ckpt)
        return model, {"name": f"Hugging Face GPT-2 {args.ckpt}", "hf_model": args.ckpt}, None, Path(args.out_dir)
    model, state, path = read_model(args.ckpt, "eval_lm.py", args.weights)
    name = f"step {state['step']} of {path}" + (" (EMA weights)" if args.weights == "ema" else "")
    described = {"name": name, "checkpoint": str(path), "step": state["step"], "tokens_seen": state.get("tokens_seen"),
                 "weights": args.weights}
    return model, described, state.get("config"), Path(args.out_dir) if args.out_dir else run_folder(path)


def card_val_window(args, config: dict | None, block_size: int) -> tuple[dict[str, str], int, int]:
    """(the val sets to score {name: folder or shard}, seq_len, val_tokens) of the card."""
    if args.data_dir == "none":
        return {}, 0, 0
    require(args.data_dir is not None or config is not None, "--data_dir", f"needed for {args.ckpt}'s val loss and "
            f"bpb (the folder whose val split to score, your run's data_dir to compare; none leaves them out)")
    defaults = config or trainer_defaults([]).to_dict()
    sets = {"val": args.data_dir} if args.data_dir else parse_val_sets(defaults.get("val_sets") or "",
                                                                        defaults["data_dir"])
    seq_len = args.seq_len or (defaults["seq_len"] if config else min(defaults["seq_len"], block_size))
    require(seq_len <= block_size, "--seq_len", f"{seq_len} exceeds the model's block_size {block_size}")
    return sets, seq_len, args.val_tokens or defaults["val_tokens"]


def report_card(args) -> int:
    """eval_lm.py --card: see the module docstring."""
    tasks = card_tasks(args.tasks)
    require(not args.num_fewshot, "--num_fewshot", f"the report card is zero-shot, got {args.num_fewshot}")
    require(args.wandb_mode is None, "--wandb_mode",
            "the report card logs nothing to W&B (its files are report.md and report.json)")
    if not is_hf_model(args.ckpt):
        check_checkpoint_argument(args)
    if tasks:  # the task names first: a typo is one line before the model loads
        lm_eval = import_lm_eval()
        from lm_eval.tasks import TaskManager
        from evals.lm_eval_harness import GPTLM

        task_manager = task_manager_for(list(tasks), args.include_path, TaskManager)
        check_tasks(list(tasks), task_manager.all_tasks)
        # every task's data and metric before the model loads: a missing one is one line before anything slow
        specs = {task: task if metric == SUITE.get(task, DEFAULT_METRIC) else f"{task}:{metric}"
                 for task, metric in tasks.items()}
        loaded = load_tasks(specs, task_manager, hub_offline(), spare="--tasks none the card's val figures alone")
        for task, metric in tasks.items():
            check_metric(task, metric, loaded[task])
    model, described, config, out_dir = load_card_model(args)
    sets, seq_len, val_tokens = card_val_window(args, config, model.config.block_size)
    if tasks and model.config.vocab_size < GPT2_VOCAB_SIZE:
        raise CheckpointError(f"{args.ckpt}: the model has vocab_size {model.config.vocab_size}; lm-eval tasks are "
                              f"tokenized with GPT-2's tokenizer, which needs {GPT2_VOCAB_SIZE} (--tasks none: the "
                              f"val figures alone)")
    runtime = resolve_runtime(args.device, eval_dtype(args.dtype, config), compile=False, loss_chunk_size=0)
    model.to(runtime.device, dtype=runtime.weights_dtype).eval()
    print(f"# report card of {described['name']} ({runtime.device}, {runtime.dtype})", flush=True)
    settings = eval_settings(args, runtime)
    name = REPORT + ("_ema" if args.weights == "ema" else "")

    val, scored = [], {}
    try:
        env = DistEnv(rank=0, local_rank=0, world_size=1, device=runtime.device, distributed=False)
        for set_name, data in sets.items():
            start = time.monotonic()
            loader = ValLoader(data, seq_len, val_tokens, args.batch_size)
            rows = val_row_losses(model, loader, env, runtime.autocast())
            figures = val_figures(set_name, str(data), rows, seq_len, loader.target_bytes(token_byte_lengths()))
            val.append(figures)
            bpb, took = figures["bpb"]["value"], format_duration(time.monotonic() - start)
            print(f"val{'' if set_name == 'val' else ' ' + set_name}: loss {figures['loss']['value']:.4f}"
                  + ("" if bpb is None else f", {bpb:.4f} bpb")
                  + f" over {figures['rows']:,} rows of {seq_len:,} tokens ({took})", flush=True)
        lm = GPTLM(model, get_tokenizer(), runtime.device, batch_size=args.batch_size,
                   autocast=runtime.autocast()) if tasks else None
        for i, (task, metric) in enumerate(tasks.items(), 1):
            label, start = f"[{i}/{len(tasks)}] {task}", time.monotonic()
            lm.progress = ProgressLine(label)
            entries = task_entries(evaluate_tasks(lm_eval, lm, loaded[task], task_manager, args.limit, 0), settings)
            entry = entries.get(task) or next(iter(entries.values()))
            if metric not in entry["metrics"]:  # a group's, or a filter's name: known once scored
                names = ", ".join(m for m in entry["metrics"] if "_stderr" not in m)
                raise ConfigError(f"--tasks: {task} has no metric {metric!r} (it has {names})")
            figure = scored[task] = task_figure(task, metric, entry)
            interval = "" if figure["ci95"] is None else f" ({figure['ci95'][0]:.4f}-{figure['ci95'][1]:.4f})"
            print(f"{label}: {metric} {figure['value']:.4f}{interval} on {figure['n']} examples "
                  f"({format_duration(time.monotonic() - start)})", flush=True)
    except BaseException:  # a task that fails as it is scored, or Ctrl-C: the figures made so far are kept
        if val or scored:
            done = {figures["set"] for figures in val}
            not_scored = [("val" if s == "val" else f"val {s}") for s in sets if s not in done] + \
                [task for task in tasks if task not in scored]
            written = write_card(build_card(described, settings, val, scored, not_scored), out_dir, name)
            print(f"partial card written, without {', '.join(not_scored)}: {written}.md, {written}.json",
                  flush=True)
        raise
    card = build_card(described, settings, val, scored)
    written = write_card(card, out_dir, name)
    print(card_markdown(card) + f"\nwritten: {written}.md, {written}.json")
    return 0


def write_card(card: dict, out_dir: Path, name: str) -> Path:
    """OUT_DIR/NAME.json and OUT_DIR/NAME.md; OUT_DIR/NAME."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WriteError(f"{out_dir}: cannot create ({e.strerror or e})") from None
    write_text_file(out_dir / f"{name}.json", json.dumps(card, indent=2) + "\n")
    write_text_file(out_dir / f"{name}.md", card_markdown(card))
    return out_dir / name


def check_metric(task: str, metric: str, loaded: list) -> None:
    """A card metric that a task does not compute is one line before anything is scored. (Only a task's metrics
    are known before it is scored: a group's or a tag's are checked once scored.)"""
    from lm_eval.api.task import Task

    if len(loaded) == 1 and isinstance(loaded[0], Task):
        names = list(loaded[0].aggregation())  # lm_eval's metric names; a filter's "name/filter" ends in one
        require(metric.partition("/")[0] in names, "--tasks",
                f"{task} has no metric {metric!r} (it has {', '.join(names)})")


def import_lm_eval():
    """lm_eval, imported only here: training never needs it, and GPU images may lack it."""
    try:
        import lm_eval
    except ImportError:
        raise ConfigError("eval_lm.py needs lm-evaluation-harness: pip install 'lm_eval>=0.4'") from None
    progress_bars_on_terminal_only()
    return lm_eval


def progress_bars_on_terminal_only() -> None:
    """tqdm's bars (lm_eval's as it builds a task's requests, the datasets library's as it loads data) drawn only
    where stderr is a terminal: a log file keeps every carriage-return redraw of a bar as a line of its own, even
    for a task that takes under a second. disable=None is tqdm's own rule for that (prep/fineweb.py's bar passes
    it); the libraries pass no `disable`, so it becomes the default of tqdm's constructor in this process, as a
    TQDM_DISABLE variable would (tqdm reads those only when it is imported, which torch does first)."""
    from tqdm import std

    std.tqdm.__init__ = functools.partialmethod(std.tqdm.__init__, disable=None)


def task_manager_for(tasks: list[str], include_path: str | None, task_manager_class):
    """lm_eval's task index for these tasks: of include_path alone when it holds them all.

    Indexing lm_eval's thousands of built-in task files takes about 10 s; a user's own tasks
    (--include_path) do not need them.
    """
    if include_path:
        own = task_manager_class(include_path=include_path, include_defaults=False)
        if all(name in own.all_tasks for name in tasks):
            return own
    return task_manager_class(include_path=include_path)


def check_tasks(tasks: list[str], known: list[str]) -> None:
    """Refuse names lm_eval does not know (before the model loads), with the closest known names."""
    for name in tasks:
        if name in known or (name.endswith((".yaml", ".yml")) and Path(name).is_file()):
            continue
        close = difflib.get_close_matches(name, known, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else "`lm-eval ls tasks` lists them"
        raise ConfigError(f"--tasks: unknown task {name!r} ({hint})")


def run_folder(ckpt: Path) -> Path:
    """The run folder of OUT_DIR/checkpoints/step_X[.pt]; the checkpoint's own folder for a loose one."""
    return ckpt.parent.parent if ckpt.parent.name == CHECKPOINT_DIR else ckpt.parent


def task_entries(results: dict, settings: dict) -> dict[str, dict]:
    """{task: {"metrics": {name: value}, "n": examples scored, "num_fewshot", "version", **settings}}.

    lm_eval keys a metric as "name,filter" ("acc,none", "exact_match,strict-match"); the
    filter is kept only where it is not the default "none". Non-numeric entries (the alias,
    "N/A" standard errors) are left out; NaN (the standard error of one example) becomes None.
    """
    entries = {}
    for task, values in results["results"].items():
        metrics = {}
        for key, value in values.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name, filter_name = key.split(",", 1)
            name = name if filter_name == "none" else f"{name}/{filter_name}"
            metrics[name] = value if math.isfinite(value) else None
        entries[task] = {
            "metrics": metrics,
            "n": results.get("n-samples", {}).get(task, {}).get("effective"),  # None for a group
            "num_fewshot": results.get("n-shot", {}).get(task),
            "version": results.get("versions", {}).get(task),
            **settings,
        }
    return entries


def write_results(out_dir: Path, ckpt: Path, state: dict, entries: dict[str, dict]) -> Path:
    """Merge entries into OUT_DIR/lm_eval/step_XXXXXXXX.json (atomically); its path."""
    path = out_dir / RESULTS_DIR / f"step_{state['step']:08d}.json"
    record = {"checkpoint": str(ckpt.resolve()), "step": state["step"], "tokens_seen": state.get("tokens_seen"),
              "tasks": {}}
    if path.is_file():
        try:
            previous = json.loads(path.read_text())
            tasks = previous.get("tasks") if isinstance(previous, dict) else None
            if isinstance(tasks, dict):  # another shape is no results file of ours: replaced, like an unreadable one
                record["tasks"] = tasks
        except (OSError, json.JSONDecodeError):
            pass  # an unreadable earlier file is replaced, not merged
    record["tasks"].update(entries)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WriteError(f"{path.parent}: cannot create ({e.strerror or e})") from None
    write_text_file(path, json.dumps(record, indent=2) + "\n")
    return path


def format_table(entries: dict[str, dict]) -> str:
    """A Markdown table: one row per metric, its standard error beside it."""
    lines = ["| task | metric | value | stderr | n |", "| --- | --- | ---: | ---: | ---: |"]
    for task, entry in entries.items():
        metrics = entry["metrics"]
        for name, value in metrics.items():
            if name.partition("/")[0].endswith("_stderr"):
                continue
            base, _, filter_name = name.partition("/")
            stderr = metrics.get(f"{base}_stderr/{filter_name}" if filter_name else f"{base}_stderr")
            n = "" if entry["n"] is None else entry["n"]
            lines.append(f"| {task} | {name} | {_number(value)} | {_number(stderr)} | {n} |")
    return "\n".join(lines)


def _number(value) -> str:
    if value is None:
        return ""
    return f"{value:.4f}" if isinstance(value, float) and math.isfinite(value) else str(value)


def log_to_wandb(state: dict, entries: dict[str, dict], out_dir: Path, mode: str | None) -> str | None:
    """Log the metrics into the checkpoint's own W&B run; its id, or None when the run had none.

    The run is resumed by id (project and mode from the checkpoint's config, mode overridable),
    with its files under out_dir/wandb like the trainer's.
    """
    config = state.get("config") or {}
    run_id = state.get("wandb_run_id")
    mode = mode or wandb_mode_of(config.get("wandb_mode"))  # the run's, WANDB_MODE's where the run took it
    if not (config.get("wandb") and run_id) or mode == "disabled":
        return None
    try:
        import wandb  # lazily, as in training: only runs that used W&B need it
    except ImportError:
        raise ConfigError(f"the run logged to W&B run {run_id}; logging there needs wandb (pip install wandb), "
                          f"or pass --wandb_mode disabled") from None
    metrics = {f"{WANDB_PREFIX}/{task}/{name}": value
               for task, entry in entries.items() for name, value in entry["metrics"].items() if value is not None}
    try:
        run = wandb.init(project=config.get("wandb_project"), id=run_id, resume="allow", mode=mode, dir=str(out_dir))
        run.define_metric(f"{WANDB_PREFIX}/step")
        run.define_metric(f"{WANDB_PREFIX}/*", step_metric=f"{WANDB_PREFIX}/step")
        run.log({f"{WANDB_PREFIX}/step": state["step"], **metrics})
        run.finish()
    except Exception as e:  # network, authentication, W&B service: the results file is already written
        raise WriteError(f"W&B: could not log to run {run_id} ({first_line(e, 160)}); "
                         f"the results file is written") from None
    return run_id


if __name__ == "__main__":
    sys.exit(run_cli(main))
