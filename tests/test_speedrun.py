"""scripts/speedrun.sh: data to report card in one command, rehearsed on the CPU shrunk (SPEEDRUN_SHRINK=1) the way
`make smoke` rehearses the 124M launch, run twice to show the second run skips what the first completed; and the
helpers it calls (scripts/run_finished.py, scripts/card_table.py)."""

from __future__ import annotations

import json
import sys

import pytest

from common.errors import run_cli
from conftest import REPO, run_and_reap, trainer_env
from runtime.logger import read_log

SCRIPT = REPO / "scripts" / "speedrun.sh"


def speedrun(env: dict, timeout: float):
    return run_and_reap(["bash", str(SCRIPT)], trainer_env({"PYTHON": sys.executable, **env}), timeout=timeout)


@pytest.mark.slow  # bash
@pytest.mark.parametrize("name", ["SPEEDRUN_OUT", "SPEEDRUN_DATA", "SPEEDRUN_CONFIG", "SPEEDRUN_GPUS", "SPEEDRUN_SHRINK",
                                  "PYTHON"])
def test_an_empty_setting_is_refused_in_one_line(name, tmp_path):
    proc = run_and_reap(["bash", str(SCRIPT)], {**trainer_env({"SPEEDRUN_SHRINK": "1"}), name: " "}, timeout=30,
                        cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr == f"error: {name} is set but empty: give it a value, or unset it " \
                                                  f"for its default\n", proc.stderr
    assert proc.stdout == "" and list(tmp_path.iterdir()) == []


@pytest.mark.smoke
@pytest.mark.slow  # prep, torchrun on 2 ranks, the card and the curves, twice
def test_the_shrunk_speedrun_runs_every_stage_then_resumes_by_skipping_them(tmp_path):
    """Into folders whose paths hold spaces: the estimate, the data, 2 ranks of training, the card and the curves;
    then the same command again finds each stage done and runs none of them."""
    env = {"SPEEDRUN_SHRINK": "1", "SPEEDRUN_DATA": str(tmp_path / "my data"), "SPEEDRUN_OUT": str(tmp_path / "my run")}
    first = speedrun(env, timeout=300)
    assert first.returncode == 0, f"{first.stdout[-3000:]}\n{first.stderr[-5000:]}"
    run = tmp_path / "my run"
    records = read_log(run / "log.jsonl")
    assert [r["step"] for r in records if r["kind"] == "val"] == [0, 3, 6]
    assert [r["step"] for r in records if r["kind"] == "checkpoint"] == [3, 6]
    card = json.loads((run / "report.json").read_text())
    assert card["val"][0]["loss"]["value"] == pytest.approx([r for r in records if r["kind"] == "val"][-1]["loss"],
                                                          abs=1e-4)  # the final checkpoint's card
    assert (run / "report.md").is_file() and (run / "curves.png").stat().st_size > 10_000
    assert "speedrun [1/8] estimate: 2 x H100" in first.stdout and "device-hours" in first.stdout
    assert "world size 2" in first.stdout and first.stdout.count("done already") == 0

    stamps = {p: p.stat().st_mtime_ns for p in [run / "log.jsonl", run / "report.json", run / "curves.png"]}
    second = speedrun(env, timeout=120)
    assert second.returncode == 0, f"{second.stdout[-3000:]}\n{second.stderr[-5000:]}"
    assert "device-hours" in second.stdout  # the estimate, printed every time
    for what in ("_manifest.json", "records the checkpoint of the last step", "report.json", "curves.png"):
        assert f"done already ({tmp_path}" in second.stdout and what in second.stdout, what
    assert second.stdout.count("done already") == 4 and "world size" not in second.stdout
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps


def test_run_finished_reads_the_final_checkpoint_from_the_log(tmp_path, capfd):
    """Finished: the log holds the checkpoint record of max_steps (a val record there is not enough: the final save
    may not have completed); with final_checkpoint false, the final val record."""
    sys.path.insert(0, str(REPO / "scripts"))
    import run_finished

    argv = ["--out_dir", str(tmp_path), "--max_steps", "6"]
    assert run_cli(run_finished.main, argv) == 1  # no log
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in [{"kind": "checkpoint", "step": 3}, {"kind": "val", "step": 6}]))
    assert run_cli(run_finished.main, argv) == 1
    assert run_cli(run_finished.main, [*argv, "--final_checkpoint", "false"]) == 0
    with log.open("a") as f:
        f.write(json.dumps({"kind": "checkpoint", "step": 6}) + "\n")
    assert run_cli(run_finished.main, argv) == 0
    assert run_cli(run_finished.main, [*argv[:2], "--max_steps", "9"]) == 1  # raised since: not finished
    assert run_cli(run_finished.main, ["--out_dir", ""]) == 2
    assert capfd.readouterr().err.startswith("error: out_dir: ")


def test_card_table_sets_cards_side_by_side(tmp_path, capfd):
    sys.path.insert(0, str(REPO / "scripts"))
    import card_table

    def card(loss, acc):
        figure = {"value": loss, "ci95": [loss - 0.01, loss + 0.01]}
        return {"model": {"name": "m"}, "val": [{"set": "val", "rows": 10, "seq_len": 1024, "loss": figure,
                                                "bpb": {"value": None, "ci95": None}}],
                "tasks": {} if acc is None else {"hellaswag": {"metric": "acc_norm", "value": acc, "ci95": None}}}

    (tmp_path / "a.json").write_text(json.dumps(card(3.3, None)))
    (tmp_path / "b.json").write_text(json.dumps(card(3.29, 0.2955)))
    out = tmp_path / "both.md"
    assert run_cli(card_table.main, [str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--names", "run,GPT-2",
                                     "-o", str(out)]) == 0
    assert out.read_text() == capfd.readouterr().out == (
        "| figure | run | GPT-2 |\n| --- | ---: | ---: |\n"
        "| val loss (val: 10 rows of 1,024 tokens) | 3.3000 (3.2900–3.3100) | 3.2900 (3.2800–3.3000) |\n"
        "| val bpb (val: 10 rows of 1,024 tokens) |  |  |\n"
        "| hellaswag acc_norm |  | 0.2955 |\n")
    (tmp_path / "c.json").write_text("{}")
    assert run_cli(card_table.main, [str(tmp_path / "c.json")]) == 2
    assert capfd.readouterr().err.startswith(f"error: {tmp_path / 'c.json'}: not a report card")
