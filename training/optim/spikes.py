"""Loss spikes: which updates to skip, and when to roll back instead.

A spike is a step whose loss or gradient norm is more than `spike_threshold` standard
deviations above the mean of the last `spike_window` applied steps (OLMo-core's rule, 6 over
128 by default). Its update is not applied: the weights and AdamW moments stay as they were,
the step counter and the data go on (the batch is passed over). Nothing is judged until the
window is full, so the fast early descent never counts as a spike.

The window lives on the device: judging a step is a few tensor operations whose result rides
on the step's one host synchronisation (training/run/lockstep.py). The loss is all-reduced and the
gradient norm global, so every rank judges the same values the same way. The window, the skips
in a row and the rollback count are part of the run's state (checkpoints), so a resumed run
skips exactly the steps a straight one skips.
"""

from __future__ import annotations

from typing import TypedDict

import torch

from common.settings import Settings, option, require, section


class RollbackRequested(Exception):
    """Raised on every rank alike by the step: reload the newest checkpoint instead of going on.

    Not an error the run stops with: the training loop catches it (train_gpt2.py, roll_back)."""

    def __init__(self, step: int, reason: str):
        super().__init__(f"step {step}: {reason}")
        self.step, self.reason = step, reason


class SpikeWindowState(TypedDict):
    """The checkpoint's spike_window entry: what SpikeWindow.load_state_dict reads."""

    values: list[list[float]]  # the losses, then the grad norms
    filled: int
    position: int


class SpikeWindow:
    """The (loss, grad norm) of the last `size` applied steps, in a ring on the device."""

    def __init__(self, size: int, threshold: float, device: torch.device, dtype: torch.dtype):
        self.size, self.threshold = size, threshold
        self.values = torch.zeros(2, size, device=device, dtype=dtype)  # rows: loss, grad norm
        self.filled = 0  # slots holding a step (host ints: known without a sync)
        self.position = 0  # the slot the next applied step goes to

    @property
    def full(self) -> bool:
        return self.filled == self.size

    def judge(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """(5,) on the device, no sync: [spike (1.0 or 0.0), loss mean, grad norm mean, loss std, grad norm std]."""
        mean, std = self.values.mean(dim=1), self.values.std(dim=1)
        current = torch.stack([loss, grad_norm]).to(self.values.dtype)
        spike = (current > mean + self.threshold * std).any().to(self.values.dtype)
        return torch.cat([spike.unsqueeze(0), mean, std])

    def add(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """An applied step's values (0-d tensors on the device) replace the oldest. No sync."""
        self.values[:, self.position] = torch.stack([loss, grad_norm]).to(self.values.dtype)
        self.position = (self.position + 1) % self.size
        self.filled = min(self.filled + 1, self.size)

    def state_dict(self) -> SpikeWindowState:
        """Plain Python values (the sharded format keeps them in JSON): floats hold float32 exactly."""
        return {"values": self.values.double().cpu().tolist(), "filled": self.filled, "position": self.position}

    def load_state_dict(self, state: SpikeWindowState) -> None:
        values = torch.tensor(state["values"], dtype=torch.float64)
        if values.shape != self.values.shape:  # spike_window changed: start a new window
            self.values.zero_()
            self.filled = self.position = 0
            return
        self.values.copy_(values.to(self.values.dtype))
        self.filled, self.position = state["filled"], state["position"]


def spike_reason(judged: list[float], loss: float, grad_norm: float, threshold: float) -> str:
    """What made a step a spike, from judge()'s values read on the host."""
    _, loss_mean, norm_mean, loss_std, norm_std = judged
    parts = []
    if loss > loss_mean + threshold * loss_std:
        parts.append(f"loss {loss:.4g} > {loss_mean:.4g} + {threshold:g} x {loss_std:.3g}")
    if grad_norm > norm_mean + threshold * norm_std:
        parts.append(f"grad norm {grad_norm:.4g} > {norm_mean:.4g} + {threshold:g} x {norm_std:.3g}")
    return " and ".join(parts) or "a spike"


def spike_skip_on(config: dict) -> bool:
    """on_resume of the spike settings: another value changes the training math only while spike_skip is on (off,
    nothing reads them). config: the resumed run's keys, flat."""
    return config["spike_skip"]


def rollbacks_on(config: dict) -> bool:
    """on_resume of what steers the rollbacks (how many, and, through the checkpoint cadence, where to): nothing
    changes while neither rollback_after nor rollback_on_nonfinite asks for them."""
    return bool(config["rollback_after"] or config["rollback_on_nonfinite"])


@section
class LongRunSettings(Settings):
    """The long-run section: which updates are skipped as spikes, and when the run rolls back instead."""

    SECTION = "long_run"
    SUMMARY = "loss spikes: skipped updates and rollbacks"

    spike_skip: bool = option(False, "skip an update whose loss or grad norm is more than spike_threshold standard "
                                     "deviations above the mean of the last spike_window applied steps (every rank "
                                     "skips the same one; a skip record says why)", on_resume="trajectory")
    spike_window: int = option(128, "applied steps in the spike window; nothing is skipped until it is full",
                               on_resume=spike_skip_on)
    spike_threshold: float = option(6.0, "standard deviations above the window's mean that make a spike",
                                    on_resume=spike_skip_on)
    rollback_after: int = option(0, "after N skipped steps in a row, reload the newest checkpoint and continue past "
                                    "the batches since it (0: never; needs spike_skip)", on_resume=spike_skip_on)
    rollback_on_nonfinite: bool = option(False, "a NaN/inf loss or grad norm rolls back like rollback_after instead "
                                                "of stopping the run (exit 3)", on_resume="trajectory")
    max_rollbacks: int = option(3, "rollbacks in one run; the next one stops it with an error (exit 3)",
                                on_resume=rollbacks_on)

    def validate(self) -> None:
        for key in ("rollback_after", "max_rollbacks"):
            require(getattr(self, key) >= 0, key, f"must be >= 0, got {getattr(self, key)}")
        require(self.spike_window >= 2, "spike_window", f"must be >= 2, got {self.spike_window}")
        require(self.spike_threshold > 0, "spike_threshold", f"must be positive, got {self.spike_threshold}")
        require(not self.rollback_after or self.spike_skip, "rollback_after",
                "counts skipped steps, so it needs spike_skip: true")
