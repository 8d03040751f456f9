"""Tokenize FineWeb-Edu (or local text) into uint16 token shards for train_gpt2.py.

    python prep/fineweb.py                                   # FineWeb-Edu sample-10BT -> data/edu_fineweb10B/
    python prep/fineweb.py --input a.txt b.jsonl c.parquet --out data/mycorpus

Inputs. FineWeb-Edu is streamed from the Hugging Face Hub with the `datasets` library (no
30 GB download cache). Local files are read directly: `.txt`, `.md` or `.py` (one UTF-8 document per file,
CRLF and CR line ends read as LF), `.jsonl` / `.json` (JSON Lines: one object per line, the
document in its `text` field) and `.parquet` (a `text` string column). Every input is checked
before anything is written; a bad document is an error naming its file and line (row, counted
from 0, for parquet).

Output. Every document becomes <|endoftext|> + its tokens, and the documents are written in
input order as `{prefix}_{split}_{index:06d}.npy`: index 000000 is the val split (whole
documents only, at most --val_size tokens: a first document longer than that is an error),
then train shards of --shard_size tokens. Without --val_size, a corpus smaller than one shard
gives about 10% of its documents to val.

Offline. Streaming needs the Hub: where it cannot be reached (or HF_HUB_OFFLINE is set), prep
stops at once with one line, before it writes anything. Offline, tokenize local copies instead
(`--input *.parquet`: FineWeb-Edu's own parquet files, fetched on a machine with internet).
`{prefix}_manifest.json`, written last, lists every shard (tokens, documents, sha256), the
source, the settings and the tokenizer's hash.

Speed. Worker processes read their own part of the input (about 1 MiB of .jsonl lines, a
parquet row group, a .txt file), tokenize it and return one token array; the main process
only writes the arrays in input order, so the bytes are the same for any --num_proc.

Resuming. After each shard, `{prefix}_progress.json` records where the input continues. After
an interruption (Ctrl-C, kill, preemption), the same command continues from there and ends
with the same bytes as an uninterrupted run. A folder holding other files of this prefix (a
finished prep, or another command's shards) is refused unless --overwrite is given.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: make `data` importable

import common.startup  # noqa: E402,F401 - first: a Ctrl-C while the modules below load is one line

import numpy as np  # noqa: E402

from data.manifest import (  # noqa: E402
    MANIFEST_FORMAT, manifest_path, prep_files, progress_path, read_json, shard_record, write_json_atomic,
    write_manifest,
)
from data.shards import ShardWriter, open_shard, shard_files  # noqa: E402
from data.tokenizer import BPE_RANKS_SHA256, EOT_TOKEN, get_tokenizer  # noqa: E402
from common.errors import ArgumentParser, ConfigError, DataError, ReproError, print_warning, run_cli  # noqa: E402
from common.settings import path_argument, require  # noqa: E402

HUB_DATASET = "HuggingFaceFW/fineweb-edu"
HUB_SUBSET = "sample-10BT"
# plain text, one document per file: .txt, and Markdown and Python sources (a prose or a code corpus from a folder)
INPUT_KINDS = {".txt": "txt", ".md": "txt", ".py": "txt", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
PIECE_BYTES = 1 << 20  # .jsonl bytes per worker task: about 250K tokens, 0.5 MB of them to send back
HUB_BATCH_DOCS = 512  # Hub documents per worker task
EOT_IDS = np.array([EOT_TOKEN], dtype=np.uint32)


# --- tokenizing (runs in the workers) ------------------------------------------------------------

def tokenize_texts(texts) -> np.ndarray:
    """<|endoftext|> + the tokens of each text, concatenated: uint16, (documents + tokens,).

    The ids of data.tokenizer.tokenize_document, without a Python int per token: tiktoken
    writes each document's ids straight into a numpy buffer. GPT-2 ids are < 50257 < 2**16.
    """
    enc = get_tokenizer()
    parts = []
    for text in texts:
        try:  # disallowed_special=(): "<|endoftext|>" inside a document is ordinary text
            ids = enc.encode_to_numpy(text, disallowed_special=())
        except UnicodeEncodeError:  # lone surrogates: replaced, as tiktoken's encode_ordinary does
            ids = enc.encode_to_numpy(text.encode("utf-16", "surrogatepass").decode("utf-16", "replace"),
                                      disallowed_special=())
        parts += (EOT_IDS, ids)
    return np.concatenate(parts).astype(np.uint16) if parts else np.empty(0, dtype=np.uint16)


class PieceError(Exception):
    """A bad document in a piece; `index` counts lines (rows) from the piece's first one."""

    def __init__(self, index: int, message: str):
        super().__init__(index, message)  # both in args: the exception pickles back from a worker
        self.index, self.message = index, message


def jsonl_text(line: bytes, index: int, text_field: str) -> str:
    try:
        record = json.loads(line)
    except UnicodeDecodeError as e:
        raise PieceError(index, f"not UTF-8 (byte {line[e.start]:#04x} at column {e.start + 1})") from None
    except json.JSONDecodeError as e:
        raise PieceError(index, f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise PieceError(index, "not a JSON object (.jsonl/.json inputs hold one object per line)")
    if text_field not in record:
        raise PieceError(index, f"no {text_field!r} field")
    text = record[text_field]
    if not isinstance(text, str):
        raise PieceError(index, f"{text_field!r} is {'null' if text is None else type(text).__name__}, not a string")
    return text


def read_piece(kind: str, path: str, start: int, end: int, text_field: str) -> tuple[np.ndarray, int]:
    """Tokens of one piece of an input, and how many lines (rows) it spans.

    .jsonl: the lines in bytes [start, end); .parquet: row group `start`; .txt: the whole file.
    """
    if kind == "txt":
        data = Path(path).read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise PieceError(data.count(b"\n", 0, e.start), f"not UTF-8 text (byte {data[e.start]:#04x})") from None
        # universal newlines, as Python's text mode reads a file (and as prep did through `datasets`)
        return tokenize_texts([text.replace("\r\n", "\n").replace("\r", "\n")]), 0
    if kind == "jsonl":
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(end - start)
        lines = enumerate(data.split(b"\n"))
        return tokenize_texts(jsonl_text(line, i, text_field) for i, line in lines if line.strip()), data.count(b"\n")
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    column = pq.ParquetFile(path).read_row_group(start, columns=[text_field]).column(0)
    if column.null_count:
        raise PieceError(pc.index(pc.is_null(column), True).as_py(), f"{text_field!r} is null, not a string")
    return tokenize_texts(column.to_pylist()), len(column)


# --- running tasks in order ------------------------------------------------------------------

def start_worker(parent: int) -> None:
    """Workers leave Ctrl-C to the main process, which stops them (no traceback from each), and
    exit when the main process is gone: killed with SIGKILL, it cannot stop them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=exit_with, args=(parent,), daemon=True).start()


def exit_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def worker_died() -> ReproError:
    return ReproError("a tokenizer worker process died (killed, or out of memory?); "
                      "run the same command again to continue after the last finished shard")


def raise_error(error: Exception):
    raise error


def serve(tasks, results, parent: int) -> None:
    """A worker: (fn, args) tasks in, (True, fn(*args)) or (False, the exception) out, in order,
    until its task pipe ends. A thread reads the tasks as they come, so the parent never waits to
    hand one over while this worker waits for the parent to take a result."""
    start_worker(parent)
    pending: queue.SimpleQueue = queue.SimpleQueue()

    def read_tasks() -> None:
        while True:
            try:
                task = tasks.recv()
            except (EOFError, OSError):  # the parent closed the pipe, or is gone
                pending.put(None)
                return
            except Exception as e:  # noqa: BLE001 - a task that cannot be unpickled here: its error is its result
                task = (raise_error, (e,))
            pending.put(task)

    threading.Thread(target=read_tasks, daemon=True).start()
    while (task := pending.get()) is not None:
        fn, args = task
        try:
            message = (True, fn(*args))
        except Exception as e:  # noqa: BLE001 - raised again in the parent, by get()
            message = (False, e)
        try:
            try:
                results.send(message)
            except (pickle.PicklingError, TypeError, AttributeError) as e:  # pickled whole before a byte is sent
                what = f"{type(message[1]).__name__}: {message[1]}" if not message[0] else "its result"
                results.send((False, ReproError(f"a tokenizer worker could not send back {what} ({e})")))
        except OSError:  # the parent is gone (killed): leave quietly, as exit_with does
            os._exit(1)


class Workers:
    """num_proc worker processes, each with a pipe of its own for tasks and one for results.

    A worker that dies, whatever it was doing, even half-way through sending a result, closes
    its ends of its pipes, and only it holds them: the parent then reads an end of file, or
    writes into a broken pipe, and raises worker_died(). (With one result queue shared by all
    workers, as ProcessPoolExecutor has, the parent waits forever for the rest of a message
    whose sender was killed, and the other workers for the lock it held.)
    """

    def __init__(self, num_proc: int):
        # spawn works everywhere (macOS, CUDA-initialised parents); the workers import this module
        context = mp.get_context("spawn")
        self.tasks, self.results, self.processes = [], [], []
        for _ in range(num_proc):
            task_reader, task_writer = context.Pipe(duplex=False)
            result_reader, result_writer = context.Pipe(duplex=False)
            process = context.Process(target=serve, args=(task_reader, result_writer, os.getpid()), daemon=True)
            process.start()
            task_reader.close()  # the worker's ends, now held by the worker alone
            result_writer.close()
            self.tasks.append(task_writer)
            self.results.append(result_reader)
            self.processes.append(process)

    def submit(self, worker: int, fn: Callable, args: tuple) -> None:
        try:
            self.tasks[worker].send((fn, args))
        except OSError:  # BrokenPipeError: the worker is gone
            raise worker_died() from None

    def result(self, worker: int):
        """The result of the oldest task handed to `worker` not yet collected, or the error it raised."""
        try:
            ok, value = self.results[worker].recv()
        except (EOFError, OSError):  # gone, perhaps half-way through its message
            raise worker_died() from None
        except Exception as e:  # noqa: BLE001 - whole, but not unpicklable here (an exception class's own arguments)
            raise ReproError(f"a tokenizer worker's result could not be read back ({type(e).__name__}: {e})") from None
        if not ok:
            raise value
        return value

    def close(self, finished: bool) -> None:
        """Stop every worker: after the last task once it has finished (they read the end of their
        task pipes), at once otherwise (an error, Ctrl-C)."""
        for connection in self.tasks:
            connection.close()
        for process in self.processes:
            if finished:
                process.join(timeout=10)
            if process.is_alive():
                process.kill()
            process.join()
        for connection in self.results:
            connection.close()


def in_order(jobs: Iterator[tuple[object, Callable, tuple]], num_proc: int) -> Iterator[tuple[object, Callable]]:
    """(key, get) for each (key, fn, args) job, in job order; get() returns fn(*args) or raises.

    With num_proc > 1, fn runs in that many worker processes (job k on worker k % num_proc, its
    result read back from that worker in turn), at most 2 * num_proc jobs ahead of the caller
    (memory stays flat). A worker that dies ends prep with an error, wherever it was (see
    Workers). With num_proc 1, fn runs here when get() is called.
    """
    if num_proc <= 1:
        for key, fn, args in jobs:
            yield key, functools.partial(fn, *args)
        return
    workers, window, finished = Workers(num_proc), deque(), False
    try:
        for k, (key, fn, args) in enumerate(jobs):
            workers.submit(k % num_proc, fn, args)
            window.append((key, k % num_proc))
            if len(window) >= 2 * num_proc:
                key, worker = window.popleft()
                yield key, functools.partial(workers.result, worker)
        while window:
            key, worker = window.popleft()
            yield key, functools.partial(workers.result, worker)
        finished = True
    finally:
        workers.close(finished)


# --- sources: where documents come from and how a position in them is written down -------------

@dataclass(frozen=True)
class Input:
    path: Path
    kind: str  # "txt", "jsonl" or "parquet"
    size: int  # where its positions end: bytes (.txt, .jsonl) or row groups (.parquet)

    def identity(self) -> dict:
        stat = self.path.stat()
        return {"path": str(self.path.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def check_inputs(names: list[str], text_field: str) -> list[Input]:
    """Every input exists, is a readable file of a supported type (parquet: with a string text column)."""
    inputs = []
    for name in names:
        path = Path(name)
        kind = INPUT_KINDS.get(path.suffix.lower())
        if kind is None:
            raise DataError(f"{path}: unsupported input type {path.suffix!r} "
                            f"(use .txt, .md, .py, .jsonl, .json or .parquet)")
        if not path.exists():
            raise DataError(f"{path}: no such file")
        if not path.is_file():
            raise DataError(f"{path}: not a file")
        if not os.access(path, os.R_OK):
            raise DataError(f"{path}: not readable (permission denied)")
        size = parquet_row_groups(path, text_field) if kind == "parquet" else path.stat().st_size
        inputs.append(Input(path, kind, size))
    return inputs


def parquet_row_groups(path: Path, text_field: str) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.read_metadata(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file ({e})") from None
    schema = meta.schema.to_arrow_schema()
    if text_field not in schema.names:
        raise DataError(f"{path}: no {text_field!r} column (columns: {', '.join(schema.names)})")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise DataError(f"{path}: column {text_field!r} is {kind}, not a string column")
    return meta.num_row_groups


def line_ranges(path: Path, start: int, size: int) -> Iterator[tuple[int, int]]:
    """Byte ranges [a, b) covering [start, size): about PIECE_BYTES each, ending after a newline."""
    with open(path, "rb") as f:
        while start < size:
            end = start + PIECE_BYTES
            if end < size:
                f.seek(end - 1)
                f.readline()  # on to the end of the line holding byte end-1
                end = min(f.tell(), size)
            else:
                end = size
            yield start, end
            start = end


class LocalSource:
    """Local files, read by the workers. A position is {"input": index in --input, "offset":
    byte (.txt, .jsonl) or row group (.parquet) where a piece starts, "line": the number of its
    first line (from 1) or row (from 0)}."""

    FIRST_LINE = {"txt": 1, "jsonl": 1, "parquet": 0}

    def __init__(self, inputs: list[Input], text_field: str):
        self.inputs = inputs
        self.text_field = text_field
        self.identity = {"inputs": [inp.identity() for inp in inputs]}
        self.name = f"--input {inputs[0].path}" + (f" and {len(inputs) - 1} more" if len(inputs) > 1 else "")

    def start(self) -> dict:
        return {"input": 0, "offset": 0, "line": 1}

    def pieces(self, position: dict) -> Iterator[tuple[int, int, int]]:
        """(input index, start, end) of each piece from `position` on."""
        for i in range(position["input"], len(self.inputs)):
            inp = self.inputs[i]
            start = position["offset"] if i == position["input"] else 0
            if inp.kind == "jsonl":
                yield from ((i, a, b) for a, b in line_ranges(inp.path, start, inp.size))
            elif inp.kind == "parquet":
                yield from ((i, group, group + 1) for group in range(start, inp.size))
            else:
                yield i, 0, inp.size

    def read(self, position: dict, num_proc: int) -> Iterator[tuple[dict, np.ndarray]]:
        """(position, tokens) of each piece from `position` on, in input order."""
        jobs = (((i, start, end), read_piece, (self.inputs[i].kind, str(self.inputs[i].path), start, end,
                                                self.text_field)) for i, start, end in self.pieces(position))
        line = position["line"]
        for (i, start, _), get in in_order(jobs, num_proc):
            inp = self.inputs[i]
            if start == 0:
                line = self.FIRST_LINE[inp.kind]
            try:
                tokens, lines = get()
            except PieceError as e:
                raise DataError(f"{inp.path}: {'row' if inp.kind == 'parquet' else 'line'} {line + e.index}: "
                                f"{e.message}") from None
            except OSError as e:  # checked at the start, but changed since
                raise DataError(f"{inp.path}: could not be read ({e})") from None
            yield {"input": i, "offset": start, "line": line}, tokens
            line += lines


class HubSource:
    """A `datasets` IterableDataset, read here and tokenized by the workers in batches. A position
    is {"state": the dataset's state_dict() before the batch (None: the beginning), "row": the
    number of the batch's first row}."""

    def __init__(self, identity: dict, open_stream: Callable, text_field: str):
        self.identity = identity
        self.open_stream = open_stream  # () -> IterableDataset, opened only when read
        self.text_field = text_field
        self.name = " ".join(str(v) for v in identity.values())

    def start(self) -> dict:
        return {"state": None, "row": 0}

    def batches(self, stream, position: dict) -> Iterator[tuple[dict, Callable, tuple]]:
        rows = iter(stream)
        state, row = position["state"], position["row"]
        while batch := list(itertools.islice(rows, HUB_BATCH_DOCS)):
            texts = [record.get(self.text_field) for record in batch]
            for index, text in enumerate(texts):
                if not isinstance(text, str):
                    what = "missing" if self.text_field not in batch[index] else f"{type(text).__name__}, not a string"
                    raise DataError(f"{self.name}: row {row + index}: {self.text_field!r} is {what}")
            yield {"state": state, "row": row}, tokenize_texts, (texts,)
            # a fresh copy each time, JSON-shaped: it goes into the progress record as it is
            state, row = json.loads(json.dumps(stream.state_dict())), row + len(texts)

    def read(self, position: dict, num_proc: int) -> Iterator[tuple[dict, np.ndarray]]:
        stream = self.open_stream()
        if position["state"] is not None:
            stream.load_state_dict(position["state"])
        for key, get in in_order(self.batches(stream, position), num_proc):
            yield key, get()


HUB_PROBE_TIMEOUT_S = 10.0  # one request, no retries: a Hub that does not answer in this long is unreachable
OFFLINE_ROUTE = ("offline, tokenize local copies instead: --input FILE.parquet ... (FineWeb-Edu's parquet files, "
                 "fetched on a machine with internet), or .jsonl/.txt files")


def check_hub_reachable(dataset: str, timeout: float = HUB_PROBE_TIMEOUT_S) -> None:
    """One request to the Hub (HF_ENDPOINT, through the proxy settings of the environment, as `datasets` uses
    them); a DataError naming the offline route when it cannot be made. `datasets` itself retries an unreachable
    Hub with backoff for about half a minute, a screen of retry lines, before failing."""
    import urllib.error
    import urllib.request

    if any(os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")
           for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        raise DataError(f"--dataset {dataset}: streaming needs the Hugging Face Hub, and HF_HUB_OFFLINE or "
                        f"HF_DATASETS_OFFLINE is set; {OFFLINE_ROUTE}")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return  # it answered (any status): reachable; what the dataset needs is `datasets`' to check
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise DataError(f"--dataset {dataset}: cannot reach the Hugging Face Hub at {endpoint} "
                        f"({getattr(reason, 'strerror', None) or reason}); {OFFLINE_ROUTE}") from None


def hub_stream(dataset: str, subset: str):
    try:
        from datasets import load_dataset
    except ImportError:
        raise ConfigError("streaming from the Hub needs the `datasets` package (pip install datasets); "
                          "--input reads local files without it") from None
    try:
        return load_dataset(dataset, name=subset, split="train", streaming=True)
    except Exception as e:  # noqa: BLE001 - a wrong name, no network, no access: one line, not a traceback
        raise DataError(f"--dataset {dataset} --subset {subset}: cannot stream it from the Hub "
                        f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None


# --- the prep: folder checks, shards, progress, manifest -------------------------------------------

def differences(old: dict, new: dict) -> str:
    """What differs between two runs' records, for the refusal message."""
    settings = old.get("settings", {})
    said = [f"{key} {settings.get(key)} -> {value}" for key, value in new["settings"].items()
            if settings.get(key) != value]
    if old.get("source") != new["source"]:
        said.append("other inputs (or inputs changed since)")
    if old.get("tokenizer_sha256") != new["tokenizer_sha256"]:
        said.append("another tokenizer")
    return ", ".join(said)


def start_or_resume(out: Path, prefix: str, run: dict, overwrite: bool) -> dict:
    """The progress record to start from: that of an interrupted run of this same command, or a
    fresh one (written at once, so that any shard in the folder has a record saying whose it is)."""
    existing = prep_files(out, prefix)
    if overwrite or not any(p.name.endswith(".npy") for p in existing):
        for path in existing:  # with no shard, bookkeeping files (of a run that stopped early) guard nothing
            path.unlink()
        existing = []
    progress = progress_path(out, prefix)
    if manifest_path(out, prefix) in existing:
        raise ConfigError(f"--out {out}: holds a finished prep ({manifest_path(out, prefix).name}); "
                          f"pass --overwrite to replace it, or choose another --out or --prefix")
    if progress in existing:
        record = read_json(progress)
        if not {"run", "shards", "position", "skip"} <= record.keys():
            raise DataError(f"{progress}: not a progress record; pass --overwrite to start again")
        if record["run"] != run:
            raise ConfigError(f"--out {out}: holds an unfinished prep of another command "
                              f"({differences(record['run'], run)}); run that command to finish it, "
                              f"or pass --overwrite to replace it")
        for shard in record["shards"]:
            path = out / shard["name"]
            if not path.is_file() or open_shard(path).size != shard["tokens"]:
                raise DataError(f"{path}: missing or changed since {progress.name} recorded it; "
                                f"pass --overwrite to start again")
        print(f"continuing the interrupted prep in {out}: {len(record['shards'])} shards already written")
        return record
    if existing:
        raise ConfigError(f"--out {out}: holds {len(existing)} files of prefix {prefix!r} from another run "
                          f"({existing[0].name}, ...); pass --overwrite to replace them, "
                          f"or choose another --out or --prefix")
    record = {"format": MANIFEST_FORMAT, "run": run, "shards": [], "position": None, "skip": 0}
    write_json_atomic(progress, record)
    return record


def prepare(source, out: Path, prefix: str, settings: dict, num_proc: int, overwrite: bool = False,
            show_progress: bool = True) -> list[dict]:
    """Tokenize `source` into shards in `out`, continuing an interrupted run; the shard records.

    `settings` holds shard_size, val_size (None: the default), text_field and max_tokens. Where
    shards begin and end depends on the token stream alone, so a run continued from a progress
    record (a piece's position + how many of its tokens are already in shards) writes the same
    bytes.
    """
    created = not out.exists()  # removed again by a failure before the first shard
    out.mkdir(parents=True, exist_ok=True)
    run = json.loads(json.dumps({"source": source.identity, "settings": {"prefix": prefix, **settings},
                                 "tokenizer_sha256": BPE_RANKS_SHA256}))  # as it reads back from JSON
    record = start_or_resume(out, prefix, run, overwrite)
    if others := sorted(set(shard_files(out)) - set(prep_files(out, prefix))):
        print_warning(f"{out} also holds shards of another prefix ({others[0].name}, ...); "
                      f"the trainer reads every *_train_*.npy and *_val_*.npy in it")

    shards = record["shards"]
    done = sum(s["tokens"] for s in shards)  # stream offset of the first token not in a shard
    pending = deque()  # (position, stream offset, tokens) of the pieces read but not wholly in shards

    def on_shard(path: Path, tokens: np.ndarray) -> None:
        nonlocal done
        shards.append(shard_record(path, tokens))
        done += tokens.size
        while len(pending) > 1 and pending[0][1] + pending[0][2] <= done:
            pending.popleft()
        position, offset, _ = pending[0]
        write_json_atomic(progress_path(out, prefix), {**record, "shards": shards, "position": position,
                                                       "skip": done - offset})

    from tqdm import tqdm

    writer = ShardWriter(out, prefix, settings["shard_size"], settings["val_size"], first_index=len(shards),
                         on_shard=on_shard)
    resume_at, max_tokens = done, settings["max_tokens"]
    offset = done - record["skip"]  # stream offset of the first token of the first piece read
    # disable=None: tqdm draws only where stderr is a terminal; a log file would keep each redraw
    bar = tqdm(desc=f"tokenizing into {out}", unit="tok", unit_scale=True, initial=done, dynamic_ncols=True,
               disable=None if show_progress else True)
    try:
        # closing(): an error stops the worker processes before it is reported
        with bar, contextlib.closing(source.read(record["position"] or source.start(), num_proc)) as pieces:
            for position, tokens in pieces:
                pending.append((position, offset, tokens.size))
                new = tokens[max(0, resume_at - offset) : max_tokens - offset if max_tokens else None]
                writer.add(new)  # the tokens at stream offsets [resume_at, max_tokens)
                offset += tokens.size
                bar.update(new.size)
                bar.set_postfix(shards=len(shards))
                if max_tokens and offset >= max_tokens:
                    break
            writer.close()
        if not shards:
            raise DataError(f"{source.name}: no documents; nothing was written")
    except BaseException:  # Ctrl-C too
        if not shards:  # nothing to continue from: leave no progress record that looks like a prep under way
            progress_path(out, prefix).unlink(missing_ok=True)
            if created and not any(out.iterdir()):
                out.rmdir()
        raise
    write_manifest(out, prefix, source.identity, run["settings"], BPE_RANKS_SHA256, shards)
    progress_path(out, prefix).unlink()  # after the manifest: a folder always has one or the other
    return shards


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="prep/fineweb.py", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", metavar="FILE", type=path_argument,
                        help="local .txt/.md/.py/.jsonl/.json/.parquet files instead of the Hub")
    parser.add_argument("--out", default=None, type=path_argument,
                        help="output folder (default data/edu_fineweb10B, or data/local with --input)")
    parser.add_argument("--prefix", default=None, help="shard name prefix (default edufineweb, or local with --input)")
    parser.add_argument("--shard_size", type=int, default=100_000_000, help="tokens per train shard (default 100M)")
    parser.add_argument("--val_size", type=int, default=None,
                        help="most tokens in the val shard, which holds whole documents: it ends at the last "
                             "document start within them (a first document longer than that is an error); default "
                             "shard_size, or about 10%% of a corpus smaller than that")
    parser.add_argument("--num_proc", type=int, default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                        else os.cpu_count() or 1, help="tokenizer processes (default: one per core)")
    parser.add_argument("--text_field", default="text", help="field holding the document text")
    parser.add_argument("--dataset", default=HUB_DATASET, help="Hub dataset (without --input)")
    parser.add_argument("--subset", default=HUB_SUBSET, help="Hub dataset config name (without --input)")
    parser.add_argument("--max_tokens", type=int, default=0, help="stop after this many tokens (0 = all)")
    parser.add_argument("--overwrite", action="store_true",
                        help="first delete this prefix's shards, progress and manifest in --out")
    args = parser.parse_args(argv)
    for name in ("shard_size", "val_size", "num_proc"):
        require(getattr(args, name) is None or getattr(args, name) > 0, f"--{name}",
                f"must be positive, got {getattr(args, name)}")
    require(args.max_tokens >= 0, "--max_tokens", f"must be 0 (all) or positive, got {args.max_tokens}")

    if args.input:
        out = Path(args.out or REPO / "data" / "local")
        prefix = args.prefix or "local"
        source = LocalSource(check_inputs(args.input, args.text_field), args.text_field)
    else:
        check_hub_reachable(args.dataset)  # before anything is written: offline, at once, not after retries
        out = Path(args.out or REPO / "data" / "edu_fineweb10B")
        prefix = args.prefix or "edufineweb"
        source = HubSource({"dataset": args.dataset, "subset": args.subset},
                           functools.partial(hub_stream, args.dataset, args.subset), args.text_field)
    settings = {"shard_size": args.shard_size, "val_size": args.val_size, "text_field": args.text_field,
                "max_tokens": args.max_tokens}
    shards = prepare(source, out, prefix, settings, args.num_proc, args.overwrite)
    total = sum(s["tokens"] for s in shards)
    print(f"wrote {total:,} tokens, {sum(s['documents'] for s in shards):,} documents in {len(shards)} shards "
          f"({shards[0]['name']} is val, {shards[0]['tokens']:,} tokens) to {out}")
    if len(shards) == 1:
        print_warning(f"no train shard was written: all {total:,} tokens went to the val shard "
                      f"(--val_size {args.val_size or args.shard_size}); lower --val_size or add data")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
