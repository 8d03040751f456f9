"""SIGTERM / SIGUSR1 (what SLURM and cloud schedulers send before a kill) become a flag.

The handler only sets the flag: the ranks agree on it at the next step boundary (it rides
on the per-step loss all-reduce), rank 0 writes a checkpoint and every rank exits cleanly.
"""

from __future__ import annotations

import signal


class PreemptionFlag:
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.signal_name: str | None = None
        self._previous = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name

    def install(self) -> "PreemptionFlag":
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
