"""A ladder's law: evals/scaling_law.py's fit through each recipe's rungs, its prediction of the next size and that
size's check; and, with two recipes, their comparison at each size (evals/run_comparison.py) and its trend."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from evals.run_comparison import compare, format_rows, summary
from evals.scaling_law import PARAMETERS, fit_with_bootstrap, trend
from evals.stats import format_p
from scaling_ladder.plan import Rung
from scaling_ladder.runs import METRICS, finite


def fit_recipe(rungs: list[Rung], results: dict[str, dict], recipe: str, metric: str, replicates: int) -> dict | None:
    """The law through a recipe's finished ladder rungs (not the next size's), its prediction of the next size, and
    how the next size's runs, where trained, landed: a JSON-ready dict, or None with fewer than 3 budgets."""
    ladder = [r for r in rungs if r.recipe == recipe and not r.check and finite(results.get(r.name, {}).get(metric))]
    if len({r.flops for r in ladder}) < PARAMETERS:
        return None
    fit = fit_with_bootstrap([r.flops for r in ladder], [results[r.name][metric] for r in ladder], replicates)
    following = [r for r in rungs if r.recipe == recipe and r.check]
    prediction = fit.predict(following[0].flops)
    checked = [{"name": r.name, "seed": r.seed, "value": results[r.name][metric],
                "inside": None if prediction.run is None else prediction.run.contains(results[r.name][metric])}
               for r in following if finite(results.get(r.name, {}).get(metric))]
    error = float(np.mean([c["value"] for c in checked])) - prediction.loss if checked else None
    return {"law": dataclasses.asdict(fit.law), "formula": fit.law.formula(),
            "intervals": {name: interval_list(fit.interval(name)) for name in ("E", "A", "alpha")},
            "runs": fit.n, "budgets": fit.budgets, "residual_sd": fit.residual_sd, "at_bound": list(fit.at_bound),
            "bootstrap_replicates": 0 if fit.replicates is None else replicates,
            "prediction": {"size": following[0].size.label, "flops": prediction.compute, "value": prediction.loss,
                           "law_interval": interval_list(prediction.law),
                           "run_interval": interval_list(prediction.run)},
            "check": {"runs": checked, "mean_error": error,
                      "relative_error": None if error is None else error / prediction.loss,
                      "inside": None if not checked or prediction.run is None else all(c["inside"] for c in checked)}
            if checked else None, "_fit": fit}


def interval_list(interval) -> list[float] | None:
    return None if interval is None else [interval.low, interval.high]


def compare_recipes(args, rungs: list[Rung], results: dict[str, dict]) -> dict | None:
    """With two recipes: at each size where both have every seed, evals/run_comparison.py's comparison (B - A,
    Welch's t-test); then how B - A moves with log10 C across those sizes (least squares, t interval)."""
    if len(args.recipes) != 2:
        return None
    names = tuple(args.recipes)
    sizes = []
    for label in dict.fromkeys(r.size.label for r in rungs):
        groups = [[r for r in rungs if r.size.label == label and r.recipe == recipe] for recipe in names]
        if all(r.name in results and all(map(finite, results[r.name].values())) for group in groups for r in group):
            rows = compare(*[[args.out / r.name for r in group] for group in groups], names=names)
            sizes.append({"size": label, "flops": groups[0][0].flops, "summary": summary(rows, names),
                          "table": format_rows(rows, names),
                          "rows": {row.metric: {"a_mean": row.result.mean_a, "b_mean": row.result.mean_b,
                                                "difference": row.result.diff,
                                                "interval": None if row.result.interval is None
                                                else list(row.result.interval),
                                                "p": row.result.p, "verdict": row.verdict} for row in rows}})
    trends = {}
    for metric in METRICS.values():
        points = [(math.log10(s["flops"]), s["rows"][metric]["difference"]) for s in sizes if metric in s["rows"]]
        if len({x for x, _ in points}) >= 2:
            t = trend(*zip(*points))
            trends[metric] = {"slope_per_decade": t.slope, "interval": interval_list(t.interval), "p": t.p,
                              "sizes": t.n, "words": trend_words(t, names)}
    return {"names": list(names), "sizes": sizes, "trends": trends}


def trend_words(t, names: tuple[str, str]) -> str:
    a, b = names
    if t.interval is None:
        return "two sizes: a slope without an interval (a third size gives one)"
    if t.interval.low <= 0 <= t.interval.high:
        return f"no trend the sizes can tell (p = {format_p(t.p)})"
    towards = b if t.slope < 0 else a  # a loss or bpb: a falling B - A favours B
    return f"it moves in {towards}'s favour as the compute grows (p = {format_p(t.p)})"
