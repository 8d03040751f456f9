"""What Muon's optimizer step costs per rank: every rank orthogonalising every matrix, or each one its share.

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_muon.py --model gpt2 --layers 4     # CPU, gloo
    python benchmarks/bench_muon.py --device cuda --model gpt2                                     # one GPU
    torchrun --standalone --nproc_per_node=8 benchmarks/bench_muon.py --device cuda --model gpt2   # 8 GPUs

Takes the Muon matrices of --model (the blocks' attention and MLP weights, as the trainer's
optimizer muon splits them; --layers keeps the first few blocks' worth, so the CPU run is short)
with random gradients, and times optimizer.step() (the median of --steps after 2 warm-up steps,
the slowest rank's):
  replicated   torch.optim.Muon on every rank, each rank orthogonalising every matrix (what ddp
               ran before training/distributed/muon.py)
  whole        DistributedMuon over whole matrices (ddp): each orthogonalised on its owner, then broadcast
  rows         DistributedMuon over row shards (DTensors, as FSDP2 holds them): each gathered to its
               owner, orthogonalised, and its rows scattered back
Rank 0 prints one JSON line per variant: label, model, layers, world_size, device, step_ms,
newton_schulz_runs (on rank 0, per step). `--dry_run`: a 2-layer, 64-wide model (the rehearsal).
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.errors import ArgumentParser, run_cli  # noqa: E402
from model import GPT, PRESETS, GPTConfig  # noqa: E402
from training.distributed.muon import DistributedMuon  # noqa: E402
from runtime.process_group import setup_distributed, teardown_distributed  # noqa: E402
from training.optim.optimizers.muon import split_parameters  # noqa: E402

OPTIONS = dict(lr=0.02, momentum=0.95, weight_decay=0.0, nesterov=True)  # the trainer's muon defaults


def muon_shapes(model: str, layers: int | None, dry_run: bool) -> list[torch.Size]:
    shape = dict(n_layer=2, n_head=2, n_embd=64) if dry_run else dict(PRESETS[model])
    if layers:
        shape["n_layer"] = min(layers, shape["n_layer"])
    with torch.device("meta"):
        gpt = GPT(GPTConfig(**shape))
    muon, _ = split_parameters(gpt)
    return [p.shape for p in muon]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier()


def time_steps(optimizer: torch.optim.Optimizer, steps: int, device: torch.device) -> float:
    """The median step in ms over `steps` after 2 warm-up steps, the slowest rank's."""
    times = []
    for i in range(steps + 2):
        synchronize(device)
        start = time.perf_counter()
        optimizer.step()
        synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    median = torch.tensor([statistics.median(times) * 1000], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median)


def main(argv: list[str]) -> int:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="gpt2", choices=list(PRESETS))
    parser.add_argument("--layers", type=int, default=None, help="only the first LAYERS blocks' matrices")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--variants", default="replicated,whole,rows")
    parser.add_argument("--dry_run", action="store_true", help="a 2-layer, 64-wide model instead of --model")
    args = parser.parse_args(argv)

    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    env = setup_distributed(device, datetime.timedelta(minutes=30))
    try:
        shapes = muon_shapes(args.model, args.layers, args.dry_run)
        mesh = None
        for variant in args.variants.split(","):
            torch.manual_seed(0)  # the same matrices and gradients on every rank
            whole = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
            grads = [torch.randn(s, device=device) for s in shapes]
            if variant == "rows" and env.distributed:
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.tensor import Shard, distribute_tensor

                mesh = mesh or init_device_mesh(device.type, (env.world_size,))
                params = [torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])) for p in whole]
                for p, g in zip(params, grads):
                    p.grad = distribute_tensor(g, mesh, [Shard(0)])
            else:
                params = whole
                for p, g in zip(params, grads):
                    p.grad = g
            if variant == "replicated":
                optimizer = torch.optim.Muon(params, **OPTIONS)
                runs = len(shapes)
            else:
                optimizer = DistributedMuon(params, **OPTIONS)
                runs = sum(owner == optimizer.rank for owner in optimizer.owners.values())
            step_ms = time_steps(optimizer, args.steps, device)
            if env.master_process:
                print(json.dumps({"label": f"muon-{variant}", "model": "dry_run" if args.dry_run else args.model,
                                  "layers": len(shapes) // 4, "world_size": env.world_size, "device": args.device,
                                  "step_ms": round(step_ms, 2), "newton_schulz_runs": runs}), flush=True)
            del optimizer, params, whole, grads
    finally:
        teardown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
