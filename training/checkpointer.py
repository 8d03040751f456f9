"""Writing a run's checkpoints: the format the config picks, at most one save in flight.

- file: rank 0 writes `step_X.pt` (the run's state gathered onto its CPU under FSDP) before
  training goes on.
- sharded: every rank writes its part of `step_X/` (training/sharded_checkpoint.py); with
  `checkpoint_async` the loop is blocked only while the state is copied to host memory, and
  the files are written in the background.

A checkpoint counts as written (for the lineage, for retention, for "newest readable") only
once it is complete: rank 0 then writes its commit file and prunes older checkpoints. Rank 0
commits a finished background save as soon as it notices (`poll`, a look at a Future after
each step, no collective); every rank waits for the save in flight before the next save, and
before the process ends (`wait`, collective), which is also where a failed write stops every
rank with one line.
"""

from __future__ import annotations

import datetime
import time
import uuid
from dataclasses import dataclass

from errors import CheckpointWriteError, ReproError, first_line
from training import sharded_checkpoint as sharded
from training.checkpoint import (FORMAT_VERSION, checkpoint_path, checkpoints_folder, prune_checkpoints,
                                 save_checkpoint)
from training.config import TrainConfig
from training.distributed import DistEnv, run_on_all_ranks
from training.run import Run
from training.run_logger import RunLogger
from training.storage import Location


@dataclass
class PendingSave:
    path: Location
    step: int
    metadata: dict  # the commit file's entries
    future: object | None  # concurrent.futures.Future of an asynchronous save; None once written
    started: float
    committed: bool = False
    error: Exception | None = None  # rank 0's poll saw the save fail; raised at the next wait


class Checkpointer:
    """Every rank holds one; `save` and `wait` are collectives, `poll` is not."""

    def __init__(self, cfg: TrainConfig, env: DistEnv, logger: RunLogger, provenance: dict):
        self.cfg, self.env, self.logger, self.provenance = cfg, env, logger, provenance
        self.folder = checkpoints_folder(cfg.out_dir, cfg.checkpoint_dir)
        self.sharded = cfg.resolved_checkpoint_format() == "sharded"
        self.asynchronous = self.sharded and cfg.checkpoint_async
        self.pending: PendingSave | None = None
        self.process_group = None
        if self.asynchronous and env.distributed:
            # the background write's collectives must not interleave with the training's
            import torch.distributed as dist

            self.process_group = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(minutes=cfg.hang_timeout_minutes))

    def save(self, run: Run, blocking: bool = False) -> None:
        """Checkpoint `step_{run.step}`. Collective: every rank calls it at the same step.

        blocking: written and committed on return, also where saves are asynchronous. For the
        saves the process exits after (the last step, a preemption): a background write that is
        waited for at once costs its copy to host memory on top of the same write.
        """
        self.wait()  # at most one save in flight (and the previous one's failure stops every rank now)
        metadata = {**run.progress_state(), **checkpoint_metadata(run, self.cfg, self.provenance)}
        if not self.sharded:
            self._save_file(run, metadata)
            return
        path = checkpoint_path(self.folder, run.step, sharded_format=True)
        started = time.perf_counter()
        asynchronous = self.asynchronous and not blocking
        group = self.process_group if asynchronous else None
        future = run_on_all_ranks(self.env, lambda: sharded.start_save(
            run.model, run.optimizer, path, asynchronous, group),
            describe=lambda e: self._write_error(path, e))
        self.pending = PendingSave(path, run.step, metadata, future, started)
        if asynchronous:
            self.logger.console(f"saving checkpoint {path} in the background "
                                f"(training blocked {time.perf_counter() - started:.2f} s)")
        else:
            self.wait()

    def poll(self) -> None:
        """After a step: rank 0 commits a background save that has finished. Not a collective."""
        pending = self.pending
        if (not self.env.master_process or pending is None or pending.committed or pending.error is not None
                or pending.future is None or not pending.future.done()):
            return
        try:
            pending.future.result()
            self._commit(pending)
        except Exception as e:  # noqa: BLE001 - kept for wait(), which stops every rank with it
            pending.error = e

    def wait(self) -> None:
        """Every rank waits for the save in flight to be written, and rank 0 commits it. Collective."""
        pending, self.pending = self.pending, None
        if pending is None:
            return

        def finish() -> None:
            if pending.error is not None:
                raise pending.error
            if pending.future is not None:
                pending.future.result()  # this rank's part (on rank 0: every part, and DCP's index)
            if self.env.master_process and not pending.committed:
                self._commit(pending)

        run_on_all_ranks(self.env, finish, describe=lambda e: self._write_error(pending.path, e))

    def close(self, timeout_s: float = 300.0) -> None:
        """Not a collective: after a failure, a save still in flight gets timeout_s to finish, and
        counts (rank 0 commits it) if it does. Normal exits have waited already."""
        pending, self.pending = self.pending, None
        if pending is None or pending.future is None or pending.error is not None or pending.committed:
            return
        try:
            pending.future.result(timeout=timeout_s)
            if self.env.master_process:
                self._commit(pending, check_log=False)
        except Exception as e:  # noqa: BLE001 - the run is already failing with its own error
            self.logger.warn(f"the checkpoint save in flight did not finish ({first_line(e)}); "
                             f"{pending.path} is incomplete and will not be used")

    def _commit(self, pending: PendingSave, check_log: bool = True) -> None:
        """rank 0: the checkpoint is complete from here on; then older ones are pruned."""
        if check_log:
            self.logger.check()  # a log that could not be written stops the run before a checkpoint counts
        sharded.commit(pending.path, pending.metadata)
        pending.committed = True
        prune_checkpoints(self.folder, self.cfg.keep_last, written_step=pending.step, warn=self.logger.warn)
        self.logger.console(f"saved checkpoint {pending.path} ({time.perf_counter() - pending.started:.2f} s)")

    def _save_file(self, run: Run, metadata: dict) -> None:
        state = run.state_dict()  # gathered onto rank 0 under FSDP

        def write() -> None:
            if not self.env.master_process:
                return
            self.logger.check()  # a log that could not be written stops the run before anything else
            path = checkpoint_path(self.folder, run.step)
            save_checkpoint({**state, **metadata}, path)
            prune_checkpoints(self.folder, self.cfg.keep_last, written_step=run.step, warn=self.logger.warn)
            self.logger.console(f"saved checkpoint {path}")

        run_on_all_ranks(self.env, write)

    @staticmethod
    def _write_error(path: Location, e: Exception) -> ReproError | None:
        if isinstance(e, ReproError):
            return e
        cause = e
        # DCP reports the failures of every rank together; an OSError says what went wrong (torch.save's
        # zip writer turns a failed write into an opaque size mismatch on the rank it hit), else the first
        failures = getattr(e, "failures", None)
        if failures:
            causes = [f[0] if isinstance(f, tuple) else f for f in failures.values()]  # (exception, traceback)
            cause = next((c for c in causes if isinstance(c, OSError)), causes[0])
        reason = getattr(cause, "strerror", None) or first_line(cause)
        if "unexpected pos" in reason:  # torch.save's zip writer saw a write come back short
            reason = f"a write came back short: is the disk full, or a file size limit reached? ({reason})"
        return CheckpointWriteError(f"{path}: could not write checkpoint ({reason}); earlier checkpoints are intact")


def checkpoint_metadata(run: Run, cfg: TrainConfig, provenance: dict) -> dict:
    """What a checkpoint holds beside the run's state: what wrote it, with which settings."""
    return {
        "config": cfg.to_dict(),
        "model_args": run.model.config.to_dict(),
        "provenance": provenance,
        "checkpoint_id": uuid.uuid4().hex,
        "format_version": FORMAT_VERSION,
    }
