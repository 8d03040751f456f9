"""The learning-rate schedule, the `lr_schedule` key.

cosine  linear warmup, then cosine decay to min_lr (GPT-3 paper; the faithful recipe)
wsd     warmup-stable-decay: the same linear warmup, max_lr held constant, then a cooldown to
        min_lr over the last cooldown_frac of max_steps, linear or "1-sqrt" (lr falls fast
        at first, then flattens out). The stable phase does not depend on max_steps, so a run
        can be extended, or cooled down from any checkpoint of the stable phase.

The value is in max_lr's units: the optimizer groups whose base lr is not max_lr (Muon's,
training/optim/muon_with_adamw.py) scale it by their base lr / max_lr.
"""

from __future__ import annotations

import math

from common.settings import Settings, option, require, section

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


def wsd_on(config: dict) -> bool:
    """on_resume of the cooldown's settings: the cosine schedule does not read them. config: the resumed run's keys,
    flat."""
    return config["lr_schedule"] == "wsd"


@section
class ScheduleSettings(Settings):
    """The schedule section: the run's length and every step's learning rate (max_lr is the peak of
    every optimizer group: training/optim/muon_with_adamw.py scales Muon's muon_lr by lr / max_lr)."""

    SECTION = "schedule"
    SUMMARY = "the run's length and the learning rate of every step"

    max_steps: int = option(19073, "optimizer steps (10B tokens / 524,288)", on_resume="trajectory")
    warmup_steps: int = option(715, "linear warmup steps (375M tokens)", on_resume="trajectory")
    max_lr: float = option(6e-4, "peak learning rate", on_resume="trajectory")
    min_lr: float = option(6e-5, "learning rate at the end of the cosine (10% of max_lr)", on_resume="trajectory")
    lr_schedule: str = option("cosine", "cosine (warmup, then cosine decay to min_lr: GPT-3's) or wsd "
                                        "(warmup-stable-decay: warmup, max_lr held, then a cooldown to min_lr over "
                                        "the last cooldown_frac of max_steps)", on_resume="trajectory")
    cooldown_frac: float = option(0.2, "wsd: the share of max_steps that cools down, in (0, 1] (0.2: the 20% "
                                       "cooldown that matches a tuned cosine in Hagele et al. 2024)",
                                  on_resume=wsd_on)
    cooldown_shape: str = option("linear", "wsd: linear, or 1-sqrt (lr = min_lr + (max_lr - min_lr) * "
                                           "(1 - sqrt(progress)): a little better in Hagele et al. 2024)",
                                 on_resume=wsd_on)

    def validate(self) -> None:
        require(self.max_steps > 0, "max_steps", f"must be positive, got {self.max_steps}")
        require(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        for key in ("max_lr", "min_lr"):
            require(getattr(self, key) >= 0, key, f"must be >= 0, got {getattr(self, key)}")
        require(self.min_lr <= self.max_lr, "min_lr", f"{self.min_lr} is above max_lr {self.max_lr}")
        require(self.lr_schedule in SCHEDULES, "lr_schedule",
                f"unknown schedule {self.lr_schedule!r}; choose {', '.join(SCHEDULES)}")
        require(self.cooldown_shape in COOLDOWN_SHAPES, "cooldown_shape",
                f"unknown shape {self.cooldown_shape!r}; choose {', '.join(COOLDOWN_SHAPES)}")
        require(0 < self.cooldown_frac <= 1, "cooldown_frac", f"must be in (0, 1], got {self.cooldown_frac}")
        if self.lr_schedule == "wsd":
            start = cooldown_start(self.max_steps, self.cooldown_frac)
            require(self.warmup_steps <= start, "warmup_steps",
                    f"{self.warmup_steps} runs into the wsd cooldown, which starts at step {start} "
                    f"(max_steps {self.max_steps}, cooldown_frac {self.cooldown_frac})")

    def warning(self) -> str | None:
        """What a launch warns of: a warmup that never ends (warmup_steps >= max_steps, as when a config's
        max_steps is cut for a quick test), so every step trains below max_lr; None when the schedule is sound."""
        if self.warmup_steps < self.max_steps:
            return None
        return (f"warmup_steps {self.warmup_steps} >= max_steps {self.max_steps}: the schedule never leaves its "
                f"warmup; the lr goes from {self.lr(0):.3e} at step 0 to {self.lr(self.max_steps - 1):.3e} at the "
                f"last step (max_lr {self.max_lr:g}) and never decays; lower warmup_steps")

    def lr(self, step: int) -> float:
        """learning_rate for optimizer update `step` (0-based) under these settings."""
        return learning_rate(step, self.warmup_steps, self.max_steps, self.max_lr, self.min_lr, self.lr_schedule,
                             self.cooldown_frac, self.cooldown_shape)
