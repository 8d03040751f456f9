"""Choosing the checkpoint a launch resumes, and the one-history rules (launch/resume.py).

The trainer's own runs through these rules are in tests/test_run_folder.py and tests/test_fault_paths.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from common.errors import ConfigError
from test_checkpoint import state
from training.checkpoint import folder as ckpt
from launch.resume import check_one_history, find_resume_checkpoint


def lineage(run_id: str, checkpoint_id: str, *ancestry: str) -> dict:
    return {"run_id": run_id, "checkpoint_id": checkpoint_id, "ancestry": list(ancestry)}


def test_auto_resume_skips_truncated_and_garbage_newest_files(tmp_path, capsys):
    for step in (3, 6, 9, 12):
        ckpt.save_checkpoint(state(step), ckpt.checkpoint_path(tmp_path / "checkpoints", step))
    data = ckpt.checkpoint_path(tmp_path / "checkpoints", 12).read_bytes()
    ckpt.checkpoint_path(tmp_path / "checkpoints", 12).write_bytes(data[: len(data) // 2])  # truncated
    ckpt.checkpoint_path(tmp_path / "checkpoints", 9).write_bytes(b"\x00garbage" * 100)  # not a checkpoint at all
    path, loaded, _ = find_resume_checkpoint(tmp_path / "checkpoints", "auto")
    assert path == ckpt.checkpoint_path(tmp_path / "checkpoints", 6) and loaded["step"] == 6
    err = capsys.readouterr().err
    assert "step_00000012.pt: unreadable checkpoint" in err and "step_00000009.pt: unreadable checkpoint" in err
    assert find_resume_checkpoint(tmp_path / "checkpoints", "never") is None
    assert find_resume_checkpoint(tmp_path / "empty" / "checkpoints", "auto") is None
    with pytest.raises(ckpt.CheckpointError, match="step_00000009.pt.unreadable: unreadable checkpoint"):
        find_resume_checkpoint(tmp_path / "checkpoints", str(ckpt.checkpoint_path(tmp_path / "checkpoints", 9)) + ".unreadable")


def test_resume_path_continues_from_newer_checkpoints_that_descend_from_it(tmp_path):
    path3 = ckpt.checkpoint_path(tmp_path / "a" / "checkpoints", 3)
    ckpt.save_checkpoint({**state(3), **lineage("r", "c3")}, path3)
    # a run started with --resume path3 into out_dir b, preempted after step 8: the same command again
    out = tmp_path / "b"
    ckpt.save_checkpoint({**state(5), **lineage("r", "c5", "c3")}, ckpt.checkpoint_path(out / "checkpoints", 5))
    ckpt.save_checkpoint({**state(8), **lineage("r", "c8", "c3", "c5")}, ckpt.checkpoint_path(out / "checkpoints", 8))
    path, loaded, how = find_resume_checkpoint(out / "checkpoints", str(path3))
    assert path == ckpt.checkpoint_path(out / "checkpoints", 8) and loaded["step"] == 8 and str(path3) in how
    # nothing newer that descends from it: the path itself
    assert find_resume_checkpoint(tmp_path / "empty" / "checkpoints", str(path3))[0] == path3


def test_resume_path_refuses_to_mix_with_another_run_or_an_abandoned_future(tmp_path):
    path3 = ckpt.checkpoint_path(tmp_path / "checkpoints", 3)
    ckpt.save_checkpoint({**state(3), **lineage("r", "c3")}, path3)
    ckpt.save_checkpoint({**state(6), **lineage("r", "c6")}, ckpt.checkpoint_path(tmp_path / "checkpoints", 6))  # not from c3's resume
    with pytest.raises(ConfigError, match="step_00000006.pt is newer than .*step_00000003.pt and did not continue"):
        find_resume_checkpoint(tmp_path / "checkpoints", str(path3))
    other = tmp_path / "other"
    ckpt.save_checkpoint({**state(1), **lineage("q", "c1")}, ckpt.checkpoint_path(other / "checkpoints", 1))
    with pytest.raises(ConfigError, match="step_00000001.pt belongs to another run"):
        find_resume_checkpoint(other / "checkpoints", str(path3))


def test_a_resume_path_that_is_no_file_names_the_key(tmp_path):
    # checked where the file is opened, not in config validation
    with pytest.raises(ConfigError, match="resume: no checkpoint file"):
        find_resume_checkpoint(tmp_path / "checkpoints", "/no/such/ckpt.pt")


CHOOSE_AND_MEASURE = """
import os, sys
from pathlib import Path
from launch.resume import find_resume_checkpoint
def resident_mib():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2**20
before = resident_mib()
path, state, _ = find_resume_checkpoint(Path(sys.argv[1]) / "checkpoints", sys.argv[2])  # state held: its tensors count if read
print(state["step"], resident_mib() - before)
"""


@pytest.mark.slow
@pytest.mark.parametrize("resume", ["auto", "path"])
def test_choosing_the_checkpoint_to_resume_reads_no_tensors_into_memory(tmp_path, resume):
    """Rank 0 picks the checkpoint from its metadata; the ranks then load the file themselves,
    so reading gpt2-xl's ~19 GB of weights and AdamW state here would only waste memory and time."""
    import subprocess
    import sys

    big = {"w": torch.ones(64 * 2**20, dtype=torch.float32)}  # 256 MiB of "weights"
    out = tmp_path / "out"
    ckpt.save_checkpoint({**state(3), "model": big, **lineage("r", "c3")}, ckpt.checkpoint_path(out / "checkpoints", 3))
    ckpt.save_checkpoint({**state(6), "model": big, **lineage("r", "c6", "c3")}, ckpt.checkpoint_path(out / "checkpoints", 6))
    arg = "auto" if resume == "auto" else str(ckpt.checkpoint_path(out / "checkpoints", 3))  # path: 3, then its descendant 6
    proc = subprocess.run([sys.executable, "-c", CHOOSE_AND_MEASURE, str(out), arg],
                          capture_output=True, text=True, check=True)
    step, grown_mib = map(int, proc.stdout.split())
    assert step == 6
    assert grown_mib < 64, f"choosing a checkpoint grew the process by {grown_mib} MiB"


def lineage_state(run_id: str, step: int) -> dict:
    return {"model": {}, "step": step, "run_id": run_id, "checkpoint_id": f"{run_id}-{step}", "ancestry": []}


def test_one_history_rules(tmp_path):
    out = tmp_path / "out"
    ckpt.save_checkpoint(lineage_state("a" * 32, 3), ckpt.checkpoint_path(out / "checkpoints", 3))
    check_one_history(out, out / "checkpoints", None)
    check_one_history(out, out / "checkpoints", (ckpt.checkpoint_path(out / "checkpoints", 3), lineage_state("a" * 32, 3)))
    (out / "run.json").write_text(json.dumps({"run_id": "b" * 32}))
    with pytest.raises(ConfigError, match="holds more than one run \\(run bbbbbbbb in run.json and log.jsonl, "
                                          "run aaaaaaaa in checkpoints/step_00000003.pt\\)"):
        check_one_history(out, out / "checkpoints", None)
    (out / "run.json").write_text(json.dumps({"run_id": "a" * 32}))
    elsewhere = ckpt.checkpoint_path(tmp_path / "other" / "checkpoints", 9)
    with pytest.raises(ConfigError, match="belongs to run cccccccc, but .* holds run aaaaaaaa"):
        check_one_history(out, out / "checkpoints", (elsewhere, lineage_state("c" * 32, 9)))
    legacy = tmp_path / "legacy"  # a log from older code, no run_id anywhere
    legacy.mkdir()
    (legacy / "log.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match="holds a log.jsonl of another run"):
        check_one_history(legacy, legacy / "checkpoints", (elsewhere, lineage_state("c" * 32, 9)))


def test_another_total_batch_size_says_which_rows_it_passes_over_or_reads_again(tmp_path):
    """One folder's position is step x rows per step: resumed at step 3 with 32 rows a step instead of 16, the
    run reads on from row 96, not 48, of epoch 0; rows 48-95 are never read (and the other way, read again)."""
    from conftest import make_shards
    from data.loader import TrainLoader
    from launch.resume import moved_position

    data = make_shards(tmp_path / "shards", train_sizes=(20000,))  # 624 rows of 32 (+1) tokens: 19 steps of 32 rows
    wider = TrainLoader(data, seq_len=32, micro_batch_size=4, total_batch_size=1024)
    assert moved_position(wider, {"seq_len": 32, "total_batch_size": 512}, 3) == (
        "total_batch_size 512 -> 1,024 moved the train data's position: step 3 reads from row 96 of epoch 0 "
        "(rows 48-95 of epoch 0 are never read)")
    narrower = TrainLoader(data, seq_len=32, micro_batch_size=4, total_batch_size=512)
    assert moved_position(narrower, {"seq_len": 32, "total_batch_size": 1024}, 3).endswith(
        "step 3 reads from row 48 of epoch 0 (rows 48-95 of epoch 0 are read a second time)")
    assert moved_position(narrower, {"seq_len": 32, "total_batch_size": 1024}, 20).endswith(
        "step 20 reads from row 320 of epoch 0 (the checkpoint's run was at row 32 of epoch 1)")
    for same in ({"seq_len": 32, "total_batch_size": 512}, {"seq_len": 64, "total_batch_size": 1024}):
        assert moved_position(narrower, same, 3) is None  # unchanged; or other rows altogether (seq_len)


@pytest.mark.slow
def test_a_resume_with_another_total_batch_size_warns_of_the_rows_it_moves_past(tmp_path):
    from conftest import base_args, make_shards, run_trainer

    data = make_shards(tmp_path / "shards", train_sizes=(20000,))
    run_trainer(base_args(data, tmp_path / "run", max_steps=3, eval_interval=0))  # 16 rows of 32 tokens a step
    proc = run_trainer(base_args(data, tmp_path / "run", max_steps=4, eval_interval=0, total_batch_size=1024))
    (line,) = [line for line in proc.stderr.splitlines() if "moved the train data's position" in line]
    assert line.startswith("warning: total_batch_size 512 -> 1,024 moved the train data's position: step 3 reads "
                           "from row 96 of epoch 0 (rows 48-95 of epoch 0 are never read) since ")


def test_a_checkpoint_of_older_code_at_max_steps_is_finished_only_when_its_log_records_the_final_evaluations(
        tmp_path, capfd):
    """Older code saved no finished_at. Its final checkpoint followed the final evaluations, but a stop in the last
    step saved it before them: only the run's log tells which. One without the final val record in its log gets
    it from the next launch (which records it in the checkpoint: the launch after has nothing to do); one with it
    has nothing to do."""
    import json

    from conftest import base_args, build_tiny_run, lockstep_steps, make_shards, train_here
    from launch.components import make_checkpointer
    from runtime.logger import read_log

    data = make_shards(tmp_path / "shards")
    settings = dict(max_steps=1, eval_interval=0, val_tokens=64)
    out = tmp_path / "run"
    cfg, ctx, run = build_tiny_run(data, out, **settings)
    lockstep_steps(cfg, ctx, run, 1)
    checkpointer = make_checkpointer(cfg, ctx, run, record={})
    checkpointer.save(run)
    checkpointer.wait()
    path = ckpt.checkpoint_path(out / "checkpoints", 1)
    older = {key: value for key, value in ckpt.load_checkpoint(path).items() if key != "finished_at"}
    ckpt.save_checkpoint(older, path)
    stopped = [{"kind": "train", "step": 0, "loss": 6.2}, {"kind": "checkpoint", "step": 1, "path": str(path)}]
    final_val = {"kind": "val", "step": 1, "tokens": 512, "loss": 6.1}

    (out / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*stopped[:1], final_val, stopped[1]]))
    assert build_tiny_run(data, out, **settings)[2] is None  # finished: nothing to do

    (out / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in stopped))
    capfd.readouterr()
    assert train_here(base_args(data, out, **settings)) == 0
    said = capfd.readouterr().out
    assert "its final evaluations were not run (a stop came first): running them" in said
    assert f"recorded the final evaluations in {path}" in said
    assert [r["step"] for r in read_log(out / "log.jsonl") if r["kind"] == "val"] == [1]
    assert ckpt.load_checkpoint(path)["finished_at"] == 1
    assert train_here(base_args(data, out, **settings)) == 0
    assert "nothing to do" in capfd.readouterr().out
