"""micro_batch_size auto (launch/micro_batch.py): the search with the CUDA memory faked on the CPU,
the min over two gloo ranks, the probes forced on the CPU (the first step bitwise that of B set by hand),
and the CPU fallback through the trainer."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import torch

from common.errors import ConfigError, ReproError
from data.settings import grad_accum_steps
from forked_ranks import launch
from launch import micro_batch
from launch.config import parse_args
from launch.micro_batch import (FAILED, agree_on_smallest, candidate_sizes, search_micro_batch_size)

GIB = 2**30


def test_the_candidates_keep_grad_accum_steps_whole():
    assert candidate_sizes(524288, 1024, 1) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert candidate_sizes(524288, 1024, 8) == [1, 2, 4, 8, 16, 32, 64]
    assert candidate_sizes(3 * 4 * 32, 32, 2) == [1, 2, 3, 6]  # 12 rows, 6 per rank
    for b in candidate_sizes(3 * 4 * 32, 32, 2):
        assert (3 * 4 * 32) % (b * 32 * 2) == 0
    assert candidate_sizes(3 * 32, 32, 2) == []  # 3 rows do not split over 2 ranks


def linear_probe(fixed: float, per_row: float, oom_from: int | None = None, seen: list | None = None):
    """A fake probe: peak bytes fixed + per_row * B, or torch.OutOfMemoryError from B = oom_from."""
    def probe(size: int) -> int:
        if seen is not None:
            seen.append(size)
        if oom_from is not None and size >= oom_from:
            raise torch.OutOfMemoryError("CUDA out of memory (fake)")
        return int(fixed + per_row * size)
    return probe


def test_the_search_finds_the_largest_fit_largest_first_then_bisecting():
    seen = []
    result = search_micro_batch_size([1, 2, 4, 8, 16, 32, 64, 128], linear_probe(1 * GIB, 0.1 * GIB, seen=seen),
                                     lambda: (10 * GIB, 10 * GIB), headroom=0.1)
    # budget 9 GiB: 1 + 0.1 B <= 9 -> B <= 80
    assert result.chosen == 64 and result.budget_bytes == 9 * GIB
    assert seen[0] == 128 and len(seen) <= 4  # the largest first, then a bisection: not all 8
    assert [p["B"] for p in result.probes] == seen and [p["fits"] for p in result.probes][0] is False


def test_the_headroom_and_the_reserve_lower_the_budget():
    probe = linear_probe(0, 1 * GIB)
    memory = lambda: (20 * GIB, 40 * GIB)  # noqa: E731 - 20 free of 40
    assert search_micro_batch_size([1, 2, 4, 8, 16], probe, memory, headroom=0.0).chosen == 16
    assert search_micro_batch_size([1, 2, 4, 8, 16], probe, memory, headroom=0.1).chosen == 16  # 16 <= 20 - 4
    assert search_micro_batch_size([1, 2, 4, 8, 16], probe, memory, headroom=0.25).chosen == 8  # 10 left
    assert search_micro_batch_size([1, 2, 4, 8, 16], probe, memory, headroom=0.1, reserve_bytes=9 * GIB).chosen == 4
    assert search_micro_batch_size([1, 2, 4, 8, 16], probe, memory, headroom=0.5).chosen is None  # nothing left


def test_an_out_of_memory_probe_does_not_fit_and_is_released_outside_its_except_clause():
    released = []

    def release():
        import sys
        released.append(sys.exc_info()[0])  # no exception being handled: its traceback is gone

    result = search_micro_batch_size([1, 2, 4, 8, 16], linear_probe(0, 1, oom_from=8), lambda: (GIB, GIB),
                                     release, headroom=0.0)
    assert result.chosen == 4
    assert [p["fits"] for p in result.probes if p["B"] >= 8] == [False] * len([p for p in result.probes
                                                                              if p["B"] >= 8])
    assert all(p["peak_bytes"] is None for p in result.probes if p["B"] >= 8)
    assert released == [None] * len(result.probes)


def test_another_error_of_a_probe_is_not_taken_for_out_of_memory():
    def probe(size):
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        search_micro_batch_size([1, 2], probe, lambda: (GIB, GIB))


def test_agree_forces_every_rank_down_the_same_path():
    """Under FSDP each probe's outcome is agreed: a rank where B=8 fits follows one where it does not."""
    other_rank_fits = {16: False, 8: False, 4: True, 2: True, 1: True}
    seen: list[int] = []
    probe = linear_probe(0, 1, seen=seen)
    result = search_micro_batch_size([1, 2, 4, 8, 16], probe, lambda: (GIB, GIB), headroom=0.0,
                                     agree=lambda fits: fits and other_rank_fits[seen[-1]])
    assert result.chosen == 4


# --- the smallest over two gloo ranks -------------------------------------------------------------------------

def two_rank_votes(argv: list[str]) -> int:
    """A rank body for launch(): each rank votes argv[rank]; prints the agreed value."""
    import torch.distributed as dist

    from runtime.process_group import DistEnv

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=1))
    rank = dist.get_rank()
    env = DistEnv(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"), distributed=True)
    try:
        print(json.dumps({"rank": rank, "agreed": agree_on_smallest(int(argv[rank]), env)}), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


@pytest.mark.parametrize("votes, agreed", [(["32", "16"], 16), (["8", "0"], 0), (["64", str(FAILED)], FAILED)])
def test_every_rank_gets_the_smallest_vote(votes, agreed):
    proc = launch(votes, 2, target="test_micro_batch:two_rank_votes", timeout=120)
    assert proc.exitcodes == [0, 0], proc.stdout + proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in rows) == [0, 1] and {r["agreed"] for r in rows} == {agreed}


# --- the configuration -----------------------------------------------------------------------------------------

def test_auto_is_read_from_the_command_line_and_yaml(tmp_path):
    assert parse_args(["--micro_batch_size", "auto"]).data.micro_batch_size is None
    path = tmp_path / "c.yaml"
    path.write_text("micro_batch_size: auto\nmicro_batch_size_fallback: 8\n")
    cfg = parse_args(["--config", str(path)])
    assert (cfg.data.micro_batch_size, cfg.data.micro_batch_size_fallback) == (None, 8)
    assert parse_args([]).data.micro_batch_size == 64  # the default stays a fixed B


@pytest.mark.parametrize("argv, message", [
    (["--micro_batch_size", "automatic"], "micro_batch_size: expected an integer or auto, got 'automatic'"),
    (["--micro_batch_size", "0"], "micro_batch_size: must be positive, got 0"),
    (["--micro_batch_size", "auto", "--micro_batch_size_fallback", "0"],
     "micro_batch_size_fallback: must be positive, got 0"),
])
def test_bad_values_name_the_key(argv, message):
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert str(e.value) == message


# --- the probes, forced on the CPU ----------------------------------------------------------------------------

def forced_probes(monkeypatch, oom_above: int, probe_models: list):
    """auto probes on the CPU: the memory query faked (plenty free), and a probe of more than oom_above rows
    runs out of memory halfway through its backward (the last block's gradients already there)."""
    monkeypatch.setattr(micro_batch, "probing_supported", lambda device_type: True)
    monkeypatch.setattr(micro_batch, "device_memory", lambda device: (64 * GIB, 64 * GIB))
    real_copy = micro_batch.probe_copy

    def probe_copy(*args, **kwargs):
        model = real_copy(*args, **kwargs)

        def out_of_memory(module, inputs, output):
            if output.shape[0] > oom_above:
                def fail(grad):
                    raise torch.OutOfMemoryError("CUDA out of memory (fake)")
                output.register_hook(fail)

        model.transformer.h[0].register_forward_hook(out_of_memory)
        probe_models.append(model)
        return model

    monkeypatch.setattr(micro_batch, "probe_copy", probe_copy)


def first_step(cfg, ctx, run):
    from launch.components import make_lockstep
    from launch.recovery import Recovery

    model = run.strategy.training_model(run.model)
    recovery = Recovery(ctx, run, None, cfg.schedule.max_steps, cfg.long_run.max_rollbacks)
    try:
        result = make_lockstep(cfg, ctx).step(run, model, recovery.batches, False)
    finally:
        recovery.close()
    return result, {k: v.clone() for k, v in run.model.state_dict().items()}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_probed_b_trains_bitwise_as_the_same_b_set_by_hand(shards, tmp_path, monkeypatch, dropout):
    from conftest import build_tiny_run

    probe_models: list = []
    forced_probes(monkeypatch, oom_above=4, probe_models=probe_models)
    cfg, ctx, run = build_tiny_run(shards, tmp_path / "auto", micro_batch_size="auto", dropout=dropout)
    assert run.micro_batch_size == 4 and run.grad_accum_steps == 4  # 16 rows: 16 and 8 ran out of memory
    # the B is the run's: the validated configuration still says auto, and what ran says 4
    assert cfg.data.micro_batch_size is None and run.config["micro_batch_size"] == 4
    assert run.micro_batch["chosen"] == 4 and run.micro_batch["candidates"] == [1, 2, 4, 8, 16]
    assert [(p["B"], p["fits"]) for p in run.micro_batch["probes"]] == [(16, False), (4, True), (8, False)]
    (probed,) = probe_models
    assert all(p.grad is None for p in probed.parameters())  # the out-of-memory probes left no gradients
    assert all(p.grad is None for p in run.model.parameters()) and not run.optimizer.state
    auto_result, auto_weights = first_step(cfg, ctx, run)

    monkeypatch.undo()
    by_hand_cfg, by_hand_ctx, by_hand = build_tiny_run(shards, tmp_path / "by_hand", micro_batch_size=4,
                                                       dropout=dropout)
    assert by_hand.micro_batch is None
    hand_result, hand_weights = first_step(by_hand_cfg, by_hand_ctx, by_hand)
    assert auto_result.loss == hand_result.loss and auto_result.grad_norm == hand_result.grad_norm
    for key in hand_weights:
        assert torch.equal(auto_weights[key], hand_weights[key]), key


def test_no_micro_batch_that_fits_is_one_error(shards, tmp_path, monkeypatch):
    from conftest import build_tiny_run

    forced_probes(monkeypatch, oom_above=0, probe_models=[])
    with pytest.raises(ReproError, match="micro_batch_size: auto: not even micro-batch 1 fits"):
        build_tiny_run(shards, tmp_path / "out", micro_batch_size="auto")


# --- the fallback, through the trainer ---------------------------------------------------------------------------

def test_on_the_cpu_auto_is_one_warning_and_the_fallback(shards, tmp_path):
    from conftest import base_args, run_trainer

    out = tmp_path / "out"
    proc = run_trainer(base_args(shards, out, micro_batch_size="auto", micro_batch_size_fallback=8, max_steps=2,
                                 warmup_steps=1, eval_interval=0, checkpoint_interval=0))  # a sound schedule: no warning
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: micro_batch_size auto probes CUDA memory; on cpu it uses "
                        "micro_batch_size_fallback 8"]
    assert "micro_batch_size 8 (auto: fallback (cpu)) | grad_accum_steps 2" in proc.stdout
    record = json.loads((out / "run.json").read_text())
    assert record["micro_batch_size"] == {"requested": "auto", "chosen": 8, "how": "fallback (cpu)"}
    assert "micro_batch_size: 8\n" in (out / "config.yaml").read_text()  # what the checkpoints' config holds too
    checkpoint = torch.load(next(Path(out / "checkpoints").glob("step_*.pt")), weights_only=True)
    assert checkpoint["config"]["micro_batch_size"] == 8


def choose_on_rank_0(cfg, world_size: int = 1, logger=None):
    """choose_micro_batch_size under DDP on rank 0 of world_size ranks, with no process group (a silent logger by
    default): (chosen, record)."""
    from runtime.context import Context
    from runtime.logger import RunLogger
    from runtime.process_group import DistEnv
    from training.distributed.strategies import make_strategy

    runtime = cfg.runtime.make_runtime()
    env = DistEnv(rank=0, local_rank=0, world_size=world_size, device=runtime.device, distributed=False)
    ctx = Context(env, runtime, logger or RunLogger(enabled=False))
    return micro_batch.choose_micro_batch_size(ctx, make_strategy("ddp", env, runtime), cfg.data,
                                               cfg.model.model_config())


def test_on_the_cpu_a_fallback_that_does_not_divide_the_batch_is_made_to_fit(monkeypatch):
    """configs/demo.yaml's batch is 1,024 tokens, 8 rows of seq_len 128: the fallback 16 would not keep
    grad_accum_steps whole, so auto takes 8, the largest micro-batch up to it that does, and says so."""
    from conftest import REPO
    from runtime.logger import RunLogger

    cfg = parse_args(["--config", str(REPO / "configs" / "demo.yaml"), "--micro_batch_size", "auto",
                      "--device", "cpu"])
    assert cfg.data.micro_batch_size_fallback == 16
    logger, warnings = RunLogger(enabled=False), []
    monkeypatch.setattr(logger, "warn", warnings.append)
    chosen, record = choose_on_rank_0(cfg, logger=logger)
    assert (chosen, record) == (8, {"requested": "auto", "chosen": 8, "how": "fallback (cpu)"})
    assert warnings == ["micro_batch_size auto probes CUDA memory; on cpu it uses 8, the largest micro-batch up to "
                        "micro_batch_size_fallback 16 that keeps grad_accum_steps whole (8 rows a rank per step: "
                        "total_batch_size 1024 / seq_len 128 / 1 rank(s))"]
    assert grad_accum_steps(cfg.data.total_batch_size, cfg.data.seq_len, chosen, 1) == 1


def test_micro_batch_size_auto_names_the_nearest_batches_whose_rows_split_over_the_ranks():
    """auto finds a micro-batch where the step's rows split over the ranks: 524,288 tokens on 3 do not."""
    cfg = parse_args(["--micro_batch_size", "auto", "--device", "cpu"])  # GPT-2 124M's batch otherwise
    with pytest.raises(ConfigError) as raised:
        choose_on_rank_0(cfg, world_size=3)
    assert str(raised.value) == ("micro_batch_size: auto finds no micro-batch: total_batch_size 524288 does not split "
                                 "into rows of seq_len 1024 over 3 ranks; total_batch_size 522240 or 525312 does")


def test_a_resume_with_auto_chooses_again_and_names_the_change(shards, tmp_path):
    """The checkpoint holds the concrete B; a resume with auto chooses anew, and a different B is named (it
    changes the math only with dropout: its field's on_resume, dropout_on)."""
    from conftest import base_args, run_trainer

    out = tmp_path / "out"
    common = dict(micro_batch_size="auto", eval_interval=0, checkpoint_interval=2)
    run_trainer(base_args(shards, out, micro_batch_size_fallback=8, max_steps=2, **common))
    proc = run_trainer(base_args(shards, out, micro_batch_size_fallback=4, max_steps=3, **common))
    assert "resumed from" in proc.stdout and "micro_batch_size 4 (auto: fallback (cpu))" in proc.stdout
    changed = [line for line in proc.stderr.splitlines() if "differ from the checkpoint's" in line]
    assert len(changed) == 1 and "micro_batch_size 8 -> 4" in changed[0]
    assert "values; max_steps changes the training math" in changed[0]  # B does not (no dropout here)
