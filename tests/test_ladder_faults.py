"""ladder.py's faults: what it refuses before it trains anything (a --check with no law to check, a budget past
a float's range, an --out that cannot be a folder), each as one error line."""

from __future__ import annotations


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
