"""Multi-node through torchrun's own c10d rendezvous: two agents ("nodes") on this machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, base_args, load_weights, make_shards, run_trainer, train_losses, wait_for_step
from forked_ranks import free_port
from slowness import guard
from test_faults import SIGNAL_PAUSE, STEPS, assert_same_run, children, slow_steps

pytestmark = pytest.mark.slow  # every test here starts processes


def start_two_nodes(args: list[str], cwds: tuple[Path, Path] = (REPO, REPO), torchrun_args: tuple[str, ...] = (),
                    script: str = "train_gpt2.py", extra_env: dict | None = None) -> list[subprocess.Popen]:
    """One torchrun agent per "node" (each in its own working directory), meeting through c10d
    rendezvous, running in the background with their output piped."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(extra_env or {}))
    return [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
             f"--node_rank={rank}", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
             "--rdzv_id=gpt2-repro-test", *torchrun_args, str(REPO / script), *args],
            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank, cwd in enumerate(cwds)
    ]


def finish(nodes: list[subprocess.Popen], timeout: float = 240) -> list[subprocess.Popen]:
    """Wait for every node's agent (a hang guard of `timeout` s, tests/slowness.py); .outputs = (stdout, stderr)."""
    try:
        for node in nodes:
            node.outputs = node.communicate(timeout=guard(timeout))
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.communicate()
    return nodes


def run_two_nodes(args: list[str], cwds: tuple[Path, Path] = (REPO, REPO)) -> list[subprocess.Popen]:
    """start_two_nodes, finished."""
    return finish(start_two_nodes(args, cwds))


def test_two_nodes_with_c10d_rendezvous_match_one_node(tmp_path):
    data = make_shards(tmp_path / "shards")
    run_trainer(base_args(data, tmp_path / "one_node"), nproc=2)

    nodes = run_two_nodes(base_args(data, tmp_path / "two_nodes"))
    outputs = [node.outputs for node in nodes]
    for node, (stdout, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, stdout[-2000:] + stderr[-4000:]
    assert "world size 2" in outputs[0][0] + outputs[1][0]

    assert train_losses(tmp_path / "two_nodes") == train_losses(tmp_path / "one_node")
    a, b = load_weights(tmp_path / "two_nodes", 6), load_weights(tmp_path / "one_node", 6)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_data_missing_on_one_node_stops_both_with_one_line(tmp_path):
    """A relative data_dir that exists on node 0 only: every rank fails the same way, exit 2. The job prints the
    error once (rank 0, on whichever node the rendezvous put it), and each node's torchrun report names it."""
    nodes_dirs = (tmp_path / "node0", tmp_path / "node1")
    make_shards(nodes_dirs[0] / "shards")
    nodes_dirs[1].mkdir()
    args = base_args("shards", tmp_path / "run")  # relative: resolved in each node's own cwd
    outputs = [node.outputs for node in run_two_nodes(args, nodes_dirs)]
    errors = [line for _, stderr in outputs for line in stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: data_dir shards: no such directory (prepare data first, e.g. `python prep/fineweb.py`)"], \
        outputs
    for _, stderr in outputs:
        assert "exitcode  : 2" in stderr and f"traceback : {errors[0]}" in stderr, stderr[-3000:]
        assert "train_gpt2.py\", line" not in stderr


def test_worker_killed_on_one_node_under_max_restarts_recovers_on_both(tmp_path):
    """torchrun counts a restart only on the agent whose worker failed: the other node's new worker
    has TORCHELASTIC_RESTART_COUNT 0, the failed node's 1. Both must still meet again and train on,
    exactly as a run that never failed."""
    data = make_shards(tmp_path / "shards", train_sizes=(6000, 5000, 8000))
    steps = dict(max_steps=STEPS, checkpoint_interval=3, eval_interval=0, val_tokens=64)
    run_trainer(base_args(data, tmp_path / "straight", **steps), nproc=2)

    out = tmp_path / "killed"
    nodes = start_two_nodes(base_args(data, out, **steps), torchrun_args=("--max-restarts=1",),
                            script="tests/inject_fault.py", extra_env={**slow_steps(SIGNAL_PAUSE), "PYTHONPATH": str(REPO)})
    try:
        wait_for_step(out, 7, nodes[0])  # past the step-6 checkpoint
        (worker,) = children(nodes[1].pid)
        os.kill(worker, signal.SIGKILL)  # node 1's GPU falls off the bus; node 0's agent sees only a peer leave
    finally:
        finish(nodes, timeout=180)
    for node in nodes:
        assert node.returncode == 0, node.outputs[0][-2000:] + node.outputs[1][-4000:]
    assert "resumed from" in nodes[0].outputs[0] + nodes[1].outputs[0]
    assert_same_run(out, tmp_path / "straight")
