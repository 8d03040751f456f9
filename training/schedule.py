"""The learning-rate schedule, the `lr_schedule` key.

cosine  linear warmup, then cosine decay to min_lr (GPT-3 paper; the faithful recipe)
wsd     warmup-stable-decay: the same linear warmup, max_lr held constant, then a cooldown to
        min_lr over the last cooldown_frac of max_steps, linear or "1-sqrt" (lr falls fast
        at first, then flattens out). The stable phase does not depend on max_steps, so a run
        can be extended, or cooled down from any checkpoint of the stable phase.

The value is in max_lr's units: the optimizer groups whose base lr is not max_lr (Muon's,
training/optimizers.py) scale it by their base lr / max_lr.
"""

from __future__ import annotations

import math

SCHEDULES = ("cosine", "wsd")
COOLDOWN_SHAPES = ("linear", "1-sqrt")


def learning_rate(step: int, warmup_steps: int, max_steps: int, max_lr: float, min_lr: float,
                  schedule: str = "cosine", cooldown_frac: float = 0.2, cooldown_shape: str = "linear") -> float:
    """lr for optimizer update `step` (0-based)."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps  # step 0 already moves the weights a little
    if step >= max_steps:
        return min_lr
    if schedule == "wsd":
        return _wsd(step, max_steps, max_lr, min_lr, cooldown_frac, cooldown_shape)
    if schedule != "cosine":
        raise ValueError(f"unknown lr_schedule {schedule!r}; choose {', '.join(SCHEDULES)}")
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)  # 0 -> 1
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)


def cooldown_start(max_steps: int, cooldown_frac: float) -> int:
    """The first step of wsd's cooldown: max_steps - round(cooldown_frac * max_steps)."""
    return max_steps - max(1, round(cooldown_frac * max_steps))


def _wsd(step: int, max_steps: int, max_lr: float, min_lr: float, cooldown_frac: float, shape: str) -> float:
    start = cooldown_start(max_steps, cooldown_frac)
    if step < start:
        return max_lr
    # progress 0 at the cooldown's first step (still max_lr: continuous with the stable phase),
    # 1 at max_steps (min_lr: continuous with what follows)
    progress = (step - start) / (max_steps - start)
    if shape == "linear":
        remaining = 1.0 - progress
    elif shape == "1-sqrt":
        remaining = 1.0 - math.sqrt(progress)
    else:
        raise ValueError(f"unknown cooldown_shape {shape!r}; choose {', '.join(COOLDOWN_SHAPES)}")
    return min_lr + (max_lr - min_lr) * remaining
