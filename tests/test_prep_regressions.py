"""Regressions of reported prep/fineweb.py defects (#16-#21); each failed before its fix.

All go through the command line, as a user meets them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, wait_until
from slowness import guard
from data.shards import find_shards
from data.tokenizer import EOT_TOKEN
from test_prep import (
    all_tokens, folder_bytes, make_docs, prep_cmd, prep_env, run_prep, tokens_of, worker_pids, write_inputs,
    write_jsonl, write_parquet,
)

pytestmark = pytest.mark.slow  # every test here starts prep processes


def error_line(proc) -> str:
    """The one `error:` line a failed prep prints (no traceback)."""
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


# --- 16: old shards in --out ----------------------------------------------------------------------

def test_a_folder_holding_another_runs_shards_is_refused_unless_overwrite(tmp_path):
    docs = make_docs(500, seed=16)
    jsonl = write_jsonl(tmp_path / "docs.jsonl", docs)
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    run_prep([jsonl], out, "--shard_size", "5000")
    before = folder_bytes(out)
    assert len(find_shards(out, "train")) > 5

    proc = run_prep([jsonl], out, "--shard_size", "60000", check=False)
    assert proc.returncode == 2 and f"--out {out}: holds a finished prep" in error_line(proc)
    assert "--overwrite" in error_line(proc) and folder_bytes(out) == before  # nothing written or removed

    run_prep([jsonl], out, "--shard_size", "60000", "--overwrite")
    run_prep([jsonl], fresh, "--shard_size", "60000")
    assert folder_bytes(out) == folder_bytes(fresh)  # no old shard left behind
    assert np.array_equal(all_tokens(out), tokens_of(docs))

    (out / "local_manifest.json").unlink()  # shards without bookkeeping: another run's
    proc = run_prep([jsonl], out, "--shard_size", "60000", check=False)
    assert proc.returncode == 2 and "files of prefix 'local' from another run" in error_line(proc)


# --- 17: every input checked before anything is written --------------------------------------------

@pytest.mark.parametrize("bad,message", [
    ("missing.jsonl", "missing.jsonl: no such file"),
    ("folder.jsonl", "folder.jsonl: not a file"),
    ("notes.docx", "notes.docx: unsupported input type '.docx'"),
    ("fake.parquet", "fake.parquet: not a readable parquet file"),
    ("ints.parquet", "ints.parquet: column 'text' is int64, not a string column"),
])
def test_every_input_is_checked_before_anything_is_written(tmp_path, bad, message):
    import pyarrow as pa
    import pyarrow.parquet as pq

    big = write_jsonl(tmp_path / "big.jsonl", make_docs(2000, seed=17))
    (tmp_path / "folder.jsonl").mkdir()
    (tmp_path / "notes.docx").write_text("x")
    (tmp_path / "fake.parquet").write_text("not parquet")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    out = tmp_path / "out"
    proc = run_prep([big, tmp_path / bad], out, "--shard_size", "1000", check=False)
    assert proc.returncode == 2 and message in error_line(proc)
    assert not out.exists() or not list(out.iterdir())


# --- 18: bad documents are named by file and line (row) ---------------------------------------------

def bad_txt(folder: Path) -> Path:
    path = folder / "bad.txt"
    path.write_bytes(b"line one\nline two\nline \xff three")
    return path


def jsonl_with(folder: Path, line: int, raw: str, before: int = 10) -> Path:
    """A .jsonl whose line `line` is `raw`, after good lines (and blank ones, which count as lines)."""
    good = [f'{{"text": "document {i}"}}' for i in range(before)]
    lines = good[: line - 2] + [""] + [raw] + good[line - 2:]  # a blank line at line-1
    path = folder / "docs.jsonl"
    path.write_bytes("\n".join(lines).encode("utf-8").replace(b"@", b"\xff") + b"\n")
    return path


def parquet_with_null(folder: Path) -> Path:
    docs = make_docs(20, seed=18)
    docs[13] = None
    return write_parquet(folder / "docs.parquet", docs, row_group_size=5)


def big_jsonl_with_null(folder: Path) -> Path:
    """A null `text` on line 9001, beyond the first 1 MiB piece: numbered across pieces."""
    docs = make_docs(9500, seed=19, words=(20, 60))
    path = write_jsonl(folder / "big.jsonl", docs)
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[9000] = '{"text": null}\n'
    path.write_text("".join(lines), encoding="utf-8")
    assert sum(len(line.encode()) for line in lines[:9000]) > 1 << 20
    return path


@pytest.mark.parametrize("make,message", [
    (bad_txt, "bad.txt: line 3: not UTF-8 text (byte 0xff)"),
    (lambda d: jsonl_with(d, 5, '{"text": null}'), "docs.jsonl: line 5: 'text' is null, not a string"),
    (lambda d: jsonl_with(d, 4, '{"text": 7}'), "docs.jsonl: line 4: 'text' is int, not a string"),
    (lambda d: jsonl_with(d, 6, '{"body": "x"}'), "docs.jsonl: line 6: no 'text' field"),
    (lambda d: jsonl_with(d, 3, '{"text": "caf@"}'), "docs.jsonl: line 3: not UTF-8 (byte 0xff at column 14)"),
    (lambda d: jsonl_with(d, 7, '{"text": "unterminated}'), "docs.jsonl: line 7: not valid JSON"),
    (lambda d: jsonl_with(d, 2, '["a", "b"]'), "docs.jsonl: line 2: not a JSON object"),
    (parquet_with_null, "docs.parquet: row 13: 'text' is null, not a string"),
    (big_jsonl_with_null, "big.jsonl: line 9001: 'text' is null, not a string"),
], ids=["txt-utf8", "jsonl-null", "jsonl-int", "jsonl-missing", "jsonl-utf8", "jsonl-json", "jsonl-array",
        "parquet-null", "jsonl-null-2nd-piece"])
@pytest.mark.parametrize("num_proc", [1, 2])
def test_a_bad_document_is_named_by_file_and_line(tmp_path, make, message, num_proc):
    good, _ = write_inputs(tmp_path / "good")
    proc = run_prep([*good, make(tmp_path)], tmp_path / "out", "--num_proc", str(num_proc), check=False)
    assert proc.returncode == 2 and f"error: {tmp_path / message}" in error_line(proc)


def test_local_inputs_need_no_datasets_library(tmp_path):
    """GPU images lack `datasets`: local files are read without it."""
    shadow = tmp_path / "shadow" / "datasets"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('datasets is not installed here')\n")
    inputs, docs = write_inputs(tmp_path / "in")
    env = prep_env(PYTHONPATH=str(shadow.parent))
    run_prep(inputs, tmp_path / "out", "--shard_size", "300", "--num_proc", "2", env=env)
    assert np.array_equal(all_tokens(tmp_path / "out"), tokens_of(docs))


# --- 19: a killed worker --------------------------------------------------------------------------

def test_a_killed_worker_ends_prep_with_an_error_not_a_hang(tmp_path):
    jsonl = write_jsonl(tmp_path / "docs.jsonl", make_docs(4000, seed=20) * 8)  # ~16 MB
    out, log = tmp_path / "out", tmp_path / "stderr.txt"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(prep_cmd([jsonl], out, "--shard_size", "50000", "--num_proc", "2"), env=prep_env(),
                                stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
    try:
        wait_until(lambda: list(out.glob("*.npy")) and worker_pids(proc.pid), proc, "a shard written, workers running",
                   60)
        os.kill(worker_pids(proc.pid)[0], signal.SIGKILL)
        try:
            returncode = proc.wait(timeout=guard(60))
        except subprocess.TimeoutExpired:
            pytest.fail("prep hangs after one of its workers was killed")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    done = subprocess.CompletedProcess(proc.args, returncode, "", log.read_text())
    assert returncode == 1 and "a tokenizer worker process died" in error_line(done)


# --- 20: a small corpus and no train shard -------------------------------------------------------------

def test_a_small_corpus_gets_about_a_tenth_as_val_and_the_rest_as_train(tmp_path):
    docs = make_docs(60, seed=20)
    run_prep([write_jsonl(tmp_path / "docs.jsonl", docs)], tmp_path / "out")  # default sizes: 100M tokens
    val, train = find_shards(tmp_path / "out", "val"), find_shards(tmp_path / "out", "train")
    assert len(val) == 1 and len(train) == 1
    val_tokens, total = np.load(val[0]), tokens_of(docs)
    assert 0.05 < val_tokens.size / total.size < 0.2 and np.load(train[0])[0] == EOT_TOKEN
    assert np.array_equal(all_tokens(tmp_path / "out"), total)


def test_no_train_shard_is_a_warning(tmp_path):
    docs = make_docs(60, seed=20)
    proc = run_prep([write_jsonl(tmp_path / "docs.jsonl", docs)], tmp_path / "out", "--val_size", "100000000")
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "no train shard was written" in warnings[0], proc.stderr
    assert [p.name for p in find_shards(tmp_path / "out", "val")] == ["local_val_000000.npy"]


# --- 21: val and train share no document ------------------------------------------------------------

def test_the_val_shard_holds_whole_documents_and_train_starts_with_the_next(tmp_path):
    docs = make_docs(200, seed=21)
    lengths = np.cumsum([tokens_of([d]).size for d in docs])
    assert 1000 not in lengths  # no document happens to end exactly at val_size
    run_prep([write_jsonl(tmp_path / "docs.jsonl", docs)], tmp_path / "out", "--shard_size", "1000",
             "--val_size", "1000")
    val = np.load(find_shards(tmp_path / "out", "val")[0])
    first_train = np.load(find_shards(tmp_path / "out", "train")[0])
    whole = int(np.searchsorted(lengths, 1000, side="right"))  # documents that fit in 1000 tokens
    assert np.array_equal(val, tokens_of(docs[:whole]))
    assert first_train[0] == EOT_TOKEN


def test_a_first_document_longer_than_val_size_is_one_error_line_and_writes_nothing(tmp_path):
    """--val_size is the most tokens in the val shard (issue 44: a first document longer than it was the val
    shard, 5,378 tokens for --val_size 4096); the val shard holds whole documents, so it cannot be honoured."""
    docs = make_docs(30, seed=22, words=(500, 900))
    first = tokens_of(docs[:1]).size
    proc = run_prep([write_jsonl(tmp_path / "docs.jsonl", docs)], tmp_path / "out", "--shard_size", "1000",
                    "--val_size", "100", check=False)
    assert proc.returncode == 2
    assert error_line(proc) == (
        f"error: --val_size 100: the first document is {first:,} tokens long, and the val shard holds whole "
        f"documents only (no document is in both splits); raise --val_size to at least {first}, or put a shorter "
        f"document first")
    assert not (tmp_path / "out").exists()  # no progress record that would look like a prep under way


def test_a_worker_killed_while_sending_its_result_ends_prep_with_an_error_not_a_hang():
    """A worker killed half-way through a message (tests/dying_worker.py): one shared result queue
    would wait for the rest of it, and on the lock the dead worker held, for ever."""
    try:
        proc = subprocess.run([sys.executable, str(REPO / "tests" / "dying_worker.py")], capture_output=True, text=True,
                              timeout=guard(30), start_new_session=True)
    except subprocess.TimeoutExpired:
        pytest.fail("prep's worker pool hangs on a result a killed worker left half-sent")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "a tokenizer worker process died" in proc.stdout
