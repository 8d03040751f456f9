"""Plot the curves of one or several runs from their log.jsonl, for comparison at a glance.

    python plot_log.py out/gpt2_124m -o curves.png --smooth 20
    python plot_log.py out/run_a out/run_b -o compare.png --title "lr sweep"

Left panel: train loss (a trailing moving average over --smooth N points, raw values faint
behind it) and val loss against tokens seen. Right panel: HellaSwag acc_norm against tokens,
or a note when no run has HellaSwag records. One colour per run, labelled by its folder name.

Reference lines: the OpenAI GPT-2 124M checkpoint's val loss on FineWeb-Edu (3.29) is drawn
only when the plotted losses would still fill at least 60% of the y axis with it; otherwise a
note says it is off-scale, so a run whose losses sit in a narrow band far above 3.29 (a short
or resumed small run) keeps a readable axis; the y limits then follow the data alone. The HellaSwag
references (GPT-2 124M 29.4%, GPT-3 124M 33.7%) are always drawn: accuracies live between
chance (25%) and a few tens of percent, so they never squash the curves.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from training.run_logger import LOG_NAME, read_log  # noqa: E402

GPT2_VAL_LOSS = 3.29
HELLASWAG_REFS = [(29.4, "GPT-2 124M (29.4%)"), (33.7, "GPT-3 124M (33.7%)")]
FIGSIZE, DPI = (12.0, 4.5), 100  # a 1200 x 450 pixel image
MIN_FILL = 0.6


def load_run(out_dir: str | Path) -> list[dict]:
    """The records of OUT_DIR/log.jsonl; raises ValueError (message names the file) if missing or empty."""
    path = Path(out_dir) / LOG_NAME
    try:
        records = read_log(path)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    if not records:
        raise ValueError(f"{path}: no records")
    return records


def series(records: list[dict], kind: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, values) of the records of `kind`, sorted by tokens; null or non-finite values are skipped."""
    points = sorted((r["tokens"], r[key]) for r in records
                    if isinstance(r, dict) and r.get("kind") == kind and _finite(r.get("tokens")) and _finite(r.get(key)))
    return np.array([p[0] for p in points], dtype=float), np.array([p[1] for p in points], dtype=float)


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average: point i is the mean of the last `window` values up to i."""
    if window <= 1 or len(values) == 0:
        return values
    sums = np.cumsum(np.insert(values, 0, 0.0))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (sums[ends] - sums[starts]) / (ends - starts)


def token_unit(max_tokens: float) -> tuple[float, str]:
    """The divisor and name of the x axis unit for a run of up to max_tokens tokens."""
    for scale, name in ((1e9, "billions"), (1e6, "millions"), (1e3, "thousands")):
        if max_tokens >= scale:
            return scale, name
    return 1.0, ""


def reference_fits(ref: float, values: list[np.ndarray]) -> bool:
    """Whether drawing a line at `ref` leaves the data at least MIN_FILL of the y range."""
    data = np.concatenate(values) if values else np.array([])
    if data.size == 0:
        return False
    lo, hi = float(data.min()), float(data.max())
    if lo <= ref <= hi:
        return True
    return (hi - lo) / (max(hi, ref) - min(lo, ref)) >= MIN_FILL


def plot(runs: dict[str, list[dict]], out: Path, window: int, title: str | None) -> None:
    """Draw the loss and HellaSwag panels for runs (label -> records) into the image `out`."""
    fig, (ax_loss, ax_hs) = plt.subplots(1, 2, figsize=FIGSIZE, dpi=DPI)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    data = {label: {name: series(records, kind, key) for name, kind, key in
                    (("train", "train", "loss"), ("val", "val", "loss"), ("hs", "hellaswag", "acc_norm"))}
            for label, records in runs.items()}
    max_tokens = max([s[0].max() for d in data.values() for s in d.values() if len(s[0])] or [0.0])
    scale, unit = token_unit(max_tokens)
    losses, has_hs = [], False
    for i, (label, d) in enumerate(data.items()):
        color = colors[i % len(colors)]
        (tx, ty), (vx, vy), (hx, hy) = d["train"], d["val"], d["hs"]
        if len(tx):
            if window > 1:
                ax_loss.plot(tx / scale, ty, color=color, alpha=0.2, linewidth=0.8)
            ax_loss.plot(tx / scale, smooth(ty, window), color=color, linewidth=1.2, label=f"{label} train")
        if len(vx):
            ax_loss.plot(vx / scale, vy, color=color, linestyle="--", marker="o", markersize=3, label=f"{label} val")
        losses += [ty, vy]
        if len(hx):
            ax_hs.plot(hx / scale, hy * 100, color=color, marker="o", markersize=3, label=label)
            has_hs = True
    xlabel = f"tokens seen ({unit})" if unit else "tokens seen"
    if any(len(v) for v in losses):
        if reference_fits(GPT2_VAL_LOSS, losses):
            ax_loss.axhline(GPT2_VAL_LOSS, color="gray", linestyle=":", label="OpenAI GPT-2 124M checkpoint (3.29)")
        else:
            ax_loss.text(0.01, 0.02, f"GPT-2 124M reference ({GPT2_VAL_LOSS}) off-scale", transform=ax_loss.transAxes,
                         ha="left", va="bottom", fontsize=8, color="gray")
        ax_loss.set(xlabel=xlabel, ylabel="loss", title="loss" + (f" (train smoothed over {window})" if window > 1 else ""))
        ax_loss.legend(fontsize=8, loc="upper right")
        ax_loss.grid(alpha=0.3)
    else:
        _empty(ax_loss, "no train/val loss records")
    if has_hs:
        for (ref, name), style in zip(HELLASWAG_REFS, (":", "-.")):
            ax_hs.axhline(ref, color="gray", linestyle=style, label=name)
        ax_hs.set(xlabel=xlabel, ylabel="acc_norm (%)", title="HellaSwag")
        ax_hs.legend(fontsize=8, loc="lower right")
        ax_hs.grid(alpha=0.3)
    else:
        _empty(ax_hs, "no HellaSwag records")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)  # no bbox_inches="tight": the pixel size stays FIGSIZE * DPI
    plt.close(fig)


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", color="gray", transform=ax.transAxes)
    ax.set_axis_off()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Plot loss and HellaSwag curves of training runs.")
    parser.add_argument("out_dirs", nargs="+", metavar="OUT_DIR", help="run folders holding log.jsonl")
    parser.add_argument("-o", "--output", default="curves.png", help="image to write (default: curves.png)")
    parser.add_argument("--smooth", type=int, default=1, metavar="N", help="trailing moving average of train loss")
    parser.add_argument("--title", default=None, help="figure title")
    args = parser.parse_args(argv)
    names = [Path(d).resolve().name for d in args.out_dirs]
    labels = names if len(set(names)) == len(names) else list(args.out_dirs)  # same name: use the paths
    runs = {}
    for label, out_dir in zip(labels, args.out_dirs):
        try:
            runs[label] = load_run(out_dir)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    plot(runs, Path(args.output), args.smooth, args.title)
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
