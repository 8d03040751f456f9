"""The c10d rendezvous store of a multi-node torchrun, in a process of its own (scripts/slurm.sbatch runs it).

    python scripts/rendezvous_store.py HOST PORT &        # on the first node, before torchrun
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT \
        --rdzv_conf=is_host=false --rdzv_id=gpt2-124m train_gpt2.py      # on every node
    kill -INT %1                                          # once every node's torchrun is done

By default the torchrun agent on the endpoint's host keeps the store in its own process, and it
exits as soon as its own part is done: an agent on another node, still in torchrun's exit barrier
or closing the rendezvous, then loses the store mid-call and prints an "Error waiting on exit
barrier" traceback, although every worker exited 0. A store that outlives every agent ends a job
quietly. It holds only the rendezvous's state (a few small keys); no training data goes through it.

It runs until SIGINT or SIGHUP, then exits 0, whenever the signal comes: while it imports torch
too (seconds), so a script that stops it early does not leave it holding its port. (A script starts
a background command with SIGINT ignored, so one sent before Python has started is lost; nothing
ignores SIGHUP, whose default ends the process before that too: slurm.sbatch sends SIGHUP.) A
port already taken is one `error:` line, exit 2. SIGTERM is ignored: `scancel` sends it to every
process of the job at once, and the agents, which got it too, still use the store while their
workers save a checkpoint (Slurm's SIGKILL after KillWait ends it).
"""

from __future__ import annotations

import signal
import sys


def stop(signum, frame):
    raise SystemExit(0)


def handle_signals() -> None:
    """SIGINT and SIGHUP stop the store, SIGTERM is ignored (the docstring says why). Only as a script: an
    import (a test reading main's arguments) must not leave its importer ignoring SIGTERM, which every process
    it starts would inherit."""
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, stop)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


# First of all, before the imports: a script starts a background command with SIGINT ignored, which Python
# keeps, so a SIGINT sent before a handler of its own is installed would be lost.
if __name__ == "__main__":
    handle_signals()

import datetime  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.errors import ArgumentParser, ConfigError, run_cli  # noqa: E402


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="rendezvous_store.py", description=__doc__)
    parser.add_argument("host", help="the address torchrun's --rdzv_endpoint names (this node's)")
    parser.add_argument("port", type=int, help="its port")
    args = parser.parse_args(argv)
    host, port = args.host, args.port
    from torch.distributed import TCPStore

    try:
        # wait_for_workers=False: clients come and go (the agents, a requeued job's next ones are another store)
        store = TCPStore(host, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                         timeout=datetime.timedelta(minutes=30))
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"rendezvous store: cannot listen on {host}:{port} ({str(e).splitlines()[0]}); "
                          f"set RDZV_PORT to a free port") from None
    try:
        while True:
            signal.pause()  # the store serves from its own threads until SIGINT or SIGHUP (stop)
    finally:
        del store  # its port closes now


if __name__ == "__main__":
    sys.exit(run_cli(main))
