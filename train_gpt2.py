"""Train GPT-2 on token shards, on one device or many (torchrun), resuming exactly.

    python train_gpt2.py --config configs/demo.yaml
    torchrun --standalone --nproc_per_node=8 train_gpt2.py          # GPT-2 124M on FineWeb-Edu

Step s is the s-th optimizer update. Each step sees total_batch_size tokens: every rank runs
grad_accum_steps micro-batches of (micro_batch_size, seq_len) and DDP averages the gradients
once, on the last micro-step. Rank 0 alone writes logs, samples and checkpoints; every
collective (the step's all-reduce, val loss, HellaSwag, checkpoint agreement) is reached by
all ranks, and an error that only one rank can see is shared with the others before they go
on, so every rank stops with the same one-line message instead of hanging.

The pieces: training/train/build.py builds the run (data, model, optimizer), and
training/train/resume.py continues it from the checkpoint it resumes (which one, what it loads,
what a changed setting means); training/train/step.py is one optimizer step's math, and
training/train/lockstep.py the ranks' agreement around it. The loop below calls components that
decide their own timing: evals/ (val loss, HellaSwag, samples, each at its interval),
training/checkpoint/checkpointer.py (when a checkpoint is due, saves in the background, a failed
save's retry), training/distributed/preemption.py (the stop vote), training/train/recovery.py
(the data feed, and rollbacks), training/observe/diagnostics.py (profiler, memory snapshots,
rank timings); training/core/logger.py is rank 0's console, files, W&B and TensorBoard. Here the
configuration is split: each component is made from its own settings section, and any key of
another section it reads is passed to it as a value.

Exit codes (common/errors.py): 0 done, preempted and checkpointed, or nothing to do; 2 bad
configuration or input; 3 the loss went NaN/inf (the update was not applied), or spikes went on
past max_rollbacks rollbacks; 1 anything else
(e.g. a checkpoint write failed). Under torchrun one worker prints the error for all, each exits with its
code, and the shell sees torchrun's own status, 1 (docs/OPERATIONS.md, "When things go wrong").
"""

from __future__ import annotations

# ruff: noqa: E402 (the launcher's parent-death signal is asked for before the imports, which take seconds)
import common.startup  # noqa: F401 - first: a Ctrl-C while the modules below load is one line
from training.core.launcher import stop_when_launcher_dies

stop_when_launcher_dies()  # under torchrun: a launcher killed during the imports leaves no orphan behind

import datetime
import json
import sys
import time
from pathlib import Path

import torch

from data.tokenizer import get_tokenizer
from common.errors import EVERY_RANK, NODE_RANKS, ConfigError, ReproError, held_alike_by, run_cli
from evals.periodic import PeriodicEvaluation
from training.checkpoint.folder import checkpoints_folder
from training.checkpoint.checkpointer import Checkpointer
from training.train.config import TrainConfig, config_yaml, parse_args, usage, wants_help
from training.core.context import Context
from training.observe.diagnostics import Diagnostics
from training.core.process_group import (barrier, local_rank, run_on_all_ranks,
                                  set_collective_timeout, setup_distributed, teardown_distributed)
from training.train.lockstep import Lockstep, StepResult
from training.core.metrics import model_flops_utilization, process_start_time
from training.distributed.strategies import Strategy, local_state_bytes, make_strategy
from training.distributed.preemption import PreemptionFlag, StopVote
from training.observe.provenance import provenance
from training.train.recovery import Recovery
from training.train.build import build_run
from training.train.run import Run
from training.checkpoint.run_folder import claim_run_folder, release_all
from training.core.logger import TENSORBOARD_MISSING, RunLogger, format_train_line
from training.core.runtime import deterministic_kernels
from training.optim.spikes import RollbackRequested
from training.core.storage import filesystem, is_url, require_shared

STARTUP_TIMEOUT = datetime.timedelta(minutes=30)  # compilation and the first evals: ranks wait on each other


def main(argv: list[str], wrap_step=None) -> int:
    """Run the training that argv describes; the exit status. wrap_step(step) -> step: tests inject faults."""
    if wants_help(argv):  # anywhere: `--config configs/demo.yaml --help` too
        print(usage())
        return 0
    with held_alike_by(NODE_RANKS):  # before the ranks connect: a node's ranks read the same arguments and files
        cfg = parse_args(argv)
        check_optional_packages(cfg)
    with deterministic_kernels(cfg.runtime.deterministic):  # entered before any CUDA work
        return run_training(cfg, argv, wrap_step)


def run_training(cfg: TrainConfig, argv: list[str], wrap_step=None) -> int:
    """Set up the processes, then build and train the run that cfg describes; the exit status."""
    with held_alike_by(NODE_RANKS):  # the node's devices, seen alike by its ranks
        runtime = cfg.runtime.make_runtime(local_rank())
        if runtime.device_type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True  # TF32 for any fp32 matmul left outside autocast
            torch.backends.cudnn.allow_tf32 = True
        env = setup_distributed(runtime.device, STARTUP_TIMEOUT)
    preemption = PreemptionFlag(announce=env.master_process).install()
    logger = RunLogger(enabled=env.master_process)
    ctx = Context(env, runtime, logger)  # what every component below is made from, beside its sections
    locks = []
    try:
        # ddp, or FSDP's sharding (training/distributed/strategies.py)
        strategy = make_strategy(cfg.runtime.strategy, env, runtime)
        out_dir = cfg.run.out_dir
        checkpoints = checkpoints_folder(out_dir, cfg.checkpoint.checkpoint_dir)
        require_shared(checkpoints, env.world_size)  # every rank's part must land where rank 0 sees it
        # one launch at a time per out_dir (and checkpoint folder): rank 0 holds the locks until the end
        locks = run_on_all_ranks(env, lambda: claim_run_folder(out_dir, checkpoints, logger.warn)
                                 if env.master_process else [])
        run = build_run(cfg, ctx, strategy)  # data, model, optimizer, the checkpoint it resumes
        if run is not None:  # None: that checkpoint already reached max_steps, its final evaluations run
            record = provenance(ctx, argv, run.data_fingerprint, run.run_id, config_yaml(cfg))
            if run.micro_batch is not None:  # micro_batch_size auto: how B was chosen (config.yaml has the B)
                record["micro_batch_size"] = run.micro_batch
            open_run_folder(cfg, ctx, run, record)
            train(cfg, ctx, run, preemption, record, wrap_step)
        barrier(env)  # leave together: a gloo rank torn down while its peer still talks can abort
        return 0
    except ReproError as e:  # a failure one rank saw is shared with all (run_on_all_ranks): rank 0 prints it
        e.held_by = EVERY_RANK
        raise
    finally:
        try:
            logger.close()
            release_all(locks)
            teardown_distributed()
        finally:  # last: as soon as one worker ends, torchrun sends the others SIGTERM, which must not end rank 0
            preemption.restore()  # before run_cli has printed the error the others left to it (until here: a flag)


def open_run_folder(cfg: TrainConfig, ctx: Context, run: Run, record: dict) -> None:
    """Rank 0 creates out_dir, config.yaml, run.json and log.jsonl (and the W&B run); a failure stops every rank."""
    env, logger, out_dir, logging = ctx.env, ctx.logger, cfg.run.out_dir, cfg.logging

    def open_files() -> None:
        logger.open_run_folder(out_dir, run.start_step, {
            "config.yaml": config_yaml(cfg),
            "run.json": json.dumps(record, indent=2) + "\n",
        })

    run_on_all_ranks(env, open_files)
    if logging.wandb:  # network or credentials trouble is seen by rank 0 alone
        run_on_all_ranks(env, lambda: logger.start_wandb(
            logging.wandb_project, logging.wandb_run_name, logging.wandb_mode, {**cfg.to_dict(), "provenance": record},
            logging.wandb_tags, run.wandb_run_id, out_dir),
            describe=lambda e: ConfigError(f"wandb: could not start the run ({type(e).__name__}: {e}); "
                                           f"use --wandb_mode offline or --wandb false"))
        run.wandb_run_id = logger.wandb_run_id  # on rank 0, which writes the checkpoints
    if logging.tensorboard:
        run_on_all_ranks(env, lambda: logger.start_tensorboard(Path(out_dir) / "tensorboard", run.start_step))


def train(cfg: TrainConfig, ctx: Context, run: Run, preemption: PreemptionFlag, record: dict, wrap_step=None) -> None:
    """The loop: at the top of each iteration the model has had run.step updates. Each component
    decides its own timing (evaluations, checkpoints, the stop vote); every rank runs this alike."""
    logger, max_steps = ctx.logger, cfg.schedule.max_steps
    describe_launch(cfg, ctx, run)
    model = run.strategy.training_model(run.model)  # compiled, and wrapped by DDP: the training forward
    evaluation = make_evaluation(cfg, ctx, run.strategy, get_tokenizer())  # val, HellaSwag, samples
    diagnostics = Diagnostics(cfg.diagnostics, ctx, cfg.run.out_dir, max_steps)  # each off unless configured
    diagnostics.watch(model)  # the ranks' compute time ends at their last forward
    checkpointer = make_checkpointer(cfg, ctx, run.strategy, record)  # file or sharded, one save in flight
    lockstep = make_lockstep(cfg, ctx, save_failed=checkpointer.failed)  # the log's failures ride on its vote too
    take_step = wrap_step(lockstep.step) if wrap_step else lockstep.step  # run.step -> run.step + 1
    recovery = Recovery(ctx, run, checkpointer, max_steps, cfg.long_run.max_rollbacks)  # the data feed, rollbacks
    stop = StopVote(preemption, ctx.env)  # set only from all-reduced votes: every rank stops at the same step
    records = StepRecords(cfg, ctx, run)
    try:
        while True:
            try:
                last_step = run.step == max_steps
                stop.note(evaluation.run_due(run, last_step, stop.agree))
                if stop.agreed:  # at the last step: before its final evaluations ran, which a relaunch runs
                    return stop.exit(run, checkpointer, logger, resume_hint(cfg.checkpoint.resume, last_step))
                if last_step:
                    run.finished_at = run.step  # the final evaluations are logged: the final checkpoint says so
                if checkpointer.due(run, last_step):
                    checkpointer.save(run, blocking=last_step)  # the last one is waited for anyway
                if last_step:
                    return checkpointer.finish(run)
                checkpointer.poll()  # a background save that finished is committed, or its failure voted on
                with diagnostics.step(run.step):  # a profiler window, and a memory snapshot on OOM
                    result = take_step(run, model, recovery.batches, stop.requested)
                diagnostics.step_finished(run.step - 1, result.data_wait)  # every rank: an all-gather at intervals
                stop.note(result.stop)
                records.log(result)
                if result.save_failed:  # some rank saw a background save fail: this step's state is saved now
                    checkpointer.retry(run)
            except RollbackRequested as request:  # every rank alike: spikes in a row, a NaN (if asked)
                recovery.roll_back(request)
    finally:
        recovery.close()
        diagnostics.close()  # a profile window or memory recording still open is written
        checkpointer.close()  # after a failure: a background save that finishes still counts


# --- the loop's components that tests make too, each from its own sections ---------------------------------

def make_evaluation(cfg: TrainConfig, ctx: Context, strategy: Strategy, tokenizer) -> PeriodicEvaluation:
    """The evaluations (the evaluation section), their samples drawn from the runtime section's seed."""
    return PeriodicEvaluation(cfg.evaluation, ctx, strategy, tokenizer, seed=cfg.runtime.seed)


def make_checkpointer(cfg: TrainConfig, ctx: Context, strategy: Strategy, record: dict) -> Checkpointer:
    """The checkpointer (the checkpoint section) of the run folder, storing the whole configuration (flat) and
    the launch's record with every checkpoint."""
    return Checkpointer(cfg.checkpoint, ctx, cfg.run.out_dir, cfg.to_dict(), record,
                        strategy_format=strategy.default_checkpoint_format,
                        hang_timeout_minutes=cfg.runtime.hang_timeout_minutes,
                        rollback_on_nonfinite=cfg.long_run.rollback_on_nonfinite)


def make_lockstep(cfg: TrainConfig, ctx: Context, save_failed=lambda: False) -> Lockstep:
    """The step (the schedule and long_run sections, the data section's batch geometry), with the other keys it
    applies: the optimizer's grad_clip, and the runtime's seed where the model has dropout."""
    dropout_base_seed = cfg.runtime.seed if cfg.model.dropout > 0 else None
    return Lockstep(ctx, cfg.schedule, cfg.long_run, cfg.data, grad_clip=cfg.optimizer.grad_clip,
                    dropout_base_seed=dropout_base_seed, out_dir=cfg.run.out_dir, save_failed=save_failed)


def describe_launch(cfg: TrainConfig, ctx: Context, run: Run) -> None:
    env, runtime = ctx.env, ctx.runtime
    ctx.logger.console(
        f"model {cfg.model.model}: {run.model.num_params():,} parameters | world size {env.world_size} | "
        f"device {runtime.device} | {runtime.dtype} | compile {runtime.compile} | {cfg.runtime.strategy} | "
        + (f"activation checkpointing {cfg.runtime.activation_checkpointing_label()} | "
           if runtime.recompute_every else "") +
        (f"micro_batch_size {cfg.data.micro_batch_size} (auto: {run.micro_batch['how']}) | "
         if run.micro_batch else "") +
        f"grad_accum_steps {run.grad_accum_steps} | {run.train_loader.summary()}"
        + (f" | resumed from {run.resumed_from} at step {run.start_step}" if run.resumed_from else ""))
    schedule_warning = cfg.schedule.warning()
    if schedule_warning:
        ctx.logger.warn(schedule_warning)


class StepRecords:
    """The train record of each step (and skip records), the console line, and what the launch's first step
    settles. The line's times are the host's clock, read after the step's one host synchronisation."""

    def __init__(self, cfg: TrainConfig, ctx: Context, run: Run):
        self.cfg, self.ctx, self.run = cfg, ctx, run
        self.flops_per_token = run.model.estimate_flops_per_token(cfg.data.seq_len)
        self.first = True
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
        logger.log(record)
        self.steps_taken += 1
        if self.steps_taken == 1:
            self.rate_from = time.perf_counter()
        if result.spike:
            logger.log({"kind": "skip", "step": record["step"], "tokens": run.tokens_seen, "loss": result.loss,
                        "grad_norm": result.grad_norm, "reason": result.spike})
            logger.warn(f"step {record['step']}: loss spike, the update was not applied ({result.spike})")
        if self.first:  # the launch's first step (not a rollback's): compiled, and the ranks in step
            logger.log({"kind": "startup", "step": record["step"], "compile": runtime.compile,
                        "seconds_to_first_step": time.time() - process_start_time(),
                        "state_gib_per_rank": local_state_bytes(run.model, run.optimizer) / 2**30})
            # from here on a collective that waits long is a hang: it surfaces in minutes
            set_collective_timeout(env, datetime.timedelta(minutes=cfg.runtime.hang_timeout_minutes))
            self.first = False
        # after every log_interval-th update (the steps evaluations print too), the launch's first and the last
        if run.step % cfg.logging.log_interval == 0 or self.steps_taken == 1 or run.step == max_steps:
            logger.console(format_train_line(record, max_steps, time.time() - process_start_time(), self.eta()))


def resume_hint(resume: str, last_step: bool) -> str:
    """The command that continues this run (resume: the checkpoint section's; a fresh start would refuse a used
    out_dir); at the last step, what is left of it is its final evaluations."""
    what = "run the final evaluations" if last_step else "resume"
    if resume == "never":
        return f"run the same command with --resume auto to {what}"
    return f"run the same command again to {what}"


def check_optional_packages(cfg: TrainConfig) -> None:
    """Fail up front, on every rank, when the config asks for a package that is not installed."""
    import importlib.util

    logging, checkpoint_dir = cfg.logging, cfg.checkpoint.checkpoint_dir
    if logging.wandb and logging.wandb_mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise ConfigError("wandb: the wandb package is not installed (pip install wandb), or set --wandb false")
    if logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(TENSORBOARD_MISSING)
    if is_url(checkpoint_dir):
        filesystem(checkpoint_dir)  # a ConfigError naming the package a URL's scheme needs (s3fs, gcsfs)


def cli(argv: list[str]) -> int:
    return run_cli(main, argv)


if __name__ == "__main__":
    sys.exit(run_cli(main))
