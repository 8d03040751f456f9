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
