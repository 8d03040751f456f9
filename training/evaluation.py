"""Val loss over the fixed val window, and text samples.

Both run on the unwrapped, uncompiled model: no DDP hooks fire, and a compiled training
model never recompiles for eval-only shapes.
"""

from __future__ import annotations

import contextlib

import torch

from data.loader import ValLoader
from training.distributed import DistEnv, all_reduce_sum


@torch.no_grad()
def evaluate_val_loss(model: torch.nn.Module, val_loader: ValLoader, env: DistEnv,
                      autocast: contextlib.AbstractContextManager) -> float:
    """Mean token cross-entropy over the whole val window: sum of losses / count over all ranks.

    Every rank calls this (it ends in an all-reduce), including ranks whose share is empty.
    """
    was_training = model.training
    model.eval()
    # float64 where the device has it, so the sum does not depend on how rows split over ranks
    acc_dtype = torch.float32 if env.device_type == "mps" else torch.float64
    loss_sum = torch.zeros((), device=env.device, dtype=acc_dtype)
    for x, y in val_loader.batches():
        x, y = x.to(env.device), y.to(env.device)  # (b, T)
        with autocast:
            _, loss = model(x, y)  # mean over b*T tokens
        loss_sum += loss.to(acc_dtype) * y.numel()
    all_reduce_sum(loss_sum, env)
    model.train(was_training)
    return loss_sum.item() / (val_loader.num_rows * val_loader.stream.seq_len)


@torch.no_grad()
def generate_samples(model: torch.nn.Module, tokenizer, prompt: str, count: int, max_new_tokens: int,
                     device: torch.device, seed: int, temperature: float = 1.0, top_k: int = 50,
                     autocast: contextlib.AbstractContextManager | None = None) -> list[str]:
    """`count` continuations of `prompt`, top-k sampled from a generator seeded with `seed`.

    No collective inside: rank 0 alone calls it while the others go on to the next step.
    """
    was_training = model.training
    model.eval()
    ids = torch.tensor([tokenizer.encode(prompt)] * count, dtype=torch.long, device=device)  # (count, P)
    generator = torch.Generator(device=device).manual_seed(seed)
    with autocast or contextlib.nullcontext():
        out = model.generate(ids, max_new_tokens, temperature=temperature, top_k=top_k,
                             generator=generator, valid_vocab=tokenizer.n_vocab)
    model.train(was_training)
    return [tokenizer.decode(row.tolist()) for row in out]
