"""Several token folders mixed by weight into one train stream, and the named val sets.

data_dir names one folder (data/loader.py's TrainLoader reads it) or several with weights:

    data_dir: {data/edu: 0.7, data/code: 0.3}        # YAML
    --data_dir data/edu:0.7,data/code:0.3            # the command line (the YAML form is stored so)

Each source is named by its folder's last part (edu, code). Every optimizer step reads the same
number of rows from each source: the step's R rows are split by the largest remainder of
weight * R (so 0.7 of 512 rows is 358 and 0.3 is 154: 69.9% and 30.1%, said at start-up), and
every source must get at least one row. Which source fills which of the step's R slots is a
permutation seeded by (seed, step), so a micro-batch mixes the sources, and the source of every
row is a pure function of (seed, step, row) and where each source stood: source k has read
r_k + n_k * (s - s0) rows before step s, and slot j of step s is its next row + (how many of step
s's earlier slots are k's). Nothing depends on the world size, so a resume is exact on any world size.

Where each source stands is state, saved with every checkpoint (`state_dict`: the rows r_k each
source has read and the tokens it has given, at that step) and resumed (`load_state_dict`), not
derived from today's weights: a resume with other weights (or another total_batch_size) goes on
from the rows each source had read, at the new n_k, and its tokens_<source> counters count on. A
fresh run starts every source at r_k = 0, s0 = 0; a checkpoint written before this state existed
is given the state its own config implies (`derived_state`: n_k * s, its weights' n_k).

A source's rows form its own endless stream, in its own epochs: epoch e of a source is all of
its rows, the shards in order for e = 0 and then in an order seeded by (seed, e, source), or
with `shuffle` the rows themselves in such an order; a source that runs out of rows starts its
next epoch (it wraps, as one folder does), whatever the others do. The realised share of each
source is its n_k / R exactly, on every step: no source is silently skewed.

val_sets names the val windows evaluated (evals/val_loss.py): by default the data_dir folder's
val split (one folder: today's `val` record), or each source's (a mixture); or explicitly

    val_sets: {edu: data/edu, wiki: data/wiki/wiki_val_000000.npy}    # YAML
    --val_sets edu=data/edu,wiki=data/wiki/wiki_val_000000.npy        # the command line

each a folder (its *_val_*.npy shards) or one val shard file.
"""

from __future__ import annotations

from typing import TypedDict

import numpy as np
import torch

from common.errors import ConfigError, DataError
from common.settings import require
from data.loader import RowStream, TrainLoader, row_permutation, shard_order
from data.manifest import data_fingerprint
from data.settings import Source, grad_accum_steps, parse_sources
from data.shards import find_shards
from data.tokenizer import EOT_TOKEN


def step_composition(weights: list[float], rows_per_step: int) -> list[int]:
    """Rows per step of each source: weight * R rounded by the largest remainder (ties to the earlier
    source), summing to R exactly."""
    total = sum(weights)
    ideal = [w / total * rows_per_step for w in weights]
    counts = [int(x) for x in ideal]
    by_remainder = sorted(range(len(weights)), key=lambda k: (-(ideal[k] - counts[k]), k))
    for k in by_remainder[: rows_per_step - sum(counts)]:
        counts[k] += 1
    return counts


class SourceStream:
    """One source's endless row stream: row q is row q % N of epoch q // N (N its rows)."""

    def __init__(self, source: Source, index: int, seq_len: int, seed: int, shuffle: bool, doc_aligned: bool):
        self.source, self.index, self.seed, self.shuffle = source, index, seed, shuffle
        self.paths = find_shards(source.path, "train")
        self.stream = RowStream(self.paths, seq_len, EOT_TOKEN if doc_aligned else None)
        self.num_rows = self.stream.num_rows
        if self.num_rows == 0:
            raise DataError(f"data_dir {source.path}: its train shards hold no row of {seq_len + 1} tokens")
        self._epoch: tuple[int, object] | None = None

    def _order(self, epoch: int):
        """The epoch's row permutation (shuffle) or its reordered stream, seeded by (seed, epoch, source)."""
        if self._epoch is None or self._epoch[0] != epoch:
            source = (1 + self.index,)  # TrainLoader's draws with the source's number appended
            if self.shuffle:
                order = row_permutation(self.seed, epoch, self.num_rows, source)
            elif epoch == 0:
                order = self.stream
            else:
                order = self.stream.reordered(shard_order(self.seed, epoch, len(self.paths), source))
            self._epoch = (epoch, order)
        return self._epoch[1]

    def rows(self, indices: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Rows q of the endless stream, in that order: inputs and targets of shape (len, T)."""
        T = self.stream.seq_len
        x = np.empty((len(indices), T), dtype=np.int64)
        y = np.empty((len(indices), T), dtype=np.int64)
        for i, q in enumerate(indices):
            epoch, row = divmod(q, self.num_rows)
            order = self._order(epoch)
            if self.shuffle:
                xi, yi = self.stream.read_rows([int(order[row])])
            else:
                xi, yi = order.read(row, 1)
            x[i], y[i] = xi[0], yi[0]
        return x, y


class SourceState(TypedDict):
    """Where one source of a mixture stands."""

    rows_read: int
    tokens: int
    rows_per_step: int


class MixtureState(TypedDict):
    """The checkpoint's mixture entry: what MixtureLoader.load_state_dict reads."""

    step: int
    position: int
    sources: dict[str, SourceState]  # by source name


class MixtureLoader:
    """Micro-batches of several sources mixed by weight, a pure function of (step, micro_step): as TrainLoader."""

    def __init__(self, sources: list[Source], seq_len: int, micro_batch_size: int, total_batch_size: int,
                 rank: int = 0, world_size: int = 1, seed: int = 0, shuffle: bool = False, doc_aligned: bool = False):
        self.grad_accum_steps = grad_accum_steps(total_batch_size, seq_len, micro_batch_size, world_size)
        self.T, self.B, self.rank, self.world_size, self.seed = seq_len, micro_batch_size, rank, world_size, seed
        self.rows_per_step = total_batch_size // seq_len  # R
        self.sources = sources
        self.counts = step_composition([s.weight for s in sources], self.rows_per_step)
        for source, count in zip(sources, self.counts):
            require(count > 0, "data_dir", f"source {source.name}'s weight {source.weight} gives it none of the "
                                           f"{self.rows_per_step} rows of a step; raise its weight or total_batch_size")
        self.streams = [SourceStream(s, k, seq_len, seed, shuffle, doc_aligned) for k, s in enumerate(sources)]
        for stream, count in zip(self.streams, self.counts):  # as one folder must hold one step's rows
            if stream.num_rows < count:
                raise DataError(f"data_dir {stream.source.path}: its train shards hold {stream.num_rows} rows of "
                                f"{seq_len + 1} tokens, fewer than its share of one step ({count} of "
                                f"{self.rows_per_step} rows): every step would read some rows twice; lower its "
                                f"weight or total_batch_size, or add data")
        self.paths = [p for stream in self.streams for p in stream.paths]
        self._step: tuple[int, np.ndarray, np.ndarray] | None = None
        # where the sources stood at data position `position` (the step whose rows come next, a rollback's
        # passed-over batches counted) and after training step `step`: rows read and tokens given, each
        # source; from there each reads its n_k rows a step. A fresh run: all zero.
        self.anchor = {"position": 0, "step": 0, "rows": [0] * len(sources), "tokens": [0] * len(sources)}

    def rows_read(self, position: int) -> list[int]:
        """Rows each source has read before data position `position` (at or past the anchor's)."""
        a = self.anchor
        return [rows + count * (position - a["position"]) for rows, count in zip(a["rows"], self.counts)]

    def slots(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, row in that source's stream) of each of the step's R rows (`step`: its data position)."""
        if self._step is None or self._step[0] != step:
            mix = np.random.default_rng([self.seed, step, int.from_bytes(b"mix", "little")])
            source = mix.permutation(np.repeat(np.arange(len(self.counts)), self.counts))
            within = np.empty(self.rows_per_step, dtype=np.int64)
            for k, (count, before) in enumerate(zip(self.counts, self.rows_read(step))):
                mine = source == k
                within[mine] = before + np.arange(count)  # the source's rows after those read before this step
            self._step = (step, source, within)
        return self._step[1], self._step[2]

    def micro_batch(self, step: int, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of shape (B, T), int64, on the CPU: this rank's slots of the step."""
        source, within = self.slots(step)
        first = (micro_step * self.world_size + self.rank) * self.B
        x = np.empty((self.B, self.T), dtype=np.int64)
        y = np.empty((self.B, self.T), dtype=np.int64)
        for k, stream in enumerate(self.streams):
            mine = np.flatnonzero(source[first : first + self.B] == k)
            if len(mine):
                x[mine], y[mine] = stream.rows(within[first + mine].tolist())
        return torch.from_numpy(x), torch.from_numpy(y)

    def tokens_by_source(self, steps: int) -> dict[str, int]:
        """Train tokens each source has given after `steps` steps (at or past the anchor's)."""
        a = self.anchor
        return {s.name: tokens + count * self.T * (steps - a["step"])
                for s, tokens, count in zip(self.sources, a["tokens"], self.counts)}

    # --- state -----------------------------------------------------------------------------------
    def state_dict(self, step: int, position: int) -> MixtureState:
        """Where each source stands after training step `step`, before data position `position` (plain values,
        by source name): the checkpoint's `mixture` entry."""
        tokens = self.tokens_by_source(step)
        return {"step": step, "position": position,
                "sources": {s.name: {"rows_read": rows, "tokens": tokens[s.name], "rows_per_step": count}
                            for s, rows, count in zip(self.sources, self.rows_read(position), self.counts)}}

    def load_state_dict(self, state: MixtureState) -> str | None:
        """Go on from a checkpoint's state_dict: each source from the rows it had read, at today's rows per step
        (a source new to the mixture from its first row). What changed, said in words (None: nothing)."""
        saved = state["sources"]
        self.anchor = {"position": state["position"], "step": state["step"],
                       "rows": [saved.get(s.name, {}).get("rows_read", 0) for s in self.sources],
                       "tokens": [saved.get(s.name, {}).get("tokens", 0) for s in self.sources]}
        self._step = None
        changes = [f"{s.name} {saved[s.name]['rows_per_step']} -> {count}" for s, count in zip(self.sources, self.counts)
                   if s.name in saved and saved[s.name]["rows_per_step"] != count]
        changes += [f"{s.name} new ({count})" for s, count in zip(self.sources, self.counts) if s.name not in saved]
        changes += [f"{name} dropped" for name in saved if name not in {s.name for s in self.sources}]
        if not changes:
            return None
        where = ", ".join(f"{s.name} at row {rows:,}" for s, rows in zip(self.sources, self.anchor["rows"]))
        return (f"the mixture's composition changed: rows per step {', '.join(changes)} (of {self.rows_per_step}); "
                f"each source reads on from the rows it had read ({where})")

    def summary(self) -> str:
        """The startup line's account of the data: each source's rows per step, share and epoch."""
        parts = [f"{s.name} {n} rows/step ({n / self.rows_per_step:.1%}; {stream.num_rows:,} rows, an epoch every "
                 f"{stream.num_rows / n:,.0f} steps)" for s, n, stream in zip(self.sources, self.counts, self.streams)]
        return "mixture: " + ", ".join(parts)


def make_train_loader(data_dir: str, seq_len: int, micro_batch_size: int, total_batch_size: int, rank: int = 0,
                      world_size: int = 1, seed: int = 0, shuffle: bool = False, doc_aligned: bool = False):
    """data_dir's train loader: one folder's TrainLoader (exactly as ever), or a MixtureLoader of several."""
    sources = parse_sources(data_dir)
    if len(sources) == 1:
        return TrainLoader(sources[0].path, seq_len, micro_batch_size, total_batch_size, rank, world_size, seed,
                           shuffle=shuffle, doc_aligned=doc_aligned)
    return MixtureLoader(sources, seq_len, micro_batch_size, total_batch_size, rank, world_size, seed,
                         shuffle=shuffle, doc_aligned=doc_aligned)


def derived_state(config: dict, step: int, position: int) -> MixtureState | None:
    """The state_dict a mixture run of `config` (a checkpoint's) had at `step` (data position `position`), for
    checkpoints written before that state was saved: every source read n_k rows a step, n_k by that config's
    weights. None where the config names no data_dir it can read."""
    try:
        sources = parse_sources(str(config["data_dir"]))
        rows_per_step = int(config["total_batch_size"]) // int(config["seq_len"])
        counts = step_composition([s.weight for s in sources], rows_per_step)
    except (KeyError, TypeError, ValueError, ZeroDivisionError, ConfigError):
        return None
    tokens_per_row = int(config["seq_len"])
    return {"step": step, "position": position,
            "sources": {s.name: {"rows_read": count * position, "tokens": count * tokens_per_row * step,
                                 "rows_per_step": count} for s, count in zip(sources, counts)}}


def changed_shards(trained_on: str, now: str) -> list[str] | None:
    """The sources whose shards differ between two sources_fingerprint values (their names; ["data_dir"] for a
    single folder's), or None where none does: a mixture's weights alone are not its shards."""
    def by_name(fingerprint: str) -> dict[str, str]:
        entries = [e.rpartition("=") for e in fingerprint.split(",")]
        if not all(sep for _, sep, _ in entries):
            return {"data_dir": fingerprint}  # one folder's 16 hex digits
        return {name.rpartition(":")[0]: fp for name, _, fp in entries}

    before, after = by_name(trained_on), by_name(now)
    changed = [name for name in {**before, **after} if before.get(name) != after.get(name)]
    return changed or None


def sources_fingerprint(data_dir: str) -> str:
    """data/manifest.py's fingerprint of one folder; of a mixture, every source's, named with its weight
    (name:weight=fingerprint,...), so run.json and the checkpoints say what each source held."""
    sources = parse_sources(data_dir)
    if len(sources) == 1:
        return data_fingerprint(sources[0].path)
    return ",".join(f"{s.name}:{s.weight:g}={data_fingerprint(s.path)}" for s in sources)
