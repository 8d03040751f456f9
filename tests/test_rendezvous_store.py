"""scripts/rendezvous_store.py: the rendezvous store slurm.sbatch keeps in a process of its own."""

from __future__ import annotations

import datetime
import signal
import sys
import time
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from conftest import REPO, background, signalled, wait_until
from slowness import guard
from forked_ranks import free_port

pytestmark = pytest.mark.slow  # starts a Python process


def start(port: int, **popen):
    """The store running for a `with` block (conftest's background)."""
    return background([sys.executable, str(REPO / "scripts" / "rendezvous_store.py"), "127.0.0.1", str(port)], cwd=None,
                      **popen)


def test_it_serves_until_sighup_ignores_sigterm_and_refuses_a_taken_port_in_one_line():
    port = free_port()
    with start(port) as store:
        client = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=guard(60)))
        client.set("k", "v")
        store.send_signal(signal.SIGTERM)  # scancel's: the agents still use the store while their workers save
        time.sleep(0.5)
        assert store.poll() is None and client.get("k") == b"v"

        with start(port) as second:
            _, stderr = second.communicate(timeout=guard(60))
        assert second.returncode == 2 and stderr.startswith(f"error: rendezvous store: cannot listen on 127.0.0.1:{port}")
        assert stderr.rstrip().endswith("set RDZV_PORT to a free port") and stderr.count("\n") == 1

        signalled(store, signal.SIGHUP, timeout=30)  # what slurm.sbatch sends once srun has returned
        assert store.returncode == 0


def test_a_sigint_while_it_imports_torch_stops_it_though_it_started_with_sigint_ignored():
    """A script's background command starts with SIGINT ignored, and the SIGINT that stops it (`kill -INT %1`)
    may come while the store still imports torch (seconds), when the script ends at once."""
    # the child ignores SIGINT as it execs the store, as one started by `python ... &` inherits it
    with start(free_port(), preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) as store:
        wait_until(lambda: "libtorch" in Path(f"/proc/{store.pid}/maps").read_text(), store,  # importing torch
                   "the store importing torch", 30)
        assert signalled(store, signal.SIGINT, timeout=20) == ("", "")
        assert store.returncode == 0
