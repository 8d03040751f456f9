"""A ladder's plan: its sizes, budgets and recipes, and each rung's complete trainer config."""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from common.errors import ConfigError
from common.settings import require
from launch.config import TrainConfig, coerce, config_yaml, load_yaml
from launch.estimate import duration, model_shape
from model_size import PRESETS

REPO = Path(__file__).resolve().parents[1]
# a recipe is the keys its config sets beyond the faithful one's (configs/gpt2_124m_modern.yaml's header explains them)
RECIPES = {"faithful": REPO / "configs" / "gpt2_124m.yaml", "modern": REPO / "configs" / "gpt2_124m_modern.yaml"}
OWNED = ("model", "n_layer", "n_head", "n_embd", "max_steps", "seed", "out_dir")  # set per rung by the ladder


@dataclass(frozen=True)
class Size:
    label: str  # d4, gpt2-medium
    keys: dict  # the model keys of the trainer


def depth_size(depth: int) -> Size:
    """GPT-2's shape at another depth: heads of 64 wide, as many as layers (depth 12: GPT-2 124M)."""
    return Size(f"d{depth}", {"model": "custom", "n_layer": depth, "n_head": depth, "n_embd": 64 * depth})


def preset_size(name: str) -> Size:
    return Size(name, {"model": name, "n_layer": None, "n_head": None, "n_embd": None})


@dataclass(frozen=True)
class Rung:
    name: str  # d2_faithful_s1337: its run folder's name
    size: Size
    n_layer: int
    n_head: int
    n_embd: int
    recipe: str
    seed: int
    params: int  # N: every parameter but the position table (those of 6N)
    flops_per_token: int  # 6N + 12 L H Q T
    max_steps: int
    tokens: int  # max_steps x total_batch_size
    flops: float  # flops_per_token x tokens
    config: str  # the complete config, YAML
    check: bool  # the next size, trained by --check

    def describe(self) -> dict:
        """Every field but the config, the size by its label (what ladder.json keeps; redraw() reads it back)."""
        return {f.name: self.size.label if f.name == "size" else getattr(self, f.name)
                for f in dataclasses.fields(self) if f.name != "config"}


def recipe_keys(recipe: str) -> dict:
    """The keys a recipe sets: those of its config (RECIPES) that differ from the faithful one's (none for faithful)."""
    faithful = load_yaml(RECIPES["faithful"])
    return {k: v for k, v in load_yaml(RECIPES[recipe]).items() if k != "out_dir" and faithful.get(k) != v}


def recipe_arguments(recipe: str) -> list[str]:
    """recipe_keys() as the trainer's command-line arguments (scripts/compare_recipes.py passes them)."""
    return [part for key, value in recipe_keys(recipe).items()
            for part in (f"--{key}", str(value).lower() if isinstance(value, bool) else str(value))]


def parse_sets(pairs: list[str]) -> dict:
    """--set KEY=VALUE ..., each value converted by its key's type; the keys the ladder sets per rung refused."""
    values = {}
    for pair in pairs:
        key, equals, value = pair.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        require(equals == "=", "--set", f"expected KEY=VALUE, got {pair!r}")
        require(key not in OWNED, "--set", f"{key} is set per rung by the ladder (the sizes, the budget rule, --seeds, "
                                           f"--out)")
        values[key] = coerce(key, value)  # an unknown key: one line naming it
    return values


def plan(args, sizes: list[Size], next_size: Size) -> list[Rung]:
    """Every rung, the next size's too (check: trained by --check alone), sizes in order, each size's seeds and
    recipes."""
    sets = parse_sets(args.set)
    base = {**load_yaml(args.config), **sets}  # --set wins over the base config and over a recipe
    schedule = TrainConfig(**base).schedule  # the base's own max_steps and warmup: the warmup's share
    budgets = flop_budgets(args, len(sizes))
    recipe_sets = {recipe: recipe_keys(recipe) for recipe in args.recipes}
    rungs = []
    for index, size in enumerate([*sizes, next_size]):
        # the model and the batch: the same for every seed and recipe of the size
        cfg = TrainConfig(**{**base, **size.keys, "max_steps": 1, "warmup_steps": 0})
        shape = model_shape(cfg)  # counted as the trainer's MFU and --estimate count it (model_size.py)
        params, per_token = shape.non_embedding_params, shape.flops_per_token()
        batch = cfg.data.total_batch_size
        tokens = args.tokens_per_param * params if budgets is None else budgets[index] / per_token
        max_steps = rung_steps(tokens, batch, per_token, "--tokens_per_param" if budgets is None else "--flops",
                               size.label)
        for seed in args.seeds:
            for recipe in args.recipes:
                name = f"{size.label}_{recipe}_s{seed}"
                keys = {**base, **recipe_sets[recipe], **sets, **size.keys, "seed": seed, "max_steps": max_steps,
                        "out_dir": str(args.out / name)}
                if "warmup_steps" not in sets:  # the base's share of its steps
                    keys["warmup_steps"] = round(schedule.warmup_steps * max_steps / schedule.max_steps)
                if "checkpoint_interval" not in sets:
                    keys["checkpoint_interval"] = max(1, math.ceil(max_steps / args.checkpoints_per_rung))
                config = config_yaml(TrainConfig(**keys))
                rungs.append(Rung(name, size, shape.n_layer, shape.n_head, shape.n_embd, recipe, seed, params,
                                  per_token, max_steps, max_steps * batch, float(per_token * max_steps * batch), config,
                                  index == len(sizes)))
    return rungs


def rung_steps(tokens: float, batch: int, per_token: int, flag: str, label: str) -> int:
    """A rung's max_steps: its tokens over the batch, rounded, at least 1. A budget whose FLOPs are past what a float
    holds (the FLOPs the ladder reports and fits) is refused, naming the flag that set it."""
    if math.isfinite(tokens):
        max_steps = max(1, round(tokens / batch))
        if per_token * max_steps * batch <= sys.float_info.max:
            return max_steps
    raise ConfigError(f"{flag}: {label} would train {tokens:.3g} tokens of {per_token:,} FLOPs each: more FLOPs than "
                      f"a float holds ({sys.float_info.max:.2g})")


def flop_budgets(args, n_sizes: int) -> list[float] | None:
    """--flops, one per size and one for the next: given, or the ladder's last ratio once more."""
    if args.flops is None:
        return None
    budgets = list(args.flops)
    if len(budgets) == n_sizes:
        require(n_sizes >= 2, "--flops", "with one size, give the next size's budget too (two values)")
        budgets.append(budgets[-1] * (budgets[-1] / budgets[-2]))
        require(budgets[-1] < math.inf, "--flops", f"the next size's budget, the last ratio once more, is past a "
                                                   f"float's range ({sys.float_info.max:.2g}): give it (one more)")
    require(len(budgets) == n_sizes + 1, "--flops",
            f"one budget per size ({n_sizes}), and optionally the next size's, got {len(args.flops)}")
    return budgets


def ladder_sizes(args) -> tuple[list[Size], Size]:
    """The sizes and the next one (--next, or by default: the depth after the last by the last step between two,
    or the next preset)."""
    if args.presets:
        for flag, name in [*(("--presets", p) for p in args.presets), ("--next", args.next or args.presets[0])]:
            require(name in PRESETS, flag, f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
        names = list(PRESETS)
        require(args.next is not None or args.presets[-1] != names[-1], "--next",
                f"no preset after {args.presets[-1]}; name the size to predict")
        following = args.next or names[names.index(args.presets[-1]) + 1]
        sizes, next_size = [preset_size(p) for p in args.presets], preset_size(following)
    else:
        depths = args.depths
        require(all(d >= 1 for d in depths) and depths == sorted(set(depths)), "--depths",
                f"increasing positive depths, got {' '.join(map(str, depths))}")
        try:
            following = int(args.next) if args.next else depths[-1] + (depths[-1] - depths[-2] if len(depths) > 1
                                                                       else 1)
        except ValueError:
            raise ConfigError(f"--next: a depth with --depths, got {args.next!r}") from None
        sizes, next_size = [depth_size(d) for d in depths], depth_size(following)
    require(next_size.label not in [s.label for s in sizes], "--next",
            f"{next_size.label} is a size of the ladder; predict another")
    return sizes, next_size


def rung_config(rung: Rung) -> TrainConfig:
    return TrainConfig(**yaml.safe_load(rung.config))


def plan_table(rungs: list[Rung], times: dict[str, float] | None = None) -> str:
    lines = ["| rung | n_layer | n_embd | params N | steps | tokens | tokens / N | FLOPs C |"
             + (" estimated time |" if times else ""),
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if times else "")]
    for r in rungs:
        label = r.name + (" (check)" if r.check else "")
        lines.append(f"| {label} | {r.n_layer} | {r.n_embd} | {r.params:,} | {r.max_steps:,} | {r.tokens:,} "
                     f"| {r.tokens / r.params:.3g} | {r.flops:.3e} |" + (f" {duration(times[r.name])} |" if times
                                                                         else ""))
    return "\n".join(lines)

