"""Checkpoint files: atomic writes, weights_only loads, fallback past damaged files, retention."""

from __future__ import annotations

import errno
import os
import stat

import pytest
import torch

from training.checkpoint import folder as ckpt
from launch import resume
from conftest import train_here
def state(step: int, n_layer: int = 2) -> dict:
    return {"model": {"w": torch.full((3,), float(step))}, "optimizer": {"state": {}, "param_groups": []},
            "step": step, "tokens_seen": step * 10, "config": {"seed": 1, "tags": ["a"]},
            "model_args": {"n_layer": n_layer, "n_head": 2, "n_embd": 64, "vocab_size": 50304, "block_size": 32},
            "rng": {"torch": torch.get_rng_state(), "cuda": None}, "wandb_run_id": None, "metrics": {}}


def test_round_trip_with_weights_only_and_no_temp_files(tmp_path):
    path = ckpt.checkpoint_path(tmp_path / "checkpoints", 12)
    assert path.name == "step_00000012.pt"
    ckpt.save_checkpoint(state(12), path)
    loaded = ckpt.load_checkpoint(path)
    assert loaded["step"] == 12 and torch.equal(loaded["model"]["w"], torch.full((3,), 12.0))
    assert torch.load(path, weights_only=True)["config"] == {"seed": 1, "tags": ["a"]}
    assert [p.name for p in path.parent.iterdir()] == ["step_00000012.pt"]


def test_unreadable_checkpoints_are_set_aside_and_never_outrank_good_ones(tmp_path, capsys):
    for step in (3, 6):
        ckpt.save_checkpoint(state(step), ckpt.checkpoint_path(tmp_path / "checkpoints", step))
    ckpt.checkpoint_path(tmp_path / "checkpoints", 6).write_bytes(b"\x00" * 64)
    assert resume.find_resume_checkpoint(tmp_path / "checkpoints", "auto")[0] == ckpt.checkpoint_path(tmp_path / "checkpoints", 3)
    assert "renamed it to step_00000006.pt.unreadable" in capsys.readouterr().err
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "checkpoints")] == [3]
    assert (tmp_path / "checkpoints" / "step_00000006.pt.unreadable").exists()  # kept, for inspection
    # a run that resumed from 3 and keeps one checkpoint keeps the one it writes next
    ckpt.save_checkpoint(state(4), ckpt.checkpoint_path(tmp_path / "checkpoints", 4))
    ckpt.prune_checkpoints(tmp_path / "checkpoints", keep_last=1, written_step=4)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "checkpoints")] == [4]


def test_pickled_code_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "step": 1, "payload": object()}, path)  # needs full unpickling
    with pytest.raises(ckpt.CheckpointError, match="evil.pt: unreadable checkpoint"):
        ckpt.load_checkpoint(path)


def test_retention_keeps_the_newest_and_never_the_new_file_or_anything_newer(tmp_path):
    for step in (1, 2, 3, 4, 5, 9):
        ckpt.save_checkpoint(state(step), ckpt.checkpoint_path(tmp_path / "checkpoints", step))
    deleted = ckpt.prune_checkpoints(tmp_path / "checkpoints", keep_last=2, written_step=5)
    assert sorted(p.name for p in deleted) == ["step_00000001.pt", "step_00000002.pt", "step_00000003.pt"]
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "checkpoints")] == [4, 5, 9]


def test_a_checkpoint_that_cannot_be_deleted_is_a_warning(tmp_path, monkeypatch, capsys):
    for step in (1, 2):
        ckpt.save_checkpoint(state(step), ckpt.checkpoint_path(tmp_path / "checkpoints", step))

    def refuse(self, missing_ok=False):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(type(tmp_path), "unlink", refuse)
    assert ckpt.prune_checkpoints(tmp_path / "checkpoints", keep_last=1, written_step=2) == []
    assert "could not delete old checkpoint" in capsys.readouterr().err


def test_a_folder_that_refuses_fsync_does_not_fail_the_save(tmp_path, monkeypatch):
    real_fsync = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):  # as some network and FUSE filesystems do
            raise OSError(errno.EINVAL, "Invalid argument")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    ckpt.save_checkpoint(state(7), ckpt.checkpoint_path(tmp_path / "checkpoints", 7))
    assert ckpt.load_checkpoint(ckpt.checkpoint_path(tmp_path / "checkpoints", 7))["step"] == 7


def test_failed_write_leaves_previous_checkpoint_intact(tmp_path, monkeypatch):
    ckpt.save_checkpoint(state(3), ckpt.checkpoint_path(tmp_path / "checkpoints", 3))

    def disk_full(obj, f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(ckpt.CheckpointWriteError, match="step_00000006.pt: could not write checkpoint "
                                                        r"\(No space left on device\); earlier checkpoints are intact"):
        ckpt.save_checkpoint(state(6), ckpt.checkpoint_path(tmp_path / "checkpoints", 6))
    assert [p.name for p in ckpt.checkpoint_path(tmp_path / "checkpoints", 3).parent.iterdir()] == ["step_00000003.pt"]
    assert ckpt.load_checkpoint(ckpt.checkpoint_path(tmp_path / "checkpoints", 3))["step"] == 3


def test_checkpoint_of_another_model_size_is_refused_naming_the_key(tmp_path):
    path = ckpt.checkpoint_path(tmp_path / "checkpoints", 3)
    with pytest.raises(ckpt.CheckpointError, match=r"checkpoint has n_layer=4 but this run has n_layer=2 \(remedy\)"):
        ckpt.check_compatible(state(3, n_layer=4), state(3)["model_args"], path, "remedy")
    ckpt.check_compatible(state(3), state(3)["model_args"], path, "remedy")


def test_a_checkpoint_of_a_newer_format_is_refused_by_name(tmp_path):
    path = ckpt.checkpoint_path(tmp_path / "checkpoints", 1)
    ckpt.save_checkpoint({**state(1), "format_version": ckpt.FORMAT_VERSION + 1}, path)
    with pytest.raises(ckpt.CheckpointError, match=f"step_00000001.pt: checkpoint format_version "
                                                   f"{ckpt.FORMAT_VERSION + 1} is newer than this code reads"):
        ckpt.load_checkpoint(path)


def test_a_newer_format_checkpoint_stops_every_reader_and_stays_where_it_is(tmp_path):
    """Written by newer code, not damaged: refused, never set aside for an older checkpoint."""
    ckpt.save_checkpoint(state(3), ckpt.checkpoint_path(tmp_path / "checkpoints", 3))
    newer = ckpt.checkpoint_path(tmp_path / "checkpoints", 6)
    ckpt.save_checkpoint({**state(6), "format_version": ckpt.FORMAT_VERSION + 1}, newer)
    for read in (lambda: resume.find_resume_checkpoint(tmp_path / "checkpoints", "auto"),
                 lambda: ckpt.resolve_checkpoint(tmp_path),  # sample.py, export_hf.py, eval_lm.py
                 lambda: resume.find_resume_checkpoint(tmp_path / "checkpoints", str(ckpt.checkpoint_path(tmp_path / "checkpoints", 3)))):
        with pytest.raises(ckpt.CheckpointError, match="step_00000006.pt: checkpoint format_version .* is newer"):
            read()
        assert newer.exists() and [s for s, _ in ckpt.list_checkpoints(tmp_path / "checkpoints")] == [3, 6]


def test_a_run_resumed_on_the_cpu_keeps_no_view_of_its_checkpoint_file(tmp_path):
    """Files load memory-mapped; a resumed run that kept views into one (its AdamW moments, its step
    counts) would hold the file's disk space for the rest of the run, after retention deleted it."""
    import gc

    from conftest import build_tiny_run, make_shards
    from launch.components import make_checkpointer

    data, out = make_shards(tmp_path / "shards"), tmp_path / "out"
    cfg, ctx, run = build_tiny_run(data, out, checkpoint_format="file")
    tokens = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    run.model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())[1].backward()
    run.optimizer.step()
    run.step = 1
    make_checkpointer(cfg, ctx, run, record={}).save(run)
    path = ckpt.checkpoint_path(out / "checkpoints", 1)

    *_, resumed = build_tiny_run(data, out, checkpoint_format="file")
    assert resumed.start_step == 1 and resumed.optimizer.state  # the moments came from the file
    os.remove(path)  # as retention does
    gc.collect()
    with open("/proc/self/maps") as maps:
        assert [line for line in maps if str(path) in line] == []


@pytest.mark.parametrize("checkpoint_format", ["file", "sharded"])
def test_the_final_evaluations_of_a_launch_that_ran_them_alone_are_recorded_in_its_checkpoint(checkpoint_format,
                                                                                              tmp_path):
    """A launch that resumed the last step's checkpoint (saved by a stop before the final evaluations) ran them
    alone: finishing, it amends that checkpoint in place with their figures and finished_at, and nothing else of
    it changes (its tensors, its id); no temp file is left."""
    from conftest import build_tiny_run, make_shards
    from launch.components import make_checkpointer

    data, out = make_shards(tmp_path / "shards"), tmp_path / "out"
    cfg, ctx, run = build_tiny_run(data, out, checkpoint_format=checkpoint_format, max_steps=1)
    run.step = 1
    checkpointer = make_checkpointer(cfg, ctx, run, record={})
    checkpointer.save(run, blocking=True)
    (path,) = [p for _, p in ckpt.list_checkpoints(out / "checkpoints")]
    before = ckpt.read_full_state(path)
    assert before["finished_at"] is None and not resume.finished(ckpt.load_checkpoint(path))

    run.start_step, run.resumed_from = 1, path  # as the launch that resumed it
    run.metrics, run.finished_at = {"val_loss": 4.5}, 1
    checkpointer.finish(run)
    after = ckpt.read_full_state(path)
    assert (after["metrics"], after["finished_at"]) == ({"val_loss": 4.5}, 1) and resume.finished(after)
    assert {k: v for k, v in after.items() if k not in ("metrics", "finished_at", "model", "optimizer")} == \
        {k: v for k, v in before.items() if k not in ("metrics", "finished_at", "model", "optimizer")}
    assert all(torch.equal(after["model"][k], before["model"][k]) for k in before["model"])
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [path.name]


def test_a_url_to_a_file_checkpoint_is_one_line_for_every_reader(tmp_path, capfd):
    """URLs hold sharded checkpoints only; a file:// URL to a .pt file said "unreadable checkpoint.json (Not a
    directory)". Every reader goes through load_checkpoint, so each says what is wrong in the same line."""
    import sample
    from common.errors import run_cli
    from model import GPT, GPTConfig
    from launch.weights import load_initial_weights

    path = ckpt.checkpoint_path(tmp_path / "checkpoints", 1)
    ckpt.save_checkpoint(state(1), path)
    url = f"file://{path}"
    line = f"{url} is a URL to a file; URLs hold sharded checkpoints (step_XXXXXXXX folders) only: give the file's " \
           f"local path"
    readers = {"load": lambda: ckpt.load_checkpoint(url),
               "sample.py, export_hf.py, eval_lm.py": lambda: ckpt.resolve_checkpoint(url),
               "--resume": lambda: resume.find_resume_checkpoint(tmp_path / "checkpoints", url),
               "init_from": lambda: load_initial_weights(GPT(GPTConfig(**state(1)["model_args"])), url)}
    for reader, read in readers.items():
        with pytest.raises(ckpt.CheckpointError) as caught:
            read()
        assert str(caught.value) == line, reader
    assert run_cli(sample.main, ["--ckpt", url, "--device", "cpu"]) == 2
    assert capfd.readouterr().err == f"error: {line}\n"
    # a file of another name is known as one by asking its storage
    other = tmp_path / "weights.bin"
    other.write_bytes(path.read_bytes())
    with pytest.raises(ckpt.CheckpointError) as caught:
        ckpt.resolve_checkpoint(f"file://{other}")
    assert str(caught.value) == line.replace(url, f"file://{other}")
    assert path.exists() and other.exists()  # nothing was set aside or changed


@pytest.mark.parametrize("checkpoint_dir", ["ckpts", "file://ckpts"])
def test_a_run_with_a_relative_checkpoint_dir_is_found_from_another_folder(checkpoint_dir, tmp_path, monkeypatch):
    """sample.py, export_hf.py and eval_lm.py --ckpt RUN_FOLDER read config.yaml's checkpoint_dir; a relative one
    was resolved against the tool's working directory, not the trainer's."""
    from launch.config import config_yaml, parse_args

    launched, elsewhere = tmp_path / "launched", tmp_path / "elsewhere"
    launched.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(launched)
    cfg = parse_args(["--out_dir", "run", "--checkpoint_dir", checkpoint_dir])
    (launched / "run").mkdir()
    (launched / "run" / "config.yaml").write_text(config_yaml(cfg))  # as the trainer writes them
    # a sharded checkpoint (what a URL holds) of a tiny module, written where the trainer would write it
    folder = ckpt.checkpoint_path(ckpt.checkpoints_folder(cfg.run.out_dir, cfg.checkpoint.checkpoint_dir), 2, ckpt.SHARDED)
    module = torch.nn.Linear(2, 2)
    ckpt.sharded.start_save({"model": module}, folder, asynchronous=False)
    ckpt.sharded.commit(folder, {"step": 2, "format_version": ckpt.FORMAT_VERSION})
    monkeypatch.chdir(elsewhere)
    path, found = ckpt.resolve_checkpoint(launched / "run")
    assert found["step"] == 2 and str(path).endswith(f"{launched}/ckpts/step_00000002")


def test_a_pt_file_in_a_url_checkpoint_folder_is_no_checkpoint_and_stays_as_it_is(tmp_path, capsys):
    """URLs hold sharded checkpoints only: a .pt file copied there was listed, failed to load, and auto-resume
    renamed it `.unreadable`."""
    path = ckpt.checkpoint_path(tmp_path / "checkpoints", 1)
    ckpt.save_checkpoint(state(1), path)
    url = f"file://{tmp_path / 'checkpoints'}"
    assert ckpt.list_checkpoints(url) == []
    assert resume.find_resume_checkpoint(url, "auto") is None  # a fresh start, as in an empty folder
    assert [p.name for p in path.parent.iterdir()] == ["step_00000001.pt"] and capsys.readouterr().err == ""
    assert ckpt.list_checkpoints(tmp_path / "checkpoints") == [(1, path)]  # the same folder as a path: a checkpoint


def in_format_2(state: dict) -> dict:
    """A checkpoint as format_version 2 (and 1) wrote it: the optimizer state keyed by parameter index,
    numbered as torch's Optimizer.state_dict() numbers them (through the groups, in order), and each
    group's `params` a list of those indices."""
    optimizer = state["optimizer"]
    order = [name for group in optimizer["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(order)}
    return {**state, "format_version": 2,
            "optimizer": {"state": {index[name]: value for name, value in optimizer["state"].items()},
                          "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                                           for group in optimizer["param_groups"]]}}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_checkpoint_of_format_2_keyed_by_index_is_converted_on_read_and_resumes_bitwise(tmp_path, optimizer):
    """Files written before format_version 3 keep loading: resumed (the trainer), read whole (export,
    consolidation), read for the weights (sample.py, eval_lm.py, init_from), with no difference."""
    import shutil
    from conftest import base_args, make_shards, train_losses

    data, straight, legacy = make_shards(tmp_path / "shards"), tmp_path / "straight", tmp_path / "legacy"
    settings = dict(optimizer=optimizer, max_steps=6, checkpoint_interval=3, eval_interval=0, val_tokens=64)
    assert train_here(base_args(data, straight, **settings)) == 0  # checkpoints 3 and 6
    shutil.copytree(straight, legacy)
    ckpt.delete_checkpoint(ckpt.checkpoint_path(legacy / "checkpoints", 6))  # as if it had died after step 5
    path = ckpt.checkpoint_path(legacy / "checkpoints", 3)
    current = torch.load(path, weights_only=True)
    assert current["format_version"] == ckpt.FORMAT_VERSION == 4
    assert all(isinstance(name, str) for name in current["optimizer"]["state"])  # keyed by name now
    ckpt.save_checkpoint(in_format_2(current), path)
    written = torch.load(path, weights_only=True)
    assert written["format_version"] == 2 and sorted(written["optimizer"]["state"]) == list(range(len(current["optimizer"]["state"])))

    # read whole: the same state as the file of today's layout (and a consolidation of it writes that layout)
    whole = ckpt.read_full_state(path)
    assert whole["format_version"] == 3 and whole["optimizer"]["param_groups"] == current["optimizer"]["param_groups"]
    assert whole["optimizer"]["state"].keys() == current["optimizer"]["state"].keys()
    for name, entries in current["optimizer"]["state"].items():
        assert all(torch.equal(value, whole["optimizer"]["state"][name][key]) for key, value in entries.items()), name
    consolidated = ckpt.consolidate(path, tmp_path / "step_00000003.pt")
    assert torch.load(tmp_path / "step_00000003.pt", weights_only=True)["optimizer"]["param_groups"] == \
        consolidated["optimizer"]["param_groups"] == current["optimizer"]["param_groups"]
    # read for the weights
    model, _, _ = ckpt.read_model(path, "sample.py")
    assert all(torch.equal(value, current["model"][key]) for key, value in model.state_dict().items())

    # resumed by the trainer: the same steps, bitwise, and the same final state as the uninterrupted run
    assert train_here(base_args(data, legacy, **settings)) == 0
    assert train_losses(legacy) == train_losses(straight)
    final = [ckpt.read_full_state(ckpt.checkpoint_path(out / "checkpoints", 6)) for out in (legacy, straight)]
    assert all(torch.equal(value, final[1]["model"][key]) for key, value in final[0]["model"].items())
    assert final[0]["optimizer"]["param_groups"] == final[1]["optimizer"]["param_groups"]
    for name, entries in final[1]["optimizer"]["state"].items():
        assert all(torch.equal(value, final[0]["optimizer"]["state"][name][key]) for key, value in entries.items())
