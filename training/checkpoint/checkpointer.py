"""Writing a run's checkpoints: when they are due, in the format the config picks, at most one save in flight.

The format (training/checkpoint/format.py) writes: the file format has rank 0 write `step_X.pt`
before training goes on; the sharded one has every rank write its part of `step_X/`, and with
`checkpoint_async` the loop is blocked only while the state is copied to host memory, the
files being written in the background.

A checkpoint counts as written (for the lineage, for retention, for "newest readable") only
once it is complete: rank 0 then commits it (the sharded format's commit file), prunes older
checkpoints and logs a `checkpoint` record. Weights that are not finite are never saved: a
checkpoint is a good state.

A background save that fails (disk full, an object store's 5xx) is reported when it is seen
(`poll`, after each step, no collective), and every rank learns of it through the next step's
vote (training/run/lockstep.py): the loop then saves that step's state synchronously (`retry`),
so no more than one step is trained past a loss that is already known, and a run whose
storage stays broken stops with that error. Every rank waits for the save in flight before the
next save, and before the process ends (`wait`, collective).
"""

from __future__ import annotations

import datetime
import time
import uuid
from dataclasses import dataclass

import torch

from common.errors import CheckpointWriteError, NonFiniteLossError, ReproError, first_line
from training.checkpoint.folder import FORMAT_VERSION, FORMATS, format_of, prune_checkpoints
from training.checkpoint.format import TrainingState
from runtime.process_group import any_rank, run_on_all_ranks
from training.distributed.strategies import local_part
from runtime.context import Context
from training.checkpoint.run_folder import adopt_checkpoint_folder
from training.checkpoint.settings import CheckpointSettings
from training.optim.spikes import RollbackRequested
from runtime.storage import Location


@dataclass
class PendingSave:
    path: Location
    step: int
    metadata: dict  # the commit file's entries
    future: object | None  # concurrent.futures.Future of an asynchronous save; None when written on return
    started: float
    committed: bool = False  # rank 0: its commit file is written; other ranks: their part is
    error: Exception | None = None  # this rank saw the save fail (reported already)


class Checkpointer:
    """Every rank holds one; `save`, `retry` and `wait` are collectives, `poll` is not."""

    def __init__(self, settings: CheckpointSettings, ctx: Context, folder: Location, out_dir: str, config: dict,
                 provenance: dict, *, strategy_format: str, hang_timeout_minutes: float, rollback_on_nonfinite: bool):
        """settings: the checkpoint section (cadence, retention, format, async); folder: where the checkpoints go
        (training/checkpoint/folder.py's checkpoints_folder). Of other sections, as values: out_dir (run: the run
        folder, whose checkpoint folder it adopts); config (every key,
        flat) and provenance (the launch's record), which every checkpoint stores as what wrote it;
        strategy_format (the strategy's default_checkpoint_format: what checkpoint_format auto means);
        hang_timeout_minutes (runtime: the background writes' process group); rollback_on_nonfinite (long_run:
        what non-finite weights at a save ask for)."""
        self.settings, self.env, self.logger = settings, ctx.env, ctx.logger
        self.out_dir, self.config, self.provenance = out_dir, config, provenance
        self.rollback_on_nonfinite = rollback_on_nonfinite
        self.folder = folder
        self.format = FORMATS[settings.resolved_format(strategy_format)]
        self.asynchronous = self.format.writes_in_background and settings.checkpoint_async
        self.pending: PendingSave | None = None
        self.saved_step: int | None = None  # the step of the last save started by this launch
        self.adopted = False  # the folder was cleaned (and owned) before this launch's first save
        self.process_group = None
        if self.asynchronous and ctx.env.distributed:
            # the background write's collectives must not interleave with the training's
            import torch.distributed as dist

            self.process_group = dist.new_group(  # the training's hang timeout, as the training's group
                backend="gloo", timeout=datetime.timedelta(minutes=hang_timeout_minutes))

    def due(self, run: TrainingState, last_step: bool) -> bool:
        """Whether step run.step is saved: every checkpoint_interval steps and (final_checkpoint) at the
        end; never the step this launch (or a rollback) loaded, nor one saved already."""
        if run.step in (run.start_step, self.saved_step):
            return False
        interval = self.settings.checkpoint_interval
        return (last_step and self.settings.final_checkpoint) or bool(interval and run.step % interval == 0)

    def save(self, run: TrainingState, blocking: bool = False) -> None:
        """Checkpoint `step_{run.step}`. Collective: every rank calls it at the same step.

        blocking: written and committed on return, also where saves are asynchronous. For the
        saves the process exits after (the last step, a preemption): a background write that is
        waited for at once costs its copy to host memory on top of the same write.
        Weights that are not finite are not saved: RollbackRequested with rollback_on_nonfinite,
        else NonFiniteLossError (every rank alike).
        """
        self.check_finite(run)
        # at most one save in flight; one that failed was reported, and this one, in its place, is written
        # synchronously: storage that keeps failing stops the run here, instead of failing in the background
        blocking = self.wait(fail=False) or blocking
        run_on_all_ranks(self.env, self._prepare_folder)
        self.saved_step = run.step
        # the whole configuration: a checkpoint says with which settings of every section it was trained
        metadata = {**run.state_dict(), **checkpoint_metadata(run, self.config, self.provenance)}
        path = self.format.path(self.folder, run.step)
        started = time.perf_counter()
        asynchronous = self.asynchronous and not blocking
        group = self.process_group if asynchronous else None
        future = run_on_all_ranks(self.env, lambda: self.format.save(run, path, metadata, asynchronous, group),
                                  describe=lambda e: self._write_error(path, e))
        self.pending = PendingSave(path, run.step, metadata, future, started)
        if asynchronous:
            self.logger.console(f"saving checkpoint {path} in the background "
                                f"(training blocked {time.perf_counter() - started:.2f} s)")
        else:
            self.wait()

    def finish(self, run: TrainingState) -> None:
        """After the last step and its final evaluations: the save in flight is written and committed, and so were
        the log's last records (a run whose log failed at the end does not end as a success). A launch that ran
        those evaluations alone (it resumed the checkpoint of the last step, which a stop had saved before them)
        records them in that checkpoint: its figures become the final ones, and it is of a finished run.
        Collective."""
        self.wait()
        if run.step == run.start_step and run.resumed_from is not None:
            path = run.resumed_from
            run_on_all_ranks(self.env, lambda: self._amend(path, run.evaluation_state()),
                             describe=lambda e: self._write_error(path, e))
        run_on_all_ranks(self.env, self.logger.check)

    def _amend(self, path: Location, entries: dict) -> None:
        """rank 0: the checkpoint at path gets entries; the log is sound first, as before a commit."""
        if not self.env.master_process:
            return
        self.logger.check()
        format_of(path).amend(path, entries)
        self.logger.console(f"recorded the final evaluations in {path}")

    def _prepare_folder(self) -> None:
        """rank 0, before a save: the log is sound (one that could not be written stops the run before a
        checkpoint is written), and before this launch's first save the folder is adopted (cleaned, owned)."""
        if not self.env.master_process:
            return
        self.logger.check()
        if not self.adopted:
            adopt_checkpoint_folder(self.folder, self.out_dir, self.logger.console)
            self.adopted = True

    def save_before_exit(self, run: TrainingState) -> None:
        """This step's state, written and committed on return (a stop signal: the process exits next),
        unless it is saved already (a retry's save at this very step), then that save is waited for."""
        if self.saved_step == run.step:
            self.wait()
        else:
            self.save(run, blocking=True)

    def check_finite(self, run: TrainingState) -> None:
        """Refuse to save weights with a NaN/inf (an update of step run.step - 1 that blew up: the loss
        guard checks a step's loss before its update, never the weights after it). Collective."""
        local = [local_part(p) for p in run.model.parameters()]  # FSDP: the shard
        finite = bool(torch.stack([torch.isfinite(p).all() for p in local]).all())
        if not any_rank(not finite, self.env):
            return
        step = run.step - 1
        reason = f"the weights after the update of step {step} are not finite"
        if self.rollback_on_nonfinite:  # long_run's key: the step's own non-finite check reads it too
            raise RollbackRequested(step, reason)
        raise NonFiniteLossError(f"step {step}: {reason}; they were not saved, and the newest checkpoint in "
                                 f"{self.folder} is the last good state")

    def poll(self) -> None:
        """After a step: a background save that has finished is committed (rank 0), or, if it failed,
        reported at once (`failed` then votes for a retry at the next step). Not a collective."""
        pending = self.pending
        if (pending is None or pending.committed or pending.error is not None or pending.future is None
                or not pending.future.done()):
            return
        try:
            pending.future.result()
            if self.env.master_process:
                self._commit(pending)
            pending.committed = True
        except Exception as e:  # noqa: BLE001 - every rank hears of it at the next step's vote
            self._failed(pending, e)

    def failed(self) -> bool:
        """This rank saw the save in flight fail: its vote, at the next step, for `retry`."""
        return self.pending is not None and self.pending.error is not None

    def retry(self, run: TrainingState) -> None:
        """Every rank, once the step's vote said a background save failed: save this step's state now,
        synchronously. If that fails too, the run stops with its error (the earlier checkpoints are
        intact). Collective."""
        failed = self.pending.path if self.pending is not None else "a background save"
        self.save(run, blocking=True)
        self.logger.console(f"saved step {run.step} in place of {failed}, whose background save failed")

    def wait(self, fail: bool = True) -> bool:
        """Every rank waits for the save in flight to be written, and rank 0 commits it. Collective.

        fail: a failed save stops every rank with its error. Otherwise (a newer save, or a
        rollback, is about to replace it) it is reported as a warning, is not a checkpoint, and
        every rank returns True.
        """
        pending, self.pending = self.pending, None
        if pending is None:
            return False

        def finish() -> None:
            if pending.error is None and not pending.committed:
                try:
                    if pending.future is not None:
                        pending.future.result()  # this rank's part (on rank 0: every part, and DCP's index)
                    if self.env.master_process:
                        self._commit(pending)
                except Exception as e:  # noqa: BLE001 - shared below, or reported
                    if fail:
                        raise
                    self._failed(pending, e)
            if pending.error is not None and fail:
                raise pending.error

        run_on_all_ranks(self.env, finish, describe=lambda e: self._write_error(pending.path, e))
        return any_rank(pending.error is not None, self.env)

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

    def _failed(self, pending: PendingSave, e: Exception) -> None:
        pending.error = e
        self.logger.warn(f"{first_line(self._write_error(pending.path, e))}; {pending.path} is not a checkpoint: "
                         f"saving the next step's state in its place")

    def _commit(self, pending: PendingSave, check_log: bool = True) -> None:
        """rank 0: the checkpoint is complete from here on; then older ones are pruned."""
        if check_log:
            self.logger.check()  # a log that could not be written stops the run before a checkpoint counts
        self.format.commit(pending.path, pending.metadata, self.env.world_size)
        pending.committed = True
        prune_checkpoints(self.folder, self.settings.keep_last, written_step=pending.step, warn=self.logger.warn)
        seconds = time.perf_counter() - pending.started
        self.logger.log({"kind": "checkpoint", "step": pending.step, "path": str(pending.path), "seconds": seconds})
        self.logger.console(f"saved checkpoint {pending.path} ({seconds:.2f} s)")

    @staticmethod
    def _write_error(path: Location, e: Exception) -> ReproError | None:
        if isinstance(e, ReproError):
            return e
        cause = e
        # DCP reports the failures of every rank together; an OSError says what went wrong (torch.save's
        # zip writer turns a failed write into an opaque size mismatch on the rank it hit), else the first
        if failures := getattr(e, "failures", None):
            causes = [f[0] if isinstance(f, tuple) else f for f in failures.values()]  # (exception, traceback)
            cause = next((c for c in causes if isinstance(c, OSError)), causes[0])
        reason = getattr(cause, "strerror", None) or first_line(cause)
        if "unexpected pos" in reason:  # torch.save's zip writer saw a write come back short
            reason = f"a write came back short: is the disk full, or a file size limit reached? ({reason})"
        return CheckpointWriteError(f"{path}: could not write checkpoint ({reason}); earlier checkpoints are intact")


def checkpoint_metadata(run: TrainingState, config: dict, provenance: dict) -> dict:
    """What a checkpoint holds beside the run's state: what wrote it, with which settings (config: every key,
    flat, as config.yaml has them)."""
    return {
        "config": config,
        "model_args": run.model.config.to_dict(),
        "provenance": provenance,
        "checkpoint_id": uuid.uuid4().hex,
        "format_version": FORMAT_VERSION,
    }
