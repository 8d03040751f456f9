"""prep/fineweb.py on local txt / jsonl / parquet files (no network), and the shard writer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO
from data.shards import ShardWriter, find_shards, open_shard
from data.tokenizer import get_tokenizer

DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé text — with “quotes”, emoji 🙂 and 日本語.",
    "Numbers 3.14159 and 2**16 = 65536; code: def f(x):\n    return x + 1\n",
    "   leading spaces, trailing spaces   \n\n\nand blank lines",
    "A document that mentions <|endoftext|> as plain text.",
] + [f"Document number {i}: " + "lorem ipsum dolor sit amet " * (i % 7 + 1) for i in range(60)]


def write_inputs(folder):
    folder.mkdir(parents=True, exist_ok=True)
    txt_docs, json_docs, parquet_docs = DOCS[:3], DOCS[3:30], DOCS[30:]
    txt_files = []
    for i, doc in enumerate(txt_docs):
        path = folder / f"doc{i}.txt"
        path.write_text(doc, encoding="utf-8")
        txt_files.append(path)
    jsonl = folder / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(json_docs)), encoding="utf-8")
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = folder / "docs.parquet"
    pq.write_table(pa.table({"text": parquet_docs, "score": list(range(len(parquet_docs)))}), parquet)
    return [*txt_files, jsonl, parquet], txt_docs + json_docs + parquet_docs


def run_prep(inputs, out, *extra):
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, str(REPO / "prep" / "fineweb.py"), "--input", *map(str, inputs), "--out", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("num_proc", [1, 2])
def test_local_files_become_shards_identical_to_direct_tokenization(tmp_path, num_proc):
    inputs, docs = write_inputs(tmp_path / "in")
    out = tmp_path / f"out{num_proc}"
    run_prep(inputs, out, "--shard_size", "300", "--val_size", "200", "--num_proc", str(num_proc))
    enc = get_tokenizer()
    expected = np.concatenate([[50256, *enc.encode_ordinary(d)] for d in docs]).astype(np.uint16)
    val, train = find_shards(out, "val"), find_shards(out, "train")
    assert [p.name for p in val] == ["local_val_000000.npy"]
    assert train[0].name == "local_train_000001.npy"
    assert len(open_shard(val[0])) == 200 and all(len(open_shard(p)) == 300 for p in train[:-1])
    written = np.concatenate([np.load(p) for p in [*val, *train]])
    assert np.array_equal(written, expected)  # same ids as tiktoken, in input order, nothing lost
    assert (written == 50256).sum() == len(docs)  # one <|endoftext|> before each document
    assert written[0] == 50256


def test_prep_is_deterministic(tmp_path):
    inputs, _ = write_inputs(tmp_path / "in")
    run_prep(inputs, tmp_path / "a", "--shard_size", "256", "--num_proc", "2")
    run_prep(inputs, tmp_path / "b", "--shard_size", "256", "--num_proc", "1")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_unsupported_or_missing_input_is_a_clear_error(tmp_path):
    bad = tmp_path / "notes.docx"
    bad.write_text("x")
    proc = subprocess.run([sys.executable, str(REPO / "prep" / "fineweb.py"), "--input", str(bad), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "notes.docx: unsupported input type" in proc.stderr


def test_shard_writer_splits_documents_across_shards(tmp_path):
    writer = ShardWriter(tmp_path, "x", shard_size=10, val_size=4)
    writer.add(np.arange(7, dtype=np.uint16))
    writer.add(np.arange(100, 118, dtype=np.uint16))
    paths = writer.close()
    assert [p.name for p in paths] == ["x_val_000000.npy", "x_train_000001.npy", "x_train_000002.npy", "x_train_000003.npy"]
    assert np.array_equal(np.concatenate([np.load(p) for p in paths]),
                          np.concatenate([np.arange(7), np.arange(100, 118)]))
    assert [len(np.load(p)) for p in paths] == [4, 10, 10, 1]
