"""Measure what saving and loading an FSDP run's state costs: time and peak host memory per rank.

    torchrun --standalone --nproc_per_node=2 scripts/fsdp_checkpoint_cost.py --model gpt2-large --method full
    torchrun --standalone --nproc_per_node=2 scripts/fsdp_checkpoint_cost.py --model gpt2-large --method dcp

Builds the model sharded with FSDP2 (CPU, gloo) and its AdamW state (moments filled by one
step on a zero gradient), then either
  full  gathers full model and optimizer state dicts onto rank 0's CPU and writes one file
        (what the trainer does: one checkpoint format for every strategy), then every rank
        memory-maps that file and loads its shard back;
  dcp   writes torch.distributed.checkpoint's sharded format (a folder, one file per rank) and
        loads it back (the resharding alternative).
Each method runs in its own processes, so the peak resident memory (ru_maxrss) is its own.
Rank 0 prints one JSON line: seconds to save and to load, and each rank's peak memory.
"""

from __future__ import annotations

import argparse
import datetime
import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import GPT, PRESETS, GPTConfig  # noqa: E402
from training.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from training.distributed import DistEnv  # noqa: E402
from training.parallel import make_strategy  # noqa: E402
from training.runtime import resolve_runtime  # noqa: E402


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-large", choices=list(PRESETS))
    parser.add_argument("--method", default="full", choices=["full", "dcp"])
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=60))
    env = DistEnv(rank=dist.get_rank(), local_rank=dist.get_rank(), world_size=dist.get_world_size(),
                  device=torch.device("cpu"), distributed=True)
    strategy = make_strategy("fsdp", env, resolve_runtime("cpu", "float32", False, 0))
    model = GPT(GPTConfig(**PRESETS[args.model]))
    strategy.shard(model)
    optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # creates the AdamW moments (12 bytes per parameter with the weights)
    optimizer.zero_grad(set_to_none=True)
    built = peak_rss_gib()

    folder = Path(args.dir) if args.dir else None
    if folder is None:  # rank 0's temp folder, for every rank
        folder = Path(dist_broadcast(tempfile.mkdtemp(prefix="ckpt-cost-") if env.master_process else "", env))
    dist.barrier()
    t0 = time.perf_counter()
    if args.method == "full":
        model_state, optimizer_state = strategy.full_state(model, optimizer)
        if env.master_process:
            save_checkpoint({"model": model_state, "optimizer": optimizer_state, "step": 0}, folder / "state.pt")
        del model_state, optimizer_state
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder / "dcp"))
        del model_state, optimizer_state
    dist.barrier()
    saved = time.perf_counter() - t0
    after_save = peak_rss_gib()

    t0 = time.perf_counter()
    if args.method == "full":
        state = load_checkpoint(folder / "state.pt")
        strategy.load_full_state(model, optimizer, state["model"], state["optimizer"])
        del state
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer)
        target = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(target, checkpoint_id=str(folder / "dcp"))
        set_state_dict(model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optimizer"])
    dist.barrier()
    loaded = time.perf_counter() - t0
    sizes = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())

    peaks = [None] * env.world_size
    dist.all_gather_object(peaks, {"built": built, "after_save": after_save, "after_load": peak_rss_gib()})
    if env.master_process:
        with torch.device("meta"):
            params = GPT(GPTConfig(**PRESETS[args.model])).num_params()
        print(json.dumps({"model": args.model, "params": params, "method": args.method, "world_size": env.world_size,
                          "bytes_on_disk": sizes, "save_s": round(saved, 1), "load_s": round(loaded, 1),
                          "peak_rss_gib_per_rank": [{k: round(v, 2) for k, v in p.items()} for p in peaks]}))
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    dist.destroy_process_group()


def dist_broadcast(value: str, env: DistEnv) -> str:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


if __name__ == "__main__":
    main()
