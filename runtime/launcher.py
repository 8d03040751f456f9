"""What a worker knows of the launcher that started it: whether it is torchrun's, and ending when it dies.

This module imports nothing but the standard library: an entry point calls
`stop_when_launcher_dies` before it imports torch, which takes seconds.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def under_torchrun() -> bool:
    """A worker of torchrun's agent (a variable the agent sets for its workers only)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def stop_when_launcher_dies() -> None:
    """Under torchrun on Linux, ask the kernel for a SIGTERM when the launcher dies (the parent-death signal).

    torchrun's agent starts each worker as its own child (subprocess.Popen, in a session of its
    own) and forwards only the signals named in --signals-to-handle; any other fatal signal
    (SIGUSR1 by default, a SIGKILL) ends the agent at once and would leave its workers running as
    orphans: training on, or waiting for the agent's store that is gone, and holding their GPUs
    from the next launch. With this, a worker whose launcher is gone gets SIGTERM at once: before
    the trainer handles SIGTERM (start-up: nothing to save yet) it ends the process there and
    then; once it handles it, the stop is a preemption's: the ranks save at the next step and
    exit, through their process group, which needs no store.

    The request holds from the moment it is made, so an entry point makes it first of all, before
    its imports. A launcher killed in the milliseconds before that leaves the worker to find out
    otherwise: the store the launcher hosted refuses the worker's connection at start-up
    (runtime/process_group.py). Calling it again is harmless. A plain `python train_gpt2.py`
    asks for nothing: its parent is the user's shell, whose end must not stop a run (nohup).
    """
    if not sys.platform.startswith("linux") or not under_torchrun():
        return
    # a failure (no libc) only loses the orphan protection
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
