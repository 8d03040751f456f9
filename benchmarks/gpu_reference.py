"""Time build-nanogpt's GPT-2 124M training step on this machine: the reference to beat.

    python benchmarks/gpu_reference.py --json reference.json     # compiled, B=64, T=1024, 524,288 tokens/step
    python benchmarks/gpu_reference.py --dry_run                  # the same plumbing on the CPU, tiny model, 3 steps

build-nanogpt (github.com/karpathy/build-nanogpt) is the compiled PyTorch GPT-2 loop this trainer
is measured against (it publishes no H100 rate; 468K tokens/s per H100 is llm.c's). Timed on the same machine as
scripts/bench.py, it gives the ratio from one machine. Its code is not part of this repository and
is never committed here: clone it into the git-ignored folder .ref/ on the GPU machine first,

    git clone https://github.com/karpathy/build-nanogpt .ref/build-nanogpt

(--ref names a copy elsewhere). scripts/gpu_check.sh runs this script as its part `reference`.

That train_gpt2.py is a script: importing it would start training on FineWeb shards. So only
its definitions are loaded, from its syntax tree: the top-level imports (not `hellaswag`), classes
and functions (GPTConfig, GPT, DataLoaderLite, get_lr, ...); none of its top-level statements
run. The loop here is ours and mirrors its training step: torch.manual_seed(1337), TF32 matmuls
('high'), GPT(GPTConfig(vocab_size=50304)) compiled, its configure_optimizers (fused AdamW), its
DataLoaderLite on a shard of random tokens, bf16 autocast, gradient accumulation to 524,288
tokens, clipping at 1.0, its get_lr, then torch.cuda.synchronize() and the step's wall time.
The row it writes has scripts/bench.py's keys, so gpu_check.sh's summary puts both in one table.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: our model (FLOPs per token) and metrics

from model import GPT as OurGPT, GPTConfig as OurConfig  # noqa: E402
from launch.config import TrainConfig  # noqa: E402
from runtime.metrics import detect_peak_flops, process_start_time  # noqa: E402

DEFAULT_REF = REPO / ".ref" / "build-nanogpt" / "train_gpt2.py"
NEEDED = ("GPTConfig", "GPT", "DataLoaderLite", "get_lr")
DATA_ROOT = "edu_fineweb10B"  # the folder DataLoaderLite reads, relative to the working directory


def load_definitions(path: Path) -> types.ModuleType:
    """A module holding the script's imports and definitions, with the globals they read supplied."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))

    def wanted(node: ast.stmt) -> bool:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            return True
        if isinstance(node, ast.ImportFrom):
            return node.module != "hellaswag"  # the eval helpers, absent beside a lone train_gpt2.py
        return isinstance(node, ast.Import) and all(alias.name != "hellaswag" for alias in node.names)

    module = types.ModuleType("build_nanogpt_train_gpt2")
    module.__file__ = str(path)
    sys.modules[module.__name__] = module  # @dataclass looks its class's module up there
    # the script-level globals its definitions read: one process, and its (our) lr schedule
    recipe = TrainConfig()
    schedule = recipe.schedule
    module.__dict__.update(master_process=True, max_lr=schedule.max_lr, min_lr=schedule.min_lr,
                           warmup_steps=schedule.warmup_steps, max_steps=schedule.max_steps)
    body = ast.Module(body=[node for node in tree.body if wanted(node)], type_ignores=[])
    exec(compile(body, str(path), "exec"), module.__dict__)
    if missing := [name for name in NEEDED if name not in module.__dict__]:
        raise SystemExit(f"error: {path} defines no {', '.join(missing)}: not build-nanogpt's train_gpt2.py?")
    return module


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpu_reference.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref", type=Path, default=DEFAULT_REF, help="build-nanogpt's train_gpt2.py")
    parser.add_argument("--json", default="reference.json", help="where the row goes")
    parser.add_argument("--label", default="reference-build-nanogpt-b64")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first one compiles)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--dry_run", action="store_true",
                        help="CPU, no compile, a 2-layer model, 2 micro-batches of 2 x 32 tokens: plumbing only")
    args = parser.parse_args(argv)
    if not args.ref.is_file():
        print(f"error: no {args.ref}; see the top of benchmarks/gpu_reference.py for how to fetch it", file=sys.stderr)
        return 2
    ref = load_definitions(args.ref)

    if args.dry_run:
        device, use_compile, B, T, total = "cpu", False, 2, 32, 128
        shape = dict(block_size=T, vocab_size=50304, n_layer=2, n_head=2, n_embd=64)
    else:
        device, use_compile, B, T, total = "cuda", True, 64, 1024, 524288
        shape = dict(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768)  # GPT-2 124M, padded vocab
    device_type = "cuda" if device.startswith("cuda") else "cpu"
    grad_accum_steps = total // (B * T)
    steps = args.warmup + args.steps

    torch.manual_seed(1337)
    torch.set_float32_matmul_precision("high")
    model = ref.GPT(ref.GPTConfig(**shape))
    model.to(device)
    if use_compile:
        model = torch.compile(model)
    optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=6e-4, device_type=device_type)

    # one shard of random GPT-2 ids, long enough that the loader never reloads it mid-run
    work, here = Path(tempfile.mkdtemp(prefix="gpu-reference-")), os.getcwd()
    try:
        (work / DATA_ROOT).mkdir()
        tokens = np.random.default_rng(0).integers(0, 50257, steps * total + B * T + 1, dtype=np.uint16)
        np.save(work / DATA_ROOT / "refbench_train_000001.npy", tokens)
        os.chdir(work)
        train_loader = ref.DataLoaderLite(B=B, T=T, process_rank=0, num_processes=1, split="train")  # reads it whole
    finally:
        os.chdir(here)
        shutil.rmtree(work, ignore_errors=True)

    times, losses, first_done = [], [], None
    for step in range(steps):
        t0 = time.time()
        optimizer.zero_grad()
        loss_accum = 0.0
        for _ in range(grad_accum_steps):
            x, y = train_loader.next_batch()
            x, y = x.to(device), y.to(device)
            with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
                _, loss = model(x, y)
            loss = loss / grad_accum_steps
            loss_accum += loss.detach()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        lr = ref.get_lr(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        if device_type == "cuda":
            torch.cuda.synchronize()
        times.append(time.time() - t0)
        first_done = first_done or time.time()
        losses.append(loss_accum.item())
        print(f"step {step:3d} | loss {losses[-1]:.6f} | {times[-1] * 1000:.1f} ms", flush=True)

    ms = sorted(1000 * t for t in times[args.warmup:])
    median = statistics.median(ms)
    with torch.device("meta"):
        flops_per_token = OurGPT(OurConfig(**shape)).estimate_flops_per_token(T)  # the same architecture
    peak = detect_peak_flops(torch.device(device))
    tokens_per_sec = total / (median / 1000)
    row = {
        "label": args.label, "model": "gpt2 (build-nanogpt)", "params": sum(p.numel() for p in model.parameters()),
        "B": B, "T": T, "total_batch_size": total, "world_size": 1, "grad_accum": grad_accum_steps,
        "compile": use_compile, "loss_chunk_size": 0, "dtype": "bfloat16",
        "device": torch.cuda.get_device_name() if device_type == "cuda" else device_type, "torch": torch.__version__,
        "data": "random", "ms_per_step": median, "ms_p10": float(np.percentile(ms, 10)),
        "ms_p90": float(np.percentile(ms, 90)), "tokens_per_sec": tokens_per_sec, "first_step_s": times[0],
        "compile_s": max(1000 * times[0] - median, 0.0) / 1000, "startup_s": first_done - process_start_time(),
        "final_loss": losses[-1], "steps_timed": len(ms),
        "mfu": flops_per_token * tokens_per_sec / peak if peak else None,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if device_type == "cuda" else None,
        "date": datetime.date.today().isoformat(), "command": " ".join(["gpu_reference.py", *argv]),
        "reference_sha256": hashlib.sha256(args.ref.read_bytes()).hexdigest(),
    }
    Path(args.json).write_text(json.dumps(row, indent=2) + "\n")
    print(f"{args.label}: {median:.1f} ms/step (p10-p90 {row['ms_p10']:.1f}-{row['ms_p90']:.1f}), "
          f"{tokens_per_sec:,.0f} tokens/s; wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
