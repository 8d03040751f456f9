"""Throughput metrics: the bf16 peak of the detected GPU (runtime/gpus.py's table) and model FLOPs utilisation
(MFU)."""

from __future__ import annotations

import os
import time

import torch

from runtime.gpus import peak_flops_for  # the table of GPU models: torch-free, for estimates too


def detect_peak_flops(device: torch.device, override: float = 0.0) -> float | None:
    """bf16 peak of one device: the override if given, else the table (CUDA only), else None."""
    if override > 0:
        return override
    if device.type != "cuda":
        return None  # MFU is not meaningful against a CPU/MPS peak we cannot look up
    return peak_flops_for(torch.cuda.get_device_name(device))


def model_flops_utilization(flops_per_token: float, tokens_per_sec: float, world_size: int,
                            peak_flops: float | None) -> float | None:
    """Achieved model FLOP/s over all ranks divided by their combined peak.

    world_size counts every device of the run (env.world_size), not the data-parallel size: a
    replica split over several devices (tensor parallel) still has the peak of all of them.
    """
    return flops_per_token * tokens_per_sec / (peak_flops * world_size) if peak_flops else None


_IMPORTED = time.time()  # the fallback launch time where /proc is missing: close after the first imports


def process_start_time() -> float:
    """When this process was launched (Unix time): from /proc on Linux, else when this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _IMPORTED
