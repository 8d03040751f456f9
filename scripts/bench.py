"""Benchmark the real training step: train_gpt2.py itself, timed.

    python scripts/bench.py                                                 # GPT-2 124M, B=64, T=1024, one GPU
    torchrun --standalone --nproc_per_node=8 scripts/bench.py --json bench.json
    python scripts/bench.py --compile false --loss_chunk_size 8192          # any trainer key can be set
    python scripts/bench.py --model custom --n_layer 2 --n_head 2 --n_embd 64 --block_size 64 --seq_len 64 \\
        --micro_batch_size 4 --total_batch_size 1024 --warmup 2 --steps 5           # a CPU smoke test

It puts the repository root on sys.path, as the other scripts here do.

The trainer runs unchanged (model, torch.compile, DDP under torchrun, gradient accumulation,
clipping, fused AdamW, the shard loader and its prefetch thread) for --warmup + --steps
optimizer steps on the shards of the configured data_dir (random tokens generated here when it
has none), with evaluation, samples and checkpoints off. Its per-step log gives the figures:
the first step's time holds the compilation, the steps after the warm-up give ms/step
(median, 10th-90th percentile), tokens/s (all ranks), MFU and peak memory. Rank 0 prints one table
and writes it as JSON.

With --profile_top N, one more step runs after the timed ones under the trainer's profiler window
(profile_from): the N kernels that took the most GPU time in it go into the JSON as top_kernels
(on the CPU, where there are no kernels, the N costliest operators). That step's time and loss
stay out of the figures above.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: train_gpt2, data, training

from data.shards import shard_files, shard_name, write_shard  # noqa: E402
from common.errors import ArgumentParser, ConfigError, run_cli  # noqa: E402


def generate_shards(folder: Path, train_tokens: int, val_tokens: int, vocab: int = 50257, seed: int = 0) -> Path:
    """Random token ids below vocab (GPT-2's 50257 at most): one val shard and train shards of at most 100M tokens."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    write_shard(folder / shard_name("bench", "val", 0), rng.integers(0, vocab, val_tokens, dtype=np.uint16))
    for index, start in enumerate(range(0, train_tokens, 100_000_000), start=1):
        size = min(100_000_000, train_tokens - start)
        write_shard(folder / shard_name("bench", "train", index), rng.integers(0, vocab, size, dtype=np.uint16))
    return folder


def summarize(log_path: Path, warmup: int, steps: int) -> dict:
    """Figures from the trainer's log.jsonl: the steps after the warm-up, and the first step; steps
    from `steps` on (a profiled step after the timed ones) are left out."""
    from runtime.logger import read_log

    records = read_log(log_path)
    train = [r for r in records if r["kind"] == "train" and r["step"] < steps]
    timed = [r for r in train if r["step"] >= warmup]
    ms = sorted(r["step_ms"] for r in timed)
    median = statistics.median(ms)
    tokens_per_step = train[0]["tokens"]
    summary = {
        "ms_per_step": median,
        "ms_p10": float(np.percentile(ms, 10)),
        "ms_p90": float(np.percentile(ms, 90)),
        "tokens_per_sec": tokens_per_step / (median / 1000),
        "first_step_s": train[0]["step_ms"] / 1000,
        "compile_s": max(train[0]["step_ms"] - median, 0.0) / 1000,  # first step minus a steady one
        "startup_s": next(r["seconds_to_first_step"] for r in records if r["kind"] == "startup"),
        "final_loss": train[-1]["loss"],
        "steps_timed": len(timed),
    }
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    summary["mfu"] = statistics.median(mfus) if mfus else None
    mems = [r["peak_mem_gb"] for r in train if r.get("peak_mem_gb") is not None]
    summary["peak_mem_gb"] = max(mems) if mems else None
    return summary


def top_kernels(trace: Path, n: int) -> dict:
    """The n kernels (CPU: operators) that took the most time in a torch.profiler Chrome trace of one step.

    GPU kernels do not overlap on one stream, so their shares add up to the step's GPU busy time;
    CPU operators nest (an operator's time includes its children's), so on the CPU the list only
    shows where the time went, and the shares overlap.
    """
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    kind = "kernel" if any(e.get("cat") == "kernel" for e in events) else "cpu_op"
    totals: dict[str, list[float]] = {}
    for event in events:
        if event.get("cat") == kind:
            total = totals.setdefault(event["name"], [0.0, 0])
            total[0] += event["dur"] / 1000  # microseconds -> ms
            total[1] += 1
    busy = sum(ms for ms, _ in totals.values()) or 1.0
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:n]
    return {"profile_events": kind, "profile_busy_ms": busy,
            "top_kernels": [{"name": name[:120], "ms": ms, "share": ms / busy, "calls": calls}
                            for name, (ms, calls) in ranked]}


def describe_run(cfg, world_size: int) -> dict:
    """What the trainer ran with cfg: the model and batch, and the runtime it resolved (device,
    precision, compile, loss chunking), from the very function the trainer uses."""
    import torch

    from model import GPT
    from runtime.process_group import local_rank

    runtime = cfg.runtime.make_runtime(local_rank())
    with torch.device("meta"):
        params = GPT(cfg.model.model_config()).num_params()
    data = cfg.data
    return {
        "model": cfg.model.model, "params": params, "B": data.micro_batch_size, "T": data.seq_len,
        "total_batch_size": data.total_batch_size, "world_size": world_size,
        "grad_accum": data.grad_accum_steps(world_size), "strategy": cfg.runtime.strategy, "compile": runtime.compile,
        "optimizer": cfg.optimizer.optimizer,
        "activation_checkpointing": cfg.runtime.activation_checkpointing_label(),
        "loss_chunk_size": runtime.loss_chunk_size, "levers": runtime.levers(), "dtype": runtime.dtype,
        "device": runtime.device_name,
        "torch": torch.__version__,
    }


def table(row: dict) -> str:
    mfu = f"{100 * row['mfu']:.1f}%" if row.get("mfu") is not None else "-"
    mem = f"{row['peak_mem_gb']:.1f}" if row.get("peak_mem_gb") is not None else "-"
    header = ("model", "params", "B", "T", "world", "accum", "strategy", "compile", "loss_chunk", "ms/step (p10-p90)",
              "tokens/s", "MFU", "peak GB", "compile s", "startup s")
    values = (row["model"], f"{row['params'] / 1e6:.0f}M", row["B"], row["T"], row["world_size"], row["grad_accum"],
              row["strategy"], row["compile"], row["loss_chunk_size"],
              f"{row['ms_per_step']:.1f} ({row['ms_p10']:.1f}-{row['ms_p90']:.1f})",
              f"{row['tokens_per_sec']:,.0f}", mfu, mem, f"{row['compile_s']:.1f}", f"{row['startup_s']:.1f}")
    widths = [max(len(str(h)), len(str(v))) for h, v in zip(header, values)]
    line = lambda cells: " | ".join(str(c).rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return f"{line(header)}\n{'-' * len(line(header))}\n{line(values)}"


def split_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """bench.py's own arguments, and the rest: the trainer's (--key value, checked by its config)."""
    parser = ArgumentParser(prog="scripts/bench.py", description=__doc__)
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (the first one compiles)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps after the warm-up")
    parser.add_argument("--json", default="bench.json", help="where rank 0 writes the figures")
    parser.add_argument("--label", default="", help="a name for this variant in the JSON")
    parser.add_argument("--profile_top", type=int, default=0,
                        help="profile one more step after the timed ones; its N costliest kernels go into the JSON")
    args, trainer_args = parser.parse_known_args(argv)
    if args.warmup < 1 or args.steps < 1:
        raise ConfigError("--warmup and --steps must be at least 1")
    if args.profile_top < 0:
        raise ConfigError(f"--profile_top must be >= 0, got {args.profile_top}")
    return args, trainer_args


def main(argv: list[str]) -> int:
    args, trainer_args = split_args(argv)

    import train_gpt2
    from launch.config import parse_args

    rank = int(os.environ.get("RANK", 0))
    work = Path(tempfile.mkdtemp(prefix=f"gpt2-bench-rank{rank}-"))
    try:
        # no evaluations, samples or checkpoints: only the steps are timed (the user's keys come last and win)
        quiet = ["--eval_interval", "0", "--hellaswag_interval", "0", "--sample_interval", "0",
                 "--checkpoint_interval", "0", "--final_checkpoint", "false", "--resume", "never", "--wandb", "false",
                 "--log_interval", "1000000"]
        # parse once to know the batch geometry, then hand the trainer its full argument list
        user_cfg = parse_args(quiet + trainer_args)
        total_steps = args.warmup + args.steps
        steps_run = total_steps + bool(args.profile_top)  # the profiled step, when asked for, comes last
        user_data = user_cfg.data
        if not shard_files(user_data.data_dir, "train"):
            # no shards where the config points: random tokens. Every rank writes its own
            # identical copy, so no coordination is needed before the process group exists.
            generate_shards(work / "data", steps_run * user_data.total_batch_size + 1,
                            user_data.seq_len * user_data.micro_batch_size + 1, min(user_cfg.model.vocab_size, 50257))
            trainer_args = [*trainer_args, "--data_dir", str(work / "data")]
        profile = ["--profile_from", str(total_steps), "--profile_steps", "1"] if args.profile_top else []  # 0-based
        bench_args = ["--out_dir", str(work / "run"), "--max_steps", str(steps_run),
                      "--val_tokens", str(user_data.seq_len * user_data.micro_batch_size), *quiet, *profile]
        code = run_cli(train_gpt2.main, bench_args + trainer_args)  # the user's keys come last and win
        if code != 0 or rank != 0:
            return code
        cfg = parse_args(bench_args + trainer_args)
        row = {"label": args.label, **describe_run(cfg, int(os.environ.get("WORLD_SIZE", 1))),
               "data": "random" if str(work) in cfg.data.data_dir else cfg.data.data_dir,
               **summarize(work / "run" / "log.jsonl", args.warmup, total_steps),
               "date": datetime.date.today().isoformat(), "command": " ".join([Path(sys.argv[0]).name, *argv])}
        print(table(row))
        if args.profile_top:
            traces = sorted((work / "run" / "profile").glob("rank0_*.json"))
            if traces:
                row.update(top_kernels(traces[0], args.profile_top))
                busy = row["profile_busy_ms"]
                print(f"the profiled step's costliest {row['profile_events']}s ({busy:.1f} ms in all):")
                for k in row["top_kernels"]:
                    print(f"  {k['ms']:9.2f} ms {k['share']:6.1%} x{k['calls']:<5} {k['name']}")
            else:
                print("warning: no profiler trace was written (the trainer's warning says why)", file=sys.stderr)
        Path(args.json).write_text(json.dumps(row, indent=2) + "\n")
        print(f"wrote {args.json}")
        return 0
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(run_cli(main))
