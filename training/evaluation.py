"""Val loss over the fixed val window, and text samples.

Both run on the unwrapped, uncompiled model: no DDP hooks fire, and a compiled training
model never recompiles for eval-only shapes.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn import functional as F

from data.loader import ValLoader
from data.tokenizer import EOT_TOKEN
from model import upcast
from training.distributed import DistEnv, all_reduce_sum


@torch.no_grad()
def evaluate_val_loss(model: torch.nn.Module, val_loader: ValLoader, env: DistEnv,
                      autocast: contextlib.AbstractContextManager, chunk_tokens: int = 8192) -> float:
    """Mean token cross-entropy over the whole val window, the same number for any world size.

    Every rank calls this (it ends in an all-reduce), including ranks with no batch. Each val
    batch is the same rows on any world size (ValLoader), and its summed token loss goes into
    its own slot of a float64 vector; the all-reduce adds only zeros to each slot, and every
    rank then sums the slots in the same order. So 1, 2 or 8 ranks give a bitwise-equal figure.
    """
    was_training = model.training
    model.eval()
    acc_dtype = torch.float32 if env.device_type == "mps" else torch.float64  # MPS has no float64
    sums = torch.zeros(val_loader.num_batches, device=env.device, dtype=acc_dtype)
    for index, x, y in val_loader.batches():
        x, y = x.to(env.device), y.to(env.device)  # (b, T)
        with autocast:
            hidden = model.hidden_states(x).flatten(0, 1)  # (b*T, C)
        targets = y.flatten()  # (b*T,)
        # lm_head a chunk of tokens at a time: whole (b*T, V) logits would be 13 GB in fp32 at b=64
        for h, t in zip(hidden.split(chunk_tokens), targets.split(chunk_tokens)):
            with autocast:
                logits = model.lm_head(h)  # (n, V)
            sums[index] += F.cross_entropy(upcast(logits), t, reduction="none").to(acc_dtype).sum()
    all_reduce_sum(sums, env)
    model.train(was_training)
    return sums.sum().item() / (val_loader.num_rows * val_loader.stream.seq_len)


@torch.no_grad()
def generate_samples(model: torch.nn.Module, tokenizer, prompt: str, count: int, max_new_tokens: int,
                     device: torch.device, seed: int, temperature: float = 1.0, top_k: int = 50,
                     autocast: contextlib.AbstractContextManager | None = None) -> list[str]:
    """`count` continuations of `prompt`, top-k sampled from a generator seeded with `seed`.

    No collective inside: rank 0 alone calls it while the others go on to the next step.
    """
    was_training = model.training
    model.eval()
    ids = torch.tensor([encode_prompt(tokenizer, prompt)] * count, dtype=torch.long, device=device)  # (count, P)
    generator = torch.Generator(device=device).manual_seed(seed)
    with autocast or contextlib.nullcontext():
        out = model.generate(ids, max_new_tokens, temperature=temperature, top_k=top_k,
                             generator=generator, valid_vocab=tokenizer.n_vocab)
    model.train(was_training)
    return [tokenizer.decode(row.tolist()) for row in out]


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """The prompt's token ids; an empty prompt is <|endoftext|>, GPT-2's unconditional start."""
    return tokenizer.encode(prompt, allowed_special="all") or [EOT_TOKEN]
