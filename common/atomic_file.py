"""Atomic file replacement: a reader sees the old file or the new one, never half of one.

Checkpoints, token shards, prep manifests, the run folder's text files and downloads are
all written the same way: into a temp file beside the target (same filesystem, so the rename
is atomic), flushed and fsynced, renamed over the target, and the rename made durable by
fsyncing the folder where the filesystem allows it. A failure (disk full, a killed writer
leaves only a `.NAME.tmp`) never touches the target. Imports nothing from the project.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", encoding: str | None = None, unique: bool = False,
                 permissions: int | None = None):
    """Open a temp file for writing; on a clean exit it replaces `path`, on an exception it is removed.

    mode: "wb" or "w" (text, with `encoding`, utf-8 by default). unique: a temp name of this
    writer's own (`.NAME.XXXXXX.tmp`), for files that several machines may fill at once (a
    shared cache); otherwise `.NAME.tmp`, which the next writer of NAME overwrites.
    permissions: chmod the file before it replaces path. The OSError of a failed write or
    rename propagates; the caller words it.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write writes whole files: mode 'w' or 'wb', not {mode!r}")
    path = Path(path)
    if unique:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp = Path(name)
    else:
        tmp = path.with_name(f".{path.name}.tmp")  # hidden, and never a name readers match
    try:
        with open(tmp, mode, encoding=(encoding or "utf-8") if mode == "w" else None) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if permissions is not None:
            os.chmod(tmp, permissions)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def fsync_folder(folder: str | os.PathLike) -> None:
    """Make a rename inside folder durable, where the filesystem allows it.

    Some network and FUSE filesystems refuse to open or fsync a directory (EINVAL, EACCES...);
    the file itself is already complete and renamed, so that refusal is no reason to fail.
    """
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)
