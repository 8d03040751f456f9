"""gpu_check.sh's memory part: micro_batch_size auto per preset and activation_checkpointing setting, on this GPU.

    python benchmarks/memory_check.py --model gpt2-xl --data_dir DIR --work DIR [--settings none,selective,full]
    python benchmarks/memory_check.py --dry_run --data_dir DIR --work DIR      # the plumbing, on the CPU

For each setting: a short trainer run (2 steps of 524,288 tokens, eager, bf16, ddp on one GPU) with
`--micro_batch_size auto`; the B it chose (run.json), the peak memory of its real steps (log.jsonl's
peak_mem_gb, the probes' peaks excluded) and its step time, beside scripts/memory_table.py's estimate
for this card: the largest B the table predicts, and the peak it predicts at the chosen B (model state,
what does not grow with B, and B sequences of activations). Eager, so the probes do not compile each
size (compile is probed the same way, only slower). One JSON line per setting on stdout; a setting the
time budget (BENCH_DEADLINE, BENCH_MIN_S: gpu_check.sh exports them) leaves no time for is a line with
"skipped". The dry run uses conftest's tiny model on the CPU, where auto falls back to
micro_batch_size_fallback: it checks the plumbing, not the memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.activations import activation_costs, params_of  # noqa: E402
from launch.estimate import GIB, STATE_BYTES, largest_batch  # noqa: E402
from model import PRESETS  # noqa: E402
from runtime.logger import LOG_NAME, read_log  # noqa: E402

SETTINGS = {"none": 0, "selective": 2, "full": 1}  # activation_checkpointing -> recompute one block in every N
TINY = dict(n_layer=2, n_head=2, n_embd=64)
VOCAB = 50304  # the corpus is GPT-2 tokens


def trainer_args(model: str, setting: str, data_dir: str, out: Path, dry_run: bool) -> list[str]:
    shape = ["--model", "custom", *(f"--{k}={v}" for k, v in TINY.items()), "--block_size", "32", "--seq_len", "32"] \
        if dry_run else ["--model", model]
    tokens = 2 * 4 * 32 if dry_run else 524288
    return [*shape, "--data_dir", data_dir, "--out_dir", str(out), "--micro_batch_size", "auto",
            "--micro_batch_size_fallback", "4", "--activation_checkpointing", setting,
            "--total_batch_size", str(tokens), "--max_steps", "2", "--warmup_steps", "1", "--eval_interval", "0",
            "--val_tokens", str(tokens // 8), "--hellaswag_interval", "0", "--sample_interval", "0",
            "--checkpoint_interval", "0", "--final_checkpoint", "false", "--compile", "false",
            "--vocab_size", str(VOCAB), "--device", "cpu" if dry_run else "cuda",
            "--dtype", "float32" if dry_run else "bfloat16", "--log_interval", "1"]


def one_setting(model: str, setting: str, args, costs, params: int, n_layer: int, card_gib: float | None) -> dict:
    out = Path(args.work) / f"{model}-{setting}"
    started = time.time()
    done = subprocess.run([sys.executable, str(REPO / "train_gpt2.py"),
                           *trainer_args(model, setting, args.data_dir, out, args.dry_run)],
                          capture_output=True, text=True, cwd=REPO)
    row = {"label": f"memory-{model}-{setting}", "model": model, "activation_checkpointing": setting,
           "seconds": round(time.time() - started, 1), "exit": done.returncode}
    if done.returncode != 0:
        return {**row, "error": (done.stderr.strip().splitlines() or [""])[-1][:300]}
    record = json.loads((out / "run.json").read_text())["micro_batch_size"]
    trains = [r for r in read_log(out / LOG_NAME) if r.get("kind") == "train"]
    chosen = record["chosen"]
    per_seq = costs.per_sequence(n_layer, SETTINGS[setting])
    state = STATE_BYTES["ddp"](params, 1)
    peaks = [r["peak_mem_gb"] for r in trains if "peak_mem_gb" in r]
    return {**row, "chosen_B": chosen, "how": record["how"], "probes": record.get("probes", []),
            "peak_gib": max(peaks) if peaks else None,
            "step_ms": trains[-1]["step_ms"] if trains else None,
            "estimate_B": largest_batch(card_gib, state, costs, per_seq) if card_gib else None,
            "estimate_peak_gib": (state + costs.fixed + chosen * per_seq) / GIB,
            "activations_per_sequence_gib": per_seq / GIB, "card_gib": card_gib}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", choices=list(PRESETS))
    parser.add_argument("--settings", default="none,selective,full")
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--work", required=True, help="the runs' folders")
    parser.add_argument("--dry_run", action="store_true", help="conftest's tiny model on the CPU (auto falls back)")
    args = parser.parse_args()
    shape = {**TINY, "vocab_size": VOCAB, "block_size": 32} if args.dry_run else {**PRESETS[args.model]}
    seq_len = 32 if args.dry_run else 1024
    costs = activation_costs(shape, seq_len)  # measured on the CPU, as the table's
    card_gib = torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else None
    deadline = float(os.environ.get("BENCH_DEADLINE", "inf"))
    min_start = float(os.environ.get("BENCH_MIN_S", "0"))
    name = "tiny" if args.dry_run else args.model
    for setting in args.settings.split(","):
        left = deadline - time.time()
        if left < min_start:
            row = {"label": f"memory-{name}-{setting}", "skipped": f"{left:.0f}s of the time budget left"}
        else:
            row = one_setting(name, setting, args, costs, params_of(shape), shape["n_layer"], card_gib)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
