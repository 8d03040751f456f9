"""Bad input: exit code 2 and one line naming the key or file, on every rank, no hang, no traceback.

Problems that depend on data or checkpoints run under 2-rank torchrun (where a rank-local error
could leave the other rank waiting in a collective); pure configuration errors, which are
raised before any process group exists, run as one process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, base_args, make_shards, run_trainer
from data.shards import shard_name, write_shard

pytestmark = pytest.mark.slow  # every test here starts processes


def drop_val(d):
    for p in d.glob("*_val_*.npy"):
        p.unlink()


def empty_dir(d):
    for p in d.iterdir():
        p.unlink()


def wrong_dtype(d):
    np.save(d / "tiny_train_000009.npy", np.arange(100, dtype=np.int32))


def wrong_dimension(d):
    np.save(d / "tiny_train_000009.npy", np.zeros((40, 40), dtype=np.uint16))


def out_of_range(d):
    write_shard(d / shard_name("tiny", "train", 4), np.full(500, 50304, dtype=np.uint16))


def corrupt(d):
    (d / "tiny_train_000009.npy").write_bytes(b"\x93NUMPY garbage that is not a header")


DATA_CASES = [
    (drop_val, [], "no val shards (*_val_*.npy)"),
    (empty_dir, [], "no train shards (*_train_*.npy)"),
    (wrong_dtype, [], "tiny_train_000009.npy: token shards must be uint16, found int32"),
    (wrong_dimension, [], "tiny_train_000009.npy: token shards must be 1-D"),
    (out_of_range, [], "tiny_train_000004.npy: token id 50304 at position 0 is out of range for vocab_size 50304"),
    (corrupt, [], "tiny_train_000009.npy: not a readable .npy token shard"),
    (None, ["--data_dir", "/no/such/folder"], "data_dir /no/such/folder: no such directory"),
    (None, ["--total_batch_size", "448"], "total_batch_size: 448 is not divisible by micro_batch_size * seq_len * world_size = 4 * 32 * 2 = 256"),
    (None, ["--total_batch_size", "32", "--micro_batch_size", "1"], "total_batch_size: a step of 32 tokens holds 1 rows of seq_len 32, fewer than the 2 ranks"),
    (None, ["--total_batch_size", "65536"], "fewer than one step needs (2048)"),
    (None, ["--val_tokens", "1000000"], "fewer than val_tokens 1000000 needs"),
]


@pytest.mark.parametrize("damage,extra,message", DATA_CASES, ids=[c[2][:40] for c in DATA_CASES])
def test_bad_data_fails_cleanly_on_every_rank(tmp_path, damage, extra, message):
    data = make_shards(tmp_path / "shards")
    if damage:
        damage(data)
    proc = run_trainer(base_args(data, tmp_path / "out") + extra, nproc=2, check=False, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2, proc.stderr[-3000:]  # one line per rank, the same line
    assert errors[0] == errors[1] and message in errors[0], errors
    assert "exitcode  : 2" in proc.stderr
    assert "train_gpt2.py\", line" not in proc.stderr  # no traceback from the trainer


CONFIG_CASES = [
    (["--n_layer", "x"], "error: n_layer: expected an integer or null, got 'x'"),
    (["--learning_rate", "1e-3"], "error: learning_rate: unknown config key"),
    (["--model", "gpt3"], "error: model: unknown model 'gpt3'"),
    (["--seq_len", "64"], "error: seq_len: 64 exceeds block_size 32"),
    (["--resume", "/no/such/step_00000100.pt"], "error: resume: no checkpoint file at '/no/such/step_00000100.pt'"),
    (["--config", "/no/such.yaml"], "error: config: no such file /no/such.yaml"),
]


@pytest.mark.parametrize("extra,message", CONFIG_CASES, ids=[c[1][7:40] for c in CONFIG_CASES])
def test_bad_config_is_one_line_and_exit_code_2(tmp_path, extra, message):
    proc = run_trainer(base_args(tmp_path, tmp_path / "out") + extra, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [message] or proc.stderr.strip().startswith(message), proc.stderr


def test_unreadable_resume_checkpoint_fails_on_every_rank(tmp_path):
    data = make_shards(tmp_path / "shards")
    bogus = tmp_path / "step_00000003.pt"
    bogus.write_bytes(b"not a checkpoint")
    proc = run_trainer(base_args(data, tmp_path / "out", resume=bogus), nproc=2, check=False, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and "step_00000003.pt: unreadable checkpoint" in errors[0], proc.stderr[-3000:]
    assert "exitcode  : 2" in proc.stderr


ENTRY_POINT_CASES = [
    (["sample.py", "--ckpt", "x.pt", "--num_samples", "0"], "--num_samples: must be >= 1, got 0"),
    (["sample.py", "--ckpt", "x.pt", "--top_k", "-1"], "--top_k: must be >= 0, got -1"),
    (["sample.py", "--ckpt", "x.pt", "--device", "cuda"], "device: cuda requested but CUDA is not available"),
    (["sample.py", "--ckpt", "x.pt", "--device", "tpu"], "device: unknown device 'tpu'"),
    (["sample.py", "--ckpt", "x.pt", "--max_new_tokens", "ten"], "sample.py: argument --max_new_tokens: invalid int"),
    (["sample.py"], "sample.py: the following arguments are required: --ckpt"),
    (["sample.py", "--ckpt", "no/such.pt"], "no/such.pt: no such checkpoint"),
    (["export_hf.py", "only_one_argument"], "export_hf.py: the following arguments are required: out_dir"),
    (["bench.py", "--warmup", "0"], "--warmup and --steps must be at least 1"),
    (["bench.py", "--micro_batch_size", "x"], "micro_batch_size: expected an integer"),
]


@pytest.mark.parametrize("argv,message", ENTRY_POINT_CASES, ids=[" ".join(c[0])[:40] for c in ENTRY_POINT_CASES])
def test_every_entry_point_answers_bad_input_with_one_line_and_exit_2(argv, message):
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert (proc.returncode, proc.stderr.count("\n")) == (2, 1), proc.stderr
    assert proc.stderr.startswith("error: ") and message in proc.stderr, proc.stderr
