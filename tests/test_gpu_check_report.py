"""scripts/gpu_check_report.py, the Python of scripts/gpu_check.sh and bench_gpu.sh, on hand-made results: the
pairing of multi-GPU rows, the numerics groups, the merged summary, the levers' comparison, its usage errors.
tests/test_gpu_check.py runs it for real inside gpu_check.sh's dry run (make test-gpu-check)."""

from __future__ import annotations

import json

import pytest

from scripts import gpu_check_report as report


def row(label: str, world_size: int = 1, tokens_per_sec: float = 500_000.0, **fields) -> dict:
    """A bench row (scripts/bench.py's JSON), with what the summary reads."""
    return {"label": label, "world_size": world_size, "tokens_per_sec": tokens_per_sec, "ms_per_step": 1000.0,
            "ms_p10": 990.0, "ms_p90": 1010.0, "model": "gpt2", "params": 124_000_000, "B": 64, "T": 1024,
            "total_batch_size": 524288, "steps_timed": 25, "command": "scripts/bench.py --warmup 5", "mfu": None,
            "peak_mem_gb": None, "compile_s": 30.0, "startup_s": 40.0, "final_loss": 7.0, "data": "/x/corpus",
            **fields}


def test_scaling_pairs_each_multi_gpu_row_with_the_same_runs_one_gpu_row():
    """tokens/s per GPU and efficiency = tokens/s(N) / (N x tokens/s(1)); rows of other runs, or without a one-GPU
    row of their own, are left out."""
    rows = [row("124m-compile-plain-b64", 1, 500_000.0), row("124m-ddp-1gpu", 1, 480_000.0),
            row("124m-ddp-8gpu", 8, 3_456_000.0), row("350m-ddp-4gpu", 4, 600_000.0)]
    (scaled,) = report.scaling(rows)
    assert (scaled["label"], scaled["baseline"], scaled["world_size"]) == ("124m-ddp-8gpu", "124m-ddp-1gpu", 8)
    assert scaled["per_gpu"] == 432_000.0 and scaled["efficiency"] == pytest.approx(0.9)  # 432K of 480K per GPU
    assert report.scaling([row("124m-ddp-2gpu", 2, 960_000.0), row("124m-ddp-1gpu", 1, 480_000.0)])[0][
        "efficiency"] == pytest.approx(1.0)  # the one-GPU row may come after


def test_losses_compare_within_a_group_of_the_same_steps_tokens_and_optimizer():
    """The warm-up read from the command line (the last --warmup wins) counts in the steps; Muon's rows never meet
    AdamW's; a group of one is no comparison."""
    rows = [row("a", final_loss=7.0), row("b", final_loss=7.005), row("c", final_loss=7.5, command="--warmup 5 --warmup 2"),
            row("d", final_loss=7.02), row("e", optimizer="muon")]
    (group,) = report.compare_losses(rows)
    assert (group["baseline"], group["steps"]) == ("a", 30)
    assert [(r["label"], r["within_tolerance"]) for r in group["rows"]] == [("a", True), ("b", True), ("d", False)]


def test_report_merges_results_into_one_summary_with_what_was_not_measured(tmp_path):
    """Two results.json (one of an older script, without the newer keys) become one results.json, numerics.json and
    summary.md: the speed rows beside the reference, the best 124M against the target, and the failed and skipped."""
    environment = {"date": "2026-12-01T00:00:00", "dry_run": False, "gpu": "H100", "gpu_count": 1,
                   "torch": "2.13.0", "cuda": "12.8"}
    first = {"environment": [environment], "parts": [{"part": "speed", "status": "ok", "seconds": 300}],
             "tests": [], "rows": [row("124m-compile-plain-b64", tokens_per_sec=550_000.0),
                                   row("124m-eager-fused-b64", tokens_per_sec=400_000.0, startup_s=70.0)],
             "failed": [{"label": "1558m-b8", "why": "out of memory", "log_tail": []}], "skipped": []}
    second = {"environment": [environment], "parts": [{"part": "reference", "status": "ok", "seconds": 45}],
              "rows": [row("reference-build-nanogpt-b64", tokens_per_sec=500_000.0)],
              "skipped": [{"label": "recipe", "why": "no data/shakespeare"}]}
    for name, data in (("a", first), ("b", second)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(data))
    assert report.main(["report", str(tmp_path / "out"), str(tmp_path / "a"), str(tmp_path / "b" / "results.json")]) == 0
    merged = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [p["part"] for p in merged["parts"]] == ["speed", "reference"] and merged["muon"] == []
    assert len(json.loads((tmp_path / "out" / "numerics.json").read_text())[0]["rows"]) == 3
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert summary.startswith("# GPU check 2026-12-01T00:00:00: H100, torch 2.13.0 (CUDA 12.8)\n")
    assert "| 124m-compile-plain-b64 | 64 | 1000.0 (990.0-1010.0) | 550,000 | 1.100x |" in summary
    assert "target 540,000 met, aim 600,000 not met" in summary
    assert "not for 124m-eager-fused-b64." in summary  # its startup of 70 s is over the 60 s aimed at
    assert "- 1558m-b8: failed, out of memory" in summary and "- recipe: skipped, no data/shakespeare" in summary


def test_collect_reads_a_work_folder_into_results_and_details(tmp_path):
    work, results = tmp_path / "work", tmp_path / "results"
    (work / "bench").mkdir(parents=True)
    results.mkdir()
    (work / "environment.json").write_text(json.dumps({"gpu": None}))
    (work / "parts.tsv").write_text("speed\tok\t12\n")
    (work / "bench" / "order.txt").write_text("124m-a\n124m-gone\n")  # a label whose JSON was never written
    (work / "bench" / "124m-a.json").write_text(json.dumps(row("124m-a")))
    (work / "bench" / "failed.txt").write_text("124m-gone\texit 1\n")
    (work / "bench" / "124m-gone.log").write_text("".join(f"line {i}\n" for i in range(40)))
    assert report.main(["collect", str(work), str(results)]) == 0
    data = json.loads((results / "results.json").read_text())
    assert data["parts"] == [{"part": "speed", "status": "ok", "seconds": 12}]
    assert [r["label"] for r in data["rows"]] == ["124m-a"] and data["tests"] == []
    (failed,) = data["failed"]
    assert failed["why"] == "exit 1" and failed["log_tail"][0] == "line 15" and len(failed["log_tail"]) == 25
    import tarfile

    with tarfile.open(results / "details.tar.gz") as tar:
        assert {"parts.tsv", "environment.json", "124m-a.json", "failed.txt"} <= set(tar.getnames())


def test_faster_compares_two_bench_rows_and_refuses_a_missing_one(tmp_path):
    for label, rate in (("lever", 510_000.0), ("plain", 500_000.0)):
        (tmp_path / f"{label}.json").write_text(json.dumps({"tokens_per_sec": rate}))
    lever, plain, gone = (str(tmp_path / f"{name}.json") for name in ("lever", "plain", "gone"))
    assert report.main(["faster", lever, plain]) == 0
    assert report.main(["faster", plain, lever]) == 1 and report.main(["faster", lever, gone]) == 1


@pytest.mark.parametrize("argv", [["sideways"], ["report", "only-one"], ["faster", "a", "b", "c"]])
def test_a_usage_mistake_is_one_error_line_and_exit_2(argv, capfd):
    assert report.run_cli(report.main, argv) == 2
    (line,) = capfd.readouterr().err.splitlines()
    assert line.startswith("error: scripts/gpu_check_report.py: ")
