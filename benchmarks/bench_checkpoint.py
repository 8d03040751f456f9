"""The preemption budget of a checkpoint: how long a save blocks the loop, how long until it is
complete, its size and peak host memory per rank; and how long a resume takes to load it.

    B="benchmarks/bench_checkpoint.py --model gpt2" D=/tmp/ckpt-bench
    torchrun --standalone --nproc_per_node=2 $B --format file --dir $D/file
    torchrun --standalone --nproc_per_node=2 $B --format sharded --dir $D/sync
    torchrun --standalone --nproc_per_node=2 $B --format sharded --async --dir $D/async
    torchrun --standalone --nproc_per_node=2 $B --load $D/file/step_00000001.pt
    python $B --load $D/async/step_00000001     # one process (ddp)
    rm -rf $D
    python $B --device cuda --format sharded --async --dir $D   # on a GPU (scripts/gpu_check.sh, part checkpoint)

Builds the model (float32, on --device: the CPU with gloo by default, or CUDA with NCCL) sharded
with FSDP (`--strategy fsdp`, the default on 2+ ranks) or whole on every rank (`ddp`, the default
in one process), and its AdamW state (one step on zero gradients), then goes through the
trainer's own code: a save is `Checkpointer.save` then `Checkpointer.wait`
(training/checkpoint/checkpointer.py) of checkpoint step 1 into --dir (a temp folder, deleted afterwards,
when not given); `--load PATH` builds a fresh model and optimizer and times
`load_compatible_checkpoint` + `load_state` (launch/resume.py), on whatever number of ranks it is launched.
Each invocation is its own processes, so the peak resident memory (ru_maxrss) is that method's.
Rank 0 prints one JSON line: blocking_s (until `save` returns: the whole save, except for
`--async`, where it is the copy to host memory), total_s (until written and committed), the bytes
on disk and bytes / total_s, or load_s; and each rank's peak host memory (GiB) after the build and
at the end (on CUDA also rank 0's peak GPU memory). `--dry_run` takes a 2-layer model instead of
--model: the plumbing in seconds (tests, scripts/gpu_check.sh's rehearsal on the CPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import GPT, PRESETS  # noqa: E402
from training.checkpoint.folder import FORMATS, checkpoints_folder  # noqa: E402
from launch.config import TrainConfig  # noqa: E402
from runtime.context import Context  # noqa: E402
from runtime.process_group import barrier, broadcast_object, setup_distributed, teardown_distributed  # noqa: E402
from training.distributed.strategies import STRATEGIES, make_strategy  # noqa: E402
from launch.resume import load_compatible_checkpoint, load_state  # noqa: E402
from training.optim.optimizers import build_optimizer  # noqa: E402
from training.run.run import Run  # noqa: E402
from runtime.logger import RunLogger  # noqa: E402
from runtime.runtime import resolve_runtime  # noqa: E402
from train_gpt2 import make_checkpointer  # noqa: E402


def peak_rss_gib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)  # Linux reports KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", choices=list(PRESETS))
    parser.add_argument("--format", default="sharded", choices=["file", "sharded"])
    parser.add_argument("--async", dest="asynchronous", action="store_true", help="sharded: write in the background")
    parser.add_argument("--strategy", default=None, choices=list(STRATEGIES), help="default: fsdp on 2+ ranks, or ddp")
    parser.add_argument("--dir", default=None, help="checkpoint folder to save into (default: a temp folder)")
    parser.add_argument("--load", default=None, help="instead of saving, time loading this checkpoint")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model and AdamW live")
    parser.add_argument("--label", default=None, help="a name copied into the JSON line")
    parser.add_argument("--dry_run", action="store_true", help="a 2-layer, 64-wide model instead of --model")
    args = parser.parse_args()

    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    env = setup_distributed(device, datetime.timedelta(minutes=60))
    strategy_name = args.strategy or ("fsdp" if env.world_size > 1 else "ddp")
    folder = args.dir or ""
    if not folder and not args.load:  # rank 0's temp folder, for every rank
        folder = broadcast_object(tempfile.mkdtemp(prefix="ckpt-bench-") if env.master_process else "", env)
    tiny = dict(model="custom", n_layer=2, n_head=2, n_embd=64) if args.dry_run else {}
    cfg = TrainConfig(**{"model": args.model, **tiny}, strategy=strategy_name, device=args.device, dtype="float32",
                      out_dir=folder or "out", checkpoint_dir=folder, checkpoint_format=args.format,
                      checkpoint_async=args.asynchronous)
    runtime = resolve_runtime(args.device, "float32", False, 0)
    strategy = make_strategy(strategy_name, env, runtime)
    model = GPT(cfg.model.model_config())
    strategy.shard(model)
    model.to(device)
    optimizer = build_optimizer(model, cfg.optimizer, cfg.schedule.max_lr, device.type)  # fused AdamW on CUDA
    if args.load is None:  # a resume loads into a fresh optimizer; a save needs the AdamW moments
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    run = Run(model=model, optimizer=optimizer, strategy=strategy, train_loader=None, val_loaders={},
              scaler=torch.amp.GradScaler("cpu", enabled=False), grad_accum_steps=1, data_fingerprint="", step=1,
              config=cfg.to_dict(), checkpoints=checkpoints_folder(cfg.run.out_dir, cfg.checkpoint.checkpoint_dir))
    result = {"label": args.label, "model": cfg.model.model, "params": model.num_params(), "strategy": strategy_name,
              "world_size": env.world_size, "device": args.device}
    checkpointer = make_checkpointer(cfg, Context(env, runtime, RunLogger(enabled=False)), run, record={})
    built = peak_rss_gib()

    def synchronize() -> None:  # a time taken on CUDA counts the kernels launched before it
        if cuda:
            torch.cuda.synchronize()
        barrier(env)

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    synchronize()
    t0 = time.perf_counter()
    if args.load:
        load_state(run, load_compatible_checkpoint(args.load, model.config), args.load)  # as a resume does
        synchronize()
        result.update(path=args.load, load_s=round(time.perf_counter() - t0, 2))
    else:
        checkpointer.save(run)  # returns once training could go on (the trainer syncs at its next step)
        blocking = time.perf_counter() - t0
        checkpointer.wait()
        total = time.perf_counter() - t0
        path = FORMATS[args.format].path(Path(folder), run.step)
        size = sum(p.stat().st_size for p in [path, *path.rglob("*")] if p.is_file())
        result.update(format=args.format, asynchronous=args.asynchronous, path=str(path), bytes_on_disk=size,
                      blocking_s=round(blocking, 2), total_s=round(total, 2), gb_per_s=round(size / total / 1e9, 3))

    peaks = [(built, peak_rss_gib())]
    if env.distributed:
        peaks = [None] * env.world_size
        dist.all_gather_object(peaks, (built, peak_rss_gib()))
    if env.master_process:
        result.update(built_rss_gib=[b for b, _ in peaks], peak_rss_gib=[p for _, p in peaks])
        if cuda:
            result.update(peak_cuda_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
        print(json.dumps(result), flush=True)
        if folder and args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    teardown_distributed()


if __name__ == "__main__":
    main()
