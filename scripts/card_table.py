"""Report cards side by side: one table, a column per card, a row per figure (eval_lm.py --card's report.json).

    python scripts/card_table.py out/gpt2_124m/report.json out/gpt2_card/report.json --names "this run,GPT-2 124M"

Each cell is the figure with its 95% interval; a figure one card lacks is left empty. The cards are compared as
they are: the val rows compare where both scored the same window (eval_lm.py gives GPT-2 the 124M config's), the
tasks where both ran the same task and metric (the row names them). Prints the table, and writes it with -o.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common.startup  # noqa: E402,F401 - first: a Ctrl-C while the modules below load is one line

from common.errors import ArgumentParser, DataError, run_cli  # noqa: E402
from common.settings import path_argument, require  # noqa: E402
from runtime.logger import write_text_file  # noqa: E402


def read_card(path: Path) -> dict:
    try:
        card = json.loads(path.read_text())
        return {**card, "model": card["model"], "val": card["val"], "tasks": card["tasks"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: not a report card of eval_lm.py --card ({e})") from None


def figures(card: dict) -> dict[str, str]:
    """{row name: the cell} of one card: each val set's loss and bpb, each task's metric."""
    def cell(figure: dict) -> str:
        value, interval = figure.get("value"), figure.get("ci95")
        if value is None:
            return ""
        return f"{value:.4f}" + ("" if interval is None else f" ({interval[0]:.4f}–{interval[1]:.4f})")

    rows = {}
    for v in card["val"]:
        where = f"{v['set']}: {v['rows']:,} rows of {v['seq_len']:,} tokens"
        rows[f"val loss ({where})"] = cell(v["loss"])
        rows[f"val bpb ({where})"] = cell(v["bpb"])
    for task, figure in card["tasks"].items():
        rows[f"{task} {figure['metric']}"] = cell(figure)
    return rows


def side_by_side(cards: list[dict], names: list[str]) -> str:
    columns = [figures(card) for card in cards]
    rows = list(dict.fromkeys(row for column in columns for row in column))
    lines = ["| figure | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]
    lines += [f"| {row} | " + " | ".join(column.get(row, "") for column in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="scripts/card_table.py", description=__doc__)
    parser.add_argument("cards", nargs="+", type=path_argument, help="report.json files of eval_lm.py --card")
    parser.add_argument("--names", default=None, help="the columns' names, comma-separated (default: each card's "
                                                      "model name)")
    parser.add_argument("-o", "--output", default=None, type=path_argument, help="also write the table here")
    args = parser.parse_args(argv)
    cards = [read_card(Path(path)) for path in args.cards]
    names = [n.strip() for n in args.names.split(",")] if args.names else [c["model"].get("name", "?") for c in cards]
    require(len(names) == len(cards), "--names", f"one name per card ({len(cards)}), got {len(names)}")
    table = side_by_side(cards, names)
    print(table, end="")
    if args.output:
        write_text_file(Path(args.output), table)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
