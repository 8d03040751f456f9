"""The health check scripts/slurm.sbatch runs on every node before it starts torchrun there.

    srun --ntasks-per-node=1 python scripts/slurm_preflight.py --workers_per_node 8 --config configs/x.yaml ...

Everything after --workers_per_node N (torchrun's --nproc_per_node) is the trainer's own
arguments. On each node (one task per node, under srun) it checks, and fails the job with one
`error:` line naming the node if not:
  - the configuration: the trainer's own parsing, so a bad key stops the job before any launch;
  - the GPUs, when the job asked Slurm for some (--gpus-per-node, --gres) or the config says
    device cuda: this node sees at least N, one per worker (a CPU partition: nothing to check);
  - the run folder (out_dir, and checkpoint_dir when it is a path elsewhere): writable here, and
    shared: every node writes a file into it and waits until it sees every other node's. A folder
    on a node's local disk would otherwise pass the first launch and fail at the first sharded
    checkpoint (each rank's part lands where rank 0 cannot see it), or at the first requeue onto
    other nodes (the checkpoints stay behind). A job of one node has no other node to meet: there
    the folder's filesystem tells, and one in the node's memory (tmpfs) or its scratch space
    (/tmp, /var/tmp and the job's $TMPDIR, emptied when the job ends; or NODE_LOCAL_DIRS), each
    root resolved as the folder is (a link to the node's disk), is refused, since a requeue may
    start the job on another node, or find the folder emptied;
  - a requeued job (SLURM_RESTART_COUNT above 0) in the run folder its earlier start used: node 0
    records the job id in each folder (RECORD) first, once it has read the config, and a requeued
    start that finds another job's record, or none, stops rather than start the run over from
    step 0 where the earlier start's checkpoints cannot be seen. (A start that ended before its
    record, in its first seconds, leaves none: the next one stops too, and the job is submitted
    again.)
Exit 0 when all hold; 2 (an `error:` line) when one does not.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.errors import ArgumentParser, ConfigError, run_cli  # noqa: E402
from training.checkpoint.folder import checkpoints_folder  # noqa: E402
from runtime.storage import is_url  # noqa: E402
from launch.config import parse_args  # noqa: E402

SHARED_WAIT_S = float(os.environ.get("PREFLIGHT_SHARED_WAIT_S", 120))  # a network filesystem's caches may lag
RECORD = ".slurm-job"  # in each run folder: the id of the job that last started there
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")  # a node's memory: no other node sees them, and a reboot empties them


def scratch_roots(environ) -> tuple[Path, ...]:
    """Each node's own scratch space: /tmp, /var/tmp and the job's $TMPDIR, or the site's folders that
    NODE_LOCAL_DIRS names (colon-separated, in their place: `/tmp:/var/tmp:/scratch:$TMPDIR` where every node has
    its own /scratch, or `/var/tmp` where the nodes of a one-machine cluster share its /tmp). Sites point $TMPDIR at
    a folder of the job's own on the node (/tmp/job77, /local/job77) that is emptied when the job ends, so that a
    requeue finds nothing there even on the same node; an entry `$TMPDIR` (written so, expanded here, on the node)
    names it, and is left out where the job has none."""
    entries = environ.get("NODE_LOCAL_DIRS", "/tmp:/var/tmp:$TMPDIR").split(":")
    return tuple(Path(p) for p in (environ.get("TMPDIR", "") if e == "$TMPDIR" else e for e in entries) if p)


SCRATCH_ROOTS = scratch_roots(os.environ)
MOUNTS = Path("/proc/self/mounts")


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="slurm_preflight.py", description=__doc__)
    parser.add_argument("--workers_per_node", type=int, required=True,
                        help="torchrun's --nproc_per_node (GPUS_PER_NODE in scripts/slurm.sbatch)")
    args, trainer_args = parser.parse_known_args(argv)  # the rest: the trainer's own arguments
    workers = args.workers_per_node
    cfg = parse_args(trainer_args)
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    node_id, nodes = int(os.environ.get("SLURM_NODEID", 0)), int(os.environ.get("SLURM_JOB_NUM_NODES", 1))
    job, restarts = os.environ.get("SLURM_JOB_ID", str(os.getpid())), int(os.environ.get("SLURM_RESTART_COUNT", 0))
    out_dir = cfg.run.out_dir
    folders = [("out_dir", Path(out_dir))]
    checkpoints = checkpoints_folder(out_dir, cfg.checkpoint.checkpoint_dir)
    if not is_url(checkpoints) and Path(out_dir).resolve() not in Path(checkpoints).resolve().parents:
        folders.append(("checkpoint_dir", Path(checkpoints)))
    if node_id == 0:  # first, before the checks that take time (a start stopped during them has left its record)
        for key, folder in folders:
            record_start(key, folder, node, job, restarts)
    if cfg.runtime.device == "cuda" or gpus_asked():
        check_gpus(node, workers)
    for key, folder in folders:
        check_shared(key, folder, node, node_id, nodes, f"{job}.{restarts}")
        if nodes == 1:
            check_not_node_local(key, folder, node)
    if node_id == 0:
        print(f"preflight: {nodes} node(s) | {workers} worker(s) each | "
              + ", ".join(f"{key} {folder} shared" for key, folder in folders), flush=True)
    return 0


def gpus_asked() -> int:
    """The GPUs the job asked Slurm for on this node (0: none): SLURM_GPUS_ON_NODE, else --gpus-per-node's
    SLURM_GPUS_PER_NODE, whose count may come with its type (a100:8), or be one per type (a100:4,h100:4)."""
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        if value := os.environ.get(name, ""):
            try:
                return sum(int(item.rsplit(":", 1)[-1]) for item in value.split(","))
            except ValueError:
                raise ConfigError(f"{name}={value}: not a GPU count ([type:]number, or several joined by "
                                  f"commas)") from None
    return 0


def check_gpus(node: str, wanted: int) -> None:
    import torch

    found = torch.cuda.device_count()
    if found < wanted:
        raise ConfigError(f"node {node}: sees {found} GPU(s) but the job starts {wanted} workers per node "
                          f"(GPUS_PER_NODE): check the node's GPUs (nvidia-smi), --gpus-per-node and "
                          f"CUDA_VISIBLE_DEVICES")


def check_shared(key: str, folder: Path, node: str, node_id: int, nodes: int, attempt: str) -> None:
    """Every node writes `wrote_<id>` into folder/.preflight-<attempt>, then waits to see all the others';
    node 0 removes the folder once every node has said it saw them all (`saw_<id>`)."""
    meeting = folder / f".preflight-{attempt}"
    try:
        meeting.mkdir(parents=True, exist_ok=True)
        (meeting / f"wrote_{node_id}").write_text(node)
    except OSError as e:
        raise ConfigError(f"{key} {folder}: not writable on node {node} ({e.strerror or e})") from None
    if missing := wait_for(meeting, "wrote", nodes):
        raise ConfigError(f"{key} {folder}: not shared between the job's nodes: node {node} sees no file from "
                          f"node(s) {', '.join(map(str, missing))} after {SHARED_WAIT_S:.0f} s; put it on a "
                          f"filesystem every node mounts")
    (meeting / f"saw_{node_id}").write_text(node)
    if node_id == 0:
        wait_for(meeting, "saw", nodes)
        shutil.rmtree(meeting, ignore_errors=True)


def check_not_node_local(key: str, folder: Path, node: str) -> None:
    """A job of one node meets no other node in folder: refuse a folder that its filesystem says is this node's own."""
    if where := node_local(folder):
        raise ConfigError(f"{key} {folder}: {where} of node {node}: a requeue (the time limit, a preemption, a node "
                          f"failure) may start this job on another node, which would find neither its checkpoints "
                          f"nor its log; put it on a filesystem every node mounts")


def node_local(folder: Path) -> str | None:
    """Where folder (an existing one) is this node's own and no other's, in words: in its memory (a tmpfs), or in
    its scratch space (/tmp); None where its filesystem does not say."""
    path = folder.resolve()
    filesystem = filesystem_of(path)
    if filesystem in MEMORY_FILESYSTEMS:
        return f"in the memory ({filesystem})"
    # each root resolved as the folder is: /scratch a link to the node's disk (or macOS's /tmp to /private/tmp)
    # holds a folder whose resolved path no longer starts with /scratch
    roots = [(root, root.resolve()) for root in SCRATCH_ROOTS]
    holding = [(root, resolved) for root, resolved in roots if resolved == path or resolved in path.parents]
    if not holding:
        return None
    root, _ = max(holding, key=lambda pair: len(pair[1].parts))  # the nearest: the job's $TMPDIR, not the /tmp it is in
    return f"in the scratch space ({root})"


def filesystem_of(path: Path) -> str | None:
    """The type of the filesystem path (resolved) is on, from the mount table: its longest mount point that holds
    it (None where there is no mount table to read)."""
    try:
        lines = MOUNTS.read_text().splitlines()
    except OSError:
        return None
    found, longest = None, -1
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        # the mount table writes a space in a mount point as \040 (and a tab, newline, backslash alike)
        point = Path(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1]))
        if (point == path or point in path.parents) and len(point.parts) >= longest:
            found, longest = fields[2], len(point.parts)  # the later of two at one point is the one on top
    return found


def record_start(key: str, folder: Path, node: str, job: str, restarts: int) -> None:
    """Node 0: record this start of the job in folder, once a requeued start has found its earlier start's record
    there. Without one, this is not where that start wrote, and its checkpoints are elsewhere: going on would
    start the run over from step 0."""
    record = folder / RECORD
    if restarts:
        try:
            recorded = record.read_text().strip()
        except OSError:
            recorded = ""
        if recorded != job:
            found = f"job {recorded}'s" if recorded else "none"
            raise ConfigError(f"{key} {folder}: job {job} was requeued (start {restarts + 1}), but this folder holds "
                              f"no record of its earlier start ({RECORD}: {found}): it is not the folder that start "
                              f"wrote to (a node's own disk? that start's checkpoints stay there, on the node this "
                              f"log names for start {restarts}), or that start ended within its first seconds, before "
                              f"its health check read the config; not starting the run over from step 0: put {key} "
                              f"on a filesystem every node mounts, or submit the job again")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        record.write_text(f"{job}\n")
    except OSError as e:
        raise ConfigError(f"{key} {folder}: not writable on node {node} ({e.strerror or e})") from None


def wait_for(meeting: Path, kind: str, nodes: int) -> list[int]:
    """The node ids whose `<kind>_<id>` file has not appeared within SHARED_WAIT_S (empty: all there)."""
    deadline = time.monotonic() + SHARED_WAIT_S
    while True:
        missing = [i for i in range(nodes) if not (meeting / f"{kind}_{i}").exists()]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(run_cli(main))
