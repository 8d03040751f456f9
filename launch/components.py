"""The components train_gpt2.py's loop is made of, each from its own settings sections, and what the loop
writes at each step.

The evaluations (evals/periodic.py), the checkpointer (training/checkpoint/checkpointer.py) and the
ranks' lockstep around one step (training/run/lockstep.py) are each made here from the sections they
read, with any key of another section passed as a value; StepRecords turns a step's result into its
train record and console line. The run folder is opened here too (config.yaml, run.json, log.jsonl,
W&B, TensorBoard).
"""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import torch

from common.errors import ConfigError
from evals.periodic import PeriodicEvaluation
from launch.config import TrainConfig, config_yaml
from training.checkpoint.checkpointer import Checkpointer
from training.core.context import Context
from training.core.logger import format_train_line
from training.core.metrics import model_flops_utilization, process_start_time
from training.core.process_group import run_on_all_ranks, set_collective_timeout
from training.distributed.strategies import Strategy, local_state_bytes
from training.run.lockstep import Lockstep, StepResult
from training.run.run import Run


def open_run_folder(cfg: TrainConfig, ctx: Context, run: Run, record: dict) -> None:
    """Rank 0 starts the W&B run, then creates out_dir, config.yaml, run.json and log.jsonl; a failure stops every
    rank. W&B first: it is what fails for reasons outside the run (network, credentials), and a start that fails
    writes nothing into the run folder (the log keeps its records, no config.yaml of a run that never ran)."""
    env, logger, out_dir, logging = ctx.env, ctx.logger, cfg.run.out_dir, cfg.logging
    if logging.wandb:  # network or credentials trouble is seen by rank 0 alone
        run_on_all_ranks(env, lambda: logger.start_wandb(
            logging.wandb_project, logging.wandb_run_name, logging.resolved_wandb_mode(),
            {**run.config, "provenance": record}, logging.wandb_tags, run.wandb_run_id, out_dir),
            describe=lambda e: ConfigError(f"wandb: could not start the run ({type(e).__name__}: {e}); "
                                           f"use --wandb_mode offline or --wandb false"))
        run.wandb_run_id = logger.wandb_run_id  # on rank 0, which writes the checkpoints
    run_on_all_ranks(env, lambda: logger.open_run_folder(out_dir, run.start_step, {
        "config.yaml": config_yaml(run.config), "run.json": json.dumps(record, indent=2) + "\n"}))
    if logging.tensorboard:
        run_on_all_ranks(env, lambda: logger.start_tensorboard(Path(out_dir) / "tensorboard", run.start_step))


def make_evaluation(cfg: TrainConfig, ctx: Context, strategy: Strategy, tokenizer) -> PeriodicEvaluation:
    """The evaluations (the evaluation section), their samples drawn from the runtime section's seed."""
    return PeriodicEvaluation(cfg.evaluation, ctx, strategy, tokenizer, seed=cfg.runtime.seed)


def make_checkpointer(cfg: TrainConfig, ctx: Context, run: Run, record: dict) -> Checkpointer:
    """The checkpointer (the checkpoint section) of the run's checkpoint folder, storing the whole configuration
    as the run runs it (flat) and the launch's record with every checkpoint."""
    return Checkpointer(cfg.checkpoint, ctx, run.checkpoints, cfg.run.out_dir, run.config, record,
                        strategy_format=run.strategy.default_checkpoint_format,
                        hang_timeout_minutes=cfg.runtime.hang_timeout_minutes,
                        rollback_on_nonfinite=cfg.long_run.rollback_on_nonfinite)


def make_lockstep(cfg: TrainConfig, ctx: Context, save_failed=lambda: False) -> Lockstep:
    """The step (the schedule and long_run sections, the data section's batch geometry), with the other keys it
    applies: the optimizer's grad_clip, and the runtime's seed where the model has dropout."""
    dropout_base_seed = cfg.runtime.seed if cfg.model.dropout > 0 else None
    return Lockstep(ctx, cfg.schedule, cfg.long_run, cfg.data, grad_clip=cfg.optimizer.grad_clip,
                    dropout_base_seed=dropout_base_seed, save_failed=save_failed)


def describe_launch(cfg: TrainConfig, ctx: Context, run: Run) -> None:
    env, runtime = ctx.env, ctx.runtime
    ctx.logger.console(
        f"model {cfg.model.model}: {run.model.num_params():,} parameters | world size {env.world_size} | "
        f"device {runtime.device} | {runtime.dtype} | compile {runtime.compile} | {cfg.runtime.strategy} | "
        + (f"activation checkpointing {cfg.runtime.activation_checkpointing_label()} | "
           if runtime.recompute_every else "") +
        "".join(f"{lever} | " for lever in runtime.levers()) +
        (f"micro_batch_size {run.micro_batch_size} (auto: {run.micro_batch['how']}) | "
         if run.micro_batch else "") +
        f"grad_accum_steps {run.grad_accum_steps} | {run.train_loader.summary()}"
        + (f" | resumed from {run.resumed_from} at step {run.start_step}" if run.resumed_from else ""))
    if schedule_warning := cfg.schedule.warning():
        ctx.logger.warn(schedule_warning)


class StepRecords:
    """The train record of each step (and skip records), the console line, and what the launch's first step
    settles. The line's times are the host's clock, read after the step's one host synchronisation."""

    def __init__(self, cfg: TrainConfig, ctx: Context, run: Run):
        self.cfg, self.ctx, self.run = cfg, ctx, run
        self.flops_per_token = run.model.estimate_flops_per_token(cfg.data.seq_len)
        self.steps_taken = 0  # by this launch (a rollback's redone steps count: they take time too)
        self.rate_from = 0.0  # perf_counter at the end of the launch's first step (which compiles)

    def eta(self) -> float | None:
        """Seconds to max_steps at this launch's pace since its first step (evaluations and checkpoints
        included), None before there is one."""
        if self.steps_taken < 2:
            return None
        per_step = (time.perf_counter() - self.rate_from) / (self.steps_taken - 1)
        return per_step * (self.cfg.schedule.max_steps - self.run.step)

    def log(self, result: StepResult) -> None:
        cfg, env, runtime, logger, run = self.cfg, self.ctx.env, self.ctx.runtime, self.ctx.logger, self.run
        max_steps = cfg.schedule.max_steps
        tokens_per_sec = cfg.data.total_batch_size / result.seconds  # all ranks together
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
        record.update(result.metrics)  # what the step recorded (common/log_fields.py's train_metric)
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
            set_collective_timeout(env, datetime.timedelta(minutes=cfg.runtime.hang_timeout_minutes))
        # after every log_interval-th update (the steps evaluations print too), the launch's first and the last
        if run.step % cfg.logging.log_interval == 0 or first or run.step == max_steps:
            logger.console(format_train_line(record, max_steps, time.time() - process_start_time(), self.eta()))


def resume_hint(resume: str, last_step: bool) -> str:
    """The command that continues this run (resume: the checkpoint section's; a fresh start would refuse a used
    out_dir); at the last step, what is left of it is its final evaluations."""
    again = "with --resume auto" if resume == "never" else "again"
    return f"run the same command {again} to {'run the final evaluations' if last_step else 'resume'}"
