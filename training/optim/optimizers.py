"""The optimizer of a run, the `optimizer` key: one function, build_optimizer.

adamw  the faithful recipe: model.configure_optimizers (AdamW, weight decay on 2-D tensors only).
muon   the modern recipe: Muon (torch.optim.Muon's math, each matrix orthogonalised whole on one
       rank: training/distributed/muon.py) on the transformer blocks' weight matrices (attention
       c_attn / c_proj, MLP c_fc / c_proj), AdamW on everything else: the token embedding (tied
       with lm_head, so once), the position embedding, LayerNorm gains and every bias.

Both are one torch.optim.Optimizer to the rest of the code (zero_grad, step, param_groups,
state_dict / load_state_dict, DCP's get_state_dict / set_state_dict, GradScaler.unscale_,
training/distributed/strategies.py's parameter_names): MuonWithAdamW's param_groups are the AdamW groups
followed by the Muon group, and its `state` is the one dict both inner optimizers read and write.

The training loop sets every group's "lr" to the schedule's value, in max_lr's units
(training/run/step.py). Each group carries its own peak lr as "base_lr" (max_lr for the AdamW
groups, muon_lr for Muon's), and the update uses lr * base_lr / max_lr: the schedule scales both
optimizers alike, and the AdamW groups get the schedule's value exactly (base_lr / max_lr is 1).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch

from common.errors import CheckpointError
from model import GPT
from training.distributed.muon import DistributedMuon, muon_math_missing
from common.settings import require
from training.optim.settings import OptimizerSettings

MUON_TORCH = "2.9"  # the first PyTorch release with torch.optim.Muon (requirements.txt allows older ones)
BLOCK_MATRICES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def build_optimizer(model: GPT, settings: OptimizerSettings, peak_lr: float,
                    device_type: str) -> torch.optim.Optimizer:
    """The optimizer the optimizer section names, over the model's (possibly FSDP-sharded) parameters;
    peak_lr is the schedule's max_lr (every group's lr in the schedule's units)."""
    require_available(settings)  # the trainer checked it already; a tool that builds one itself is told here
    if settings.optimizer == "adamw":
        return model.configure_optimizers(settings.weight_decay, peak_lr, (settings.beta1, settings.beta2),
                                          settings.adam_eps, device_type)
    if settings.optimizer != "muon":
        raise ValueError(f"unknown optimizer {settings.optimizer!r}")  # the config refuses it first
    muon, adamw = split_parameters(model)
    fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
    adamw_groups = [
        {"params": [p for p in adamw if p.dim() >= 2], "weight_decay": settings.weight_decay},  # embeddings
        {"params": [p for p in adamw if p.dim() < 2], "weight_decay": 0.0},  # LayerNorm gains, biases
    ]
    inner_adamw = torch.optim.AdamW(adamw_groups, lr=peak_lr, betas=(settings.beta1, settings.beta2),
                                    eps=settings.adam_eps, fused=fused)
    # torch.optim.Muon's math, each matrix orthogonalised whole on one rank (training/distributed/muon.py)
    inner_muon = DistributedMuon([{"params": muon}], lr=settings.muon_lr, momentum=settings.muon_momentum,
                                 weight_decay=settings.muon_weight_decay, nesterov=True)
    return MuonWithAdamW(inner_adamw, inner_muon, peak_lr=peak_lr)


def require_available(settings: OptimizerSettings) -> None:
    """The optimizer section's one rule that needs torch, so not checked with the others (training/optim/settings.py,
    read before torch is imported): the optimizer it names runs on this PyTorch. A ConfigError naming optimizer,
    which the trainer raises once torch is imported, before any work (train_gpt2.py's main)."""
    if settings.optimizer == "muon":
        missing = muon_unavailable()
        require(missing is None, "optimizer", missing)


def muon_unavailable() -> str | None:
    """Why optimizer muon cannot run with this PyTorch (None when it can): refused before any work starts
    (require_available), instead of an AttributeError when the optimizer is built."""
    if hasattr(torch.optim, "Muon") and not muon_math_missing():
        return None
    return (f"muon needs torch.optim.Muon, which PyTorch {MUON_TORCH} added; this is torch {torch.__version__}: "
            f"upgrade torch (pip install 'torch>={MUON_TORCH}'), or use optimizer adamw")


def split_parameters(model: GPT) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(Muon's, AdamW's) parameters, every trainable parameter in exactly one (a tied one once).

    Muon: the 2-D weight matrices inside the transformer blocks. AdamW: the rest, including the
    embeddings (a lookup table is not a hidden layer's map: Muon's orthogonalised update does
    not suit it) and lm_head (tied with the token embedding here).
    """
    muon, adamw = [], []
    for name, p in model.named_parameters():  # a tied parameter comes once, under its first name
        if not p.requires_grad:
            continue
        in_block = name.startswith("transformer.h.")
        (muon if in_block and name.endswith(BLOCK_MATRICES) and p.dim() == 2 else adamw).append(p)
    return muon, adamw


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
