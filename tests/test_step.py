"""The training step driven directly, in this process: one host sync, and no update from a NaN."""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, build_tiny_run, lockstep_steps, train_loop
from launch.components import make_lockstep
from data.loader import Prefetcher
from common.errors import NonFiniteLossError
from training.distributed.preemption import PreemptionFlag

SYNCING_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


@pytest.fixture
def count_syncs(monkeypatch):
    """Counts, per call site, the host synchronisations the repository's own code asks for.

    A host sync is anything that makes the CPU wait for a tensor's value: .item(), .tolist(),
    .cpu(), .numpy(), bool()/float()/int() of a tensor; on a GPU each one stalls the launch
    queue. Library internals (such as the CPU AdamW's step counter) are not ours to change.
    """
    counts: collections.Counter = collections.Counter()

    def counting(name: str):
        original = getattr(torch.Tensor, name)

        def method(self, *args, **kwargs):
            frame = sys._getframe(1)
            path = Path(frame.f_code.co_filename)
            if REPO in path.parents and not {"tests", ".venv", "site-packages"} & set(path.relative_to(REPO).parts):
                counts[f"{path.relative_to(REPO)}:{frame.f_lineno}"] += 1
            return original(self, *args, **kwargs)

        return method

    for name in SYNCING_METHODS:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    return counts


@pytest.mark.parametrize("settings", [{}, {"spike_skip": "true", "spike_window": 2}, {"ema_decay": 0.9}],
                         ids=["default", "spike-skip", "ema"])
def test_a_training_step_syncs_with_the_host_once(shards, tmp_path, count_syncs, settings):
    """With spike_skip, steps 2 and 3 are judged against a full window: on the same sync."""
    cfg, ctx, run = build_tiny_run(shards, tmp_path / "run", **settings)
    batches = Prefetcher(run.train_loader, 0, cfg.schedule.max_steps, ctx.runtime.device)
    count_syncs.clear()
    try:
        for _ in range(4):
            make_lockstep(cfg, ctx).step(run, run.model, batches, stop_requested=False)
    finally:
        batches.close()
    assert run.step == 4 and run.grad_accum_steps == 4  # micro-steps do not sync
    assert list(count_syncs.values()) == [4] and next(iter(count_syncs)).startswith("training/run/lockstep.py:")
    assert run.spikes is None or (run.spikes.full and run.skips_in_a_row == 0)
    assert run.ema is None or run.ema.updates == 4  # the EMA's update adds no sync


def test_the_training_loop_adds_no_sync_of_its_own(shards, tmp_path, count_syncs):
    """The whole loop (logging, checkpoint and eval bookkeeping) on steps without an eval."""

    quiet = dict(eval_interval=0, checkpoint_interval=0, final_checkpoint="false", log_interval=1000)
    totals = {}
    for steps in (3, 7):
        cfg, ctx, run = build_tiny_run(shards, tmp_path / f"run{steps}", max_steps=steps, **quiet)  # a silent logger
        count_syncs.clear()
        train_loop(cfg, ctx, run, PreemptionFlag(), record={})
        totals[steps] = dict(count_syncs)
    growth = {site: totals[7].get(site, 0) - totals[3].get(site, 0) for site in {*totals[3], *totals[7]}}
    assert {site: n for site, n in growth.items() if n} == {next(s for s in totals[7] if s.startswith("training/run/lockstep.py")): 4}


def combined_metrics(argv: list[str]) -> int:
    """A rank body for launch(): the step's one collective (Lockstep.agree) on this rank's loss, stop vote and a
    metric of each kind the step can record; what the rank read, printed as JSON. argv: the shards' folder."""
    import datetime

    import torch.distributed as dist
    from common.log_fields import train_metric
    from runtime.context import Context
    from runtime.process_group import DistEnv

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=1))
    rank = dist.get_rank()
    try:
        cfg, ctx, run = build_tiny_run(Path(argv[0]), Path(argv[0]) / f"run{rank}")
        env = DistEnv(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"), distributed=True)
        metrics = {train_metric("test_mean", "mean"): torch.tensor(rank + 1.0), train_metric("test_sum", "sum"): rank + 1,
                   train_metric("test_max", "max"): torch.tensor(5.0 - 6 * rank)}  # ranks 0, 1: 1, 2 | 1, 2 | 5, -1
        verdict = make_lockstep(cfg, Context(env, ctx.runtime, ctx.logger)).agree(
            run, torch.tensor(2.0 * rank + 4), torch.tensor(0.5), rank == 1, None, metrics)
        print(json.dumps([verdict.loss, verdict.stop, verdict.grad_norm, verdict.metrics]), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


def test_the_metrics_a_step_records_are_combined_over_the_ranks_as_declared_in_its_one_collective(shards):
    """common/log_fields.py's train_metric: the mean, sum or max of the ranks' values, every rank alike, beside the
    loss (its mean) and the votes (any rank's stop) of the same all-gather."""
    from forked_ranks import launch

    proc = launch([str(shards)], 2, target="test_step:combined_metrics", timeout=120)
    assert proc.exitcodes == [0, 0], proc.stdout + proc.stderr
    read = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("[")]
    assert read == [[5.0, True, 0.5, {"test_mean": 1.5, "test_sum": 3.0, "test_max": 5.0}]] * 2


@pytest.mark.parametrize("grad_clip", [1.0, 0.0])
def test_each_step_records_whether_its_gradient_was_clipped(shards, tmp_path, grad_clip):
    """training/run/step.py's metric `clipped`: 1.0 where the norm was over grad_clip, else 0.0 (0: no clipping);
    the tiny model's first norm is over 1, the later ones under. On the default run of the one-sync test above too."""
    cfg, ctx, run = build_tiny_run(shards, tmp_path / "run", grad_clip=grad_clip)
    results = lockstep_steps(cfg, ctx, run, 3)
    assert results[0].grad_norm > 1.0 > results[2].grad_norm
    assert [r.metrics["clipped"] for r in results] == [float(0 < grad_clip < r.grad_norm) for r in results]


def test_a_nan_loss_raises_before_the_update_is_applied(shards, tmp_path):
    cfg, ctx, run = build_tiny_run(shards, tmp_path / "run")
    batches = Prefetcher(run.train_loader, 0, cfg.schedule.max_steps, ctx.runtime.device)
    try:
        for _ in range(2):
            make_lockstep(cfg, ctx).step(run, run.model, batches, stop_requested=False)
        with torch.no_grad():
            run.model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("nan")
        weights = {k: v.clone() for k, v in run.model.state_dict().items()}
        moments = {k: v.clone() for k, v in run.optimizer.state[run.model.lm_head.weight].items()}
        with pytest.raises(NonFiniteLossError, match="step 2: loss nan / grad norm nan is not finite; the update "
                                                     "was not applied"):
            make_lockstep(cfg, ctx).step(run, run.model, batches, stop_requested=False)
    finally:
        batches.close()
    assert run.step == 2
    for key, value in run.model.state_dict().items():
        torch.testing.assert_close(value, weights[key], rtol=0, atol=0, equal_nan=True)
    for key, value in run.optimizer.state[run.model.lm_head.weight].items():
        assert torch.equal(value, moments[key]), key


def test_float16_overflow_skips_the_update_and_lowers_the_loss_scale(shards, tmp_path):
    cfg, ctx, run = build_tiny_run(shards, tmp_path / "run", dtype="float16")
    assert ctx.runtime.loss_scaling and run.scaler.is_enabled()
    run.scaler.load_state_dict({**run.scaler.state_dict(), "scale": 2.0**100})  # every gradient overflows
    batches = Prefetcher(run.train_loader, 0, cfg.schedule.max_steps, ctx.runtime.device)
    try:
        weights = {k: v.clone() for k, v in run.model.state_dict().items()}
        result = make_lockstep(cfg, ctx).step(run, run.model, batches, stop_requested=False)
        assert result.skipped and run.step == 1  # the batch is consumed, the update is not applied
        for key, value in run.model.state_dict().items():
            assert torch.equal(value, weights[key]), key
        assert run.scaler.get_scale() == 2.0**99
        run.scaler.update(2.0**16)  # a scale the gradients fit in
        result = make_lockstep(cfg, ctx).step(run, run.model, batches, stop_requested=False)
        assert not result.skipped and result.loss < 11 and not torch.equal(run.model.lm_head.weight, weights["lm_head.weight"])
    finally:
        batches.close()


def test_dtype_auto_picks_float16_on_a_gpu_without_bf16(monkeypatch):
    from runtime.runtime import resolve_dtype

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", torch.device("cuda", 0)) == "float16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", torch.device("cuda", 0)) == "bfloat16"
