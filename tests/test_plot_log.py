"""plot_log.py: run as a user would on synthetic logs, then look at the image and figure it made."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import yaml

import plot_log
from common.errors import DataError
from forked_ranks import launch
from model import PRESETS
from PIL import Image
from scripts import pictures
from launch.config import parse_args

REPO = Path(__file__).resolve().parents[1]
HEIGHT, PANEL_WIDTH = 450, 600  # plot_log.PANEL_SIZE * plot_log.DPI
DEMO = parse_args(["--config", str(REPO / "configs/demo.yaml")]).to_dict()  # as the trainer writes config.yaml
GPT2_124M = parse_args(["--config", str(REPO / "configs/gpt2_124m.yaml")]).to_dict()
GPT2_350M = parse_args(["--config", str(REPO / "configs/gpt2_350m.yaml")]).to_dict()


def write_log(out_dir: Path, records: list[dict], torn: str = "", config: dict | None = None) -> Path:
    """A run folder: log.jsonl of `records`, optionally ending in a torn (half-written) line, and config.yaml."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "log.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
        f.write(torn)
    if config is not None:
        (out_dir / "config.yaml").write_text(yaml.safe_dump(config))
    return out_dir


def fake_run(steps: int = 200, batch: int = 524288, start_loss: float = 10.9, end_loss: float = 3.4,
             hellaswag: bool = True, seed: int = 0, resumes: tuple[int, ...] = ()) -> list[dict]:
    """Records shaped like the trainer's: a decaying noisy train loss, val every 50 steps, HellaSwag too,
    and a startup record per launch: step 0, then each step in `resumes`."""
    rng = np.random.default_rng(seed)
    records = []
    for step in range(steps):
        if step % 50 == 0 or step == steps - 1:
            loss = end_loss + (start_loss - end_loss) * np.exp(-step / 30)
            records.append({"kind": "val", "step": step, "loss": loss + 0.05, "tokens": step * batch})
            if hellaswag:
                acc = 0.25 + 0.05 * step / steps
                records.append({"kind": "hellaswag", "step": step, "acc_norm": acc, "acc": acc - 0.01,
                                "n": 10042, "tokens": step * batch})
        loss = end_loss + (start_loss - end_loss) * np.exp(-step / 30) + rng.normal(0, 0.05)
        records.append({"kind": "train", "step": step, "loss": float(loss), "lr": 6e-4, "grad_norm": 0.9,
                        "tokens": (step + 1) * batch, "tokens_per_sec": 468000.0, "mfu": None, "step_ms": 1120.0})
        if step == 0 or step in resumes:
            records.append({"kind": "startup", "step": step, "compile": False, "seconds_to_first_step": 12.0})
    return records


def figure(tmp_path: Path, runs: dict[str, tuple[list[dict], dict | None]], references: str = "auto"):
    """The figure plot_log draws for run folders written from name -> (records, config or None). A config's
    data_dir is moved under tmp_path, where no shards are (the unigram entropy line needs them: a checkout
    that prepared data/shakespeare draws the same figure), unless it is there already."""
    def no_data(config: dict | None) -> dict | None:
        if not config or str(config.get("data_dir", "")).startswith(str(tmp_path)):
            return config
        return {**config, "data_dir": str(tmp_path / "no-shards" / config["data_dir"])}

    loaded = {name: plot_log.load_run(write_log(tmp_path / name, records, config=no_data(config)))
              for name, (records, config) in runs.items()}
    return plot_log.plot(loaded, tmp_path / "curves.png", references=references)


def labels(ax) -> list[str]:
    return [line.get_label() for line in ax.get_lines()]


def reference_labels(fig) -> list[list[str]]:
    """Per panel, the labels of its horizontal reference lines (the lr panel, which has none, left out)."""
    return [[line.get_label() for line in ax.get_lines() if line.get_color() == "gray"] for ax in fig.axes
            if ax.get_title() != plot_log.LEARNING_RATE.panel]


def run_plot(*args):
    """`python plot_log.py ARGS`: its exit status and output (forked from a warm process, tests/forked_ranks.py)."""
    return launch(list(map(str, args)), target="plot_log:main", timeout=120)


def check_image(path: Path, panels: int) -> np.ndarray:
    """The image at `path`: of the pixel size of `panels` panels side by side, and not blank."""
    image = matplotlib.image.imread(path)
    assert image.shape[:2] == (HEIGHT, PANEL_WIDTH * panels)
    assert image[..., :3].var() > 1e-3
    return image


@pytest.mark.slow
def test_two_runs_with_nulls_and_torn_line(tmp_path):
    records_a = fake_run(seed=0)
    records_a[5]["loss"] = None  # a null value is skipped, not plotted as 0
    records_a.append({"kind": "sample", "step": 199, "text": "Hello"})
    run_a = write_log(tmp_path / "run_a", records_a, torn='{"kind": "train", "step": 200, "lo')
    run_b = write_log(tmp_path / "run_b", fake_run(start_loss=11.0, end_loss=3.2, seed=1))
    out = tmp_path / "plots" / "curves.png"
    proc = run_plot(run_a, run_b, "-o", out, "--smooth", 10, "--title", "two runs")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    image = check_image(out, panels=3)
    # Every panel carries curves: the HellaSwag and lr thirds are not a plain background either.
    assert image[:, PANEL_WIDTH:2 * PANEL_WIDTH, :3].var() > 1e-3 and image[:, 2 * PANEL_WIDTH:, :3].var() > 1e-3


def test_one_panel_per_kind_of_data(tmp_path):
    fig = figure(tmp_path, {"demo": (fake_run(steps=30, batch=2048, hellaswag=False), DEMO)})
    assert [ax.get_title() for ax in fig.axes] == ["loss", "learning rate"]
    assert labels(fig.axes[0]) == ["demo train", "demo val"]
    check_image(tmp_path / "curves.png", panels=2)
    fig = figure(tmp_path, {"demo": (fake_run(steps=30, batch=2048, hellaswag=False), DEMO),
                            "gpt2": (fake_run(), GPT2_124M)})  # one run with HellaSwag: a second panel
    assert [ax.get_title() for ax in fig.axes] == ["loss", "HellaSwag", "learning rate"]
    assert [label for label in labels(fig.axes[1]) if not label.startswith("GPT")] == ["gpt2"]
    check_image(tmp_path / "curves.png", panels=3)


def test_a_run_with_several_val_sets_gets_one_val_curve_per_set_in_a_style_of_its_own(tmp_path):
    records = fake_run(steps=30, batch=2048, hellaswag=False)
    for r in records:
        if r["kind"] == "val":  # evals/val_loss.py's record with named sets: `loss` is the first set's
            r.update(edu=r["loss"], code=r["loss"] - 0.5)
    fig = figure(tmp_path, {"mix": (records, DEMO), "plain": (fake_run(steps=30, batch=2048, hellaswag=False), DEMO)})
    assert labels(fig.axes[0]) == ["mix train", "mix val/edu", "mix val/code", "plain train", "plain val"]
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert lines["mix val/edu"].get_linestyle() != lines["mix val/code"].get_linestyle()
    assert list(lines["mix val/code"].get_ydata()) == [r["code"] for r in records if r["kind"] == "val"]


def test_plain_val_points_stay_when_sets_are_named_and_ema_curves_differ_from_their_live_ones(tmp_path):
    """A run whose val records name sets from some step on (a resume with val_sets) keeps its earlier plain val
    points; each set's EMA curve (ema_<set>) is drawn apart from its live one: the marker hollow."""
    records = fake_run(steps=30, batch=2048, hellaswag=False)
    vals = [r for r in records if r["kind"] == "val"]  # steps 0, 29
    plain = vals[0]["loss"]
    vals[0]["ema_loss"] = plain - 0.1
    vals[1].update(edu=vals[1]["loss"], code=vals[1]["loss"] - 0.5, ema_loss=vals[1]["loss"] - 0.1,
                   ema_edu=vals[1]["loss"] - 0.1, ema_code=vals[1]["loss"] - 0.6)
    fig = figure(tmp_path, {"mix": (records, DEMO)})
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert list(lines["mix val"].get_ydata()) == [plain]  # the step-0 point, not the named record's loss
    assert list(lines["mix val/ema_loss"].get_ydata()) == [plain - 0.1]
    assert list(lines["mix val/ema_edu"].get_ydata()) == [vals[1]["loss"] - 0.1]

    def look(line):
        return line.get_linestyle(), line.get_marker(), str(line.get_markerfacecolor())

    for name, averaged in (("val", "val/ema_loss"), ("val/edu", "val/ema_edu"), ("val/code", "val/ema_code")):
        live, ema = lines[f"mix {name}"], lines[f"mix {averaged}"]
        assert live.get_color() == ema.get_color() and look(live) != look(ema), name
        assert ema.get_markerfacecolor() == "none" and ema.get_marker() == live.get_marker()


@pytest.mark.slow
def test_train_records_only(tmp_path):
    records = [r for r in fake_run(steps=30, batch=2048, hellaswag=False) if r["kind"] == "train"]
    run = write_log(tmp_path / "demo", records)
    out = tmp_path / "curves.png"
    proc = run_plot(run, "-o", out)
    assert proc.returncode == 0, proc.stderr
    check_image(out, panels=2)  # loss, and the lr


def test_references_follow_model_size_and_data(tmp_path):
    gpt2 = "GPT-2 124M checkpoint: 3.29"
    small = ["GPT-2 124M: 29.4%", "GPT-3 Small (125M): 33.7%"]
    medium = ["GPT-2 350M: 37.5%", "GPT-3 Medium (350M): 43.6%"]
    # A Shakespeare demo, or a folder without config.yaml: no reference applies.
    assert reference_labels(figure(tmp_path, {"demo": (fake_run(), DEMO)})) == [[], []]
    assert reference_labels(figure(tmp_path, {"bare": (fake_run(), None)})) == [[], []]
    # GPT-2 sizes on FineWeb-Edu: the val loss line, and the HellaSwag figures of that size only.
    assert reference_labels(figure(tmp_path, {"gpt2": (fake_run(), GPT2_124M)})) == [[gpt2], small]
    assert reference_labels(figure(tmp_path, {"m": (fake_run(), GPT2_350M)})) == [[gpt2], medium]
    # Compared runs of two sizes: both sizes' figures.
    fig = figure(tmp_path, {"gpt2": (fake_run(), GPT2_124M), "m": (fake_run(), GPT2_350M)})
    assert reference_labels(fig) == [[gpt2], small + medium]
    # A custom model of a GPT-2 shape is that size; on other data its val loss is not comparable.
    custom = {**DEMO, "n_layer": 24, "n_head": 16, "n_embd": 1024}
    assert reference_labels(figure(tmp_path, {"custom": (fake_run(), custom)})) == [[], medium]


@pytest.mark.slow
def test_references_flag(tmp_path):
    every = [f"{name}: {value}%" for _, refs in plot_log.HELLASWAG_REFS.values() for name, value in refs]
    fig = figure(tmp_path, {"demo": (fake_run(), DEMO)}, references="all")
    assert reference_labels(fig) == [["GPT-2 124M checkpoint: 3.29"], every]
    assert len(every) == 8
    assert reference_labels(figure(tmp_path, {"gpt2": (fake_run(), GPT2_124M)}, references="none")) == [[], []]
    run = write_log(tmp_path / "gpt2", fake_run(), config=GPT2_124M)
    proc = run_plot(run, "-o", tmp_path / "c.png", "--references", "none")
    assert proc.returncode == 0, proc.stderr


def test_loss_reference_off_scale_is_a_note_unless_asked(tmp_path):
    # A short resumed segment far above 3.29: auto notes the line instead of squashing the curves.
    records = [r for r in fake_run(start_loss=5.5, end_loss=5.4) if r["kind"] != "hellaswag"]
    fig = figure(tmp_path, {"gpt2": (records, GPT2_124M)})
    assert reference_labels(fig) == [[]]
    assert any("off-scale" in text.get_text() for text in fig.axes[0].texts)
    fig = figure(tmp_path, {"gpt2": (records, GPT2_124M)}, references="all")
    assert reference_labels(fig) == [["GPT-2 124M checkpoint: 3.29"]]
    assert not fig.axes[0].texts


def test_resumes_are_marked_per_run(tmp_path):
    batch = 524288
    fig = figure(tmp_path, {"a": (fake_run(resumes=(60, 150)), GPT2_124M),
                            "b": (fake_run(resumes=(100,), seed=1), GPT2_124M),
                            "fresh": (fake_run(seed=2), GPT2_124M)})
    for ax in fig.axes:  # loss and HellaSwag panels alike
        markers = {}
        for line in ax.get_lines():
            if line.get_label().endswith(" resumed"):
                markers.setdefault(line.get_label(), []).append((line.get_xdata()[0], line.get_color()))
        run_colors = {line.get_label().split()[0]: line.get_color() for line in ax.get_lines()
                      if line.get_label() in ("a", "b", "a train", "b train")}
        unit = 1e6  # tokens seen (millions)
        assert markers == {"a resumed": [(60 * batch / unit, run_colors["a"]), (150 * batch / unit, run_colors["a"])],
                           "b resumed": [(100 * batch / unit, run_colors["b"])]}
        assert [t.get_text() for t in ax.get_legend().get_texts()].count("a resumed") == 1  # one entry per run


def test_skips_and_rollbacks_are_marked_and_a_skipped_steps_loss_is_left_out(tmp_path):
    batch = 524288
    records = fake_run(resumes=(150,))
    for r in records:  # update 80 was a spike: its loss was logged, then a skip record
        if r["kind"] == "train" and r["step"] == 80:
            r["loss"] = 5000.0
    records += [{"kind": "skip", "step": 80, "tokens": 81 * batch, "loss": 5000.0, "grad_norm": 400.0,
                 "reason": "loss 5000 > 4 + 6 x 0.1"},
                {"kind": "rollback", "step": 100, "tokens": 100 * batch, "from_step": 120, "reason": "spikes",
                 "skipped_batches": [100, 120]}]
    fig = figure(tmp_path, {"a": (records, GPT2_124M), "plain": (fake_run(seed=1), GPT2_124M)})
    unit = 1e6
    for ax in fig.axes:
        marks = {}
        for line in ax.get_lines():
            if line.get_label().startswith("a ") and line.get_label() != "a train":
                marks.setdefault(line.get_label(), []).append((line.get_xdata()[0], line.get_linestyle()))
        assert {k: v for k, v in marks.items() if k != "a val"} == {
            "a resumed": [(150 * batch / unit, "-")], "a rolled back": [(100 * batch / unit, "--")],
            "a skipped a spike": [(81 * batch / unit, ":")]}
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "a rolled back" in legend and "a skipped a spike" in legend and "plain rolled back" not in legend
    loss = fig.axes[0]
    train = next(line for line in loss.get_lines() if line.get_label() == "a train")
    assert max(train.get_ydata()) < 20  # the spike's 5000 is not on the curve
    assert loss.get_ylim()[1] < 20


def test_hellaswag_reference_sizes_match_the_model_presets():
    assert {size: shape for size, (shape, _) in plot_log.HELLASWAG_REFS.items()} == \
        {size: (p["n_layer"], p["n_embd"]) for size, p in PRESETS.items()}


@pytest.mark.slow
def test_missing_log_is_one_error_line(tmp_path):
    out = tmp_path / "curves.png"
    proc = run_plot(tmp_path / "nothing_here", "-o", out)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("error: ") and str(tmp_path / "nothing_here" / "log.jsonl") in lines[0]
    assert not out.exists()
    with pytest.raises(DataError, match="nothing_here/log.jsonl: no such file"):  # main raises; run_cli reports
        plot_log.main([str(tmp_path / "nothing_here")])


@pytest.mark.slow
def test_empty_log_is_an_error(tmp_path):
    run = write_log(tmp_path / "empty", [], torn='{"kind": "tr')
    proc = run_plot(run, "-o", tmp_path / "curves.png")
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {run / 'log.jsonl'}: no train, val or hellaswag records"
    run = write_log(tmp_path / "samples_only", [{"kind": "sample", "step": 0, "text": "Hi"}])
    with pytest.raises(DataError, match="no train, val or hellaswag records"):
        plot_log.load_run(run)


@pytest.mark.slow
def test_bad_config_or_argument_is_one_error_line(tmp_path):
    run = write_log(tmp_path / "run", fake_run(steps=10))
    (run / "config.yaml").write_text("model: [gpt2\n")
    proc = run_plot(run, "-o", tmp_path / "curves.png")
    assert (proc.returncode, proc.stderr) == (2, f"error: {run / 'config.yaml'}: not a YAML mapping of config keys\n")
    proc = run_plot(run, "--references", "some")
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("error: ") and "--references" in proc.stderr


@pytest.mark.slow
def test_unwritable_output_is_one_error_line(tmp_path):
    run = write_log(tmp_path / "run", fake_run(steps=10))
    (tmp_path / "file").write_text("")
    proc = run_plot(run, "-o", tmp_path / "file" / "curves.png")  # a file where a folder should be
    assert proc.returncode == 1
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(f"error: {tmp_path / 'file'}")


def test_series_skips_nulls_and_sorts_by_tokens():
    records = [{"kind": "train", "step": 2, "loss": 2.0, "tokens": 30},
               {"kind": "train", "step": 1, "loss": None, "tokens": 20},
               {"kind": "train", "step": 0, "loss": 3.0, "tokens": 10},
               {"kind": "val", "step": 0, "loss": 9.0, "tokens": 0},
               {"kind": "train", "step": 3, "loss": float("nan"), "tokens": 40}]
    tokens, values = plot_log.series(records, "train", "loss")
    assert tokens.tolist() == [10, 30] and values.tolist() == [3.0, 2.0]


def test_smooth_is_a_trailing_mean():
    values = np.array([4.0, 2.0, 6.0, 0.0])
    assert plot_log.smooth(values, 1).tolist() == values.tolist()
    assert plot_log.smooth(values, 2).tolist() == pytest.approx([4.0, 3.0, 4.0, 3.0])
    assert plot_log.smooth(values, 10).tolist() == pytest.approx([4.0, 3.0, 4.0, 3.0])


def test_token_unit_follows_the_range():
    assert plot_log.token_unit(10e9) == (1e9, "billions")
    assert plot_log.token_unit(1.2e6) == (1e6, "millions")
    assert plot_log.token_unit(5e4) == (1e3, "thousands")


def test_reference_line_only_when_the_data_still_fills_the_axis():
    gpt2_run = [np.array([10.9, 6.0, 3.5])]
    far_segment = [np.array([5.40, 5.45])]  # a narrow band far above 3.29: the line would squash it
    assert plot_log.reference_fits(3.29, gpt2_run)
    assert plot_log.reference_fits(3.29, [np.array([3.1, 3.4])])  # line inside the data
    assert not plot_log.reference_fits(3.29, far_segment)
    assert not plot_log.reference_fits(3.29, [np.array([])])


# --- issue 44: the lr panel, and the unigram entropy of the train data ---------------------------------------

def test_the_lr_panel_draws_the_lr_of_every_step(tmp_path):
    records = fake_run(steps=30, batch=2048, hellaswag=False)
    for r in records:
        if r["kind"] == "train":
            r["lr"] = 1e-3 * (r["step"] + 1) / 30  # a warmup
    fig = figure(tmp_path, {"demo": (records, DEMO)})
    lr = fig.axes[-1]
    assert lr.get_title() == "learning rate" and labels(lr) == ["demo"]
    assert list(lr.get_lines()[0].get_ydata()) == [r["lr"] for r in records if r["kind"] == "train"]


def shards_of(folder: Path, tokens: list[int], train_shards: int = 2) -> Path:
    """A data folder whose train shards hold `tokens` (split over train_shards files), and a val shard."""
    from data.shards import shard_name, write_shard

    folder.mkdir(parents=True)
    write_shard(folder / shard_name("t", "val", 0), np.array([7, 7, 7], dtype=np.uint16))  # not counted
    for index, part in enumerate(np.array_split(np.array(tokens, dtype=np.uint16), train_shards), start=1):
        write_shard(folder / shard_name("t", "train", index), part)
    return folder


def test_the_unigram_entropy_is_computed_from_the_train_shards_of_the_runs_data(tmp_path):
    even = shards_of(tmp_path / "even", [0, 1, 2, 3] * 50)  # four tokens, equally often: ln 4
    skewed = shards_of(tmp_path / "skewed", [0] * 150 + [1] * 50)  # 3/4 and 1/4
    assert plot_log.unigram_entropy({"data_dir": str(even)}) == pytest.approx((np.log(4), False))
    h = -(0.75 * np.log(0.75) + 0.25 * np.log(0.25))
    assert plot_log.unigram_entropy({"data_dir": str(skewed)})[0] == pytest.approx(h)
    # a mixture reads its sources in the share of their weights: (3/4 of 1/4 each) + (1/4 of skewed's)
    mixed = np.array([0.75 / 4 + 0.25 * 0.75, 0.75 / 4 + 0.25 * 0.25, 0.75 / 4, 0.75 / 4])
    assert plot_log.unigram_entropy({"data_dir": f"{even}:3,{skewed}:1"})[0] == \
        pytest.approx(-(mixed * np.log(mixed)).sum())
    assert plot_log.unigram_entropy({"data_dir": str(skewed)}, limit=100) == (0.0, True)  # the first 100: all 0s
    assert plot_log.unigram_entropy({"data_dir": str(tmp_path / "none")}) is None
    assert plot_log.unigram_entropy({}) is None


def test_the_unigram_entropy_line_is_labelled_with_its_data_and_value(tmp_path):
    data = shards_of(tmp_path / "corpus", list(range(64)) * 10)  # ln 64 = 4.16 nats
    records = fake_run(steps=30, batch=2048, start_loss=6.0, end_loss=3.0, hellaswag=False)
    config = {**DEMO, "data_dir": str(data)}
    (line,) = [line for line in figure(tmp_path, {"run": (records, config)}).axes[0].get_lines()
               if line.get_color() == "gray"]
    assert line.get_label() == f"unigram entropy of {data}: 4.16"
    assert line.get_ydata()[0] == pytest.approx(np.log(64))
    assert reference_labels(figure(tmp_path, {"run": (records, config)}, references="none")) == [[]]
    # far below losses that stay far above it: auto leaves it out, all draws it
    high = fake_run(steps=30, batch=2048, start_loss=10.9, end_loss=10.0, hellaswag=False)
    assert reference_labels(figure(tmp_path, {"run": (high, config)})) == [[]]
    assert reference_labels(figure(tmp_path, {"run": (high, config)}, references="all")) == \
        [["GPT-2 124M checkpoint: 3.29", f"unigram entropy of {data}: 4.16"]]


# --- issue 53: what a figure draws, as text; one unigram line per data; the lr legend out of the way ----------

def test_the_description_tells_apart_what_a_reader_sees(tmp_path):
    """describe() names each line's label, colour, style and marker (an EMA curve's hollow), the reference lines
    and the legends: two figures a reader tells apart have different descriptions."""
    records = fake_run(steps=30, batch=2048, hellaswag=False)
    for r in records:
        if r["kind"] == "val":
            r["ema_loss"] = r["loss"] - 0.1
    data = shards_of(tmp_path / "corpus", list(range(64)) * 10)
    text = plot_log.describe(figure(tmp_path, {"run": (records, {**DEMO, "data_dir": str(data)})},
                                    references="all"))
    assert text.splitlines()[:2] == ["figure 1200 x 450 px", "panel 'loss': x 'tokens seen (thousands)', y 'loss'"]
    assert "line 'run val': #1f77b4 dashed width 1.5, marker o size 3 filled; 2 points" in text
    assert "line 'run val/ema_loss': #1f77b4 dashed width 1.5, marker o size 4 hollow; 2 points" in text
    assert f"line 'unigram entropy of {data}: 4.16': #808080 dash-dot width 1; horizontal at y 4.159" in text
    assert "panel 'learning rate': x 'tokens seen (thousands)', y 'lr'" in text
    assert "legend: 'run train', 'run val', 'run val/ema_loss', 'GPT-2 124M checkpoint: 3.29'" in text
    with Image.open(tmp_path / "curves.png") as image:  # every PNG of plot_log.py carries it
        assert image.text["Description"] == text


def test_the_description_tells_apart_points_bands_and_error_bars(tmp_path):
    """Beyond plot_log.py's lines, describe() names what ladder.py draws (docs/ladder.png): log axes, scatter points
    (marker, area, face and edge), a band's colour and alpha, error bars, a marker face of another colour."""
    import matplotlib.pyplot as plt

    def drawn(star: str) -> str:
        fig, ax = plt.subplots(figsize=(4, 3), dpi=100)
        ax.scatter([1e12, 1e13], [7.0, 6.5], color="C0", s=22, label="rungs")
        ax.scatter([3e13], [6.3], marker=star, s=90, color="C0", edgecolor="black", lw=0.5, label="trained")
        ax.fill_between([1e12, 3e13], [6.9, 6.3], [7.1, 6.6], color="C0", alpha=0.15, lw=0)
        ax.errorbar([3e13], [6.45], yerr=[[0.05], [0.1]], fmt="s", color="C0", capsize=4, mfc="white")
        ax.set(xscale="log", yscale="log", title="ladder")
        plt.close(fig)
        return plot_log.describe(fig)

    text = drawn("*")
    assert "panel 'ladder': x '' (log), y '' (log)" in text
    assert "collection 'rungs': face #1f77b4, edge #1f77b4 width 1, marker o area 22; 2 points, x 1e+12 to 1e+13, " \
           "y 6.5 to 7" in text
    assert "collection 'trained': face #1f77b4, edge #000000 width 0.5, marker * area 90; 1 points" in text
    assert "collection (unlabelled): face #1f77b4 alpha 0.15, edge #1f77b4 alpha 0.15 width 0; 1 polygons, " \
           "x 1e+12 to 3e+13, y 6.3 to 7.1" in text
    assert "collection (unlabelled): face none, edge #1f77b4 width 1.5; 1 segments, x 3e+13 to 3e+13, " \
           "y 6.4 to 6.55" in text
    assert "line (unlabelled): #1f77b4 none width 1.5, marker s size 6 filled #ffffff; 1 points" in text
    assert drawn("D") != text  # another marker, another description


def test_runs_on_the_same_data_get_one_unigram_entropy_line(tmp_path):
    data = shards_of(tmp_path / "corpus", list(range(64)) * 10)
    config = {**DEMO, "data_dir": str(data)}
    records = fake_run(steps=30, batch=2048, start_loss=6.0, end_loss=3.0, hellaswag=False)
    fig = figure(tmp_path, {"a": (records, config), "b": (records, config)})
    assert reference_labels(fig) == [[f"unigram entropy of {data}: 4.16"]]


def test_the_lr_legend_leaves_every_schedule_in_sight(tmp_path):
    """A cosine falls to the lower right, a wsd holds at the top until its cooldown: the lr panel's legend covers
    neither (recipes.png: faithful against modern)."""
    cosine, wsd = fake_run(steps=100, batch=2048, hellaswag=False), fake_run(steps=100, batch=2048, hellaswag=False)
    for c, w in zip(cosine, wsd):
        if c["kind"] == "train":
            c["lr"] = 4e-4 + 3.6e-3 * (1 + np.cos(np.pi * c["step"] / 99)) / 2
            w["lr"] = 4e-3 if w["step"] < 80 else 4e-3 - 3.6e-3 * (w["step"] - 79) / 20
    ax = figure(tmp_path, {"faithful_s1337": (cosine, DEMO), "modern_s1337": (wsd, DEMO)}).axes[-1]
    box = ax.get_legend().get_window_extent()
    for line in ax.get_lines():
        x, y = ax.transData.transform(np.column_stack([line.get_xdata(), line.get_ydata()])).T  # pixels
        covered = (box.x0 <= x) & (x <= box.x1) & (box.y0 <= y) & (y <= box.y1)
        assert not covered.any(), f"the legend covers {line.get_label()}"


# --- issue 53: the shipped pictures are today's figures of the runs stored beside them -------------------------

def test_every_shipped_picture_is_redrawn_by_make_pictures():
    assert sorted(p.stem for p in (REPO / "docs").glob("*.png")) == sorted(pictures.PICTURES)
    assert sorted(p.name for p in pictures.STORED.iterdir()) == sorted(pictures.PICTURES)


@pytest.mark.parametrize("name", sorted(pictures.PICTURES))
def test_a_shipped_picture_is_what_plot_log_draws_today_from_its_stored_runs(tmp_path, name):
    """docs/pictures/NAME/figure.txt, and the text docs/NAME.png carries, describe the figure today's plot_log.py
    draws from the stored runs, or ladder.py from a ladder's stored ladder.json (and the PNG has its size): a change
    to what either draws fails here until `make pictures` has redrawn the pictures."""
    description = plot_log.describe(pictures.draw(name, tmp_path / "picture.png"))
    assert (pictures.STORED / name / "figure.txt").read_text() == description, "make pictures redraws it"
    with Image.open(REPO / "docs" / f"{name}.png") as shipped, Image.open(tmp_path / "picture.png") as drawn:
        assert (shipped.text.get("Description"), shipped.size) == (description, drawn.size), "make pictures redraws it"
