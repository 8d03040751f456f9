"""Compare two recipes over seeds: per metric, both means, a 95% interval for the difference and a t-test.

    python compare_runs.py --a out/recipes/faithful_s* --b out/recipes/modern_s* --names faithful,modern
    python compare_runs.py --a out/recipes/faithful_s* --b out/recipes/faithful_s* --b_weights ema --names live,EMA

Each group is several run folders of one recipe (one seed each). The metrics, where every run of both
groups has them: the final val loss and val bits per byte (the last `val` record of log.jsonl; each
named val set's too), and each task of the report card (RUN/report.json from `eval_lm.py RUN --card`).
--a_weights/--b_weights ema read the EMA's figures instead (ema_loss, ema_bpb, report_ema.json).

Two groups of different runs get Welch's t-test (unequal variances); the same runs in both groups
(live weights against their EMA, say) get the paired t-test, run by run. The verdict says which recipe
is better at what p, or that the runs cannot tell them apart at --alpha (default 0.05): one seed proves
nothing, and a difference smaller than the seeds' spread needs more of them. Loss and bpb are better
lower, accuracies higher. --json FILE writes the rows.
"""

from __future__ import annotations

import common.startup  # noqa: F401 - first: a Ctrl-C while the modules below load is one line

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from common.errors import ArgumentParser, ConfigError, DataError, run_cli
from evals.base import EMA_PREFIX
from evals.stats import Difference, format_p, paired, verdict, welch
from common.log_fields import BPB, BPB_PREFIX, val_set_names
from training.core.logger import LOG_NAME, read_log, write_text_file

CARD = "report"  # eval_lm.py --card's report.json (report_ema.json of the EMA weights)


@dataclass(frozen=True)
class Row:
    metric: str
    lower_is_better: bool
    a: list[float]
    b: list[float]
    result: Difference
    verdict: str


def run_metrics(run: Path, weights: str = "live") -> dict[str, tuple[float, bool]]:
    """{metric: (value, lower is better)} of one run folder: its final val figures, its report card's tasks."""
    path = run / LOG_NAME
    try:
        records = [r for r in read_log(path) if isinstance(r, dict) and r.get("kind") == "val"]
    except FileNotFoundError:
        raise DataError(f"{path}: no such file (not a run folder?)") from None
    except OSError as e:
        raise DataError(f"{path}: {e.strerror or e}") from None
    if not records:
        raise DataError(f"{path}: no val record")
    final = max(records, key=lambda r: r.get("step", -1))
    prefix = EMA_PREFIX if weights == "ema" else ""
    fields = {"final val loss": "loss", "final val bpb": BPB}
    for name in val_set_names(final):
        fields[f"final val loss ({name})"] = name
        fields[f"final val bpb ({name})"] = BPB_PREFIX + name
    metrics = {metric: (final[prefix + field], True) for metric, field in fields.items()
               if isinstance(final.get(prefix + field), (int, float))}
    if weights == "ema" and not metrics:
        raise DataError(f"{path}: its final val record (step {final.get('step')}) has no EMA figures")
    card = run / f"{CARD}{'_ema' if weights == 'ema' else ''}.json"
    if card.is_file():
        try:
            tasks = json.loads(card.read_text())["tasks"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{card}: not a report card ({e})") from None
        for task, figure in tasks.items():
            if isinstance(figure.get("value"), (int, float)):
                metrics[f"{task} {figure['metric']}"] = (figure["value"], not figure["metric"].startswith(("acc",
                                                                                                            "exact")))
    return metrics


def compare(a: list[Path], b: list[Path], a_weights: str = "live", b_weights: str = "live",
            names: tuple[str, str] = ("A", "B"), alpha: float = 0.05) -> list[Row]:
    """One Row per metric that every run of both groups has, in the order of the first run's metrics."""
    ma = [run_metrics(run, a_weights) for run in a]
    mb = [run_metrics(run, b_weights) for run in b]
    same_runs = [p.resolve() for p in a] == [p.resolve() for p in b]
    test = paired if same_runs else welch
    rows = []
    for metric, (_, lower) in ma[0].items():
        if all(metric in m for m in ma + mb):
            xs, ys = [m[metric][0] for m in ma], [m[metric][0] for m in mb]
            result = test(xs, ys)
            rows.append(Row(metric, lower, xs, ys, result, verdict(result, lower, alpha, names)))
    return rows


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


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="compare_runs.py", description=__doc__)
    parser.add_argument("--a", nargs="+", required=True, type=Path, help="run folders of recipe A (one seed each)")
    parser.add_argument("--b", nargs="+", required=True, type=Path, help="run folders of recipe B (one seed each)")
    parser.add_argument("--names", default="A,B", help="the recipes' names in the table and verdicts (default A,B)")
    parser.add_argument("--a_weights", default="live", choices=["live", "ema"],
                        help="live, or ema: group A's EMA figures")
    parser.add_argument("--b_weights", default="live", choices=["live", "ema"],
                        help="live, or ema: group B's EMA figures")
    parser.add_argument("--alpha", type=float, default=0.05, help="the p below which a difference is called (0.05)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    names = tuple(n.strip() for n in args.names.split(","))
    if len(names) != 2 or not all(names):
        raise ConfigError(f"--names: two names, A's and B's, separated by a comma, got {args.names!r}")
    if not 0 < args.alpha < 1:
        raise ConfigError(f"--alpha: must be in (0, 1), got {args.alpha}")
    if [p.resolve() for p in args.a] == [p.resolve() for p in args.b] and args.a_weights == args.b_weights:
        raise ConfigError("--b: the same runs with the same weights as --a: nothing to compare (--b_weights ema?)")
    rows = compare(args.a, args.b, args.a_weights, args.b_weights, names, args.alpha)
    if not rows:
        raise DataError("no metric that every run has (a final val record; report.json for the card's tasks)")
    test = "paired t-test (the same runs)" if rows[0].result.test == "paired" else "Welch's t-test"
    print(f"{names[0]}: {len(args.a)} runs, {names[1]}: {len(args.b)} runs; {test}, two-sided, alpha {args.alpha}")
    print(format_rows(rows, names))
    if args.json:
        write_text_file(args.json, json.dumps([{**asdict(row), "names": names} for row in rows], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
