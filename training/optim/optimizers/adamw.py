"""adamw, the faithful recipe: AdamW over every parameter, weight decay on the 2-D ones only (matmul weights and
embeddings; biases and LayerNorm gains are not decayed: GPT-3 paper, appendix B), as GPT-2/3 and build-nanogpt's
configure_optimizers, in the same parameter order. Its grouping and its fused check are muon's AdamW part too."""

from __future__ import annotations

from training.optim.optimizers import OptimizerEntry, register


def decay_groups(params: list, weight_decay: float) -> list[dict]:
    """AdamW's two groups of params (in their order): the 2-D ones decayed, the rest not."""
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def make_adamw(groups: list[dict], lr: float, settings, device_type: str):
    """torch's AdamW over groups with the optimizer section's betas and eps: fused on CUDA (all parameters in one
    kernel launch) where this PyTorch has it."""
    import inspect

    import torch

    fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
    return torch.optim.AdamW(groups, lr=lr, betas=(settings.beta1, settings.beta2), eps=settings.adam_eps,
                             fused=fused)


def build(model, settings, peak_lr: float, device_type: str):
    params = [p for p in model.parameters() if p.requires_grad]  # a tied parameter comes once
    return make_adamw(decay_groups(params, settings.weight_decay), peak_lr, settings, device_type)


ADAMW = register(OptimizerEntry("adamw", "every parameter; GPT-2/3's", build))
