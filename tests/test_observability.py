"""What a user watches: HellaSwag in the trainer, samples, W&B offline runs, MFU, sample.py."""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import GPT2_VOCAB, REPO, TINY_VOCAB, base_args, make_shards, run_trainer, train_losses
from training.metrics import model_flops_utilization, peak_flops_for
from training.run_logger import read_log



def hellaswag_fixture(path: Path, n: int = 11) -> Path:
    """A small file in the official HellaSwag jsonl format."""
    rng = random.Random(0)
    lines = []
    for i in range(n):
        ctx = " ".join(rng.choice(["A man", "The woman", "a dog", "runs", "then", "slowly", "the ball"]) for _ in range(5 + i))
        endings = [" ".join(rng.choice(["jumps", "over", "it", "and", "falls", "smiles"]) for _ in range(2 + j)) for j in range(4)]
        lines.append(json.dumps({"ind": i, "activity_label": "Sports", "ctx_a": ctx, "ctx_b": "", "ctx": ctx,
                                 "endings": endings, "label": rng.randrange(4), "split": "val",
                                 "split_type": "indomain", "source_id": f"fixture-{i}"}))
    path.write_text("\n".join(lines) + "\n")
    return path


def wandb_records(run_dir: Path):
    """Decode the records of an offline W&B run file (LevelDB-style log of protobuf Records)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, partial = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(partial + chunk)
            partial = b""
            yield record
        elif kind in (2, 3):  # first or middle piece
            partial += chunk
        elif kind == 0:
            pos += block - pos % block


def wandb_history(run_dir: Path) -> list[dict]:
    rows = []
    for record in wandb_records(run_dir):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 2-rank and one single-process run with HellaSwag, samples and W&B offline."""
    root = tmp_path_factory.mktemp("observe")
    data = make_shards(root / "shards")
    hellaswag = hellaswag_fixture(root / "hellaswag_val.jsonl")
    common = dict(dtype="float64", hellaswag_interval=3, hellaswag_path=hellaswag, sample_interval=3, vocab_size=GPT2_VOCAB,
                  sample_count=2, sample_tokens=6, wandb="true", wandb_mode="offline", wandb_project="test",
                  wandb_run_name="observe")
    secret = {"WANDB_API_KEY": "k" * 40 + "SECRET"}
    run_trainer(base_args(data, root / "ddp", **common), nproc=2, extra_env=secret)
    run_trainer(base_args(data, root / "single", **common), extra_env=secret)
    return root, data, common


@pytest.mark.slow
def test_hellaswag_in_the_trainer_is_identical_for_one_and_two_ranks(runs):
    root, _, _ = runs
    results = {d: [r for r in read_log(root / d / "log.jsonl") if r["kind"] == "hellaswag"] for d in ("ddp", "single")}
    assert [r["step"] for r in results["ddp"]] == [0, 3, 6]
    for a, b in zip(results["ddp"], results["single"]):
        assert (a["acc_norm"], a["acc"], a["n"]) == (b["acc_norm"], b["acc"], b["n"])
        assert a["n"] == 11


@pytest.mark.slow
def test_samples_are_written_once_by_rank_zero(runs):
    root, _, _ = runs
    samples = [r for r in read_log(root / "ddp" / "log.jsonl") if r["kind"] == "sample"]
    assert [r["step"] for r in samples] == [3, 3, 6, 6]
    assert all(r["text"].startswith("Hello, I'm a language model,") for r in samples)
    single = [r["text"] for r in read_log(root / "single" / "log.jsonl") if r["kind"] == "sample"]
    assert single == [r["text"] for r in samples]  # seeded: the same continuations for any world size


@pytest.mark.slow
def test_wandb_offline_history_holds_the_logged_metrics_and_no_api_key(runs):
    root, _, _ = runs
    (run_dir,) = (root / "ddp" / "wandb").glob("offline-run-*")
    history = wandb_history(run_dir)
    logged = {row["_step"]: row["train/loss"] for row in history if "train/loss" in row}
    assert logged == train_losses(root / "ddp")
    val = {row["_step"]: row["val/loss"] for row in history if "val/loss" in row}
    assert sorted(val) == [0, 3, 6]
    assert any("hellaswag/acc_norm" in row for row in history)
    assert any("train/tokens_per_sec" in row and "train/grad_norm" in row for row in history)
    # the API key comes from the environment only: never in the run folder or a checkpoint
    for path in (root / "ddp").rglob("*"):
        if path.is_file():
            assert b"SECRET" not in path.read_bytes(), path


@pytest.mark.slow
def test_resume_continues_the_same_wandb_run(runs, tmp_path):
    root, data, common = runs
    out = tmp_path / "resumed"
    run_trainer(base_args(data, out, **{**common, "max_steps": 3}))
    first_id = torch.load(out / "checkpoints" / "step_00000003.pt", weights_only=True)["wandb_run_id"]
    run_trainer(base_args(data, out, **common))
    assert torch.load(out / "checkpoints" / "step_00000006.pt", weights_only=True)["wandb_run_id"] == first_id
    run_dirs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 2 and all(d.name.endswith(first_id) for d in run_dirs)
    resumed_steps = [row["_step"] for row in wandb_history(run_dirs[1]) if "train/loss" in row]
    assert resumed_steps == [3, 4, 5]  # the resumed part logs the steps after the checkpoint, once


def test_mfu_is_reported_against_the_peak_and_lookup_table():
    assert peak_flops_for("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_flops_for("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_for("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_for("NVIDIA GeForce RTX 4090") == 165.2e12
    assert peak_flops_for("NVIDIA H200") == 989.4e12
    assert peak_flops_for("Some Future GPU") is None
    # GPT-2 124M at T=1024: ~ 6 * 124M + 12 * 12 * 12 * 64 * 1024 FLOPs per token
    assert model_flops_utilization(8.5e8, 468_000, 1, 989.4e12) == pytest.approx(8.5e8 * 468_000 / 989.4e12)
    assert model_flops_utilization(8.5e8, 468_000, 8, 989.4e12) == pytest.approx(8.5e8 * 468_000 / 989.4e12 / 8)


@pytest.mark.slow
def test_train_records_carry_throughput_and_mfu_with_a_peak_override(tmp_path):
    data = make_shards(tmp_path / "shards")
    run_trainer(base_args(data, tmp_path / "out", max_steps=2, peak_flops=1e12))
    records = [r for r in read_log(tmp_path / "out" / "log.jsonl") if r["kind"] == "train"]
    from model import GPT, GPTConfig

    flops = GPT(GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64, vocab_size=TINY_VOCAB)).estimate_flops_per_token(32)
    for r in records:
        assert r["tokens_per_sec"] == pytest.approx(512 / (r["step_ms"] / 1000))
        assert r["mfu"] == pytest.approx(flops * r["tokens_per_sec"] / 1e12)
    assert [r["tokens"] for r in records] == [512, 1024]
    startup = [r for r in read_log(tmp_path / "out" / "log.jsonl") if r["kind"] == "startup"]
    assert len(startup) == 1 and 0 < startup[0]["seconds_to_first_step"] < 120


@pytest.mark.slow
def test_sample_py_generates_from_a_checkpoint_like_the_model(runs):
    root, _, _ = runs
    cmd = [sys.executable, str(REPO / "sample.py"), "--ckpt", str(root / "single"), "--prompt", "Hello",
           "--max_new_tokens", "8", "--num_samples", "2", "--temperature", "0", "--device", "cpu"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "# step 6 of" in out and out.count("--- sample") == 2
    from sample import load_model
    from data.tokenizer import get_tokenizer

    model, _ = load_model(str(root / "single"), torch.device("cpu"))
    enc = get_tokenizer()
    greedy = model.generate(torch.tensor([enc.encode("Hello")]), 8, temperature=0, valid_vocab=50257)
    assert enc.decode(greedy[0].tolist()) in out
    seeded = [subprocess.run(cmd[:-4] + ["--seed", "3", "--device", "cpu"], capture_output=True, text=True).stdout
              for _ in range(2)]
    assert seeded[0] == seeded[1]


@pytest.mark.slow
def test_every_run_records_what_produced_it(runs):
    import subprocess as sp

    root, _, _ = runs
    record = json.loads((root / "ddp" / "run.json").read_text())
    head = sp.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert record["git_commit"] == head and isinstance(record["git_dirty"], bool)
    assert record["torch"] == torch.__version__ and record["world_size"] == 2 and record["device_count"] == 1
    assert record["command"].startswith("train_gpt2.py --model custom") and len(record["config_sha256"]) == 64
    assert len(record["data_fingerprint"]) == 16
    saved = torch.load(root / "ddp" / "checkpoints" / "step_00000006.pt", weights_only=True)
    assert saved["provenance"] == record
    (run_dir,) = (root / "ddp" / "wandb").glob("offline-run-*")
    configs = [json.loads(item.value_json) for r in wandb_records(run_dir) if r.WhichOneof("record_type") == "run"
               for item in r.run.config.update if item.key == "provenance"]
    assert configs and configs[0] == record
