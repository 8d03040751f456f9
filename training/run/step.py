"""One optimizer step's math: gradients accumulated over total_batch_size tokens, then the update.

Each rank runs grad_accum_steps micro-batches of (micro_batch_size, seq_len); the gradients are
synced (DDP's all-reduce, FSDP's reduce-scatter) only on the last micro-step, and the loss is
scaled by 1/grad_accum_steps, so W ranks x A micro-steps equal one process with W*A micro-steps.
Whether the update is applied is decided between the two halves, by every rank together
(training/run/lockstep.py): nothing here synchronises with the host.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from common.log_fields import train_metric
from runtime.recorder import record_metric
from runtime.runtime import Runtime
from training.run.run import Run

# 1 where the global gradient norm was over grad_clip (the gradients were scaled down to it), else 0: over a run's
# steps, the fraction clipped. The same on every rank; not on the step line, whose norm says it already
CLIPPED = train_metric("clipped", "max")


def train_step(run: Run, model: torch.nn.Module, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
               lr: float, runtime: Runtime, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of step run.step; (loss, grad_norm) as 0-d tensors on the device.

    model: run.model's compiled / DDP wrapper (training/distributed/strategies.py); micro_batches: the step's
    grad_accum_steps (inputs, targets) pairs, each (B, T). loss is this rank's mean over its
    rows; grad_norm the global norm over all ranks, before clipping to max_norm. What else it measures it records
    (runtime/recorder.py).
    """
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    loss_accum = torch.zeros((), device=runtime.device, dtype=runtime.weights_dtype)  # float64 in float64 runs
    last = run.grad_accum_steps - 1
    for micro_step, (x, y) in enumerate(micro_batches):
        with run.strategy.gradient_sync(run.model, model, enabled=micro_step == last):
            with runtime.autocast():
                _, loss = model(x, y, loss_chunk_size=runtime.loss_chunk_size, loss_head=runtime.loss_head)
            loss = loss / run.grad_accum_steps  # the gradients add up to the mean over the whole batch
            loss_accum += loss.detach()
            run.scaler.scale(loss).backward()  # float16: scaled up, so small gradients do not flush to zero
    run.scaler.unscale_(run.optimizer)  # back to true gradients before clipping (a no-op unless float16)
    grad_norm = run.strategy.clip_grad_norm(run.model, max_norm)
    record_metric(CLIPPED, grad_norm > max_norm)
    return loss_accum, grad_norm


def apply_update(run: Run, skip: bool) -> None:
    """Apply the gradients (unless the ranks agreed to skip this update), then clear them; the EMA of the
    weights (if on) folds in the updated weights, on the device (a skipped update is not folded in)."""
    if not skip:
        run.optimizer.step()
        if run.ema is not None:
            run.ema.update(run.model, run.step)
    run.scaler.update()  # float16: from the overflow check unscale_ recorded, no host sync
    run.optimizer.zero_grad(set_to_none=True)
