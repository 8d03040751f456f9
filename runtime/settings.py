"""The runtime section: the device, the precision, the kernels, the seed, and how the ranks share the model.

Its keys are read beside it (runtime/runtime.py's resolve_runtime: device, dtype, compile, loss chunking, the
FLOP/s peak, recomputation; deterministic_kernels) and by training/distributed/strategies.py (the strategy), whose
names it checks the `strategy` key against and whose help it lists (STRATEGY_INFO).

Torch-free, as every settings section is (launch/config.py): the trainer checks a configuration
before it imports torch. So the strategies are described here, by name, and strategies.py's classes
(STRATEGIES, under the same names) are the rest of them; make_runtime imports runtime.py when it is called.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from common.settings import OrNone, Settings, dropout_on, option, require, section

if TYPE_CHECKING:
    from runtime.runtime import Runtime


class StrategyInfo(NamedTuple):
    """What the configuration knows of a strategy: strategies.py's class of that name is the rest of it."""

    help: str  # what it does, in a few words: the `strategy` key's help lists them
    # what checkpoint_format auto means: file (rank 0 gathers and writes everything) or sharded (every rank
    # writes its part); sharded where one writer gathering everything does not scale
    default_checkpoint_format: str


# Every strategy by name, each a class of strategies.py's STRATEGIES (tests/test_strategy.py checks the names match).
STRATEGY_INFO: dict[str, StrategyInfo] = {
    "ddp": StrategyInfo("a full copy per rank", "file"),
    "fsdp": StrategyInfo("parameters, gradients and AdamW state sharded, like ZeRO-3", "sharded"),
    "fsdp_zero2": StrategyInfo("fsdp keeping a block's parameters gathered from its forward to its backward",
                               "sharded"),
}


def strategies_help() -> str:
    """The strategies with what each does, for the `strategy` key's help: "a (...), b (...) or c (...)"."""
    described = [f"{name} ({info.help})" for name, info in STRATEGY_INFO.items()]
    return " or ".join(filter(None, [", ".join(described[:-1]), described[-1]]))


# The longest hang_timeout_minutes: a year, longer than any run waits on a hung rank. Far longer values overflow
# where the timeout is set after the first step, on every rank: datetime.timedelta past ~2.7 million years, gloo's
# timeout (a 64-bit count) before that.
MAX_HANG_TIMEOUT_MINUTES = 365 * 24 * 60

DEVICES = ("auto", "cuda", "mps", "cpu")
DTYPES = ("auto", "bfloat16", "float16", "float32", "float64")
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
LOSS_KERNELS = ("torch", "triton")  # model.py's F.cross_entropy, or runtime/kernels/cross_entropy.py's kernel


@section
class RuntimeSettings(Settings):
    """The runtime section: resolved into the launch's Runtime (`make_runtime`), its strategy made by
    strategies.py's make_strategy, its hang timeout set on the process group after the first step."""

    SECTION = "runtime"
    SUMMARY = "device, precision, kernels, the seed, and how the ranks share the model"

    device: str = option("auto", "auto, cuda, cuda:N, mps or cpu", on_resume="trajectory")
    dtype: str = option("auto", "auto (CUDA: bfloat16 autocast, or float16 with a gradient scaler on GPUs without "
                             "bf16 such as V100/T4; CPU: bfloat16 autocast on CPUs with AMX, and on AMD CPUs with "
                             "AVX512-BF16, where it is faster, else float32; MPS: float32), bfloat16, float16, "
                             "float32, or float64 (weights and math, for numerical checks)", on_resume="trajectory")
    compile: OrNone[bool] = option(None, "torch.compile the model (null: on for CUDA)", on_resume=dropout_on)
    compile_mode: str = option("default", "torch.compile's mode: default, or max-autotune-no-cudagraphs (Inductor "
                                          "times Triton templates beside cuBLAS for each matrix product and keeps "
                                          "the fastest; minutes more compilation)", on_resume=dropout_on)
    seed: int = option(1337, "seed of the initial weights, epoch shuffles, dropout and samples", on_resume="trajectory")
    deterministic: bool = option(False, "only kernels that give the same bits for the same inputs, so two runs "
                                        "with the same seed and data log the same losses (slower on GPUs: see "
                                        "docs/PERFORMANCE.md; on CPUs the kernels mostly are already)",
                                 on_resume=dropout_on)
    loss_chunk_size: OrNone[int] = option(None, "fused chunked lm_head + cross-entropy in chunks of N tokens, never "
                                             "holding the whole logits (0: plain; null: 8192 on CUDA without compile)",
                                          on_resume="none")
    loss_kernel: str = option("torch", "the plain loss's cross-entropy: torch (F.cross_entropy over float32 "
                                       "logits, two passes) or triton (one kernel writes each row's loss and its "
                                       "gradient in the forward, reading the bf16 logits once; where Triton or CUDA "
                                       "is absent, the same math in torch)", on_resume="none")
    fused_residual_norm: bool = option(False, "each block's attention residual add and the layer norm after it in "
                                              "one Triton kernel forward and one backward (torch.compile fuses them "
                                              "already: for eager runs); the same math", on_resume="none")
    fp8_lm_head: bool = option(False, "the lm_head's matrix products in FP8 with per-tensor dynamic scales "
                                      "(torch._scaled_mm; CUDA GPUs with FP8: compute capability 8.9+); modern "
                                      "recipe only (optimizer muon): it changes the numerics", on_resume="trajectory")
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
    ddp_bucket_cap_mb: OrNone[float] = option(None, "strategy ddp: MB of gradients per all-reduce bucket (null: "
                                                    "DDP's default, 25)", on_resume="none")
    ddp_gradient_as_bucket_view: bool = option(False, "strategy ddp: each gradient a view into its all-reduce "
                                                      "bucket (no copy into and out of the buckets, less memory)",
                                               on_resume="none")
    ddp_static_graph: bool = option(False, "strategy ddp: tell DDP every step uses the same parameters, so it "
                                           "skips its search for unused ones and may reorder its buckets once; "
                                           "only where grad_accum_steps is 1 (it does not take accumulation)",
                                    on_resume="none")
    hang_timeout_minutes: float = option(15.0, "after the first step, a collective that waits longer fails the run "
                                            "(a rank hung or died); start-up gets 30 minutes", on_resume="none")

    def make_runtime(self, local_rank: int = 0) -> Runtime:
        """The Runtime these settings make on this process: auto values resolved for its device (torch's
        runtime, imported now: the settings are read before torch is)."""
        from runtime.runtime import DDPOptions, resolve_runtime

        return resolve_runtime(self.device, self.dtype, self.compile, self.loss_chunk_size, self.peak_flops,
                               local_rank, self.recompute_every(), compile_mode=self.compile_mode,
                               loss_kernel=self.loss_kernel, fused_residual_norm=self.fused_residual_norm,
                               fp8_lm_head=self.fp8_lm_head, ddp=DDPOptions(self.ddp_bucket_cap_mb,
                                                                            self.ddp_gradient_as_bucket_view,
                                                                            self.ddp_static_graph))

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
        require(self.compile_mode in COMPILE_MODES, "compile_mode",
                f"unknown mode {self.compile_mode!r}; choose {' or '.join(COMPILE_MODES)}")
        require(self.loss_kernel in LOSS_KERNELS, "loss_kernel",
                f"unknown kernel {self.loss_kernel!r}; choose {' or '.join(LOSS_KERNELS)}")
        for key, on in (("loss_kernel", self.loss_kernel != "torch"), ("fp8_lm_head", self.fp8_lm_head)):
            require(not on or not self.loss_chunk_size, key,
                    f"{getattr(self, key)} makes the whole logits, and loss_chunk_size {self.loss_chunk_size} asks for "
                    f"chunks of them: set loss_chunk_size 0 (or null)")
        require(self.ddp_bucket_cap_mb is None or self.ddp_bucket_cap_mb > 0, "ddp_bucket_cap_mb",
                f"must be positive, got {self.ddp_bucket_cap_mb}")
        require(self.strategy in STRATEGY_INFO, "strategy",
                f"unknown strategy {self.strategy!r}; choose {', '.join(STRATEGY_INFO)}")
        require(self.activation_checkpointing in ACTIVATION_CHECKPOINTING, "activation_checkpointing",
                f"unknown value {self.activation_checkpointing!r}; choose {', '.join(ACTIVATION_CHECKPOINTING)}")
        require(self.activation_checkpointing_every >= 1, "activation_checkpointing_every",
                f"must be positive, got {self.activation_checkpointing_every}")
        require(0 < self.hang_timeout_minutes <= MAX_HANG_TIMEOUT_MINUTES, "hang_timeout_minutes",
                f"must be positive and at most {MAX_HANG_TIMEOUT_MINUTES} (a year), got {self.hang_timeout_minutes}")
