"""Muon on any world size and strategy (training/distributed/muon.py): each matrix orthogonalised whole, once.

The optimizer alone (tests/muon_worker.py, 2 and 3 gloo ranks, float64): DistributedMuon's update
is bit for bit one-process torch.optim.Muon's, with its matrices whole on every rank (ddp) or
sharded by rows (fsdp, rows that do not divide by the ranks), each matrix orthogonalised once in
all; the mutation that orthogonalises a rank's own rows is caught. The trainer: optimizer muon
under fsdp trains like one process, and a run resumes across world sizes, strategies and formats.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import base_args, crashed_copy, run_trainer, train_losses
from forked_ranks import launch
from muon_worker import SHAPES
from training.checkpoint.folder import list_checkpoints, read_full_state
from training.distributed.muon import assign_owners, newton_schulz_cost

STEPS = 3  # the worker's steps


def run_worker(tmp_path: Path, nproc: int, layout: str, variant: str = "right") -> list[dict]:
    out = tmp_path / f"{layout}-{nproc}-{variant}"
    out.mkdir()
    proc = launch([str(out), layout, variant], nproc, target="muon_worker:main", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
@pytest.mark.parametrize("layout", ["whole", "rows"], ids=["ddp-whole-matrices", "fsdp-row-shards"])
def test_the_distributed_update_is_one_process_muons_bit_for_bit_with_each_matrix_orthogonalised_once(
        tmp_path, nproc, layout):
    ranks = run_worker(tmp_path, nproc, layout)
    assert all(r["matched"] and r["worst"] == 0.0 for r in ranks), ranks
    assert all(r["host_syncs"] == 0 for r in ranks)  # the gathers and scatters wait for no value on the host
    owners = ranks[0]["owners"]
    assert all(r["owners"] == owners for r in ranks) and set(owners) == set(range(nproc))  # every rank works
    # each rank orthogonalised its own matrices each step (plus one 2x2 probe of the result's dtype)
    for rank, r in enumerate(ranks):
        assert r["runs"] == STEPS * owners.count(rank) + 1, (rank, r)


@pytest.mark.slow
def test_the_suite_catches_newton_schulz_on_what_a_rank_holds_instead_of_the_whole_matrix(tmp_path):
    """The mutation: every rank orthogonalises its own part. Under fsdp those are row blocks (a wrong
    update); under ddp whole copies (the right update, computed on every rank: N times the work)."""
    rows = run_worker(tmp_path, 2, "rows", "local")
    assert not any(r["matched"] for r in rows) and min(r["worst"] for r in rows) > 1e-3
    whole = run_worker(tmp_path, 2, "whole", "local")
    assert all(r["matched"] for r in whole)
    assert [r["runs"] for r in whole] == [STEPS * len(SHAPES)] * 2  # not the once-per-matrix count above


def test_owners_spread_the_newton_schulz_work_evenly_over_the_ranks():
    """GPT-2 124M's 48 block matrices over 8 ranks: within 10% of an even share each; the same on every call."""
    shapes = [torch.Size(s) for _ in range(12) for s in [(2304, 768), (768, 768), (3072, 768), (768, 3072)]]
    owners = assign_owners(shapes, 8)
    load = [sum(newton_schulz_cost(s) for s, o in zip(shapes, owners) if o == r) for r in range(8)]
    assert max(load) <= 1.1 * sum(load) / 8 and owners == assign_owners(shapes, 8)
    assert assign_owners(shapes, 1) == [0] * 48


# --- the trainer ---------------------------------------------------------------------------------

MUON = dict(optimizer="muon", dtype="float64", total_batch_size=768, max_steps=6, checkpoint_interval=2,
            eval_interval=0)  # 768 tokens: 6, 3 or 2 micro-batches of 4 rows on 1, 2 or 3 ranks


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("straight")
    runs = {"single": (None, "ddp"), "ddp2": (2, "ddp"), "fsdp2": (2, "fsdp"), "fsdp3": (3, "fsdp")}
    for name, (nproc, strategy) in runs.items():
        run_trainer(base_args(data, root / name, strategy=strategy, **MUON), nproc=nproc)
    return {name: root / name for name in runs}


def same_training(a: Path, b: Path, rtol: float = 1e-12) -> None:
    """Losses within rtol and every weight and Muon momentum buffer within rtol (relative norm), at the last step."""
    la, lb = train_losses(a), train_losses(b)
    assert sorted(la) == sorted(lb) == list(range(6))
    assert all(abs(la[s] - lb[s]) <= rtol * abs(lb[s]) for s in la), (la, lb)
    sa, sb = final_state(a), final_state(b)
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.linalg.norm(sa[key] - sb[key]) <= rtol * torch.linalg.norm(sb[key]), key


def final_state(out: Path) -> dict[str, torch.Tensor]:
    """The weights, and each Muon matrix's momentum buffer (whole, under its parameter's name), of the step-6 checkpoint."""
    (path,) = [p for s, p in list_checkpoints(out / "checkpoints") if s == 6]
    state = read_full_state(path)
    buffers = {f"{name}.momentum_buffer": v["momentum_buffer"] for name, v in state["optimizer"]["state"].items()
               if "momentum_buffer" in v}
    assert len(buffers) == 8  # the tiny model's 2 blocks x 4 matrices
    return {**state["model"], **buffers}


def resume_from(source: Path, out: Path, step: int, data: Path, nproc: int | None, strategy: str) -> None:
    """Continue source's run in out from its checkpoint at `step`, on nproc ranks under strategy."""
    crashed_copy(source, out, step)
    run_trainer(base_args(data, out, strategy=strategy, **MUON), nproc=nproc)


@pytest.mark.slow
@pytest.mark.parametrize("run", ["ddp2", "fsdp2", "fsdp3"])
def test_muon_on_2_and_3_ranks_under_ddp_and_fsdp_trains_like_one_process(straight, run):
    same_training(straight[run], straight["single"])


@pytest.mark.slow
def test_a_muon_run_resumes_across_world_sizes_strategies_and_formats(straight, data, tmp_path):
    """2 ranks ddp (file) -> 1 process -> 3 ranks fsdp (sharded); and 2 ranks fsdp (sharded) -> 1 process."""
    chain = tmp_path / "chain"
    resume_from(straight["ddp2"], chain, 2, data, None, "ddp")
    resume_from(chain, chain, 4, data, 3, "fsdp")
    assert list_checkpoints(chain / "checkpoints")[-1][1].name.endswith("step_00000006")  # a sharded folder
    same_training(chain, straight["single"])
    resume_from(straight["fsdp2"], tmp_path / "from-sharded", 2, data, None, "ddp")
    same_training(tmp_path / "from-sharded", straight["single"])


@pytest.mark.slow
def test_a_muon_run_under_fsdp_resumes_bitwise_on_the_same_ranks(straight, data, tmp_path):
    resume_from(straight["fsdp2"], tmp_path / "resumed", 2, data, 2, "fsdp")
    assert train_losses(tmp_path / "resumed") == train_losses(straight["fsdp2"])
    resumed, original = final_state(tmp_path / "resumed"), final_state(straight["fsdp2"])
    assert all(torch.equal(resumed[k], original[k]) for k in original)


@pytest.mark.slow
def test_the_muon_benchmark_times_each_variant_and_counts_each_ranks_share(tmp_path):
    """benchmarks/bench_muon.py's rehearsal on 2 ranks: replicated does every matrix on each rank, the others half."""
    proc = run_trainer(["--dry_run", "--steps", "1"], nproc=2, script="benchmarks/bench_muon.py")
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["label"] for r in rows] == ["muon-replicated", "muon-whole", "muon-rows"]
    assert all(r["world_size"] == 2 and r["step_ms"] > 0 for r in rows)
    assert [r["newton_schulz_runs"] for r in rows] == [8, 4, 4]  # 2 blocks x 4 matrices; owners split them evenly
