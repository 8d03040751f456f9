"""Token shards: uint16 `.npy` files named `{prefix}_{split}_{index:06d}.npy`.

numpy's own header carries dtype and length, so a shard is readable with `np.load` alone and
memory-maps for free. Index 000000 is the val split by convention of the prep scripts.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from errors import DataError

SHARD_DTYPE = np.uint16  # GPT-2 ids are < 50257 < 2**16


def shard_name(prefix: str, split: str, index: int) -> str:
    return f"{prefix}_{split}_{index:06d}.npy"


def write_shard(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Write a shard atomically (temp file + rename) so a killed prep never leaves half a shard."""
    if tokens.dtype != SHARD_DTYPE or tokens.ndim != 1:
        raise ValueError(f"{path}: shards hold a 1-D uint16 array, got {tokens.dtype} {tokens.shape}")
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, tokens, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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


def find_shards(data_dir: str | os.PathLike, split: str) -> list[Path]:
    """The shards of one split, sorted by name; a clear error when there are none."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"data_dir {data_dir}: no such directory (prepare data first, e.g. `python prep/fineweb.py`)")
    shards = sorted(data_dir.glob(f"*_{split}_*.npy"))
    if not shards:
        raise DataError(f"data_dir {data_dir}: no {split} shards (*_{split}_*.npy)")
    return shards


class ShardWriter:
    """Packs documents' tokens into fixed-size shards: index 0 is the val split, then train.

    Tokens go into one preallocated uint16 buffer (never a list of Python ints); a document
    that does not fit is split, its remainder starting the next shard.
    """

    def __init__(self, out_dir: str | os.PathLike, prefix: str, shard_size: int, val_size: int | None = None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.shard_size = shard_size
        self.val_size = val_size or shard_size
        self.index = 0
        self.buffer = np.empty(max(self.shard_size, self.val_size), dtype=SHARD_DTYPE)
        self.filled = 0
        self.written: list[Path] = []
        self.total_tokens = 0

    @property
    def capacity(self) -> int:
        return self.val_size if self.index == 0 else self.shard_size

    def add(self, tokens: np.ndarray) -> None:
        while tokens.size:
            take = min(tokens.size, self.capacity - self.filled)
            self.buffer[self.filled : self.filled + take] = tokens[:take]
            self.filled += take
            tokens = tokens[take:]
            if self.filled == self.capacity:
                self._flush()

    def _flush(self) -> None:
        split = "val" if self.index == 0 else "train"
        path = self.out_dir / shard_name(self.prefix, split, self.index)
        write_shard(path, self.buffer[: self.filled].copy())
        self.written.append(path)
        self.total_tokens += self.filled
        self.index += 1
        self.filled = 0

    def close(self) -> list[Path]:
        """Write the last partial shard; returns every shard written."""
        if self.filled:
            self._flush()
        return self.written
