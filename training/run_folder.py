"""One run folder holds one line of history: a lock against concurrent launches, and the run it belongs to.

A run folder (out_dir) belongs to one run: the `run_id` that a fresh start draws and that its
checkpoints, its resumes and `run.json` carry. Two things would break that, and both are refused
before anything is written:

- two launches into the same out_dir at once (a job submitted twice): rank 0 holds an exclusive
  `flock` on `out_dir/.lock` for the whole launch. The kernel drops the lock when the process
  ends, however it ends, so a crashed or killed run never leaves it stuck (on NFS, when the
  client's lease expires). Filesystems without locks get a warning, and go on unprotected.
- continuing a run in a folder that holds another run (a checkpoint copied in from elsewhere,
  `--resume PATH` into a folder with a third run's log): see `check_one_history`.
"""

from __future__ import annotations

import errno
import json
import os
import socket
from datetime import datetime, timezone
from pathlib import Path

from errors import CheckpointError, ConfigError
from training.checkpoint import CheckpointTooNewError, list_checkpoints, load_checkpoint, remove_stale_temp_files
from training.run_logger import LOG_NAME
from training.storage import Location, name_of, parent_of

LOCK_NAME = ".lock"
RUN_RECORD = "run.json"  # written by the trainer at every launch (training/provenance.py)


def claim_run_folder(out_dir: str | Path, checkpoints: Location, warn, console) -> RunFolderLock:
    """Lock out_dir for this launch (rank 0), then clean what a killed save left in its checkpoint
    folder: safe now that no one else writes there."""
    lock = RunFolderLock(out_dir, warn)
    try:
        removed = remove_stale_temp_files(checkpoints)
    except BaseException:
        lock.release()
        raise
    if removed:
        console(f"removed what {len(removed)} interrupted checkpoint save(s) left: "
                f"{', '.join(name_of(p) for p in removed)}")
    return lock


class RunFolderLock:
    """rank 0's exclusive lock on out_dir for the duration of a launch."""

    def __init__(self, out_dir: str | Path, warn):
        import fcntl  # POSIX only, like the rest of the multi-process trainer

        self.out_dir = Path(out_dir)
        self.created_folder = not self.out_dir.exists()
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.out_dir / LOCK_NAME, "a+")
        except OSError as e:
            raise ConfigError(f"out_dir: cannot create {self.out_dir} ({e.strerror or e})") from None
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                warn(f"cannot lock {self.out_dir / LOCK_NAME} on this filesystem ({e.strerror or e}): a second launch "
                     f"into the same out_dir at the same time would not be noticed")
            else:
                self._file.seek(0)
                holder = self._file.read().strip() or "another process"
                self._file.close()
                raise ConfigError(f"out_dir: {self.out_dir} is in use by another launch ({holder}); wait for it to "
                                  f"end, or give this run another out_dir") from None
        self._file.seek(0)
        self._file.truncate()
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self._file.write(f"pid {os.getpid()} on {socket.gethostname()} since {started}\n")
        self._file.flush()

    def release(self) -> None:
        """Unlock (closing the file drops the flock); an out_dir this launch created and left empty goes too."""
        if self._file is None:
            return
        self._file.close()
        self._file = None
        if self.created_folder and [p.name for p in self.out_dir.iterdir()] == [LOCK_NAME]:
            (self.out_dir / LOCK_NAME).unlink(missing_ok=True)
            try:
                self.out_dir.rmdir()
            except OSError:
                pass


def recorded_run_id(out_dir: str | Path) -> str | None:
    """The run_id in out_dir/run.json; None without one (no run yet, or a folder of older code)."""
    try:
        record = json.loads((Path(out_dir) / RUN_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record.get("run_id") if isinstance(record, dict) else None


def check_one_history(out_dir: str | Path, checkpoints: Location, chosen: tuple[Location, dict] | None) -> None:
    """Refuse to go on when out_dir (with its checkpoint folder), or out_dir and the checkpoint chosen
    to resume, hold more than one run.

    What names a run: run.json's run_id (every launch writes it), and each readable checkpoint's
    run_id. They must all agree, with each other and with the chosen checkpoint. A chosen
    checkpoint from another folder into an out_dir whose log cannot be attributed to any run
    (written by older code) is refused too: its records would mix with the new ones.
    """
    out_dir = Path(out_dir)
    owners: dict[str, str] = {}  # run_id -> what carries it, for the message
    recorded = recorded_run_id(out_dir)
    if recorded:
        owners[recorded] = f"{RUN_RECORD} and {LOG_NAME}"
    for step, path in list_checkpoints(checkpoints):
        try:
            run_id = load_checkpoint(path).get("run_id")  # metadata only: the tensors stay on disk
        except CheckpointTooNewError:
            raise
        except CheckpointError:
            continue  # damaged: never chosen, and set aside when it would be
        if run_id:
            owners.setdefault(run_id, f"{name_of(checkpoints)}/{name_of(path)}")
    if len(owners) > 1:
        raise ConfigError(f"resume: {out_dir} holds more than one run ({describe(owners)}); one folder holds one "
                          f"line of history: move the other run's files out, or give this run another out_dir")
    if chosen is None:
        return
    path, state = chosen
    theirs = state.get("run_id")
    ours = next(iter(owners), None)
    if ours is not None and theirs != ours:
        raise ConfigError(f"resume: {path} belongs to run {short(theirs)}, but {out_dir} holds run {short(ours)} "
                          f"({owners[ours]}); continue that run with --resume auto, or give this run another out_dir")
    if ours is None and (out_dir / LOG_NAME).exists() and str(parent_of(path)) != str(checkpoints):
        raise ConfigError(f"resume: {out_dir} holds a {LOG_NAME} of another run; resuming {path} there would mix "
                          f"their records: give this run another out_dir")


def describe(owners: dict[str, str]) -> str:
    return ", ".join(f"run {short(run_id)} in {where}" for run_id, where in owners.items())


def short(run_id: str | None) -> str:
    return run_id[:8] if run_id else "(unnamed)"
