"""Rank-strided, world-size independent train loader and the fixed val window reader.

The train split is one global sequence of rows. Row j of a shard is its tokens
[j*T, j*T + T] (T+1 tokens: inputs and the targets shifted by one); rows never straddle a
shard boundary, and only each shard's final partial row is skipped. Rows are numbered through
the shards in order, so optimizer step s consumes global rows [s*R, (s+1)*R) with
R = total_batch_size / T, and micro-step k of rank r reads the B rows starting at
s*R + (k*W + r)*B. That makes the position a pure function of the step: resuming needs the
step alone, and may change the world size W or the micro-batch B.

Consecutive rows overlap by one token, so B consecutive rows of one shard are the single
slice [j*T, (j+B)*T] and read as one copy.

With `doc_aligned`, every row starts at a document's first token (the <|endoftext|> our
shards put before each document), packed greedily: a row takes T+1 tokens from a document
start, and the next row begins at the first document that starts at or after its end. A
document longer than a row is cut there and the rest of it is passed over (modded-nanogpt's
choice: no row begins mid-document); `coverage` says what share of the tokens rows still use.

By default epoch 0 reads the shards in order and later epochs in a shard order seeded by
(seed, epoch), as build-nanogpt reads FineWeb. With `shuffle`, every epoch reads the rows
themselves in an order seeded by (seed, epoch): global row j of epoch e is the row
permutation_e[j]. The position is still a pure function of the step, on any world size.

The loaders' `rank` r and `world_size` W are the data-parallel ones, the strategy's dp_rank and
dp_size (training/distributed/strategies.py): the same as the process's rank and world size wherever every
rank is its own replica, as under ddp and fsdp.
"""

from __future__ import annotations

import bisect
import queue
import threading
from pathlib import Path

import numpy as np
import torch

from common.errors import DataError
from data.settings import grad_accum_steps
from data.shards import check_token_range, find_shards, open_shard, val_shards
from data.tokenizer import EOT_TOKEN


def document_row_starts(tokens: np.ndarray, seq_len: int, doc_token: int) -> np.ndarray:
    """Where a shard's document-aligned rows start: each at a document's first token, the next
    at the first document starting at or after the previous row's end (see the module doc)."""
    docs = np.flatnonzero(np.asarray(tokens) == doc_token)
    last = len(tokens) - (seq_len + 1)  # the last start with a whole row after it
    starts, i = [], 0
    while i < len(docs) and docs[i] <= last:
        starts.append(int(docs[i]))
        i = int(np.searchsorted(docs, docs[i] + seq_len, side="left"))
    return np.array(starts, dtype=np.int64)


class RowStream:
    """Rows of T+1 tokens numbered consecutively through an ordered list of shards.

    doc_token None: row j of a shard is its tokens [j*T, j*T + T]. Otherwise rows start at
    that token's occurrences (document starts), as document_row_starts packs them.
    """

    def __init__(self, shard_paths: list[Path], seq_len: int, doc_token: int | None = None):
        self.seq_len = seq_len
        self.paths = list(shard_paths)
        self.shards = [open_shard(p) for p in self.paths]
        self.row_starts = None if doc_token is None else [document_row_starts(s, seq_len, doc_token)
                                                          for s in self.shards]
        if self.row_starts is None:
            self.rows_per_shard = [(len(s) - 1) // seq_len for s in self.shards]
        else:
            self.rows_per_shard = [len(starts) for starts in self.row_starts]
        # first global row of each shard: bisect maps a global row to its shard
        self.first_row = np.concatenate([[0], np.cumsum(self.rows_per_shard)]).tolist()
        self.num_rows = self.first_row[-1]
        # the share of the tokens that rows use (inputs; each row's last target is the next one's first input)
        self.coverage = self.num_rows * seq_len / max(1, sum(len(s) for s in self.shards))

    def reordered(self, order: list[int]) -> "RowStream":
        """The same shards in another order (epoch shuffles), sharing the memory maps."""
        other = RowStream.__new__(RowStream)
        other.seq_len = self.seq_len
        other.paths = [self.paths[i] for i in order]
        other.shards = [self.shards[i] for i in order]
        other.rows_per_shard = [self.rows_per_shard[i] for i in order]
        other.row_starts = None if self.row_starts is None else [self.row_starts[i] for i in order]
        other.coverage = self.coverage
        other.first_row = np.concatenate([[0], np.cumsum(other.rows_per_shard)]).tolist()
        other.num_rows = self.num_rows
        return other

    def read(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows [first, first+count) as inputs and targets, int64 arrays of shape (count, T)."""
        if first < 0 or first + count > self.num_rows:
            raise IndexError(f"rows [{first}, {first + count}) outside [0, {self.num_rows})")
        if self.row_starts is not None:  # document-aligned rows lie apart from each other
            return self.read_rows(range(first, first + count))
        T = self.seq_len
        x = np.empty((count, T), dtype=np.int64)
        y = np.empty((count, T), dtype=np.int64)
        done = 0
        while done < count:
            row = first + done
            shard = bisect.bisect_right(self.first_row, row) - 1
            local = row - self.first_row[shard]
            n = min(count - done, self.rows_per_shard[shard] - local)
            # n consecutive rows share their boundary tokens: one slice of n*T + 1 tokens
            span = self.shards[shard][local * T : (local + n) * T + 1]
            x[done : done + n] = span[:-1].reshape(n, T)
            y[done : done + n] = span[1:].reshape(n, T)
            done += n
        return x, y

    def read_rows(self, rows) -> tuple[np.ndarray, np.ndarray]:
        """The given global rows, in that order, as inputs and targets of shape (len(rows), T): one at a time."""
        T = self.seq_len
        x = np.empty((len(rows), T), dtype=np.int64)
        y = np.empty((len(rows), T), dtype=np.int64)
        for i, row in enumerate(rows):
            shard = bisect.bisect_right(self.first_row, row) - 1
            local = row - self.first_row[shard]
            start = local * T if self.row_starts is None else int(self.row_starts[shard][local])
            span = self.shards[shard][start : start + T + 1]
            x[i], y[i] = span[:-1], span[1:]
        return x, y


def validate_shards(paths: list[Path], vocab_size: int, rank: int, world_size: int) -> None:
    """Check every shard's header, and the token range of this rank's share of the shards.

    Raises a DataError naming the file. The caller shares it with the other ranks, so every
    rank fails the same way (no rank hangs).
    """
    for p in paths:
        open_shard(p)
    for p in paths[rank::world_size]:
        check_token_range(p, vocab_size)


ROWS_TAG = int.from_bytes(b"rows", "little")  # the row shuffles' own stream: never the same draws as a shard order


def shard_order(seed: int, epoch: int, num_shards: int, source: tuple[int, ...] = ()) -> list[int]:
    """An epoch's shard order, seeded by (seed, epoch[, source]): a mixture's sources each draw their own."""
    return np.random.default_rng([seed, epoch, *source]).permutation(num_shards).tolist()


def row_permutation(seed: int, epoch: int, num_rows: int, source: tuple[int, ...] = ()) -> np.ndarray:
    """With shuffle: an epoch's order of the train rows, seeded by (seed, epoch[, source])."""
    return np.random.default_rng([seed, epoch, *source, ROWS_TAG]).permutation(num_rows)


class TrainLoader:
    """Micro-batches of the train split as a pure function of (step, micro_step)."""

    def __init__(
        self,
        data_dir: str | Path,
        seq_len: int,
        micro_batch_size: int,
        total_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = False,
        doc_aligned: bool = False,
    ):
        self.shuffle = shuffle
        self.grad_accum_steps = grad_accum_steps(total_batch_size, seq_len, micro_batch_size, world_size)
        self.T = seq_len
        self.B = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.rows_per_step = total_batch_size // seq_len  # R
        self.paths = find_shards(data_dir, "train")
        self.stream = RowStream(self.paths, seq_len, EOT_TOKEN if doc_aligned else None)
        self.steps_per_epoch = self.stream.num_rows // self.rows_per_step
        if self.steps_per_epoch == 0:
            raise DataError(
                f"data_dir {data_dir}: the train shards hold {self.stream.num_rows} rows of "
                f"{seq_len + 1} tokens{' starting at a document (<|endoftext|>)' if doc_aligned else ''}, "
                f"fewer than one step needs ({self.rows_per_step}); lower total_batch_size or add data"
            )
        self._epoch_streams = {0: self.stream}
        self._permutation: tuple[int, np.ndarray] | None = None  # (epoch, its row order), with shuffle

    def summary(self) -> str:
        """The startup line's account of the data."""
        coverage = f", starting at documents: {self.stream.coverage:.0%} of the tokens" \
            if self.stream.row_starts is not None else ""
        return f"{self.stream.num_rows:,} train rows ({self.steps_per_epoch} steps/epoch{coverage})"

    def tokens_by_source(self, steps: int) -> dict[str, int]:
        """One folder: no sources to count apart (data/mixture.py's MixtureLoader counts them)."""
        return {}

    def row_order(self, epoch: int) -> np.ndarray:
        """With shuffle: the epoch's order of the train rows, a permutation seeded by (seed, epoch)."""
        if self._permutation is None or self._permutation[0] != epoch:
            self._permutation = (epoch, row_permutation(self.seed, epoch, self.stream.num_rows))
        return self._permutation[1]

    def epoch_stream(self, epoch: int) -> RowStream:
        """Epoch 0 reads the shards in order; later epochs in an order seeded by (seed, epoch)."""
        if epoch not in self._epoch_streams:
            order = shard_order(self.seed, epoch, len(self.paths))
            self._epoch_streams = {0: self.stream, epoch: self.stream.reordered(order)}
        return self._epoch_streams[epoch]

    def step_start(self, step: int, rows_per_step: int | None = None) -> tuple[int, int]:
        """(epoch, first row within that epoch) of a step's R rows; rows_per_step: another R than this loader's
        (where a run of another total_batch_size stood: launch/resume.py)."""
        rows = rows_per_step or self.rows_per_step
        epoch, step_in_epoch = divmod(step, self.stream.num_rows // rows)
        return epoch, step_in_epoch * rows

    def first_row(self, step: int, micro_step: int) -> tuple[int, int]:
        """(epoch, first global row within that epoch) of this rank's micro-batch."""
        epoch, first = self.step_start(step)
        return epoch, first + (micro_step * self.world_size + self.rank) * self.B

    def micro_batch(self, step: int, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of shape (B, T), int64, on the CPU."""
        epoch, first = self.first_row(step, micro_step)
        if self.shuffle:
            x, y = self.stream.read_rows(self.row_order(epoch)[first : first + self.B].tolist())
        else:
            x, y = self.epoch_stream(epoch).read(first, self.B)
        return torch.from_numpy(x), torch.from_numpy(y)


class Prefetcher:
    """Reads the coming micro-batches of a TrainLoader on a background thread.

    The training loop asks for (step, micro_step) in order; the thread stays up to `depth`
    micro-batches ahead, so reading the memory-mapped shards (and pinning the result, for an
    asynchronous copy to the GPU) never sits on the loop's critical path. What `get` returns
    is exactly `loader.micro_batch(step, micro_step)`, moved to `device`.

    `get` never waits forever: an error in the thread is raised by `get`, asking past the last
    step raises too (the thread leaves an end marker), and a thread that is gone is noticed.
    """

    _END = (None, None, None, None)

    def __init__(self, loader: TrainLoader, start_step: int, end_step: int, device: torch.device, depth: int = 4):
        self.loader = loader
        self.device = device
        self.pin = device.type == "cuda"
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        keys = ((s, k) for s in range(start_step, end_step) for k in range(loader.grad_accum_steps))
        self._thread = threading.Thread(target=self._produce, args=(keys,), name="prefetch", daemon=True)
        self._thread.start()

    def _produce(self, keys) -> None:
        try:
            for key in keys:
                x, y = self.loader.micro_batch(*key)
                if self.pin:
                    x, y = x.pin_memory(), y.pin_memory()
                if not self._put((key, x, y, None)):
                    return
            self._put(self._END)
        except BaseException as e:  # noqa: BLE001 - surfaced to the training loop by get()
            self._put((None, None, None, e))

    def _put(self, item) -> bool:
        """Queue item unless close() was called meanwhile; whether it was queued."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def get(self, step: int, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (B, T) inputs and targets of this micro-step, on the device (copy not awaited)."""
        while True:
            try:
                key, x, y, error = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError(f"prefetch thread ended before batch {(step, micro_step)}") from None
        if error is not None:
            raise error
        if key is None:
            raise RuntimeError(f"no batch {(step, micro_step)}: the prefetcher's steps are done")
        if key != (step, micro_step):
            raise RuntimeError(f"prefetcher out of order: asked for {(step, micro_step)}, had {key}")
        return x.to(self.device, non_blocking=self.pin), y.to(self.device, non_blocking=self.pin)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class ValLoader:
    """The first `val_tokens // T` rows of the val split (a folder's *_val_*.npy, or one val shard file),
    in fixed batches shared out to ranks.

    Batch i is always rows [i*B, (i+1)*B) (the last one shorter), whatever the world size, and
    rank r scores batches r, r + W, r + 2W, ... Each batch is therefore computed on the same
    rows with the same shapes on any number of ranks, which is what lets the val loss be the
    very same number for every world size (see evals/val_loss.py).
    """

    def __init__(self, data_dir: str | Path, seq_len: int, val_tokens: int, batch_size: int,
                 rank: int = 0, world_size: int = 1, key: str = "data_dir"):
        # key: the config key that named the folder or file (data_dir, or val_sets), for the errors
        self.paths = val_shards(data_dir, key)
        self.stream = RowStream(self.paths, seq_len)
        self.num_rows = val_tokens // seq_len
        if self.num_rows < 1:
            raise DataError(f"val_tokens {val_tokens} is less than one row of seq_len {seq_len}")
        if self.num_rows > self.stream.num_rows:
            raise DataError(
                f"{data_dir}: the val shards hold {self.stream.num_rows} rows of "
                f"{seq_len + 1} tokens, fewer than val_tokens {val_tokens} needs ({self.num_rows}); "
                f"lower val_tokens"
            )
        self.batch_size = batch_size
        self.num_batches = -(-self.num_rows // batch_size)
        self.rank = rank
        self.world_size = world_size

    @property
    def batches_per_rank(self) -> int:
        """The most batches any rank scores (rank 0's share)."""
        return -(-self.num_batches // self.world_size)

    def target_bytes(self, byte_lengths: np.ndarray, rows_at_once: int = 1024) -> int:
        """The bytes of text the whole window's targets stand for (every row, whatever this rank
        scores): byte_lengths[id] summed over the targets y of rows [0, num_rows). The same on
        every rank; bits per byte divides by it (evals/val_loss.py)."""
        total = 0
        for first in range(0, self.num_rows, rows_at_once):
            _, y = self.stream.read(first, min(rows_at_once, self.num_rows - first))  # (n, T) each
            total += int(byte_lengths[y].sum())
        return total

    def batches(self):
        """Yield (batch index, x, y), x and y of shape (b, T) with b <= batch_size: this rank's batches."""
        for index in range(self.rank, self.num_batches, self.world_size):
            first = index * self.batch_size
            x, y = self.stream.read(first, min(self.batch_size, self.num_rows - first))
            yield index, torch.from_numpy(x), torch.from_numpy(y)
