"""scripts/gpu_check.sh's dry run on the CPU (GPU_CHECK_DRY_RUN=1), a part each: the plumbing a GPU machine's
check runs through (its parts, results files, budget, several GPUs, --report), proven before GPU time is spent.
The `gpu` tests themselves are tests/test_gpu.py's, whose CPU form runs in the suite.

Marker `gpu_check`: `make test-gpu-check` runs this file (CI does, after make test), which `make test` leaves out:
four minutes on one of make test's two workers, its tests sharing one fixture, would set the suite's length."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import test_gpu
from common.cpu_malloc import CPU_MALLOC
from conftest import REPO
from slowness import guard

pytestmark = pytest.mark.gpu_check


# A stand-in for build-nanogpt's train_gpt2.py, whose code may not live in this repository: the
# definitions benchmarks/gpu_reference.py loads, on our model, around statements that must not run.
REFERENCE_STAND_IN = """
import os
import numpy as np
import torch
from hellaswag import render_example
import model as ours

class GPTConfig(ours.GPTConfig):
    pass

class GPT(ours.GPT):
    def configure_optimizers(self, weight_decay, learning_rate, device_type):
        from training.optim.optimizers import build_optimizer
        from training.optim.settings import OptimizerSettings
        return build_optimizer(self, OptimizerSettings(weight_decay=weight_decay), learning_rate, device_type)

def get_lr(it):
    return max_lr * min(1.0, (it + 1) / warmup_steps)

class DataLoaderLite:
    def __init__(self, B, T, process_rank, num_processes, split):
        self.B, self.T, self.position = B, T, 0
        shard = sorted(name for name in os.listdir("edu_fineweb10B") if split in name)[0]
        self.tokens = torch.tensor(np.load(os.path.join("edu_fineweb10B", shard)).astype(np.int32), dtype=torch.long)

    def next_batch(self):
        buf = self.tokens[self.position : self.position + self.B * self.T + 1]
        self.position += self.B * self.T
        return buf[:-1].view(self.B, self.T), buf[1:].view(self.B, self.T)

raise SystemExit("the reference's top-level training code ran")
"""


# scripts/gpu_check.sh on the CPU (GPU_CHECK_DRY_RUN=1): the parts in five invocations, grouped as its header
# splits them (multigpu alone: 2 ranks on gloo), each into its own results folder, and one test per part; then
# parts spread over 2 stand-in GPUs side by side, a budget that skips every part, and --report merging them all.
# The `gpu` tests run in this suite in their CPU form (tests/test_gpu.py): the tests part runs one of them
# (GPU_CHECK_TESTS), which proves the part's own plumbing (its pytest command, the junit XML read into
# results.json) without running them twice.
DRY_RUN_SPEED = ["124m-compile-plain-b64", "124m-eager-fused-b64"]  # two of the group keep the part short
DRY_RUN_RECOMPUTE = ["124m-eager-fused-b64-full"]  # one of bench_gpu.sh's group recompute
DRY_RUN_TEST = "test_fused_chunked_loss_matches_the_plain_loss_and_its_gradients"  # in-process: seconds
DRY_RUN_CALLS = {"call1": ("tests", "speed"), "call2": ("reference",), "call3": ("recipe", "checkpoint"),
                 "call4": ("memory", "recompute"), "call5": ("multigpu",)}  # results folder: its call's parts
DRY_RUN_MULTIGPU = ["124m-ddp-1gpu", "124m-ddp-2gpu"]  # bench_gpu.sh's group multigpu on 2 ranks
# recipe's comparison of two recipes needs data/shakespeare (`make demo` makes it), and is skipped without it
RECIPE_WITHOUT_DATA = ("recipe", "no data/shakespeare (python prep/shakespeare.py first)")


@pytest.fixture(scope="module")
def gpu_check(tmp_path_factory):
    """gpu_check(name, *args, report=False, **env): `scripts/gpu_check.sh RESULTS *args` (or `--report RESULTS
    *args`, each a name) in the dry run, RESULTS this module's folder `name`, run once per name (the --report
    test reuses the parts' results) -> (RESULTS, the finished process)."""
    root = tmp_path_factory.mktemp("gpu_check")
    reference = root / "ref" / "train_gpt2.py"
    reference.parent.mkdir()
    reference.write_text(REFERENCE_STAND_IN)
    env = dict(os.environ, GPU_CHECK_DRY_RUN="1", GPU_REFERENCE=str(reference), PYTHON=sys.executable, **CPU_MALLOC,
               BENCH_ONLY=" ".join(DRY_RUN_SPEED + DRY_RUN_RECOMPUTE + DRY_RUN_MULTIGPU + ["reference-*"]),
               GPU_CHECK_TESTS=DRY_RUN_TEST)
    env.pop("OUT", None)
    done = {}

    def run(name: str, *args: str, report: bool = False, **extra_env: str) -> tuple[Path, subprocess.CompletedProcess]:
        if name not in done:
            # gpu_check.sh works from the repository root: every folder it is given is absolute
            args = ["--report", str(root / name), *(str(root / a) for a in args)] if report else [str(root / name), *args]
            proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), *args], cwd=root,
                                  env={**env, **extra_env}, capture_output=True, text=True, timeout=guard(300))
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            done[name] = root / name, proc
        return done[name]

    return run


def dry_run_part(gpu_check, part: str) -> tuple[Path, dict, set[str]]:
    """The call of DRY_RUN_CALLS that runs `part`, its results folder checked as every call's is
    -> (the folder, its results.json, the names in its details.tar.gz)."""
    (name, parts), = [(name, parts) for name, parts in DRY_RUN_CALLS.items() if part in parts]
    out, proc = gpu_check(name, *parts)
    assert sorted(p.name for p in out.iterdir()) == [
        "details.tar.gz", "gpu_check.log", "numerics.json", "results.json", "summary.md"]
    assert proc.stdout.endswith((out / "summary.md").read_text())  # the summary is printed last
    results = json.loads((out / "results.json").read_text())
    skipped = [(s["label"], s["why"]) for s in results["skipped"]]
    assert skipped in ([], [RECIPE_WITHOUT_DATA]), skipped
    assert [(p["part"], p["status"]) for p in results["parts"]] == [
        (p, "skipped: nothing to run" if p == "recipe" and skipped else "ok") for p in parts]
    assert results["environment"][0]["dry_run"] and not results["failed"]
    with tarfile.open(out / "details.tar.gz") as tar:
        details = set(tar.getnames())
    assert {"parts.tsv", "environment.json"} <= details
    return out, results, details


def gpu_tests() -> list[str]:
    """The `gpu` tests of tests/test_gpu.py, sorted."""
    return sorted(name for name, test in vars(test_gpu).items() if name.startswith("test_") and "gpu" in
                  {mark.name for mark in getattr(test, "pytestmark", [])})


@pytest.mark.slow
def test_gpu_check_dry_run_tests_part_runs_the_chosen_gpu_tests_and_reads_their_outcome(gpu_check):
    """gpu_check.sh's pytest on the one `gpu` test GPU_CHECK_TESTS names, its outcome read from the junit XML."""
    _, results, details = dry_run_part(gpu_check, "tests")
    assert DRY_RUN_TEST in gpu_tests() and len(gpu_tests()) == 6
    assert [(t["test"], t["outcome"]) for t in results["tests"]] == [(DRY_RUN_TEST, "passed")]
    assert {"tests.xml", "tests.log"} <= details


@pytest.mark.slow
def test_gpu_check_dry_run_speed_part_benches_the_variants_and_compares_their_losses(gpu_check):
    out, results, details = dry_run_part(gpu_check, "speed")
    assert [r["label"] for r in results["rows"]] == DRY_RUN_SPEED
    (numerics,) = json.loads((out / "numerics.json").read_text())
    assert [r["label"] for r in numerics["rows"]] == DRY_RUN_SPEED and all(r["within_tolerance"] for r in numerics["rows"])
    assert {"124m-compile-plain-b64.json", "124m-compile-plain-b64.log"} <= details


@pytest.mark.slow
def test_gpu_check_dry_run_reference_part_runs_the_reference_loop(gpu_check):
    out, results, details = dry_run_part(gpu_check, "reference")
    assert [r["label"] for r in results["rows"]] == ["reference-build-nanogpt-b64"]
    assert "reference-build-nanogpt-b64.log" in details
    assert "1.000x" in (out / "summary.md").read_text()  # the reference's own row


@pytest.mark.slow
def test_gpu_check_dry_run_checkpoint_part_saves_and_loads_in_every_format(gpu_check):
    out, results, _ = dry_run_part(gpu_check, "checkpoint")
    saves, loads = results["checkpoint"][:3], results["checkpoint"][3:]
    assert [c["label"] for c in results["checkpoint"]] == [
        f"checkpoint-tiny-{v}" for v in ("file", "sharded", "sharded-async", "load-file", "load-sharded")]
    assert all(c["total_s"] >= c["blocking_s"] > 0 and c["bytes_on_disk"] > 0 for c in saves)
    assert all(c["load_s"] > 0 for c in loads) and "| checkpoint-tiny-load-file |" in (out / "summary.md").read_text()


@pytest.mark.slow
def test_gpu_check_dry_run_memory_part_sets_auto_beside_the_tables_estimate(gpu_check):
    """On the CPU micro_batch_size auto falls back (4): the rehearsal checks the plumbing, each setting's run,
    run.json's record, the estimate, and the summary's table."""
    out, results, details = dry_run_part(gpu_check, "memory")
    settings = ("none", "selective", "full")
    assert [m["label"] for m in results["memory"]] == [f"memory-tiny-{s}" for s in settings]
    assert all(m["exit"] == 0 and m["chosen_B"] == 4 and m["how"] == "fallback (cpu)" and m["peak_gib"] is None
               for m in results["memory"])
    per_sequence = [m["activations_per_sequence_gib"] for m in results["memory"]]
    assert per_sequence[2] < per_sequence[0]  # full recomputation keeps less per sequence than none
    assert all(m["estimate_peak_gib"] > 0 for m in results["memory"]) and "memory-gpt2.log" in details
    summary = (out / "summary.md").read_text()
    assert "## Memory: micro_batch_size auto" in summary and "| tiny | full | 4 | fallback (cpu) | 0 | - |" in summary


@pytest.mark.slow
def test_gpu_check_dry_run_recipe_part_times_muons_step_before_the_recipes(gpu_check):
    """Muon's optimizer step needs no data; the recipes need data/shakespeare, and are skipped without it."""
    out, results, _ = dry_run_part(gpu_check, "recipe")
    assert [m["label"] for m in results["muon"]] == ["muon-replicated", "muon-whole", "muon-rows"]
    assert all(m["step_ms"] > 0 and m["newton_schulz_runs"] == 8 for m in results["muon"])  # one process: all 8
    assert "| muon-whole | dry_run | 1 | cpu |" in (out / "summary.md").read_text()


@pytest.mark.slow
def test_gpu_check_dry_run_recompute_part_benches_activation_checkpointing(gpu_check):
    """The part runs bench_gpu.sh's group recompute (one of its variants here, to keep it short)."""
    out, results, _ = dry_run_part(gpu_check, "recompute")
    assert [r["label"] for r in results["rows"]] == DRY_RUN_RECOMPUTE
    assert f"| {DRY_RUN_RECOMPUTE[0]} |" in (out / "summary.md").read_text()


# The levers part as docs/PERFORMANCE.md gives its call, `GPU_CHECK_BUDGET_S=480 bash scripts/gpu_check.sh DIR levers`:
# the reference loop, then (to keep the rehearsal short) the plain row and the modern recipe's, with what the part
# decides without a GPU: the best combination (here no lever beat the plain row: none was measured) and the FP8 row,
# which the CPU cannot run. Every other variant's arguments are checked by the test of every GPU launch above.
LEVERS_REHEARSED = ["124m-levers-plain", "124m-levers-best", "124m-levers-modern", "124m-levers-modern-fp8"]


@pytest.mark.slow
def test_gpu_check_dry_run_levers_part_benches_the_levers_beside_the_reference(gpu_check):
    out, _ = gpu_check("levers", "levers", GPU_CHECK_BUDGET_S="480", BENCH_ONLY=" ".join(LEVERS_REHEARSED))
    results = json.loads((out / "results.json").read_text())
    assert [(p["part"], p["status"]) for p in results["parts"]] == [("levers", "ok")] and not results["failed"]
    rows = {r["label"]: r for r in results["rows"]}
    assert list(rows) == ["reference-build-nanogpt-b64-levers", "124m-levers-plain", "124m-levers-modern"]
    assert [(s["label"], s["why"]) for s in results["skipped"]] == [
        ("124m-levers-best", "0 of 2 levers beat 124m-levers-plain alone: no combination to run"),
        ("124m-levers-modern-fp8", "the dry run is on the CPU, which fp8_lm_head refuses")]
    plain, modern = rows["124m-levers-plain"], rows["124m-levers-modern"]
    assert (plain["optimizer"], modern["optimizer"]) == ("adamw", "muon") and plain["levers"] == modern["levers"] == []
    assert plain["top_kernels"] and modern["top_kernels"]  # one profiled step each
    # the same steps on the same tokens as the reference's (2 + 8 there, shrunk alike to 1 + 2 here)
    assert rows["reference-build-nanogpt-b64-levers"]["steps_timed"] == plain["steps_timed"] == 2
    assert json.loads((out / "numerics.json").read_text()) == []  # AdamW and Muon rows are never compared
    summary = (out / "summary.md").read_text()
    assert "| reference-build-nanogpt-b64-levers | 2 |" in summary and "1.000x" in summary
    assert all(f"| {label} |" in summary for label in rows) and "124m-levers-modern-fp8: skipped" in summary


@pytest.mark.slow
def test_gpu_check_dry_run_multigpu_part_scales_all_reduces_and_preempts_on_2_ranks(gpu_check):
    """The part on every GPU, rehearsed on 2 gloo ranks: the same step on 2 ranks and on 1 (its figures paired,
    its losses equal: DDP on 2 ranks trains on the same batches as accumulation on one), the all-reduce of a
    bucket and of the whole gradient, and a run that SIGTERM stopped mid-run and a relaunch resumed."""
    out, results, details = dry_run_part(gpu_check, "multigpu")
    assert [(r["label"], r["world_size"], r["grad_accum"]) for r in results["rows"]] == [
        ("124m-ddp-1gpu", 1, 2), ("124m-ddp-2gpu", 2, 1)]
    (numerics,) = json.loads((out / "numerics.json").read_text())
    assert [r["label"] for r in numerics["rows"]] == DRY_RUN_MULTIGPU and all(r["within_tolerance"] for r in numerics["rows"])
    assert [(a["label"], a["world_size"], a["backend"]) for a in results["allreduce"]] == [
        (f"allreduce-{buffer}-{dtype}", 2, "gloo") for buffer in ("bucket", "grad") for dtype in ("fp32", "bf16")]
    assert all(a["ms"] > 0 and a["algbw_gbps"] > 0 for a in results["allreduce"])
    assert all(a["busbw_gbps"] == pytest.approx(a["algbw_gbps"]) for a in results["allreduce"])  # 2 ranks: 2(N-1)/N = 1
    (preempted,) = results["preemption"]
    assert preempted["ok"] and preempted["problems"] == [] and preempted["world_size"] == 2
    assert 3 < preempted["saved_step"] == preempted["resumed_at"] < preempted["final_checkpoint"] == 12
    assert preempted["logged_steps"] == 12
    summary = (out / "summary.md").read_text()
    assert "## Several GPUs: the same step under DDP on N GPUs and on one" in summary
    assert "| 124m-ddp-2gpu | 2 |" in summary and "| allreduce-grad-fp32 | dry_run |" in summary
    assert "| preemption-2gpu | 2 | 12 | 3 |" in summary and "ok: resumed where it stopped" in summary
    assert {"124m-ddp-2gpu.json", "allreduce-2gpu.log", "preemption-2gpu.log", "preemption-2gpu-launch1.log",
            "preemption-2gpu-launch2.log"} <= details


@pytest.mark.slow
def test_gpu_check_on_several_gpus_runs_the_single_gpu_parts_side_by_side_one_gpu_each(gpu_check):
    """With 2 GPUs (GPU_CHECK_GPUS=2: stand-ins on the CPU) two parts run at once, each in an invocation of its own
    on one of the GPUs CUDA_VISIBLE_DEVICES names, and their results merge into the one results folder."""
    out, proc = gpu_check("spread", "tests", "reference", GPU_CHECK_GPUS="2", CUDA_VISIBLE_DEVICES="4,6")
    assert sorted(p.name for p in out.iterdir()) == [
        "details.tar.gz", "gpu_check.log", "numerics.json", "results.json", "summary.md"]
    assert proc.stdout.endswith((out / "summary.md").read_text())
    results = json.loads((out / "results.json").read_text())
    assert results["spread"] == [{"gpu": "4", "parts": ["tests"]}, {"gpu": "6", "parts": ["reference"]}]
    assert [(p["part"], p["status"]) for p in results["parts"]] == [("tests", "ok"), ("reference", "ok")]
    assert [e["cuda_visible_devices"] for e in results["environment"]] == ["4,6", "4", "6"]
    assert [t["test"] for t in results["tests"]] == [DRY_RUN_TEST]
    assert [r["label"] for r in results["rows"]] == ["reference-build-nanogpt-b64"] and not results["failed"]
    assert "Spread over 2 GPUs, one invocation each, side by side: GPU 4: tests; GPU 6: reference" in (
        out / "summary.md").read_text()
    with tarfile.open(out / "details.tar.gz") as tar:
        assert {"gpu_check-gpu0.log", "gpu_check-gpu1.log", "details-gpu0.tar.gz", "details-gpu1.tar.gz",
                "spread.tsv"} <= set(tar.getnames())


@pytest.mark.slow
def test_gpu_check_skips_every_part_a_spent_budget_leaves_no_time_for(gpu_check):
    skipped, _ = gpu_check("skipped", "tests", "presets", GPU_CHECK_BUDGET_S="1")
    parts = json.loads((skipped / "results.json").read_text())["parts"]
    assert [p["part"] for p in parts] == ["tests", "presets"] and all(p["status"].startswith("skipped") for p in parts)
    # on several GPUs: multigpu first, then the others, none started
    spread, _ = gpu_check("skipped-spread", "tests", "presets", "multigpu", GPU_CHECK_BUDGET_S="1", GPU_CHECK_GPUS="2")
    results = json.loads((spread / "results.json").read_text())
    assert [p["part"] for p in results["parts"]] == ["multigpu", "tests", "presets"] and not results["spread"]
    assert all(p["status"].startswith("skipped") for p in results["parts"]), results["parts"]


WITHOUT_PYDANTIC = """
import sys


class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "pydantic":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, Absent())
"""


@pytest.mark.parametrize("case", ["a python without the requirements", "an unknown part", "a count of no GPUs"])
def test_gpu_check_refuses_in_one_line_before_it_runs_any_part(case, tmp_path):
    """A GPU image's own Python with torch but without requirements.txt (pydantic), a misspelt part, or
    GPU_CHECK_GPUS not a number of GPUs: one error line and exit 2, no results folder, rather than the same
    traceback in every part."""
    env = dict(os.environ, GPU_CHECK_DRY_RUN="1", PYTHON=sys.executable)
    args = ["tests"]
    if case == "an unknown part":
        args = ["tests", "sped"]
    elif case == "a count of no GPUs":
        env["GPU_CHECK_GPUS"] = "0"
    else:
        (tmp_path / "site").mkdir()
        (tmp_path / "site" / "sitecustomize.py").write_text(WITHOUT_PYDANTIC)
        env["PYTHONPATH"] = str(tmp_path / "site")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(tmp_path / "results"), *args],
                          env=env, capture_output=True, text=True, timeout=guard(60))
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout[-2000:] + proc.stderr[-2000:]
    (line,) = proc.stderr.splitlines()
    expected = {"an unknown part": "unknown part sped", "a count of no GPUs": "GPU_CHECK_GPUS=0: a number of GPUs"}.get(
        case, "the package 'pydantic' is not installed")
    assert line.startswith("error: ") and expected in line, line
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
def test_gpu_check_report_merges_the_calls_into_one_summary(gpu_check):
    """--report over the part calls above (run here if this test runs alone) and the skipped one."""
    for call_parts in DRY_RUN_CALLS.values():
        dry_run_part(gpu_check, call_parts[0])
    gpu_check("skipped", "tests", "presets", GPU_CHECK_BUDGET_S="1")
    merged, _ = gpu_check("merged", *DRY_RUN_CALLS, "skipped", report=True)
    results = json.loads((merged / "results.json").read_text())
    parts = [(p["part"], p["status"].split(":")[0]) for p in results["parts"]]
    assert [p for p in parts if p[0] != "recipe"] == [
        *((p, "ok") for call_parts in DRY_RUN_CALLS.values() for p in call_parts if p != "recipe"),
        ("tests", "skipped"), ("presets", "skipped")]
    assert [t["test"] for t in results["tests"]] == [DRY_RUN_TEST]
    assert [r["label"] for r in results["rows"]] == [*DRY_RUN_SPEED, "reference-build-nanogpt-b64", *DRY_RUN_RECOMPUTE,
                                                     *DRY_RUN_MULTIGPU]
    summary = (merged / "summary.md").read_text()
    assert "speed ok" in summary and "reference ok" in summary and "tests skipped" in summary
    assert "1.000x" in summary  # the reference's row, with ratios beside the speed rows


def test_the_preemption_check_names_each_way_a_preempted_run_can_go_wrong():
    """benchmarks/preemption_check.py's verdict on two launches: none for a stop mid-run resumed where it stopped,
    one sentence for each thing that went wrong otherwise."""
    from benchmarks.preemption_check import check

    def launch(console: str, newest: int | None, exit: int = 0) -> dict:
        return {"console": console, "newest": newest, "exit": exit, "error": "error: the reason"}

    stopped = launch("SIGTERM received: saved step 12; run the same command again to resume", 12, exit=1)
    resumed = launch("model gpt2 | resumed from /r/checkpoints/step_00000012.pt at step 12", 30)
    steps = [(s, 3.0) for s in range(30)]
    assert check(stopped, resumed, steps, max_steps=30, signal_after=10) == []
    problems = check(stopped, launch("resumed from x at step 9", 29, exit=1), [*steps[:20], *steps[19:29],
                     (29, float("nan"))], max_steps=30, signal_after=10)
    assert [p.split(":")[0].split(",")[0] for p in problems] == [
        "the second launch exited 1", "the second launch did not resume at step 12",
        "the newest checkpoint after the second launch is step 29", "the log's training steps are not 0 to 29 once each",
        "losses that are not finite at steps [29]"]
    assert "repeated [19]" in problems[3]
    late = launch("SIGTERM received: saved step 30; ...", 30, exit=1)  # the run ended before the signal landed
    assert "did not land mid-run" in check(late, resumed, steps, 30, 10)[0]
    assert check(launch("error: no shards", None, exit=2), resumed, [], 30, 10) == [
        "the first launch never said it saved after SIGTERM (exit 2): error: the reason"]
