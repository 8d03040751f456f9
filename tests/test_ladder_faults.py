"""ladder.py's faults: what it refuses before it trains anything (a --check with no law to check), as one error
line."""

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

