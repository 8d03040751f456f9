"""Compare two recipes over seeds: per metric, both means, a 95% interval for the difference and a t-test.

    python compare_runs.py --a out/recipes/faithful_s* --b out/recipes/modern_s* --names faithful,modern
    python compare_runs.py --a out/recipes/faithful_s* --b out/recipes/faithful_s* --b_weights ema --names live,EMA

Each group is several run folders of one recipe (one seed each). The metrics, where every run of both
groups has them: the final val loss and val bits per byte (the last `val` record of log.jsonl; each
named val set's too), and each task of the report card (RUN/report.json from `eval_lm.py RUN --card`).
--a_weights/--b_weights ema read the EMA's figures instead (ema_loss, ema_bpb, report_ema.json).
A run's figures are of its newest step: a val record or card older than its last checkpoint (or than
each other) is refused, as are a group whose runs end at different steps and a run given twice; the
line above the table says each group's step, and a warning says when the two groups' steps differ.
A figure that is not finite (a NaN loss) is an error naming the run.

Two groups of different runs get Welch's t-test (unequal variances); the same runs in both groups, in
any order (live weights against their EMA, say), get the paired t-test, run by run. The verdict says
which recipe is better at what p, or that the runs cannot tell them apart at --alpha (default 0.05):
one seed proves nothing, and a difference smaller than the seeds' spread needs more of them. Loss and
bpb are better lower, accuracies higher. --json FILE writes the rows.
"""

from __future__ import annotations

import common.startup  # noqa: F401 - first: a Ctrl-C while the modules below load is one line

import json
import sys
from dataclasses import asdict
from pathlib import Path

from common.errors import ArgumentParser, DataError, run_cli
from common.settings import path_argument, require
from evals.run_comparison import compare, format_rows, summary
from runtime.logger import write_text_file


def as_path(text: str) -> Path:
    """A path argument: '' refused (path_argument), where Path would read it as the current folder."""
    return Path(path_argument(text))


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="compare_runs.py", description=__doc__)
    parser.add_argument("--a", nargs="+", required=True, type=as_path, help="run folders of recipe A (one seed each)")
    parser.add_argument("--b", nargs="+", required=True, type=as_path, help="run folders of recipe B (one seed each)")
    parser.add_argument("--names", default="A,B", help="the recipes' names in the table and verdicts (default A,B)")
    parser.add_argument("--a_weights", default="live", choices=["live", "ema"],
                        help="live, or ema: group A's EMA figures")
    parser.add_argument("--b_weights", default="live", choices=["live", "ema"],
                        help="live, or ema: group B's EMA figures")
    parser.add_argument("--alpha", type=float, default=0.05, help="the p below which a difference is called (0.05)")
    parser.add_argument("--json", type=as_path, default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    names = tuple(n.strip() for n in args.names.split(","))
    require(len(names) == 2 and all(names), "--names",
            f"two names, A's and B's, separated by a comma, got {args.names!r}")
    require(0 < args.alpha < 1, "--alpha", f"must be in (0, 1), got {args.alpha}")
    rows = compare(args.a, args.b, args.a_weights, args.b_weights, names, args.alpha)
    if not rows:
        raise DataError("no metric that every run has (a final val record; report.json for the card's tasks)")
    print(summary(rows, names, args.alpha))
    print(format_rows(rows, names))
    if args.json:
        write_text_file(args.json, json.dumps([{**asdict(row), "names": names} for row in rows], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
