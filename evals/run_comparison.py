"""Two groups of runs compared metric by metric (compare_runs.py, ladder.py --recipes, scripts/compare_recipes.py):
each run's final figures read and checked to be of its newest step, then evals/stats.py's Welch's or paired t-test
per metric, with a verdict, a summary line and a Markdown table."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from common.errors import ConfigError, DataError, print_warning
from common.log_fields import BPB, BPB_PREFIX, val_set_names
from common.settings import require
from evals.base import EMA_PREFIX
from evals.stats import Difference, format_p, paired, verdict, welch
from runtime.logger import LOG_NAME, read_run_log

CARD = "report"  # eval_lm.py --card's report.json (report_ema.json of the EMA weights)


@dataclass(frozen=True)
class Row:
    metric: str
    lower_is_better: bool
    a: list[float]
    b: list[float]
    result: Difference
    verdict: str
    a_step: int  # the step every figure of group A is of (compare refuses a group of several steps)
    b_step: int


@dataclass(frozen=True)
class RunFigures:
    """One run's figures, all of one step: the newest one its log and report card know of."""

    step: int
    metrics: dict[str, tuple[float, bool]]  # {metric: (value, lower is better)}


def is_step(value) -> bool:
    return isinstance(value, int) and value >= 0


def read_records(path: Path) -> list[dict]:
    """The records of a run's log.jsonl; DataError naming it where it is missing or a record's step is not one."""
    records = read_run_log(path, missing="no such file (not a run folder?)")
    bad = next((r for r in records if r.get("kind") in ("val", "checkpoint") and not is_step(r.get("step"))), None)
    if bad is not None:
        raise DataError(f"{path}: a {bad['kind']} record whose step is {bad.get('step')!r}, not a step number")
    return records


def card_figures(card: Path) -> tuple[int, dict[str, tuple[float, bool]]]:
    """(the step of the checkpoint it scored, {"task metric": (value, lower is better)}) of a report card (eval_lm.py
    --card's report.json); a task whose value is null (lm_eval gave none) is left out. DataError naming the file
    where it is not such a card."""
    try:
        data = json.loads(card.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{card}: not a report card ({e})") from None
    model = data.get("model") if isinstance(data, dict) else None
    step = model.get("step") if isinstance(model, dict) else None
    tasks = data.get("tasks") if isinstance(data, dict) else None
    if not is_step(step) or not isinstance(tasks, dict):
        raise DataError(f"{card}: not a report card of a checkpoint (eval_lm.py RUN --card writes one: its model's "
                        f"step and a tasks table)")
    figures = {}
    for task, figure in tasks.items():
        metric, value = (figure.get("metric"), figure.get("value")) if isinstance(figure, dict) else (None, None)
        if not isinstance(metric, str) or not (value is None or isinstance(value, (int, float))):
            raise DataError(f"{card}: task {task!r} is not a card's figure (a metric name and its value)")
        if value is None:
            continue
        if not math.isfinite(value):
            raise DataError(f"{card}: {task} {metric} is {value}, not a finite figure")
        figures[f"{task} {metric}"] = (value, not metric.startswith(("acc", "exact")))
    return step, figures


def run_figures(run: Path, weights: str = "live") -> RunFigures:
    """A run folder's final val figures and its report card's tasks, checked to be of one step: its newest.

    The figures name the run's newest state, so each must come from the newest step the run folder knows of:
    its last val record, its last checkpoint (the log's record of each save) and the step its card scored. A
    figure of an earlier step is refused, not warned about: it describes weights the run has gone past while
    its row says "final" (a run stopped before its final evaluations, or a card made before the run went on),
    and the remedy is one command (relaunching the run logs them; eval_lm.py --card makes the card again)."""
    path = run / LOG_NAME
    records = read_records(path)
    vals = [r for r in records if r.get("kind") == "val"]
    if not vals:
        raise DataError(f"{path}: no val record")
    final = max(vals, key=lambda r: r["step"])
    prefix = EMA_PREFIX if weights == "ema" else ""
    fields = {"final val loss": "loss", "final val bpb": BPB}
    for name in val_set_names(final):
        fields[f"final val loss ({name})"] = name
        fields[f"final val bpb ({name})"] = BPB_PREFIX + name
    # the trainer's logger writes a NaN or infinite figure as null (runtime/logger.py): a figure the record
    # holds as null is such a figure, refused as one, not a figure left out (its row lost the run without a word)
    held = {metric: final[prefix + field] for metric, field in fields.items() if prefix + field in final}
    metrics = {metric: (value, True) for metric, value in held.items()
               if value is None or isinstance(value, (int, float))}
    if weights == "ema" and not metrics:
        raise DataError(f"{path}: its final val record (step {final['step']}) has no EMA figures")
    for metric, (value, _) in metrics.items():
        if value is None or not math.isfinite(value):
            shown = "null (NaN or infinite: the trainer logs them so)" if value is None else value
            raise DataError(f"{path}: the {metric} of step {final['step']} is {shown}, not a finite figure")
    saved = max((r["step"] for r in records if r.get("kind") == "checkpoint"), default=-1)
    card = run / f"{CARD}{'_ema' if weights == 'ema' else ''}.json"
    card_step, card_metrics = card_figures(card) if card.is_file() else (None, {})
    newest = max(final["step"], saved, -1 if card_step is None else card_step)
    if final["step"] < newest:
        raise DataError(f"{path}: its last val record is of step {final['step']}, but the run has a "
                        f"{'checkpoint' if saved == newest else 'report card'} of step {newest}: its figures of step "
                        f"{newest} are missing (a run still going, or one stopped before its final evaluations: "
                        f"relaunching its command logs them)")
    if card_step is not None and card_step < newest:
        again = f"python eval_lm.py {run} --card" + (" --weights ema" if weights == "ema" else "")
        raise DataError(f"{card}: the card of step {card_step}, but the run has gone on to step {newest}: make it "
                        f"again ({again})")
    return RunFigures(newest, {**metrics, **card_metrics})


def run_identities(runs: list[Path], flag: str) -> list[Path]:
    """Each run folder resolved (the run itself, whatever path names it); ConfigError on a run given twice, which
    would count as two seeds."""
    seen: dict[Path, Path] = {}
    for run in runs:
        identity = run.resolve()
        if identity in seen:
            again = "" if str(seen[identity]) == str(run) else f" (as {seen[identity]} and {run})"
            raise ConfigError(f"{flag}: {run} is given twice{again}: each run counts once")
        seen[identity] = run
    return list(seen)


def group_step(figures: list[RunFigures], runs: list[Path], flag: str) -> int:
    """The step of a group's figures. A group of several steps is refused: its runs are one recipe's seeds, and a
    mean over different training lengths is no recipe's figure, nor is their spread the seeds' spread."""
    steps = {f.step for f in figures}
    if len(steps) > 1:
        listed = ", ".join(f"{run}: step {f.step}" for run, f in zip(runs, figures))
        raise DataError(f"{flag}: its runs' figures are of different steps ({listed}); a group is one recipe's seeds, "
                        f"compared at one step")
    return steps.pop()


def compare(a: list[Path], b: list[Path], a_weights: str = "live", b_weights: str = "live",
            names: tuple[str, str] = ("A", "B"), alpha: float = 0.05) -> list[Row]:
    """One Row per metric that every run of both groups has, in the order of the first run's metrics.

    The runs are told apart by what they are (their resolved folders), not by how or in which order they are
    listed: the same runs in both groups, in any order, are paired run by run; groups with no run in common get
    Welch's test; groups that share only some runs are neither, and refused."""
    ids_a, ids_b = run_identities(a, "--a"), run_identities(b, "--b")
    shared = set(ids_a) & set(ids_b)
    same_runs = set(ids_a) == set(ids_b)
    require(not same_runs or a_weights != b_weights, "--b",
            "the same runs with the same weights as --a: nothing to compare (--b_weights ema?)")
    if shared and not same_runs:
        run = next(run for run, identity in zip(b, ids_b) if identity in shared)
        raise ConfigError(f"--b: {run} is in --a too, but the groups are not the same runs: the same runs in both "
                          f"(their live weights against their EMA, paired) or none in common (Welch's t-test)")
    if same_runs:
        b = [b[ids_b.index(identity)] for identity in ids_a]  # B's figures in A's order: each pair is one run
    fa = [run_figures(run, a_weights) for run in a]
    fb = [run_figures(run, b_weights) for run in b]
    step_a, step_b = group_step(fa, a, "--a"), group_step(fb, b, "--b")
    if step_a != step_b:
        # warned, not refused: recipes compared at different budgets may be the question asked (does B at fewer
        # steps match A?); the line above the table shows both steps, and this says what the verdicts then weigh
        print_warning(f"{names[0]}'s figures are of step {step_a}, {names[1]}'s of step {step_b}: the verdicts compare "
                      f"different training lengths too")
    test = paired if same_runs else welch
    rows = []
    for metric, (_, lower) in fa[0].metrics.items():
        if all(metric in f.metrics for f in fa + fb):
            xs, ys = [f.metrics[metric][0] for f in fa], [f.metrics[metric][0] for f in fb]
            result = test(xs, ys)
            rows.append(Row(metric, lower, xs, ys, result, verdict(result, lower, alpha, names), step_a, step_b))
    return rows


def summary(rows: list[Row], names: tuple[str, str] = ("A", "B"), alpha: float = 0.05) -> str:
    """The line above the table: each group's runs and the step their figures are of, and the test."""
    first = rows[0]
    r = first.result
    test = "paired t-test (the same runs)" if r.test == "paired" else "Welch's t-test"
    return (f"{names[0]}: {r.n_a} runs at step {first.a_step}, {names[1]}: {r.n_b} runs at step {first.b_step}; "
            f"{test}, two-sided, alpha {alpha}")


def format_rows(rows: list[Row], names: tuple[str, str] = ("A", "B")) -> str:
    """A Markdown table: each metric's means, B - A with its 95% interval, p and the verdict."""
    a, b = names
    lines = [f"| metric | {a} mean | {b} mean | {b} - {a} (95% interval) | p | verdict |",
             "| --- | ---: | ---: | --- | ---: | --- |"]
    for row in rows:
        r = row.result
        interval = "" if r.interval is None else f" ({r.interval[0]:+.4f} to {r.interval[1]:+.4f})"
        p = "" if r.p is None else format_p(r.p)
        lines.append(f"| {row.metric} | {r.mean_a:.4f} | {r.mean_b:.4f} | {r.diff:+.4f}{interval} | {p} "
                     f"| {row.verdict} |")
    return "\n".join(lines)

