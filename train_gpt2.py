"""Train GPT-2 on token shards, on one device or many (torchrun), resuming exactly.

    python train_gpt2.py --config configs/demo.yaml
    torchrun --standalone --nproc_per_node=8 train_gpt2.py          # GPT-2 124M on FineWeb-Edu

Step s is the s-th optimizer update. Each step sees total_batch_size tokens: every rank runs
grad_accum_steps micro-batches of (micro_batch_size, seq_len) and DDP averages the gradients
once, on the last micro-step. Rank 0 alone writes logs, samples and checkpoints; every
collective (the step's all-reduce, val loss, HellaSwag, checkpoint agreement) is reached by
all ranks, and an error that only one rank can see is shared with the others before they go
on, so every rank stops with the same one-line message instead of hanging.

The pieces: launch/build.py builds the run (data, model, optimizer) and launch/resume.py continues
it from a checkpoint; training/run/step.py is one optimizer step's math, training/run/lockstep.py the
ranks' agreement around it; launch/components.py makes each component of the loop below from its own
settings section (a key of another section it reads is passed to it as a value). Each component
decides its own timing: the evaluations, the checkpoints, the stop vote, rollbacks, diagnostics.

Exit codes (common/errors.py): 0 done, preempted and checkpointed, or nothing to do; 2 bad
configuration or input; 3 the loss went NaN/inf (the update was not applied), or spikes went on
past max_rollbacks rollbacks; 1 anything else (e.g. a checkpoint write failed). Under torchrun one
worker prints the error for all, each exits with its code, and the shell sees torchrun's own
status, 1 (docs/OPERATIONS.md, "When things go wrong").
"""

from __future__ import annotations

# ruff: noqa: E402 (the launcher's parent-death signal and the arguments' check come before the imports, which
# take seconds)
import common.startup  # noqa: F401 - first: a Ctrl-C while the modules below load is one line
from runtime.launcher import stop_when_launcher_dies

stop_when_launcher_dies()  # under torchrun: a launcher killed during the imports leaves no orphan behind

from common.errors import check_before_imports
from launch.early_checks import answered_without_training, check_command_line, check_launch

check_before_imports(__name__, check_command_line)  # as a script: a mistake in its arguments or files is one line now

import datetime
import sys

import torch

from data.tokenizer import get_tokenizer
from common.errors import EVERY_RANK, NODE_RANKS, held_alike_by, run_cli
from training.checkpoint.folder import checkpoints_folder
from launch.config import TrainConfig, config_yaml
from runtime.context import Context
from training.observe.diagnostics import Diagnostics
from runtime.process_group import (barrier, local_rank, run_on_all_ranks,
                                   setup_distributed, teardown_distributed)
from training.distributed.strategies import make_strategy
from training.distributed.preemption import PreemptionFlag, StopVote
from training.observe.provenance import provenance
from launch.recovery import Recovery
from launch.build import build_run
from launch.components import (describe_launch, make_checkpointer, make_evaluation, make_lockstep,
                               make_step_records, open_run_folder, resume_hint)
from training.run.run import Run
from training.checkpoint.run_folder import claim_run_folder, release_all
from runtime.logger import RunLogger
from runtime.runtime import deterministic_kernels
from training.optim.optimizers import require_available
from training.optim.spikes import RollbackRequested
from runtime.storage import require_shared

STARTUP_TIMEOUT = datetime.timedelta(minutes=30)  # compilation and the first evals: ranks wait on each other


def main(argv: list[str], wrap_step=None) -> int:
    """Run the training that argv describes; the exit status. wrap_step(step) -> step: tests inject faults."""
    if answered_without_training(argv):  # --help, or --estimate: what the run would cost (launch/estimate.py)
        return 0
    with held_alike_by(NODE_RANKS):  # before the ranks connect: a node's ranks read the same arguments and files
        cfg = check_launch(argv)  # check_before_imports made these checks as the script started; tests call main
        require_available(cfg.optimizer)  # the configuration's one rule that needs torch
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
        with held_alike_by(EVERY_RANK):  # what one rank saw is shared with all (run_on_all_ranks): rank 0 prints it
            # ddp, or FSDP's sharding (training/distributed/strategies.py)
            strategy = make_strategy(cfg.runtime.strategy, env, runtime)
            out_dir = cfg.run.out_dir
            checkpoints = checkpoints_folder(out_dir, cfg.checkpoint.checkpoint_dir)
            require_shared(checkpoints, env.world_size)  # every rank's part must land where rank 0 sees it
            # one launch at a time per out_dir (and checkpoint folder): rank 0 holds the locks until the end
            locks = run_on_all_ranks(env, lambda: claim_run_folder(out_dir, checkpoints, logger.warn)
                                     if env.master_process else [])
            run = build_run(cfg, ctx, strategy, checkpoints)  # data, model, optimizer, the checkpoint it resumes
            if run is not None:  # None: that checkpoint already reached max_steps, its final evaluations run
                record = provenance(ctx, argv, run.data_fingerprint, run.run_id, config_yaml(run.config))
                if run.micro_batch is not None:  # micro_batch_size auto: how B was chosen (config.yaml has the B)
                    record["micro_batch_size"] = run.micro_batch
                open_run_folder(cfg, ctx, run, record)
                train(cfg, ctx, run, preemption, record, wrap_step)
            barrier(env)  # leave together: a gloo rank torn down while its peer still talks can abort
            return 0
    finally:
        try:
            logger.close()
            release_all(locks)
            teardown_distributed()
        finally:  # last: as soon as one worker ends, torchrun sends the others SIGTERM, which must not end rank 0
            preemption.restore()  # before run_cli has printed the error the others left to it (until here: a flag)


def train(cfg: TrainConfig, ctx: Context, run: Run, preemption: PreemptionFlag, record: dict, wrap_step=None) -> None:
    """The loop: at the top of each iteration the model has had run.step updates. Each component
    decides its own timing (evaluations, checkpoints, the stop vote); every rank runs this alike."""
    logger, max_steps = ctx.logger, cfg.schedule.max_steps
    describe_launch(cfg, ctx, run)
    model = run.strategy.training_model(run.model)  # compiled, and wrapped by DDP: the training forward
    evaluation = make_evaluation(cfg, ctx, run.strategy, get_tokenizer())  # val, HellaSwag, samples
    diagnostics = Diagnostics(cfg.diagnostics, ctx, cfg.run.out_dir, max_steps)  # each off unless configured
    diagnostics.watch(model)  # the ranks' compute time ends at their last forward
    checkpointer = make_checkpointer(cfg, ctx, run, record)  # file or sharded, one save in flight
    lockstep = make_lockstep(cfg, ctx, save_failed=checkpointer.failed)  # the log's failures ride on its vote too
    take_step = wrap_step(lockstep.step) if wrap_step else lockstep.step  # run.step -> run.step + 1
    recovery = Recovery(ctx, run, checkpointer, max_steps, cfg.long_run.max_rollbacks)  # the data feed, rollbacks
    stop = StopVote(preemption, ctx.env)  # set only from all-reduced votes: every rank stops at the same step
    records = make_step_records(cfg, ctx, run)  # train records and step lines
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


if __name__ == "__main__":
    sys.exit(run_cli(main))
