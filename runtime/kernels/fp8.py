"""The lm_head's three matrix products in FP8 (torch._scaled_mm), each operand scaled by its own amax.

The lm_head is the widest matrix product of a GPT-2 step (C=768 in, V=50,304 out: 38.6M of the 124M model's
124M matrix weights, so about 30% of its matrix FLOPs), and an H100/H200 multiplies FP8 at twice its bf16
rate. Every operand is cast to FP8 with a per-tensor scale taken from its current absolute maximum (dynamic
scaling: no state, no history, computed on the device, so no host synchronisation):

    scale = 2^ceil(log2(amax(|t|) / FP8_MAX)),  t_fp8 = fp8(t / scale),  A @ B = scale_a * scale_b * (A_fp8 @ B_fp8)

    forward   logits (N, V) = x (N, C) @ W (V, C)^T          x, W in e4m3 (3 mantissa bits, range 448)
    backward  grad_x (N, C) = grad (N, V) @ W (V, C)         the gradient in e5m2 (2 mantissa bits, range
              grad_W (V, C) = grad (N, V)^T @ x (N, C)       57,344): gradients span more orders of magnitude

with float32 accumulation and bf16 results. _scaled_mm wants its first operand row-major and its second
column-major, which the `.t().contiguous().t()` copies below arrange. Its use is opt-in (`fp8_lm_head`),
for the modern recipe: it changes the model's numerics, which the faithful reproduction keeps as GPT-2's.
"""

from __future__ import annotations

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def to_fp8(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(t / scale in dtype, scale as a float32 0-d tensor). scale is the power of two at or above
    amax(|t|) / dtype's largest value (1 for an all-zero t): |t| / scale stays in range, and dividing by a
    power of two is exact in t's own dtype, so no float32 copy of t is made."""
    amax = t.detach().abs().amax().float()
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / torch.finfo(dtype).max))),
                        torch.ones_like(amax))
    return (t * (1.0 / scale).to(t.dtype)).to(dtype), scale


def scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """a (M, K) @ b (K, N) for FP8 a and b with their scales: a made row-major, b column-major."""
    return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=a_scale, scale_b=b_scale,
                            out_dtype=out_dtype)


class FP8Linear(torch.autograd.Function):
    """x (N, C) @ weight (V, C)^T with FP8 operands; gradients in the inputs' dtypes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        x8, x_scale = to_fp8(x, E4M3)
        w8, w_scale = to_fp8(weight, E4M3)
        ctx.save_for_backward(x8, x_scale, w8, w_scale)
        ctx.dtypes = x.dtype, weight.dtype
        return scaled_mm(x8, x_scale, w8.t(), w_scale, out_dtype)  # (N, V)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x8, x_scale, w8, w_scale = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        g8, g_scale = to_fp8(grad, E5M2)  # (N, V)
        grad_x = scaled_mm(g8, g_scale, w8, w_scale, torch.bfloat16)  # (N, V) @ (V, C)
        grad_w = scaled_mm(g8.t(), g_scale, x8, x_scale, torch.float32)  # (V, N) @ (N, C)
        return grad_x.to(x_dtype), grad_w.to(w_dtype), None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` for x (N, C) and weight (V, C) through FP8, bf16 out (what autocast's bf16 linear gives)."""
    return FP8Linear.apply(x, weight, torch.bfloat16)
