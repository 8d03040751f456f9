"""A ladder's report: OUT/ladder.md, OUT/ladder.json (no timings: the same rungs give the same bytes) and
OUT/ladder.png, which ladder.json alone draws again (redraw())."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from evals.scaling_law import PARAMETERS, LawFit
from scaling_ladder.fit import compare_recipes, fit_recipe
from scaling_ladder.plan import REPO, Rung, Size
from scaling_ladder.runs import METRICS, final_figures, finite
from runtime.logger import write_text_file

if TYPE_CHECKING:
    from matplotlib.figure import Figure  # matplotlib loads where a picture is drawn, not for --dry_run


def shown(path: Path) -> str:
    """A path as the report names it: from the repository's root where it lies inside."""
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def budget_words(budget: dict) -> str:
    """The budget rule as ladder.json holds it ({"flops": [...]} or {"tokens_per_param": R}), in words."""
    if "flops" in budget:
        return "FLOP budgets " + ", ".join(f"{c:.3g}" for c in budget["flops"])
    return f"{budget['tokens_per_param']:g} tokens per parameter"


FLOPS_WORDS = ("FLOPs: C = (6 N + 12 L H Q T) x tokens trained, as the trainer's MFU counts them (model.py's "
               "estimate_flops_per_token): N the parameters but the position table, L layers, H heads of size Q, "
               "T = seq_len.")


def report(args, rungs: list[Rung], results: dict[str, dict], sizes: list[Size]) -> tuple[str, dict, dict]:
    """(ladder.md, ladder.json's content, the fits for the picture)."""
    fits = {recipe: {metric: fit_recipe(rungs, results, recipe, metric, args.bootstrap) for metric in METRICS}
            for recipe in args.recipes}
    comparison = compare_recipes(args, rungs, results)
    described = ", ".join(s.label for s in sizes)
    budget = {"flops": args.flops} if args.flops is not None else {"tokens_per_param": args.tokens_per_param}
    lines = [f"# Scaling ladder: {shown(args.config)}, sizes {described}, {budget_words(budget)}, "
             f"seeds {', '.join(map(str, args.seeds))}", "", FLOPS_WORDS, "",
             "| rung | recipe | seed | params N | steps | tokens | FLOPs C | final val loss | final val bpb |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rungs:
        got = results.get(r.name)
        if got is None and r.check and not args.check:
            continue
        figures = " | ".join("-" if got is None or m not in got else f"{got[m]:.4f}" if finite(got[m])
                             else "not finite" for m in METRICS)
        lines.append(f"| {r.size.label}{' (next)' if r.check else ''} | {r.recipe} | {r.seed} | {r.params:,} "
                     f"| {r.max_steps:,} | {r.tokens:,} | {r.flops:.3e} | {figures} |")
    lines += not_finite_lines(rungs, results, comparison is not None)
    for recipe in args.recipes:
        for metric, name in METRICS.items():
            fit = fits[recipe][metric]
            lines += ["", f"## {recipe}: {name} against compute", ""]
            if fit is None:
                lines.append(f"No fit: the law has {PARAMETERS} parameters and needs at least {PARAMETERS} budgets "
                             f"with a finished run whose {name} is finite.")
                continue
            lines += law_lines(fit, name)
    if comparison:
        a, b = comparison["names"]
        lines += ["", f"## {a} against {b}, size by size (compare_runs.py)", ""]
        for size in comparison["sizes"]:
            lines += [f"{size['size']} (C = {size['flops']:.3e}): {size['summary']}", "", size["table"], ""]
        for metric, t in comparison["trends"].items():
            interval = "" if t["interval"] is None else f" (95% interval {t['interval'][0]:+.4f} to " \
                                                        f"{t['interval'][1]:+.4f})"
            lines.append(f"{metric}, {b} - {a} against log10 C over {t['sizes']} sizes: {t['slope_per_decade']:+.4f} "
                         f"per decade of compute{interval}: {t['words']}.")
    data = {"config": shown(args.config), "sizes": [s.label for s in sizes],
            "next": next(r.size.label for r in rungs if r.check),
            "budget": budget,
            "seeds": args.seeds, "recipes": args.recipes, "flops_counted_as": FLOPS_WORDS,
            "rungs": [{**r.describe(), "final": results.get(r.name)} for r in rungs],
            "fits": {recipe: {metric: None if fit is None else {k: v for k, v in fit.items() if k != "_fit"}
                              for metric, fit in by_metric.items()} for recipe, by_metric in fits.items()},
            "comparison": comparison}
    return "\n".join(lines) + "\n", data, fits


def not_finite_lines(rungs: list[Rung], results: dict[str, dict], compared: bool) -> list[str]:
    """A line for each finished rung with a final figure that is not finite, naming it: what it leaves out of."""
    lines = []
    for r in rungs:
        names = [METRICS[m] for m, value in results.get(r.name, {}).items() if not finite(value)]
        if names:
            what = "the check" if r.check else "the fit" + (" and the recipes' comparison at its size" if compared
                                                             else "")
            lines.append(f"Not finite: {r.name}'s {' and '.join(names)} (NaN, inf or null in its log): left out of "
                         f"{what}.")
    return ["", *lines] if lines else []


def law_lines(fit: dict, name: str) -> list[str]:
    law, iv = fit["law"], fit["intervals"]

    def with_interval(key: str, digits: int) -> str:
        bounds = iv[key]
        return f"{law[key]:.{digits}f}" + ("" if bounds is None else
                                           f" (95% interval {bounds[0]:.{digits}f} to {bounds[1]:.{digits}f})")

    how = (f"a residual bootstrap of {fit['bootstrap_replicates']} replicates over the rungs and seeds"
           if fit["bootstrap_replicates"] else "no intervals: as many runs as parameters, no residual to resample")
    bounds = {"E": "at its bound, 0: these rungs do not determine the loss's floor",
              "A": "at its bound, 0: the loss does not fall with compute here",
              "alpha": "at an end of its search range: these rungs do not pin down a power law"}
    lines = [f"{fit['formula']}, least squares on the {name} of {fit['runs']} runs at {fit['budgets']} budgets "
             f"({how}; the runs' residual sd {fit['residual_sd']:.4f}):", ""]
    lines += [f"- {key} = {with_interval(key, 4)}" + (f"; {bounds[key]}" if key in fit["at_bound"] else "")
              for key in ("alpha", "E", "A")]
    p = fit["prediction"]
    law_iv = "" if p["law_interval"] is None else f"; the law there {p['law_interval'][0]:.4f} to " \
                                                 f"{p['law_interval'][1]:.4f}"
    run_iv = "" if p["run_interval"] is None else f"; one run, 95%: {p['run_interval'][0]:.4f} to " \
                                                 f"{p['run_interval'][1]:.4f}"
    lines += ["", f"Predicted for {p['size']} (C = {p['flops']:.3e}): {p['value']:.4f}{law_iv}{run_iv}."]
    if check := fit["check"]:
        runs = ", ".join(f"seed {c['seed']} {c['value']:.4f}" + ("" if c["inside"] is None else
                                                                  " (inside)" if c["inside"] else " (outside)")
                         for c in check["runs"])
        inside = sum(bool(c["inside"]) for c in check["runs"])
        verdict = "" if check["inside"] is None else f" {inside} of {len(check['runs'])} landed inside the interval."
        lines.append(f"Trained ({p['size']}): {runs}; mean minus prediction {check['mean_error']:+.4f} "
                     f"({check['relative_error']:+.2%}).{verdict}")
    return lines


def draw(path: Path, rungs: list[Rung], results: dict[str, dict], fits: dict, title: str) -> Figure:
    """Final val loss against FLOPs, log-log: each recipe's runs, its law with the law's 95% band, and at the next
    size the prediction with one run's 95% interval (and the runs trained there, where --check trained them). The
    PNG carries what it draws as its Description text (plot_log.py's describe()); the figure is returned."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, MaxNLocator, NullFormatter, NullLocator, ScalarFormatter

    from plot_log import describe

    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    for index, (recipe, by_metric) in enumerate(fits.items()):
        colour = f"C{index}"
        own = [r for r in rungs if r.recipe == recipe and finite(results.get(r.name, {}).get("loss"))]
        ladder = [r for r in own if not r.check]
        ax.scatter([r.flops for r in ladder], [results[r.name]["loss"] for r in ladder], color=colour, s=22,
                   zorder=3, label=f"{recipe}: rungs")
        fit = by_metric["loss"]
        if fit is None:
            continue
        law: LawFit = fit["_fit"]
        p = fit["prediction"]
        grid = np.geomspace(min(r.flops for r in ladder) / 1.3, p["flops"] * 1.3, 200)
        ax.plot(grid, law.law(grid), color=colour, lw=1.4,
                label=rf"{recipe}: $E + A\,(C/C_0)^{{-\alpha}}$, $\alpha$ = {law.law.alpha:.3f}")
        band = law.band(grid)
        if band is not None:
            ax.fill_between(grid, *band, color=colour, alpha=0.15, lw=0)
        low, high = p["run_interval"] or (p["value"], p["value"])  # no interval from as many runs as parameters
        ax.errorbar([p["flops"]], [p["value"]], yerr=[[p["value"] - low], [high - p["value"]]], fmt="s",
                    color=colour, ms=6, capsize=4, mfc="white", zorder=4, label=f"{recipe}: {p['size']} predicted")
        if checked := [r for r in own if r.check]:
            # a little to the right of the prediction, which they would hide
            ax.scatter([r.flops * 1.08 for r in checked], [results[r.name]["loss"] for r in checked], marker="*", s=90,
                       color=colour, edgecolor="black", lw=0.5, zorder=5, label=f"{recipe}: {p['size']} trained")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())
    # a ladder's losses span far less than a decade: plain ticks over their range, not powers of ten
    ax.yaxis.set_major_locator(FixedLocator(MaxNLocator(6).tick_values(*ax.get_ylim())))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel("final val loss (nats)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7.5)
    fig.tight_layout()
    fig.savefig(path, metadata={"Description": describe(fig)})
    plt.close(fig)
    return fig


def picture_title(data: dict) -> str:
    """ladder.png's title, from ladder.json's content."""
    return f"{data['config']}: {', '.join(data['sizes'])} ({budget_words(data['budget'])})"


def redraw(data: dict, path: Path) -> Figure:
    """ladder.png again, from ladder.json's content `data` alone: its rungs with their final figures, and each
    recipe's law fitted to them again as report() fitted it (the same numbers: the bootstrap is seeded, and as
    many replicates as ladder.json records). scripts/pictures.py draws docs/ladder.png so."""
    # a rung as describe() wrote it; its model keys and config are not in ladder.json, nor in the picture
    rungs = [Rung(**{**{k: v for k, v in r.items() if k != "final"}, "size": Size(r["size"], {}), "config": ""})
             for r in data["rungs"]]
    results = {r["name"]: r["final"] for r in data["rungs"] if r["final"] is not None}
    fits = {recipe: {"loss": fit_recipe(rungs, results, recipe, "loss",
                                        (data["fits"][recipe]["loss"] or {}).get("bootstrap_replicates", 0))}
            for recipe in data["recipes"]}
    return draw(path, rungs, results, fits, picture_title(data))


def write_report(args, rungs: list[Rung], sizes: list[Size]) -> str:
    results = {r.name: got for r in rungs if (got := final_figures(r, args.out)) is not None}
    text, data, fits = report(args, rungs, results, sizes)
    write_text_file(args.out / "ladder.md", text)
    write_text_file(args.out / "ladder.json", json.dumps(data, indent=2) + "\n")
    draw(args.out / "ladder.png", rungs, results, fits, picture_title(data))
    return text
