"""Compare the two ways of computing in bf16 under FSDP2, on the CPU (gloo): speed and loss.

    torchrun --standalone --nproc_per_node=2 scripts/fsdp_mixed_precision.py [--steps 12]

autocast   what the trainer does under every strategy: float32 parameters, all-gathered in
           float32, matmuls in bf16 under torch.autocast, LayerNorm and softmax in float32,
           gradients reduced in float32.
mp_policy  FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32): parameters
           all-gathered in bf16 (half the bytes), every op in bf16 (LayerNorm too),
           gradients reduced in float32; no autocast.
The same model, data and seed for both (and a float32 reference): rank 0 prints the median
ms/step after a warm-up and the losses of the first and last steps for each.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import GPT, GPTConfig  # noqa: E402


def train(mode: str, steps: int, mesh, config: GPTConfig, batch: int) -> tuple[list[float], float]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = GPT(config)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mode == "mp_policy" else MixedPrecisionPolicy()
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    losses, times = [], []
    for _ in range(steps):
        x = torch.randint(0, 1000, (batch, config.block_size), generator=generator)  # a small vocabulary: learnable
        t0 = time.perf_counter()
        precision = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else contextlib.nullcontext()
        with precision:
            _, loss = model(x[:, :-1].contiguous(), x[:, 1:].contiguous())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        summed = loss.detach().clone()
        dist.all_reduce(summed)
        losses.append(summed.item() / dist.get_world_size())
        times.append(time.perf_counter() - t0)
    return losses, statistics.median(times[2:]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    config = GPTConfig(block_size=257, vocab_size=50304, n_layer=6, n_head=6, n_embd=384)
    for mode in ("float32", "autocast", "mp_policy"):
        losses, ms = train(mode, args.steps, mesh, config, args.batch)
        if dist.get_rank() == 0:
            print(f"{mode:10s} {ms:8.1f} ms/step  loss step 0 {losses[0]:.4f}  step {args.steps - 1} {losses[-1]:.4f}",
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
