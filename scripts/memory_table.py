"""Bytes per GPU for each GPT-2 preset under DDP and FSDP, for 1, 2, 4 and 8 GPUs (README, "Bigger models").

    python scripts/memory_table.py [--seq_len 1024] [--gpu_gb 24]

Model state is exact arithmetic: float32 weights (4 bytes per parameter), float32 gradients (4)
and AdamW's two moments (8). DDP keeps all of it on every GPU. FSDP shards weights and AdamW
state over the GPUs; gradients are sharded after the step's reduce-scatter, but while
micro-batches accumulate (no reduce-scatter before the last one) each GPU holds them whole, so
with gradient accumulation FSDP needs 12/N + 4 bytes per parameter.

Activations per sequence are measured, not estimated: the bytes autograd saves for backward in
a bf16-autocast training forward with the fused loss (eager, flash attention; see
scripts/activation_memory.py), taken on 1- and 2-layer models of each preset's width at the
full seq_len and scaled to its depth, which is exact because every block saves the same.
The largest micro-batch that fits leaves 15% of the card for the CUDA context, the allocator
and transient buffers: an estimate, not a GPU measurement.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from activation_memory import saved_bytes  # noqa: E402  (scripts/ is this script's own folder)
from model import GPT, PRESETS, GPTConfig  # noqa: E402

GPUS = (1, 2, 4, 8)
GIB = 2**30
# model state bytes per GPU of a model of p parameters on n GPUs, under the strategies the table compares
STATE_BYTES = {"ddp": lambda p, n: 16 * p, "fsdp": lambda p, n: 12 * p / n + 4 * p}


def activation_bytes_per_sequence(shape: dict, seq_len: int, chunk: int = 8192) -> float:
    """Saved-for-backward bytes of one more sequence, for the preset's full depth."""
    per_depth = {}
    for n_layer in (1, 2):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**{**shape, "n_layer": n_layer}))
        one, two = (saved_bytes(model, batch, seq_len, chunk) for batch in (1, 2))
        per_depth[n_layer] = two - one
    per_layer = per_depth[2] - per_depth[1]
    return per_depth[1] + (shape["n_layer"] - 1) * per_layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--gpu_gb", type=float, default=24.0, help="card size (GiB) for the largest-micro-batch column")
    args = parser.parse_args()
    usable = args.gpu_gb * GIB * 0.85
    print("| model | params | activations per sequence | strategy | "
          + " | ".join(f"state per GPU, {n} GPU{'s' if n > 1 else ''}" for n in GPUS)
          + f" | largest B on {args.gpu_gb:.0f} GB, 8 GPUs |")
    print("| --- | --- | --- | --- | " + " | ".join("---" for _ in GPUS) + " | --- |")
    for name, shape in PRESETS.items():
        with torch.device("meta"):
            params = GPT(GPTConfig(**shape)).num_params()
        per_seq = activation_bytes_per_sequence(shape, args.seq_len)
        for strategy, state_bytes in STATE_BYTES.items():
            state = [state_bytes(params, n) for n in GPUS]
            largest = max(int((usable - state[-1]) // per_seq), 0)
            print(f"| {name} | {params / 1e6:.0f}M | {per_seq / GIB:.2f} GiB | {strategy} | "
                  + " | ".join(f"{s / GIB:.1f} GiB" for s in state) + f" | {largest} |", flush=True)


if __name__ == "__main__":
    main()
