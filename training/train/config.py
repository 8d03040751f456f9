"""The training configuration: settings sections, one per component, composed into TrainConfig.

Every key is a typed dataclass field with its help text beside it, declared by the one settings
section (common/settings.py) of the component it configures, and checked by that section's
validate(); TrainConfig is all the sections at once (cfg.max_lr), and its own validate() holds the
rules that span sections. The sections, and where each is declared:

    run          out_dir                                     here: run_folder.py imports it (via checkpoint.py)
    data         the shards and the batch geometry           here: data/ is a layer below training/
    model        the architecture, the initial weights       here: model.py imports nothing of the project
    optimizer    AdamW or Muon + AdamW, gradient clipping    training/optim/optimizers.py
    schedule     max_steps and the learning-rate schedule    training/optim/schedule.py
    ema          an average of the weights, evaluated beside  training/optim/ema.py
    evaluation   val loss, HellaSwag, samples                here: evals/ is a layer above training/
    checkpoint   cadence, retention, resume, where and how   here: checkpointer.py, checkpoint.py import it
    runtime      device, precision, kernels, seed, ranks     here: read by runtime.py, parallel.py, distributed.py
    long_run     loss spikes and rollbacks                   training/optim/spikes.py
    diagnostics  rank stats, profiler, memory snapshots      here: diagnostics.py imports it
    logging      the console, TensorBoard, W&B               training/core/logger.py

The keys users type stay flat. Precedence: the defaults (the faithful GPT-2 124M recipe) <
`--config FILE.yaml` (flat keys, or a section's keys nested under its name) < `--key value` /
`--key=value`. The command line is parsed by argparse, generated from the sections (one argument
group each: `--help` lists the keys by section), and every value is converted by its field's type;
the whole configuration is validated in `__post_init__` before any work starts. A problem is a
`ConfigError` whose message names the key: the trainer prints it on one line and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import yaml

from data.loader import grad_accum_steps
from data.mixture import mapping_text, parse_sources, parse_val_sets
from data.tokenizer import GPT2_VOCAB_SIZE
from common.errors import ArgumentParser, ConfigError, first_line
from model import PRESETS, GPTConfig
from training.optim.ema import EMASettings
from training.optim.optimizers import OptimizerSettings
from training.distributed.strategies import STRATEGIES, strategies_help
from training.core.logger import LoggingSettings
from training.optim.schedule import ScheduleSettings
from common.settings import Settings, check, option, require
from training.optim.spikes import LongRunSettings
from training.core.storage import absolute, is_url

# The longest hang_timeout_minutes: a year, longer than any run waits on a hung rank. Far longer values overflow
# where the timeout is set after the first step, on every rank: datetime.timedelta past ~2.7 million years, gloo's
# timeout (a 64-bit count) before that.
MAX_HANG_TIMEOUT_MINUTES = 365 * 24 * 60


# --- the sections kept here ------------------------------------------------------------------------

@dataclass
class RunSettings(Settings):
    """The run section: the run folder (training/checkpoint/run_folder.py, which every part of a run writes into)."""

    SECTION = "run"
    SUMMARY = "the run folder"

    out_dir: str = option("out/gpt2_124m", "run folder: config.yaml, run.json, log.jsonl, checkpoints/",
                          on_resume="none")

    def validate(self) -> None:
        require(not is_url(self.out_dir), "out_dir",
                f"{self.out_dir!r} is a URL, but the run folder (logs, config) is a local or shared path; put "
                f"checkpoints on remote storage with --checkpoint_dir URL")


@dataclass
class DataSettings(Settings):
    """The data section, read by data/loader.py (here: data/ is a layer below training/ and its settings kit)."""

    SECTION = "data"
    SUMMARY = "the token shards and the batch geometry"

    data_dir: str = option("data/edu_fineweb10B", "folder of token shards (*_train_*.npy, *_val_*.npy), or a "
                                                   "mixture: folder:weight,folder:weight ({folder: weight, ...} in "
                                                   "YAML), every step the same share of rows from each "
                                                   "(data/mixture.py)", on_resume="trajectory")
    total_batch_size: int = option(524288, "tokens per optimizer step over all ranks (2**19, GPT-3's 125M setting)",
                                   on_resume="trajectory")
    micro_batch_size: int | None = option(64, "sequences in one forward pass on one rank (B), or auto: on CUDA the "
                                              "largest B that fits the GPU's free memory with headroom, found by "
                                              "probing the training step before training (the smallest over the "
                                              "ranks, keeping grad_accum_steps whole; run.json and the startup "
                                              "line say which); on CPU and MPS micro_batch_size_fallback",
                                          on_resume="with_dropout", none="auto")
    micro_batch_size_fallback: int = option(16, "micro_batch_size auto on CPU and MPS, where no memory is probed: "
                                                "this B, or the largest below it that keeps grad_accum_steps "
                                                "whole, with a warning", on_resume="with_dropout")
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


@dataclass
class ModelSettings(Settings):
    """The model section, made into model.py's GPTConfig (here: model.py imports nothing of the project)."""

    SECTION = "model"
    SUMMARY = "the architecture and the initial weights"

    model: str = option("gpt2", "gpt2, gpt2-medium, gpt2-large, gpt2-xl, or custom (with n_layer, n_head, n_embd)",
                        on_resume="trajectory")
    n_layer: int | None = option(None, "transformer blocks (model=custom only)", on_resume="trajectory")
    n_head: int | None = option(None, "attention heads (model=custom only)", on_resume="trajectory")
    n_embd: int | None = option(None, "width of the residual stream (model=custom only)", on_resume="trajectory")
    vocab_size: int = option(50304, "embedding rows: GPT-2's 50257 padded to a multiple of 128 for faster matmuls "
                                    "(smaller only for data of other token ids: HellaSwag and samples need 50257)",
                             on_resume="trajectory")
    block_size: int = option(1024, "longest sequence the position table covers", on_resume="trajectory")
    dropout: float = option(0.0, "dropout probability (0 for pretraining)", on_resume="trajectory")
    init_from: str = option("scratch", "initial weights: scratch, a GPT-2 preset or HF folder, or a checkpoint .pt "
                                    "(weights only)", on_resume="none")  # a resumed run's weights are its checkpoint's

    def validate(self) -> None:
        shape = ("n_layer", "n_head", "n_embd")
        if self.model == "custom":
            for key in shape:
                require(getattr(self, key) is not None, key, "must be set when model is custom")
        else:
            require(self.model in PRESETS, "model",
                    f"unknown model {self.model!r}; choose one of {', '.join(PRESETS)} or custom")
            for key in shape:
                require(getattr(self, key) is None, key, f"only used with model=custom (model is {self.model})")
        for key in (*shape, "vocab_size", "block_size"):
            value = getattr(self, key)
            require(value is None or value > 0, key, f"must be positive, got {value}")
        require(0 <= self.dropout < 1, "dropout", f"must be in [0, 1), got {self.dropout}")
        if self.model == "custom":
            require(self.n_embd % self.n_head == 0, "n_embd", f"{self.n_embd} is not divisible by n_head {self.n_head}")
        # init_from is checked where its weights are read

    def model_config(self) -> GPTConfig:
        shape = PRESETS.get(self.model) or dict(n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd)
        return GPTConfig(block_size=self.block_size, vocab_size=self.vocab_size, dropout=self.dropout, **shape)


@dataclass
class EvalSettings(Settings):
    """The evaluation section, read by evals/ (here: evals/ is a layer above training/)."""

    SECTION = "evaluation"
    SUMMARY = "val loss (always after the last step), HellaSwag and text samples"

    eval_interval: int = option(250, "val loss every N steps (0: only after the last)", on_resume="none")
    val_tokens: int = option(10485760, "tokens of the fixed val window (20 x 524,288), of each val set",
                             on_resume="none")
    val_sets: str = option("", "named val windows, each its own val/<name> series: name=folder or name=val shard, "
                               "comma-separated ({name: folder, ...} in YAML); '': data_dir's val split as `val`, or "
                               "each mixture source's under its name", on_resume="none")
    hellaswag_interval: int = option(250, "HellaSwag every N steps and after the last (0: off)", on_resume="none")
    hellaswag_path: str = option("", "a local HellaSwag val jsonl ('': download it once into the cache)",
                                 on_resume="none")
    hellaswag_limit: int = option(0, "score only the first N examples (0: all 10,042)", on_resume="none")
    sample_interval: int = option(250, "text samples every N steps and after the last (0: off)", on_resume="none")
    sample_prompt: str = option("Hello, I'm a language model,", "prompt of the samples ('': unconditional)",
                                on_resume="none")
    sample_count: int = option(4, "samples each time", on_resume="none")
    sample_tokens: int = option(32, "new tokens per sample", on_resume="none")

    def validate(self) -> None:
        for key in ("val_tokens", "sample_count", "sample_tokens"):
            require(getattr(self, key) > 0, key, f"must be positive, got {getattr(self, key)}")
        for key in ("eval_interval", "hellaswag_interval", "hellaswag_limit", "sample_interval"):
            require(getattr(self, key) >= 0, key, f"must be >= 0, got {getattr(self, key)}")
        # hellaswag_path is checked where the file is opened


CHECKPOINT_FORMATS = ("auto", "file", "sharded")


@dataclass
class CheckpointSettings(Settings):
    """The checkpoint section, read by training/checkpoint/checkpointer.py and checkpoint.py (here: they import this
    module)."""

    SECTION = "checkpoint"
    SUMMARY = "when checkpoints are written and kept, where they go, which one a run resumes"

    checkpoint_interval: int = option(5000, "checkpoint every N steps (0: only at the end and on preemption)",
                                      on_resume="with_rollbacks")
    final_checkpoint: bool = option(True, "checkpoint after the last step (benchmarks turn it off)", on_resume="none")
    keep_last: int = option(3, "keep the newest N checkpoints", on_resume="none")
    resume: str = option("auto", "auto (newest checkpoint in out_dir, else fresh), never, or a checkpoint path",
                         on_resume="none")
    checkpoint_dir: str = option("", "where checkpoints go ('': out_dir/checkpoints): a local or shared path (a "
                                     "relative one is stored absolute), or an fsspec URL (s3://bucket/run, gs://..., "
                                     "needing s3fs, gcsfs, ...)", on_resume="none")
    checkpoint_format: str = option("auto", "file (one step_X.pt written by rank 0), sharded (a step_X/ folder "
                                            "every rank writes its part of, torch.distributed.checkpoint), or auto "
                                            "(sharded under fsdp and for URLs, else file); both resume anywhere",
                                    on_resume="none")
    checkpoint_async: bool = option(True, "sharded checkpoints are written in the background: training waits only "
                                          "for the copy to host memory", on_resume="none")

    def resolve(self) -> None:
        # stored absolute, so config.yaml, the checkpoints' config and run.json name the place itself: a tool run
        # from another folder (sample.py --ckpt RUN_FOLDER reads config.yaml's checkpoint_dir) finds it too
        self.checkpoint_dir = absolute(self.checkpoint_dir)

    def validate(self) -> None:
        require(self.checkpoint_interval >= 0, "checkpoint_interval", f"must be >= 0, got {self.checkpoint_interval}")
        require(self.keep_last > 0, "keep_last", f"must be positive, got {self.keep_last}")
        require(self.checkpoint_format in CHECKPOINT_FORMATS, "checkpoint_format",
                f"unknown format {self.checkpoint_format!r}; choose auto, file or sharded")
        require(not (is_url(self.checkpoint_dir) and self.checkpoint_format == "file"), "checkpoint_format",
                f"file checkpoints are written locally; checkpoint_dir {self.checkpoint_dir!r} is a URL: use sharded")
        # resume's path is checked where the checkpoint is opened


DEVICES = ("auto", "cuda", "mps", "cpu")
DTYPES = ("auto", "bfloat16", "float16", "float32", "float64")
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")


@dataclass
class RuntimeSettings(Settings):
    """The runtime section, read by training/core/runtime.py, parallel.py and distributed.py."""

    SECTION = "runtime"
    SUMMARY = "device, precision, kernels, the seed, and how the ranks share the model"

    device: str = option("auto", "auto, cuda, cuda:N, mps or cpu", on_resume="trajectory")
    dtype: str = option("auto", "auto (CUDA: bfloat16 autocast, or float16 with a gradient scaler on GPUs without "
                             "bf16 such as V100/T4; CPU: bfloat16 autocast on CPUs with AMX, and on AMD CPUs with "
                             "AVX512-BF16, where it is faster, else float32; MPS: float32), bfloat16, float16, "
                             "float32, or float64 (weights and math, for numerical checks)", on_resume="trajectory")
    compile: bool | None = option(None, "torch.compile the model (null: on for CUDA)", on_resume="with_dropout")
    seed: int = option(1337, "seed of the initial weights, epoch shuffles, dropout and samples", on_resume="trajectory")
    deterministic: bool = option(False, "only kernels that give the same bits for the same inputs, so two runs "
                                        "with the same seed and data log the same losses (slower on GPUs: see "
                                        "docs/PERFORMANCE.md; on CPUs the kernels mostly are already)",
                                 on_resume="with_dropout")
    loss_chunk_size: int | None = option(None, "fused chunked lm_head + cross-entropy in chunks of N tokens, never "
                                            "holding the whole logits (0: plain; null: 8192 on CUDA without compile)",
                                         on_resume="none")
    peak_flops: float = option(0.0, "bf16 FLOP/s of one device for MFU (0: look the device up)", on_resume="none")
    strategy: str = option("ddp", f"data parallelism: {strategies_help()}", on_resume="none")
    activation_checkpointing: str = option("none", "recompute transformer blocks' activations in the backward "
                                                   "instead of keeping them from the forward: none, full (every "
                                                   "block: the least memory, about one more forward of compute) "
                                                   "or selective (one block in every activation_checkpointing_every); "
                                                   "the same losses and gradients (README, memory table)",
                                           on_resume="none")
    activation_checkpointing_every: int = option(2, "selective: recompute blocks 0, N, 2N, ... (2: every other "
                                                    "block)", on_resume="none")
    hang_timeout_minutes: float = option(15.0, "after the first step, a collective that waits longer fails the run "
                                            "(a rank hung or died); start-up gets 30 minutes", on_resume="none")

    def recompute_every(self) -> int:
        """activation_checkpointing as GPT.recompute_blocks takes it: one block in every N recomputed (0: none)."""
        return {"none": 0, "full": 1}.get(self.activation_checkpointing, self.activation_checkpointing_every)

    def activation_checkpointing_label(self) -> str:
        """What the startup line says: none, full, or selective with its N."""
        if self.activation_checkpointing == "selective":
            return f"selective (1 block in {self.activation_checkpointing_every})"
        return self.activation_checkpointing

    def validate(self) -> None:
        require(self.device in DEVICES or self.device.startswith("cuda:"), "device",
                f"unknown device {self.device!r}; choose auto, cuda, mps or cpu")
        require(self.dtype in DTYPES, "dtype",
                f"unknown dtype {self.dtype!r}; choose auto, bfloat16, float16, float32 or float64")
        # numpy's seed sequences (the epoch shuffles) take non-negative integers, torch.manual_seed 64 bits
        require(0 <= self.seed < 2**64, "seed", f"must be in [0, 2**64), got {self.seed}")
        require(self.loss_chunk_size is None or self.loss_chunk_size >= 0, "loss_chunk_size",
                f"must be >= 0, got {self.loss_chunk_size}")
        require(self.peak_flops >= 0, "peak_flops", f"must be >= 0, got {self.peak_flops}")
        require(self.strategy in STRATEGIES, "strategy",
                f"unknown strategy {self.strategy!r}; choose {', '.join(STRATEGIES)}")
        require(self.activation_checkpointing in ACTIVATION_CHECKPOINTING, "activation_checkpointing",
                f"unknown value {self.activation_checkpointing!r}; choose {', '.join(ACTIVATION_CHECKPOINTING)}")
        require(self.activation_checkpointing_every >= 1, "activation_checkpointing_every",
                f"must be positive, got {self.activation_checkpointing_every}")
        require(0 < self.hang_timeout_minutes <= MAX_HANG_TIMEOUT_MINUTES, "hang_timeout_minutes",
                f"must be positive and at most {MAX_HANG_TIMEOUT_MINUTES} (a year), got {self.hang_timeout_minutes}")


@dataclass
class DiagnosticsSettings(Settings):
    """The diagnostics section, read by training/observe/diagnostics.py (here: it imports this module)."""

    SECTION = "diagnostics"
    SUMMARY = "rank stats, stragglers, the profiler and memory snapshots"

    rank_stats_interval: int = option(100, "every N steps the ranks share their step and data-wait times, and a "
                                           "ranks record gives the median and the slowest rank (0: off)",
                                      on_resume="none")
    straggler_factor: float = option(1.5, "warn, naming rank and host, when a rank's step time stays above this "
                                          "multiple of the median for 3 rank_stats intervals in a row (0: never)",
                                     on_resume="none")
    profile_from: int = option(0, "profile profile_steps steps from this step with torch.profiler: one trace per "
                                  "rank in out_dir/profile/ (0: off)", on_resume="none")
    profile_steps: int = option(3, "steps in the profile window", on_resume="none")
    memory_snapshot: int = option(0, "CUDA only: record every allocation for the first N steps, then write one "
                                     "snapshot per rank to out_dir/memory/ (also on out-of-memory; 0: off)",
                                  on_resume="none")

    def validate(self) -> None:
        for key in ("rank_stats_interval", "profile_from", "memory_snapshot"):
            require(getattr(self, key) >= 0, key, f"must be >= 0, got {getattr(self, key)}")
        require(self.profile_steps > 0, "profile_steps", f"must be positive, got {self.profile_steps}")
        require(self.straggler_factor == 0 or self.straggler_factor > 1, "straggler_factor",
                f"must be 0 (never) or above 1, got {self.straggler_factor}")


# --- the whole configuration ------------------------------------------------------------------------

S = TypeVar("S", bound=Settings)


# The bases in reverse: a dataclass's fields start with its last base's, so the keys (config.yaml, to_dict,
# --help) come in the order of SECTIONS below.
@dataclass
class TrainConfig(LoggingSettings, DiagnosticsSettings, LongRunSettings, RuntimeSettings, CheckpointSettings,
                  EvalSettings, EMASettings, ScheduleSettings, OptimizerSettings, ModelSettings, DataSettings,
                  RunSettings):
    """Every key of every section, flat (cfg.max_lr); cfg.section(ScheduleSettings) is one section's values."""

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Each section's rules (in SECTIONS' order), then the rules that span sections."""
        for section in SECTIONS:
            check(section, self)
        parse_val_sets(self.val_sets, self.data_dir)
        require(self.seq_len <= self.block_size, "seq_len", f"{self.seq_len} exceeds block_size {self.block_size}")
        for key in ("hellaswag_interval", "sample_interval"):  # they read GPT-2-tokenized text
            require(not getattr(self, key) or self.vocab_size >= GPT2_VOCAB_SIZE, key,
                    f"needs vocab_size >= {GPT2_VOCAB_SIZE} (GPT-2's tokenizer), got {self.vocab_size}; set it to 0")
        if self.optimizer == "muon":
            require(self.max_lr > 0, "max_lr", "must be positive with optimizer muon (the schedule scales "
                                               "muon_lr by lr / max_lr)")

    def section(self, cls: type[S]) -> S:
        """This configuration's values of one section: what a component that needs no other key is handed."""
        return cls(**{key: getattr(self, key) for key in cls.keys()})

    def resolved_checkpoint_format(self) -> str:
        """file or sharded: auto is the strategy's default_checkpoint_format (sharded for fsdp, where one
        writer gathering everything does not scale), and sharded where only those can go (URLs)."""
        if self.checkpoint_format != "auto":
            return self.checkpoint_format
        return "sharded" if is_url(self.checkpoint_dir) else STRATEGIES[self.strategy].default_checkpoint_format

    def changes_training_math(self, key: str) -> bool:
        """Whether another value of key makes this run's steps differ (what a resume with it changed warns of)."""
        if key in WITH_DROPOUT_KEYS:
            return self.dropout > 0
        if key in WITH_ROLLBACKS_KEYS:
            return bool(self.rollback_after or self.rollback_on_nonfinite)
        return key in TRAJECTORY_KEYS

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS: tuple[type[Settings], ...] = tuple(reversed(TrainConfig.__bases__))
SECTION_NAMED = {section.SECTION: section for section in SECTIONS}
SECTION_OF = {key: section for section in SECTIONS for key in section.keys()}


# --- what a changed key does to a run's steps (the resume warning, training/train/run.py) -------------------
# Each key's field declares it (option's on_resume: common/settings.py's ON_RESUME); these are the keys of each kind.


def _keys_on_resume(kind: str) -> frozenset[str]:
    return frozenset(f.name for section in SECTIONS for f in dataclasses.fields(section)
                     if f.metadata["on_resume"] == kind)


TRAJECTORY_KEYS = _keys_on_resume("trajectory")  # in the training math
WITH_DROPOUT_KEYS = _keys_on_resume("with_dropout")  # only the rounding, unless dropout is on
WITH_ROLLBACKS_KEYS = _keys_on_resume("with_rollbacks")  # nothing, unless rollbacks are on
OTHER_KEYS = _keys_on_resume("none")  # never in the training math

# --- parsing --------------------------------------------------------------------------------------

_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_HINTS = typing.get_type_hints(TrainConfig)
MAPPING_SEPARATORS = {"data_dir": ":", "val_sets": "="}  # keys that YAML may give as a mapping: {a: b} is "a<sep>b"
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _base_types(key: str) -> tuple[type, ...]:
    """The concrete types a field accepts: `int | None` -> (int, NoneType)."""
    hint = _HINTS[key]
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return tuple(typing.get_origin(a) or a for a in typing.get_args(hint))
    return (origin or hint,)


def known_key(key: str) -> str:
    """key, or a ConfigError naming it with the keys it may have meant."""
    if key not in _FIELDS:
        close = [k for k in _FIELDS if k.startswith(key[:4])]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(f"{key}: unknown config key{hint}")
    return key


def coerce(key: str, value):
    """Check (a YAML value) or convert (command-line text) one value to its field's type.

    Text is converted by the field's type, from the command line and from YAML alike: PyYAML
    reads `6e-4` (no dot) as a string, and users write floats every way. Strings stay exactly
    as written (a prompt may start with a space).
    """
    accepted = _base_types(known_key(key))
    if isinstance(value, dict) and key in MAPPING_SEPARATORS:  # a YAML mapping: stored as its command-line text
        return mapping_text(key, value, MAPPING_SEPARATORS[key])
    if isinstance(value, str):
        return _from_text(key, value, accepted)
    # a YAML value: already typed; ints are fine for floats, but bools are not ints
    if value is None and type(None) in accepted:
        return None
    if isinstance(value, bool):
        if bool in accepted:
            return value
    elif isinstance(value, int) and (int in accepted or float in accepted):
        return float(value) if int not in accepted else value
    elif isinstance(value, float) and float in accepted:
        return value
    elif isinstance(value, list) and list in accepted and all(isinstance(v, str) for v in value):
        return value
    raise ConfigError(f"{key}: expected {_type_name(key, accepted)}, got {value!r}")


def _from_text(key: str, value: str, accepted: tuple[type, ...]):
    if str in accepted:
        return value
    text = value.strip()
    if type(None) in accepted and text.lower() in ("none", "null", "auto"):
        return None
    if bool in accepted:
        if text.lower() in _TRUE | _FALSE:
            return text.lower() in _TRUE
    elif int in accepted:
        try:
            return int(text.replace("_", ""))
        except ValueError:
            pass
    elif float in accepted:
        try:
            return float(text.replace("_", ""))
        except ValueError:
            pass
    elif list in accepted:
        return [t for t in text.split(",") if t]
    raise ConfigError(f"{key}: expected {_type_name(key, accepted)}, got {text!r}")


def _type_name(key: str, accepted: tuple[type, ...]) -> str:
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string",
             list: "a list of strings", type(None): _FIELDS[key].metadata["none"]}
    return " or ".join(names[t] for t in accepted)


def load_yaml(path: str | Path) -> dict:
    """The keys a YAML file sets, each checked against its field's type: flat (`max_lr: 6e-4`), or nested
    under its section's name (`schedule: {max_lr: 6e-4}`); a key set twice is an error."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config: no such file {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config: {path} is not valid YAML ({first_line(e)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path} must hold a mapping of keys to values")
    pairs = []
    for key, value in data.items():
        section = SECTION_NAMED.get(key)
        if section is None or not isinstance(value, dict):  # `model: gpt2` is a key; `model: {...}` a section
            require(section is None or key in _FIELDS, key, f"a section: expected a mapping of its keys, got {value!r}")
            pairs.append((key, value))
            continue
        for inner, inner_value in value.items():
            owner = SECTION_OF.get(known_key(inner))
            require(owner is section, inner, f"is a key of section {owner.SECTION}, not of {key}")
            pairs.append((inner, inner_value))
    values: dict = {}
    for key, value in pairs:
        require(key not in values, key, f"set twice in {path}")
        values[key] = coerce(key, value)
    return values


# --- the command line: argparse, generated from the sections ------------------------------------------

USAGE = "train_gpt2.py [--config configs/NAME.yaml] [--key value | --key=value ...]"
DESCRIPTION = """\
Every key below can be set in the YAML file (flat, or nested under its section's name) or on the
command line (the command line wins). Each belongs to one settings section of the code."""
_METAVARS = {bool: "true|false", int: "INT", float: "NUMBER", str: "TEXT", list: "A,B,..."}


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="train_gpt2.py", usage=USAGE, description=DESCRIPTION, add_help=False,
                            allow_abbrev=False, argument_default=argparse.SUPPRESS, exit_on_error=False)
    parser.add_argument_group("config file").add_argument(
        "--config", action="append", metavar="FILE.yaml", help="YAML keys to start from (given twice: both, the "
                                                               "second winning)")
    for section in SECTIONS:
        group = parser.add_argument_group(section.SECTION, section.SUMMARY)
        for f in dataclasses.fields(section):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            group.add_argument(f"--{f.name}", type=functools.partial(coerce, f.name),
                               metavar="|".join(_METAVARS.get(t, f.metadata["none"]) for t in _base_types(f.name)),
                               help=f"{f.metadata['help']} (default: {json.dumps(default)})".replace("%", "%%"))
    return parser


def _argparse_form(argv: list[str]) -> list[str]:
    """argv as argparse reads it: `-` in a key as `_` (users type both), and `--key VALUE` as `--key=VALUE`
    where VALUE starts with one `-` (-1e-3, -inf, -x: argparse would take it for an option)."""
    out = []
    for arg in argv:
        if arg.startswith("--") and len(arg) > 2:
            key, equals, value = arg[2:].partition("=")
            arg = f"--{key.replace('-', '_')}{equals}{value}"
        elif arg.startswith("-") and not arg.startswith("--") and out and _takes_value(out[-1]):
            out[-1] = f"{out[-1]}={arg}"
            continue
        out.append(arg)
    return out


def _takes_value(arg: str) -> bool:
    """Whether arg is a `--key` still waiting for its value."""
    return arg.startswith("--") and "=" not in arg and arg[2:] in (_FIELDS.keys() | {"config"})


def wants_help(argv: list[str]) -> bool:
    """Whether argv asks for --help (or -h) anywhere, but as the value of a key (`--sample_prompt -h`)."""
    return any(arg in ("-h", "--help") for arg in _argparse_form(argv))


def usage() -> str:
    """--help: the keys by section, each with its type, help and default."""
    return _parser().format_help()


def parse_args(argv: list[str]) -> TrainConfig:
    """`[--config FILE] [--key value | --key=value ...]` -> a validated TrainConfig."""
    try:
        given, rest = _parser().parse_known_args(_argparse_form(argv))
    except argparse.ArgumentError as e:  # the one argparse raises here: a key without its value
        key = (e.argument_name or "").lstrip("-")
        raise ConfigError(f"{key}: {'missing value' if 'expected one' in e.message else e.message}") from None
    if rest:
        if rest[0].startswith("--") and rest[0] != "--":
            known_key(rest[0][2:].partition("=")[0])  # raises: argparse knows every key
        raise ConfigError(f"{rest[0]}: expected --key value or --key=value")
    values: dict = {}
    given = vars(given)
    for path in given.pop("config", []):
        values.update(load_yaml(path))
    return TrainConfig(**{**values, **given})


def config_yaml(config: TrainConfig) -> str:
    """The resolved configuration as YAML, flat (what `--config` reads back)."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
