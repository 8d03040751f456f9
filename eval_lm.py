"""Evaluate a checkpoint with EleutherAI's lm-evaluation-harness (`pip install lm_eval`).

    python eval_lm.py out/gpt2_124m --tasks hellaswag,arc_easy,piqa --batch_size 32
    python eval_lm.py out/demo/checkpoints/step_00000400.pt --tasks lambada_openai --limit 500 --device cpu

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
cache (HF_DATASETS_CACHE); on an offline node fill the cache elsewhere and set
HF_DATASETS_OFFLINE=1. `--include_path DIR` adds task YAML files of your own, such as
tests/fixtures/lm_eval/ (HellaSwag-format data from a local file, and the trainer's
token-normalised acc_norm as an lm_eval metric).
"""

from __future__ import annotations

import datetime
import difflib
import json
import math
from importlib import metadata
import sys
from pathlib import Path

from data.tokenizer import GPT2_VOCAB_SIZE, get_tokenizer
from common.errors import ArgumentParser, CheckpointError, ConfigError, DataError, WriteError, first_line, run_cli
from training.checkpoint import storage
from training.checkpoint.folder import CHECKPOINT_DIR, WEIGHTS, read_model
from training.observe.logger import write_text_file
from training.train.runtime import resolve_runtime

RESULTS_DIR = "lm_eval"  # inside the run folder
WANDB_PREFIX = "lm_eval"


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="eval_lm.py", description=__doc__)
    parser.add_argument("ckpt", help="checkpoint .pt file, or a run folder (its newest readable checkpoint)")
    parser.add_argument("--tasks", required=True,
                        help="comma-separated lm_eval task, group or tag names (`lm-eval ls tasks` lists them)")
    parser.add_argument("--batch_size", type=int, default=16, help="rows per forward pass (default 16)")
    parser.add_argument("--device", default="auto", help="auto, cuda, cuda:N, mps or cpu")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float64"],
                        help="auto: as the trainer picks it (bfloat16 autocast on CUDA and on CPUs with native "
                             "bf16, float32 elsewhere); float32 to compare with an in-loop eval run in float32")
    parser.add_argument("--limit", type=int, default=None, help="score only the first N examples of each task")
    parser.add_argument("--num_fewshot", type=int, default=None, help="few-shot examples (default: each task's own)")
    parser.add_argument("--include_path", default=None, help="a folder of extra task YAML files")
    parser.add_argument("--out_dir", default=None,
                        help="where lm_eval/step_XXXXXXXX.json goes (default: the checkpoint's run folder)")
    parser.add_argument("--weights", default="live", choices=WEIGHTS,
                        help="live (the trained weights) or ema (the checkpoint's EMA of them: its results are "
                             "keyed ema/<task>)")
    parser.add_argument("--wandb_mode", default=None, choices=["online", "offline", "disabled"],
                        help="W&B mode for runs that used W&B (default: the run's own)")
    args = parser.parse_args(argv)
    tasks = [name.strip() for name in args.tasks.split(",") if name.strip()]
    if not tasks:
        raise ConfigError("--tasks: no task names given")
    for name, low in (("batch_size", 1), ("limit", 1), ("num_fewshot", 0)):
        value = getattr(args, name)
        if value is not None and value < low:
            raise ConfigError(f"--{name}: must be >= {low}, got {value}")
    if not storage.exists(storage.as_location(args.ckpt)):  # before the slow task index: a typo should fail at once
        raise CheckpointError(f"{args.ckpt}: no such checkpoint file or run folder")
    if storage.is_url(args.ckpt) and not args.out_dir:
        raise ConfigError(f"--out_dir: needed for a checkpoint at a URL ({args.ckpt}): where the results go")
    if args.include_path and not Path(args.include_path).is_dir():
        raise ConfigError(f"--include_path: {args.include_path} is not a folder")

    lm_eval = import_lm_eval()
    from lm_eval.tasks import TaskManager
    from evals.lm_eval_harness import GPTLM

    task_manager = task_manager_for(tasks, args.include_path, TaskManager)
    check_tasks(tasks, task_manager.all_tasks)
    runtime = resolve_runtime(args.device, args.dtype, compile=False, loss_chunk_size=0)
    model, state, path = read_model(args.ckpt, "eval_lm.py", args.weights)
    state.pop("model", None)  # the model holds the weights now
    if model.config.vocab_size < GPT2_VOCAB_SIZE:
        raise CheckpointError(f"{path}: the model has vocab_size {model.config.vocab_size}; lm-eval tasks are "
                              f"tokenized with GPT-2's tokenizer, which needs {GPT2_VOCAB_SIZE}")
    model.to(runtime.device, dtype=runtime.weights_dtype)
    lm = GPTLM(model, get_tokenizer(), runtime.device, batch_size=args.batch_size, autocast=runtime.autocast())
    print(f"# evaluating step {state['step']} of {path} on {', '.join(tasks)} ({runtime.device}, {runtime.dtype})",
          flush=True)
    try:
        results = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=task_manager, limit=args.limit,
                                          num_fewshot=args.num_fewshot, log_samples=False)
    except ConnectionError as e:  # datasets' "Couldn't reach ... on the Hub", offline or not cached
        raise DataError(f"--tasks: could not load a task's data ({e}); run once where the Hugging Face Hub "
                        f"is reachable to fill the datasets cache, then HF_DATASETS_OFFLINE=1 works") from None
    except FileNotFoundError as e:  # a task YAML's data_files that do not resolve (from the working directory)
        task = task_missing_data(tasks, task_manager) or ", ".join(tasks)
        raise DataError(f"--tasks: {task}: data file not found ({e}); a relative data_files path in a task YAML "
                        f"is read from the working directory ({Path.cwd()})") from None

    settings = dict(lm_eval_version=metadata.version("lm_eval"), limit=args.limit, batch_size=args.batch_size,
                    device=str(runtime.device), dtype=runtime.dtype,
                    date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    entries = task_entries(results, settings)
    if args.weights == "ema":  # beside the live weights' figures in the same file and W&B run, never over them
        entries = {f"ema/{task}": {**entry, "weights": "ema"} for task, entry in entries.items()}
    out_dir = Path(args.out_dir) if args.out_dir else run_folder(path)
    written = write_results(out_dir, path, state, entries)
    print(format_table(entries))
    print(f"results: {written}")
    run_id = log_to_wandb(state, entries, out_dir, args.wandb_mode)
    if run_id:
        print(f"logged to W&B run {run_id}")
    return 0


def import_lm_eval():
    """lm_eval, imported only here: training never needs it, and GPU images may lack it."""
    try:
        import lm_eval
    except ImportError:
        raise ConfigError("eval_lm.py needs lm-evaluation-harness: pip install 'lm_eval>=0.4'") from None
    return lm_eval


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


def task_missing_data(tasks: list[str], task_manager) -> str | None:
    """The first task whose data files cannot be found (after a load of them all failed for that reason)."""
    for name in tasks:
        try:
            task_manager.load_task_or_group([name])
        except FileNotFoundError:
            return name
        except Exception:  # noqa: BLE001 - another problem of another task: not the one being named
            continue
    return None


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
            record["tasks"] = previous.get("tasks", {}) if isinstance(previous, dict) else {}
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
    mode = mode or config.get("wandb_mode", "online")
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
