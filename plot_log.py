"""Plot the curves of one or several runs from their log.jsonl, for comparison at a glance.

    python plot_log.py out/gpt2_124m -o curves.png --smooth 20
    python plot_log.py out/run_a out/run_b -o compare.png --title "lr sweep" --references all

One panel per kind of data the runs logged, side by side against tokens seen: loss (train loss
as a trailing moving average over --smooth N points, raw values faint behind it, and val loss),
then one panel per other evaluation a run logged (HellaSwag acc_norm, ...): the panels come from
the record kinds in the logs, as the trainer's evaluations declare them (evals/periodic.py);
last, the learning rate of every step. One colour per run, labelled by its folder name. Vertical
lines in the run's colour mark what changed its course: a thin solid line each resume (a launch
that started from step S > 0, as its `startup` record says), a dashed line each rollback (at the
tokens of the checkpoint it went back to) and a dotted line each skipped update (a loss spike).
The train loss of a skipped update is left out of its curve: it was never applied, and a spike's
loss would flatten the rest.

Reference lines (--references, default auto) follow each run folder's config.yaml:
- val loss 3.29, OpenAI's GPT-2 124M checkpoint on FineWeb-Edu: for runs of a GPT-2 size on
  FineWeb data (data_dir names fineweb). auto also leaves it out, with a note, when the
  losses would fill less than 60% of the y axis with it (a short run far above 3.29);
- HellaSwag acc_norm of the GPT-2 checkpoint and the GPT-3 model of the same size: for runs
  whose model is that GPT-2 size (a preset name, or custom with its n_layer and n_embd).
- the unigram entropy of the run's train data (nats): the loss of a model that knows only how
  often each token occurs, which a model learning anything from context goes below. Computed from
  the token shards config.yaml's data_dir names (a mixture: its sources' frequencies mixed by
  their weights), at most UNIGRAM_TOKENS tokens of each; left out where they cannot be read.
  auto draws it where the losses still fill 60% of the y axis, like the val loss reference.
all draws every reference, none draws none. A folder without config.yaml gets none in auto.

A PNG carries, as its Description text, what it draws (describe(): panels, lines with their labels
and styles, legends), which tests/test_plot_log.py compares for the pictures the docs show.
"""

from __future__ import annotations

import common.startup  # noqa: F401 - first: a Ctrl-C while the modules below load is one line

import math
import sys
from pathlib import Path
from typing import NamedTuple

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402
from matplotlib.collections import LineCollection, PathCollection, PolyCollection  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.markers import MarkerStyle  # noqa: E402

from common.errors import ArgumentParser, DataError, ReproError, WriteError, run_cli  # noqa: E402
from common.log_fields import val_set_names  # noqa: E402
from common.settings import path_argument  # noqa: E402
from data.settings import parse_sources  # noqa: E402
from data.shards import find_shards, open_shard  # noqa: E402
from evals.base import EMA_PREFIX, TRAIN_LOSS, Series, averaged_series  # noqa: E402
from evals.periodic import EVALUATORS  # noqa: E402
from runtime.logger import LOG_NAME, read_run_log  # noqa: E402

GPT2_VAL_LOSS = 3.29
# HellaSwag acc_norm (%) by GPT-2 size: the preset, its shape (n_layer, n_embd), and the
# figures of OpenAI's GPT-2 checkpoint and of the GPT-3 paper's model of about that size.
HELLASWAG_REFS = {
    "gpt2": ((12, 768), [("GPT-2 124M", 29.4), ("GPT-3 Small (125M)", 33.7)]),
    "gpt2-medium": ((24, 1024), [("GPT-2 350M", 37.5), ("GPT-3 Medium (350M)", 43.6)]),
    "gpt2-large": ((36, 1280), [("GPT-2 774M", 43.0), ("GPT-3 Large (760M)", 51.0)]),
    "gpt2-xl": ((48, 1600), [("GPT-2 1558M", 50.9), ("GPT-3 XL (1.3B)", 54.7)]),
}
PANEL_SIZE, DPI = (6.0, 4.5), 100  # each panel 600 x 450 pixels
MIN_FILL = 0.6
SERIES: list[Series] = [TRAIN_LOSS] + [cls.series for cls in EVALUATORS if cls.series]  # what is plotted
# the same figures of the EMA of the weights (runs with ema_decay), each its own curve in the same panel
SERIES += [averaged_series(cls.series) for cls in EVALUATORS if cls.series and cls.averaged]
LEARNING_RATE = Series("train", "lr", "learning rate", "lr")  # every step, a panel of its own
SERIES.append(LEARNING_RATE)
UNIGRAM_TOKENS = 100_000_000  # counted of each source at most (about 0.5 s); a FineWeb-Edu shard holds as many


class PlottedRun(NamedTuple):
    records: list[dict]  # of log.jsonl
    config: dict  # of config.yaml
    unigram: tuple[float, bool] | None = None  # unigram_entropy() of its train data; None: not known


def load_run(out_dir: str | Path, unigram: bool = True) -> PlottedRun:
    """The records and config of the run folder OUT_DIR, and (where `unigram`) the unigram entropy of the
    train shards its config names; DataError (naming the file) if its log is missing or has nothing to plot."""
    path = Path(out_dir) / LOG_NAME
    records = read_run_log(path)
    if not any(len(series(records, s.kind, s.field)[0]) for s in SERIES):
        kinds = list(dict.fromkeys(s.kind for s in SERIES))
        raise DataError(f"{path}: no {', '.join(kinds[:-1])} or {kinds[-1]} records")
    config = load_config(out_dir)
    return PlottedRun(records, config, unigram_entropy(config) if unigram and config else None)


def load_config(out_dir: str | Path) -> dict:
    """OUT_DIR/config.yaml, the run's resolved trainer configuration; {} if the folder has none."""
    path = Path(out_dir) / "config.yaml"
    if not path.exists():
        return {}
    try:
        config = yaml.safe_load(path.read_text())
    except OSError as e:
        raise DataError(f"{path}: {e.strerror or e}") from None
    except yaml.YAMLError:
        config = None
    if not isinstance(config, dict):
        raise DataError(f"{path}: not a YAML mapping of config keys")
    return config


def series(records: list[dict], kind: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, values) of the records of `kind`, sorted by tokens; null or non-finite values are skipped."""
    points = sorted((r["tokens"], r[key]) for r in records
                    if r.get("kind") == kind and _finite(r.get("tokens")) and _finite(r.get(key)))
    return np.array([p[0] for p in points], dtype=float), np.array([p[1] for p in points], dtype=float)


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


MARKERS = {  # record kind -> (legend suffix, line style) of the vertical lines marking it
    "rollback": ("rolled back", "--"),
    "skip": ("skipped a spike", ":"),
}


def event_tokens(records: list[dict], kind: str) -> list[float]:
    """Tokens seen at each record of `kind` (skip: after the skipped step; rollback: at the step gone back to)."""
    return sorted(r["tokens"] for r in records if r.get("kind") == kind and _finite(r.get("tokens")))


def without_skipped_steps(records: list[dict]) -> list[dict]:
    """The records, less the train records of updates that were skipped (their loss was a spike)."""
    skipped = {r.get("step") for r in records if r.get("kind") == "skip"}
    return [r for r in records if not (r.get("kind") == "train" and r.get("step") in skipped)]


def resume_tokens(records: list[dict]) -> list[float]:
    """Tokens seen at each resume: a startup record of step S > 0 is placed at the tokens of the
    train record of step S - 1 (the log keeps it: a resume from S drops only steps >= S)."""
    tokens_after = {r["step"]: r["tokens"] for r in records if r.get("kind") == "train" and _finite(r.get("tokens"))}
    return sorted(tokens_after[r["step"] - 1] for r in records
                  if r.get("kind") == "startup" and r.get("step", 0) > 0 and r["step"] - 1 in tokens_after)


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
    return lo <= ref <= hi or (hi - lo) / (max(hi, ref) - min(lo, ref)) >= MIN_FILL


def gpt2_size(config: dict) -> str | None:
    """The GPT-2 preset the run's model is, by name or by shape; None for any other model."""
    for size, (shape, _) in HELLASWAG_REFS.items():
        if config.get("model") == size or (config.get("n_layer"), config.get("n_embd")) == shape:
            return size
    return None


def applicable_references(configs: list[dict], mode: str) -> tuple[bool, list[tuple[str, float]]]:
    """For the runs' configs and --references `mode`: whether the val loss reference is drawn,
    and the HellaSwag references (name, acc_norm %) that are."""
    if mode == "none":
        return False, []
    sizes = [gpt2_size(c) for c in configs]
    loss = mode == "all" or any(size and "fineweb" in str(c.get("data_dir", "")).lower()
                                for size, c in zip(sizes, configs))
    return loss, [ref for size, (_, refs) in HELLASWAG_REFS.items() if mode == "all" or size in sizes for ref in refs]


def unigram_entropy(config: dict, limit: int = UNIGRAM_TOKENS) -> tuple[float, bool] | None:
    """The entropy in nats of the token frequencies of the run's train shards (config.yaml's data_dir; a
    mixture's sources mixed by their weights), and whether some source had more than `limit` tokens (only
    its first `limit` were counted); None when the config names no data or its shards cannot be read."""
    try:
        sources = parse_sources(str(config["data_dir"]))
        mixed, capped = None, False
        for source in sources:
            counts, left = None, limit
            for path in find_shards(source.path, "train"):
                if not left:  # more tokens than counted
                    capped = True
                    break
                tokens = open_shard(path)
                capped |= tokens.size > left
                part = np.bincount(tokens[:left], minlength=2**16)  # uint16 token ids
                counts = part if counts is None else counts + part
                left -= min(left, tokens.size)
            share = counts / counts.sum() * source.weight / sum(s.weight for s in sources)
            mixed = share if mixed is None else mixed + share
    except (KeyError, ReproError, OSError):
        return None
    p = mixed[mixed > 0]
    return float(-(p * np.log(p)).sum()), capped


SET_STYLES = [("--", "o"), (":", "s"), ("-.", "^"), ((0, (5, 1)), "D")]  # (line style, marker) of each val set


def val_sets(records: list[dict]) -> list[str]:
    """The named val sets of a run's val records: [] where every record is of the one default set."""
    return list({k: None for r in records if r.get("kind") == "val" for k in val_set_names(r)})


def without_named_sets(records: list[dict]) -> list[dict]:
    """The records, less the val records of named sets: their `loss` is the first set's, drawn as that set's
    curve. The val records of the one default set (a run before it named sets) stay: the plain val curve."""
    return [r for r in records if not (r.get("kind") == "val" and val_set_names(r))]


def plot(runs: dict[str, PlottedRun], out: Path, window: int = 1, title: str | None = None,
         references: str = "auto") -> Figure:
    """Draw the panels that runs (label -> PlottedRun) have data for into the image `out`; the figure.

    A run with several val sets gets one val curve per set (`val/<name>`) instead of the plain val loss; its val
    records of the one default set (before it named sets) stay its plain val curve. A curve of the EMA weights
    (`ema_...`) has its live curve's line and marker, the marker hollow."""
    named = {label: val_sets(run.records) for label, run in runs.items()}
    sets = dict.fromkeys(n for names in named.values() for n in names)
    every = SERIES + [Series("val", prefix + name, "loss", "loss") for name in sets for prefix in ("", EMA_PREFIX)]
    plain = ("loss", EMA_PREFIX + "loss")  # of the val records: the default set's (a named set's has its own)
    data = {label: {s: series(without_named_sets(records) if s.kind == "val" and s.field in plain else records,
                              s.kind, s.field)
                    for s in every}
            for label, records in ((label, without_skipped_steps(run.records)) for label, run in runs.items())}
    panels = list(dict.fromkeys(s.panel for s in every if any(len(d[s][0]) for d in data.values())))
    drawn = [s for s in every if not s.field.startswith(EMA_PREFIX) or any(len(d[s][0]) for d in data.values())]
    shared = {panel: sum(s.panel == panel for s in drawn) > 1 for panel in panels}  # label curves by kind
    fig, row = plt.subplots(1, len(panels), figsize=(PANEL_SIZE[0] * len(panels), PANEL_SIZE[1]), dpi=DPI,
                            squeeze=False)
    axes = dict(zip(panels, row[0]))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    scale, unit = token_unit(max(x.max() for d in data.values() for x, _ in d.values() if len(x)))
    for i, (label, d) in enumerate(data.items()):
        color = colors[i % len(colors)]
        for s, (x, y) in d.items():
            if not len(x):
                continue
            ax, y = axes[s.panel], y * 100 if s.percent else y
            kind = s.kind if s.field == "loss" or (s.kind != "val" and not s.field.startswith(EMA_PREFIX)) \
                else f"{s.kind}/{s.field}"
            name = f"{label} {kind}" if shared[s.panel] else label
            if s is TRAIN_LOSS:  # every step: smoothed, raw values faint behind
                if window > 1:
                    ax.plot(x / scale, y, color=color, alpha=0.2, linewidth=0.8)
                ax.plot(x / scale, smooth(y, window), color=color, linewidth=1.2, label=name)
            elif s is LEARNING_RATE:  # every step, as the schedule set it
                ax.plot(x / scale, y, color=color, linewidth=1.2, label=name)
            else:  # evaluations: every N steps; several val sets in styles of their own
                averaged = s.field.startswith(EMA_PREFIX)  # the EMA weights' curve: its live one's style, hollow
                live = s.field.removeprefix(EMA_PREFIX)
                style, marker = SET_STYLES[list(sets).index(live) % len(SET_STYLES)] if live in sets else \
                    ("--" if shared[s.panel] else "-", "o")
                ax.plot(x / scale, y, color=color, linestyle=style, marker=marker, markersize=4 if averaged else 3,
                        markerfacecolor="none" if averaged else color, label=name)
        for tokens in resume_tokens(runs[label].records):
            for ax in axes.values():
                ax.axvline(tokens / scale, color=color, linewidth=0.8, alpha=0.6, label=f"{label} resumed")
        for kind, (suffix, style) in MARKERS.items():
            for tokens in event_tokens(runs[label].records, kind):
                for ax in axes.values():
                    ax.axvline(tokens / scale, color=color, linewidth=0.8, linestyle=style, alpha=0.8,
                               label=f"{label} {suffix}")
    for s in every:
        if s.panel in axes:
            axes[s.panel].set(ylabel=s.ylabel, title=s.panel)
    loss_ref, hellaswag_refs = applicable_references([run.config for run in runs.values()], references)
    if "loss" in axes:
        ax = axes["loss"]
        fits = reference_fits(GPT2_VAL_LOSS, [y for d in data.values() for s, (_, y) in d.items() if s.panel == "loss"])
        if loss_ref and (fits or references == "all"):
            ax.axhline(GPT2_VAL_LOSS, color="gray", linestyle=":", label=f"GPT-2 124M checkpoint: {GPT2_VAL_LOSS}")
        elif loss_ref:
            ax.text(0.01, 0.02, f"GPT-2 124M reference ({GPT2_VAL_LOSS}) off-scale: --references all draws it",
                    transform=ax.transAxes, ha="left", va="bottom", fontsize=8, color="gray")
        losses = [y for d in data.values() for s, (_, y) in d.items() if s.panel == "loss"]
        entropies = {}  # label -> nats of each run's data: runs on the same data get one line
        for run in runs.values():
            entropy = run.unigram if references != "none" else None
            if entropy is None or (references == "auto" and not reference_fits(entropy[0], losses)):
                continue
            label = f"unigram entropy of {run.config['data_dir']}" + (" (sampled)" if entropy[1] else "")
            entropies[f"{label}: {entropy[0]:.2f}"] = entropy[0]
        for label, nats in entropies.items():
            ax.axhline(nats, color="gray", linestyle="-.", linewidth=1.0, label=label)
        ax.set(title="loss" + (f" (train smoothed over {window})" if window > 1 else ""))
    if "HellaSwag" in axes:
        for name, value in hellaswag_refs:
            axes["HellaSwag"].axhline(value, color="gray", linestyle=":" if name.startswith("GPT-2") else "-.",
                                      label=f"{name}: {value}%")
    for panel, ax in axes.items():
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))  # one entry per label: a run resumed twice is listed once
        # where the curves are not: losses fall, HellaSwag rises; the lr wherever its schedules leave room (a cosine
        # falls, a wsd holds at the top)
        ax.legend(unique.values(), unique.keys(), fontsize=8,
                  loc={"loss": "upper right", LEARNING_RATE.panel: "best"}.get(panel, "upper left"))
        ax.set(xlabel=f"tokens seen ({unit})" if unit else "tokens seen")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # no bbox_inches="tight": the pixel size stays PANEL_SIZE * DPI per panel. A PNG carries what it draws.
        fig.savefig(out, dpi=DPI, metadata={"Description": describe(fig)} if out.suffix.lower() == ".png" else None)
    except OSError as e:
        raise WriteError(f"{out}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return fig


LINE_STYLES = {"-": "solid", "--": "dashed", ":": "dotted", "-.": "dash-dot"}
# what a collection holds: scatter()'s points, fill_between()'s polygons, errorbar()'s bars (segments)
COLLECTION_ITEMS = [(PathCollection, "points"), (PolyCollection, "polygons"), (LineCollection, "segments")]


def describe(fig: Figure) -> str:
    """What the figure draws, as text: its size and title, then per panel its titles and any axis not linear,
    every line (label, colour, style, marker; of a curve its number of points and the range of its values, of a
    reference line where it stands), every collection (scatter points, filled bands, error bars: label, colours,
    marker, how many and where), its notes and legend. Two figures with the same description look the same to a
    reader: plot_log.py's and ladder.py's alike."""
    width, height = (fig.get_size_inches() * fig.dpi).round().astype(int)
    suptitle = fig._suptitle.get_text() if fig._suptitle else ""  # Figure.get_suptitle() is matplotlib 3.8+
    lines = [f"figure {width} x {height} px" + (f", title {suptitle!r}" if suptitle else "")]
    for ax in fig.axes:
        x_scale, y_scale = (f" ({scale})" if scale != "linear" else "" for scale in (ax.get_xscale(), ax.get_yscale()))
        lines.append(f"panel {ax.get_title()!r}: x {ax.get_xlabel()!r}{x_scale}, y {ax.get_ylabel()!r}{y_scale}")
        for line in ax.get_lines():
            look = f"{matplotlib.colors.to_hex(line.get_color())} {LINE_STYLES.get(line.get_linestyle(), 'none')} " \
                   f"width {line.get_linewidth():g}"
            if line.get_alpha() is not None:
                look += f" alpha {line.get_alpha():g}"
            if line.get_marker() not in (None, "None", ""):
                face = line.get_markerfacecolor()
                if str(face) == "none":
                    fill = "hollow"
                elif matplotlib.colors.same_color(face, line.get_color()):
                    fill = "filled"
                else:  # a face of another colour than its line (white: an open square on a white ground)
                    fill = f"filled {colours([face])}"
                look += f", marker {line.get_marker()} size {line.get_markersize():g} {fill}"
            x, y = line.get_xdata(), line.get_ydata()
            if line.get_transform() is ax.get_yaxis_transform():
                where = f"horizontal at y {y[0]:.4g}"
            elif line.get_transform() is ax.get_xaxis_transform():
                where = f"vertical at x {x[0]:.4g}"
            else:
                where = f"{len(x)} points, x {np.min(x):.4g} to {np.max(x):.4g}, y {np.min(y):.4g} to {np.max(y):.4g}"
            lines.append(f"  line {shown_label(line)}: {look}; {where}")
        for collection in ax.collections:
            items = next((name for cls, name in COLLECTION_ITEMS if isinstance(collection, cls)),
                         f"{type(collection).__name__} items")
            look = f"face {colours(collection.get_facecolor())}, edge {colours(collection.get_edgecolor())} width " \
                   f"{', '.join(f'{w:g}' for w in dict.fromkeys(collection.get_linewidths()))}"
            if isinstance(collection, PathCollection):  # every point the same path, of its own area (points^2)
                look += f", marker {marker_name(collection.get_paths()[0])} area " \
                        f"{', '.join(f'{s:g}' for s in dict.fromkeys(collection.get_sizes()))}"
            count = len(collection.get_offsets()) if isinstance(collection, PathCollection) else \
                len(collection.get_paths())
            box = collection.get_datalim(ax.transData)  # in data coordinates, whatever the scales
            lines.append(f"  collection {shown_label(collection)}: {look}; {count} {items}, "
                         f"x {box.x0:.4g} to {box.x1:.4g}, y {box.y0:.4g} to {box.y1:.4g}")
        lines += [f"  note {text.get_text()!r}" for text in ax.texts]
        if legend := ax.get_legend():
            lines.append(f"  legend: {', '.join(repr(text.get_text()) for text in legend.get_texts())}")
    return "\n".join(lines) + "\n"


def shown_label(artist) -> str:
    """An artist's label as describe() names it: matplotlib's own labels (_child0, _nolegend_) are no label."""
    label = artist.get_label()
    return "(unlabelled)" if label.startswith("_") else repr(label)


def colours(rgba) -> str:
    """Distinct colours, each as hex and its alpha where it is not opaque: '#1f77b4 alpha 0.15'."""
    shown = [matplotlib.colors.to_hex(c) + (f" alpha {a:g}" if (a := matplotlib.colors.to_rgba(c)[3]) < 1 else "")
             for c in rgba]
    return ", ".join(dict.fromkeys(shown)) or "none"


def marker_name(path) -> str:
    """The marker whose shape scatter() drew as `path` (a collection keeps the shape, not the name)."""
    for name in MarkerStyle.markers:
        style = MarkerStyle(name)
        shape = style.get_path().transformed(style.get_transform())
        if np.array_equal(shape.vertices, path.vertices) and np.array_equal(shape.codes, path.codes):
            return str(name)
    return f"a path of {len(path.vertices)} vertices"


def main(argv: list[str]) -> int:
    parser = ArgumentParser(description="Plot loss and HellaSwag curves of training runs.")
    parser.add_argument("out_dirs", nargs="+", metavar="OUT_DIR", type=path_argument,
                        help="run folders holding log.jsonl")
    parser.add_argument("-o", "--output", default="curves.png", type=path_argument,
                        help="image to write (default: curves.png)")
    parser.add_argument("--smooth", type=int, default=1, metavar="N", help="trailing moving average of train loss")
    parser.add_argument("--title", default=None, help="figure title")
    parser.add_argument("--references", choices=("auto", "all", "none"), default="auto",
                        help="reference lines: those that apply to the runs' model and data (auto, the default), "
                             "all of them, or none")
    args = parser.parse_args(argv)
    names = [Path(d).resolve().name for d in args.out_dirs]
    labels = names if len(set(names)) == len(names) else list(args.out_dirs)  # same name: use the paths
    runs = {label: load_run(out_dir, unigram=args.references != "none")  # the entropy: only for its line
            for label, out_dir in zip(labels, args.out_dirs)}
    plot(runs, Path(args.output), args.smooth, args.title, args.references)
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
