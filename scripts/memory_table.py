"""Activations per sequence and the largest micro-batch per GPU for each GPT-2 preset (docs/PERFORMANCE.md, "Memory").

    python scripts/memory_table.py [--seq_len 1024] [--every 2] [--state] [--models gpt2 gpt2-xl]

For each preset and activation_checkpointing setting (none, selective with one block in every
`--every` recomputed, full): the activation bytes of one more sequence, and the largest
micro-batch that fits on one GPU under ddp and on each of 8 GPUs under fsdp, for 12, 16, 24, 40
and 80 GiB cards. `--state` prints the model state per GPU for 1, 2, 4 and 8 GPUs instead.

Model state is exact arithmetic: float32 weights (4 bytes per parameter), float32 gradients (4)
and AdamW's two moments (8). DDP keeps all of it on every GPU. FSDP shards weights and AdamW
state over the GPUs; gradients are sharded after the step's reduce-scatter, but while
micro-batches accumulate (no reduce-scatter before the last one) each GPU holds them whole, so
with gradient accumulation FSDP needs 12/N + 4 bytes per parameter.

Activations are measured, not estimated: the bytes autograd saves for backward in a
bf16-autocast training forward with the fused loss (eager, flash attention; see
benchmarks/activations.py), at B=1 and B=2 (their difference is one sequence) on 1- and
2-layer models of each preset's width at the full seq_len, plain and recomputed: what the
embeddings and the loss keep, what one plain block keeps, and what one recomputed block keeps
(its input). The preset's depth is then exact arithmetic, because every block saves the same.
With recomputation, one block's activations exist again during its backward: one plain block is
added for that, and what does not grow with B (the fused loss's float32 (V, C) gradient) is taken off
the card first. The largest micro-batch leaves 15% of the card for the CUDA context, the
allocator and transient buffers: an estimate, not a GPU measurement.
"""

from __future__ import annotations

import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# the model's arithmetic (model state, activations per sequence, the largest micro-batch) is the trainer's
# --estimate's; this script measures the activations it rests on (benchmarks/activations.py)
from benchmarks.activations import activation_costs, params_of  # noqa: E402
from common.errors import ArgumentParser, run_cli  # noqa: E402
from launch.estimate import GIB, STATE_BYTES, largest_batch  # noqa: E402
from model import PRESETS  # noqa: E402

GPUS = (1, 2, 4, 8)
CARDS_GIB = (12, 16, 24, 40, 80)


def state_table() -> None:
    print("| model | params | strategy | " + " | ".join(f"state per GPU, {n} GPU{'s' if n > 1 else ''}" for n in GPUS)
          + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in GPUS) + " |")
    for name, shape in PRESETS.items():
        params = params_of(shape)
        for strategy, state_bytes in STATE_BYTES.items():
            print(f"| {name} | {params / 1e6:.0f}M | {strategy} | "
                  + " | ".join(f"{state_bytes(params, n) / GIB:.1f} GiB" for n in GPUS) + " |")


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="scripts/memory_table.py", description=__doc__)
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--every", type=int, default=2, help="selective: one block in every N recomputed")
    parser.add_argument("--state", action="store_true", help="the model state per GPU table instead")
    parser.add_argument("--models", nargs="+", choices=list(PRESETS), default=list(PRESETS), help="the presets")
    args = parser.parse_args(argv)
    if args.state:
        state_table()
        return 0
    settings = {"none": 0, f"selective (1 in {args.every})": args.every, "full": 1}
    cards = " | ".join([f"{CARDS_GIB[0]} GiB", *map(str, CARDS_GIB[1:])])  # largest micro-batch per card
    print(f"| model | activation checkpointing | activations per sequence | 1 GPU (ddp): {cards} "
          f"| 8 GPUs (fsdp): {cards} |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in range(2 * len(CARDS_GIB))) + " |")
    for name in args.models:
        shape = PRESETS[name]
        params, costs = params_of(shape), activation_costs(shape, args.seq_len)
        for label, every in settings.items():
            per_seq = costs.per_sequence(shape["n_layer"], every)
            fits = [largest_batch(gib, STATE_BYTES[strategy](params, n), costs, per_seq)
                    for strategy, n in (("ddp", 1), ("fsdp", 8)) for gib in CARDS_GIB]
            print(f"| {name} | {label} | {per_seq / GIB:.2f} GiB | " + " | ".join(map(str, fits)) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
