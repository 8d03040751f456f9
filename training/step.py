"""One optimizer step over total_batch_size tokens: the training hot loop's body.

Each rank runs grad_accum_steps micro-batches of (micro_batch_size, seq_len); DDP all-reduces
the gradients once, on the last micro-step (no_sync covers the forward and backward of the
others), so W ranks x A micro-steps equal one process with W*A micro-steps. The step makes
one collective of its own (the loss, the stop votes and the failure votes together) and one
host synchronisation, which decides, before the update is applied, whether to apply it. (FSDP
adds its own reduce-scatters and the global gradient-norm all-reduce; no host sync.)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from errors import NonFiniteLossError, ReproError
from training.config import TrainConfig
from training.distributed import DistEnv, all_reduce_sum, as_repro_error, raise_first_error
from training.run import Run
from training.runtime import Runtime
from training.schedule import learning_rate


@dataclass
class StepResult:
    loss: float  # mean over the whole global batch, all ranks
    grad_norm: float  # global, before clipping
    lr: float
    stop: bool  # some rank was asked to stop (SIGTERM/SIGUSR1): all ranks see the same value
    seconds: float
    skipped: bool = False  # float16 only: the gradients overflowed, the scaler skipped the update


def train_step(run: Run, model: torch.nn.Module, batches, cfg: TrainConfig, env: DistEnv, runtime: Runtime,
               stop_requested: bool, pending: ReproError | None = None) -> StepResult:
    """Apply update run.step to run.model through `model` (its compiled / DDP wrapper, see training/parallel.py).

    batches.get(step, micro_step) gives (B, T) inputs and targets on the device. `pending` is
    a failure this rank has seen since the last step (a log record it could not write); with
    a batch this rank could not read, it is shared with every rank here, and every rank raises
    the same error before the update. So does a NaN/inf loss or gradient norm: the weights and
    optimizer state stay those of step run.step.
    """
    t0 = time.perf_counter()
    step = run.step
    if cfg.dropout > 0:
        # dropout masks depend on (seed, step, rank) only, so a resumed run draws the same ones
        torch.manual_seed(((cfg.seed * 1_000_003 + step) * 4099 + env.rank) % 2**64)
    lr = learning_rate(step, cfg.warmup_steps, cfg.max_steps, cfg.max_lr, cfg.min_lr)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    loss_sum = torch.zeros((), device=runtime.device, dtype=runtime.weights_dtype)  # float64 in float64 runs
    failure = pending
    for micro_step in range(run.grad_accum_steps):
        try:
            x, y = batches.get(step, micro_step)  # (B, T) each, already on the device
        except Exception as e:  # noqa: BLE001 - keep stepping in lockstep, fail together below
            failure = failure or as_repro_error(e, env)
            x = y = torch.zeros((cfg.micro_batch_size, cfg.seq_len), dtype=torch.long, device=runtime.device)
        # gradients are synced (all-reduced, or reduce-scattered) only on the last micro-step
        with run.strategy.gradient_sync(run.model, model, enabled=micro_step == run.grad_accum_steps - 1):
            with runtime.autocast():
                _, loss = model(x, y, loss_chunk_size=runtime.loss_chunk_size)
            loss = loss / run.grad_accum_steps  # gradients add up to the mean over the whole batch
            loss_sum += loss.detach()
            run.scaler.scale(loss).backward()  # float16: scaled up, so small gradients do not flush to zero
    run.scaler.unscale_(run.optimizer)  # back to true gradients before clipping (a no-op unless float16)
    grad_norm = run.strategy.clip_grad_norm(run.model, cfg.grad_clip or math.inf)  # global, over all shards
    # the step's one collective: the summed loss, the stop votes, the failure votes
    stats = all_reduce_sum(torch.stack([loss_sum, loss_sum.new_full((), float(stop_requested)),
                                        loss_sum.new_full((), float(failure is not None))]), env)
    # the step's one host synchronisation: decide before the update is applied
    loss_value, stop_votes, failures, norm_value = torch.stack(
        [stats[0] / env.world_size, stats[1], stats[2], grad_norm]).tolist()
    if failures:
        raise_first_error(failure, env)  # every rank raises the same error
    # float16's gradients overflow now and then: the scaler skips that update and lowers the scale
    overflow = run.scaler.is_enabled() and not math.isfinite(norm_value)
    if not (math.isfinite(loss_value) and (math.isfinite(norm_value) or overflow)):
        raise NonFiniteLossError(
            f"step {step}: loss {loss_value} / grad norm {norm_value} is not finite; the update was "
            f"not applied and the newest checkpoint in {cfg.out_dir} is the last good state")
    if not overflow:
        run.optimizer.step()
    run.scaler.update()  # from the overflow check unscale_ recorded: no host sync
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    run.tokens_seen += cfg.total_batch_size
    return StepResult(loss=loss_value, grad_norm=norm_value, lr=lr, stop=bool(stop_votes),
                      seconds=time.perf_counter() - t0, skipped=overflow)
