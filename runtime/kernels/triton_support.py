"""Where a Triton kernel can run: Triton importable, and a CUDA tensor, or a CPU one under Triton's interpreter."""

from __future__ import annotations

import os

import torch

try:
    import triton  # noqa: F401  (re-exported: the kernel modules define their kernels only where it imports)
    import triton.language as tl  # noqa: F401
except ImportError:  # a CPU-only install: the ops' torch fallbacks run
    triton = None
    tl = None


def interpreting() -> bool:
    """TRITON_INTERPRET=1: Triton runs kernels in its numpy interpreter, on CPU tensors. Read when the kernel
    modules are imported (triton.jit decides then), so the tests set it before the first import."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernels_available(device: torch.device) -> bool:
    """Whether the ops' Triton kernels run on this device: Triton installed, and CUDA (compiled) or the CPU with
    the interpreter on. Elsewhere (MPS, a CPU without the interpreter, no Triton) their torch fallbacks run."""
    return triton is not None and (device.type == "cuda" or (device.type == "cpu" and interpreting()))


def kernel_runs_on(t: torch.Tensor) -> bool:
    """kernels_available for t's device."""
    return kernels_available(t.device)
