"""What a run will cost, worked out before it runs: its parameters, tokens, steps and FLOPs, its time on a named
GPU model and count, its val and HellaSwag passes, the disk its shards and checkpoints take, the memory of each
GPU and the dollars at a price per GPU-hour. Every figure says where it comes from:

    config     a value of the configuration
    derived    arithmetic on other figures (the formula is given)
    measured   a measurement of this trainer, with its date and GPU (runtime/gpus.py's MEASUREMENTS)
    assumed    a figure taken where nothing was measured, with what it rests on
    given      a flag of the command (--mfu, --price)

    python train_gpt2.py --config configs/gpt2_124m.yaml --estimate --gpu H100 --gpus 8 --price 2.5

The trainer's --estimate prints it and trains nothing; ladder.py's --dry_run times its rungs with the same
functions. Nothing here imports torch: the figures are arithmetic on the validated configuration, and the FLOPs
are counted by model_size.py's formula, the one the trainer's MFU uses.

Memory per GPU follows scripts/memory_table.py's model (its arithmetic is here; the script measures the
activations it rests on): model state by exact arithmetic, activations from bytes measured on the CPU.
"""

from __future__ import annotations

import json
import math
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from common.errors import ConfigError
from common.settings import require
from model_size import PRESETS, flops_per_token, parameter_count
from runtime.gpus import GPU_MODELS, MEASUREMENTS, GPUModel, Measurement, gpu_model

if TYPE_CHECKING:
    from launch.config import TrainConfig

GIB = 2**30
GB = 1e9
DEFAULT_MFU = 0.4  # where nothing was measured (ladder.py's default before it, too)
# The official HellaSwag val split's examples (evals/hellaswag.py's VAL_EXAMPLES), each 4 rows: its context and
# one ending. How long a row is was not measured here (the data comes from the network): a context of a sentence
# or two and an ending of one, padded to a multiple of 32 tokens, is taken as 96 tokens.
HELLASWAG_EXAMPLES = 10_042
HELLASWAG_ROWS = 4
HELLASWAG_ROW_TOKENS = 96
# Checkpoint write rates measured on a CPU machine's disk (docs/PERFORMANCE.md, "Checkpoints", 2026-11-24: gpt2,
# 2 ranks, the median of 3): the file format 0.37 GB/s, the sharded one 0.71 GB/s. A GPU node's disk is unmeasured.
SAVE_RATE = {"file": 0.37e9, "sharded": 0.71e9}
SAVE_RATE_SOURCE = "a CPU machine's disk (docs/PERFORMANCE.md, 2026-11-24)"


# --- memory per GPU: scripts/memory_table.py's model --------------------------------------------------------

HEADROOM = 0.85  # of a card's memory, what model state and activations may use (the rest: CUDA context, allocator)


# Whether each strategy of training/distributed/strategies.py shards the model state over the GPUs (its class's
# forwards_are_collective: under FSDP every forward gathers the shards), as a torch-free table; a test checks it
# against the classes, so a new strategy is added here too.
SHARDS_STATE = {"ddp": False, "fsdp": True, "fsdp_zero2": True}


def state_bytes(params: int, optimizer: float, sharded: bool, gpus: int, ema: bool = False) -> float:
    """Model state bytes on each GPU: float32 weights (4 bytes a parameter) and gradients (4), the optimizer's
    `optimizer` bytes (AdamW's two moments: 8 a parameter), and an EMA's float32 copy. DDP keeps all of it on every
    GPU. FSDP (and fsdp_zero2 between steps) shards the weights, the optimizer state and the EMA; gradients are
    sharded after the step's reduce-scatter, but while micro-batches accumulate (no reduce-scatter before the last)
    each GPU holds them whole: with AdamW, 12/n + 4 bytes a parameter on n GPUs."""
    state = 4 * params + optimizer + (4 * params if ema else 0)
    return (state / gpus if sharded else state) + 4 * params


# AdamW's model state per GPU of a model of p parameters on n GPUs, under the strategies scripts/memory_table.py
# compares: 16 bytes a parameter under ddp, 12/n + 4 under fsdp
STATE_BYTES = {name: (lambda p, n, sharded=SHARDS_STATE[name]: state_bytes(p, 8 * p, sharded, n))
               for name in ("ddp", "fsdp")}


@dataclass(frozen=True)
class ActivationCosts:
    """Saved-for-backward bytes (measured by scripts/memory_table.py, or worked out by scaled_activation_costs): of
    one sequence, the part outside the blocks (embeddings, final LayerNorm, the loss), one plain block, and one
    recomputed block (its input); and what does not grow with B (the weights' bf16 copies, the lm_head's tensors)."""

    fixed: float
    outside: float
    plain_block: float
    recomputed_block: float

    def per_sequence(self, n_layer: int, every: int) -> float:
        """Bytes of one sequence at full depth, recomputing blocks 0, every, 2 * every, ... (0: none), plus
        the one recomputed block whose activations exist again during its backward."""
        recomputed = 0 if every == 0 else math.ceil(n_layer / every)
        transient = self.plain_block if recomputed else 0.0
        return (self.outside + (n_layer - recomputed) * self.plain_block + recomputed * self.recomputed_block
                + transient)


# Activations saved for the backward, as scripts/memory_table.py measures them (bf16 autocast, eager, flash
# attention: the bytes of every tensor autograd saves, at B = 1 and 2): bytes a token, with C = n_embd, H heads and
# V = vocab_size. Measured on a CPU (2026-11-29) at C = 768 and 256, V = 512 and 1,024, T = 1,024, 1 and 2 layers,
# to the byte; tests/test_estimate.py measures a small model against them. Derived from them for gpt2 (C = 768, 12
# layers): 0.32 GiB a sequence with the fused loss, 0.51 with the plain one, docs/PERFORMANCE.md's measured rows.
ACTIVATIONS_MEASURED = "measured on a CPU to the byte (2026-11-29, scripts/memory_table.py's method)"


def block_bytes(C: int, H: int) -> int:
    """One block kept whole: 36 C (the two LayerNorms' float32 inputs, 8 C; the bf16 inputs of attention's and the
    MLP's first matmuls, 2 C each; q, k and v, 6 C; attention's output, the projection's input, 2 C; the MLP's
    4C-wide hidden layer before and after its GELU, 16 C), the two LayerNorms' float32 mean and rstd (16 bytes)
    and attention's float32 log-sum-exp of each head (4 H)."""
    return 36 * C + 16 + 4 * H


def recomputed_block_bytes(C: int) -> int:
    """A block recomputed in the backward keeps its float32 input alone."""
    return 4 * C


def outside_bytes(C: int, V: int, fused: bool) -> int:
    """Outside the blocks: the embeddings' float32 sum, the final LayerNorm and the fused loss (6 C + 16); the
    plain loss keeps the float32 logits of every token too (4 V)."""
    return 6 * C + 16 + (0 if fused else 4 * V)


def fixed_bytes(C: int, V: int, kept_blocks: int, fused: bool) -> int:
    """What does not grow with the batch: the bf16 copies autocast keeps of the matrices of each block kept whole (2
    bytes of each of their 12 C^2 weights; a recomputed block keeps none), and the lm_head's: the fused loss's
    float32 (V, C) gradient (4 V C), or the plain loss's bf16 copy of the weight (2 V C)."""
    return 24 * C * C * kept_blocks + (4 if fused else 2) * V * C


def scaled_activation_costs(shape: Shape, fused: bool, every: int = 0) -> ActivationCosts:
    """A shape's ActivationCosts by the arithmetic above, at its seq_len, recomputing one block in every `every`
    (0: none). The block recomputed in its backward holds its weights' bf16 copies again, as its activations."""
    C, H, V, T, L = shape.n_embd, shape.n_head, shape.vocab_size, shape.seq_len, shape.n_layer
    recomputed = 0 if every == 0 else math.ceil(L / every)
    fixed = fixed_bytes(C, V, L - recomputed, fused) + (24 * C * C if recomputed else 0)
    return ActivationCosts(fixed=fixed, outside=T * outside_bytes(C, V, fused), plain_block=T * block_bytes(C, H),
                           recomputed_block=T * recomputed_block_bytes(C))


def largest_batch(card_gib: float, state: float, costs: ActivationCosts, per_sequence: float) -> int:
    """The largest micro-batch whose activations fit beside the model state in HEADROOM of the card."""
    return max(int((card_gib * GIB * HEADROOM - state - costs.fixed) // per_sequence), 0)


# --- the pieces: the model, the hardware, a figure and its source -------------------------------------------

@dataclass(frozen=True)
class Figure:
    """A value as it is printed, and where it comes from: its kind (config, derived, measured (date, GPU),
    assumed, given) and how."""

    label: str
    value: str
    source: str


@dataclass(frozen=True)
class Shape:
    """The model's shape as the configuration resolves it (launch/weights.py's model_config), counted."""

    name: str  # the preset, or custom
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    block_size: int
    seq_len: int

    @property
    def params(self) -> int:
        """Every parameter, the tied token table and lm_head once (model.py's num_params)."""
        return parameter_count(self.n_layer, self.n_embd, self.vocab_size, self.block_size)

    @property
    def non_embedding_params(self) -> int:
        """N of 6N: every parameter but the position table (model.py's num_params(non_embedding=True))."""
        return self.params - self.block_size * self.n_embd

    def flops_per_token(self, context: int | None = None) -> int:
        """Training FLOPs per token over a context of `context` tokens (default seq_len), as the MFU counts them."""
        return flops_per_token(self.non_embedding_params, self.n_layer, self.n_head, self.n_embd,
                               self.seq_len if context is None else context)


def model_shape(cfg: TrainConfig) -> Shape:
    model = cfg.model
    shape = PRESETS.get(model.model) or dict(n_layer=model.n_layer, n_head=model.n_head, n_embd=model.n_embd)
    return Shape(model.model, **shape, vocab_size=model.vocab_size, block_size=model.block_size,
                 seq_len=cfg.data.seq_len)


@dataclass(frozen=True)
class Hardware:
    """What the run's time is worked out on: its FLOP/s over all its devices, and where that rate comes from."""

    name: str  # "8 x H100", "this CPU"
    devices: int
    flops_per_sec: float
    source: str
    gpu: GPUModel | None = None  # None: not a GPU of the table (a CPU's measured rate)
    measurement: Measurement | None = None  # the measurement of this configuration on this GPU model, if any
    # a measurement of this configuration, on this GPU model or another: its start-up and memory carry over
    this_config: Measurement | None = None

    @property
    def card_gib(self) -> float | None:
        return self.gpu.memory_gib if self.gpu else None


def find_gpu(name: str, flag: str) -> GPUModel:
    """The table's GPU model of a name (H100, or a device name such as "NVIDIA H100 80GB HBM3"); a ConfigError
    naming the flag that gave it otherwise."""
    gpu = gpu_model(name) if name.strip() else None
    if gpu is None:
        raise ConfigError(f"{flag}: {name!r} is not in the peak FLOP/s table (runtime/gpus.py: "
                          f"{', '.join(g.name for g in GPU_MODELS)})")
    return gpu


def resolved_compile(cfg: TrainConfig) -> bool:
    """compile on a GPU: null is on (runtime/runtime.py's resolve_runtime on CUDA)."""
    return True if cfg.runtime.compile is None else cfg.runtime.compile


def fused_loss(cfg: TrainConfig) -> bool:
    """Whether the loss is the fused chunked one on a GPU: loss_chunk_size null is fused without compile only."""
    chunk = cfg.runtime.loss_chunk_size
    return (not resolved_compile(cfg)) if chunk is None else chunk > 0


def differences(cfg: TrainConfig, m: Measurement) -> list[str]:
    """What a measurement ran that cfg does not (its GPU aside): [] where it measured this configuration's step."""
    shape = model_shape(cfg)
    return [what for what, same in (
        (f"model {m.model}", PRESETS.get(m.model) == dict(n_layer=shape.n_layer, n_head=shape.n_head,
                                                         n_embd=shape.n_embd)
         and (shape.vocab_size, shape.block_size) == (model_shape_of(m).vocab_size, model_shape_of(m).block_size)),
        (f"seq_len {m.seq_len}", shape.seq_len == m.seq_len),
        (f"micro_batch_size {m.micro_batch_size}", cfg.data.micro_batch_size == m.micro_batch_size),
        ("compile" if m.compile else "no compile", resolved_compile(cfg) == m.compile),
        ("the fused loss" if m.loss_chunk_size else "the plain loss", fused_loss(cfg) == bool(m.loss_chunk_size)),
        ("no activation checkpointing", cfg.runtime.activation_checkpointing == "none"),
        ("AdamW", cfg.optimizer.optimizer == "adamw"),
        (m.strategy, cfg.runtime.strategy == m.strategy),
    ) if not same]


def measured_mfu(m: Measurement) -> float:
    """The MFU the trainer logged in a measurement: its tokens/s x FLOPs per token over its GPU's peak."""
    return m.tokens_per_sec * model_shape_of(m).flops_per_token() / find_gpu(m.gpu, "measurement").bf16_flops


def model_shape_of(m: Measurement) -> Shape:
    """The shape a measurement ran: its preset at the default vocab_size and block_size (the benchmarks' own)."""
    return Shape(m.model, **PRESETS[m.model], vocab_size=50304, block_size=1024, seq_len=m.seq_len)


def gpu_hardware(cfg: TrainConfig, gpu: GPUModel, gpus: int, mfu: float | None = None,
                 mfu_flag: str = "--mfu") -> Hardware:
    """gpus x gpu at an MFU: the one given (mfu_flag), else the one measured for this configuration on this GPU
    model, else DEFAULT_MFU, assumed. The peak is the config's peak_flops where set, else the table's."""
    peak, peak_source = gpu.bf16_flops, f"{gpu.name}'s bf16 peak of {gpu.bf16_flops / 1e12:,.0f} TFLOP/s"
    if cfg.runtime.peak_flops > 0:
        peak = cfg.runtime.peak_flops
        peak_source = f"the config's peak_flops, {peak / 1e12:,.0f} TFLOP/s"
    this_config = [m for m in MEASUREMENTS if not differences(cfg, m)]
    measurement = next((m for m in this_config if m.gpu == gpu.name), None)
    if mfu is not None:
        how = f"given: MFU {mfu:.1%} ({mfu_flag})"
    elif measurement is not None:
        mfu = measured_mfu(measurement)
        how = (f"{measurement.label()}: MFU {mfu:.1%} ({measurement.tokens_per_sec:,.0f} tokens/s on one GPU, "
               f"{measurement.source})" + (f"; on {gpus} GPUs DDP's all-reduce is taken as hidden behind the "
                                           f"backward" if gpus > 1 else ""))
    else:
        mfu = DEFAULT_MFU
        elsewhere = [f"{measured_mfu(m):.1%} {m.label()} for this configuration" for m in this_config] + [
            f"{measured_mfu(m):.1%} {m.label()} with {', '.join(differs)}, which this run does not have"
            for m in MEASUREMENTS
            if m.gpu == gpu.name and (differs := differences(cfg, m))]
        how = (f"assumed: MFU {mfu:.0%} (llm.c's published ~41% on an H100, rounded down); nothing "
               f"measured for this configuration on {gpu.name} GPUs" + (f" ({'; '.join(elsewhere)})" if elsewhere
                                                                        else ""))
    return Hardware(f"{gpus} x {gpu.name}", gpus, peak * gpus * mfu, f"{how}; x {peak_source}", gpu, measurement,
                    this_config[0] if this_config else None)


def measured_hardware(name: str, flops_per_sec: float, source: str) -> Hardware:
    """A device whose rate was measured (ladder.py times this CPU with scripts/bench.py)."""
    return Hardware(name, 1, flops_per_sec, source)


# --- counts over the run ------------------------------------------------------------------------------------

def eval_count(max_steps: int, interval: int, after: int = -1) -> int:
    """How many evaluations run at steps past `after` (evals/base.py's Evaluator.due: every interval steps from
    step 0, and after the last one; interval 0: after the last one only). Counted, not listed: a ladder's dry run
    may plan more steps than a list holds."""
    if after >= max_steps:
        return 0
    if interval <= 0:
        return 1
    multiples = max_steps // interval - (after // interval if after >= 0 else -1)  # k * interval in (after, max]
    return multiples + (1 if max_steps % interval else 0)


def checkpoint_count(max_steps: int, interval: int, final: bool) -> int:
    """How many saves a run makes (training/checkpoint/checkpointer.py's due): every interval steps, never step 0,
    and after the last one with final_checkpoint."""
    every = max_steps // interval if interval > 0 else 0
    return every + (1 if final and (interval <= 0 or max_steps % interval) else 0)


def passes(cfg: TrainConfig, interval: int) -> tuple[int, int]:
    """(evaluations of the live weights, of the EMA's) at an interval: with an EMA, an averaged evaluation runs
    again on the average at every step past its start (evals/periodic.py; training/optim/ema.py's start_step)."""
    live = eval_count(cfg.schedule.max_steps, interval)
    if not cfg.ema.ema_decay:
        return live, 0
    return live, eval_count(cfg.schedule.max_steps, interval, after=cfg.ema.start_step(cfg.schedule.max_steps))


def source_folders(data_dir: str) -> list[str]:
    """The folders of data_dir: one, or a mixture's `folder:weight,...` (data/mixture.py's parse_sources, which the
    configuration has already checked it against)."""
    parts = [p.strip() for p in data_dir.split(",") if p.strip()]
    if len(parts) <= 1 and ":" not in data_dir:
        return [data_dir]
    return [part.rpartition(":")[0] for part in parts]


def val_windows(cfg: TrainConfig) -> int:
    """Val windows of val_tokens each pass scores: one per val set (val_sets' names), else one per source of
    data_dir (data/mixture.py's parse_val_sets)."""
    text = cfg.evaluation.val_sets
    return len([p for p in text.split(",") if p.strip()]) if text else len(source_folders(cfg.data.data_dir))


def prepared_tokens(data_dir: str) -> int | None:
    """The tokens the data folders hold, from the manifests their preps wrote last (data/manifest.py); None where a
    folder holds no single finished prep's manifest."""
    total = 0
    for folder in source_folders(data_dir):
        manifests = sorted(Path(folder).glob("*_manifest.json"))
        if len(manifests) != 1:
            return None
        try:
            total += sum(int(shard["tokens"]) for shard in json.loads(manifests[0].read_text())["shards"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
    return total


def optimizer_bytes(shape: Shape, optimizer: str) -> float:
    """Bytes of optimizer state: AdamW's two float32 moments (8 bytes) for every parameter; Muon's one momentum (4)
    for the blocks' weight matrices (12 n_embd^2 a block: training/optim/optimizers/muon.py) and AdamW's on the rest."""
    if optimizer != "muon":
        return 8 * shape.params
    matrices = 12 * shape.n_embd**2 * shape.n_layer
    return 4 * matrices + 8 * (shape.params - matrices)


def checkpoint_bytes(cfg: TrainConfig, shape: Shape) -> float:
    """One checkpoint's bytes on disk: the float32 weights (4 bytes a parameter), the optimizer state, the EMA's
    float32 copy where there is one; the tied token table is stored a second time (as lm_head.weight) except in a
    file that DDP wrote (docs/PERFORMANCE.md, "Checkpoints": 1.49 GB for gpt2 there, 1.65 GB otherwise). The rest
    (step, data position, random states, config) is a few kilobytes."""
    tied_twice = cfg.resolved_checkpoint_format() == "sharded" or SHARDS_STATE[cfg.runtime.strategy]
    weights = 4 * shape.params * (2 if cfg.ema.ema_decay else 1)
    return weights + optimizer_bytes(shape, cfg.optimizer.optimizer) + \
        (4 * shape.vocab_size * shape.n_embd if tied_twice else 0)


# --- the estimate ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Estimate:
    """A run's figures (seconds, bytes, dollars) and the lines that print them with their sources."""

    shape: Shape
    steps: int
    tokens: int
    train_flops: float
    hardware: Hardware
    train_s: float
    val_s: float
    hellaswag_s: float
    checkpoint_s: float
    startup_s: float  # 0 where nothing was measured (the figures say so)
    checkpoint_bytes: float
    checkpoints_on_disk: int
    shard_bytes: float  # the tokens the run reads
    memory_bytes: float | None  # per GPU; None for a device that is not a GPU
    dollars: float | None  # None without a price
    figures: tuple[Figure, ...]

    @property
    def eval_s(self) -> float:
        return self.val_s + self.hellaswag_s

    @property
    def total_s(self) -> float:
        return self.train_s + self.eval_s + self.checkpoint_s + self.startup_s

    @property
    def device_hours(self) -> float:
        return self.total_s / 3600 * self.hardware.devices

    def text(self, title: str) -> str:
        """What --estimate prints: a title, then each figure and, under it, where it comes from."""
        width = max(len(f.label) for f in self.figures) + 2
        lines = [title, ""]
        for f in self.figures:
            lines += [f"{f.label:<{width}}{f.value}"] + ([f"{'':<{width}}{f.source}"] if f.source else [])
        return "\n".join(lines) + "\n"


def duration(seconds: float) -> str:
    """A time as it reads best: seconds, minutes or hours."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def estimate(cfg: TrainConfig, hardware: Hardware, price: float | None = None) -> Estimate:
    """The whole run that cfg describes, on `hardware`; dollars at `price` per device-hour (--price)."""
    shape = model_shape(cfg)
    schedule, data, evaluation, checkpoint = cfg.schedule, cfg.data, cfg.evaluation, cfg.checkpoint
    figures: list[Figure] = []
    rate = hardware.flops_per_sec

    # the model and the training
    per_token = shape.flops_per_token()
    steps, tokens = schedule.max_steps, schedule.max_steps * data.total_batch_size
    train_flops = float(per_token * tokens)
    L, H, C, T = shape.n_layer, shape.n_head, shape.n_embd, shape.seq_len
    figures += [
        Figure("parameters", f"{shape.params:,} ({shape.name}: {L} layers, {H} heads, {C} wide, vocab "
                             f"{shape.vocab_size:,}); N = {shape.non_embedding_params:,} without the position table",
               "derived: the shape's count (model_size.py; model.py's num_params counts the same)"),
        Figure("tokens", f"{tokens:,} = {steps:,} steps x {data.total_batch_size:,} tokens",
               "config: max_steps x total_batch_size"),
        Figure("FLOPs", f"{train_flops:.3e} = {per_token:,} a token x {tokens:,} tokens",
               f"derived: 6N + 12 L H Q T a token, T = {T:,} (model_size.py's flops_per_token, what the trainer's "
               f"MFU counts)"),
        Figure("speed", f"{rate:.3e} FLOP/s on {hardware.name}", hardware.source),
    ]
    train_s = train_flops / rate
    figures.append(Figure("training", duration(train_s), f"derived: {train_flops:.3e} FLOPs / {rate:.3e} FLOP/s"))

    # evaluations: a forward is a third of a training step's FLOPs a token (model_size.flops_per_token)
    live, averaged = passes(cfg, evaluation.eval_interval)
    windows = val_windows(cfg)
    val_tokens = float(live + averaged) * windows * evaluation.val_tokens  # a float: a dry run's budget may be vast
    val_s = val_tokens * per_token / 3 / rate
    ema = f" (+{averaged} of the EMA)" if averaged else ""
    sets = f"{windows} val set{'s' if windows > 1 else ''}"
    figures.append(Figure("val", f"{duration(val_s)}: {live} passes{ema} x {sets} of {evaluation.val_tokens:,} tokens",
                          "derived: forward FLOPs (a third of training's a token) at the training speed; passes "
                          "every eval_interval steps, at step 0 and after the last"))
    hellaswag_s = 0.0
    if evaluation.hellaswag_interval:
        live, averaged = passes(cfg, evaluation.hellaswag_interval)
        examples = evaluation.hellaswag_limit or HELLASWAG_EXAMPLES
        row_tokens = float(live + averaged) * examples * HELLASWAG_ROWS * HELLASWAG_ROW_TOKENS
        hellaswag_s = row_tokens * shape.flops_per_token(HELLASWAG_ROW_TOKENS) / 3 / rate
        ema = f" (+{averaged} of the EMA)" if averaged else ""
        figures.append(Figure("HellaSwag", f"{duration(hellaswag_s)}: {live} passes{ema} x {examples:,} examples",
                              f"assumed: {HELLASWAG_ROWS} rows of {HELLASWAG_ROW_TOKENS} tokens an example (a context "
                              f"and one ending, padded; not measured here), forward FLOPs at the training speed"))
    else:
        figures.append(Figure("HellaSwag", "none", "config: hellaswag_interval 0"))

    # checkpoints
    saves = checkpoint_count(steps, checkpoint.checkpoint_interval, checkpoint.final_checkpoint)
    one = checkpoint_bytes(cfg, shape)
    layout = cfg.resolved_checkpoint_format()
    checkpoint_s = saves * one / SAVE_RATE[layout]
    figures.append(Figure("checkpoints", f"{duration(checkpoint_s)}: {saves} saves of {one / GB:.2f} GB ({layout})",
                          f"assumed: {SAVE_RATE[layout] / GB:.2f} GB/s, the {layout} format's rate measured on "
                          f"{SAVE_RATE_SOURCE}"))

    # start-up: measured for this configuration on this GPU model, or taken from another's measurement of it
    startup_s, m = 0.0, hardware.this_config
    if m is None:
        figures.append(Figure("start-up", "not counted", "nothing measured for this configuration"))
    else:
        startup_s = m.startup_s
        measured = m is hardware.measurement
        figures.append(Figure("start-up", duration(startup_s),
                              f"{'' if measured else 'assumed the same as '}{m.label()}: launch to the first step, "
                              f"compilation into an empty cache included"))

    total = train_s + val_s + hellaswag_s + checkpoint_s + startup_s
    hours = "" if total >= 7200 else f" ({total / 3600:.2f} h)"  # duration() gives hours from 2 on
    figures.append(Figure("hours", f"{duration(total)}{hours} on {hardware.name}: "
                                   f"{total / 3600 * hardware.devices:.1f} device-hours",
                          "derived: training + val + HellaSwag + checkpoints + start-up"))
    dollars = None
    if price is not None:
        dollars = total / 3600 * hardware.devices * price
        figures.append(Figure("dollars", f"${dollars:,.2f} at ${price:,.2f} per GPU-hour",
                              "derived: device-hours x the price (given: --price)"))
    figures.append(Figure("evaluations", f"{duration(val_s + hellaswag_s)} of the hours (val and HellaSwag)",
                          "derived: the val and HellaSwag lines above"))

    # disk
    shard_bytes = 2.0 * tokens  # uint16 tokens (data/shards.py)
    held = prepared_tokens(data.data_dir)
    kept = min(saves, checkpoint.keep_last + 1)  # the newest keep_last, and the next while it is written
    data_words = f"{shard_bytes / GB:.1f} GB of shards for the {tokens:,} tokens read"
    data_source = "derived: 2 bytes a token (uint16 shards)"
    if held is not None:
        data_words += f"; {data.data_dir} holds {held:,} tokens, {2 * held / GB:.1f} GB"
        data_source += "; the folder's tokens: measured, its prep's manifest"
    figures.append(Figure("disk, data", data_words, data_source))
    figures.append(Figure("disk, checkpoints", f"{kept * one / GB:.2f} GB: {kept} x {one / GB:.2f} GB",
                          f"derived: float32 weights (4 bytes a parameter), the optimizer's state ("
                          f"{optimizer_bytes(shape, cfg.optimizer.optimizer) / shape.params:.1f} bytes a parameter, "
                          f"{cfg.optimizer.optimizer})"
                          f"{' and the EMA' if cfg.ema.ema_decay else ''}; keep_last {checkpoint.keep_last}, and one "
                          f"more while the next is written"))
    # memory per GPU
    memory = None
    if hardware.gpu is not None:
        memory, words, source = gpu_memory(cfg, shape, hardware)
        figures.append(Figure("memory per GPU", words, source))
    figures.append(Figure("not counted", "text samples, data prep and download, the report card", ""))
    return Estimate(shape, steps, tokens, train_flops, hardware, train_s, val_s, hellaswag_s, checkpoint_s, startup_s,
                    one, kept, shard_bytes, memory, dollars, tuple(figures))


def recompute_every(cfg: TrainConfig) -> int:
    """Blocks recomputed: one in every N (0: none), as the runtime section's activation_checkpointing says."""
    setting = cfg.runtime.activation_checkpointing
    return {"none": 0, "full": 1}.get(setting, cfg.runtime.activation_checkpointing_every)


def auto_micro_batch(cfg: TrainConfig, fits: int, gpus: int) -> int:
    """micro_batch_size auto on a GPU: the largest B that fits and keeps grad_accum_steps whole (a divisor of each
    rank's rows a step: launch/micro_batch.py); 0 where even one sequence does not fit."""
    rows = cfg.data.total_batch_size // cfg.data.seq_len // gpus
    return max((b for b in range(1, min(fits, rows) + 1) if rows % b == 0), default=0)


def gpu_memory(cfg: TrainConfig, shape: Shape, hardware: Hardware) -> tuple[float | None, str, str]:
    """(bytes, the words, the source) of the memory each GPU needs: the model state, and the activations of one
    micro-batch (scripts/memory_table.py's model); beside the card's memory where the table knows it, and the
    measured peak where this configuration was measured."""
    gpus, card = hardware.devices, hardware.card_gib
    strategy = cfg.runtime.strategy
    state = state_bytes(shape.params, optimizer_bytes(shape, cfg.optimizer.optimizer), SHARDS_STATE[strategy], gpus,
                        ema=bool(cfg.ema.ema_decay))
    every = recompute_every(cfg)
    costs = scaled_activation_costs(shape, fused_loss(cfg), every)
    per_sequence = costs.per_sequence(shape.n_layer, every)
    batch, chosen = cfg.data.micro_batch_size, ""
    if batch is None:  # auto: what the trainer's probe would find, by this model
        if card is None:
            return None, (f"micro_batch_size auto: the largest B that fits; {hardware.gpu.name}'s memory is not in "
                          f"the table"), f"model state {state / GIB:.1f} GiB, activations {per_sequence / GIB:.2f} " \
                                      f"GiB a sequence: derived, scripts/memory_table.py's model"
        batch = auto_micro_batch(cfg, largest_batch(card, state, costs, per_sequence), gpus)
        chosen = f" (auto: the largest B that fits in {HEADROOM:.0%} of the card and divides the step)"
    else:
        cfg.data.grad_accum_steps(gpus)  # a batch that does not divide over these GPUs: the trainer's own error
    total = state + costs.fixed + batch * per_sequence
    words = (f"{total / GIB:.1f} GiB = {state / GIB:.1f} GiB of model state ({strategy}, {cfg.optimizer.optimizer}) "
             f"+ {batch} sequence{'s' if batch != 1 else ''}{chosen} x {per_sequence / GIB:.2f} GiB of activations + "
             f"{costs.fixed / GIB:.2f} "
             f"GiB whatever the batch (" + ("the bf16 copies of the blocks' weights, the fused loss's float32 (V, C) "
                                            "gradient)" if fused_loss(cfg) else "the bf16 copies of the weights)"))
    source = (f"derived: scripts/memory_table.py's model, the model state exact, the activations (eager) "
              f"{ACTIVATIONS_MEASURED}" + ("" if fused_loss(cfg) else "; the plain loss's transient float32 logits "
                                                                     "gradient in its backward not counted"))
    needed = total
    if (m := hardware.this_config) is not None:  # what the card must hold is what was measured, where it was
        words += f"; {m.peak_memory_gib:g} GiB measured for this configuration"
        source += f"; {m.label()}: the peak of torch.cuda.max_memory_allocated over its timed steps, compiled"
        needed = max(total, m.peak_memory_gib * GIB)
    if card is not None:
        fits = needed <= card * GIB * HEADROOM
        words += f"; {'fits' if fits else 'does NOT fit'} in {HEADROOM:.0%} of the {hardware.gpu.name}'s {card:g} GiB"
    return total, words, source


# --- the trainer's flags: --estimate and what it is worked out for ---------------------------------------------

@dataclass(frozen=True)
class EstimateFlags:
    gpu: GPUModel
    gpus: int
    price: float | None
    mfu: float | None


# Flags of the trainer's command line that are no config key (a test checks they never become one): --estimate
# prints the estimate instead of training; the others say what for, and go only with it.
ESTIMATE = "estimate"
VALUED = {"gpu": "a GPU model of the table (H100, or the name nvidia-smi prints)", "gpus": "how many GPUs",
          "price": "dollars per GPU-hour", "mfu": "the MFU to assume, in (0, 1]"}


def usage() -> str:
    """The end of the trainer's --help: these flags, laid out as its keys are."""
    flags = [("--estimate", "print what the run would cost, each figure with where it comes from, and exit "
                            "(nothing trains)"),
             ("--gpu NAME", f"{VALUED['gpu']}: {', '.join(g.name for g in GPU_MODELS)}"),
             ("--gpus N", f"{VALUED['gpus']} (default: 1)"),
             ("--price DOLLARS", f"{VALUED['price']} (default: no dollars)"),
             ("--mfu F", f"{VALUED['mfu']} (default: the one measured for this configuration on that GPU model, "
                         f"else {DEFAULT_MFU:.0%}, assumed)")]
    lines = ["", "estimate, instead of training (flags, not config keys):", "",
             "    python train_gpt2.py --config configs/gpt2_124m.yaml --estimate --gpu H100 --gpus 8 --price 2.5", ""]
    for flag, words in flags:
        lines += [f"  {flag}", textwrap.fill(words, 92, initial_indent=" " * 8, subsequent_indent=" " * 8)]
    return "\n".join(lines) + "\n"


def wants_estimate(argv: list[str]) -> bool:
    """Whether the trainer's argv asks for --estimate (it takes no value)."""
    return any(arg == f"--{ESTIMATE}" or arg.startswith(f"--{ESTIMATE}=") for arg in argv)


def estimate_flags(argv: list[str]) -> tuple[EstimateFlags, list[str]]:
    """(the estimate's flags, the rest of argv: the configuration's) from the trainer's argv. A ConfigError names a
    flag without its value, a value that is not one, or a GPU model that is not in the table."""
    given: dict[str, str] = {}
    rest: list[str] = []
    words = iter(argv)
    for arg in words:
        key, equals, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if key == ESTIMATE:
            require(not equals, f"--{ESTIMATE}", f"takes no value, got {value!r}")
        elif key in VALUED:
            if not equals:
                value = next(words, None)
                require(value is not None and not value.startswith("--"), f"--{key}", f"missing value: {VALUED[key]}")
            require(key not in given, f"--{key}", "given twice")
            given[key] = value
        else:
            rest.append(arg)
    require("gpu" in given, "--gpu", f"name the GPU model to estimate for: {VALUED['gpu']}")
    return EstimateFlags(find_gpu(given["gpu"], "--gpu"), number(given, "gpus", int, 1, low=1),
                         number(given, "price", float, None, low=0), number(given, "mfu", float, None, low=0, high=1),
                         ), rest


def number(given: dict[str, str], key: str, kind: type, default, low: float, high: float | None = None):
    """A flag's number: its kind, finite, at least low (above it for a float), at most high."""
    if key not in given:
        return default
    try:
        value = kind(given[key])
    except ValueError:
        raise ConfigError(f"--{key}: expected {'a whole number' if kind is int else 'a number'}, "
                          f"got {given[key]!r}") from None
    bound = f"at least {low}" if kind is int else f"above {low:g}" + ("" if high is None else f" and at most {high:g}")
    ok = math.isfinite(value) and (value >= low if kind is int else value > low) and (high is None or value <= high)
    require(ok, f"--{key}", f"must be {bound}, got {given[key]}")
    return value


def estimate_text(cfg: TrainConfig, flags: EstimateFlags, command: str) -> str:
    """What the trainer's --estimate prints for cfg, the configuration `command` gave."""
    hardware = gpu_hardware(cfg, flags.gpu, flags.gpus, flags.mfu)
    title = (f"Estimate of `{command}` on {hardware.name}: nothing is trained. Each figure, then where it comes "
             f"from (config, derived, measured, assumed or given).")
    return estimate(cfg, hardware, flags.price).text(title)
