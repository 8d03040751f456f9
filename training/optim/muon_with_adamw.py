"""Muon and AdamW as one torch.optim.Optimizer (optimizer muon: training/optim/optimizers/muon.py).

To the rest of the code it is one optimizer (zero_grad, step, param_groups, state_dict / load_state_dict, DCP's
get_state_dict / set_state_dict, GradScaler.unscale_, training/distributed/strategies.py's parameter_names): its
param_groups are the AdamW groups followed by the Muon group, and its `state` is the one dict both inner
optimizers read and write.

The training loop sets every group's "lr" to the schedule's value, in max_lr's units (training/run/step.py). Each
group carries its own peak lr as "base_lr" (max_lr for the AdamW groups, muon_lr for Muon's), and the update uses
lr * base_lr / max_lr: the schedule scales both optimizers alike, and the AdamW groups get the schedule's value
exactly (base_lr / max_lr is 1).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from common.errors import CheckpointError


class MuonWithAdamW(torch.optim.Optimizer):
    """AdamW and Muon as one optimizer: param_groups are AdamW's groups, then Muon's.

    The public groups (self.param_groups) hold the settings; each step copies them onto the
    inner optimizers' own groups, with lr scaled by base_lr / peak_lr. The state is one dict,
    shared with the inner optimizers, and re-shared after load_state_dict (which replaces it).
    """

    def __init__(self, adamw: torch.optim.AdamW, muon: torch.optim.Muon, peak_lr: float):
        if peak_lr <= 0:
            raise ValueError(f"peak_lr must be positive, got {peak_lr}")
        self.inner = [adamw, muon]
        self.peak_lr = peak_lr
        groups = []
        for optimizer in self.inner:
            for group in optimizer.param_groups:
                # "lr" is in max_lr's units, as the training loop sets it; "base_lr" is the group's own peak
                groups.append({**group, "params": list(group["params"]), "lr": peak_lr, "base_lr": group["lr"]})
        super().__init__(groups, defaults={})
        self._share_state()

    def _share_state(self) -> None:
        for optimizer in self.inner:
            optimizer.state = self.state

    def _inner_groups(self) -> Iterable[dict]:
        return (group for optimizer in self.inner for group in optimizer.param_groups)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for public, inner in zip(self.param_groups, self._inner_groups(), strict=True):
            inner.update({k: v for k, v in public.items() if k not in ("params", "base_lr")})
            if public["base_lr"] != self.peak_lr:  # the AdamW groups take the schedule's value as it is
                inner["lr"] = public["lr"] * (public["base_lr"] / self.peak_lr)
        for optimizer in self.inner:
            optimizer.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict.get("param_groups", [])
        if len(saved) != len(self.param_groups) or any("base_lr" not in g for g in saved):
            raise CheckpointError("optimizer: the checkpoint's optimizer state is not Muon + AdamW's (its "
                                  "parameter groups differ); resume it with the optimizer it was written with")
        super().load_state_dict(state_dict)
        self._share_state()
