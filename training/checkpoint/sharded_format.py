"""The sharded checkpoint format: a folder `step_XXXXXXXX/` that every rank writes its part of.

    step_00005000/
        __0_0.distcp, __1_0.distcp, ...   each rank's tensors (torch.distributed.checkpoint, DCP)
        .metadata                         DCP's index of every tensor shard: written once all parts are
        checkpoint.json                   everything else (step, lineage, config, ...): written LAST

The parts that hold tensors (model, optimizer, EMA: training/checkpoint/format.py's TensorPart) go through DCP
as its Stateful objects, keyed by parameter name, the same under DDP, FSDP and one process: a checkpoint loads
onto any world size and any strategy (DCP reshards), and a single process reads the model alone (sample.py,
export, eval).

A checkpoint is complete when `checkpoint.json` exists: DCP's `.metadata` is written by rank 0
only after every rank reported its part written, and the commit file after that. A folder
without the commit file is an interrupted save: never chosen, and removed before the next run's
first save. Retention deletes the commit file first, so a half-deleted folder is never complete.

Asynchronous saves (`dcp.async_save`) block the loop only while the state is copied off the
device; the files are written by a background thread, whose collectives go over a process group
of their own (gloo), apart from the training's.

`ShardedFormat`, at the end, is this format behind the interface of training/checkpoint/format.py.
"""

from __future__ import annotations

import json
import warnings
from concurrent.futures import Future

import torch

from common.errors import CheckpointError, first_line
from runtime import storage
from training.checkpoint.format import (TENSOR_ENTRIES, CheckpointFormat, ModelState, TensorPart, TrainingState,
                                        tensor_parts)
from runtime.storage import Location

COMMIT_NAME = "checkpoint.json"
DCP_METADATA = ".metadata"

# DCP warns, on every save and load without a process group, that it "assumes the intent is to
# save/load in a single process": one process (sample.py, a one-GPU run) is exactly that intent
# (worded "is disabled, unavailable or ..." by save and load, "is unavailable or ..." by the whole-state read)
warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized",
                        category=UserWarning)


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


def start_save(parts: dict, location: Location, asynchronous: bool, process_group=None):
    """Write the parts' tensors (this rank's part) into the folder; a Future when asynchronous. parts: entry ->
    Stateful (training/checkpoint/format.py's TensorPart), whose state_dict DCP saves.

    Every rank calls it (a collective). Synchronous: returns once every part and DCP's index are
    written. Asynchronous: returns once the state is copied to host memory; the Future completes
    when the files are written (on rank 0: all ranks' files and the index), or raises their error.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    storage.make_dirs(location)
    no_dist = not _distributed()
    try:
        if asynchronous:
            return _ordinary_failure(dcp.async_save(parts, storage_writer=_writer(location),
                                                    process_group=process_group, no_dist=no_dist))
        dcp.save(parts, storage_writer=_writer(location), process_group=process_group, no_dist=no_dist)
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


def read_commit(location: Location) -> dict:
    """The commit file's entries, plus `tensor_entries`: the tensor entries that the DCP files hold.

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
    return {**metadata, "tensor_entries": entries}


def read_tensors(location: Location, entries: list[str]) -> dict:
    """Those tensor entries whole in this process, as saved: {"model": {name: tensor}, "optimizer": {"state":
    {name: {...}}, "param_groups": [...]}, ...} (parameters by name, a tied weight under its first name only).
    For consolidation and inspection: it holds everything."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    try:
        return _load_state_dict_from_keys(set(entries), storage_reader=_reader(location))
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"{location}: could not read the checkpoint ({first_line(_first_failure(e))})") from None


def load(state: dict, location: Location, what: str, alone: bool = False) -> None:
    """Read the checkpoint's tensors into state's in place (a Stateful's: into its state_dict's, which its
    load_state_dict then takes), every rank its part, resharded: a collective, or (alone) in this process alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=_reader(location), no_dist=alone or not _distributed())
    except (Exception, CheckpointException) as e:  # a shape or key that does not match, a part unreadable
        raise CheckpointError(f"{location}: could not read {what} ({first_line(_first_failure(e))})") from None


class ShardedFormat(CheckpointFormat):
    """A `step_XXXXXXXX/` folder, local or at any URL; every URL is read as one."""

    name = "sharded"
    suffix = ""
    writes_in_background = True

    def is_complete(self, path: Location) -> bool:
        return is_complete(path)

    def is_leftover(self, path: Location) -> bool:
        return self.step_of(storage.name_of(path)) is not None and not is_complete(path)

    def delete(self, path: Location) -> None:
        storage.remove(storage.join(path, COMMIT_NAME))  # first: from now on it is incomplete, whatever happens next
        storage.remove(path)

    def save(self, run: TrainingState, path: Location, metadata: dict, asynchronous: bool = False,
             process_group=None) -> Future | None:
        return start_save(tensor_parts(run), path, asynchronous, process_group)

    def commit(self, path: Location, metadata: dict, world_size: int) -> None:
        check_parts(path, world_size)
        commit(path, metadata)

    def amend(self, path: Location, entries: dict) -> None:
        """The commit file written again (whole: atomically locally, one PUT on an object store); the parts stay."""
        metadata = json.loads(storage.read_bytes(storage.join(path, COMMIT_NAME)))
        commit(path, {**metadata, **entries})

    def read_metadata(self, path: Location) -> dict:
        """The commit file's entries. A URL to a file is said to be one: file checkpoints are written
        locally only, and reading a commit file "inside" a file says "Not a directory"."""
        url_to_a_file = CheckpointError(f"{path} is a URL to a file; URLs hold sharded checkpoints (step_XXXXXXXX "
                                        f"folders) only: give the file's local path")
        if storage.is_url(path) and storage.name_of(path).endswith(".pt"):  # known before any I/O
            raise url_to_a_file
        try:
            state = read_commit(path)
        except CheckpointError:
            if storage.is_url(path) and _names_a_file(path):
                raise url_to_a_file from None
            raise
        if "step" not in state:
            raise CheckpointError(f"{path}: not a gpt2-repro checkpoint (no step entry)")
        return state

    def holds(self, state: dict, key: str) -> bool:
        """The tensor entries are in the DCP files: there when DCP's index lists them."""
        return key in state or key in state.get("tensor_entries", ())

    def tensor_layout(self, path: Location, state: dict) -> dict:
        """From DCP's index: each tensor a meta tensor of its shape and dtype, where the state dict DCP flattened had
        it; a value DCP keeps as bytes (the optimizer's settings and parameter names), None."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        try:
            index = _reader(path).read_metadata()
        except Exception as e:  # read when the checkpoint was chosen: gone or damaged since
            raise CheckpointError(f"{path}: unreadable checkpoint index {DCP_METADATA} ({first_line(e)})") from None
        places = index.planner_data or {}  # each flat key's path in the state dict: ("optimizer", "state", name, ...)
        layout: dict = {}
        for key, item in index.state_dict_metadata.items():
            if key not in places:
                continue  # not flattened by DCP's default planner: DCP's own load checks it
            value = torch.empty(item.size, dtype=item.properties.dtype, device="meta") \
                if isinstance(item, TensorStorageMetadata) else None
            *outer, last = places[key]
            container = layout
            for part in outer:
                container = container.setdefault(part, {})
            container[last] = value
        return as_lists(layout)

    def load_tensors(self, state: dict, parts: dict[str, TensorPart], path: Location) -> None:
        load(parts, path, "the training state")

    def read_model(self, model: torch.nn.Module, path: Location, state: dict) -> None:
        load({"model": ModelState(model)}, path, "the model", alone=True)

    def read_entry(self, path: Location, state: dict, entry: str, like: dict[str, torch.Tensor]) -> dict:
        tensors = {entry: {name: torch.empty_like(tensor) for name, tensor in like.items()}}
        load(tensors, path, f"the {entry} entry", alone=True)
        return tensors[entry]

    def read_full_state(self, path: Location, state: dict) -> dict:
        self.require_entries(state, dict.fromkeys(TENSOR_ENTRIES, dict), path, "consolidation")
        full = read_tensors(path, state["tensor_entries"])  # the model, the optimizer, the EMA where it started
        model = dict(full["model"])
        if "transformer.wte.weight" in model:  # GPT's tied weight (model.py): one tensor under both names, as in a file
            model["lm_head.weight"] = model["transformer.wte.weight"]
        entries = {key: value for key, value in state.items() if key != "tensor_entries"}
        return {**entries, **full, "model": model}


def as_lists(nested):
    """nested dicts with the dicts keyed 0..n-1 (DCP's flattening of a list: the optimizer's param_groups) as lists."""
    if not isinstance(nested, dict):
        return nested
    nested = {key: as_lists(value) for key, value in nested.items()}
    if nested and all(isinstance(key, int) for key in nested) and sorted(nested) == list(range(len(nested))):
        return [nested[i] for i in range(len(nested))]
    return nested


def _names_a_file(url: str) -> bool:
    """Whether a URL names a file (not a folder); False when that cannot be told."""
    try:
        return storage.exists(url) and not storage.is_dir(url)
    except OSError:
        return False
