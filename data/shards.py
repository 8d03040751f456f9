"""Token shards: uint16 `.npy` files named `{prefix}_{split}_{index:06d}.npy`.

numpy's own header carries dtype and length, so a shard is readable with `np.load` alone and
memory-maps for free. Index 000000 is the val split by convention of the prep scripts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np

from common.atomic_file import atomic_write
from data.tokenizer import EOT_TOKEN
from common.errors import DataError

SHARD_DTYPE = np.uint16  # GPT-2 ids are < 50257 < 2**16
SMALL_CORPUS_VAL_FRACTION = 0.1  # share of a corpus smaller than one shard that goes to val


SPLITS = ("val", "train")


def shard_name(prefix: str, split: str, index: int) -> str:
    return f"{prefix}_{split}_{index:06d}.npy"


def shard_glob(split: str) -> str:
    """The pattern of a split's shards in a folder, whatever their prefix: what the trainer reads."""
    return f"*_{split}_*.npy"


def shard_files(data_dir: str | os.PathLike, *splits: str) -> list[Path]:
    """The shards of the given splits (default: both) in a folder, sorted by name; none for a missing folder."""
    return sorted({path for split in splits or SPLITS for path in Path(data_dir).glob(shard_glob(split))})


def write_shard(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Write a shard atomically (temp file + rename) so a killed prep never leaves half a shard."""
    if tokens.dtype != SHARD_DTYPE or tokens.ndim != 1:
        raise ValueError(f"{path}: shards hold a 1-D uint16 array, got {tokens.dtype} {tokens.shape}")
    with atomic_write(path, "wb") as f:
        np.save(f, tokens, allow_pickle=False)


def open_shard(path: str | os.PathLike) -> np.ndarray:
    """Memory-map a shard and check its header: uint16, 1-D, non-empty."""
    path = Path(path)
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"{path}: not a readable .npy token shard ({e})") from None
    if not isinstance(tokens, np.ndarray) or tokens.dtype != SHARD_DTYPE:
        raise DataError(f"{path}: token shards must be uint16, found {getattr(tokens, 'dtype', type(tokens))}")
    if tokens.ndim != 1:
        raise DataError(f"{path}: token shards must be 1-D, found shape {tokens.shape}")
    if tokens.size == 0:
        raise DataError(f"{path}: empty token shard")
    return tokens


def check_token_range(path: str | os.PathLike, vocab_size: int, chunk: int = 1 << 24) -> None:
    """Scan a shard for ids >= vocab_size (chunked, so a 100M-token shard never sits in RAM)."""
    tokens = open_shard(path)
    for start in range(0, tokens.size, chunk):
        top = int(tokens[start : start + chunk].max())
        if top >= vocab_size:
            where = start + int(np.argmax(tokens[start : start + chunk] >= vocab_size))
            raise DataError(
                f"{path}: token id {int(tokens[where])} at position {where} is out of range "
                f"for vocab_size {vocab_size}"
            )


def find_shards(data_dir: str | os.PathLike, split: str, key: str = "data_dir") -> list[Path]:
    """The shards of one split, sorted by name; a clear error naming `key` (the config key that named the
    folder: data_dir, or val_sets) when there are none."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"{key} {data_dir}: no such directory (prepare data first, e.g. `python prep/fineweb.py`)")
    shards = shard_files(data_dir, split)
    if not shards:
        unfinished = sorted(data_dir.glob("*_progress.json"))  # data/manifest.py's record of a prep under way
        hint = (f"a prep into it has not finished ({unfinished[0].name}): run its command again to continue it"
                if unfinished else "prepare data first, e.g. `python prep/fineweb.py`")
        raise DataError(f"{key} {data_dir}: no {split} shards ({shard_glob(split)}); {hint}")
    return shards



def val_shards(location: str | os.PathLike, key: str = "data_dir") -> list[Path]:
    """The shards of a val set: the one val shard file `location` names, or its folder's val split (find_shards);
    a clear error naming `key` (data_dir, or val_sets) when it names neither."""
    location = Path(location)
    if not location.exists():
        raise DataError(f"{key} {location}: no such folder or val shard file")
    return [location] if location.is_file() else find_shards(location, "val", key)


class ShardWriter:
    """Packs a stream of documents' tokens into shards: index 0 is the val split, then train.

    Every document starts with <|endoftext|> (EOT_TOKEN), which is how the writer sees where
    documents begin. The val shard holds whole documents only, so no document is in both
    splits: it ends at the last document start within `val_size` tokens, so it holds at most
    `val_size` tokens (a first document longer than that is a DataError naming --val_size: no
    whole document fits). Train shards are exactly
    `shard_size` tokens (the last one shorter) and may split a document between two train
    shards; the loader reads them as one stream.

    `val_size=None` means "as much as a train shard" (`shard_size`) for a large corpus; a corpus
    that ends before that much is read is split at the document start nearest to
    `SMALL_CORPUS_VAL_FRACTION` of its tokens instead, so a small corpus still gets train data.

    Tokens go into one preallocated uint16 buffer (never a list of Python ints); it only grows
    while a first document longer than the val shard is being read (to say how long it is). `on_shard(path, tokens)` is
    called after each shard is on disk (resumable preps record their progress there);
    `first_index > 0` continues a prep whose shards 0 .. first_index-1 are already written.
    """

    def __init__(self, out_dir: str | os.PathLike, prefix: str, shard_size: int, val_size: int | None = None,
                 first_index: int = 0, on_shard: Callable[[Path, np.ndarray], None] | None = None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.shard_size = shard_size
        self.val_size = val_size or shard_size
        self.split_small_corpus = val_size is None
        self.on_shard = on_shard
        self.index = first_index
        self.buffer = np.empty(max(self.shard_size, self.val_size), dtype=SHARD_DTYPE)
        self.filled = 0
        self.val_end = 0  # the last document start in (0, val_size] seen so far; 0 = none yet
        self.written: list[Path] = []
        self.total_tokens = 0  # tokens in the shards this writer wrote

    def add(self, tokens: np.ndarray) -> None:
        """Append the next tokens of the stream (any cut: whole documents or not)."""
        if self.index == 0:
            self._add_val(tokens)
        else:
            self._add_train(tokens)

    def _add_val(self, tokens: np.ndarray) -> None:
        if self.filled + tokens.size > self.buffer.size:  # a first document longer than the val shard
            grown = np.empty(max(2 * self.buffer.size, self.filled + tokens.size), dtype=SHARD_DTYPE)
            grown[: self.filled] = self.buffer[: self.filled]
            self.buffer = grown
        base = self.filled
        self.buffer[base : base + tokens.size] = tokens
        self.filled += tokens.size
        starts = np.flatnonzero(tokens == EOT_TOKEN) + base  # document starts, as buffer positions
        starts = starts[starts > 0]
        within = starts[starts <= self.val_size]
        if within.size:
            self.val_end = int(within[-1])
        if self.filled <= self.val_size:
            return  # a document may still start at or before val_size
        if self.val_end:
            self._end_val(self.val_end)
        elif (starts > self.val_size).any():  # the first document alone is longer than val_size
            raise self._first_document_too_long(int(starts[starts > self.val_size][0]))

    def _first_document_too_long(self, length: int) -> DataError:
        return DataError(f"--val_size {self.val_size}: the first document is {length:,} tokens long, and the val "
                         f"shard holds whole documents only (no document is in both splits); raise --val_size to "
                         f"at least {length}, or put a shorter document first")

    def _end_val(self, end: int) -> None:
        """Write buffer[:end] as the val shard; the tokens after it start the train split."""
        rest = self.buffer[end : self.filled].copy()
        self.filled = end
        self._flush()
        self.buffer = np.empty(self.shard_size, dtype=SHARD_DTYPE)
        self._add_train(rest)

    def _add_train(self, tokens: np.ndarray) -> None:
        while tokens.size:
            take = min(tokens.size, self.shard_size - self.filled)
            self.buffer[self.filled : self.filled + take] = tokens[:take]
            self.filled += take
            tokens = tokens[take:]
            if self.filled == self.shard_size:
                self._flush()

    def _flush(self) -> None:
        split = "val" if self.index == 0 else "train"
        path = self.out_dir / shard_name(self.prefix, split, self.index)
        tokens = self.buffer[: self.filled]
        write_shard(path, tokens)
        if self.on_shard:
            self.on_shard(path, tokens)
        self.written.append(path)
        self.total_tokens += self.filled
        self.index += 1
        self.filled = 0

    def close(self) -> list[Path]:
        """Write what is buffered (the val shard too if the stream ended inside it); every shard written."""
        if self.index == 0 and self.filled:
            end = self.filled
            if self.filled > self.val_size:  # one document, longer than val_size: it cannot be split
                raise self._first_document_too_long(self.filled)
            if self.split_small_corpus:
                starts = np.flatnonzero(self.buffer[1 : self.filled] == EOT_TOKEN) + 1
                if starts.size:  # the document start nearest the target share; at least one document in val
                    end = int(starts[np.argmin(np.abs(starts - SMALL_CORPUS_VAL_FRACTION * self.filled))])
            self._end_val(end)
        if self.filled:
            self._flush()
        return self.written
