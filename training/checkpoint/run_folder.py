"""A run folder for one launch at a time: the locks on out_dir and checkpoint_dir, and the owner of a checkpoint_dir.

A run folder (out_dir) holds one line of history (launch/resume.py enforces it when it
chooses what a launch continues). What would break it before anything is chosen is refused
here, before anything is written:

- two launches into the same out_dir at once (a job submitted twice): rank 0 holds an exclusive
  `flock` on `out_dir/.lock` for the whole launch. The kernel drops the lock when the process
  ends, however it ends, so a crashed or killed run never leaves it stuck (on NFS, when the
  client's lease expires). Filesystems without locks get a warning, and go on unprotected.
- two runs sharing one checkpoint folder (a checkpoint_dir outside out_dir, named by two
  experiments): that folder is locked too, and belongs to one out_dir (`claim_run_folder`;
  its owner file is written by the first save, `adopt_checkpoint_folder`).
"""

from __future__ import annotations

import errno
import json
import os
import socket
from datetime import datetime, timezone
from pathlib import Path

from common.errors import ConfigError, first_line
from runtime import storage
from training.checkpoint.folder import remove_stale_temp_files
from runtime.storage import Location, name_of

LOCK_NAME = ".lock"
OWNER_NAME = "owner.json"  # in a checkpoint_dir outside out_dir: the run folder it belongs to


def claim_run_folder(out_dir: str | Path, checkpoints: Location, warn) -> list[FolderLock]:
    """Lock out_dir for this launch (rank 0), and the checkpoint folder too when it lives elsewhere.

    A checkpoint_dir outside out_dir (a shared YAML's `checkpoint_dir: /shared/ckpt`, an s3 URL)
    could be named by two runs by mistake: each would prune the other's checkpoints and resume
    the other's state. So such a folder is locked as well (a local one; object stores have no
    locks), and it must belong to this out_dir: its owner file (written by the first save, see
    `adopt_checkpoint_folder`) names the run folder it belongs to. Nothing is written or deleted
    here but the lock files: a launch that is refused later leaves the folders as they were.
    """
    locks = [FolderLock(out_dir, "out_dir", warn)]
    try:
        if not inside(checkpoints, out_dir):
            check_owner(checkpoints, out_dir)
            if isinstance(checkpoints, Path):
                locks.append(FolderLock(checkpoints, "checkpoint_dir", warn))
    except BaseException:
        release_all(locks)
        raise
    return locks


def release_all(locks: list[FolderLock]) -> None:
    for lock in reversed(locks):
        lock.release()


def inside(location: Location, folder: str | Path) -> bool:
    """Whether a checkpoint folder lies inside the run folder (the default out_dir/checkpoints)."""
    return isinstance(location, Path) and location.resolve().is_relative_to(Path(folder).resolve())


def check_owner(checkpoints: Location, out_dir: str | Path) -> None:
    """Refuse a checkpoint folder that belongs to another run folder (its owner file says which)."""
    try:
        owner = json.loads(storage.read_bytes(storage.join(checkpoints, OWNER_NAME))).get("out_dir")
    except FileNotFoundError:
        return  # a new folder (or one written by older code): the first save adopts it
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"checkpoint_dir: unreadable {storage.join(checkpoints, OWNER_NAME)} ({first_line(e)}); "
                          f"it names the run folder the checkpoints belong to") from None
    ours = str(Path(out_dir).resolve())
    if owner != ours:
        raise ConfigError(f"checkpoint_dir: {checkpoints} holds the checkpoints of the run in {owner}, not of "
                          f"out_dir {ours}; one checkpoint folder holds one run: give this run its own "
                          f"checkpoint_dir (or, if that run folder was moved here, delete {OWNER_NAME} there)")


def adopt_checkpoint_folder(checkpoints: Location, out_dir: str | Path, console) -> None:
    """rank 0, before the launch's first save: the folder is this run's from now on.

    What saves that a killed process never finished left (temp files, sharded folders without
    their commit file) is removed: safe now, since the folder is locked (or owned) by this launch
    and every check that could refuse the launch has passed. A checkpoint_dir outside out_dir gets
    its owner file, naming the run folder.
    """
    if removed := remove_stale_temp_files(checkpoints):
        console(f"removed what {len(removed)} interrupted checkpoint save(s) left: "
                f"{', '.join(name_of(p) for p in removed)}")
    if not inside(checkpoints, out_dir) and not storage.exists(storage.join(checkpoints, OWNER_NAME)):
        storage.make_dirs(checkpoints)
        storage.write_bytes(storage.join(checkpoints, OWNER_NAME),
                            (json.dumps({"out_dir": str(Path(out_dir).resolve())}) + "\n").encode())


class FolderLock:
    """rank 0's exclusive lock on a folder (out_dir, or a checkpoint_dir elsewhere) for a launch.

    Whether this launch created the folder is mkdir's own answer (it fails where the folder exists,
    whoever made it a moment ago), never an exists() made before it. A launch that is refused
    removes nothing: the folder and its `.lock` are the holder's. The holder, on release, removes a
    folder it created and left empty, unlinking `.lock` while it still holds the lock; so a launch
    that locked that file meanwhile (opened before the unlink) finds it is no longer the file at the
    path, and starts over on the new one: two launches never hold locks on two files of one folder.
    """

    ATTEMPTS = 3  # a holder removing its folder while this launch opens it makes one more

    def __init__(self, folder: str | Path, key: str, warn):
        self.folder = Path(folder)
        self.created_folder = False  # whether this launch's mkdir made the folder
        self._file = None
        for _ in range(self.ATTEMPTS):
            if self._acquire(key, warn):
                return
        raise ConfigError(f"{key}: {self.folder} kept changing while this launch locked it (another launch "
                          f"starting and ending there); try again")

    def _acquire(self, key: str, warn) -> bool:
        """Lock the `.lock` file at the folder's path; False where it was removed meanwhile (try again)."""
        import fcntl  # POSIX only, like the rest of the multi-process trainer

        path = self.folder / LOCK_NAME
        try:
            try:
                self.folder.mkdir(parents=True)  # fails where the folder exists, whoever made it a moment ago
                self.created_folder = True
            except FileExistsError:
                pass  # another launch's, or an earlier run's: not this launch's to remove
            file = open(path, "a+")
        except FileNotFoundError:
            return False  # a holder removed the folder between the mkdir and the open
        except OSError as e:
            raise ConfigError(f"{key}: cannot create {self.folder} ({e.strerror or e})") from None
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                warn(f"cannot lock {path} on this filesystem ({e.strerror or e}): a second launch "
                     f"into the same {key} at the same time would not be noticed")
                self._hold(file)
                return True
            file.seek(0)
            holder = file.read().strip() or "another process"
            file.close()  # refused: nothing removed, the folder and its .lock are the holder's
            raise ConfigError(f"{key}: {self.folder} is in use by another launch ({holder}); wait for it to "
                              f"end, or give this run another {key}") from None
        if not same_file(file, path):  # its holder unlinked it on release, after this launch opened it
            file.close()
            return False
        self._hold(file)
        return True

    def _hold(self, file) -> None:
        self._file = file
        file.seek(0)
        file.truncate()
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        file.write(f"pid {os.getpid()} on {socket.gethostname()} since {started}\n")
        file.flush()

    def release(self) -> None:
        """Unlock (closing the file drops the flock); a folder this launch created and left empty goes too, its
        .lock unlinked while the lock is still held (see the class doc)."""
        if self._file is None:
            return
        try:
            if self.created_folder and [p.name for p in self.folder.iterdir()] == [LOCK_NAME]:
                (self.folder / LOCK_NAME).unlink(missing_ok=True)
                self.folder.rmdir()
        except OSError:
            pass  # another launch made its .lock there meanwhile (the folder is its now), or it is gone
        finally:
            self._file.close()
            self._file = None


def same_file(file, path: Path) -> bool:
    """Whether the open file is the one at path now (not one unlinked since it was opened)."""
    try:
        here = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(file.fileno())
    return (mine.st_dev, mine.st_ino) == (here.st_dev, here.st_ino)
