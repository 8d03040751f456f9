"""scripts/bench.py runs the trainer's own step and reports it; the hot loop syncs with the host once per step."""

from __future__ import annotations

import json

import pytest

from conftest import TINY_MODEL, TINY_VOCAB, make_shards, run_trainer


BENCH_ARGS = [*TINY_MODEL, "--total_batch_size", "512", "--micro_batch_size", "4", "--device", "cpu",
              "--dtype", "float32", "--warmup", "2", "--steps", "4", "--vocab_size", str(TINY_VOCAB)]


@pytest.mark.slow
def test_bench_on_cpu_prints_a_table_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_trainer([*BENCH_ARGS, "--json", str(out), "--label", "tiny"], script="scripts/bench.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ms/step (p10-p90)" in proc.stdout and "tokens/s" in proc.stdout
    row = json.loads(out.read_text())
    assert row["label"] == "tiny" and row["steps_timed"] == 4 and row["world_size"] == 1
    assert (row["B"], row["T"], row["grad_accum"], row["compile"], row["device"]) == (4, 32, 4, False, "cpu")
    assert row["ms_p10"] <= row["ms_per_step"] <= row["ms_p90"]
    assert abs(row["tokens_per_sec"] - 512 / (row["ms_per_step"] / 1000)) < 1e-6 * row["tokens_per_sec"]
    assert row["startup_s"] > 0 and row["mfu"] is None  # no MFU without a known peak


@pytest.mark.slow
def test_bench_under_torchrun_reports_the_world_size(tmp_path):
    out = tmp_path / "bench.json"
    run_trainer([*BENCH_ARGS, "--json", str(out)], nproc=2, script="scripts/bench.py")
    row = json.loads(out.read_text())
    assert row["world_size"] == 2 and row["grad_accum"] == 2


@pytest.mark.slow
def test_bench_rejects_bad_trainer_keys(tmp_path):
    proc = run_trainer(["--micro_batch_size", "x"], script="scripts/bench.py", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "micro_batch_size: expected an integer" in proc.stderr


def test_bench_reports_what_runs_on_the_cpu_of_a_gpu_machine(monkeypatch):
    """--device cpu on a machine with a GPU: no compile, no bf16, the CPU's name (the trainer's own resolution)."""
    import torch

    from scripts import bench
    from runtime import runtime
    from launch.config import parse_args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda: False)
    row = bench.describe_run(parse_args([*TINY_MODEL, "--total_batch_size", "512", "--micro_batch_size", "4",
                                         "--device", "cpu"]), world_size=1)
    assert (row["compile"], row["dtype"], row["loss_chunk_size"]) == (False, "float32", 0)
    assert "H100" not in row["device"]
    on_gpu = runtime.resolve_runtime("auto", "auto", None, None)
    assert (on_gpu.device.type, on_gpu.compile, on_gpu.dtype, on_gpu.device_name) == (
        "cuda", True, "bfloat16", "NVIDIA H100 80GB HBM3")


# --- benchmarks/bench_gpu.sh (issue 44: `python3` without torch printed a traceback per variant and exited 0) ------

def bench_gpu(tmp_path, *groups: str, **env: str):
    import os
    import subprocess

    from conftest import REPO

    return subprocess.run(["bash", str(REPO / "benchmarks" / "bench_gpu.sh"), str(tmp_path / "results"), *groups],
                          capture_output=True, text=True, cwd=tmp_path, env={**os.environ, **env})


@pytest.mark.slow  # starts bash (and python: a second or two)
def test_bench_gpu_without_torch_or_a_gpu_is_one_error_line_and_writes_nothing(tmp_path):
    import os

    import torch

    from conftest import REPO

    proc = bench_gpu(tmp_path, "speed", PYTHON="false")  # an interpreter that cannot import torch
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["error: false cannot import torch: run make install (it makes .venv), or set "
                                        "PYTHON to a Python with torch"]
    assert not (tmp_path / "results").exists()
    if not torch.cuda.is_available() and (REPO / ".venv" / "bin" / "python").exists():
        env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
        proc = bench_gpu(tmp_path, "speed", **env)  # the venv's python by default, not the system's python3
        assert proc.returncode == 2 and proc.stderr.splitlines() == [
            "error: no CUDA GPU for .venv/bin/python's torch: the variants are GPU benchmarks (BENCH_DRY_RUN=1 runs "
            "each as a tiny CPU run)"], proc.stderr


@pytest.mark.slow
def test_bench_gpu_exits_1_when_a_variant_fails_for_another_reason_than_memory(tmp_path):
    """A dry-run variant on a damaged shard fails (bench.py's exit 2): failed.txt says why, and so does the
    script's status; before, it exited 0."""
    import sys

    damaged = make_shards(tmp_path / "damaged", prefix="x")  # a sound val shard: the train one is what fails
    (damaged / "x_train_000001.npy").write_bytes(b"not a shard")
    proc = bench_gpu(tmp_path, "speed", PYTHON=sys.executable, BENCH_DRY_RUN="1", BENCH_ONLY="124m-eager-fused-b64",
                     DATA_DIR=str(damaged))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    (line,) = (tmp_path / "results" / "failed.txt").read_text().splitlines()
    assert line.startswith("124m-eager-fused-b64\texit 2: error: ") and "x_train_000001.npy" in line, line
    assert proc.stderr.splitlines()[-1] == (f"error: 1 variant(s) failed, not for lack of memory: "
                                            f"{tmp_path / 'results'}/failed.txt says why")


@pytest.mark.slow
def test_a_profiled_step_after_the_timed_ones_names_the_costliest_work_and_changes_no_figure(tmp_path):
    """--profile_top: one more step under the trainer's profiler; the timed steps and the final loss
    are those of the run without it."""
    rows = {}
    for name, extra in (("plain", []), ("profiled", ["--profile_top", "3"])):
        out = tmp_path / f"{name}.json"
        proc = run_trainer([*BENCH_ARGS, "--json", str(out), *extra], script="scripts/bench.py", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows[name] = json.loads(out.read_text())
    plain, profiled = rows["plain"], rows["profiled"]
    assert "top_kernels" not in plain
    assert profiled["steps_timed"] == plain["steps_timed"] == 4
    assert profiled["final_loss"] == plain["final_loss"]  # the loss of the last timed step, not the profiled one
    assert profiled["profile_events"] == "cpu_op"  # no kernels on the CPU: its operators
    top = profiled["top_kernels"]
    assert len(top) == 3 and [k["ms"] for k in top] == sorted((k["ms"] for k in top), reverse=True)
    assert all(k["calls"] >= 1 and 0 < k["share"] <= 1 for k in top)


# --- the all-reduce bandwidth of benchmarks/bench_allreduce.py

def test_allreduce_bandwidths_are_nccl_tests_algbw_and_busbw():
    """algbw = bytes / time; busbw = algbw x 2(N-1)/N: on 2 ranks the same, on 8 1.75x it."""
    from benchmarks import bench_allreduce

    assert bench_allreduce.bandwidths(10**9, 0.5, 2) == (2.0, 2.0)
    algbw, busbw = bench_allreduce.bandwidths(498_000_000, 0.004, 8)
    assert algbw == pytest.approx(124.5) and busbw == pytest.approx(124.5 * 1.75)


def test_allreduce_times_ddps_bucket_and_the_whole_gradient_in_float32_and_bfloat16():
    """A 25 MiB bucket holds 25 MiB in either dtype (DDP caps its bytes); the gradient is every parameter once:
    GPT-2 124M's 124,475,904 (the 50,304-row embedding tied to the lm_head)."""
    import torch

    from benchmarks import bench_allreduce

    elements = bench_allreduce.gradient_elements("gpt2", dry_run=False)
    assert elements == 124_475_904
    sizes = {label: numel * dtype.itemsize for label, numel, _, dtype in bench_allreduce.buffers(25, elements)}
    assert sizes == {"allreduce-bucket-fp32": 25 * 2**20, "allreduce-bucket-bf16": 25 * 2**20,
                     "allreduce-grad-fp32": 4 * elements, "allreduce-grad-bf16": 2 * elements}
    assert [d for *_, d in bench_allreduce.buffers(25, elements)] == [torch.float32, torch.bfloat16] * 2
