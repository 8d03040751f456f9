"""ladder.py's faults: what it refuses before it trains anything (a --check with no law to check, a budget past
a float's range, an --out that cannot be a folder), each as one error line; and a rung whose final figure is not
finite, named and left out of the fit; and a signal to the ladder, which stops the rung it runs as a Ctrl-C
in a terminal stops a run."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

import ladder
from common.errors import run_cli
from scaling_ladder import runs
from scaling_ladder.plan import ladder_sizes, plan
from scaling_ladder.report import redraw, write_report
from conftest import (LAUNCH_TOKEN, REPO, TINY_VOCAB, kill_all, launched_processes, make_shards, tails, trainer_env,
                      wait_until)
from slowness import guard
from runtime.logger import read_log


@pytest.fixture
def no_training(monkeypatch):
    """A rung launched is the test's failure: what is refused must be refused before any rung trains."""
    def launched(command, env):
        pytest.fail(f"a rung was launched: {' '.join(command)}")

    monkeypatch.setattr(runs, "run_rung", launched)


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
    sizes, next_size = ladder_sizes(args)
    rungs = plan(args, sizes, next_size)
    bad = {"d2_faithful_s2": (math.nan, math.nan), "d3_faithful_s1": (None, None), "d4_faithful_s2": (math.inf, 2.5),
           "d5_faithful_s1": (math.nan, math.nan)}  # d5, the next size: as --check would have trained it
    for rung in rungs:
        if not rung.check or rung.name in bad:
            finish(tmp_path / rung.name, rung.max_steps, *bad.get(rung.name, (law(rung), law(rung) / 2.3)))
    text = write_report(args, rungs, sizes)
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
    redraw(data, tmp_path / "redrawn.png")
    assert (tmp_path / "redrawn.png").read_bytes() == (tmp_path / "ladder.png").read_bytes()


def test_check_is_refused_when_the_finite_figures_leave_no_law(tmp_path, capfd, no_training):
    """Three sizes, finished, one of them with a final val loss that is not finite (null, as a log may write NaN):
    two budgets are left, no law, so no prediction; --check names the rung and refuses to train the next size.
    Before: the rung was left out silently, and --check trained the next size for a report of No fit."""
    argv = ["--depths", "1", "2", "3", "--tokens_per_param", "0.01", "--seeds", "1", "--bootstrap", "50", "--out",
            str(tmp_path), "--check"]
    args = ladder.parse(argv)
    for rung in plan(args, *ladder_sizes(args)):
        if not rung.check:
            finish(tmp_path / rung.name, rung.max_steps, *((None, None) if rung.size.label == "d2" else
                                                           (law(rung), law(rung) / 2.3)))
    assert run_cli(ladder.main, argv) == 2
    out, err = capfd.readouterr()
    assert "Not finite: d2_faithful_s1's final val loss and final val bpb (NaN, inf or null in its log): left out " \
           "of the fit." in out.splitlines()
    assert err == (f"error: --check: no law to check d4 against: fewer than 3 budgets have a rung with a finite final "
                   f"val loss ({tmp_path / 'ladder.md'} names those left out); nothing was trained for the check\n")


# --- a signal to the ladder -----------------------------------------------------------------------------------

# d1 of the tiny vocabulary for 5,000 steps of 512 tokens, far more than the test waits for; its checkpoints every
# 1,250 steps: the one a stop saves is the only one before that
RUNG, MAX_STEPS = "d1_faithful_s1", 5000


@pytest.fixture
def long_rung(tmp_path) -> list[str]:
    """A one-size ladder whose rung trains for minutes, logging every step."""
    data = make_shards(tmp_path / "shards", train_sizes=(6000, 6000))
    config = {"data_dir": str(data), "vocab_size": TINY_VOCAB, "block_size": 32, "seq_len": 32, "micro_batch_size": 16,
              "total_batch_size": 512, "max_steps": 20, "warmup_steps": 2, "eval_interval": 0, "val_tokens": 512,
              "hellaswag_interval": 0, "sample_interval": 0, "device": "cpu", "dtype": "float32", "compile": False,
              "log_interval": 1}
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(config))
    return [sys.executable, str(REPO / "ladder.py"), "--config", str(tmp_path / "tiny.yaml"), "--depths", "1", "--next",
            "2", "--flops", "1.33e12", "2.7e12", "--seeds", "1", "--out", str(tmp_path / "ladder")]


def start_ladder(command: list[str], token: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=REPO, env={**trainer_env(), LAUNCH_TOKEN: token}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def killing(proc: subprocess.Popen, token: str):
    """wait_until's report of a failure: the ladder and its rung killed, and their output."""
    def report() -> str:
        kill_all(launched_processes(token))
        return tails(proc)

    return report


def first_step(proc: subprocess.Popen, token: str, log: Path) -> None:
    """Until the rung has logged a step (the trainer stops at a signal from there on)."""
    wait_until(lambda: log.exists() and any(r["kind"] == "train" for r in read_log(log)), proc, f"{RUNG}'s first step",
               report=killing(proc, token))


def stopped_ladder(proc: subprocess.Popen, token: str, what: str) -> tuple[str, str]:
    """The ladder's output once it has ended, within a hang guard; on a hang it and its rung are killed. No process
    of it may outlive it."""
    try:
        stdout, stderr = proc.communicate(timeout=guard(30))
    except subprocess.TimeoutExpired:
        kill_all(launched_processes(token))
        stdout, stderr = proc.communicate()
        raise AssertionError(f"{what}: the ladder and its rung ran on\n{stdout[-3000:]}\n{stderr[-3000:]}") from None
    left = launched_processes(token)
    kill_all(left)
    assert not left, f"{what}: processes {left} outlived the ladder"
    return stdout, stderr


def assert_saved_and_interrupted(out: Path, sig: signal.Signals, returncode: int, stdout: str, stderr: str) -> None:
    """The rung saved its state at the step it stopped in (the checkpoint it resumes from, as after a Ctrl-C in a
    terminal) and ended; the ladder said so in one `interrupted` line, exit 130."""
    records = read_log(out / RUNG / "log.jsonl")
    (saved,) = [r["step"] for r in records if r["kind"] == "checkpoint"]
    assert 0 < saved < MAX_STEPS and saved == max(r["step"] for r in records if r["kind"] == "train") + 1
    assert f"{sig.name} received: saved step {saved}; run the same command again to resume" in stdout.splitlines()
    assert returncode == 130, stderr[-3000:]
    assert stderr.splitlines()[-1] == (f"interrupted: {sig.name}: the ladder stopped in rung {RUNG}, which saved its "
                                       f"state: the same command resumes the ladder"), stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_ladders_pid_stops_its_rung_at_the_next_step(sig, long_rung, tmp_path):
    """`kill -INT` (or -TERM) to the ladder's pid alone: the rung saves its state after its step and ends, and the
    ladder ends with it, interrupted. Before: the signal was noted, and the rung trained on to its end."""
    token = uuid.uuid4().hex
    proc = start_ladder(long_rung, token)
    first_step(proc, token, tmp_path / "ladder" / RUNG / "log.jsonl")
    os.kill(proc.pid, sig)
    stdout, stderr = stopped_ladder(proc, token, f"{sig.name} to the ladder's pid")
    assert_saved_and_interrupted(tmp_path / "ladder", sig, proc.returncode, stdout, stderr)


@pytest.mark.slow
def test_the_terminals_ctrl_z_and_ctrl_c_reach_the_rung_through_the_ladder(long_rung, tmp_path):
    """A terminal signals the ladder's process group (its foreground job), which the rung is not in: the ladder
    passes Ctrl-Z on (the rung stops with it, and goes on with it), then Ctrl-C once (the rung saves; two would stop
    it without saving)."""
    token = uuid.uuid4().hex
    proc = start_ladder(long_rung, token, start_new_session=True)  # a job of its own, as a shell starts one
    first_step(proc, token, tmp_path / "ladder" / RUNG / "log.jsonl")
    (rung,) = [pid for pid in launched_processes(token) if pid != proc.pid]

    def state(pid: int) -> str:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    os.killpg(proc.pid, signal.SIGTSTP)
    wait_until(lambda: state(proc.pid) == state(rung) == "T", proc, "the ladder and its rung stopped", timeout=20,
               report=killing(proc, token))
    os.killpg(proc.pid, signal.SIGCONT)
    wait_until(lambda: "T" not in (state(proc.pid), state(rung)), proc, "the ladder and its rung going on", timeout=20,
               report=killing(proc, token))
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = stopped_ladder(proc, token, "Ctrl-C to the ladder's process group")
    assert_saved_and_interrupted(tmp_path / "ladder", signal.SIGINT, proc.returncode, stdout, stderr)
