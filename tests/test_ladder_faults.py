"""ladder.py's faults: what it refuses before it trains anything (a --check with no law to check, a budget past
a float's range, an --out that cannot be a folder), each as one error line; and a rung whose final figure is not
finite, named and left out of the fit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import ladder
from common.errors import run_cli


@pytest.fixture
def no_training(monkeypatch):
    """A rung launched is the test's failure: what is refused must be refused before any rung trains."""
    def launched(command, env):
        pytest.fail(f"a rung was launched: {' '.join(command)}")

    monkeypatch.setattr(ladder, "run_rung", launched)


def error_line(capfd) -> str:
    err = capfd.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err.removeprefix("error: ").rstrip("\n")


# --- --check with no law to check -------------------------------------------------------------------------

@pytest.mark.parametrize("sizes", [["--depths", "1"], ["--depths", "1", "2"], ["--depths", "1", "2", "--seeds", "1", "2"],
                                   ["--presets", "gpt2", "gpt2-medium", "--flops", "1e18", "4e18"]])
def test_check_with_fewer_sizes_than_the_law_has_parameters_is_refused_before_training(sizes, tmp_path, capfd,
                                                                                       no_training):
    """One or two sizes (whatever the seeds) give one or two budgets: the three-parameter law cannot be fitted, so
    there is no prediction for --check to check. Before: it trained the ladder and the next size, then said No fit."""
    out = tmp_path / "out"
    assert run_cli(ladder.main, [*sizes, "--check", "--out", str(out)]) == 2
    message = error_line(capfd)
    assert message.startswith("--check: the law has 3 parameters and needs rungs at 3 budgets at least; "), message
    assert not out.exists()


# --- budgets past a float's range, an --out that cannot be a folder -----------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--tokens_per_param", "inf"], "--tokens_per_param: must be a positive finite number, got inf"),
    (["--tokens_per_param", "nan"], "--tokens_per_param: must be a positive finite number, got nan"),
    (["--flops", "1e15", "1e16", "inf", "1e18"], "--flops: every budget must be a positive finite number, got inf"),
    (["--tokens_per_param", "1e300"], "--tokens_per_param: d1 would train 3.27e+306 tokens of 19,715,712 FLOPs each: more FLOPs than a float holds"),
    (["--flops", "1e150", "1e200", "1e250", "1e300"], "--flops: the next size's budget, the last ratio once more, "
                                                       "is past a float's range (1.8e+308)"),
    (["--flops", "1e150", "1e200", "1e250", "1e300", "1e308", "--depths", "1", "2", "3", "4"], None),
])
def test_a_budget_past_a_floats_range_is_one_error_line(argv, message, tmp_path, capfd, no_training):
    """Before: OverflowError tracebacks from rounding an infinite budget into steps, or from a rung's FLOPs past
    what a float holds."""
    if message is None:  # every budget given and finite: it plans (a dry run on an assumed GPU: nothing measured)
        assert run_cli(ladder.main, [*argv, "--dry_run", "--hardware", "H100", "--out", str(tmp_path / "out")]) == 0
        return
    assert run_cli(ladder.main, [*argv, "--out", str(tmp_path / "out")]) == 2
    assert error_line(capfd).startswith(message)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where, code, message", [
    ("a_file", 2, "--out: {out} is not a folder"),
    ("a_file/ladder", 2, "--out: cannot create {out} (Not a directory)"),
    ("/sys/gpt2-repro-ladder", 2, "--out: cannot create {out} ("),  # no one may make a folder there, root neither
])
def test_an_out_that_cannot_be_a_folder_is_one_error_line_before_training(where, code, message, tmp_path, capfd,
                                                                            no_training):
    """Before: NotADirectoryError or PermissionError tracebacks, from the first rung config written."""
    (tmp_path / "a_file").write_text("")
    out = tmp_path / where
    argv = ["--depths", "1", "2", "3", "--tokens_per_param", "0.01", "--out", str(out)]
    assert run_cli(ladder.main, argv) == code
    assert error_line(capfd).startswith(message.format(out=out))
    assert run_cli(ladder.main, [*argv, "--dry_run", "--hardware", "H100"]) == (2 if where == "a_file" else 0)
    capfd.readouterr()


# --- a rung whose final figure is not finite ----------------------------------------------------------------

def finish(folder: Path, step: int, loss, bpb) -> None:
    """A finished rung's run folder as the fit reads it: its final val record, written as the trainer's log writes
    one (NaN and inf as json writes them; null where a log writes a non-finite figure so)."""
    folder.mkdir(parents=True)
    (folder / "log.jsonl").write_text(json.dumps({"kind": "val", "step": step, "loss": loss, "bpb": bpb}) + "\n")


def law(rung) -> float:
    return 3.0 + 4.0 * (rung.flops / 1e11) ** -0.3 + (0.003 if rung.seed == 1 else -0.003)


def strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_rung_whose_final_figure_is_not_finite_is_named_and_left_out_of_the_fit(tmp_path):
    """NaN, inf and null (which a log may write for either) are each named, in ladder.md and the text printed, and
    left out of the fit, which the other runs make; ladder.json stays strict JSON, and draws the picture again.
    Before: NaN and inf stopped the report with an error, null was left out silently."""
    args = ladder.parse(["--depths", "1", "2", "3", "4", "--tokens_per_param", "0.01", "--seeds", "1", "2",
                         "--bootstrap", "50", "--out", str(tmp_path)])
    sizes, next_size = ladder.ladder_sizes(args)
    rungs = ladder.plan(args, sizes, next_size)
    bad = {"d2_faithful_s2": (math.nan, math.nan), "d3_faithful_s1": (None, None), "d4_faithful_s2": (math.inf, 2.5),
           "d5_faithful_s1": (math.nan, math.nan)}  # d5, the next size: as --check would have trained it
    for rung in rungs:
        if not rung.check or rung.name in bad:
            finish(tmp_path / rung.name, rung.max_steps, *bad.get(rung.name, (law(rung), law(rung) / 2.3)))
    text = ladder.write_report(args, rungs, sizes)
    assert (tmp_path / "ladder.md").read_text() == text
    named = [line for line in text.splitlines() if line.startswith("Not finite: ")]
    assert named == [
        "Not finite: d2_faithful_s2's final val loss and final val bpb (NaN, inf or null in its log): left out of the "
        "fit.",
        "Not finite: d3_faithful_s1's final val loss and final val bpb (NaN, inf or null in its log): left out of the "
        "fit.",
        "Not finite: d4_faithful_s2's final val loss (NaN, inf or null in its log): left out of the fit.",
        "Not finite: d5_faithful_s1's final val loss and final val bpb (NaN, inf or null in its log): left out of the "
        "check."], text
    assert "| d4 | faithful | 2 |" in text and text.split("| d4 | faithful | 2 |")[1].split("\n")[0].endswith(
        "| not finite | 2.5000 |")
    data = strict_json((tmp_path / "ladder.json").read_text())
    finals = {r["name"]: r["final"] for r in data["rungs"]}
    assert finals["d2_faithful_s2"] == {"loss": None, "bpb": None} and finals["d4_faithful_s2"] == {"loss": None,
                                                                                                   "bpb": 2.5}
    fits = data["fits"]["faithful"]
    assert fits["loss"]["runs"] == 5 and fits["loss"]["budgets"] == 4  # d1 s1, s2; d2 s1; d3 s2; d4 s1
    assert fits["bpb"]["runs"] == 6 and fits["loss"]["check"] is None  # d4 s2's bpb is finite: it stays in
    ladder.redraw(data, tmp_path / "redrawn.png")
    assert (tmp_path / "redrawn.png").read_bytes() == (tmp_path / "ladder.png").read_bytes()


def test_check_is_refused_when_the_finite_figures_leave_no_law(tmp_path, capfd, no_training):
    """Three sizes, finished, one of them with a final val loss that is not finite (null, as a log may write NaN):
    two budgets are left, no law, so no prediction; --check names the rung and refuses to train the next size.
    Before: the rung was left out silently, and --check trained the next size for a report of No fit."""
    argv = ["--depths", "1", "2", "3", "--tokens_per_param", "0.01", "--seeds", "1", "--bootstrap", "50", "--out",
            str(tmp_path), "--check"]
    args = ladder.parse(argv)
    for rung in ladder.plan(args, *ladder.ladder_sizes(args)):
        if not rung.check:
            finish(tmp_path / rung.name, rung.max_steps, *((None, None) if rung.size.label == "d2" else
                                                           (law(rung), law(rung) / 2.3)))
    assert run_cli(ladder.main, argv) == 2
    out, err = capfd.readouterr()
    assert "Not finite: d2_faithful_s1's final val loss and final val bpb (NaN, inf or null in its log): left out " \
           "of the fit." in out.splitlines()
    assert err == (f"error: --check: no law to check d4 against: fewer than 3 budgets have a rung with a finite final "
                   f"val loss ({tmp_path / 'ladder.md'} names those left out); nothing was trained for the check\n")
