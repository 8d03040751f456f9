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
    other nodes (the checkpoints stay behind).
Exit 0 when all hold; 2 (an `error:` line) when one does not.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.errors import ArgumentParser, ConfigError, run_cli  # noqa: E402
from training.checkpoint.folder import checkpoints_folder  # noqa: E402
from training.core.storage import is_url  # noqa: E402
from launch.config import parse_args  # noqa: E402

SHARED_WAIT_S = float(os.environ.get("PREFLIGHT_SHARED_WAIT_S", 120))  # a network filesystem's caches may lag


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="slurm_preflight.py", description=__doc__)
    parser.add_argument("--workers_per_node", type=int, required=True,
                        help="torchrun's --nproc_per_node (GPUS_PER_NODE in scripts/slurm.sbatch)")
    args, trainer_args = parser.parse_known_args(argv)  # the rest: the trainer's own arguments
    workers = args.workers_per_node
    cfg = parse_args(trainer_args)
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    gpus_here = int(os.environ.get("SLURM_GPUS_ON_NODE") or os.environ.get("SLURM_GPUS_PER_NODE") or 0)
    if cfg.runtime.device == "cuda" or gpus_here:
        check_gpus(node, workers)
    node_id, nodes = int(os.environ.get("SLURM_NODEID", 0)), int(os.environ.get("SLURM_JOB_NUM_NODES", 1))
    attempt = f"{os.environ.get('SLURM_JOB_ID', os.getpid())}.{os.environ.get('SLURM_RESTART_COUNT', 0)}"
    out_dir = cfg.run.out_dir
    folders = [("out_dir", Path(out_dir))]
    checkpoints = checkpoints_folder(out_dir, cfg.checkpoint.checkpoint_dir)
    if not is_url(checkpoints) and Path(out_dir).resolve() not in Path(checkpoints).resolve().parents:
        folders.append(("checkpoint_dir", Path(checkpoints)))
    for key, folder in folders:
        check_shared(key, folder, node, node_id, nodes, attempt)
    if node_id == 0:
        print(f"preflight: {nodes} node(s) | {workers} worker(s) each | "
              + ", ".join(f"{key} {folder} shared" for key, folder in folders), flush=True)
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
    missing = wait_for(meeting, "wrote", nodes)
    if missing:
        raise ConfigError(f"{key} {folder}: not shared between the job's nodes: node {node} sees no file from "
                          f"node(s) {', '.join(map(str, missing))} after {SHARED_WAIT_S:.0f} s; put it on a "
                          f"filesystem every node mounts")
    (meeting / f"saw_{node_id}").write_text(node)
    if node_id == 0:
        wait_for(meeting, "saw", nodes)
        shutil.rmtree(meeting, ignore_errors=True)


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
