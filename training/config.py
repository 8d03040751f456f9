"""The training configuration: one typed dataclass, filled from YAML and command-line overrides.

Precedence: dataclass defaults (the faithful GPT-2 124M recipe) < `--config FILE.yaml` <
`--key value` / `--key=value`. Every value is checked against its field's type, and the whole
configuration is validated in `__post_init__` before any work starts; a problem is a
`ConfigError` whose message names the key. The trainer prints it on one line and exits 2.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from data.loader import grad_accum_steps
from data.tokenizer import GPT2_VOCAB_SIZE
from errors import ConfigError, first_line
from model import PRESETS, GPTConfig
from training.optimizers import OPTIMIZERS, muon_unavailable
from training.parallel import STRATEGIES, strategies_help
from training.schedule import COOLDOWN_SHAPES, SCHEDULES, cooldown_start
from training.storage import absolute, is_url

# The longest hang_timeout_minutes: a year, longer than any run waits on a hung rank. Far longer values overflow
# where the timeout is set after the first step, on every rank: datetime.timedelta past ~2.7 million years, gloo's
# timeout (a 64-bit count) before that.
MAX_HANG_TIMEOUT_MINUTES = 365 * 24 * 60


def option(default, help: str):
    """A config field with its help text beside it (printed by --help)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    # --- data and run folder
    data_dir: str = option("data/edu_fineweb10B", "folder of token shards (*_train_*.npy, *_val_*.npy)")
    out_dir: str = option("out/gpt2_124m", "run folder: config.yaml, run.json, log.jsonl, checkpoints/")
    # --- model
    model: str = option("gpt2", "gpt2, gpt2-medium, gpt2-large, gpt2-xl, or custom (with n_layer, n_head, n_embd)")
    n_layer: int | None = option(None, "transformer blocks (model=custom only)")
    n_head: int | None = option(None, "attention heads (model=custom only)")
    n_embd: int | None = option(None, "width of the residual stream (model=custom only)")
    vocab_size: int = option(50304, "embedding rows: GPT-2's 50257 padded to a multiple of 128 for faster matmuls "
                                    "(smaller only for data of other token ids: HellaSwag and samples need 50257)")
    block_size: int = option(1024, "longest sequence the position table covers")
    dropout: float = option(0.0, "dropout probability (0 for pretraining)")
    init_from: str = option("scratch", "initial weights: scratch, a GPT-2 preset or HF folder, or a checkpoint .pt "
                                    "(weights only)")
    # --- batch geometry
    total_batch_size: int = option(524288, "tokens per optimizer step over all ranks (2**19, GPT-3's 125M setting)")
    micro_batch_size: int = option(64, "sequences in one forward pass on one rank (B)")
    seq_len: int = option(1024, "tokens per sequence (T)")
    # --- optimisation (the GPT-3 paper's 125M recipe at GPT-2 124M scale)
    max_steps: int = option(19073, "optimizer steps (10B tokens / 524,288)")
    warmup_steps: int = option(715, "linear warmup steps (375M tokens)")
    max_lr: float = option(6e-4, "peak learning rate")
    min_lr: float = option(6e-5, "learning rate at the end of the cosine (10% of max_lr)")
    weight_decay: float = option(0.1, "AdamW weight decay, on 2-D weights only")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.95, "AdamW beta2")
    adam_eps: float = option(1e-8, "AdamW epsilon")
    grad_clip: float = option(1.0, "clip the global gradient norm to this (0: no clipping; the norm is still logged)")
    lr_schedule: str = option("cosine", "cosine (warmup, then cosine decay to min_lr: GPT-3's) or wsd "
                                        "(warmup-stable-decay: warmup, max_lr held, then a cooldown to min_lr over "
                                        "the last cooldown_frac of max_steps)")
    cooldown_frac: float = option(0.2, "wsd: the share of max_steps that cools down, in (0, 1] (0.2: the 20% "
                                       "cooldown that matches a tuned cosine in Hagele et al. 2024)")
    cooldown_shape: str = option("linear", "wsd: linear, or 1-sqrt (lr = min_lr + (max_lr - min_lr) * "
                                           "(1 - sqrt(progress)): a little better in Hagele et al. 2024)")
    optimizer: str = option("adamw", "adamw (every parameter; GPT-2/3's) or muon (torch.optim.Muon, PyTorch 2.9+, "
                                     "on the blocks' weight matrices, AdamW with max_lr, betas, eps and weight_decay "
                                     "on embeddings, lm_head, LayerNorms and biases; ddp only). A checkpoint resumes "
                                     "only with the optimizer it was written with")
    muon_lr: float = option(0.02, "muon: peak learning rate of the Muon matrices, scaled by the schedule like "
                                  "max_lr (0.02: Keller Jordan's Muon default; the orthogonalised update has "
                                  "singular values near 1, so this lr is not on AdamW's scale)")
    muon_momentum: float = option(0.95, "muon: Nesterov momentum (0.95: the Muon paper and modded-nanogpt)")
    muon_weight_decay: float = option(0.0, "muon: decoupled weight decay, applied as w *= 1 - lr * wd with the "
                                           "Muon lr (0: as Keller Jordan's Muon and the modded-nanogpt speedruns; "
                                           "torch's default 0.1 is meant for AdamW-sized lrs and would shrink the "
                                           "weights 0.2% a step at lr 0.02)")
    shuffle: bool = option(False, "read the train rows in a new order every epoch, seeded by seed and epoch (false: "
                                  "build-nanogpt's order, the shards in order, then in a seeded shard order)")
    doc_aligned: bool = option(False, "start every train row at a document (its <|endoftext|>): a document longer "
                                      "than a row is cut at the row's end and its rest passed over (the startup "
                                      "line says the share of tokens the rows use)")
    # --- evaluation (val loss always runs after the last step)
    eval_interval: int = option(250, "val loss every N steps (0: only after the last)")
    val_tokens: int = option(10485760, "tokens of the fixed val window (20 x 524,288)")
    hellaswag_interval: int = option(250, "HellaSwag every N steps and after the last (0: off)")
    hellaswag_path: str = option("", "a local HellaSwag val jsonl ('': download it once into the cache)")
    hellaswag_limit: int = option(0, "score only the first N examples (0: all 10,042)")
    sample_interval: int = option(250, "text samples every N steps and after the last (0: off)")
    sample_prompt: str = option("Hello, I'm a language model,", "prompt of the samples ('': unconditional)")
    sample_count: int = option(4, "samples each time")
    sample_tokens: int = option(32, "new tokens per sample")
    # --- checkpoints
    checkpoint_interval: int = option(5000, "checkpoint every N steps (0: only at the end and on preemption)")
    final_checkpoint: bool = option(True, "checkpoint after the last step (benchmarks turn it off)")
    keep_last: int = option(3, "keep the newest N checkpoints")
    resume: str = option("auto", "auto (newest checkpoint in out_dir, else fresh), never, or a checkpoint path")
    checkpoint_dir: str = option("", "where checkpoints go ('': out_dir/checkpoints): a local or shared path (a "
                                     "relative one is stored absolute), or an fsspec URL (s3://bucket/run, gs://..., "
                                     "needing s3fs, gcsfs, ...)")
    checkpoint_format: str = option("auto", "file (one step_X.pt written by rank 0), sharded (a step_X/ folder "
                                            "every rank writes its part of, torch.distributed.checkpoint), or auto "
                                            "(sharded under fsdp and for URLs, else file); both resume anywhere")
    checkpoint_async: bool = option(True, "sharded checkpoints are written in the background: training waits only "
                                          "for the copy to host memory")
    # --- runtime
    device: str = option("auto", "auto, cuda, cuda:N, mps or cpu")
    dtype: str = option("auto", "auto (bfloat16 autocast on GPUs and on CPUs where it is faster, float16 with a "
                             "gradient scaler on GPUs without bf16 such as V100/T4, else float32), bfloat16, float16, "
                             "float32, or float64 (weights and math, for numerical checks)")
    compile: bool | None = option(None, "torch.compile the model (null: on for CUDA)")
    seed: int = option(1337, "seed of the initial weights, epoch shuffles, dropout and samples")
    deterministic: bool = option(False, "only kernels that give the same bits for the same inputs, so two runs "
                                        "with the same seed and data log the same losses (slower on GPUs: see "
                                        "docs/PERFORMANCE.md; on CPUs the kernels mostly are already)")
    loss_chunk_size: int | None = option(None, "fused chunked lm_head + cross-entropy in chunks of N tokens, never "
                                            "holding the whole logits (0: plain; null: 8192 on CUDA without compile)")
    log_interval: int = option(1, "console line every N steps (log.jsonl gets every step)")
    peak_flops: float = option(0.0, "bf16 FLOP/s of one device for MFU (0: look the device up)")
    strategy: str = option("ddp", f"data parallelism: {strategies_help()}")
    hang_timeout_minutes: float = option(15.0, "after the first step, a collective that waits longer fails the run "
                                            "(a rank hung or died); start-up gets 30 minutes")
    # --- long runs: loss spikes, rollback, diagnostics
    spike_skip: bool = option(False, "skip an update whose loss or grad norm is more than spike_threshold standard "
                                     "deviations above the mean of the last spike_window applied steps (every rank "
                                     "skips the same one; a skip record says why)")
    spike_window: int = option(128, "applied steps in the spike window; nothing is skipped until it is full")
    spike_threshold: float = option(6.0, "standard deviations above the window's mean that make a spike")
    rollback_after: int = option(0, "after N skipped steps in a row, reload the newest checkpoint and continue past "
                                    "the batches since it (0: never; needs spike_skip)")
    rollback_on_nonfinite: bool = option(False, "a NaN/inf loss or grad norm rolls back like rollback_after instead "
                                                "of stopping the run (exit 3)")
    max_rollbacks: int = option(3, "rollbacks in one run; the next one stops it with an error (exit 3)")
    rank_stats_interval: int = option(100, "every N steps the ranks share their step and data-wait times, and a "
                                           "ranks record gives the median and the slowest rank (0: off)")
    straggler_factor: float = option(1.5, "warn, naming rank and host, when a rank's step time stays above this "
                                          "multiple of the median for 3 rank_stats intervals in a row (0: never)")
    profile_from: int = option(0, "profile profile_steps steps from this step with torch.profiler: one trace per "
                                  "rank in out_dir/profile/ (0: off)")
    profile_steps: int = option(3, "steps in the profile window")
    memory_snapshot: int = option(0, "CUDA only: record every allocation for the first N steps, then write one "
                                     "snapshot per rank to out_dir/memory/ (also on out-of-memory; 0: off)")
    tensorboard: bool = option(False, "also write the log's numbers as TensorBoard scalars to out_dir/tensorboard/ "
                                      "(needs the tensorboard package)")
    # --- Weights & Biases
    wandb: bool = option(False, "log to Weights & Biases")
    wandb_project: str = option("gpt2-repro", "W&B project")
    wandb_run_name: str = option("", "W&B run name ('': W&B picks one)")
    wandb_mode: str = option("online", "online, offline (sync later) or disabled")
    wandb_tags: list[str] = option([], "W&B tags, comma-separated on the command line")

    def __post_init__(self):
        # stored absolute, so config.yaml, the checkpoints' config and run.json name the place itself: a tool run
        # from another folder (sample.py --ckpt RUN_FOLDER reads config.yaml's checkpoint_dir) finds it too
        self.checkpoint_dir = absolute(self.checkpoint_dir)
        self.validate()

    # --- validation -------------------------------------------------------------------------
    def validate(self) -> None:
        def require(ok: bool, key: str, message: str) -> None:
            if not ok:
                raise ConfigError(f"{key}: {message}")

        # no float key gives inf or nan a meaning (where a key can be off, 0 is that value), and the checks
        # below would let inf through (inf > 0) into the code that uses it (a timedelta overflows)
        for key in _FLOAT_KEYS:
            require(math.isfinite(getattr(self, key)), key, f"must be a finite number, got {getattr(self, key)}")
        if self.model == "custom":
            for key in ("n_layer", "n_head", "n_embd"):
                require(getattr(self, key) is not None, key, "must be set when model is custom")
        else:
            require(self.model in PRESETS, "model",
                    f"unknown model {self.model!r}; choose one of {', '.join(PRESETS)} or custom")
            for key in ("n_layer", "n_head", "n_embd"):
                require(getattr(self, key) is None, key, f"only used with model=custom (model is {self.model})")
        for key in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size", "total_batch_size",
                    "micro_batch_size", "seq_len", "max_steps", "val_tokens", "keep_last",
                    "log_interval", "sample_count", "sample_tokens"):
            value = getattr(self, key)
            require(value is None or value > 0, key, f"must be positive, got {value}")
        for key in ("warmup_steps", "eval_interval", "hellaswag_interval", "sample_interval",
                    "checkpoint_interval", "hellaswag_limit", "loss_chunk_size"):
            value = getattr(self, key)
            require(value is None or value >= 0, key, f"must be >= 0, got {value}")
        for key in ("rollback_after", "max_rollbacks", "rank_stats_interval", "profile_from", "memory_snapshot"):
            require(getattr(self, key) >= 0, key, f"must be >= 0, got {getattr(self, key)}")
        require(self.spike_window >= 2, "spike_window", f"must be >= 2, got {self.spike_window}")
        require(self.spike_threshold > 0, "spike_threshold", f"must be positive, got {self.spike_threshold}")
        require(self.profile_steps > 0, "profile_steps", f"must be positive, got {self.profile_steps}")
        require(self.straggler_factor == 0 or self.straggler_factor > 1, "straggler_factor",
                f"must be 0 (never) or above 1, got {self.straggler_factor}")
        require(not self.rollback_after or self.spike_skip, "rollback_after",
                "counts skipped steps, so it needs spike_skip: true")
        for key in ("max_lr", "weight_decay", "grad_clip", "dropout", "peak_flops", "min_lr"):
            require(getattr(self, key) >= 0, key, f"must be >= 0, got {getattr(self, key)}")
        require(self.min_lr <= self.max_lr, "min_lr", f"{self.min_lr} is above max_lr {self.max_lr}")
        require(self.dropout < 1, "dropout", f"must be below 1, got {self.dropout}")
        for key in ("beta1", "beta2"):
            require(0 <= getattr(self, key) < 1, key, f"must be in [0, 1), got {getattr(self, key)}")
        require(self.adam_eps > 0, "adam_eps", f"must be positive, got {self.adam_eps}")
        require(self.lr_schedule in SCHEDULES, "lr_schedule",
                f"unknown schedule {self.lr_schedule!r}; choose {', '.join(SCHEDULES)}")
        require(self.cooldown_shape in COOLDOWN_SHAPES, "cooldown_shape",
                f"unknown shape {self.cooldown_shape!r}; choose {', '.join(COOLDOWN_SHAPES)}")
        require(0 < self.cooldown_frac <= 1, "cooldown_frac", f"must be in (0, 1], got {self.cooldown_frac}")
        if self.lr_schedule == "wsd":
            start = cooldown_start(self.max_steps, self.cooldown_frac)
            require(self.warmup_steps <= start, "warmup_steps",
                    f"{self.warmup_steps} runs into the wsd cooldown, which starts at step {start} "
                    f"(max_steps {self.max_steps}, cooldown_frac {self.cooldown_frac})")
        require(self.optimizer in OPTIMIZERS, "optimizer",
                f"unknown optimizer {self.optimizer!r}; choose {', '.join(OPTIMIZERS)}")
        require(self.muon_lr >= 0, "muon_lr", f"must be >= 0, got {self.muon_lr}")
        require(0 <= self.muon_momentum < 1, "muon_momentum", f"must be in [0, 1), got {self.muon_momentum}")
        require(self.muon_weight_decay >= 0, "muon_weight_decay", f"must be >= 0, got {self.muon_weight_decay}")
        if self.optimizer == "muon":
            missing = muon_unavailable()
            require(missing is None, "optimizer", missing)
            require(self.max_lr > 0, "max_lr", "must be positive with optimizer muon (the schedule scales "
                                               "muon_lr by lr / max_lr)")
            require(self.strategy not in STRATEGIES or STRATEGIES[self.strategy].supports_muon, "optimizer",
                    f"muon needs whole weight matrices; it runs under strategy "
                    f"{' or '.join(n for n, cls in STRATEGIES.items() if cls.supports_muon)} "
                    f"({self.strategy} shards them)")
        # numpy's seed sequences (the epoch shuffles) take non-negative integers, torch.manual_seed 64 bits
        require(0 <= self.seed < 2**64, "seed", f"must be in [0, 2**64), got {self.seed}")
        if self.model == "custom":
            require(self.n_embd % self.n_head == 0, "n_embd", f"{self.n_embd} is not divisible by n_head {self.n_head}")
        for key in ("hellaswag_interval", "sample_interval"):  # they read GPT-2-tokenized text
            require(not getattr(self, key) or self.vocab_size >= GPT2_VOCAB_SIZE, key,
                    f"needs vocab_size >= {GPT2_VOCAB_SIZE} (GPT-2's tokenizer), got {self.vocab_size}; set it to 0")
        require(self.seq_len <= self.block_size, "seq_len",
                f"{self.seq_len} exceeds block_size {self.block_size}")
        require(self.total_batch_size % self.seq_len == 0, "total_batch_size",
                f"{self.total_batch_size} is not a multiple of seq_len {self.seq_len}")
        require(self.device in ("auto", "cuda", "mps", "cpu") or self.device.startswith("cuda:"), "device",
                f"unknown device {self.device!r}; choose auto, cuda, mps or cpu")
        require(self.dtype in ("auto", "bfloat16", "float16", "float32", "float64"), "dtype",
                f"unknown dtype {self.dtype!r}; choose auto, bfloat16, float16, float32 or float64")
        require(self.strategy in STRATEGIES, "strategy",
                f"unknown strategy {self.strategy!r}; choose {', '.join(STRATEGIES)}")
        require(self.wandb_mode in ("online", "offline", "disabled"), "wandb_mode",
                f"unknown mode {self.wandb_mode!r}; choose online, offline or disabled")
        require(0 < self.hang_timeout_minutes <= MAX_HANG_TIMEOUT_MINUTES, "hang_timeout_minutes",
                f"must be positive and at most {MAX_HANG_TIMEOUT_MINUTES} (a year), got {self.hang_timeout_minutes}")
        require(self.checkpoint_format in ("auto", "file", "sharded"), "checkpoint_format",
                f"unknown format {self.checkpoint_format!r}; choose auto, file or sharded")
        require(not is_url(self.out_dir), "out_dir",
                f"{self.out_dir!r} is a URL, but the run folder (logs, config) is a local or shared path; put "
                f"checkpoints on remote storage with --checkpoint_dir URL")
        require(not (is_url(self.checkpoint_dir) and self.checkpoint_format == "file"), "checkpoint_format",
                f"file checkpoints are written locally; checkpoint_dir {self.checkpoint_dir!r} is a URL: use sharded")
        # paths (resume, init_from, hellaswag_path, data_dir) are checked where the files are opened

    # --- derived values -----------------------------------------------------------------------
    def model_config(self) -> GPTConfig:
        shape = PRESETS.get(self.model) or dict(n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd)
        return GPTConfig(block_size=self.block_size, vocab_size=self.vocab_size, dropout=self.dropout, **shape)

    def grad_accum_steps(self, world_size: int) -> int:
        """total_batch_size / (micro_batch_size * seq_len * world_size), which must be whole (ConfigError)."""
        return grad_accum_steps(self.total_batch_size, self.seq_len, self.micro_batch_size, world_size)

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


# --- what a changed key does to a run's steps (the resume warning, training/run.py) -------------------
# Every key is in exactly one of these sets (tests/test_config.py checks it, so a new key must be placed).

# Keys whose value is in the training math: resumed with another value, a run's steps differ from those of
# an uninterrupted one.
TRAJECTORY_KEYS = frozenset({
    "data_dir",  # other shards are other batches (the data-fingerprint warning says whether they differ)
    "model", "n_layer", "n_head", "n_embd", "vocab_size", "block_size",  # the model (another shape is refused)
    "dropout", "seed",  # dropout masks (and the epoch shuffles: seed)
    "total_batch_size", "seq_len", "shuffle", "doc_aligned",  # which tokens a step trains on
    "max_steps", "warmup_steps", "max_lr", "min_lr", "lr_schedule", "cooldown_frac", "cooldown_shape",  # the lr
    "optimizer", "weight_decay", "beta1", "beta2", "adam_eps", "grad_clip", "muon_lr", "muon_momentum",
    "muon_weight_decay",
    "device", "dtype",  # the precision of the math (dtype auto picks it by device)
    "spike_skip", "spike_window", "spike_threshold", "rollback_after", "rollback_on_nonfinite",
    "max_rollbacks",  # which updates apply, and whether a run goes on past a rollback
})
# Keys that change only the rounding (other kernels, other orders of sums) unless dropout is on: then which
# dropout mask falls on which row (micro-batches hold other rows; compiled kernels draw their masks apart
# from eager ones; deterministic mode may pick another attention kernel, which draws its own).
WITH_DROPOUT_KEYS = frozenset({"micro_batch_size", "compile", "deterministic"})
# Keys that change nothing unless rollbacks are on: a rollback goes back to the newest checkpoint, so the
# checkpoint cadence decides which batches it passes over.
WITH_ROLLBACKS_KEYS = frozenset({"checkpoint_interval"})
# Keys that cannot change the training math: where the files go, logging, evaluation (which draws from its
# own generator; the training reseeds dropout every step), diagnostics, checkpoint storage, how the model is
# spread over the ranks (ddp and fsdp: the same math, rounded differently), the chunked loss (the same math,
# rounded differently), and init_from (a resumed run's weights are its checkpoint's).
OTHER_KEYS = frozenset({
    "out_dir", "init_from", "resume", "log_interval", "peak_flops", "strategy", "loss_chunk_size",
    "eval_interval", "val_tokens", "hellaswag_interval", "hellaswag_path", "hellaswag_limit",
    "sample_interval", "sample_prompt", "sample_count", "sample_tokens",
    "final_checkpoint", "keep_last", "checkpoint_dir", "checkpoint_format", "checkpoint_async",
    "hang_timeout_minutes", "rank_stats_interval", "straggler_factor", "profile_from", "profile_steps",
    "memory_snapshot", "tensorboard", "wandb", "wandb_project", "wandb_run_name", "wandb_mode", "wandb_tags",
})


# --- parsing --------------------------------------------------------------------------------------

_FIELDS = {f.name: f for f in fields(TrainConfig)}
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


_HINTS = typing.get_type_hints(TrainConfig)


def _base_types(key: str) -> tuple[type, ...]:
    """The concrete types a field accepts: `int | None` -> (int, NoneType)."""
    hint = _HINTS[key]
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return tuple(typing.get_origin(a) or a for a in typing.get_args(hint))
    return (origin or hint,)


_FLOAT_KEYS = tuple(key for key in _FIELDS if float in _base_types(key))


def coerce(key: str, value):
    """Check (a YAML value) or convert (command-line text) one value to its field's type.

    Text is converted by the field's type, from the command line and from YAML alike: PyYAML
    reads `6e-4` (no dot) as a string, and users write floats every way. Strings stay exactly
    as written (a prompt may start with a space).
    """
    if key not in _FIELDS:
        close = [k for k in _FIELDS if k.startswith(key[:4])]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(f"{key}: unknown config key{hint}")
    accepted = _base_types(key)
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
    raise ConfigError(f"{key}: expected {_type_name(accepted)}, got {value!r}")


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
    raise ConfigError(f"{key}: expected {_type_name(accepted)}, got {text!r}")


def _type_name(accepted: tuple[type, ...]) -> str:
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string",
             list: "a list of strings", type(None): "null"}
    return " or ".join(names[t] for t in accepted)


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config: no such file {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config: {path} is not valid YAML ({first_line(e)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path} must hold a mapping of keys to values")
    return {k: coerce(k, v) for k, v in data.items()}


def usage() -> str:
    lines = ["usage: train_gpt2.py [--config configs/NAME.yaml] [--key value | --key=value ...]", "",
             "Every key below can be set in the YAML file or on the command line (the command line wins).", ""]
    for f in fields(TrainConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"  --{f.name} ({_type_name(_base_types(f.name))}, default {default!r})")
        lines.append(f"      {f.metadata['help']}")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> TrainConfig:
    """`[--config FILE] [--key value | --key=value ...]` -> a validated TrainConfig."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"{arg}: expected --key value or --key=value")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"{arg[2:]}: missing value")
            key, value = arg[2:], argv[i + 1]
            i += 2
        pairs.append((key.replace("-", "_"), value))
    values: dict = {}
    for key, value in pairs:
        if key == "config":
            values.update(load_yaml(value))
    for key, value in pairs:
        if key != "config":
            values[key] = coerce(key, value)
    return TrainConfig(**values)


def config_yaml(config: TrainConfig) -> str:
    """The resolved configuration as YAML (what `--config` reads back)."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
