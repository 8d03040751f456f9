"""muon, the modern recipe: Muon (torch.optim.Muon's math, each matrix orthogonalised whole on one rank:
training/distributed/muon.py) on the transformer blocks' weight matrices (attention c_attn / c_proj, MLP c_fc /
c_proj), AdamW (adamw.py's groups) on everything else: the token embedding (tied with lm_head, so once), the
position embedding, LayerNorm gains and every bias. One optimizer to the rest of the code:
training/optim/muon_with_adamw.py."""

from __future__ import annotations

from training.optim.optimizers import OptimizerEntry, register
from training.optim.optimizers.adamw import decay_groups, make_adamw

MUON_TORCH = "2.9"  # the first PyTorch release with torch.optim.Muon (requirements.txt allows older ones)
BLOCK_MATRICES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def split_parameters(model) -> tuple[list, list]:
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


def unavailable() -> str | None:
    """Why optimizer muon cannot run with this PyTorch (None when it can): refused before any work starts,
    instead of an AttributeError when the optimizer is built."""
    import torch

    from training.distributed.muon import muon_math_missing

    if hasattr(torch.optim, "Muon") and not muon_math_missing():
        return None
    return (f"muon needs torch.optim.Muon, which PyTorch {MUON_TORCH} added; this is torch {torch.__version__}: "
            f"upgrade torch (pip install 'torch>={MUON_TORCH}'), or use optimizer adamw")


def build(model, settings, peak_lr: float, device_type: str):
    from training.distributed.muon import DistributedMuon
    from training.optim.muon_with_adamw import MuonWithAdamW

    muon, adamw = split_parameters(model)
    inner_adamw = make_adamw(decay_groups(adamw, settings.weight_decay), peak_lr, settings, device_type)
    inner_muon = DistributedMuon([{"params": muon}], lr=settings.muon_lr, momentum=settings.muon_momentum,
                                 weight_decay=settings.muon_weight_decay, nesterov=True)
    return MuonWithAdamW(inner_adamw, inner_muon, peak_lr=peak_lr)


MUON = register(OptimizerEntry(
    "muon", f"torch.optim.Muon, PyTorch {MUON_TORCH}+, on the blocks' weight matrices, AdamW with max_lr, betas, eps "
            "and weight_decay on embeddings, lm_head, LayerNorms and biases; each matrix orthogonalised whole, on "
            "one rank, under any strategy", build, unavailable))
