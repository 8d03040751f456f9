"""scripts/bench.py runs the trainer's own step and reports it; the hot loop syncs with the host once per step."""

from __future__ import annotations

import json

import pytest

from conftest import TINY_MODEL, TINY_VOCAB, run_trainer


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
    from training.train import runtime
    from training.train.config import parse_args

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
