"""The training forward's lm_head + loss as the runtime's settings choose it (GPT.forward's `loss_head`).

A loss head is a callable `(x (N, C), weight (V, C), targets (N,)) -> mean loss`: the final layer norm's
output, the (tied) lm_head weight and the targets, flattened over the N = B*T positions. GPT.forward calls it
in place of its own `lm_head` + `F.cross_entropy` when the runtime hands it one (and returns no logits then);
without one (None, the default) the model's own path runs, unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.nn import functional as F

LossHead = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def plain_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """model.py's own loss: float32 (at least) logits, F.cross_entropy's mean."""
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), targets)


def loss_head(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, linear, loss) -> torch.Tensor:
    """loss(linear(x, weight), targets): the lm_head's matrix product, then the loss over its logits (N, V)."""
    return loss(linear(x, weight), targets)


def make_loss_head(loss_kernel: str, fp8_lm_head: bool) -> LossHead | None:
    """The head for loss_kernel (torch: model.py's F.cross_entropy; triton: runtime/kernels/cross_entropy.py)
    and fp8_lm_head (the lm_head through FP8, runtime/kernels/fp8.py, else the caller's autocast's product);
    None where both are today's path, so that the model runs its own code."""
    if loss_kernel == "torch" and not fp8_lm_head:
        return None
    if loss_kernel == "triton" and not fp8_lm_head:  # the product and the kernel together: the cheapest backward
        from runtime.kernels.cross_entropy import linear_cross_entropy

        return linear_cross_entropy
    # fp8_lm_head: the FP8 product, then either loss over its logits (the kernel's backward scales its buffer,
    # which the FP8 backward quantizes next)
    from runtime.kernels.fp8 import fp8_linear

    if loss_kernel == "triton":
        from runtime.kernels.cross_entropy import cross_entropy as loss
    else:
        loss = plain_loss
    # a partial of module-level functions: torch.compile traces through it, guarding on what it holds
    return functools.partial(loss_head, linear=fp8_linear, loss=loss)
