"""SIGTERM / SIGUSR1 (what SLURM and cloud schedulers send before a kill) become a flag, and a stop.

The handler only sets the flag (`PreemptionFlag`): the ranks agree on it at the next step
boundary (it rides on the per-step loss all-reduce), and `StopVote` then saves the state and
lets every rank exit cleanly.
"""

from __future__ import annotations

import signal

from training.distributed.process_group import any_rank


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


class StopVote:
    """When the ranks stop for a signal: the flag of each, agreed on by all. Every rank holds one.

    The step carries the vote on its one all-reduce (training/train/lockstep.py); between evaluations
    it costs one all-reduce of its own (`agree`), so a signal that arrives mid-eval skips the rest.
    Once the ranks agreed, `agreed` stays set and the loop saves and leaves (`exit`).
    """

    def __init__(self, flag: PreemptionFlag, env):
        self.flag, self.env = flag, env
        self.agreed = False

    @property
    def requested(self) -> bool:
        """This rank's flag: its vote at the next step."""
        return self.flag.requested

    def agree(self) -> bool:
        """Whether any rank was asked to stop. Collective."""
        return any_rank(self.flag.requested, self.env)

    def note(self, agreed: bool) -> None:
        """The ranks' decision (a step's vote, or the evaluations'), the same on every rank."""
        self.agreed = self.agreed or agreed

    def exit(self, run, checkpointer, logger, hint: str) -> None:
        """Save the state (unless nothing changed since the launch or the rollback) and say how to go on."""
        signal_name = self.flag.signal_name or "a stop signal (on another rank)"
        if run.step == run.start_step:
            logger.console(f"{signal_name} received before the first step; nothing new to save")
            return
        checkpointer.save_before_exit(run)  # written in full before the process exits
        logger.console(f"{signal_name} received: saved step {run.step}; {hint}")
