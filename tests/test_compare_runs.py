"""compare_runs.py (two recipes over seeds) and scripts/compare_recipes.py's use of it, on run folders written here.

The figures of each run are fixed numbers in a log.jsonl and a report.json; the t-tests themselves are checked
against SciPy and by hand in test_stats.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from common.errors import run_cli
from evals.stats import paired, welch

LIVE_A = [5.9701, 5.9842, 6.0206, 5.9911]  # final val losses of 4 seeds of recipe A
LIVE_B = [5.7207, 5.7062, 5.6892, 5.7342]
EMA_A = [5.9426, 5.9529, 5.9853, 5.9711]
ACC_A, ACC_B = [0.2513, 0.2641, 0.2580, 0.2544], [0.2550, 0.2498, 0.2611, 0.2575]  # a card task's acc_norm


def write_run(folder: Path, losses: list[float], ema: float | None = None, acc: float | None = None,
              steps: int = 400) -> Path:
    """A run folder: val records every 100 steps ending at `steps` (loss, bpb = loss x 0.44), and a report card."""
    folder.mkdir(parents=True)
    records = [{"kind": "train", "step": 0, "loss": 10.9}]
    for step, loss in zip(range(0, steps + 1, steps // (len(losses) - 1)), losses):
        record = {"kind": "val", "step": step, "tokens": step * 1024, "loss": loss, "bpb": loss * 0.44}
        if ema is not None and step == steps:
            record.update(ema_loss=ema, ema_bpb=ema * 0.44)
        records.append(record)
    (folder / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if acc is not None:
        card = {"tasks": {"hellaswag": {"metric": "acc_norm", "value": acc, "n": 10042}}}
        (folder / "report.json").write_text(json.dumps(card))
    return folder


@pytest.fixture
def recipes(tmp_path):
    a = [write_run(tmp_path / f"a{i}", [10.8, 7.0, 6.3, 6.1, loss], ema, acc)
         for i, (loss, ema, acc) in enumerate(zip(LIVE_A, EMA_A, ACC_A))]
    b = [write_run(tmp_path / f"b{i}", [10.8, 6.5, 6.05, 5.8, loss], acc=acc) for i, (loss, acc) in enumerate(zip(LIVE_B, ACC_B))]
    return a, b


def test_two_recipes_are_compared_by_welchs_test_per_metric(recipes, tmp_path, capfd):
    from compare_runs import main

    a, b = recipes
    argv = ["--a", *map(str, a), "--b", *map(str, b), "--names", "faithful,modern", "--json", str(tmp_path / "rows.json")]
    assert run_cli(main, argv) == 0
    out = capfd.readouterr().out
    rows = {row["metric"]: row for row in json.loads((tmp_path / "rows.json").read_text())}
    assert list(rows) == ["final val loss", "final val bpb", "hellaswag acc_norm"]
    loss, accuracy = welch(LIVE_A, LIVE_B), welch(ACC_A, ACC_B)
    assert rows["final val loss"]["result"]["p"] == loss.p and rows["final val loss"]["result"]["interval"] == list(loss.interval)
    assert rows["final val bpb"]["a"] == pytest.approx([x * 0.44 for x in LIVE_A], rel=1e-15)
    assert rows["hellaswag acc_norm"]["result"]["diff"] == accuracy.diff and not rows["hellaswag acc_norm"]["lower_is_better"]
    assert out.startswith("faithful: 4 runs, modern: 4 runs; Welch's t-test, two-sided, alpha 0.05\n")
    low, high = loss.interval
    assert (f"| final val loss | {loss.mean_a:.4f} | {loss.mean_b:.4f} | {loss.diff:+.4f} ({low:+.4f} to {high:+.4f}) "
            f"| {loss.p:.1e} | modern is better at p = {loss.p:.1e} |") in out
    assert f"| not distinguishable with 4 and 4 runs (p = {accuracy.p:.3f}) |" in out


def test_the_same_runs_live_against_their_ema_are_paired(recipes, capfd):
    from compare_runs import main

    a, _ = recipes
    assert run_cli(main, ["--a", *map(str, a), "--b", *map(str, a), "--b_weights", "ema", "--names", "live,EMA"]) == 0
    out = capfd.readouterr().out
    result = paired(LIVE_A, EMA_A)
    assert out.startswith("live: 4 runs, EMA: 4 runs; paired t-test (the same runs)")
    assert f"| final val loss | {result.mean_a:.4f} | {result.mean_b:.4f} | {result.diff:+.4f} (" in out
    assert f"EMA is better at p = {result.p:.3f} |" in out  # lower loss
    assert "hellaswag" not in out  # no report_ema.json: the card's tasks of the EMA weights were not measured


def test_bad_groups_are_one_error_line(recipes, tmp_path, capfd):
    from compare_runs import main

    a, b = recipes
    (tmp_path / "empty").mkdir()
    cases = [
        (["--a", str(a[0]), "--b", str(tmp_path / "empty")], f"{tmp_path / 'empty' / 'log.jsonl'}: no such file"),
        (["--a", *map(str, a), "--b", *map(str, a)], "--b: the same runs with the same weights as --a"),
        (["--a", str(a[0]), "--b", str(b[0]), "--names", "one"], "--names: two names"),
        (["--a", str(b[0]), "--b", str(b[1]), "--b_weights", "ema"], "has no EMA figures"),
        (["--a", str(a[0]), "--b", str(b[0]), "--alpha", "1.5"], "--alpha: must be in (0, 1), got 1.5"),
    ]
    for argv, message in cases:
        assert run_cli(main, argv) == 2, argv
        err = capfd.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_compare_recipes_measures_the_demo_config_as_it_is_and_reads_each_runs_final_record(recipes, tmp_path):
    """The regression of `KeyError: 600`: the script expected 600 steps while configs/demo.yaml trained 400. Now the
    steps come from the config file, and each run's final figures from its own last val record."""
    sys.path.insert(0, str(REPO / "scripts"))
    import compare_recipes

    max_steps, settings = compare_recipes.SETTINGS["cpu"]
    assert max_steps == yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())["max_steps"]
    assert settings[:2] == ["--config", "configs/demo.yaml"]
    assert not {"--model", "--n_embd", "--n_layer", "--seq_len", "--total_batch_size", "--max_steps"} & set(settings)
    a, b = recipes
    runs = {**{("faithful", seed): run for seed, run in zip((1, 2, 3, 4), a)},
            **{("modern", seed): run for seed, run in zip((1, 2, 3, 4), b)}}
    rows = compare_recipes.seed_rows(runs, [1, 2, 3, 4], "cpu")
    assert [r["faithful_final_val"] for r in rows] == LIVE_A and [r["modern_final_val"] for r in rows] == LIVE_B
    assert [(r["faithful_steps"], r["modern_steps"]) for r in rows] == [(400, 300)] * 4  # modern's 5.8 at step 300
    text = "\n".join(compare_recipes.tables(rows, runs, [1, 2, 3, 4]))
    assert "| 1 | 5.9701 | 5.7207 | 400 | 300 | 1.33x |" in text and "modern is better at p = " in text
    assert "faithful: the live weights against their EMA" in text and "modern: the live" not in text  # b has no EMA
