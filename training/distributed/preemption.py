"""SIGTERM / SIGUSR1 (what SLURM and cloud schedulers send before a kill) and SIGINT (Ctrl-C) become a flag,
and a stop.

The handler only sets the flag (`PreemptionFlag`): the ranks agree on it at the next step
boundary (it rides on the per-step loss all-reduce), and `StopVote` then saves the state and
lets every rank exit cleanly. Ctrl-C does the same, so an interactive run keeps its work like a
preempted one; a second Ctrl-C, for a user who will not wait for the step and the save, stops
at once (`StopNow`, a KeyboardInterrupt: no `except Exception` on the way catches it), saving nothing.
"""

from __future__ import annotations

import os
import signal
import sys

from runtime.launcher import under_torchrun
from runtime.process_group import any_rank


class StopNow(KeyboardInterrupt):
    """A second SIGINT: stop at once, without the checkpoint the first one asked for (run_cli prints it)."""


class PreemptionFlag:
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self, announce: bool = False):
        """announce: say at once, on stderr, what a Ctrl-C will do (rank 0: one line for the whole run)."""
        self.signal_name: str | None = None
        self.announce = announce
        self.interrupts = 0  # SIGINTs so far
        self._previous = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum, frame) -> None:
        self.signal_name = self.signal_name or signal.Signals(signum).name  # the first one names the stop
        if self.interrupts and signum == signal.SIGINT:
            raise StopNow("a second SIGINT stops at once: nothing was saved since the last checkpoint")
        if self.interrupts and signum == signal.SIGTERM and under_torchrun():
            # The terminal's Ctrl-C reaches torchrun, which forwards one SIGINT to each worker; at a second one it
            # sends them SIGTERM (and SIGKILL 30 s later). A worker cannot tell that SIGTERM from a preemption's,
            # but after a Ctrl-C it is the user's second, and torchrun waits for the workers before it exits.
            raise StopNow("a second Ctrl-C (torchrun's SIGTERM after its SIGINT) stops at once: nothing was saved "
                          "since the last checkpoint")
        if signum != signal.SIGINT:
            return
        self.interrupts += 1
        if self.announce:  # a step, an eval and the save may take a while: say so now
            # os.write, not print: a handler that prints while the main thread is inside a print raises
            os.write(sys.stderr.fileno(), b"SIGINT received: saving a checkpoint after this step "
                                          b"(Ctrl-C again stops at once, without saving)\n")

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

    The step carries the vote on its one all-reduce (training/run/lockstep.py); between evaluations
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
        if run.step == run.start_step:  # the state loaded (or the fresh start): what is on storage goes on
            logger.console(f"{signal_name} received with no new step to save; {hint}")
            return
        checkpointer.save_before_exit(run)  # written in full before the process exits
        logger.console(f"{signal_name} received: saved step {run.step}; {hint}")
