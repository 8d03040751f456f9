"""What every part of a launch shares: its settings, its processes, its device and rank 0's record.

Made once per launch (train_gpt2.py's run_training) and handed to each component's constructor
(Checkpointer, Diagnostics, PeriodicEvaluation, Lockstep, Recovery, build_run, ...), with only what
is genuinely extra beside it (the run, the strategy, the tokenizer). A component reads its own
settings section from ctx.cfg (`ctx.cfg.section(CheckpointSettings)`) and keeps it, so what it reads
is visible; a key of another section it needs is read from ctx.cfg where it is used, saying why.

The modules this one imports (config, process_group, logger, runtime, and what they import) cannot
import it back: tests/test_layout.py refuses the cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

from training.train.config import TrainConfig
from training.core.process_group import DistEnv
from training.core.logger import RunLogger
from training.core.runtime import Runtime


@dataclass(frozen=True)
class Context:
    cfg: TrainConfig  # the validated configuration
    env: DistEnv  # this process: rank, world size, device
    runtime: Runtime  # device, dtype, compile, kernels
    logger: RunLogger  # rank 0's console, log.jsonl, W&B and TensorBoard (a no-op on other ranks)
