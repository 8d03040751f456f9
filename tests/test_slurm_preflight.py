"""scripts/slurm_preflight.py, the health check slurm.sbatch runs on each node: each refusal in one line.

(tests/test_slurm.py runs it on a real two-node Slurm, where it passes; here, in this process, what
it refuses: no Slurm needed.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from common.errors import run_cli
from conftest import TINY_MODEL
from scripts import slurm_preflight


def preflight(monkeypatch, capfd, tmp_path, *, node_id=0, nodes=1, gpus_asked="", job="77", restarts=0, args=(),
              env=None, mounts="/dev/vda / ext4 rw 0 0", scratch=()) -> tuple[int, list[str]]:
    """Run the check as node `node_id` of `nodes` of start `restarts + 1` of job `job`; its exit status and its
    `error:` lines. The node's mount table is `mounts` and its scratch space `scratch` (not this machine's:
    tmp_path is in its /tmp)."""
    for name, value in {"SLURMD_NODENAME": f"n{node_id + 1}", "SLURM_NODEID": str(node_id),
                        "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_JOB_ID": job, "SLURM_RESTART_COUNT": str(restarts),
                        "SLURM_GPUS_ON_NODE": gpus_asked, "SLURM_GPUS_PER_NODE": "", **(env or {})}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(slurm_preflight, "SHARED_WAIT_S", 0.5)
    (tmp_path / "mounts").write_text(mounts + "\n")
    monkeypatch.setattr(slurm_preflight, "MOUNTS", tmp_path / "mounts")
    monkeypatch.setattr(slurm_preflight, "SCRATCH_ROOTS", tuple(map(Path, scratch)))
    status = run_cli(slurm_preflight.main, ["--workers_per_node", "1", *TINY_MODEL, "--out_dir", str(tmp_path / "run"),
                                            "--device", "cpu", *args])
    return status, [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]


def test_one_node_passes_and_leaves_only_its_record_of_the_job_in_out_dir(monkeypatch, capfd, tmp_path):
    assert preflight(monkeypatch, capfd, tmp_path) == (0, [])
    assert [path.name for path in (tmp_path / "run").iterdir()] == [slurm_preflight.RECORD]
    assert (tmp_path / "run" / slurm_preflight.RECORD).read_text() == "77\n"


def test_a_requeued_job_goes_on_only_where_its_earlier_start_left_its_record(monkeypatch, capfd, tmp_path):
    """Requeued onto a node whose out_dir is its own disk, the job would find neither checkpoints nor log, and
    start again from step 0: it stops instead, in one line."""
    status, errors = preflight(monkeypatch, capfd, tmp_path, restarts=1)  # nothing of start 1 is here
    assert status == 2 and len(errors) == 1
    assert errors[0].startswith(f"error: out_dir {tmp_path / 'run'}: job 77 was requeued (start 2), but this folder "
                                f"holds no record of its earlier start (.slurm-job: none)")
    assert "not starting the run over from step 0" in errors[0]

    assert preflight(monkeypatch, capfd, tmp_path) == (0, [])  # start 1 where start 2 finds it: it goes on there
    assert preflight(monkeypatch, capfd, tmp_path, restarts=1) == (0, [])

    assert preflight(monkeypatch, capfd, tmp_path, job="76") == (0, [])  # another job's first start, there
    status, errors = preflight(monkeypatch, capfd, tmp_path, restarts=2)
    assert status == 2 and len(errors) == 1 and "(start 3)" in errors[0] and "(.slurm-job: job 76's)" in errors[0]


@pytest.mark.parametrize("where,mounts,scratch,message", [
    ("memory", "/dev/vda / ext4 rw 0 0\ntmpfs {tmp} tmpfs rw 0 0", (), "in the memory (tmpfs)"),
    ("scratch", "/dev/vda / ext4 rw 0 0", ("{tmp}",), "in the scratch space ({tmp})"),
])
def test_one_node_refuses_an_out_dir_that_its_filesystem_says_is_the_nodes_own(monkeypatch, capfd, tmp_path, where,
                                                                               mounts, scratch, message):
    """No other node to meet: the mount table says a tmpfs, or the path says the node's /tmp."""
    tmp = str(tmp_path).replace(" ", "\\040")  # as the mount table writes a space
    status, errors = preflight(monkeypatch, capfd, tmp_path, mounts=mounts.format(tmp=tmp),
                               scratch=[s.format(tmp=tmp_path) for s in scratch])
    assert status == 2 and errors == [
        f"error: out_dir {tmp_path / 'run'}: {message.format(tmp=tmp_path)} of node n1: a requeue (the time limit, a "
        "preemption, a node failure) may start this job on another node, which would find neither its checkpoints "
        "nor its log; put it on a filesystem every node mounts"]


def test_node_local_dirs_names_the_sites_own_scratch_in_place_of_tmp():
    """A site whose nodes each have a /scratch adds it; a cluster of one machine, whose nodes share /tmp, leaves
    /tmp out; unset, /tmp and /var/tmp."""
    assert slurm_preflight.scratch_roots({}) == (Path("/tmp"), Path("/var/tmp"))
    assert slurm_preflight.scratch_roots({"NODE_LOCAL_DIRS": "/tmp:/var/tmp:/scratch"})[-1] == Path("/scratch")
    assert slurm_preflight.scratch_roots({"NODE_LOCAL_DIRS": "/var/tmp"}) == (Path("/var/tmp"),)


def test_the_jobs_tmpdir_is_node_local_too():
    """Sites point $TMPDIR at a folder of the job's own on the node's disk, emptied when the job ends: a one-node
    job's run there was lost to the requeue (which found no record and stopped)."""
    assert slurm_preflight.scratch_roots({"TMPDIR": "/local/job77"}) == (Path("/tmp"), Path("/var/tmp"),
                                                                         Path("/local/job77"))
    assert slurm_preflight.scratch_roots({"NODE_LOCAL_DIRS": "/scratch:$TMPDIR", "TMPDIR": "/local/job77"}) == (
        Path("/scratch"), Path("/local/job77"))  # named on the node, where the job's $TMPDIR is known
    assert slurm_preflight.scratch_roots({"NODE_LOCAL_DIRS": "/var/tmp", "TMPDIR": "/tmp/job77"}) == (
        Path("/var/tmp"),)  # a one-machine cluster's nodes share /tmp, and the $TMPDIR in it
    assert slurm_preflight.scratch_roots({"TMPDIR": ""}) == (Path("/tmp"), Path("/var/tmp"))


def test_one_node_refuses_an_out_dir_in_the_jobs_tmpdir(monkeypatch, capfd, tmp_path):
    status, errors = preflight(monkeypatch, capfd, tmp_path,
                               scratch=slurm_preflight.scratch_roots({"TMPDIR": str(tmp_path)}))
    assert status == 2 and len(errors) == 1
    assert errors[0].startswith(f"error: out_dir {tmp_path / 'run'}: in the scratch space ({tmp_path}) of node n1: ")


def test_a_node_local_root_reached_through_a_link_is_found(monkeypatch, capfd, tmp_path):
    """NODE_LOCAL_DIRS=/scratch where /scratch links to the node's disk: out_dir, resolved, is under the disk's
    path, which the root, unresolved, did not name."""
    (tmp_path / "disk").mkdir()
    (tmp_path / "scratch").symlink_to(tmp_path / "disk")
    status, errors = preflight(monkeypatch, capfd, tmp_path, scratch=[tmp_path / "scratch"],
                               args=("--out_dir", str(tmp_path / "scratch" / "run")))
    assert status == 2 and len(errors) == 1
    assert errors[0].startswith(f"error: out_dir {tmp_path / 'scratch' / 'run'}: in the scratch space "
                                f"({tmp_path / 'scratch'}) of node n1: ")
    status, errors = preflight(monkeypatch, capfd, tmp_path, scratch=[tmp_path / "disk"],  # a link into a root
                               args=("--out_dir", str(tmp_path / "scratch" / "run2")))
    assert status == 2 and f"in the scratch space ({tmp_path / 'disk'})" in errors[0]


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


@pytest.mark.parametrize("asked", ["a100:8", "8", "a100:4,h100:4"])
def test_a_gpu_count_with_its_type_is_read_as_its_number(monkeypatch, capfd, tmp_path, asked):
    """--gpus-per-node=a100:8 sets SLURM_GPUS_PER_NODE=a100:8 (SLURM_GPUS_ON_NODE is not always set)."""
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    status, errors = preflight(monkeypatch, capfd, tmp_path, env={"SLURM_GPUS_PER_NODE": asked})
    assert status == 2 and len(errors) == 1 and errors[0].startswith("error: node n1: sees 0 GPU(s)")


def test_a_gpu_count_that_is_no_number_is_one_line_naming_it(monkeypatch, capfd, tmp_path):
    status, errors = preflight(monkeypatch, capfd, tmp_path, env={"SLURM_GPUS_PER_NODE": "a100:many"})
    assert status == 2 and errors == ["error: SLURM_GPUS_PER_NODE=a100:many: not a GPU count ([type:]number, or "
                                      "several joined by commas)"]


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
