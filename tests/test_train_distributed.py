"""End-to-end trainer runs: DDP equals one big batch, resuming is exact, checkpoints are clean."""

from __future__ import annotations

import pytest
import torch

from conftest import base_args, load_weights, run_trainer, train_losses
from runtime.logger import read_log

pytestmark = pytest.mark.slow  # every test here starts processes


def assert_weights_close(a: dict, b: dict, rtol: float = 1e-5) -> None:
    """Each tensor within rtol in relative norm: ||a - b|| <= rtol * ||b||."""
    assert a.keys() == b.keys()
    for key in a:
        diff, scale = torch.linalg.norm(a[key] - b[key]).item(), torch.linalg.norm(b[key]).item()
        assert diff <= rtol * scale, f"{key}: ||diff|| {diff:.3g} > {rtol} * ||w|| {scale:.3g}"


def test_ddp_two_ranks_equals_single_process_with_same_total_batch(shards, tmp_path):
    # 2 ranks x 2 micro-steps of B=4 == 1 process x 4 micro-steps of B=4 == 1 process x 1 of B=16.
    # In float64: the three runs add the same gradients in different orders, and in float32 that
    # rounding alone moves some weights by more than 1e-5 (bias gradients are sums of many
    # cancelling terms, and Adam normalises tiny gradients up to lr-sized steps). A bug in the
    # accumulation or the averaging would still show as an O(1) difference.
    exact = dict(dtype="float64")
    run_trainer(base_args(shards, tmp_path / "ddp", **exact), nproc=2)
    run_trainer(base_args(shards, tmp_path / "single", **exact))
    run_trainer(base_args(shards, tmp_path / "big", micro_batch_size=16, **exact))
    ddp, single, big = (train_losses(tmp_path / d) for d in ("ddp", "single", "big"))
    assert sorted(ddp) == list(range(6))
    for step in range(6):
        assert abs(ddp[step] - single[step]) <= 1e-5 * abs(single[step])
        assert abs(big[step] - single[step]) <= 1e-5 * abs(single[step])
    assert ddp[5] < ddp[0]  # it learns
    assert_weights_close(load_weights(tmp_path / "ddp", 6), load_weights(tmp_path / "single", 6))
    assert_weights_close(load_weights(tmp_path / "big", 6), load_weights(tmp_path / "single", 6))
    # val loss is the same figure for any world size
    val = {d: [r["loss"] for r in read_log(tmp_path / d / "log.jsonl") if r["kind"] == "val"] for d in ("ddp", "single")}
    assert len(val["ddp"]) == 3  # steps 0, 3, 6
    for a, b in zip(val["ddp"], val["single"]):
        assert abs(a - b) <= 1e-5 * b


def test_resume_is_bitwise_exact_and_log_has_one_record_per_step(shards, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    uneven = dict(val_tokens=320)  # 10 val rows: 3 batches of up to 4, shared 2 + 1 by two ranks
    run_trainer(base_args(shards, straight, **uneven), nproc=2)
    # stop after 3 steps (checkpoint step_3), then the same command with max_steps 6
    run_trainer(base_args(shards, resumed, max_steps=3, **uneven), nproc=2)
    # pretend the first run got further before dying: records past the checkpoint must be dropped
    with open(resumed / "log.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 3, "loss": 99.0}\n{"kind": "train", "step": 4, "lo')
    proc = run_trainer(base_args(shards, resumed, **uneven), nproc=2)
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout
    assert train_losses(straight) == train_losses(resumed)  # bitwise: float equality
    records = read_log(resumed / "log.jsonl")
    train_steps = [r["step"] for r in records if r["kind"] == "train"]
    assert train_steps == list(range(6))
    assert [r["step"] for r in records if r["kind"] == "val"] == [0, 3, 6]
    a, b = load_weights(straight, 6), load_weights(resumed, 6)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    state = torch.load(resumed / "checkpoints" / "step_00000006.pt", weights_only=True)
    assert state["step"] == 6 and state["tokens_seen"] == 6 * 512
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in state["model"])
    # the val loss of the same weights (step 0) is the very same float32 figure on 1 and 2 ranks
    one = tmp_path / "one_rank"
    run_trainer(base_args(shards, one, max_steps=1, checkpoint_interval=0, **uneven))
    val0 = [next((r["loss"], r["bpb"]) for r in read_log(d / "log.jsonl") if r["kind"] == "val" and r["step"] == 0)
            for d in (one, straight)]
    assert val0[0] == val0[1]  # bitwise (loss and bits per byte), although the ranks hold different shares of the batches


def test_resume_on_another_world_size_matches_within_tolerance(shards, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    exact = dict(dtype="float64")  # see the DDP test above
    run_trainer(base_args(shards, straight, **exact), nproc=2)
    run_trainer(base_args(shards, resumed, max_steps=3, **exact), nproc=2)
    # 2 ranks -> 1 process, and another micro-batch size: the same rows per step
    run_trainer(base_args(shards, resumed, micro_batch_size=8, **exact))
    a, b = train_losses(straight), train_losses(resumed)
    assert sorted(b) == list(range(6))
    for step in range(6):
        assert abs(a[step] - b[step]) <= 1e-5 * a[step]
    assert_weights_close(load_weights(straight, 6), load_weights(resumed, 6))


def test_compiled_ddp_with_fused_loss_matches_plain_eager(shards, tmp_path):
    """torch.compile under DDP, with the fused chunked loss, as on a GPU node (here on CPU/gloo)."""
    run_trainer(base_args(shards, tmp_path / "compiled", max_steps=3, eval_interval=0, compile="true",
                          loss_chunk_size=40), nproc=2)
    run_trainer(base_args(shards, tmp_path / "eager", max_steps=3, eval_interval=0))
    compiled, eager = train_losses(tmp_path / "compiled"), train_losses(tmp_path / "eager")
    assert sorted(compiled) == [0, 1, 2]
    for step in compiled:
        assert abs(compiled[step] - eager[step]) <= 1e-5 * eager[step]
    state = torch.load(tmp_path / "compiled" / "checkpoints" / "step_00000003.pt", weights_only=True)
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in state["model"])  # unwrapped, uncompiled keys


def test_float16_with_a_loss_scaler_resumes_exactly(shards, tmp_path):
    """GPUs without bf16 (V100, T4) train in float16 with a gradient scaler, whose state is checkpointed."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    fp16 = dict(dtype="float16")
    run_trainer(base_args(shards, straight, **fp16))
    run_trainer(base_args(shards, resumed, max_steps=3, **fp16))
    run_trainer(base_args(shards, resumed, **fp16))
    assert train_losses(straight) == train_losses(resumed) and sorted(train_losses(straight)) == list(range(6))
    a, b = (torch.load(d / "checkpoints" / "step_00000006.pt", weights_only=True) for d in (straight, resumed))
    assert a["scaler"] == b["scaler"] and a["scaler"]["scale"] > 0
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
