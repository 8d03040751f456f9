"""What produced a run: code, software, hardware, launch, configuration and data.

The record goes into `out_dir/run.json` (one per launch, overwritten by a resume), into every
checkpoint the launch writes, and into the W&B run's config, so any curve or checkpoint can be
traced to the commit, versions, devices and command that made it.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from runtime.context import Context

REPO = Path(__file__).resolve().parents[2]
# environment variables that choose kernels or change how they sum (cuBLAS' workspace, TF32, inductor's
# and NCCL's algorithm switches): two runs that differ here may round differently
KERNEL_ENV_PREFIXES = ("CUBLAS_", "CUDNN_", "NVIDIA_TF32_OVERRIDE", "TORCHINDUCTOR_", "TORCH_", "PYTORCH_", "NCCL_")


def provenance(ctx: Context, argv: list[str], data_fingerprint: str, run_id: str, config_yaml: str) -> dict:
    """The record of this launch (config_yaml: the whole configuration as config.yaml holds it)."""
    runtime = ctx.runtime
    commit, dirty = git_state(REPO)
    return {
        # the run this launch continues or starts: the run folder's owner (training/checkpoint/run_folder.py)
        "run_id": run_id,
        "git_commit": commit,  # None outside a git checkout
        "git_dirty": dirty,  # uncommitted changes to tracked files
        "python": platform.python_version(),
        "torch": str(torch.__version__),  # a str subclass that weights_only loading refuses
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if runtime.device_type == "cuda" else None,
        "device": runtime.device_name,
        "dtype": runtime.dtype,  # dtype auto resolved: bfloat16 or float32 on a CPU, by what the CPU has
        "cpu": cpu_model(),
        # the CPU kernels PyTorch picked (avx512, avx2, default): they differ in the last bits of float results
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "device_count": torch.cuda.device_count() if runtime.device_type == "cuda" else 1,
        "world_size": ctx.env.world_size,
        "command": shlex.join([Path(sys.argv[0]).name, *argv]),
        "config_sha256": hashlib.sha256(config_yaml.encode()).hexdigest(),  # the whole configuration
        "data_fingerprint": data_fingerprint,
        "kernel_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(KERNEL_ENV_PREFIXES)},
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def git_state(folder: Path) -> tuple[str | None, bool | None]:
    """(HEAD commit, whether tracked files differ from it) of the checkout holding folder."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return commit.strip(), None if status is None else bool(status.strip())


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's on Linux), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
