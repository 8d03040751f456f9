"""The faithful recipe against the modern one on the demo model: val loss, and steps to the same loss.

    python prep/shakespeare.py
    python scripts/compare_recipes.py                      # seeds 1337 1 2, ~30 minutes on 2 CPU cores
    python scripts/compare_recipes.py --seeds 7 --out /tmp/recipes
    python scripts/compare_recipes.py --gpu --seeds 1337      # GPT-2 124M on one GPU (scripts/gpu_check.sh)

Both recipes train configs/demo.yaml's model (4 layers, 128 wide) on the same Shakespeare tokens
for the same 600 steps of 2,048 tokens, with val loss every 25 steps:
- faithful: the config as it is (AdamW on every parameter, warmup + cosine, rows in order);
- modern: `--optimizer muon --lr_schedule wsd --cooldown_shape 1-sqrt --shuffle true` (Muon on
  the blocks' matrices, AdamW on the rest; warmup, constant lr, a cooldown over the last 20%;
  the rows in a seeded order).
--gpu trains GPT-2 124M instead (T=1024, 65,536 tokens a step, 300 steps, compiled, val every 25
steps over 65,536 tokens) on the same Shakespeare shards: a few hundred steps on the same tokens,
many epochs of a small corpus, so a comparison of the recipes' speed rather than of quality.
For each seed the target is the faithful run's final val loss; a recipe's steps to it are those
of its first val record at or below it (val is measured every 25 steps). Writes each run's
folder (OUT/RECIPE_sSEED/), OUT/recipes.md (the table) and OUT/recipes.png (plot_log.py of
every run), and OUT/recipes.json (the same rows). A run folder that already holds its final val
record is reused, not retrained.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from training.observe.logger import read_log  # noqa: E402

SETTINGS = {  # (max_steps, arguments of both recipes)
    "cpu": (600, ["--config", "configs/demo.yaml"]),  # the demo: 600 steps of 2,048 tokens
    "gpu": (300, ["--model", "gpt2", "--data_dir", "data/shakespeare", "--block_size", "1024", "--seq_len", "1024",
                  "--total_batch_size", "65536", "--micro_batch_size", "64", "--max_steps", "300",
                  "--warmup_steps", "30", "--val_tokens", "65536", "--hellaswag_interval", "0", "--device", "cuda",
                  "--compile", "true"]),
    "dry": (4, ["--model", "custom", "--n_layer", "2", "--n_head", "2", "--n_embd", "64", "--data_dir",
                "data/shakespeare", "--block_size", "64", "--seq_len", "64", "--total_batch_size", "512",
                "--micro_batch_size", "4", "--max_steps", "4", "--warmup_steps", "1", "--val_tokens", "1024",
                "--hellaswag_interval", "0", "--device", "cpu", "--dtype", "float32", "--compile", "false"]),
}
COMMON = ["--eval_interval", "25", "--sample_interval", "0", "--checkpoint_interval", "0", "--final_checkpoint",
          "false", "--log_interval", "100"]
RECIPES = {
    "faithful": [],
    "modern": ["--optimizer", "muon", "--lr_schedule", "wsd", "--cooldown_shape", "1-sqrt", "--shuffle", "true"],
}


def val_curve(run: Path) -> dict[int, float]:
    log = run / "log.jsonl"
    return {r["step"]: r["loss"] for r in read_log(log) if r["kind"] == "val"} if log.exists() else {}


def train(run: Path, seed: int, recipe: str, max_steps: int, settings: list[str]) -> None:
    if max_steps in val_curve(run):
        print(f"{run}: done already, reused")
        return
    shutil.rmtree(run, ignore_errors=True)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "17179869184", "MALLOC_TRIM_THRESHOLD_": "17179869184"}
    command = [sys.executable, "train_gpt2.py", *settings, *COMMON, "--out_dir", str(run), "--seed", str(seed),
               *RECIPES[recipe]]
    print(" ".join(command), flush=True)
    subprocess.run(command, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)


def steps_to(curve: dict[int, float], target: float) -> int | None:
    return next((step for step in sorted(curve) if curve[step] <= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337, 1, 2])
    parser.add_argument("--out", type=Path, default=REPO / "out" / "recipes")
    parser.add_argument("--gpu", action="store_true", help="GPT-2 124M on CUDA instead of the demo model on the CPU")
    parser.add_argument("--dry_run", action="store_true", help="4 steps of a 2-layer model on the CPU (plumbing)")
    args = parser.parse_args()
    setting = "dry" if args.dry_run else "gpu" if args.gpu else "cpu"
    max_steps, settings = SETTINGS[setting]

    runs = {(recipe, seed): args.out / f"{recipe}_s{seed}" for seed in args.seeds for recipe in RECIPES}
    for (recipe, seed), run in runs.items():
        train(run, seed, recipe, max_steps, settings)

    rows, speedups, records = [], [], []
    for seed in args.seeds:
        faithful, modern = val_curve(runs["faithful", seed]), val_curve(runs["modern", seed])
        target = faithful[max_steps]
        f_steps, m_steps = steps_to(faithful, target), steps_to(modern, target)
        speedup = f_steps / m_steps if m_steps else None
        if speedup:
            speedups.append(speedup)
        records.append({"seed": seed, "faithful_final_val": target, "modern_final_val": modern[max_steps],
                        "faithful_steps": f_steps, "modern_steps": m_steps, "speedup": speedup,
                        "setting": setting})
        rows.append(f"| {seed} | {target:.4f} | {modern[max_steps]:.4f} | {f_steps} | {m_steps or 'not reached'} "
                    f"| {f'{speedup:.2f}x' if speedup else '-'} |")
    table = ["| seed | faithful final val | modern final val | faithful steps to it | modern steps to it | "
             "speed-up |", "| --- | --- | --- | --- | --- | --- |", *rows]
    if speedups:
        table.append(f"\nMean speed-up over {len(speedups)} seed(s): {statistics.mean(speedups):.2f}x "
                     f"(min {min(speedups):.2f}x, max {max(speedups):.2f}x).")
    (args.out / "recipes.md").write_text("\n".join(table) + "\n")
    (args.out / "recipes.json").write_text(json.dumps(records, indent=2) + "\n")
    print("\n".join(table))
    subprocess.run([sys.executable, "plot_log.py", *map(str, runs.values()), "-o", str(args.out / "recipes.png"),
                    "--smooth", "20", "--title", "demo model: faithful vs modern recipe"], cwd=REPO, check=True)


if __name__ == "__main__":
    main()
