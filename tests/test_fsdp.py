"""FSDP2 (strategy fsdp / fsdp_zero2) on CPU with gloo: the same training as DDP, one checkpoint format.

Runs through real 2-rank torchrun. float64 makes the strategies' different summation orders
negligible, so their losses and weights must agree to ~1e-12; in float32 they agree within
summation noise, and a resume under the same strategy is bitwise.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import (GPT2_VOCAB, REPO, base_args, crashed_copy, load_weights, run_trainer, signalled,
                      start_trainer, train_losses, wait_for_step)
from slowness import guard
from test_faults import SIGNAL_PAUSE, env_for_workers, slow_steps
from training.checkpoint.folder import list_checkpoints, read_full_state
from runtime.logger import read_log

pytestmark = pytest.mark.slow  # every test here starts processes

STEPS = 6
F64 = dict(dtype="float64", checkpoint_interval=3)


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory) -> dict[str, Path]:
    """Straight runs of the same training on 2 ranks: DDP and FSDP in float64, FSDP in float32."""
    root = tmp_path_factory.mktemp("strategies")
    out = {}
    for name, extra in [("ddp", F64), ("fsdp", F64), ("fsdp32", {})]:
        out[name] = root / name
        run_trainer(base_args(data, out[name], strategy=name.removesuffix("32"), **extra), nproc=2)
    return out


def assert_same_training(a: Path, b: Path, rtol: float, weights_rtol: float | None = None) -> None:
    """Losses within rtol, and every weight tensor within weights_rtol (default rtol) in relative norm."""
    la, lb = train_losses(a), train_losses(b)
    assert sorted(la) == sorted(lb) == list(range(STEPS))
    for step in la:
        assert abs(la[step] - lb[step]) <= rtol * abs(lb[step]), (step, la[step], lb[step])
    wa, wb = load_weights(a, STEPS), load_weights(b, STEPS)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.linalg.norm(wa[key] - wb[key]) <= (weights_rtol or rtol) * torch.linalg.norm(wb[key]), key


def test_fsdp_trains_exactly_like_ddp(runs):
    assert_same_training(runs["fsdp"], runs["ddp"], rtol=1e-12)  # (DDP equals one process: test_train_distributed)
    # float32 against the float64 DDP run: float32 rounding alone moves the losses by ~1e-6 and some
    # bias weights (sums of many cancelling terms, scaled up to lr-sized steps by Adam) by ~1e-3
    assert_same_training(runs["fsdp32"], runs["ddp"], rtol=1e-5, weights_rtol=1e-2)
    assert train_losses(runs["fsdp"])[STEPS - 1] < train_losses(runs["fsdp"])[0]  # it learns


def test_fsdp_holds_about_half_the_model_state_per_rank_on_two_ranks(runs):
    def state_gib(run: Path) -> float:
        (startup,) = [r for r in read_log(run / "log.jsonl") if r["kind"] == "startup"]
        return startup["state_gib_per_rank"]  # parameters + gradients + AdamW state, from the local tensors

    ddp, fsdp = state_gib(runs["ddp"]), state_gib(runs["fsdp"])
    assert 0.45 <= fsdp / ddp <= 0.55, (fsdp, ddp)


@pytest.mark.parametrize("first,then,nproc", [("fsdp", "ddp", 2), ("ddp", "fsdp_zero2", 2), ("fsdp", "ddp", None)],
                         ids=["fsdp-to-ddp", "ddp-to-fsdp_zero2", "fsdp-2-ranks-to-1-process"])
def test_a_checkpoint_resumes_under_another_strategy_or_world_size(runs, data, tmp_path, first, then, nproc):
    out = tmp_path / "resumed"
    crashed_copy(runs[first], out, 3)
    run_trainer(base_args(data, out, strategy=then, **F64), nproc=nproc)
    assert_same_training(out, runs["ddp"], rtol=1e-12)  # fsdp_zero2's three steps included


def test_sigterm_under_fsdp_saves_and_the_same_command_continues_bitwise(runs, data, tmp_path):
    """Each forked rank gets the SIGTERM torchrun forwards to its workers (test_faults has torchrun's part)."""
    out = tmp_path / "preempted"
    args = base_args(data, out, strategy="fsdp", max_steps=STEPS, checkpoint_interval=0)
    with start_trainer(args, nproc=2, script="tests/inject_fault.py", extra_env=slow_steps(SIGNAL_PAUSE)) as proc:
        wait_for_step(out, 1, proc)
        stdout, stderr = signalled(proc, signal.SIGTERM)
    assert proc.returncode == 0, stderr[-3000:]
    assert "SIGTERM received: saved step" in stdout, stderr[-3000:]
    assert "in the background" not in stdout  # a save the process exits after is written at once
    assert 1 < [s for s, _ in list_checkpoints(out / "checkpoints")][-1] < STEPS
    run_trainer(args, nproc=2)
    straight = train_losses(runs["fsdp32"])
    assert train_losses(out) == straight  # bitwise: the same strategy and world size


def test_a_nan_on_one_rank_under_fsdp_stops_both_before_the_update(data, tmp_path):
    out = tmp_path / "nan"
    proc = run_trainer(base_args(data, out, strategy="fsdp", checkpoint_interval=1), nproc=2, check=False,
                       script="tests/inject_fault.py", extra_env={"FAULT": "nan", "FAULT_STEP": "2", "FAULT_RANK": "1"})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "step 2: loss nan" in errors[0], proc.stderr[-3000:]
    assert proc.exitcodes == [3, 3]
    assert [s for s, _ in list_checkpoints(out / "checkpoints")] == [1, 2]  # nothing after the last good step


def test_checkpoints_written_under_fsdp_serve_every_reader(runs, tmp_path):
    """An FSDP run's (sharded) checkpoint holds what a DDP run's file does, and sample.py reads it."""
    ckpt = runs["fsdp32"] / "checkpoints" / f"step_{STEPS:08d}"
    assert ckpt.is_dir()  # checkpoint_format auto: sharded under fsdp
    ddp = read_full_state(runs["ddp"] / "checkpoints" / f"step_{STEPS:08d}.pt")
    fsdp = read_full_state(ckpt)
    assert fsdp["model"].keys() == ddp["model"].keys() and fsdp["optimizer"].keys() == ddp["optimizer"].keys()
    assert fsdp["optimizer"]["param_groups"] == ddp["optimizer"]["param_groups"]
    assert fsdp["optimizer"]["state"].keys() == ddp["optimizer"]["state"].keys()
    sampled = subprocess.run([sys.executable, str(REPO / "sample.py"), "--ckpt", str(ckpt), "--prompt", "!",
                              "--num_samples", "1", "--max_new_tokens", "4", "--device", "cpu"],
                             cwd=REPO, capture_output=True, text=True, timeout=guard(120), env=env_for_workers())
    assert sampled.returncode == 0 and "--- sample 0" in sampled.stdout, sampled.stderr[-2000:]


def test_evaluations_that_split_unevenly_over_the_ranks_finish_with_the_ddp_figures(data, tmp_path):
    """3 val batches and 33 HellaSwag examples (17 + 16: 2 batches and 1) over 2 ranks.

    Every FSDP forward all-gathers the blocks' parameters, so a rank with fewer batches must
    still join the others' forwards (it ran out of batches and hung before); the figures are
    those of DDP, where evaluation has no collective but the final sums.
    """
    from test_hellaswag import write_fixture

    hellaswag = write_fixture(tmp_path / "hellaswag.jsonl", n=40)
    logs = {}
    for strategy in ("ddp", "fsdp"):
        out = tmp_path / strategy
        run_trainer(base_args(data, out, strategy=strategy, dtype="float64", max_steps=2, eval_interval=1,
                              val_tokens=384, micro_batch_size=4, hellaswag_interval=1, hellaswag_path=hellaswag,
                              hellaswag_limit=33, sample_interval=2, sample_count=1, sample_tokens=3, vocab_size=GPT2_VOCAB,
                              checkpoint_interval=0), nproc=2, timeout=120)
        logs[strategy] = [r for r in read_log(out / "log.jsonl") if r["kind"] in ("val", "hellaswag", "sample")]
    assert [(r["kind"], r["step"]) for r in logs["fsdp"]] == [(r["kind"], r["step"]) for r in logs["ddp"]]
    assert [r["n"] for r in logs["fsdp"] if r["kind"] == "hellaswag"] == [33, 33, 33]
    for a, b in zip(logs["fsdp"], logs["ddp"]):
        if a["kind"] == "val":
            assert abs(a["loss"] - b["loss"]) <= 1e-12 * b["loss"], (a, b)
        elif a["kind"] == "hellaswag":
            assert (a["acc"], a["acc_norm"]) == (b["acc"], b["acc_norm"]), (a, b)


def test_fsdp_resumes_with_another_micro_batch_size(runs, data, tmp_path):
    out = tmp_path / "resumed"
    crashed_copy(runs["fsdp"], out, 3)
    run_trainer(base_args(data, out, strategy="fsdp", micro_batch_size=2, **F64), nproc=2)
    assert_same_training(out, runs["ddp"], rtol=1e-12)  # 4 micro-steps of 2 rows per rank instead of 2 of 4


def test_fsdp_on_three_ranks_shards_parameters_that_do_not_divide_and_trains_like_one_process(data, tmp_path):
    """Every LayerNorm (64 values) and the (192,) attention biases split unevenly over 3 ranks;
    the 2 val batches leave the third rank with none (it joins with idle forwards)."""
    geometry = dict(total_batch_size=384, micro_batch_size=4, dtype="float64", checkpoint_interval=3)
    run_trainer(base_args(data, tmp_path / "fsdp3", strategy="fsdp", **geometry), nproc=3)
    run_trainer(base_args(data, tmp_path / "single", **geometry))
    assert_same_training(tmp_path / "fsdp3", tmp_path / "single", rtol=1e-12)
    vals = [[r["loss"] for r in read_log(tmp_path / d / "log.jsonl") if r["kind"] == "val"] for d in ("fsdp3", "single")]
    assert len(vals[0]) == 3 and all(abs(a - b) <= 1e-12 * b for a, b in zip(*vals))
