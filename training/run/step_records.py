"""What the loop writes of each step: its train record (log.jsonl, W&B and TensorBoard), a skip record for a loss
spike, the startup record of the launch's first step, and the step line on the console.

The train record's fields are declared here, where they are written (rank 0's values, after the step's sync),
beside the metrics recorded during the step from wherever they are computed (runtime/recorder.py), which
the record takes as they come: a new field of either kind is one file.
"""

from __future__ import annotations

import datetime
import time

import torch

from common.log_fields import train_metric
from runtime.context import Context
from runtime.logger import format_train_line
from runtime.metrics import model_flops_utilization, process_start_time
from runtime.process_group import set_collective_timeout
from training.distributed.strategies import local_state_bytes
from training.run.lockstep import StepResult
from training.run.run import Run

# the train record's own fields: the mean loss of the global batch, the lr, the global gradient norm before
# clipping, the tokens so far, all ranks' tokens a second and the step's time (host clock), skipped (float16
# overflow: no update), the model FLOPs utilization (a known GPU's peak) and the peak memory (CUDA)
for _field in ("loss", "lr", "grad_norm", "tokens", "tokens_per_sec", "step_ms", "skipped", "mfu", "peak_mem_gb"):
    train_metric(_field, None)


class StepRecords:
    """The train record of each step (and skip records), the console line, and what the launch's first step
    settles. The line's times are the host's clock, read after the step's one host synchronisation."""

    def __init__(self, ctx: Context, run: Run, *, seq_len: int, total_batch_size: int, max_steps: int,
                 log_interval: int, hang_timeout_minutes: float):
        """Of the sections: the data's seq_len and total_batch_size (a step's tokens), the schedule's max_steps, the
        logging's log_interval (which steps print a line) and the runtime's hang_timeout_minutes (the collectives'
        timeout from the first step on)."""
        self.ctx, self.run = ctx, run
        self.total_batch_size, self.max_steps, self.log_interval = total_batch_size, max_steps, log_interval
        self.hang_timeout_minutes = hang_timeout_minutes
        self.flops_per_token = run.model.estimate_flops_per_token(seq_len)
        self.steps_taken = 0  # by this launch (a rollback's redone steps count: they take time too)
        self.rate_from = 0.0  # perf_counter at the end of the launch's first step (which compiles)

    def eta(self) -> float | None:
        """Seconds to max_steps at this launch's pace since its first step (evaluations and checkpoints
        included), None before there is one."""
        if self.steps_taken < 2:
            return None
        per_step = (time.perf_counter() - self.rate_from) / (self.steps_taken - 1)
        return per_step * (self.max_steps - self.run.step)

    def log(self, result: StepResult) -> None:
        env, runtime, logger, run, max_steps = self.ctx.env, self.ctx.runtime, self.ctx.logger, self.run, self.max_steps
        tokens_per_sec = self.total_batch_size / result.seconds  # all ranks together
        record = {"kind": "train", "step": run.step - 1, "loss": result.loss, "lr": result.lr,
                  "grad_norm": result.grad_norm, "tokens": run.tokens_seen, "tokens_per_sec": tokens_per_sec,
                  "step_ms": result.seconds * 1000}
        for source, tokens in run.train_loader.tokens_by_source(run.step).items():  # a mixture's sources
            record[f"tokens_{source}"] = tokens
        if result.skipped:
            record["skipped"] = True  # float16 overflow: no update (the scaler lowered its scale)
        mfu = model_flops_utilization(self.flops_per_token, tokens_per_sec, env.world_size, runtime.peak_flops)
        if mfu is not None:
            record["mfu"] = mfu
        if runtime.device_type == "cuda":
            record["peak_mem_gb"] = torch.cuda.max_memory_allocated(runtime.device) / 2**30
        record.update(result.metrics)  # what was recorded for the step (runtime/recorder.py)
        logger.log(record)
        self.steps_taken += 1
        first = self.steps_taken == 1  # the launch's first step (a rollback's redone steps are later ones)
        if first:
            self.rate_from = time.perf_counter()
        if result.spike:
            logger.log({"kind": "skip", "step": record["step"], "tokens": run.tokens_seen, "loss": result.loss,
                        "grad_norm": result.grad_norm, "reason": result.spike})
            logger.warn(f"step {record['step']}: loss spike, the update was not applied ({result.spike})")
        if first:  # compiled, and the ranks in step
            logger.log({"kind": "startup", "step": record["step"], "compile": runtime.compile,
                        "seconds_to_first_step": time.time() - process_start_time(),
                        "state_gib_per_rank": local_state_bytes(run.model, run.optimizer) / 2**30})
            # from here on a collective that waits long is a hang: it surfaces in minutes
            set_collective_timeout(env, datetime.timedelta(minutes=self.hang_timeout_minutes))
        # after every log_interval-th update (the steps evaluations print too), the launch's first and the last
        if run.step % self.log_interval == 0 or first or run.step == max_steps:
            logger.console(format_train_line(record, max_steps, time.time() - process_start_time(), self.eta()))
