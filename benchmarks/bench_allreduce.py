"""The all-reduce behind DDP's gradient sync, timed on every GPU of the machine: how fast the step's one
all-reduce of the gradients can be.

    torchrun --standalone --nproc_per_node=8 benchmarks/bench_allreduce.py                        # NCCL, GPT-2 124M
    torchrun --standalone --nproc_per_node=8 benchmarks/bench_allreduce.py --model gpt2-xl --json allreduce.jsonl
    torchrun --standalone --nproc_per_node=2 benchmarks/bench_allreduce.py --device cpu --dry_run  # gloo, the rehearsal

DDP all-reduces the gradients in buckets of 25 MiB (its bucket_cap_mb default, which the trainer keeps),
in float32: the parameters are float32 under bf16 autocast, and so are their gradients. Timed here,
each as DDP would send it and in bfloat16 (half the bytes: what a bf16 compression hook would send):
  bucket  one 25 MiB bucket (--bucket_mb)
  grad    --model's whole gradient in one all-reduce (every parameter, the tied embedding once)
Each is all-reduced --warmup times, then --iters times back to back; its time is the mean of those,
the slowest rank's. Rank 0 prints one JSON line per buffer (and appends it to --json): label, bytes,
dtype, world_size, backend, ms, algbw_gbps and busbw_gbps, as nccl-tests defines them:
  algbw = bytes / time                      (the buffer's bytes over the time one all-reduce takes)
  busbw = algbw x 2 (N - 1) / N             (what each rank's link carries in a ring all-reduce: this
                                             compares with the link's own bandwidth, whatever N is)
--dry_run: a 2-layer, 64-wide model, a 1 MiB bucket and few iterations (the CPU rehearsal on gloo).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.errors import NODE_RANKS, ArgumentParser, ConfigError, held_alike_by, run_cli  # noqa: E402
from model import GPT, PRESETS, GPTConfig  # noqa: E402
from runtime.process_group import setup_distributed, teardown_distributed  # noqa: E402

DDP_BUCKET_MB = 25  # torch's DistributedDataParallel bucket_cap_mb default (MiB)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def bandwidths(nbytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s of an all-reduce of nbytes that took `seconds` over world_size ranks."""
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * 2 * (world_size - 1) / world_size


def gradient_elements(model: str, dry_run: bool) -> int:
    """How many numbers DDP all-reduces each step for the model: every parameter's gradient."""
    shape = dict(n_layer=2, n_head=2, n_embd=64) if dry_run else dict(PRESETS[model])
    with torch.device("meta"):
        gpt = GPT(GPTConfig(**shape))
    return sum(p.numel() for p in gpt.parameters() if p.requires_grad)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def time_all_reduce(buffer: torch.Tensor, warmup: int, iters: int) -> float:
    """Seconds per all-reduce of buffer: the mean of `iters` back to back, the slowest rank's."""
    for _ in range(warmup):  # NCCL sets up its channels and buffers for a size on its first calls
        dist.all_reduce(buffer)
    synchronize(buffer.device)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buffer)
    synchronize(buffer.device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=buffer.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def buffers(bucket_mb: float, elements: int) -> list[tuple[str, int, str, torch.dtype]]:
    """(label, elements, dtype name, dtype) of each buffer timed: the bucket and the whole gradient, each
    in float32 (what DDP sends) and bfloat16. The bucket holds bucket_mb MiB whatever the dtype (DDP caps
    a bucket's bytes); the gradient holds `elements` numbers."""
    return [(f"allreduce-{name}-{dtype_name}", numel or int(bucket_mb * 2**20) // dtype.itemsize, dtype_name, dtype)
            for name, numel in (("bucket", 0), ("grad", elements)) for dtype_name, dtype in DTYPES.items()]


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="benchmarks/bench_allreduce.py", description=__doc__)
    parser.add_argument("--model", default="gpt2", choices=list(PRESETS), help="whose gradient is all-reduced whole")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"], help="cuda: NCCL; cpu: gloo")
    parser.add_argument("--bucket_mb", type=float, default=DDP_BUCKET_MB, help="the bucket's size in MiB")
    parser.add_argument("--warmup", type=int, default=5, help="untimed all-reduces of each buffer first")
    parser.add_argument("--iters", type=int, default=20, help="timed all-reduces of each buffer")
    parser.add_argument("--json", default="", help="a file rank 0 appends each buffer's JSON line to")
    parser.add_argument("--dry_run", action="store_true",
                        help="a 2-layer, 64-wide model, a 1 MiB bucket, 1 warm-up and 3 timed all-reduces")
    with held_alike_by(NODE_RANKS):  # every rank reads the same arguments: one line per node
        args = parser.parse_args(argv)
        if args.dry_run:
            args.bucket_mb, args.warmup, args.iters = 1, 1, 3
        if args.bucket_mb <= 0 or args.warmup < 0 or args.iters < 1:
            raise ConfigError("--bucket_mb must be positive, --warmup at least 0 and --iters at least 1")
        if int(os.environ.get("WORLD_SIZE", 1)) < 2:
            raise ConfigError("an all-reduce needs 2 or more ranks: run it under torchrun --nproc_per_node=N, N >= 2")
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA GPU here (--device cpu times gloo)")

    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    env = setup_distributed(device, datetime.timedelta(minutes=10))
    try:
        backend = dist.get_backend()
        for label, numel, dtype_name, dtype in buffers(args.bucket_mb, gradient_elements(args.model, args.dry_run)):
            # zeros: repeated sums stay finite, and no value changes what an all-reduce costs
            buffer = torch.zeros(numel, dtype=dtype, device=device)
            seconds = time_all_reduce(buffer, args.warmup, args.iters)
            del buffer
            nbytes = numel * dtype.itemsize
            algbw, busbw = bandwidths(nbytes, seconds, env.world_size)
            row = {"label": label, "model": "dry_run" if args.dry_run else args.model, "bytes": nbytes,
                   "dtype": dtype_name, "world_size": env.world_size, "backend": backend,
                   "device": torch.cuda.get_device_name(device) if cuda else "cpu", "iters": args.iters,
                   "ms": seconds * 1000, "algbw_gbps": algbw, "busbw_gbps": busbw}
            if env.master_process:
                line = json.dumps(row)
                print(line, flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(line + "\n")
    finally:
        teardown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
