"""A prep worker SIGKILLed half-way through sending its result back (prep's worker-pool tests only).

    python tests/dying_worker.py     # exit 0 if prep's pool raised its one-line error, 1 if not

Job 0's worker stops the parent process (SIGSTOP), so nothing reads the results; then it
returns 8 MB, far more than a pipe holds: its message is written in part and the worker blocks
on the rest. After 0.5 s it is killed, the message left half written, and after 1 s a helper
lets the parent go on (SIGCONT). The pool must end with prep's "a tokenizer worker process
died" error, not wait for the rest of that message forever.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def killed_while_sending() -> np.ndarray:
    parent = os.getppid()
    subprocess.Popen(["sh", "-c", f"sleep 1; kill -CONT {parent}"], start_new_session=True)
    os.kill(parent, signal.SIGSTOP)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
    return np.zeros(4 << 20, dtype=np.uint16)  # 8 MB


def small() -> np.ndarray:
    return np.zeros(10, dtype=np.uint16)


if __name__ == "__main__":
    from common.errors import ReproError
    from prep import fineweb

    jobs = [(0, killed_while_sending, ()), *((k, small, ()) for k in range(1, 6))]
    try:
        for _, get in fineweb.in_order(iter(jobs), 2):
            get()
    except ReproError as e:
        print(f"raised: {e}")
        sys.exit(0 if "worker process died" in str(e) else 1)
    print("no error: every job's result came back")
    sys.exit(1)
