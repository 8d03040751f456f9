"""The mean cross-entropy of logits against targets, its gradient written into the logits' buffer in the forward.

The plain loss (model.py: F.cross_entropy over the upcast logits) goes over the (N, V) logits twice, in two
kernels: the forward reads them for each row's log-sum-exp, and the backward reads them again to make
softmax - one-hot. At N = 65,536 rows (B=64, T=1,024) and V = 50,304, bf16 logits are 6.6 GB, so each pass is
gigabytes of memory traffic. Because the loss is the last op of the graph, its gradient is known in the forward
(the gradient of a mean is 1/N per row, times whatever the caller scales the loss by afterwards), so one
kernel can do both, one program per row:

    pass 1  the row's running maximum m and sum s of exp(x - m), block by block (the online softmax:
            when the maximum rises to m', s becomes s * exp(m - m') + the new block's sum); then
            lse = m + log(s) and the row's loss lse - x[target]
    pass 2  the row again, each entry replaced in place by (exp(x - lse) - [col == target]) / N

A row is 100 KB in bf16, and pass 2 follows pass 1 at once, so on a GPU it reads the row from L2 rather than
from memory: the logits come from memory once and are written once. The logits are consumed: after the forward
their buffer holds the gradient, which is why GPT.forward returns no logits on this path.

What is left for the backward is the chain rule's scalar, the incoming gradient (the 1/grad_accum_steps the
trainer scales each micro-step's loss by). Multiplied into the (N, V) buffer, it would be one more pass over
it, as much memory traffic as the pass saved. linear_cross_entropy owns the lm_head's matrix product too, so
its backward applies the scalar to the two products the buffer feeds, 65 times smaller (V / C):

    d(x @ W^T)/dx = (g * G) @ W = g * (G @ W)   (N, C)        G = (softmax - one-hot) / N   (N, V)
    d(x @ W^T)/dW = (g * G)^T @ x = g * (G^T @ x)   (V, C)    g = the incoming gradient (a scalar)

The kernel is a custom op that declares the mutation (torch.compile sees one op, with a fake implementation for
its tracing), inside autograd.Functions that save the mutated buffer for the backward. Where the Triton
kernel cannot run (no Triton, no CUDA), the same op computes the same outputs with torch, 4,096 rows at a time.
"""

from __future__ import annotations

import torch

from model import autocast_operands
from runtime.kernels.triton_support import kernel_runs_on, tl, triton

FALLBACK_ROWS = 4096  # the torch fallback's rows per chunk: its float32 copy of a chunk stays under 1 GB at V=50,304
MAX_BLOCK = 32768  # columns a program holds at once: 2 blocks per pass at V=50,304, 32 fp32 values per thread


if triton is not None:

    @triton.jit
    def _cross_entropy_rows_kernel(logits_ptr, row_stride, targets_ptr, losses_ptr, grad_scale,
                                   n_cols: tl.constexpr, BLOCK: tl.constexpr):
        """One row: its loss into losses_ptr[row], its gradient (softmax - one-hot) * grad_scale over its logits.
        n_cols (V) is a compile-time constant: one kernel per vocabulary, its loops' trip counts known."""
        row = tl.program_id(0).to(tl.int64)  # 65,536 rows x 50,304 columns overflow 32-bit offsets
        row_ptr = logits_ptr + row * row_stride
        target = tl.load(targets_ptr + row)
        # pass 1: the running maximum and sum of exponentials, in float32 whatever the logits' dtype
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)  # the first block: exp(-inf) = 0
            m = m_new
        lse = m + tl.log(s)
        in_range = (target >= 0) & (target < n_cols)  # a bad target gives a wrong loss, never a stray read
        x_target = tl.load(row_ptr + target, mask=in_range, other=0.0).to(tl.float32)
        tl.store(losses_ptr + row, lse - x_target)
        # pass 2: the same row (still in L2), overwritten by its gradient
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
            grad = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * grad_scale
            tl.store(row_ptr + cols, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def _launch(logits: torch.Tensor, targets: torch.Tensor, losses: torch.Tensor, grad_scale: float) -> None:
    n_rows, n_cols = logits.shape
    block = min(MAX_BLOCK, triton.next_power_of_2(n_cols))
    # 32 warps for the widest blocks (1,024 threads, 32 values each); fewer for small vocabularies
    num_warps = 32 if block >= MAX_BLOCK else max(4, min(32, block // 1024))
    _cross_entropy_rows_kernel[(n_rows,)](logits, logits.stride(0), targets, losses, grad_scale,
                                          n_cols=n_cols, BLOCK=block, num_warps=num_warps)


def _fallback(logits: torch.Tensor, targets: torch.Tensor, losses: torch.Tensor, grad_scale: float) -> None:
    """The kernel's outputs with torch ops, FALLBACK_ROWS rows at a time (float32, or float64 for float64)."""
    compute = torch.promote_types(logits.dtype, torch.float32)
    with torch.autocast(logits.device.type, enabled=False):  # the op's math is in the dtypes written here
        for start in range(0, logits.size(0), FALLBACK_ROWS):
            rows = logits[start:start + FALLBACK_ROWS]  # (n, V), a view: written back in place
            t = targets[start:start + FALLBACK_ROWS]  # (n,)
            x = rows.to(compute)
            lse = torch.logsumexp(x, dim=1)  # (n,)
            losses[start:start + FALLBACK_ROWS] = lse - x.gather(1, t[:, None]).squeeze(1)
            grad = x.sub_(lse[:, None]).exp_()  # softmax, in place
            grad[torch.arange(t.numel(), device=t.device), t] -= 1.0
            rows.copy_(grad.mul_(grad_scale))


@torch.library.custom_op("gpt2_repro::cross_entropy_rows_", mutates_args=("logits",))
def cross_entropy_rows_(logits: torch.Tensor, targets: torch.Tensor, grad_scale: float) -> torch.Tensor:
    """Each row's loss (N,) float32 (float64 for float64 logits); logits (N, V) overwritten in place by
    (softmax - one-hot) * grad_scale. Rows may be strided (row stride >= V); columns must be contiguous."""
    if logits.stride(1) != 1:
        raise ValueError(f"logits' columns must be contiguous, got strides {logits.stride()}")
    losses = torch.empty(logits.size(0), dtype=torch.promote_types(logits.dtype, torch.float32), device=logits.device)
    if logits.size(0) == 0:
        return losses
    if kernel_runs_on(logits) and logits.dtype in (torch.float32, torch.bfloat16, torch.float16):
        _launch(logits, targets, losses, grad_scale)
    else:
        _fallback(logits, targets, losses, grad_scale)
    return losses


@cross_entropy_rows_.register_fake
def _(logits: torch.Tensor, targets: torch.Tensor, grad_scale: float) -> torch.Tensor:
    return logits.new_empty(logits.size(0), dtype=torch.promote_types(logits.dtype, torch.float32))


class LinearCrossEntropyOnePass(torch.autograd.Function):
    """Mean cross-entropy of x @ weight^T: the product, then the kernel in place on it; backward as above."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # x (N, C), weight (V, C), in the compute dtype; targets (N,)
        n = x.size(0)
        logits = x @ weight.t()  # (N, V)
        losses = cross_entropy_rows_(logits, targets, 1.0 / n)  # logits now hold G = d(mean)/d(logits)
        ctx.save_for_backward(logits, x, weight)
        return losses.sum() / n

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_logits, x, weight = ctx.saved_tensors
        g = grad_loss.to(grad_logits.dtype)
        grad_x = (grad_logits @ weight) * g if ctx.needs_input_grad[0] else None  # (N, C)
        grad_weight = (grad_logits.t() @ x) * g if ctx.needs_input_grad[1] else None  # (V, C)
        return grad_x, grad_weight, None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`F.cross_entropy(x @ weight.T, targets)` (mean; every target counts) for x (N, C), weight (V, C) and
    targets (N,): the product in the caller's autocast dtype (as autocast runs a Linear: cast in, cast back
    in the backward), the loss in float32, through the one-pass kernel."""
    x, weight = autocast_operands(x, weight)
    with torch.autocast(x.device.type, enabled=False):  # the dtypes are set above
        return LinearCrossEntropyOnePass.apply(x, weight, targets)


class CrossEntropyInPlace(torch.autograd.Function):
    """Mean cross-entropy whose forward leaves d(mean)/d(logits) in the logits' buffer; backward scales it."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        n = logits.size(0)
        losses = cross_entropy_rows_(logits, targets, 1.0 / n)  # logits now hold the gradient of the mean
        ctx.save_for_backward(logits)
        return losses.sum() / n

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        (grad,) = ctx.saved_tensors
        # one pointwise pass over (N, V): what linear_cross_entropy avoids; for logits made some other way
        return grad * grad_loss.to(grad.dtype), None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`F.cross_entropy(logits, targets)` (mean over the N rows; every target counts) for logits (N, V) and
    targets (N,), computed in float32 whatever the logits' dtype. Consumes the logits: afterwards their buffer
    holds the gradient, so they must not be read again. Its backward scales that buffer: a pass over it that
    linear_cross_entropy, where the logits are x @ weight^T, does without."""
    return CrossEntropyInPlace.apply(logits, targets)
