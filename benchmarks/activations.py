"""What a training step keeps for backward, measured on the CPU: the activations that scripts/memory_table.py
tabulates and benchmarks/memory_check.py sets beside a GPU's peak (launch/estimate.py holds the arithmetic).

The bytes autograd saves in a bf16-autocast training forward (eager, the CPU's flash-attention kernel, like
cuDNN/flash SDPA on a GPU: no T x T matrices), at B=1 and B=2 (their difference is one sequence), on 1- and
2-layer models of a preset's width at the full seq_len, plain and recomputed. Every block saves the same, so a
preset's depth is then exact arithmetic.
"""

from __future__ import annotations

import torch

from launch.estimate import ActivationCosts
from model import GPT, GPTConfig


def saved_bytes(model: GPT, batch: int, seq_len: int, loss_chunk_size: int) -> int:
    """Bytes of non-parameter tensors saved for backward by one training forward."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    idx = torch.randint(0, min(50257, model.config.vocab_size), (batch, seq_len))  # GPT-2's ids, or a small vocab's
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(idx, idx, loss_chunk_size=loss_chunk_size)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


def activation_costs(shape: dict, seq_len: int, chunk: int = 8192) -> ActivationCosts:
    """Measure ActivationCosts on 1- and 2-layer models of the preset's width (bf16 autocast, the fused loss)."""
    def one_sequence(n_layer: int, every: int) -> tuple[int, int]:
        """(bytes of one more sequence, bytes that do not grow with B)"""
        torch.manual_seed(0)
        model = GPT(GPTConfig(**{**shape, "n_layer": n_layer}))
        model.recompute_blocks(every)
        one, two = (saved_bytes(model, batch, seq_len, chunk) for batch in (1, 2))
        return two - one, 2 * one - two

    (one, fixed), (two, _), (one_recomputed, _) = one_sequence(1, 0), one_sequence(2, 0), one_sequence(1, 1)
    plain_block = two - one
    return ActivationCosts(fixed=fixed, outside=one - plain_block, plain_block=plain_block,
                           recomputed_block=one_recomputed - (one - plain_block))


def params_of(shape: dict) -> int:
    with torch.device("meta"):
        return GPT(GPTConfig(**shape)).num_params()
