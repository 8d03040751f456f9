"""ladder.py --dry_run's time: each rung's run as the trainer's --estimate works it out, at a throughput measured
on this CPU or taken from launch/estimate.py's table of GPUs."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from common.errors import ReproError
from launch.estimate import estimate, find_gpu, gpu_hardware, measured_hardware
from scaling_ladder.plan import REPO, Rung, rung_config
from scaling_ladder.runs import rung_environment


def rung_hardware(args, rungs: list[Rung]):
    """What the dry run times the rungs on, for each rung (launch/estimate.py's Hardware: its rate and where that
    comes from): on the CPU one rate measured on the ladder's largest rung; on a GPU model of the table, the
    trainer's --estimate's for each rung's config (its MFU measured for that configuration on that GPU model, else
    --mfu or the default, assumed)."""
    hardware = args.hardware
    if hardware == "auto":
        hardware = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    if hardware == "cpu":
        # the largest rung of the ladder: the largest take most of its time (and a CPU's FLOP/s grows with width)
        rate, how = measured_cpu_throughput(max((r for r in rungs if not r.check), key=lambda r: r.flops_per_token))
        return {r.name: measured_hardware("this CPU", rate, how) for r in rungs}
    gpu = find_gpu(hardware, "--hardware")
    gpus = args.gpus or args.nproc_per_node
    return {r.name: gpu_hardware(rung_config(r), gpu, gpus, args.mfu) for r in rungs}


def rung_times(args, rungs: list[Rung]) -> tuple[dict[str, float], list[str]]:
    """{rung: seconds} of the trainer's estimate of each rung (train_gpt2.py --estimate's hours: steps, evaluations,
    checkpoints, start-up), and where their speeds come from (each source once)."""
    hardware = rung_hardware(args, rungs)
    times = {r.name: estimate(rung_config(r), hardware[r.name]).total_s for r in rungs}
    sources = list(dict.fromkeys(f"{h.name}: {h.source}" for h in hardware.values()))
    return times, sources


def measured_cpu_throughput(rung: Rung) -> tuple[float, str]:
    """FLOP/s of this CPU on a rung: scripts/bench.py times the trainer's own step (the median of 3, after one),
    with a micro-batch of at most 2,048 tokens and one micro-step a step."""
    cfg = rung_config(rung)
    rows = max(1, min(cfg.data.micro_batch_size or 1, 2048 // cfg.data.seq_len))
    with tempfile.TemporaryDirectory(prefix="ladder-bench-") as work:
        config, figures = Path(work) / "rung.yaml", Path(work) / "bench.json"
        config.write_text(rung.config)
        command = [sys.executable, str(REPO / "scripts" / "bench.py"), "--warmup", "1", "--steps", "3", "--json",
                   str(figures), "--config", str(config), "--micro_batch_size", str(rows), "--total_batch_size",
                   str(rows * cfg.data.seq_len)]
        proc = subprocess.run(command, cwd=REPO, env=rung_environment(), capture_output=True, text=True)
        if proc.returncode != 0:
            raise ReproError(f"measuring this CPU: scripts/bench.py exited {proc.returncode}: "
                             f"{(proc.stderr.strip().splitlines() or [''])[-1]}")
        tokens_per_sec = json.loads(figures.read_text())["tokens_per_sec"]
    rate = tokens_per_sec * rung.flops_per_token
    return rate, (f"measured: {rate / 1e9:.1f} GFLOP/s, scripts/bench.py's median step of {rung.size.label} on this "
                  f"CPU ({rows * cfg.data.seq_len:,} tokens a step)")
