"""The results of scripts/gpu_check.sh: what it records of the machine, its results files, their summary.

    python scripts/gpu_check_report.py report DIR DIR         # merge results folders (or results.json files) into DIR

gpu_check.sh calls it after every part, from the repository root: `environment DRY_RUN PARTS BUDGET` prints the
machine's JSON (GPU, driver, torch, commit); `collect WORK RESULTS` reads a work folder (parts.tsv, the bench
rows, junit XML, the JSON lines of each part) into RESULTS/results.json and RESULTS/details.tar.gz; `report OUT
RESULTS...` merges results into OUT's results.json, numerics.json and summary.md. bench_gpu.sh asks `faster
LEVER.json BASELINE.json`: exit 0 when both rows exist and the first's tokens/s beat the second's, else 1.
A usage mistake is one `error:` line, exit 2.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: common

from common.errors import ArgumentParser, run_cli  # noqa: E402

NUMERICS_TOL = 1e-2  # final loss vs the group's first variant: the bound of the compiled-vs-eager test
TARGET, AIM, PUBLISHED = 540_000, 600_000, 468_000  # 124M tokens/s: the issue's target, aim and reference
STARTUP_TARGET_S = 60


def table_lines(path):  # rows of a small tab-separated file; none when it does not exist
    return [line.split("\t") for line in path.read_text().splitlines() if line] if path.exists() else []


def tail(path, n=25):  # the last n lines (n None: all of them)
    return path.read_text(errors="replace").splitlines()[-n if n else 0:] if path.exists() else []


def environment(dry_run, parts, budget):
    import datetime
    import platform

    import torch

    def command(*args):
        try:
            return subprocess.run(args, capture_output=True, text=True, timeout=30).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None

    cuda = torch.cuda.is_available()
    print(json.dumps({
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "dry_run": dry_run == "1",
        "parts": parts.split(), "budget_s": int(budget), "gpu": torch.cuda.get_device_name() if cuda else None,
        "gpu_count": torch.cuda.device_count(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "gpu_memory_gb": torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None,
        "driver": command("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"),
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "git_commit": command("git", "rev-parse", "HEAD"),
    }, indent=2))


def junit(path):
    if not path.exists():
        return []
    tests = []
    for case in ET.parse(path).iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome, message = kind, ((found.get("message") or "").strip().splitlines() or [""])[0][:300]
        notes = {p.get("name"): p.get("value") for p in case.iter("property")}
        tests.append({"test": case.get("name"), "outcome": outcome, "seconds": float(case.get("time", 0)),
                      "message": message, **notes})
    return tests


def collect(work, results):
    work, results = Path(work), Path(results)
    bench = work / "bench"
    order = [row[0] for row in table_lines(bench / "order.txt")]
    rows = [json.loads((bench / f"{label}.json").read_text()) for label in order if (bench / f"{label}.json").exists()]
    data = {
        "environment": [json.loads((work / "environment.json").read_text())],
        "parts": [{"part": p, "status": s, "seconds": int(t)} for p, s, t in table_lines(work / "parts.tsv")],
        "tests": junit(work / "tests.xml"), "rows": rows,
        "checkpoint": [json.loads(line) for line in tail(bench / "checkpoint.jsonl", None)],
        "muon": [json.loads(line) for line in tail(bench / "muon.jsonl", None)],
        "recipe": json.loads((bench / "recipes.json").read_text()) if (bench / "recipes.json").exists() else [],
        "repro": [(bench / "repro.md").read_text()] if (bench / "repro.md").exists() else [],
        "memory": [json.loads(line) for line in tail(bench / "memory.jsonl", None)],
        "allreduce": [json.loads(line) for line in tail(bench / "allreduce.jsonl", None)],
        "preemption": [json.loads(path.read_text()) for path in [bench / "preemption.json"] if path.exists()],
        "spread": [{"gpu": gpu, "parts": parts.split()} for gpu, parts in table_lines(work / "spread.tsv")],
        "failed": [{"label": label, "why": why, "log_tail": tail(bench / f"{label}.log")}
                   for label, why in table_lines(bench / "failed.txt")],
        "skipped": [{"label": label, "why": why} for label, why in table_lines(bench / "skipped.txt")],
    }
    (results / "results.json").write_text(json.dumps(data, indent=2) + "\n")
    with tarfile.open(results / "details.tar.gz", "w:gz") as tar:  # flat: every file under its own name
        for path in sorted([*work.glob("*.*"), *bench.glob("*.*")]):
            tar.add(path, arcname=path.name)


def total_steps(row):  # warm-up + timed steps: scripts/bench.py's command line holds the warm-up (default 5, last wins)
    warmups = re.findall(r"--warmup[ =](\d+)", row.get("command", ""))
    return row["steps_timed"] + (int(warmups[-1]) if warmups else 5)


def compare_losses(rows):
    """Groups of rows that trained the same model with the same optimizer for the same steps on the same tokens."""
    groups = {}
    for row in rows:
        key = (row["model"], row["T"], row["total_batch_size"], total_steps(row), Path(row["data"]).name,
               row.get("optimizer", "adamw"))  # rows of older scripts, and the reference loop's: AdamW
        groups.setdefault(key, []).append(row)
    compared = []
    for (model, _, _, steps, data, _), members in groups.items():
        if len(members) > 1:
            base = members[0]
            compared.append({"model": model, "steps": steps, "data": data, "baseline": base["label"],
                             "tolerance": NUMERICS_TOL, "rows": [
                                 {"label": r["label"], "final_loss": r["final_loss"],
                                  "delta": r["final_loss"] - base["final_loss"],
                                  "within_tolerance": abs(r["final_loss"] - base["final_loss"]) <= NUMERICS_TOL}
                                 for r in members]})
    return compared


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def table(title, columns, rows):
    """A markdown section: `## title` and a table of rows (lists of cells); nothing without rows."""
    if not rows:
        return []
    return [f"## {title}", "", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns),
            *("| " + " | ".join(map(str, row)) + " |" for row in rows), ""]


def scaling(rows: list[dict]) -> list[dict]:
    """Each row of a run on several GPUs beside the same run's row on one: rows labelled NAME-<N>gpu
    (bench_gpu.sh's group multigpu), paired by NAME with the one whose world_size is 1.

    tokens/s per GPU = tokens/s / N; scaling efficiency = tokens/s on N GPUs / (N x tokens/s on one):
    1.0 when N GPUs do N times the work of one, as the README's time for 8 GPUs assumes.
    """
    named = [(m.group(1), row) for row in rows if (m := re.fullmatch(r"(.+)-\d+gpu", row["label"]))]
    one = {name: row for name, row in named if row["world_size"] == 1}
    return [{"label": row["label"], "model": row.get("model"), "baseline": one[name]["label"],
             "world_size": row["world_size"],
             "tokens_per_sec": row["tokens_per_sec"], "per_gpu": row["tokens_per_sec"] / row["world_size"],
             "baseline_tokens_per_sec": one[name]["tokens_per_sec"],
             "efficiency": row["tokens_per_sec"] / (row["world_size"] * one[name]["tokens_per_sec"]),
             "ms_per_step": row["ms_per_step"], "baseline_ms_per_step": one[name]["ms_per_step"]}
            for name, row in named if row["world_size"] > 1 and name in one]


def report(out, *sources):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    merged = {key: [] for key in ("environment", "parts", "tests", "rows", "checkpoint", "muon", "recipe", "repro",
                                  "memory", "allreduce", "preemption", "spread", "failed", "skipped")}
    for source in sources:
        path = Path(source) / "results.json" if Path(source).is_dir() else Path(source)
        for key, value in json.loads(path.read_text()).items():
            merged.setdefault(key, []).extend(value)  # results of an older script lack the newer keys
    numerics = compare_losses(merged["rows"])
    (out / "results.json").write_text(json.dumps(merged, indent=2) + "\n")
    (out / "numerics.json").write_text(json.dumps(numerics, indent=2) + "\n")

    env = merged["environment"][0]
    gpus = f"{env['gpu_count']} x {env['gpu']}" if env.get("gpu_count", 0) > 1 else env["gpu"] or "no GPU"
    md = [f"# GPU check {env['date']}: {gpus}, torch {env['torch']} (CUDA {env['cuda']})"
          + (" -- DRY RUN on the CPU, tiny models: no figure here is a GPU measurement" if env["dry_run"] else ""),
          "", "Parts: " + ", ".join(f"{p['part']} {p['status']} ({p['seconds']} s)" for p in merged["parts"]), ""]
    if merged["spread"]:
        md += [f"Spread over {len(merged['spread'])} GPUs, one invocation each, side by side: "
               + "; ".join(f"GPU {s['gpu']}: {' '.join(s['parts'])}" for s in merged["spread"]), ""]
    def note(test):  # the test's properties (record_property), then its failure's first line
        notes = [f"{k}: {v}" for k, v in test.items() if k not in ("test", "outcome", "seconds", "message")]
        return "; ".join(notes + [test["message"]] if test["message"] else notes)

    md += table("Correctness: pytest -m gpu tests/test_gpu.py", ["test", "outcome", "s", "note"],
                [[t["test"], t["outcome"], f"{t['seconds']:.1f}", note(t)] for t in merged["tests"]])
    rows = merged["rows"]
    reference = next((r for r in rows if r["label"].startswith("reference")), None)
    one_gpu = [r for r in rows if r.get("world_size", 1) == 1]  # the reference and the targets are one GPU's
    if rows:
        md += ["## Speed: scripts/bench.py (the trainer's step) and the reference loop", "",
               "| variant | B | ms/step (p10-p90) | tokens/s | vs reference | MFU | peak GB | compile s | startup s "
               "| final loss |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            same_model = reference and r in one_gpu and (r["params"], r["T"]) == (reference["params"], reference["T"])
            ratio = f"{r['tokens_per_sec'] / reference['tokens_per_sec']:.3f}x" if same_model else "-"
            md.append(f"| {r['label']} | {r['B']} | {r['ms_per_step']:.1f} ({r['ms_p10']:.1f}-{r['ms_p90']:.1f}) "
                      f"| {r['tokens_per_sec']:,.0f} | {ratio} | {fmt(r['mfu'], '.1%')} "
                      f"| {fmt(r['peak_mem_gb'], '.1f')} | {r['compile_s']:.1f} | {r['startup_s']:.1f} "
                      f"| {r['final_loss']:.5f} |")
        gpt2 = [r for r in one_gpu if r["model"] == "gpt2" and r["T"] == 1024 and r["total_batch_size"] == 524288]
        if gpt2:
            best = max(gpt2, key=lambda r: r["tokens_per_sec"])
            md += ["", f"- Best 124M: {best['label']}, {best['tokens_per_sec']:,.0f} tokens/s: "
                       f"{best['tokens_per_sec'] / PUBLISHED:.3f}x llm.c's published 468K per H100; target {TARGET:,} "
                       f"{'met' if best['tokens_per_sec'] >= TARGET else 'NOT met'}, aim {AIM:,} "
                       f"{'met' if best['tokens_per_sec'] >= AIM else 'not met'}."]
            if reference:
                md.append(f"- Reference measured here: {reference['tokens_per_sec']:,.0f} tokens/s; best 124M / "
                          f"reference = {best['tokens_per_sec'] / reference['tokens_per_sec']:.3f}x (same machine).")
            slow = [r["label"] for r in gpt2 if r["startup_s"] >= STARTUP_TARGET_S]
            md.append(f"- Startup (launch to first finished step, cold compile) under {STARTUP_TARGET_S} s: "
                      + (f"not for {', '.join(slow)}." if slow else "yes, for every 124M variant."))
        md.append("")
    scaled = scaling(rows)
    md += table("Several GPUs: the same step under DDP on N GPUs and on one (benchmarks/bench_gpu.sh group multigpu)",
                ["variant", "GPUs", "tokens/s", "per GPU", "one GPU's tokens/s", "scaling efficiency",
                 "ms/step: N GPUs, one"],
                [[s["label"], s["world_size"], f"{s['tokens_per_sec']:,.0f}", f"{s['per_gpu']:,.0f}",
                  f"{s['baseline_tokens_per_sec']:,.0f}", f"{s['efficiency']:.1%}",
                  f"{s['ms_per_step']:.1f}, {s['baseline_ms_per_step']:.1f}"] for s in scaled])
    runs = [s for s in scaled if s["model"] == "gpt2"]  # the README's time for the 124M run assumed N x one GPU's rate
    md += [f"- {s['label']}: GPT-2 124M's 10.0B tokens take {10e9 / s['tokens_per_sec'] / 60:.0f} min of steps at "
           f"this rate ({10e9 / (s['world_size'] * s['baseline_tokens_per_sec']) / 60:.0f} min at {s['world_size']} x "
           "the one-GPU rate)." for s in runs] + ([""] if runs else [])
    md += table("All-reduce on every GPU: benchmarks/bench_allreduce.py (DDP's 25 MiB bucket and the whole gradient; "
                "busbw = algbw x 2(N-1)/N)",
                ["buffer", "model", "MB", "ranks", "backend", "ms", "algbw GB/s", "busbw GB/s"],
                [[a["label"], a["model"], f"{a['bytes'] / 1e6:,.1f}", a["world_size"], a["backend"], f"{a['ms']:.3f}",
                  f"{a['algbw_gbps']:.1f}", f"{a['busbw_gbps']:.1f}"] for a in merged["allreduce"]])
    md += table("Preemption on every GPU: benchmarks/preemption_check.py (SIGTERM to torchrun, then the same command)",
                ["check", "ranks", "steps", "SIGTERM after step", "saved step", "resumed at", "last checkpoint",
                 "training records", "launches s", "verdict"],
                [[p["label"], p["world_size"], p["max_steps"], p["signal_after"], fmt(p["saved_step"], "d"),
                  fmt(p["resumed_at"], "d"), fmt(p["final_checkpoint"], "d"), p["logged_steps"],
                  f"{p['first_launch_s']:.0f} + {p['second_launch_s']:.0f}",
                  "ok: resumed where it stopped, every step logged once" if p["ok"] else "; ".join(p["problems"])]
                 for p in merged["preemption"]])
    md += table("One profiled step after the timed ones: its costliest kernels (scripts/bench.py --profile_top)",
                ["variant", "kernel", "ms", "share of busy time", "calls"],
                [[r["label"], k["name"][:90], f"{k['ms']:.1f}", f"{k['share']:.1%}", k["calls"]]
                 for r in rows for k in r.get("top_kernels", [])])
    md += table(f"Numerics: final loss after the same steps on the same tokens (tolerance {NUMERICS_TOL})",
                ["variant", "steps", "final loss", "vs first", "within"],
                [[r["label"], group["steps"], f"{r['final_loss']:.5f}", f"{r['delta']:+.5f}",
                  "yes" if r["within_tolerance"] else "NO"] for group in numerics for r in group["rows"]])
    md += table("Checkpoints: benchmarks/bench_checkpoint.py (save: blocking / until complete; or load)",
                ["variant", "params", "blocking s", "total s", "GB on disk", "GB/s", "load s", "peak host GiB",
                 "peak GPU GiB"],
                [[c["label"], f"{c['params'] / 1e6:,.0f}M", fmt(c.get("blocking_s"), ".2f"),
                  fmt(c.get("total_s"), ".2f"), fmt(c.get("bytes_on_disk", 0) / 1e9 or None, ".2f"),
                  fmt(c.get("gb_per_s"), ".2f"), fmt(c.get("load_s"), ".2f"), f"{max(c['peak_rss_gib']):.1f}",
                  fmt(c.get("peak_cuda_gib"), ".1f")] for c in merged["checkpoint"]])
    md += table("Muon's optimizer step: benchmarks/bench_muon.py (one process: every matrix's Newton-Schulz; "
                "on N GPUs each does its owners' share)",
                ["variant", "model", "world size", "device", "step ms", "Newton-Schulz runs on rank 0"],
                [[m["label"], m["model"], m["world_size"], m["device"], f"{m['step_ms']:.2f}", m["newton_schulz_runs"]]
                 for m in merged["muon"]])
    md += table("Recipes: scripts/compare_recipes.py (steps to the faithful run's final val loss)",
                ["setting", "seed", "faithful final val", "modern final val", "faithful steps", "modern steps",
                 "speed-up"],
                [[r["setting"], r["seed"], f"{r['faithful_final_val']:.4f}", f"{r['modern_final_val']:.4f}",
                  r["faithful_steps"], r["modern_steps"] or "not reached", fmt(r["speedup"], ".2f")]
                 for r in merged["recipe"]])
    md += [line for text in merged["repro"] for line in text.splitlines() + [""]]  # repro_check.py's own summary
    measured = [m for m in merged["memory"] if "chosen_B" in m]
    md += table("Memory: micro_batch_size auto (benchmarks/memory_check.py, 2 eager steps of 524,288 tokens) "
                "against scripts/memory_table.py's estimate",
                ["model", "activation checkpointing", "auto B", "how", "probes", "peak GiB", "estimate B",
                 "estimated peak GiB at auto B", "step ms", "s"],
                [[m["model"], m["activation_checkpointing"], m["chosen_B"], m["how"], len(m["probes"]),
                  fmt(m["peak_gib"], ".1f"), fmt(m["estimate_B"], "d"), f"{m['estimate_peak_gib']:.2f}",
                  fmt(m["step_ms"], ".0f"), m["seconds"]] for m in measured])
    merged["failed"] += [{"label": m["label"], "why": m["error"], "log_tail": []} for m in merged["memory"]
                         if "error" in m]
    merged["skipped"] += [{"label": m["label"], "why": m["skipped"]} for m in merged["memory"] if "skipped" in m]
    if merged["failed"] or merged["skipped"]:
        md += ["## Not measured", ""]
        md += [f"- {f['label']}: failed, {f['why']} (log tail in results.json)" for f in merged["failed"]]
        md += [f"- {s['label']}: skipped, {s['why']}" for s in merged["skipped"]]
        md.append("")
    (out / "summary.md").write_text("\n".join(md).rstrip() + "\n")


def faster(lever, baseline):
    """Exit status 0 when both bench rows exist and lever's tokens/s beat baseline's (the levers' best combination)."""
    try:
        lever_rate, baseline_rate = (json.loads(Path(path).read_text())["tokens_per_sec"] for path in (lever, baseline))
    except (OSError, KeyError, ValueError):
        return 1
    return 0 if lever_rate > baseline_rate else 1


COMMANDS = {"environment": (environment, 3), "collect": (collect, 2), "report": (report, 2), "faster": (faster, 2)}


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="scripts/gpu_check_report.py", description=__doc__)
    parser.add_argument("command", choices=COMMANDS)
    parser.add_argument("args", nargs="*", help="the command's arguments (above)")
    args = parser.parse_args(argv)
    command, count = COMMANDS[args.command]
    if len(args.args) < count or (command is not report and len(args.args) > count):
        parser.error(f"{args.command} takes {count}{' or more' if command is report else ''} arguments")
    return command(*args.args) or 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
