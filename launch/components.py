"""The components train_gpt2.py's loop is made of, each from its own settings sections.

The evaluations (evals/periodic.py), the checkpointer (training/checkpoint/checkpointer.py) and the
ranks' lockstep around one step (training/run/lockstep.py) are each made here from the sections they
read, with any key of another section passed as a value, and so are the step's records and console line
(training/run/step_records.py). The run folder is opened here too (config.yaml, run.json, log.jsonl,
W&B, TensorBoard).
"""

from __future__ import annotations

import json
from pathlib import Path

from common.errors import ConfigError
from evals.periodic import PeriodicEvaluation
from launch.config import TrainConfig, config_yaml
from training.checkpoint.checkpointer import Checkpointer
from runtime.context import Context
from runtime.process_group import run_on_all_ranks
from training.distributed.strategies import Strategy
from training.run.lockstep import Lockstep
from training.run.run import Run
from training.run.step_records import StepRecords


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


def make_step_records(cfg: TrainConfig, ctx: Context, run: Run) -> StepRecords:
    """The train records and step lines, with the keys of other sections they read as values."""
    data = cfg.data
    return StepRecords(ctx, run, seq_len=data.seq_len, total_batch_size=data.total_batch_size,
                       max_steps=cfg.schedule.max_steps, log_interval=cfg.logging.log_interval,
                       hang_timeout_minutes=cfg.runtime.hang_timeout_minutes)


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


def resume_hint(resume: str, last_step: bool) -> str:
    """The command that continues this run (resume: the checkpoint section's; a fresh start would refuse a used
    out_dir); at the last step, what is left of it is its final evaluations."""
    again = "with --resume auto" if resume == "never" else "again"
    return f"run the same command {again} to {'run the final evaluations' if last_step else 'resume'}"
