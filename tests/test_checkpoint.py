"""Checkpoint files: atomic writes, weights_only loads, fallback past damaged files, retention."""

from __future__ import annotations

import errno

import pytest
import torch

from training import checkpoint as ckpt


def state(step: int, n_layer: int = 2) -> dict:
    return {"model": {"w": torch.full((3,), float(step))}, "optimizer": {"state": {}, "param_groups": []},
            "step": step, "tokens_seen": step * 10, "config": {"seed": 1, "tags": ["a"]},
            "model_args": {"n_layer": n_layer, "n_head": 2, "n_embd": 64, "vocab_size": 50304, "block_size": 32},
            "rng": {"torch": torch.get_rng_state(), "cuda": None}, "wandb_run_id": None, "metrics": {}}


def test_round_trip_with_weights_only_and_no_temp_files(tmp_path):
    path = ckpt.checkpoint_path(tmp_path, 12)
    assert path.name == "step_00000012.pt"
    ckpt.save_checkpoint(state(12), path)
    loaded = ckpt.load_checkpoint(path)
    assert loaded["step"] == 12 and torch.equal(loaded["model"]["w"], torch.full((3,), 12.0))
    assert torch.load(path, weights_only=True)["config"] == {"seed": 1, "tags": ["a"]}
    assert [p.name for p in path.parent.iterdir()] == ["step_00000012.pt"]


def test_auto_resume_skips_truncated_and_garbage_newest_files(tmp_path, capsys):
    for step in (3, 6, 9, 12):
        ckpt.save_checkpoint(state(step), ckpt.checkpoint_path(tmp_path, step))
    data = ckpt.checkpoint_path(tmp_path, 12).read_bytes()
    ckpt.checkpoint_path(tmp_path, 12).write_bytes(data[: len(data) // 2])  # truncated
    ckpt.checkpoint_path(tmp_path, 9).write_bytes(b"\x00garbage" * 100)  # not a checkpoint at all
    path, loaded = ckpt.find_resume_checkpoint(tmp_path, "auto")
    assert path == ckpt.checkpoint_path(tmp_path, 6) and loaded["step"] == 6
    err = capsys.readouterr().err
    assert "step_00000012.pt: unreadable checkpoint" in err and "step_00000009.pt: unreadable checkpoint" in err
    assert ckpt.find_resume_checkpoint(tmp_path, "never") is None
    assert ckpt.find_resume_checkpoint(tmp_path / "empty", "auto") is None
    with pytest.raises(ckpt.CheckpointError, match="step_00000009.pt: unreadable checkpoint"):
        ckpt.find_resume_checkpoint(tmp_path, str(ckpt.checkpoint_path(tmp_path, 9)))


def test_pickled_code_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "step": 1, "payload": object()}, path)  # needs full unpickling
    with pytest.raises(ckpt.CheckpointError, match="evil.pt: unreadable checkpoint"):
        ckpt.load_checkpoint(path)


def test_retention_keeps_newest_and_the_resume_source(tmp_path):
    for step in (1, 2, 3, 4, 5):
        ckpt.save_checkpoint(state(step), ckpt.checkpoint_path(tmp_path, step))
    deleted = ckpt.prune_checkpoints(tmp_path, keep_last=2, protect=ckpt.checkpoint_path(tmp_path, 1))
    assert sorted(p.name for p in deleted) == ["step_00000002.pt", "step_00000003.pt"]
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [1, 4, 5]


def test_failed_write_leaves_previous_checkpoint_intact(tmp_path, monkeypatch):
    ckpt.save_checkpoint(state(3), ckpt.checkpoint_path(tmp_path, 3))

    def disk_full(obj, f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(ckpt.CheckpointWriteError, match="step_00000006.pt: could not write checkpoint "
                                                        r"\(No space left on device\); earlier checkpoints are intact"):
        ckpt.save_checkpoint(state(6), ckpt.checkpoint_path(tmp_path, 6))
    assert [p.name for p in ckpt.checkpoint_path(tmp_path, 3).parent.iterdir()] == ["step_00000003.pt"]
    assert ckpt.load_checkpoint(ckpt.checkpoint_path(tmp_path, 3))["step"] == 3


def test_checkpoint_of_another_model_size_is_refused_naming_the_key(tmp_path):
    path = ckpt.checkpoint_path(tmp_path, 3)
    with pytest.raises(ckpt.CheckpointError, match="checkpoint has n_layer=4 but this run has n_layer=2"):
        ckpt.check_compatible(state(3, n_layer=4), state(3)["model_args"], path)
    ckpt.check_compatible(state(3), state(3)["model_args"], path)
