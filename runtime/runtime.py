"""Where and how the math runs: device, precision, compile, loss chunking, recomputation, kernels, the FLOP/s peak.

One resolution of the `auto` settings, shared by the trainer and scripts/bench.py, so both report
what really runs: `--device cpu` on a machine with a GPU means no compile, no bf16 unless the
CPU has it, and the CPU's name.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from common.errors import ConfigError
from common.settings import require
from runtime.metrics import detect_peak_flops

# The fused chunked lm_head + cross-entropy never holds the (B*T, V) logits: at B=64, T=1024
# that saves about 30 GB where no compiler fuses the cross-entropy (eager mode on a GPU).
DEFAULT_LOSS_CHUNK = 8192


# The compile modes the `compile_mode` key takes: torch.compile's default, or Inductor timing several kernels
# (Triton templates beside cuBLAS for the matrix products) and keeping the fastest, without CUDA graphs.
FP8_CAPABILITY = (8, 9)  # the first CUDA compute capability with FP8 matrix units (Ada; Hopper is 9.0)


@dataclass(frozen=True)
class DDPOptions:
    """DistributedDataParallel's gradient buckets (the runtime keys ddp_*); the defaults are DDP's own."""

    bucket_cap_mb: float | None = None  # None: DDP's default (25 MB)
    gradient_as_bucket_view: bool = False  # each .grad a view into its all-reduce bucket: no copy in or out
    static_graph: bool = False  # the same parameters get gradients every step: DDP may skip its per-step search

    def kwargs(self) -> dict:
        """DistributedDataParallel's keyword arguments for the values set: none at the defaults, so that the
        wrapper is made exactly as without these keys."""
        defaults = DDPOptions()
        return {name: getattr(self, name) for name in ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph")
                if getattr(self, name) != getattr(defaults, name)}


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    dtype: str  # bfloat16 or float16 (autocast over float32 weights), float32, or float64 (weights and math)
    compile: bool
    loss_chunk_size: int  # 0: the plain lm_head + cross-entropy
    peak_flops: float | None  # bf16 FLOP/s of one device, for MFU; None where unknown
    device_name: str
    recompute_every: int = 0  # activation checkpointing: one block in every N recomputed in backward (0: none)
    compile_mode: str = "default"  # torch.compile's mode (runtime_settings.py's COMPILE_MODES)
    loss_kernel: str = "torch"  # runtime_settings.py's LOSS_KERNELS
    fused_residual_norm: bool = False  # the blocks' residual add + ln_2 by runtime/kernels/add_layer_norm.py
    fp8_lm_head: bool = False  # the lm_head's matrix products in FP8 (runtime/kernels/fp8.py)
    ddp: DDPOptions = field(default_factory=DDPOptions)
    # what the training forward is handed, made once from the fields above (a new callable per step would
    # make torch.compile check, or retrace, it every step): GPT.forward's loss_head, GPT.fuse_residual_norms'
    loss_head: Callable | None = field(default=None, compare=False, repr=False)
    add_norm: Callable | None = field(default=None, compare=False, repr=False)

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def weights_dtype(self) -> torch.dtype:
        return torch.float64 if self.dtype == "float64" else torch.float32

    @property
    def loss_scaling(self) -> bool:
        """float16's narrow range needs the gradient scaler (training/run/step.py); bfloat16's does not."""
        return self.dtype == "float16"

    def compiled(self, model: torch.nn.Module) -> torch.nn.Module:
        """torch.compile(model) in compile_mode; the default mode is the call without a mode, as before the key."""
        if self.compile_mode == "default":
            return torch.compile(model)
        return torch.compile(model, mode=self.compile_mode)

    def levers(self) -> list[str]:
        """The speed settings away from their defaults, as the startup line names them (with where a kernel
        falls back to torch: no CUDA, or no Triton)."""
        fallback = ""
        if self.loss_kernel != "torch" or self.fused_residual_norm:  # only then is Triton looked for
            from runtime.kernels.triton_support import kernels_available

            if not kernels_available(self.device):
                fallback = " (torch fallback: no Triton kernel on this device)"
        described = [f"compile_mode {self.compile_mode}" if self.compile and self.compile_mode != "default" else "",
                     f"loss_kernel {self.loss_kernel}{fallback}" if self.loss_kernel != "torch" else "",
                     f"fused_residual_norm{fallback}" if self.fused_residual_norm else "",
                     "fp8_lm_head" if self.fp8_lm_head else "",
                     *(f"ddp {key} {value}" for key, value in self.ddp.kwargs().items())]
        return [text for text in described if text]

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's precision context: bf16 or fp16 autocast, or nothing."""
        half = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(self.dtype)
        return torch.autocast(device_type=self.device.type, dtype=half or torch.bfloat16, enabled=half is not None)


@contextlib.contextmanager
def deterministic_kernels(enabled: bool):
    """Within: only kernels that give the same bits for the same inputs (the `deterministic` key).

    Enter it before any CUDA work: cuBLAS reads CUBLAS_WORKSPACE_CONFIG when it makes its first
    handle, and a fixed workspace is what makes its split reductions repeatable. Then every op
    with a deterministic kernel uses it and one without raises instead of varying silently;
    cuDNN stops timing algorithms; and Inductor stops timing kernel candidates on the device,
    which could pick differently-rounding kernels in two processes (torch switches that on with
    the rest where it can; set here too for releases that keep it apart). New tensors are not
    filled with NaN first (torch's fill_uninitialized_memory): that only makes a program that
    reads memory it never wrote repeatable, and the trainer reads none, while the fill writes
    every new buffer once more. The process-wide switches and the variable are put back on
    leaving (tests run the trainer in-process; a cuBLAS handle made meanwhile keeps its workspace).
    """
    if not enabled:
        yield
        return
    import torch._inductor.config as inductor_config
    import torch.utils.deterministic as torch_deterministic

    algorithms = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    cudnn = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    inductor = getattr(inductor_config, "deterministic", None)
    fill = torch_deterministic.fill_uninitialized_memory
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    if inductor is not None:
        inductor_config.deterministic = True
    torch_deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(algorithms[0], warn_only=algorithms[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn
        if inductor is not None:
            inductor_config.deterministic = inductor
        torch_deterministic.fill_uninitialized_memory = fill
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def resolve_runtime(device: str, dtype: str, compile: bool | None, loss_chunk_size: int | None,
                    peak_flops: float = 0.0, local_rank: int = 0, recompute_every: int = 0,
                    compile_mode: str = "default", loss_kernel: str = "torch", fused_residual_norm: bool = False,
                    fp8_lm_head: bool = False, ddp: DDPOptions | None = None) -> Runtime:
    """The Runtime for the config's device/dtype/compile/loss_chunk_size/peak_flops values (and
    recompute_every: the config's recompute_every(), its activation_checkpointing), and the speed settings
    (compile_mode, loss_kernel, fused_residual_norm, fp8_lm_head, the ddp_* keys), whose defaults are the
    path the trainer took before they existed."""
    from runtime.kernels.heads import make_loss_head

    chosen = pick_device(device, local_rank)
    use_compile = compile if compile is not None else chosen.type == "cuda"
    if loss_chunk_size is None:  # a loss head of its own makes whole logits, not chunks
        own_head = loss_kernel != "torch" or fp8_lm_head
        loss_chunk_size = DEFAULT_LOSS_CHUNK if chosen.type == "cuda" and not use_compile and not own_head else 0
    if fp8_lm_head:
        require(chosen.type == "cuda" and torch.cuda.get_device_capability(chosen) >= FP8_CAPABILITY, "fp8_lm_head",
                f"needs a CUDA GPU with FP8 matrix units (compute capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} "
                f"or newer: Ada, Hopper, Blackwell); this run is on {device_name(chosen)}")
    add_norm = None
    if fused_residual_norm:
        from runtime.kernels.add_layer_norm import add_layer_norm as add_norm
    return Runtime(
        device=chosen, dtype=resolve_dtype(dtype, chosen), compile=use_compile, loss_chunk_size=loss_chunk_size,
        peak_flops=detect_peak_flops(chosen, peak_flops), device_name=device_name(chosen),
        recompute_every=recompute_every, compile_mode=compile_mode, loss_kernel=loss_kernel,
        fused_residual_norm=fused_residual_norm, fp8_lm_head=fp8_lm_head, ddp=ddp or DDPOptions(),
        loss_head=make_loss_head(loss_kernel, fp8_lm_head), add_norm=add_norm,
    )


def pick_device(requested: str, local_rank: int = 0) -> torch.device:
    """auto: this rank's GPU, else MPS, else the CPU. An unavailable device is a ConfigError."""
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank)
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if requested.startswith("cuda"):
        require(torch.cuda.is_available(), "device", f"{requested} requested but CUDA is not available")
        try:
            return torch.device("cuda", local_rank) if requested == "cuda" else torch.device(requested)
        except RuntimeError:
            raise ConfigError(f"device: unknown device {requested!r}; choose auto, cuda, cuda:N, mps or cpu") from None
    require(requested != "mps" or torch.backends.mps.is_available(), "device", "mps requested but MPS is not available")
    require(requested in ("cpu", "mps"), "device",
            f"unknown device {requested!r}; choose auto, cuda, cuda:N, mps or cpu")
    return torch.device(requested)


def cpu_has_native_bf16() -> bool:
    """True on CPUs where bf16 matmuls beat float32 (Linux): Intel with AMX, AMD with AVX512-BF16.

    Measured on the demo (docs/PERFORMANCE.md): an AMD EPYC with AVX512-BF16 runs bf16 2.1x faster
    than float32, but a Xeon that exposes AVX512-BF16 without AMX runs it 1.6x slower.
    """
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read(1 << 16)  # the first CPU's entry is enough
    except OSError:
        return False
    flags = next((line for line in info.splitlines() if line.startswith("flags")), "").split()
    return "amx_bf16" in flags or ("avx512_bf16" in flags and "AuthenticAMD" in info)


def resolve_dtype(requested: str, device: torch.device) -> str:
    """`auto`: bfloat16 autocast on CUDA and on CPUs with native bf16 (float16 on GPUs without
    bf16: V100, T4), float32 elsewhere."""
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    if device.type == "cpu" and cpu_has_native_bf16():
        return "bfloat16"
    return "float32"


def device_name(device: torch.device) -> str:
    """The GPU's name (what MFU is measured against), else the device type."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
