"""scripts/slurm_preflight.py, the health check slurm.sbatch runs on each node: each refusal in one line.

(tests/test_slurm.py runs it on a real two-node Slurm, where it passes; here, in this process, what
it refuses: no Slurm needed.)
"""

from __future__ import annotations

import pytest

from common.errors import run_cli
from conftest import TINY_MODEL
from scripts import slurm_preflight


def preflight(monkeypatch, capfd, tmp_path, *, node_id=0, nodes=1, gpus_asked="", args=()) -> tuple[int, list[str]]:
    """Run the check as node `node_id` of `nodes`; its exit status and its `error:` lines."""
    for name, value in {"SLURMD_NODENAME": f"n{node_id + 1}", "SLURM_NODEID": str(node_id),
                        "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0",
                        "SLURM_GPUS_ON_NODE": gpus_asked}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(slurm_preflight, "SHARED_WAIT_S", 0.5)
    status = run_cli(slurm_preflight.main, ["--workers_per_node", "1", *TINY_MODEL, "--out_dir", str(tmp_path / "run"),
                                            "--device", "cpu", *args])
    return status, [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]


def test_one_node_passes_and_leaves_nothing_in_out_dir(monkeypatch, capfd, tmp_path):
    assert preflight(monkeypatch, capfd, tmp_path) == (0, [])
    assert list((tmp_path / "run").iterdir()) == []


def test_an_out_dir_that_the_other_nodes_do_not_see_is_refused_naming_it(monkeypatch, capfd, tmp_path):
    """Node 1 of 2 writes its file and never sees node 0's: out_dir is on a disk of its own."""
    status, errors = preflight(monkeypatch, capfd, tmp_path, node_id=1, nodes=2)
    assert status == 2 and len(errors) == 1
    assert errors[0].startswith(f"error: out_dir {tmp_path / 'run'}: not shared between the job's nodes: node n2 sees "
                                "no file from node(s) 0 after 0 s")


def test_an_out_dir_that_cannot_be_written_is_refused_naming_it(monkeypatch, capfd, tmp_path):
    (tmp_path / "file").write_text("")
    status, errors = preflight(monkeypatch, capfd, tmp_path, args=("--out_dir", str(tmp_path / "file" / "run")))
    assert status == 2 and errors == [f"error: out_dir {tmp_path / 'file' / 'run'}: not writable on node n1 "
                                      "(Not a directory)"]


def test_a_job_that_asked_for_gpus_on_a_node_that_sees_none_is_refused(monkeypatch, capfd, tmp_path):
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    status, errors = preflight(monkeypatch, capfd, tmp_path, gpus_asked="8")
    assert status == 2 and len(errors) == 1 and errors[0].startswith(
        "error: node n1: sees 0 GPU(s) but the job starts 1 workers per node (GPUS_PER_NODE)")


def test_a_bad_trainer_key_is_refused_before_any_launch(monkeypatch, capfd, tmp_path):
    status, errors = preflight(monkeypatch, capfd, tmp_path, args=("--max_lrr", "1"))
    assert status == 2 and len(errors) == 1 and errors[0].startswith("error: max_lrr: unknown config key")


@pytest.mark.parametrize("argv,message", [
    ([], "the following arguments are required: --workers_per_node"),
    (["--config", "x.yaml"], "the following arguments are required: --workers_per_node"),
    (["--workers_per_node", "x"], "argument --workers_per_node: invalid int value: 'x'"),
])
def test_a_call_without_its_workers_per_node_is_one_line(capfd, argv, message):
    assert run_cli(slurm_preflight.main, argv) == 2
    assert capfd.readouterr().err == f"error: slurm_preflight.py: {message} (see --help)\n"
