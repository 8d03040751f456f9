"""The faithful recipe against the modern one on the demo model, over seeds: val loss, bpb, steps to the same loss.

    python prep/shakespeare.py
    python scripts/compare_recipes.py                      # seeds 1337 1 2: 6 runs, 35 minutes on 2 busy CPU cores
    python scripts/compare_recipes.py --seeds 7 8 --out /tmp/recipes
    python scripts/compare_recipes.py --gpu --seeds 1337      # GPT-2 124M on one GPU (scripts/gpu_check.sh)

Both recipes train configs/demo.yaml as it is (its model, batch and max_steps: the steps are read from
the file, so the two cannot drift apart) on the same Shakespeare tokens, with val loss every 25 steps
and an EMA of the weights over the second half (--ema_decay 0.98 --ema_start 0.5: it never changes
the training, and gives the README's live-vs-EMA figures from the same runs):
- faithful: the config as it is (AdamW on every parameter, warmup + cosine, rows in order);
- modern: the keys configs/gpt2_124m_modern.yaml sets beyond configs/gpt2_124m.yaml (its header says what).
--gpu trains GPT-2 124M instead (T=1024, 65,536 tokens a step, 300 steps, compiled, val every 25
steps over 65,536 tokens) on the same Shakespeare shards: a few hundred steps on the same tokens,
many epochs of a small corpus, so a comparison of the recipes' speed rather than of quality.

For each seed the target is the faithful run's final val loss; a recipe's steps to it are those of
its first val record at or below it (val is measured every 25 steps). Over the seeds, compare_runs.py
compares the recipes (Welch's t-test of the final val loss and bpb) and each recipe's live weights
with their EMA (paired). Writes each run's folder (OUT/RECIPE_sSEED/), OUT/recipes.md (the tables),
OUT/recipes.json (the per-seed rows) and OUT/recipes.png (plot_log.py of the first seed's two runs).
A run folder that already holds its final val record is reused, not retrained.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.errors import ArgumentParser, run_cli  # noqa: E402
from evals.run_comparison import compare, format_rows, summary  # noqa: E402
from scaling_ladder.plan import RECIPES as RECIPE_CONFIGS, recipe_arguments  # noqa: E402
from common.cpu_malloc import CPU_MALLOC  # noqa: E402
from runtime.logger import read_log  # noqa: E402

DEMO = REPO / "configs" / "demo.yaml"
EMA = ["--ema_decay", "0.98", "--ema_start", "0.5"]
SETTINGS = {  # (max_steps, arguments of both recipes)
    "cpu": (yaml.safe_load(DEMO.read_text())["max_steps"], ["--config", "configs/demo.yaml", *EMA]),
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
RECIPES = {recipe: recipe_arguments(recipe) for recipe in RECIPE_CONFIGS}  # faithful: none


def val_curve(run: Path) -> dict[int, float]:
    log = run / "log.jsonl"
    return {r["step"]: r["loss"] for r in read_log(log) if r["kind"] == "val"} if log.exists() else {}


def train(run: Path, seed: int, recipe: str, max_steps: int, settings: list[str]) -> float:
    """Train one run (unless its folder already holds its final val record); the seconds it took (0 if reused)."""
    if max_steps in val_curve(run):
        print(f"{run}: done already, reused")
        return 0.0
    shutil.rmtree(run, ignore_errors=True)
    env = {**CPU_MALLOC, **os.environ}
    command = [sys.executable, "train_gpt2.py", *settings, *COMMON, "--out_dir", str(run), "--seed", str(seed),
               *RECIPES[recipe]]
    print(" ".join(command), flush=True)
    start = time.monotonic()
    subprocess.run(command, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - start


def final_val(run: Path) -> dict:
    """A run's last val record."""
    return max((r for r in read_log(run / "log.jsonl") if r.get("kind") == "val"), key=lambda r: r["step"])


def steps_to(curve: dict[int, float], target: float) -> int | None:
    return next((step for step in sorted(curve) if curve[step] <= target), None)


def seed_rows(runs: dict[tuple[str, int], Path], seeds: list[int], setting: str) -> list[dict]:
    """Per seed: both recipes' final val loss (each run's last val record) and the steps each took to reach
    the faithful run's."""
    rows = []
    for seed in seeds:
        faithful, modern = val_curve(runs["faithful", seed]), val_curve(runs["modern", seed])
        target, modern_final = faithful[max(faithful)], modern[max(modern)]
        f_steps, m_steps = steps_to(faithful, target), steps_to(modern, target)
        rows.append({"seed": seed, "faithful_final_val": target, "modern_final_val": modern_final,
                     "faithful_steps": f_steps, "modern_steps": m_steps,
                     "speedup": f_steps / m_steps if m_steps else None, "setting": setting})
    return rows


def tables(rows: list[dict], runs: dict[tuple[str, int], Path], seeds: list[int]) -> list[str]:
    """The per-seed table, then compare_runs.py's: the recipes over the seeds, and each recipe's EMA against
    its live weights (where the runs kept an EMA)."""
    lines = ["| seed | faithful final val | modern final val | faithful steps to it | modern steps to it | "
             "speed-up |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        lines.append(f"| {r['seed']} | {r['faithful_final_val']:.4f} | {r['modern_final_val']:.4f} | "
                     f"{r['faithful_steps']} | {r['modern_steps'] or 'not reached'} | {speedup} |")
    if speedups := [r["speedup"] for r in rows if r["speedup"]]:
        lines.append(f"\nMean speed-up over {len(speedups)} seed(s): {statistics.mean(speedups):.2f}x "
                     f"(min {min(speedups):.2f}x, max {max(speedups):.2f}x).")
    group = {recipe: [runs[recipe, seed] for seed in seeds] for recipe in RECIPES}
    names = ("faithful", "modern")
    compared = compare(group["faithful"], group["modern"], names=names)
    lines += ["", f"The recipes over {len(seeds)} seed(s) (compare_runs.py): {summary(compared, names)}", "",
              format_rows(compared, names)]
    for recipe, folders in group.items():
        if len(folders) > 1 and all("ema_loss" in final_val(folder) for folder in folders):
            compared = compare(folders, folders, "live", "ema", names=("live", "EMA"))
            lines += ["", f"{recipe}: the live weights against their EMA, the same runs (compare_runs.py): "
                      f"{summary(compared, ('live', 'EMA'))}", "", format_rows(compared, ("live", "EMA"))]
    return lines


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="scripts/compare_recipes.py", description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337, 1, 2])
    parser.add_argument("--out", type=Path, default=REPO / "out" / "recipes")
    parser.add_argument("--gpu", action="store_true", help="GPT-2 124M on CUDA instead of the demo model on the CPU")
    parser.add_argument("--dry_run", action="store_true", help="4 steps of a 2-layer model on the CPU (plumbing)")
    args = parser.parse_args(argv)
    setting = "dry" if args.dry_run else "gpu" if args.gpu else "cpu"
    max_steps, settings = SETTINGS[setting]

    runs = {(recipe, seed): args.out / f"{recipe}_s{seed}" for seed in args.seeds for recipe in RECIPES}
    took = [train(run, seed, recipe, max_steps, settings) for (recipe, seed), run in runs.items()]
    if any(took):
        print(f"trained {sum(t > 0 for t in took)} runs in {sum(took) / 60:.1f} minutes", flush=True)
    rows = seed_rows(runs, args.seeds, setting)
    text = "\n".join(tables(rows, runs, args.seeds)) + "\n"
    (args.out / "recipes.md").write_text(text)
    (args.out / "recipes.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(text, end="")
    first = [str(runs[recipe, args.seeds[0]]) for recipe in RECIPES]  # one seed's runs: a legend that leaves room
    subprocess.run([sys.executable, "plot_log.py", *first, "-o", str(args.out / "recipes.png"), "--smooth", "20",
                    "--title", f"demo model: faithful vs modern recipe (seed {args.seeds[0]})"], cwd=REPO, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
