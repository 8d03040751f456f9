"""plot_log.py: run as a user would on synthetic logs, then look at the image it wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

import plot_log

REPO = Path(__file__).resolve().parents[1]
HEIGHT, WIDTH = 450, 1200  # plot_log.FIGSIZE * plot_log.DPI


def write_log(out_dir: Path, records: list[dict], torn: str = "") -> Path:
    """A log.jsonl of `records`, optionally ending in a torn (half-written) line."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "log.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
        f.write(torn)
    return out_dir


def fake_run(steps: int = 200, batch: int = 524288, start_loss: float = 10.9, end_loss: float = 3.4,
             hellaswag: bool = True, seed: int = 0) -> list[dict]:
    """Records shaped like the trainer's: a decaying noisy train loss, val every 50 steps, HellaSwag too."""
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
    return records


def run_plot(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "plot_log.py"), *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def check_image(path: Path) -> np.ndarray:
    """The image at `path`: of the expected pixel size, and not blank."""
    image = matplotlib.image.imread(path)
    assert image.shape[:2] == (HEIGHT, WIDTH)
    assert image[..., :3].var() > 1e-3
    return image


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
    image = check_image(out)
    # Both panels carry curves: the HellaSwag half is not a plain background either.
    assert image[:, WIDTH // 2:, :3].var() > 1e-3


def test_missing_log_is_one_error_line(tmp_path):
    out = tmp_path / "curves.png"
    proc = run_plot(tmp_path / "nothing_here", "-o", out)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("error: ") and str(tmp_path / "nothing_here" / "log.jsonl") in lines[0]
    assert not out.exists()


def test_empty_log_is_an_error(tmp_path):
    run = write_log(tmp_path / "empty", [], torn='{"kind": "tr')
    proc = run_plot(run, "-o", tmp_path / "curves.png")
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {run / 'log.jsonl'}: no records"


def test_train_records_only(tmp_path):
    records = [r for r in fake_run(steps=30, batch=2048, hellaswag=False) if r["kind"] == "train"]
    run = write_log(tmp_path / "demo", records)
    out = tmp_path / "curves.png"
    proc = run_plot(run, "-o", out)
    assert proc.returncode == 0, proc.stderr
    check_image(out)


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
