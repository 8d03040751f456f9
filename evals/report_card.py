"""The report card (eval_lm.py --card): one model's val loss, val bits per byte and a fixed zero-shot suite
of lm-eval tasks, each figure with its 95% interval and the number of examples (or val rows) behind it.

The suite (SUITE) is six zero-shot lm-eval tasks, each shown by the metric most often reported for it;
report.json keeps every metric lm_eval gave. OpenAI's GPT-2 gets the same card from the same command
(`eval_lm.py gpt2 --card ...`), so the comparison is one harness, one format.

Intervals (evals/stats.py):
- an accuracy (a metric named acc*, exact_match*): Wilson's score interval of k right of n;
- another metric (a perplexity): value +- 1.96 x lm_eval's standard error;
- val loss: Student's t over the window's rows (each row's mean token loss one value; rows are
  consecutive text, so this treats them as independent, which they nearly are at 1,024 tokens);
- val bpb: the same interval scaled, since bpb = loss x tokens / (bytes x ln 2) with the window's
  tokens and bytes fixed.
"""

from __future__ import annotations

import math

import torch

from evals.stats import CONFIDENCE, Z95, mean_interval, wilson_interval
from evals.val_loss import bits_per_byte, mean_loss

SUITE = {  # task: the metric the card shows (lm_eval's names)
    "hellaswag": "acc_norm",
    "arc_easy": "acc",
    "arc_challenge": "acc_norm",
    "piqa": "acc",
    "winogrande": "acc",
    "lambada_openai": "acc",
}
DEFAULT_METRIC = "acc"  # of a task outside the suite, unless --tasks says task:metric
PROPORTIONS = ("acc", "exact_match")  # metrics that are a share of examples right: Wilson's interval


def val_figures(name: str, data: str, row_losses: torch.Tensor, seq_len: int, n_bytes: int) -> dict:
    """The card's entry of one val set: its loss and bits per byte with their intervals.

    row_losses: each row's summed token loss (evals/val_loss.val_row_losses), (rows,)."""
    rows = row_losses.numel()
    loss = mean_loss(row_losses, seq_len)  # the very figure the trainer logs for the same weights and window
    spread = mean_interval((row_losses / seq_len).tolist())
    half = None if spread.interval is None else (spread.interval[1] - spread.interval[0]) / 2
    to_bpb = rows * seq_len / (n_bytes * math.log(2)) if n_bytes else None  # bpb per nat of mean token loss
    bpb = bits_per_byte(row_losses.sum().item(), n_bytes)
    bpb_half = None if half is None or bpb is None else half * to_bpb
    return {
        "set": name, "data": data, "rows": rows, "seq_len": seq_len, "tokens": rows * seq_len, "bytes": n_bytes,
        "loss": {"value": loss, "ci95": None if half is None else [loss - half, loss + half], "n": rows,
                 "interval": "t over rows"},
        "bpb": {"value": bpb, "ci95": None if bpb_half is None else [bpb - bpb_half, bpb + bpb_half], "n": rows,
                "interval": "t over rows, scaled"},
    }


def task_figure(task: str, metric: str, entry: dict) -> dict:
    """The card's entry of one task from eval_lm.task_entries' entry for it. KeyError: no such metric."""
    metrics, n = entry["metrics"], entry["n"]
    value = metrics[metric]
    interval, method = None, None
    if value is not None and n and metric.startswith(PROPORTIONS) and abs(value * n - round(value * n)) < 1e-6:
        interval, method = list(wilson_interval(round(value * n), n)), "wilson"
    elif value is not None and metrics.get(f"{metric}_stderr") is not None:
        half = Z95 * metrics[f"{metric}_stderr"]
        interval, method = [value - half, value + half], "normal, lm_eval's stderr"
    return {"metric": metric, "value": value, "ci95": interval, "n": n, "interval": method, **entry}


def build_card(model: dict, settings: dict, val: list[dict], tasks: dict[str, dict],
               not_scored: list[str] = ()) -> dict:
    """report.json: what was scored (model), how (settings), the figures, and the figures left out of a card cut
    short (a task that failed, or Ctrl-C): each task's name, `val` or `val <set>`."""
    return {"model": model, "settings": {**settings, "confidence": CONFIDENCE, "num_fewshot": 0}, "val": val,
            "tasks": tasks, "not_scored": list(not_scored)}


def _value(x: float | None, digits: int = 4) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def _interval(ci: list[float] | None, digits: int = 4) -> str:
    return "" if ci is None else f"{ci[0]:.{digits}f} – {ci[1]:.{digits}f}"


def card_markdown(card: dict) -> str:
    """report.md: a heading naming the model, one line of settings, one table row per figure."""
    model, settings = card["model"], card["settings"]
    lines = [f"# Report card: {model['name']}", ""]
    what = [f"{CONFIDENCE:.0%} intervals", f"{settings['device']} {settings['dtype']}", settings["date"]]
    if card["tasks"]:
        what[:1] = [f"zero-shot tasks, {CONFIDENCE:.0%} intervals", f"lm_eval {settings['lm_eval_version']}"]
    if settings.get("limit"):
        what.insert(1, f"at most {settings['limit']} examples per task (a partial card)")
    if card.get("not_scored"):
        what.insert(1, f"a partial card: {', '.join(card['not_scored'])} not scored")
    lines += [", ".join(what), "", "| figure | value | 95% interval | n |", "| --- | ---: | --- | ---: |"]
    for v in card["val"]:
        where = f"{v['set']}: {v['rows']:,} rows of {v['seq_len']:,} tokens from {v['data']}"
        lines.append(f"| val loss ({where}) | {_value(v['loss']['value'])} | {_interval(v['loss']['ci95'])} "
                     f"| {v['rows']:,} |")
        lines.append(f"| val bpb ({v['set']}: {v['bytes']:,} bytes) | {_value(v['bpb']['value'])} "
                     f"| {_interval(v['bpb']['ci95'])} | {v['rows']:,} |")
    for task, figure in card["tasks"].items():
        n = "" if figure["n"] is None else f"{figure['n']:,}"
        lines.append(f"| {task} {figure['metric']} | {_value(figure['value'])} | {_interval(figure['ci95'])} | {n} |")
    return "\n".join(lines) + "\n"
