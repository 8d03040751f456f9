"""The sharded checkpoint format: a folder `step_XXXXXXXX/` that every rank writes its part of.

    step_00005000/
        __0_0.distcp, __1_0.distcp, ...   each rank's tensors (torch.distributed.checkpoint, DCP)
        .metadata                         DCP's index of every tensor shard: written once all parts are
        checkpoint.json                   everything else (step, lineage, config, ...): written LAST

The model and optimizer go through DCP's `get_state_dict` / `set_state_dict`, keyed by parameter
name, the same under DDP, FSDP and one process: a checkpoint loads onto any world size and any
strategy (DCP reshards), and a single process reads the model alone (sample.py, export, eval).

A checkpoint is complete when `checkpoint.json` exists: DCP's `.metadata` is written by rank 0
only after every rank reported its part written, and the commit file after that. A folder
without the commit file is an interrupted save: never chosen, and removed before the next run's
first save. Retention deletes the commit file first, so a half-deleted folder is never complete.

Asynchronous saves (`dcp.async_save`) block the loop only while the state is copied off the
device; the files are written by a background thread, whose collectives go over a process group
of their own (gloo), apart from the training's.
"""

from __future__ import annotations

import json
import warnings
from concurrent.futures import Future

import torch

from errors import CheckpointError, first_line
from training import storage
from training.storage import Location

COMMIT_NAME = "checkpoint.json"
DCP_METADATA = ".metadata"
TENSOR_ENTRIES = ("model", "optimizer")  # in the DCP files; everything else is in the commit file

# DCP warns, on every save and load without a process group, that it "assumes the intent is to
# save/load in a single process": one process (sample.py, a one-GPU run) is exactly that intent
# (worded "is disabled, unavailable or ..." by save and load, "is unavailable or ..." by the whole-state read)
warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized",
                        category=UserWarning)


def is_sharded_checkpoint(location: Location) -> bool:
    """A step folder (complete or not); a file checkpoint is a `.pt` file."""
    return storage.is_dir(location)


def is_complete(location: Location) -> bool:
    return storage.exists(storage.join(location, COMMIT_NAME))


def _writer(location: Location):
    from torch.distributed.checkpoint import FileSystemWriter

    if storage.is_url(location):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        storage.filesystem(location)  # a missing backend package is a ConfigError naming it
        return FsspecWriter(location, sync_files=True)
    return FileSystemWriter(location, sync_files=True)


def _reader(location: Location):
    from torch.distributed.checkpoint import FileSystemReader

    if storage.is_url(location):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(location)
    return FileSystemReader(location)


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class DCPError(Exception):
    """A failure DCP reported as its CheckpointException, as an ordinary exception.

    DCP derives CheckpointException from BaseException, which every `except Exception` (the
    ranks' agreement on errors, the checkpointer) lets through as a traceback. `failures` keeps
    what failed on each rank; the message is the first failure's.
    """

    def __init__(self, error: BaseException):
        self.failures = getattr(error, "failures", None) or {}
        super().__init__(first_line(_first_failure(error)))


def _first_failure(error: BaseException) -> BaseException:
    """The exception of the first failing rank inside DCP's CheckpointException; else error itself."""
    failures = getattr(error, "failures", None)
    if not failures:
        return error
    cause = next(iter(failures.values()))
    return cause[0] if isinstance(cause, tuple) else cause  # (exception, traceback)


def _ordinary_failure(future: Future) -> Future:
    """A Future of the same result, whose CheckpointException is a DCPError."""
    from torch.distributed.checkpoint.api import CheckpointException

    converted: Future = Future()

    def finished(done: Future) -> None:
        try:
            converted.set_result(done.result())
        except CheckpointException as e:
            converted.set_exception(DCPError(e))
        except BaseException as e:  # noqa: BLE001 - handed on as it is, to whoever waits for the save
            converted.set_exception(e)

    future.add_done_callback(finished)
    return converted


def start_save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, location: Location,
               asynchronous: bool, process_group=None):
    """Write the model and optimizer (this rank's part) into the folder; a Future when asynchronous.

    Every rank calls it (a collective). Synchronous: returns once every part and DCP's index are
    written. Asynchronous: returns once the state is copied to host memory; the Future completes
    when the files are written (on rank 0: all ranks' files and the index), or raises their error.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    storage.make_dirs(location)
    no_dist = not _distributed()
    try:
        if asynchronous:
            return _ordinary_failure(dcp.async_save(state, storage_writer=_writer(location),
                                                    process_group=process_group, no_dist=no_dist))
        dcp.save(state, storage_writer=_writer(location), process_group=process_group, no_dist=no_dist)
    except CheckpointException as e:
        raise DCPError(e) from None
    return None


def check_parts(location: Location, world_size: int) -> None:
    """rank 0, before the commit: it sees every part DCP's index lists, in full. A checkpoint_dir that
    the ranks do not share (a node-local path, a per-process filesystem) would otherwise be called
    saved with only rank 0's part in it. An OSError names what is missing."""
    problem = _part_problem(location, _reader(location).read_metadata())
    if problem is not None:
        shared = " (is checkpoint_dir on storage that every rank shares?)" if world_size > 1 else ""
        raise OSError(f"{problem} after the save{shared}")


def commit(location: Location, metadata: dict) -> None:
    """Mark a written checkpoint complete: its commit file, written whole (rank 0, after the save finished)."""
    storage.write_bytes(storage.join(location, COMMIT_NAME),
                        (json.dumps(metadata, indent=1, sort_keys=True) + "\n").encode())


def _part_problem(location: Location, index) -> str | None:
    """What is wrong with the parts that DCP's index refers to (missing, shorter than listed); None if nothing."""
    needed: dict[str, int] = {}
    for info in (index.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, length in sorted(needed.items()):
        size = storage.size_of(storage.join(location, name))
        if size is None:
            return f"checkpoint part {name} is missing"
        if size < length:
            return f"checkpoint part {name} is truncated ({size} of {length} bytes)"
    return None


def uncommit(location: Location) -> None:
    """The first step of deleting a checkpoint: from now on it is incomplete, whatever happens next."""
    storage.remove(storage.join(location, COMMIT_NAME))


def read_metadata(location: Location) -> dict:
    """The commit file's entries, plus `sharded`, `tensor_entries` (what the DCP files hold) and `location`.

    Checks that every file DCP's index refers to is there and long enough, so a checkpoint whose
    parts were truncated or lost (a copy that failed half-way) is refused here, before any rank
    starts loading it; a CheckpointError names the folder.
    """
    try:
        metadata = json.loads(storage.read_bytes(storage.join(location, COMMIT_NAME)))
    except FileNotFoundError:
        if not storage.exists(location):
            raise CheckpointError(f"{location}: no such checkpoint") from None
        raise CheckpointError(f"{location}: incomplete checkpoint (no {COMMIT_NAME}: "
                              f"its save did not finish)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{location}: unreadable {COMMIT_NAME} ({first_line(e)})") from None
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{location}: {COMMIT_NAME} is not a mapping")
    try:
        index = _reader(location).read_metadata()
    except Exception as e:  # a missing or damaged .metadata
        raise CheckpointError(f"{location}: unreadable checkpoint index {DCP_METADATA} ({first_line(e)})") from None
    problem = _part_problem(location, index)
    if problem is not None:
        raise CheckpointError(f"{location}: {problem}")
    entries = sorted({key.split(".", 1)[0] for key in index.state_dict_metadata})
    return {**metadata, "sharded": True, "tensor_entries": entries, "location": location}


def read_full_state(location: Location) -> dict:
    """The whole model and optimizer in this process, as saved: {"model": {name: tensor},
    "optimizer": {"state": {name: {...}}, "param_groups": [...]}} (parameters by name, a tied
    weight under its first name only). For consolidation and inspection: it holds everything."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    try:
        return _load_state_dict_from_keys(set(TENSOR_ENTRIES), storage_reader=_reader(location))
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"{location}: could not read the checkpoint ({first_line(_first_failure(e))})") from None


def load_model(model: torch.nn.Module, location: Location) -> None:
    """Read the checkpoint's model into `model`, a whole (unsharded) GPT, in this process alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model_state = get_model_state_dict(model)
    try:
        dcp.load({"model": model_state}, storage_reader=_reader(location), no_dist=True)
    except (Exception, CheckpointException) as e:  # a shape or key that does not match, a part unreadable
        raise CheckpointError(f"{location}: could not read the model ({first_line(_first_failure(e))})") from None
    set_model_state_dict(model, model_state)


def load_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, location: Location,
                        adapt_optimizer) -> None:
    """Every rank reads its own part of the model and optimizer, resharded for this run. Collective.

    adapt_optimizer(saved optimizer state dict) -> the state dict to load (this run's settings).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    try:
        dcp.load(state, storage_reader=_reader(location), no_dist=not _distributed())
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"{location}: could not read the training state "
                              f"({first_line(_first_failure(e))})") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=adapt_optimizer(state["optimizer"]))
