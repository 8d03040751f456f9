"""The loop's data feed, and what a rollback does to it: go back to the newest good state, and read on past
the batches since.

A rollback is asked for by the step, on every rank alike (training/optim/spikes.py's RollbackRequested:
spikes in a row, a NaN/inf with rollback_on_nonfinite) or by a save that found non-finite weights
(training/checkpoint/checkpointer.py). The run's state becomes the checkpoint's (launch/resume.py's
roll_back), and the feed restarts at the data position that state says.
"""

from __future__ import annotations

from data.loader import Prefetcher
from training.checkpoint.checkpointer import Checkpointer
from runtime.context import Context
from launch.resume import roll_back
from training.run.run import Run
from training.optim.spikes import RollbackRequested


class Recovery:
    """Every rank holds one: `batches` feeds the steps from run.step to max_steps, read ahead on a thread."""

    def __init__(self, ctx: Context, run: Run, checkpointer: Checkpointer, max_steps: int, max_rollbacks: int):
        """max_steps: the schedule section's (where the feed ends); max_rollbacks: the long_run section's. A
        rollback goes back to the newest good checkpoint of the checkpointer's folder."""
        self.ctx, self.run, self.checkpointer = ctx, run, checkpointer
        self.max_steps, self.max_rollbacks = max_steps, max_rollbacks
        self.batches = self._read_ahead()

    def _read_ahead(self) -> Prefetcher:
        """The micro-batches of the steps from run.step on: step s reads data position s + data_offset."""
        run = self.run
        return Prefetcher(run.train_loader, run.step + run.data_offset, self.max_steps + run.data_offset,
                          self.ctx.runtime.device)

    def roll_back(self, request: RollbackRequested) -> None:
        """Every rank: continue from the newest good checkpoint, past the batches since (collective)."""
        self.checkpointer.wait(fail=False)  # a save in flight counts: it may be the newest good state
        self.batches.close()
        roll_back(self.ctx, self.run, request, self.checkpointer.folder, self.max_rollbacks)
        self.batches = self._read_ahead()

    def close(self) -> None:
        self.batches.close()
