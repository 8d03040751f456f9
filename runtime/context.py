"""What every part of a launch shares: its processes, its device and rank 0's record. Not its configuration.

Made once per launch (train_gpt2.py's run_training) and handed to each component's constructor
(Checkpointer, Diagnostics, PeriodicEvaluation, Lockstep, Recovery, build_run, ...) beside the
settings section(s) the component reads, and any key of another section it needs, passed as a
value where it is made (so what a component reads is visible in its signature), and what is
genuinely extra (the run, the strategy, the tokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.logger import RunLogger
from runtime.process_group import DistEnv
from runtime.runtime import Runtime


@dataclass(frozen=True)
class Context:
    env: DistEnv  # this process: rank, world size, device
    runtime: Runtime  # device, dtype, compile, kernels
    logger: RunLogger  # rank 0's console, log.jsonl, W&B and TensorBoard (a no-op on other ranks)
