"""Interrupted preps continue on the same command and end with the bytes of an uninterrupted run.

Local inputs are killed for real (SIGKILL, Ctrl-C) in a subprocess. The Hub path runs in this
process on a local .jsonl streamed by `datasets` (offline), interrupted at chosen shards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import wait_until
from slowness import guard
from test_prep import (
    all_tokens, folder_bytes, make_docs, prep_cmd, prep_env, run_prep, running, tokens_of, worker_pids, write_jsonl,
    write_parquet,
)

ARGS = ["--shard_size", "50000"]
SLOW_PREP = Path(__file__).with_name("slow_prep.py")  # prep/fineweb.py pausing after each shard

pytestmark = pytest.mark.slow  # every test here starts processes (the Hub test only with num_proc 2)


def big_inputs(folder):
    """~13 MB of .jsonl (13 pieces) then a parquet of 4 row groups; the documents in order."""
    folder.mkdir()
    docs = make_docs(2000, seed=3) * 8
    tail = make_docs(400, seed=4)
    return [write_jsonl(folder / "big.jsonl", docs), write_parquet(folder / "tail.parquet", tail, 100)], docs + tail


def recorded_shards(out) -> list[str]:
    try:
        return [s["name"] for s in json.loads((out / "local_progress.json").read_text())["shards"]]
    except (OSError, ValueError):
        return []  # not written yet (it is replaced atomically: never half a file)


def as_a_terminal_starts_it() -> None:
    """In the child, before exec: SIGINT's default action, as in a job a terminal runs in the
    foreground. An ignored SIGINT is inherited (a suite started as a shell's background job
    has one), and Python leaves it ignored: Ctrl-C would then never reach the prep."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt(cmd, out, sig, log, min_shards=10):
    """Start cmd (a prep_cmd) and send it sig once `min_shards` are recorded: SIGINT to its process
    group (as a terminal's Ctrl-C does), SIGKILL to the main process alone. Its exit code, stderr
    and workers. The prep runs through slow_prep.py, so it is still running when the signal lands."""
    cmd = [sys.executable, str(SLOW_PREP), *cmd[2:]]
    with open(log, "w") as stderr:
        proc = subprocess.Popen(cmd, env=prep_env(), stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True,
                                preexec_fn=as_a_terminal_starts_it)
    try:
        wait_until(lambda: len(recorded_shards(out)) >= min_shards, proc, f"{min_shards} shards recorded", 60)
        workers = worker_pids(proc.pid)
        os.killpg(proc.pid, sig) if sig == signal.SIGINT else os.kill(proc.pid, sig)
        return proc.wait(timeout=guard(60)), log.read_text(), workers
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def stats(out, names) -> dict[str, tuple[int, int]]:
    return {n: ((out / n).stat().st_ino, (out / n).stat().st_mtime_ns) for n in names}


@pytest.fixture
def ignored_ctrl_c():
    """This process with SIGINT ignored, as a shell starts a background job (`make test &` in a
    script): what children inherit, until they set it otherwise."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("sig,code", [(signal.SIGKILL, -signal.SIGKILL), (signal.SIGINT, 130)])
def test_an_interrupted_prep_continues_and_ends_with_the_uninterrupted_bytes(tmp_path, sig, code, ignored_ctrl_c):
    inputs, docs = big_inputs(tmp_path / "in")
    reference, out = tmp_path / "reference", tmp_path / "out"
    run_prep(inputs, reference, *ARGS, "--num_proc", "1")

    returncode, stderr, workers = interrupt(prep_cmd(inputs, out, *ARGS, "--num_proc", "2"), out, sig, tmp_path / "log")
    assert len(workers) == 2
    assert returncode == code and "Traceback" not in stderr, stderr[-3000:]
    if sig == signal.SIGINT:
        assert stderr.rstrip().endswith("interrupted")
    deadline = time.monotonic() + guard(10)
    while any(map(running, workers)):  # no worker outlives the main process, even one killed by SIGKILL
        if time.monotonic() > deadline:
            for pid in filter(running, workers):
                os.kill(pid, signal.SIGKILL)
            pytest.fail("worker processes outlived prep")
        time.sleep(0.05)
    finished = recorded_shards(out)
    assert not (out / "local_manifest.json").exists() and len(finished) >= 10
    before = stats(out, finished)

    proc = run_prep(inputs, out, *ARGS, "--num_proc", "1")  # another --num_proc: the same bytes
    assert f"{len(finished)} shards already written" in proc.stdout
    assert stats(out, finished) == before  # the shards finished before the interruption were kept
    assert folder_bytes(out) == folder_bytes(reference)  # shards and manifest; no progress file left
    assert np.array_equal(all_tokens(out), tokens_of(docs))


def test_an_unfinished_prep_of_another_command_is_refused(tmp_path):
    inputs, _ = big_inputs(tmp_path / "in")
    out = tmp_path / "out"
    returncode, _, _ = interrupt(prep_cmd(inputs, out, *ARGS, "--num_proc", "1"), out, signal.SIGKILL, tmp_path / "log")
    assert returncode == -signal.SIGKILL
    kept = folder_bytes(out)

    proc = run_prep(inputs, out, "--shard_size", "60000", check=False)
    assert proc.returncode == 2 and "holds an unfinished prep of another command (shard_size 50000 -> 60000)" in proc.stderr
    os.utime(inputs[1], ns=(0, 0))  # an input changed since
    proc = run_prep(inputs, out, *ARGS, check=False)
    assert proc.returncode == 2 and "other inputs (or inputs changed since)" in proc.stderr
    assert folder_bytes(out) == kept

    run_prep(inputs, out, *ARGS, "--overwrite")
    run_prep(inputs, tmp_path / "fresh", *ARGS)
    assert folder_bytes(out) == folder_bytes(tmp_path / "fresh")


def test_a_recorded_shard_that_went_missing_is_an_error(tmp_path):
    inputs, _ = big_inputs(tmp_path / "in")
    out = tmp_path / "out"
    interrupt(prep_cmd(inputs, out, *ARGS, "--num_proc", "1"), out, signal.SIGKILL, tmp_path / "log")
    (out / recorded_shards(out)[1]).unlink()
    proc = run_prep(inputs, out, *ARGS, check=False)
    assert proc.returncode == 2 and "local_train_000001.npy: missing or changed since local_progress.json" in proc.stderr


def test_a_prep_that_failed_before_its_first_shard_does_not_block_the_fixed_command(tmp_path):
    docs = make_docs(50, seed=6)
    path = write_jsonl(tmp_path / "docs.jsonl", docs[:3])
    path.write_text(path.read_text() + '{"text": null}\n')
    proc = run_prep([path], tmp_path / "out", check=False)
    assert proc.returncode == 2 and "docs.jsonl: line 4: 'text' is null" in proc.stderr
    write_jsonl(path, docs)  # fixed: another input now, but nothing of the failed run is worth keeping
    run_prep([path], tmp_path / "out")
    assert np.array_equal(all_tokens(tmp_path / "out"), tokens_of(docs))


# --- the Hub path, on a local .jsonl streamed by `datasets` ------------------------------------------

class Interrupt(Exception):
    """Stands for the process being killed at a chosen moment."""


@pytest.mark.parametrize("num_proc", [1, 2])
def test_a_hub_stream_continues_from_its_state_dict(tmp_path, monkeypatch, num_proc):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from datasets import load_dataset

    from prep import fineweb

    docs = make_docs(1500, seed=5)
    path = write_jsonl(tmp_path / "hub.jsonl", docs)
    monkeypatch.setattr(fineweb, "HUB_BATCH_DOCS", 200)  # several batches: resumes start mid-stream

    def prepare(out):
        source = fineweb.HubSource({"dataset": "json", "data_files": path.name},
                                   lambda: load_dataset("json", data_files=[str(path)], split="train", streaming=True),
                                   "text")
        settings = {"shard_size": 10000, "val_size": 5000, "text_field": "text", "max_tokens": 0}
        return fineweb.prepare(source, out, "hub", settings, num_proc, show_progress=False)

    reference, out = tmp_path / "reference", tmp_path / "out"
    prepare(reference)
    assert len(list(reference.glob("*.npy"))) > 15

    save = fineweb.write_json_atomic

    def save_then_stop(path, record):  # killed right after the progress of shard 6 is saved
        save(path, record)
        if len(record["shards"]) == 6:
            raise Interrupt

    monkeypatch.setattr(fineweb, "write_json_atomic", save_then_stop)
    with pytest.raises(Interrupt):
        prepare(out)
    assert len(recorded := json.loads((out / "hub_progress.json").read_text())["shards"]) == 6
    assert recorded[-1]["name"] == "hub_train_000005.npy"

    describe = fineweb.shard_record

    def stop_at_shard_11(path, tokens):  # killed after shard 11 is on disk but before it is recorded
        if path.name == "hub_train_000011.npy":
            raise Interrupt
        return describe(path, tokens)

    monkeypatch.setattr(fineweb, "write_json_atomic", save)
    monkeypatch.setattr(fineweb, "shard_record", stop_at_shard_11)
    with pytest.raises(Interrupt):
        prepare(out)
    assert (out / "hub_train_000011.npy").exists()
    assert len(json.loads((out / "hub_progress.json").read_text())["shards"]) == 11

    monkeypatch.setattr(fineweb, "shard_record", describe)
    prepare(out)
    assert folder_bytes(out) == folder_bytes(reference)
    assert np.array_equal(all_tokens(out), tokens_of(docs))
    manifest = json.loads((out / "hub_manifest.json").read_text())
    assert manifest["source"] == {"dataset": "json", "data_files": "hub.jsonl"}
