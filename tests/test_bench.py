"""bench.py runs the trainer's own step and reports it; the hot loop syncs with the host once per step."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO, TINY_MODEL, base_args, make_shards, run_trainer

BENCH_ARGS = [*TINY_MODEL, "--total_batch_size", "512", "--micro_batch_size", "4", "--device", "cpu",
              "--dtype", "float32", "--warmup", "2", "--steps", "4"]


def test_bench_on_cpu_prints_a_table_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench.py"), *BENCH_ARGS, "--json", str(out), "--label", "tiny"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ms/step (p10-p90)" in proc.stdout and "tokens/s" in proc.stdout
    row = json.loads(out.read_text())
    assert row["label"] == "tiny" and row["steps_timed"] == 4 and row["world_size"] == 1
    assert (row["B"], row["T"], row["grad_accum"], row["compile"], row["device"]) == (4, 32, 4, False, "cpu")
    assert row["ms_p10"] <= row["ms_per_step"] <= row["ms_p90"]
    assert abs(row["tokens_per_sec"] - 512 / (row["ms_per_step"] / 1000)) < 1e-6 * row["tokens_per_sec"]
    assert row["startup_s"] > 0 and row["mfu"] is None  # no MFU without a known peak


def test_bench_under_torchrun_reports_the_world_size(tmp_path):
    out = tmp_path / "bench.json"
    run_trainer([*BENCH_ARGS, "--json", str(out)], nproc=2, script="bench.py")
    row = json.loads(out.read_text())
    assert row["world_size"] == 2 and row["grad_accum"] == 2


def test_bench_rejects_bad_trainer_keys(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "bench.py"), "--micro_batch_size", "x"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and "micro_batch_size: expected an integer" in proc.stderr


def test_training_loop_syncs_with_the_host_once_per_step(tmp_path):
    """Count .item()/.tolist()/bool(tensor)/... calls from our code in runs of 3 and 7 steps."""
    data = make_shards(tmp_path / "shards")
    quiet = dict(eval_interval=0, checkpoint_interval=0, final_checkpoint="false", log_interval=1000)
    counts = {}
    for steps in (3, 7):
        report = tmp_path / f"syncs{steps}.json"
        run_trainer([str(report), *base_args(data, tmp_path / f"run{steps}", max_steps=steps, **quiet)],
                    script="tests/count_syncs.py")
        counts[steps] = json.loads(report.read_text())
    growing = {site: counts[7].get(site, 0) - counts[3].get(site, 0)
               for site in set(counts[3]) | set(counts[7]) if counts[7].get(site, 0) != counts[3].get(site, 0)}
    assert len(growing) == 1, growing  # a single call site in the loop ...
    ((site, extra),) = growing.items()
    assert site.startswith("train_gpt2.py:") and extra == 4, growing  # ... called once per step
