"""What is known of each GPU model: its dense bf16 peak and memory from the vendor's data sheet, and what this
trainer measured on it. The MFU the trainer logs divides by these peaks; an estimate before a run (the trainer's
--estimate, ladder.py's --dry_run) reads the same table and the measurements.

No torch here: an estimate is worked out before anything heavy loads.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPUModel:
    name: str  # matched against a device name (torch.cuda.get_device_name, nvidia-smi) or a user's words
    bf16_flops: float  # dense bf16 tensor-core peak, FLOP/s (no sparsity)
    memory_gib: float | None  # the card's memory; None where one name covers cards of several sizes


# Matched in order, so the more specific names come first. Memory: None where the name does not fix it (A100 and
# A800 come with 40 or 80 GB, GH200 with 96 or 144 GB, the Blackwell parts in several configurations).
GPU_MODELS = [
    GPUModel("GH200", 989.4e12, None),
    GPUModel("H200", 989.4e12, 141),
    GPUModel("H100 NVL", 835e12, 94),
    GPUModel("H100 PCIe", 756e12, 80),
    GPUModel("H100", 989.4e12, 80),  # SXM5, e.g. "NVIDIA H100 80GB HBM3"
    GPUModel("H800", 989.4e12, 80),
    GPUModel("B200", 2250e12, None),
    GPUModel("B100", 1750e12, None),
    GPUModel("A100", 312e12, None),
    GPUModel("A800", 312e12, None),
    GPUModel("L40S", 362e12, 48),
    GPUModel("L40", 181e12, 48),
    GPUModel("L4", 121e12, 24),
    GPUModel("A10G", 70e12, 24),  # AWS's A10G runs at lower clocks than the A10
    GPUModel("A10", 125e12, 24),
    GPUModel("RTX 6000 Ada", 364.2e12, 48),
    GPUModel("RTX A6000", 154.8e12, 48),
    GPUModel("RTX 4090", 165.2e12, 24),
    GPUModel("RTX 3090", 71e12, 24),
]
PEAK_BF16_FLOPS = [(gpu.name, gpu.bf16_flops) for gpu in GPU_MODELS]


def gpu_model(device_name: str) -> GPUModel | None:
    """The table's entry whose name is in device_name (any case); None when the device is not listed."""
    name = device_name.casefold()
    return next((gpu for gpu in GPU_MODELS if gpu.name.casefold() in name), None)


def peak_flops_for(device_name: str) -> float | None:
    """Table lookup by device name; None when the device is not listed."""
    gpu = gpu_model(device_name)
    return None if gpu is None else gpu.bf16_flops


@dataclass(frozen=True)
class Measurement:
    """One measured configuration of the trainer on one GPU, as docs/PERFORMANCE.md records it."""

    gpu: str  # a GPU_MODELS name
    date: str
    model: str  # the preset
    seq_len: int
    micro_batch_size: int
    compile: bool
    loss_chunk_size: int  # 0: the plain loss
    strategy: str
    tokens_per_sec: float  # one GPU, the steady state (the median step)
    peak_memory_gib: float  # torch.cuda.max_memory_allocated over the timed steps
    startup_s: float  # process launch to the first finished step, compilation into an empty cache included
    source: str

    def label(self) -> str:
        return f"measured ({self.date}, one {self.gpu})"


# Every measurement of the trainer on a GPU so far. An estimate uses one where the run's model, sequence length,
# micro-batch, compile, loss, optimizer, strategy and recomputation (none) are the ones measured, and says so: its
# MFU on the same GPU model, its start-up and memory on any; anything else is an assumption.
MEASUREMENTS = [
    Measurement(gpu="H200", date="2026-11-28", model="gpt2", seq_len=1024, micro_batch_size=64, compile=True,
                loss_chunk_size=0, strategy="ddp", tokens_per_sec=509_852, peak_memory_gib=41.2, startup_s=34.1,
                source="docs/PERFORMANCE.md: scripts/bench.py, 25 timed steps of 524,288 tokens, torch 2.11"),
]
