"""Measure, on the CPU, what a training step keeps for backward, and estimate the largest B per GPU.

    python scripts/activation_memory.py [--models gpt2 gpt2-medium ...] [--seq_len 1024] [--gpu_gb 80]
                                        [--activation_checkpointing none selective full] [--every 2]

For each model it runs bf16-autocast forwards at B=1 and B=2 (real tensors, eager mode, the
CPU's flash-attention kernel, like cuDNN/flash SDPA on a GPU: no T x T matrices) and sums the
bytes of every tensor autograd saves for the backward pass, with the plain loss and with the
fused chunked loss; the difference is the cost of one more sequence, the rest is fixed (the
fused loss keeps a (V, C) fp32 gradient whatever B is). Weights, gradients and AdamW state add
16 bytes per parameter (fp32 weight, gradient, two moments). The largest B is then estimated as
what fits in `gpu_gb` with 15% headroom for the allocator, transient buffers and CUDA context:
an estimate, not a GPU measurement (torch.compile saves less than eager; the plain loss also
has a transient peak in its backward that this count does not include, which makes its estimate
optimistic).

Each activation_checkpointing setting is one row: with `full` every block keeps only its input,
with `selective` one block in every `--every` does (the trainer's activation_checkpointing and
activation_checkpointing_every). A recomputed block's activations exist again, one block at a
time, during its backward: that transient is not in the saved bytes here; scripts/memory_table.py
adds it to its estimates.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import GPT, PRESETS, GPTConfig  # noqa: E402

RECOMPUTE_EVERY = {"none": lambda every: 0, "selective": lambda every: every, "full": lambda every: 1}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(PRESETS))
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--gpu_gb", type=float, default=80.0)
    parser.add_argument("--activation_checkpointing", nargs="+", default=["none"], choices=list(RECOMPUTE_EVERY))
    parser.add_argument("--every", type=int, default=2, help="selective: one block in every N recomputed")
    args = parser.parse_args()
    usable = args.gpu_gb * 2**30 * 0.85
    print(f"| model | params | weights+grads+AdamW | activation checkpointing | saved per sequence, plain loss "
          f"| fused loss | est. largest B on {args.gpu_gb:.0f} GB, plain | fused |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.models:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**PRESETS[name]))
        params = model.num_params()
        state = 16 * params
        for setting in args.activation_checkpointing:
            model.recompute_blocks(RECOMPUTE_EVERY[setting](args.every))
            cells = []
            for chunk in (0, 8192):
                one, two = (saved_bytes(model, batch, args.seq_len, chunk) for batch in (1, 2))
                per_seq, fixed = two - one, 2 * one - two
                fits = max(int((usable - state - fixed) // per_seq), 0)
                cells.append((per_seq, fits))
            (plain, plain_fits), (fused, fused_fits) = cells
            label = f"selective (1 in {args.every})" if setting == "selective" else setting
            print(f"| {name} | {params / 1e6:.0f}M | {state / 2**30:.1f} GiB | {label} | {plain / 2**30:.2f} GiB | "
                  f"{fused / 2**30:.2f} GiB | {plain_fits} | {fused_fits} |", flush=True)
        del model


if __name__ == "__main__":
    main()
