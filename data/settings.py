"""The data section (DataSettings), and what reading it takes: data_dir's sources, the val sets, the batch geometry.

Torch-free, as every settings section is (launch/config.py): the trainer checks a configuration before it imports
torch. The loaders that read the shards are data/loader.py (one folder) and data/mixture.py (several by weight);
data/mixture.py's docstring says how data_dir names a mixture and val_sets its val windows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from common.errors import ConfigError
from common.log_fields import source_name_problem, val_set_name_problem
from common.settings import OrNone, Settings, dropout_on, mapping_text, option, require, section

SourcesText = mapping_text(":")  # data_dir: folder:weight,... (YAML: {folder: weight, ...})


@dataclass(frozen=True)
class Source:
    name: str  # the folder's last part: the tokens_<name> field of train records, a default val set's name
    path: str
    weight: float


def parse_sources(text: str) -> list[Source]:
    """data_dir's sources: one folder (weight 1), or `folder:weight,folder:weight`. ConfigError naming data_dir."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if len(parts) <= 1 and ":" not in text:
        return [Source(Path(text).name or text, text, 1.0)]
    sources = []
    for part in parts:
        path, sep, weight = part.rpartition(":")
        require(sep and path, "data_dir", f"{part!r} is not folder:weight (a mixture names each folder with its "
                                          f"weight)")
        try:
            value = float(weight)
        except ValueError:
            raise ConfigError(f"data_dir: the weight of {path} is {weight!r}, not a number") from None
        require(value > 0 and math.isfinite(value), "data_dir", f"the weight of {path} must be a positive number, "
                                                                f"got {weight}")
        sources.append(Source(Path(path).name, path, value))
    require(math.isfinite(sum(s.weight for s in sources)), "data_dir",  # step_composition divides by it
            f"the weights ({', '.join(f'{s.weight:g}' for s in sources)}) sum to more than a float holds; they are "
            f"relative: give them a usual size (0.7,0.3 or 7,3)")
    names = [s.name for s in sources]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    require(duplicate is None, "data_dir", f"two sources are named {duplicate!r} (a source is named by its folder's "
                                           f"last part; rename a folder)")
    # the name makes the train record's tokens_<name> (common/log_fields.py): refused where that is a field the
    # modules imported so far declare; the trainer parses data_dir again once all of them are (launch/build.py)
    for source in sources:
        if problem := source_name_problem(source.name):
            raise ConfigError(f"data_dir: source {source.path} is named {source.name!r} (its folder's last part), "
                              f"and {problem}; rename the folder")
    return sources


def parse_val_sets(text: str, data_dir: str) -> dict[str, str]:
    """name -> folder or val shard. Default (""): data_dir's val split as `val` (one folder), or each source's.

    Each name becomes fields of the val record (common/log_fields.py): one that cannot is a ConfigError naming
    the key that gave it, val_sets or (a mixture source's folder name) data_dir."""
    if not text:
        sources = parse_sources(data_dir)
        if len(sources) == 1:
            return {"val": sources[0].path}
        for source in sources:
            if problem := val_set_name_problem(source.name):
                raise ConfigError(f"data_dir: source {source.path} names its val set {source.name!r} by default, "
                                  f"and {problem}; rename the folder, or name the val sets with val_sets "
                                  f"(name=folder,...)")
        return {s.name: s.path for s in sources}
    sets = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, path = part.partition("=")
        require(sep and name and path, "val_sets", f"{part!r} is not name=folder (or name=val shard)")
        require(name not in sets, "val_sets", f"the name {name!r} is used twice")
        if problem := val_set_name_problem(name):
            raise ConfigError(f"val_sets: the name {name!r} cannot name a val set: {problem}")
        sets[name] = path
    return sets



def grad_accum_steps(total_batch_size: int, seq_len: int, micro_batch_size: int, world_size: int) -> int:
    """Micro-steps per optimizer step on each rank: total_batch_size / (micro_batch_size * seq_len * world_size).

    It must be whole: a ConfigError naming total_batch_size otherwise (the trainer checks it
    before any work; the loader relies on it).
    """
    rows_per_step = total_batch_size // seq_len
    if total_batch_size % seq_len:
        raise ConfigError(f"total_batch_size: {total_batch_size} is not a multiple of seq_len {seq_len}")
    if rows_per_step < world_size:
        raise ConfigError(
            f"total_batch_size: a step of {total_batch_size} tokens holds {rows_per_step} rows of seq_len "
            f"{seq_len}, fewer than the {world_size} ranks; raise total_batch_size or use fewer ranks")
    tokens_per_micro_step = micro_batch_size * seq_len * world_size
    if total_batch_size % tokens_per_micro_step:
        raise ConfigError(
            f"total_batch_size: {total_batch_size} is not divisible by micro_batch_size * seq_len * world_size = "
            f"{micro_batch_size} * {seq_len} * {world_size} = {tokens_per_micro_step}; "
            + batches_that_fit(total_batch_size, seq_len, micro_batch_size, world_size))
    return total_batch_size // tokens_per_micro_step


def batches_that_fit(total_batch_size: int, seq_len: int, micro_batch_size: int, world_size: int) -> str:
    """What works instead of a total_batch_size (a multiple of seq_len) that world_size ranks' micro-batches do not
    divide: the nearest total_batch_size below and above that micro_batch_size divides, and, where the step's rows
    split over the ranks, the largest micro_batch_size below it that keeps total_batch_size.

    GPT-2's 524,288 tokens of seq_len 1024 on 3 ranks with micro_batch_size 64: 393,216 or 589,824 (its 512 rows
    do not split over 3 ranks, so no micro_batch_size keeps it).
    """
    step = micro_batch_size * seq_len * world_size
    totals = nearest_multiples(total_batch_size, step)
    ranks = f"{world_size} rank{'s' if world_size > 1 else ''}"
    advice = (f"on {ranks} with micro_batch_size {micro_batch_size}, total_batch_size "
              f"{' or '.join(str(t) for t in totals)} works "
              f"(grad_accum_steps {' or '.join(str(t // step) for t in totals)})")
    sizes = candidate_sizes(total_batch_size, seq_len, world_size)
    if not sizes:
        return advice + (f"; no micro_batch_size works for {total_batch_size} itself, whose "
                         f"{total_batch_size // seq_len} rows of seq_len {seq_len} do not split over {ranks}")
    largest = max(b for b in sizes if b < micro_batch_size)  # 1 always is one
    return advice + (f"; or keep {total_batch_size} with micro_batch_size {largest} "
                     f"(grad_accum_steps {sizes[-1] // largest})")


def candidate_sizes(total_batch_size: int, seq_len: int, dp_size: int) -> list[int]:
    """The micro-batches that keep grad_accum_steps whole, ascending: the divisors of the rows each rank
    reads per step (total_batch_size / seq_len / dp_size); none when the rows do not split over the ranks."""
    rows = total_batch_size // seq_len
    if total_batch_size % seq_len or rows % dp_size:
        return []
    per_rank = rows // dp_size
    return [b for b in range(1, per_rank + 1) if per_rank % b == 0]


def nearest_multiples(value: int, unit: int) -> list[int]:
    """The positive multiples of unit nearest to value (which is not one): below it (if positive) and above it."""
    below = value // unit * unit
    return [m for m in (below, below + unit) if m > 0]


@section
class DataSettings(Settings):
    """The data section: the shards (one folder, or a mixture: make_train_loader) and the batch geometry."""

    SECTION = "data"
    SUMMARY = "the token shards and the batch geometry"

    data_dir: SourcesText = option("data/edu_fineweb10B", "folder of token shards (*_train_*.npy, *_val_*.npy), or a "
                                                           "mixture: folder:weight,folder:weight ({folder: weight, ...} in "
                                                           "YAML), every step the same share of rows from each "
                                                           "(data/mixture.py)", on_resume="trajectory")
    total_batch_size: int = option(524288, "tokens per optimizer step over all ranks (2**19, GPT-3's 125M setting)",
                                   on_resume="trajectory")
    micro_batch_size: OrNone[int] = option(64, "sequences in one forward pass on one rank (B), or auto: on CUDA the "
                                               "largest B that fits the GPU's free memory with headroom, found by "
                                               "probing the training step before training (the smallest over the "
                                               "ranks, keeping grad_accum_steps whole; run.json and the startup "
                                               "line say which); on CPU and MPS micro_batch_size_fallback",
                                           on_resume=dropout_on, none="auto")
    micro_batch_size_fallback: int = option(16, "micro_batch_size auto on CPU and MPS, where no memory is probed: "
                                                "this B, or the largest below it that keeps grad_accum_steps "
                                                "whole, with a warning",
                                            on_resume="none")  # it changes B alone: micro_batch_size is named
    seq_len: int = option(1024, "tokens per sequence (T)", on_resume="trajectory")
    shuffle: bool = option(False, "read the train rows in a new order every epoch, seeded by seed and epoch (false: "
                                  "build-nanogpt's order, the shards in order, then in a seeded shard order)",
                           on_resume="trajectory")
    doc_aligned: bool = option(False, "start every train row at a document (its <|endoftext|>): a document longer "
                                      "than a row is cut at the row's end and its rest passed over (the startup "
                                      "line says the share of tokens the rows use)", on_resume="trajectory")

    def validate(self) -> None:
        parse_sources(self.data_dir)  # its form and weights; the folders are opened at launch
        for key in ("total_batch_size", "micro_batch_size", "micro_batch_size_fallback", "seq_len"):
            value = getattr(self, key)
            require(value is None or value > 0, key, f"must be positive, got {value}")  # None: micro_batch_size auto
        require(self.total_batch_size % self.seq_len == 0, "total_batch_size",
                f"{self.total_batch_size} is not a multiple of seq_len {self.seq_len}")

    def grad_accum_steps(self, world_size: int) -> int:
        """total_batch_size / (micro_batch_size * seq_len * world_size), which must be whole (ConfigError)."""
        return grad_accum_steps(self.total_batch_size, self.seq_len, self.micro_batch_size, world_size)
