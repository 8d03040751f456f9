"""What every part of a launch shares: its settings, its processes, its device and rank 0's record."""

from __future__ import annotations

from dataclasses import dataclass

from training.config import TrainConfig
from training.distributed import DistEnv
from training.run_logger import RunLogger
from training.runtime import Runtime


@dataclass(frozen=True)
class Context:
    cfg: TrainConfig  # the validated configuration
    env: DistEnv  # this process: rank, world size, device
    runtime: Runtime  # device, dtype, compile, kernels
    logger: RunLogger  # rank 0's console, log.jsonl, W&B and TensorBoard (a no-op on other ranks)
