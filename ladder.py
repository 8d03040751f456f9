"""A scaling ladder: a family of model sizes trained on one budget rule, the law L(C) = E + A * (C / C0)^-alpha
fitted to their final val losses, the next size's loss predicted with an interval, and (--check) trained.

    python prep/shakespeare.py
    python ladder.py --tokens_per_param 0.01 --seeds 1337 1 --dry_run       # the plan, and its time, before anything
    python ladder.py --tokens_per_param 0.01 --seeds 1337 1 --check         # configs/demo.yaml at depths 1-4, then 5
    python ladder.py --tokens_per_param 0.01 --recipes faithful,modern      # both recipes at every size
    python ladder.py --config configs/gpt2_124m.yaml --depths 3 4 6 8 --next 12 --tokens_per_param 20 \\
        --launch torchrun --nproc_per_node 8 --out out/ladder_124m             # docs/SCALING.md: its cost
    python ladder.py ... --launch slurm --sbatch_args="--nodes=1"               # one array task per rung

Sizes: --depths D... (n_layer = n_head = D, n_embd = 64 x D: depth 12 is GPT-2 124M) or --presets NAME...;
everything else is --config's, and --set KEY=VALUE sets a trainer key for every rung. Budget: --tokens_per_param
R tokens per parameter, or --flops C... per size; a rung's max_steps is its tokens / total_batch_size, its warmup
the base config's share of it. FLOPs are counted as the trainer's MFU counts them (model.py's
estimate_flops_per_token).

Each rung is an ordinary run of train_gpt2.py in OUT/RUNG/ from its complete config OUT/configs/RUNG.yaml, launched
by --launch python, torchrun, slurm (one array job) or slurm-jobs; a rung with its final val record is read, any
other launched again, and the trainer resumes it exactly: a killed ladder, run again, ends as an uninterrupted one,
bit for bit. A signal to the ladder is passed on to its rung, which saves its state and exits (the ladder's exit:
one line, 130).

The law (evals/scaling_law.py) is fitted by least squares to each recipe's final val loss and bpb, with 95%
bootstrap intervals; it predicts the next size (--next), which --check then trains. --recipes faithful,modern
trains both (configs/gpt2_124m.yaml and configs/gpt2_124m_modern.yaml's difference) and compares them per size
and across sizes. --dry_run prints the plan and the trainer's --estimate of each rung, and trains nothing.
Writes OUT/ladder.md, OUT/ladder.json and OUT/ladder.png. docs/SCALING.md: the method and its limits.
"""

from __future__ import annotations

import common.startup  # noqa: F401 - first: a Ctrl-C while the modules below load is one line

import math
import sys
from pathlib import Path

from common.errors import ArgumentParser, ConfigError, DataError, run_cli
from common.settings import require
from evals.scaling_law import PARAMETERS
from launch.estimate import duration
from model_size import PRESETS
from scaling_ladder.plan import RECIPES, REPO, ladder_sizes, plan, plan_table
from scaling_ladder.report import FLOPS_WORDS, redraw, write_report  # noqa: F401 - redraw: scripts/pictures.py's
from scaling_ladder.runs import final_figures, make_folder, submit_rungs, train_rungs, write_rung_config
from scaling_ladder.timing import rung_times


def parse(argv: list[str]):
    parser = ArgumentParser(prog="ladder.py", description=__doc__)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "demo.yaml",
                        help="the base config every rung starts from (default configs/demo.yaml)")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3, 4],
                       help="n_layer = n_head = D, n_embd = 64 x D (default 1 2 3 4)")
    sizes.add_argument("--presets", nargs="+", help=f"model presets instead: {', '.join(PRESETS)}")
    parser.add_argument("--next", help="the size to predict (and train with --check): a depth, or a preset")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--tokens_per_param", type=float, default=20.0,
                        help="tokens trained per parameter N at every size (default 20)")
    budget.add_argument("--flops", type=float, nargs="+",
                        help="FLOPs of each size instead (and of the next; default: the last ratio once more)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337])
    parser.add_argument("--recipes", default="faithful", help=f"one or two of {', '.join(RECIPES)}, "
                                                              f"comma-separated (default faithful)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a trainer key for every rung (repeat it for more)")
    parser.add_argument("--checkpoints_per_rung", type=int, default=4,
                        help="checkpoints each rung saves, evenly spaced: what a killed rung resumes from (default 4)")
    parser.add_argument("--out", type=Path, default=REPO / "out" / "ladder")
    parser.add_argument("--launch", default="python", choices=["python", "torchrun", "slurm", "slurm-jobs"])
    parser.add_argument("--nproc_per_node", type=int, default=1, help="--launch torchrun: processes per rung")
    parser.add_argument("--sbatch_args", default="", help="--launch slurm: sbatch's options, given with = (they start "
                                                          "with -): --sbatch_args=\"--nodes=1 --gpus-per-node=8\"")
    parser.add_argument("--check", action="store_true", help="then train the next size and check the prediction")
    parser.add_argument("--dry_run", action="store_true", help="print the plan and its estimated time; train nothing")
    parser.add_argument("--hardware", default="auto",
                        help="--dry_run's hardware: cpu (measured) or a GPU name of the MFU table, e.g. H100 "
                             "(default: this machine's)")
    parser.add_argument("--gpus", type=int, default=None, help="--dry_run: GPUs per rung (default --nproc_per_node)")
    parser.add_argument("--mfu", type=float, default=None,
                        help="--dry_run: the MFU assumed on a GPU (default: the one measured for a rung's "
                             "configuration on that GPU model, else 0.4; runtime/gpus.py)")
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap replicates of the fit (default 2000)")
    args = parser.parse_args(argv)
    args.recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    if not 1 <= len(args.recipes) <= 2 or len(set(args.recipes)) != len(args.recipes) \
            or any(r not in RECIPES for r in args.recipes):
        raise ConfigError(f"--recipes: one or two of {', '.join(RECIPES)}, got {','.join(args.recipes)!r}")
    for name in ("checkpoints_per_rung", "nproc_per_node"):
        require(getattr(args, name) >= 1, f"--{name}", f"must be at least 1, got {getattr(args, name)}")
    require(args.flops is not None or 0 < args.tokens_per_param < math.inf, "--tokens_per_param",
            f"must be a positive finite number, got {args.tokens_per_param}")
    if args.flops is not None:
        bad = [c for c in args.flops if not 0 < c < math.inf]
        require(not bad, "--flops", f"every budget must be a positive finite number, got {' '.join(map(str, bad))}")
    require(len(set(args.seeds)) == len(args.seeds), "--seeds",
            f"a seed given twice ({' '.join(map(str, args.seeds))})")
    require(args.mfu is None or 0 < args.mfu <= 1, "--mfu", f"must be in (0, 1], got {args.mfu}")
    require(args.bootstrap >= 0, "--bootstrap", f"must be >= 0, got {args.bootstrap}")
    require(args.config.is_file(), "--config", f"no such file {args.config}")
    args.out = args.out.resolve()
    require(args.out.is_dir() or not args.out.exists(), "--out", f"{args.out} is not a folder")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    sizes, next_size = ladder_sizes(args)
    rungs = plan(args, sizes, next_size)
    ladder = [r for r in rungs if not r.check]
    budgets = len({r.flops for r in ladder})
    require(not args.check or budgets >= PARAMETERS, "--check",
            f"the law has {PARAMETERS} parameters and needs rungs at {PARAMETERS} budgets at least; "
            f"{', '.join(s.label for s in sizes)} give {budgets}: there is no prediction to check (add sizes, or "
            f"leave --check out)")
    if args.dry_run:
        times, sources = rung_times(args, rungs)
        print(f"{FLOPS_WORDS}\nTime: each rung's run as train_gpt2.py --estimate works it out (its steps, evaluations, "
              f"checkpoints, and start-up where measured), at a speed that says where it comes from:\n"
              + "\n".join(f"- {source}" for source in sources) + "\n")
        print(plan_table(rungs, times))
        print(f"\nthe ladder: {len(ladder)} runs, {sum(r.flops for r in ladder):.3e} FLOPs, about "
              f"{duration(sum(times[r.name] for r in ladder))}; --check adds {next_size.label}: "
              f"{duration(sum(times[r.name] for r in rungs if r.check))}")
        return 0
    chosen = [r for r in rungs if args.check or not r.check]
    make_folder(args.out)  # before anything trains: an --out that cannot be a folder is one line
    print(plan_table(chosen), flush=True)
    for rung in chosen:  # each rung's config, or a refusal where one differs from the config its folder was made with
        write_rung_config(rung, args.out)
    submit = args.launch in ("slurm", "slurm-jobs")
    if submit:
        if any(final_figures(r, args.out) is None for r in ladder):
            submit_rungs(args, ladder)
            return 0
    elif not train_rungs(args, ladder):
        return 0
    text = write_report(args, rungs, sizes)
    if args.check:
        predictions = [line for line in text.splitlines() if line.startswith("Predicted")]
        for line in text.splitlines():
            if line.startswith("Not finite: "):
                print(line, flush=True)
        if not predictions:  # finished rungs left out as not finite: fewer budgets than the law has parameters
            raise DataError(f"--check: no law to check {next_size.label} against: fewer than {PARAMETERS} budgets "
                            f"have a rung with a finite final val loss ({args.out / 'ladder.md'} names those left "
                            f"out); nothing was trained for the check")
        # the prediction is on disk (ladder.md, ladder.json) before the next size trains
        print(f"ladder: {args.out / 'ladder.md'} holds the prediction for {next_size.label} before it trains:\n"
              + "\n".join(predictions), flush=True)
        if submit:
            if any(final_figures(r, args.out) is None for r in rungs if r.check):
                submit_rungs(args, [r for r in rungs if r.check])
                return 0
        elif not train_rungs(args, [r for r in rungs if r.check]):
            return 0
        text = write_report(args, rungs, sizes)
    print(text, end="")
    print(f"ladder: {args.out / 'ladder.md'}, ladder.json and ladder.png written", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
