"""How much slower than the reference machine this one runs the suite: what every hang guard is scaled by.

Every timeout in the tests (pytest-timeout's per-test limit, a launch's or a subprocess's
timeout, a bound on how long a failure may take to surface) is a guard against a hang, never a
measurement. Each is written as the seconds it allows on the reference machine (a 2-core CPU of
CI's kind, where `make test` takes about 4 minutes), at least 5 times what the guarded work
takes there, and guard() multiplies it by slowness(): a machine 3x slower gets 3x the time, so
only a real hang reaches a guard.

slowness() is measured once per test run, in the process that starts pytest (conftest's
pytest_configure: calibrate()), and handed to the xdist workers and every process they start in
TEST_SLOWNESS; set TEST_SLOWNESS yourself to skip the measurement (TEST_SLOWNESS=4 make test).
"""

from __future__ import annotations

import os
import statistics
import time

ENV = "TEST_SLOWNESS"
# calibrate()'s workload on the reference machine (the fastest of many runs; a loaded machine takes longer)
REFERENCE_S = 0.062
# A hung test must still fail, with its stack, well inside CI's 90 minutes: the per-test guard
# (pyproject.toml's 300 s) is at most 30 minutes, however slow the machine looks.
MAX_SLOWNESS = 6.0


def workload() -> float:
    """Seconds for a fixed piece of what tests do: interpreted Python, and small single-threaded torch ops
    (the tiny model's steps are dominated by per-op overhead, not by arithmetic)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        total = 0
        for i in range(300_000):
            total += i * i % 7
        x = torch.ones(64, 64)
        for _ in range(2000):
            x = torch.tanh(x @ x * 0.01)
        return time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)


def calibrate(workers: int = 1) -> float:
    """This machine's slowness now: the median of 5 runs of workload() (about half a second) against the
    reference machine's, at least 1, times how many test workers share each core this process may use
    (the workload runs alone here, but under `taskset -c 0` two xdist workers share that one core)."""
    measured = statistics.median(workload() for _ in range(5))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    factor = max(1.0, measured / REFERENCE_S) * max(1.0, workers / cores)
    return round(min(factor, MAX_SLOWNESS), 2)


def slowness() -> float:
    """The factor this test run measured or was given (1 outside a test run: a helper used on its own)."""
    return max(float(os.environ.get(ENV, "1")), 1.0)


def guard(seconds: float) -> float:
    """A hang guard of `seconds` on the reference machine, for this one."""
    return seconds * slowness()
