"""scripts/rendezvous_store.py: the rendezvous store slurm.sbatch keeps in a process of its own."""

from __future__ import annotations

import datetime
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from conftest import REPO, wait_until
from slowness import guard
from forked_ranks import free_port

pytestmark = pytest.mark.slow  # starts a Python process


def start(port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(REPO / "scripts" / "rendezvous_store.py"), "127.0.0.1", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_it_serves_until_sighup_ignores_sigterm_and_refuses_a_taken_port_in_one_line():
    port = free_port()
    store = start(port)
    try:
        client = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=guard(60)))
        client.set("k", "v")
        store.send_signal(signal.SIGTERM)  # scancel's: the agents still use the store while their workers save
        time.sleep(0.5)
        assert store.poll() is None and client.get("k") == b"v"

        second = start(port)
        _, stderr = second.communicate(timeout=guard(60))
        assert second.returncode == 2 and stderr.startswith(f"error: rendezvous store: cannot listen on 127.0.0.1:{port}")
        assert stderr.rstrip().endswith("set RDZV_PORT to a free port") and stderr.count("\n") == 1

        store.send_signal(signal.SIGHUP)  # what slurm.sbatch sends once srun has returned
        assert store.wait(timeout=guard(30)) == 0
    finally:
        if store.poll() is None:
            store.kill()
        store.communicate()


def test_a_sigint_while_it_imports_torch_stops_it_though_it_started_with_sigint_ignored():
    """A script's background command starts with SIGINT ignored, and the SIGINT that stops it (`kill -INT %1`)
    may come while the store still imports torch (seconds), when the script ends at once."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # what the child inherits, as from `python ... &`
    try:
        store = start(free_port())
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        wait_until(lambda: "libtorch" in Path(f"/proc/{store.pid}/maps").read_text(), store,  # importing torch
                   "the store importing torch", 30)
        store.send_signal(signal.SIGINT)
        assert store.wait(timeout=guard(20)) == 0
        assert store.communicate() == ("", "")
    finally:
        if store.poll() is None:
            store.kill()
        store.communicate()
