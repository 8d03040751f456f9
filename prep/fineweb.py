"""Tokenize FineWeb-Edu (or local text) into uint16 token shards for train_gpt2.py.

    python prep/fineweb.py                                   # FineWeb-Edu sample-10BT -> data/edu_fineweb10B/
    python prep/fineweb.py --input a.txt b.jsonl c.parquet --out data/mycorpus

FineWeb-Edu is streamed from the Hugging Face Hub with the `datasets` library, so no 30 GB
download cache is needed. Local files go through `datasets` too: `.txt` (one document per
file), `.jsonl` / `.json` (one document per line, in the `text` field) and `.parquet` (a
`text` column). Every document becomes <|endoftext|> + its tokens; shards of --shard_size
tokens are written as `{prefix}_{split}_{index:06d}.npy`, index 000000 being the val split.

Documents are tokenized by a pool of worker processes in bounded batches (memory stays flat
however large the corpus) and written in input order, so the same input gives the same bytes.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: make `data` importable

from data.shards import ShardWriter  # noqa: E402
from data.tokenizer import tokenize_document  # noqa: E402

HUB_DATASET = "HuggingFaceFW/fineweb-edu"
HUB_SUBSET = "sample-10BT"
LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def hub_documents(dataset: str, subset: str, text_field: str):
    from datasets import load_dataset

    stream = load_dataset(dataset, name=subset, split="train", streaming=True)
    return (row[text_field] for row in stream)


def local_documents(paths: list[str], text_field: str):
    """Documents of local files in the order given, each file read by its datasets builder."""
    from datasets import load_dataset

    for path in paths:
        suffix = Path(path).suffix.lower()
        if suffix not in LOCAL_BUILDERS:
            raise SystemExit(f"error: {path}: unsupported input type {suffix!r} (use .txt, .jsonl, .json or .parquet)")
        if not Path(path).is_file():
            raise SystemExit(f"error: {path}: no such file")
        builder = LOCAL_BUILDERS[suffix]
        extra = {"sample_by": "document"} if builder == "text" else {}
        stream = load_dataset(builder, data_files=[str(path)], split="train", streaming=True, **extra)
        for row in stream:
            if text_field not in row:
                raise SystemExit(f"error: {path}: records have no {text_field!r} field")
            yield row[text_field]


def tokenize_batch(texts: list[str]) -> np.ndarray:
    """Concatenated <|endoftext|>-prefixed tokens of several documents (one pickle per batch)."""
    return np.concatenate([tokenize_document(t) for t in texts])


def tokenized_batches(documents, num_proc: int, batch_docs: int = 256):
    """Token arrays of consecutive batches of documents, in input order.

    At most 2 * num_proc batches are in flight, so a fast stream never piles up in memory.
    """
    batches = iter(lambda: list(itertools.islice(documents, batch_docs)), [])
    if num_proc <= 1:
        yield from map(tokenize_batch, batches)
        return
    # spawn works everywhere (macOS, Windows, CUDA-initialised parents); workers import this module
    with mp.get_context("spawn").Pool(num_proc) as pool:
        in_flight = collections.deque()
        for batch in batches:
            in_flight.append(pool.apply_async(tokenize_batch, (batch,)))
            if len(in_flight) >= 2 * num_proc:
                yield in_flight.popleft().get()
        while in_flight:
            yield in_flight.popleft().get()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", metavar="FILE", help="local .txt/.jsonl/.json/.parquet files instead of the Hub")
    parser.add_argument("--out", default=None, help="output folder (default data/edu_fineweb10B, or data/local with --input)")
    parser.add_argument("--prefix", default=None, help="shard name prefix (default edufineweb, or local with --input)")
    parser.add_argument("--shard_size", type=int, default=100_000_000, help="tokens per shard (default 100M)")
    parser.add_argument("--val_size", type=int, default=None, help="tokens in the val shard (default shard_size)")
    parser.add_argument("--num_proc", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="tokenizer processes")
    parser.add_argument("--text_field", default="text", help="field holding the document text")
    parser.add_argument("--dataset", default=HUB_DATASET, help="Hub dataset (without --input)")
    parser.add_argument("--subset", default=HUB_SUBSET, help="Hub dataset config name (without --input)")
    parser.add_argument("--max_tokens", type=int, default=0, help="stop after about this many tokens (0 = all)")
    args = parser.parse_args(argv)
    if args.shard_size <= 0 or (args.val_size is not None and args.val_size <= 0):
        raise SystemExit("error: --shard_size and --val_size must be positive")

    if args.input:
        out = Path(args.out or REPO / "data" / "local")
        prefix = args.prefix or "local"
        documents = local_documents(args.input, args.text_field)
    else:
        out = Path(args.out or REPO / "data" / "edu_fineweb10B")
        prefix = args.prefix or "edufineweb"
        documents = hub_documents(args.dataset, args.subset, args.text_field)

    from tqdm import tqdm

    writer = ShardWriter(out, prefix, args.shard_size, val_size=args.val_size)
    start = time.time()
    seen = 0
    with tqdm(unit="tok", unit_scale=True, desc=f"tokenizing into {out}", dynamic_ncols=True) as progress:
        for tokens in tokenized_batches(documents, args.num_proc):
            writer.add(tokens)
            seen += tokens.size
            progress.update(tokens.size)
            progress.set_postfix(shards=len(writer.written), tok_per_s=f"{seen / max(time.time() - start, 1e-9):,.0f}")
            if args.max_tokens and seen >= args.max_tokens:
                break
    shards = writer.close()
    if not shards:
        raise SystemExit("error: the input holds no documents; nothing was written")
    print(f"wrote {writer.total_tokens:,} tokens in {len(shards)} shards ({shards[0].name} is val) to {out}")


if __name__ == "__main__":
    main()
