"""What every part of a launch shares: its settings, its processes, its device and rank 0's record."""

from __future__ import annotations

from dataclasses import dataclass

from training.train.config import TrainConfig
from training.distributed.process_group import DistEnv
from training.observe.logger import RunLogger
from training.train.runtime import Runtime


@dataclass(frozen=True)
class Context:
    cfg: TrainConfig  # the validated configuration
    env: DistEnv  # this process: rank, world size, device
    runtime: Runtime  # device, dtype, compile, kernels
    logger: RunLogger  # rank 0's console, log.jsonl, W&B and TensorBoard (a no-op on other ranks)
