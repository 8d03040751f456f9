"""Where checkpoints live: a local folder (a shared filesystem is one too) or an fsspec URL.

Local locations are `Path`s and keep every guarantee of the local filesystem (atomic renames,
fsync). A URL (`s3://bucket/run`, `gs://...`, `memory://...`, `file:///...`) is a `str` and goes
through fsspec, whose backend for the scheme (s3fs, gcsfs, ...) must be installed: a missing one
is a ConfigError naming the package. Only the sharded checkpoint format is written to URLs:
object stores have no rename, so a checkpoint there is complete once its commit file exists
(training/checkpoint/sharded_format.py), not once it is renamed into place.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from common.atomic_file import atomic_write
from common.errors import ConfigError, first_line

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")

Location = Path | str  # a local path, or a URL string (never turned into a Path: that would fold its "//")


def is_url(location: str | Path) -> bool:
    return isinstance(location, str) and bool(_URL.match(location))


def absolute(location: str) -> str:
    """location with a relative local path made absolute against the working directory: a plain path, or the
    path of a file:// (local://) URL, which fsspec also reads against the working directory (after expanding
    `~`). '' and every other URL stay as they are."""
    if not location:
        return location
    if not is_url(location):
        return location if os.path.isabs(location) else os.path.abspath(location)
    scheme, path = location.split("://", 1)
    if scheme.lower() not in ("file", "local") or path.startswith("/"):
        return location
    return f"{scheme}://{os.path.abspath(os.path.expanduser(path))}"


def as_location(location: str | Path) -> Location:
    """A URL stays a string; anything else is a local Path."""
    return location if is_url(location) else Path(location)


def join(folder: Location, name: str) -> Location:
    return f"{folder.rstrip('/')}/{name}" if isinstance(folder, str) else folder / name


def name_of(location: Location) -> str:
    return location.rstrip("/").rsplit("/", 1)[-1] if isinstance(location, str) else location.name


def parent_of(location: Location) -> Location:
    return location.rstrip("/").rsplit("/", 1)[0] if isinstance(location, str) else location.parent


def filesystem(url: str, key: str = "checkpoint_dir"):
    """The fsspec filesystem of a URL and the URL's path in it; a ConfigError for an unusable scheme."""
    try:
        import fsspec
        import fsspec.core
    except ImportError:
        raise ConfigError(f"{key}: {url} is a URL, which needs the fsspec package (pip install fsspec)") from None
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:  # fsspec names the backend package to install (s3fs, gcsfs, ...)
        raise ConfigError(f"{key}: cannot open {url}: {first_line(e)}") from None
    except ValueError as e:  # an unknown protocol
        raise ConfigError(f"{key}: cannot open {url} ({first_line(e)})") from None


def list_names(folder: Location) -> list[str]:
    """Names of the entries directly in folder; [] when it does not exist."""
    if isinstance(folder, Path):
        return [p.name for p in folder.iterdir()] if folder.is_dir() else []
    fs, path = filesystem(folder)
    try:
        return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False)]
    except FileNotFoundError:
        return []


def is_dir(location: Location) -> bool:
    if isinstance(location, Path):
        return location.is_dir()
    fs, path = filesystem(location)
    return fs.isdir(path)


def exists(location: Location) -> bool:
    if isinstance(location, Path):
        return location.exists()
    fs, path = filesystem(location)
    return fs.exists(path)


def size_of(location: Location) -> int | None:
    """Bytes of a file; None when it does not exist."""
    if isinstance(location, Path):
        return location.stat().st_size if location.is_file() else None
    fs, path = filesystem(location)
    try:
        return fs.size(path)
    except FileNotFoundError:
        return None


def read_bytes(location: Location) -> bytes:
    """The file's bytes (FileNotFoundError when it is not there)."""
    if isinstance(location, Path):
        return location.read_bytes()
    fs, path = filesystem(location)
    return fs.cat_file(path)


def write_bytes(location: Location, data: bytes) -> None:
    """Replace the file whole: atomically (temp file and rename) locally; one PUT on an object store."""
    if isinstance(location, Path):
        with atomic_write(location, "wb") as f:
            f.write(data)
        return
    fs, path = filesystem(location)
    fs.pipe_file(path, data)


def make_dirs(location: Location) -> None:
    if isinstance(location, Path):
        location.mkdir(parents=True, exist_ok=True)
        return
    fs, path = filesystem(location)
    fs.makedirs(path, exist_ok=True)


def remove(location: Location) -> None:
    """Delete a file, or a folder and everything in it; nothing when it is not there."""
    if isinstance(location, Path):
        if location.is_dir():
            import shutil

            shutil.rmtree(location)
        else:
            location.unlink(missing_ok=True)
        return
    fs, path = filesystem(location)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def rename(location: Location, new_name: str) -> Location:
    """Rename a file or folder within its parent; the new location."""
    target = join(parent_of(location), new_name)
    if isinstance(location, Path):
        location.rename(target)
        return target
    fs, path = filesystem(location)
    _, target_path = filesystem(target)
    fs.mv(path, target_path, recursive=True)
    return target


def require_shared(location: Location, world_size: int, key: str = "checkpoint_dir") -> None:
    """Refuse a filesystem that lives in one process's memory (memory://) for a run of several ranks:
    each rank would write its part where no other process can read it, and nothing would last."""
    if world_size > 1 and is_url(location):
        fs, _ = filesystem(location, key)
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        if "memory" in protocols:
            raise ConfigError(f"{key}: {location} is a filesystem inside each process, which the {world_size} "
                              f"ranks do not share: use a shared path or an object store URL")
