"""The learning-rate schedule: linear warmup, then cosine decay to min_lr (GPT-3 paper)."""

from __future__ import annotations

import math


def learning_rate(step: int, warmup_steps: int, max_steps: int, max_lr: float, min_lr: float) -> float:
    """lr for optimizer update `step` (0-based)."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps  # step 0 already moves the weights a little
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)  # 0 -> 1
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)
