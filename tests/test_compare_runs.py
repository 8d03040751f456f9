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
              steps: int = 400, saved: int | None = None, card_step: int | None = None) -> Path:
    """A run folder: val records every 100 steps ending at `steps` (loss, bpb = loss x 0.44), the record of its last
    checkpoint (of step `saved`, default `steps`), and a report card of the checkpoint of `card_step` (default
    `steps`)."""
    folder.mkdir(parents=True)
    records = [{"kind": "train", "step": 0, "loss": 10.9}]
    for step, loss in zip(range(0, steps + 1, steps // (len(losses) - 1)), losses):
        record = {"kind": "val", "step": step, "tokens": step * 1024, "loss": loss, "bpb": loss * 0.44}
        if ema is not None and step == steps:
            record.update(ema_loss=ema, ema_bpb=ema * 0.44)
        records.append(record)
    saved = steps if saved is None else saved
    records.append({"kind": "checkpoint", "step": saved, "path": str(folder / "checkpoints" / f"step_{saved:08d}.pt")})
    (folder / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if acc is not None:
        card = {"model": {"name": f"step {steps} of {folder}", "step": steps if card_step is None else card_step},
                "tasks": {"hellaswag": {"metric": "acc_norm", "value": acc, "n": 10042}}}
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
    assert out.startswith("faithful: 4 runs at step 400, modern: 4 runs at step 400; Welch's t-test, two-sided, alpha 0.05\n")
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
    assert out.startswith("live: 4 runs at step 400, EMA: 4 runs at step 400; paired t-test (the same runs)")
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
    assert ("The recipes over 4 seed(s) (compare_runs.py): faithful: 4 runs at step 400, modern: 4 runs at step 400; "
            "Welch's t-test") in text
    assert "faithful: the live weights against their EMA" in text and "modern: the live" not in text  # b has no EMA


def test_compare_recipes_trains_the_recipes_of_their_configs():
    """The modern recipe is written once, in configs/gpt2_124m_modern.yaml: the script's arguments for it are the
    keys that config sets beyond configs/gpt2_124m.yaml, and the faithful recipe adds none to the demo config."""
    sys.path.insert(0, str(REPO / "scripts"))
    import compare_recipes
    from launch.config import parse_args

    assert compare_recipes.RECIPES["faithful"] == []
    _, settings = compare_recipes.SETTINGS["cpu"]
    trained = parse_args([*settings, *compare_recipes.COMMON, *compare_recipes.RECIPES["modern"]]).to_dict()
    modern = yaml.safe_load((REPO / "configs" / "gpt2_124m_modern.yaml").read_text())
    faithful = yaml.safe_load((REPO / "configs" / "gpt2_124m.yaml").read_text())
    recipe = {k: v for k, v in modern.items() if k != "out_dir" and faithful.get(k) != v}
    assert {"optimizer", "lr_schedule", "cooldown_shape", "shuffle"} <= recipe.keys()
    assert {k: trained[k] for k in recipe} == recipe


def run_main(argv: list[str], capfd) -> tuple[int, str, str]:
    from compare_runs import main

    code = run_cli(main, argv)
    captured = capfd.readouterr()
    return code, captured.out, captured.err


def assert_one_error(code: int, err: str, *parts: str) -> None:
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    assert all(part in err for part in parts), err


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_figure_that_is_not_finite_is_one_error_line_naming_the_run(recipes, tmp_path, capfd, bad):
    """The regression of 'A is better at p = 0' from one seed's NaN final val loss (and 'B is better' from inf): the
    mean, spread and p of a group with such a value are NaN, and NaN >= alpha is false."""
    a, b = recipes
    broken = write_run(tmp_path / "broken", [10.8, 7.0, 6.3, 6.1, bad], acc=0.25)
    code, out, err = run_main(["--a", *map(str, a), "--b", *map(str, b[:3]), str(broken)], capfd)
    assert_one_error(code, err, f"{broken / 'log.jsonl'}: the final val loss of step 400 is {bad}, not a finite figure")
    assert out == ""
    card = json.loads((b[0] / "report.json").read_text())
    card["tasks"]["hellaswag"]["value"] = bad
    (b[0] / "report.json").write_text(json.dumps(card))
    code, _, err = run_main(["--a", *map(str, a), "--b", *map(str, b)], capfd)
    assert_one_error(code, err, f"{b[0] / 'report.json'}: hellaswag acc_norm is {bad}, not a finite figure")
    with pytest.raises(ValueError, match="values must be finite"):
        welch([1.0, 2.0], [3.0, bad])
    with pytest.raises(ValueError, match="values must be finite"):
        paired([1.0, bad], [3.0, 4.0])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("field,metric", [("loss", "final val loss"), ("bpb", "final val bpb"),
                                          ("ema_loss", "final val loss")])
def test_a_figure_the_trainers_log_wrote_as_null_is_not_finite(recipes, tmp_path, capfd, bad, field, metric):
    """The trainer's logger writes a NaN or inf figure as null (strict JSON): such a run's row silently lost that
    figure (the comparison went on without the seed, or without the row) instead of being refused as a NaN is."""
    from runtime.logger import RunLogger

    a, b = recipes
    broken = tmp_path / "broken"
    logger = RunLogger(enabled=True)
    logger.open_run_folder(broken, 0, {})
    for step, loss in [(0, 10.8), (400, 6.0)]:
        record = {"kind": "val", "step": step, "tokens": step * 1024, "loss": loss, "bpb": loss * 0.44,
                  "ema_loss": loss, "ema_bpb": loss * 0.44}
        logger.log({**record, field: bad} if step == 400 else record)
    logger.log({"kind": "checkpoint", "step": 400, "path": str(broken / "checkpoints" / "step_00000400.pt")})
    logger.close()
    assert f'"{field}": null' in (broken / "log.jsonl").read_text()  # as the logger writes it
    weights = ["--a_weights", "ema"] if field.startswith("ema_") else []
    code, out, err = run_main(["--a", str(broken), *map(str, a[:3]), "--b", *map(str, b), *weights], capfd)
    assert_one_error(code, err, f"{broken / 'log.jsonl'}: the {metric} of step 400 is null (NaN or infinite: the "
                                f"trainer logs them so), not a finite figure")
    assert out == ""


def test_a_run_given_twice_counts_once_or_is_refused(recipes, tmp_path, capfd):
    """The regression of a run listed twice counting as two seeds (a smaller p from the same evidence), however it
    is spelled; and of groups that share some runs but not all, which are neither independent nor paired."""
    a, b = recipes
    again = tmp_path / "x" / ".." / a[1].name  # another path to the same folder
    (tmp_path / "x").mkdir()
    code, out, err = run_main(["--a", *map(str, a), str(again), "--b", *map(str, b)], capfd)
    assert_one_error(code, err, f"--a: {again} is given twice (as {a[1]} and {again}): each run counts once")
    code, _, err = run_main(["--a", *map(str, a), "--b", str(b[0]), str(b[0]), str(b[1])], capfd)
    assert_one_error(code, err, f"--b: {b[0]} is given twice: each run counts once")
    code, _, err = run_main(["--a", *map(str, a[:3]), "--b", str(a[2]), *map(str, b[:2]), "--b_weights", "ema"], capfd)
    assert_one_error(code, err, f"--b: {a[2]} is in --a too, but the groups are not the same runs")


def test_the_same_runs_in_another_order_are_still_paired_run_by_run(recipes, tmp_path, capfd):
    """The regression of a silent switch to Welch's test when the same runs are listed in another order: runs are
    paired by what they are (their resolved folders), not by their places in the lists."""
    a, _ = recipes
    shuffled = [a[2], a[0], tmp_path / "x" / ".." / a[3].name, a[1]]
    (tmp_path / "x").mkdir()
    code, out, err = run_main(["--a", *map(str, a), "--b", *map(str, shuffled), "--b_weights", "ema",
                               "--names", "live,EMA", "--json", str(tmp_path / "rows.json")], capfd)
    assert code == 0, err
    assert out.startswith("live: 4 runs at step 400, EMA: 4 runs at step 400; paired t-test (the same runs)")
    row = json.loads((tmp_path / "rows.json").read_text())[0]
    assert row["b"] == EMA_A and row["result"] == json.loads(json.dumps(paired(LIVE_A, EMA_A).__dict__))
    code, _, err = run_main(["--a", *map(str, a), "--b", *map(str, shuffled)], capfd)  # the same weights too
    assert_one_error(code, err, "--b: the same runs with the same weights as --a: nothing to compare")


def test_each_groups_step_is_shown_and_figures_of_other_steps_are_refused_or_warned_of(recipes, tmp_path, capfd):
    """The regression of final figures of different steps compared without a word: 6-step runs against 12-step
    ones, a seed that stopped early, a report.json made before the run went on, a run whose last checkpoint is newer
    than its last val record (stopped before its final evaluations)."""
    a, b = recipes
    short = [write_run(tmp_path / f"short{i}", [10.8, 6.5, 6.05, 5.8, loss], acc=acc, steps=200)
             for i, (loss, acc) in enumerate(zip(LIVE_B, ACC_B))]
    # between the groups: warned (the question may be another budget), each group's step above the table
    code, out, err = run_main(["--a", *map(str, a), "--b", *map(str, short), "--names", "long,short"], capfd)
    assert code == 0 and err == ("warning: long's figures are of step 400, short's of step 200: the verdicts compare "
                                 "different training lengths too\n"), err
    assert out.startswith("long: 4 runs at step 400, short: 4 runs at step 200; Welch's t-test")
    # within a group: refused (its runs are one recipe's seeds), naming each run's step
    code, _, err = run_main(["--a", *map(str, a), "--b", *map(str, b[:3]), str(short[3])], capfd)
    assert_one_error(code, err, f"--b: its runs' figures are of different steps ({b[0]}: step 400, {b[1]}: step 400, "
                                f"{b[2]}: step 400, {short[3]}: step 200)")
    # a card of an older checkpoint than the run's end
    stale = write_run(tmp_path / "stale", [10.8, 6.5, 6.05, 5.8, 5.7], acc=0.25, card_step=300)
    code, _, err = run_main(["--a", *map(str, a), "--b", *map(str, b[:3]), str(stale)], capfd)
    assert_one_error(code, err, f"{stale / 'report.json'}: the card of step 300, but the run has gone on to step 400: "
                                f"make it again (python eval_lm.py {stale} --card)")
    # a checkpoint newer than the last val record: the final evaluations are missing
    stopped = write_run(tmp_path / "stopped", [10.8, 6.5, 6.05, 5.8, 5.7], steps=300, saved=400)
    code, _, err = run_main(["--a", *map(str, a), "--b", *map(str, b[:3]), str(stopped)], capfd)
    assert_one_error(code, err, f"{stopped / 'log.jsonl'}: its last val record is of step 300, but the run has a "
                                f"checkpoint of step 400: its figures of step 400 are missing")


@pytest.mark.parametrize("card", [
    {"model": {"step": 400}, "tasks": {"x": 3}},
    {"model": {"step": 400}, "tasks": {"x": {"metric": "acc", "value": "high"}}},
    {"model": {"step": 400}, "tasks": ["hellaswag"]},
    {"tasks": {"hellaswag": {"metric": "acc_norm", "value": 0.25}}},
    ["not", "a", "card"],
    "{",
])
def test_a_malformed_report_card_is_one_error_line_naming_it(recipes, capfd, card):
    """The regression of a traceback (AttributeError) on {"tasks": {"x": 3}}."""
    a, b = recipes
    (b[1] / "report.json").write_text(card if isinstance(card, str) else json.dumps(card))
    code, _, err = run_main(["--a", *map(str, a), "--b", *map(str, b)], capfd)
    assert_one_error(code, err, f"{b[1] / 'report.json'}: ")
