"""Checkpoints: `step_XXXXXXXX.pt` files or `step_XXXXXXXX/` sharded folders in the checkpoint folder.

The checkpoint folder is `out_dir/checkpoints` unless `checkpoint_dir` names another place (a
local path or an fsspec URL, see training/storage.py). A checkpoint `step_s` holds the state
after s optimizer updates (see training/run.py for its entries), in one of two formats:

- file: one `.pt` written by rank 0 (under FSDP the state is gathered onto its CPU first);
  tensors and plain Python values only, so it loads with `torch.load(weights_only=True)`. The
  write goes to a temp file in the same folder, is flushed and fsynced, then renamed over the
  final name: a crash or a full disk mid-write never leaves a half-written `step_*.pt`.
- sharded: a folder that every rank writes its part of, possibly in the background; complete
  once its commit file is there (training/sharded_checkpoint.py).

Every reader here takes both: the lineage rules, "newest readable", retention and the tools
(sample.py, export_hf.py, eval_lm.py, init_from) do not care which format a checkpoint has.
The model's state dict comes from the unwrapped, uncompiled module (no `module.` /
`_orig_mod.` prefixes).

Lineage: a fresh start draws a `run_id`, which every checkpoint of that run and of its resumes
carries; each checkpoint also has its own `checkpoint_id`, and `ancestry` lists the ids of
the checkpoints its run resumed from, oldest first. That is what lets `--resume PATH` tell
checkpoints that continued from PATH from another run's, or from an abandoned later step.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from atomic_file import atomic_write
from errors import CheckpointError, CheckpointWriteError, ConfigError, first_line, print_warning
from model import GPT, GPTConfig
from training import sharded_checkpoint as sharded
from training import storage
from training.storage import Location

CHECKPOINT_DIR = "checkpoints"
# 1: the first format. 2: lineage (run_id, checkpoint_id, ancestry) and provenance; no RNG state.
# The sharded format's commit file carries the same number.
FORMAT_VERSION = 2
_FILE = re.compile(r"^step_(\d{8})\.pt$")
_FOLDER = re.compile(r"^step_(\d{8})$")


def checkpoints_folder(out_dir: str | Path, checkpoint_dir: str = "") -> Location:
    """Where a run's checkpoints are: checkpoint_dir when set (a path or a URL), else out_dir/checkpoints."""
    return storage.as_location(checkpoint_dir) if checkpoint_dir else Path(out_dir) / CHECKPOINT_DIR


def checkpoint_path(folder: Location, step: int, sharded_format: bool = False) -> Location:
    return storage.join(folder, f"step_{step:08d}" if sharded_format else f"step_{step:08d}.pt")


def step_of(path: Location) -> int | None:
    """The step a checkpoint's name says; None for any other name."""
    m = _FILE.match(storage.name_of(path)) or _FOLDER.match(storage.name_of(path))
    return int(m.group(1)) if m else None


def list_checkpoints(folder: Location) -> list[tuple[int, Location]]:
    """(step, path) of every finished checkpoint in the folder, oldest first: `.pt` files and
    sharded folders whose save completed. At a URL only the folders: a `.pt` file there is no
    checkpoint this code reads (one copied there would be set aside as unreadable by auto-resume)."""
    found = []
    files = not storage.is_url(folder)
    for name in storage.list_names(folder):
        path = storage.join(folder, name)
        if (files and _FILE.match(name)) or (_FOLDER.match(name) and sharded.is_complete(path)):
            found.append((step_of(path), path))
    return sorted(found, key=lambda found: (found[0], storage.name_of(found[1])))


def save_checkpoint(state: dict, path: str | Path) -> None:
    """Atomically write state to path (temp file, flush, fsync, rename, fsync the folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = None
    try:
        with atomic_write(path, "wb") as f:
            writer = _FileWriter(f)
            torch.save(state, writer)
    except (OSError, RuntimeError) as e:  # torch's zip writer turns a failed write into a RuntimeError
        cause = writer.error if writer is not None and writer.error else e
        reason = getattr(cause, "strerror", None) or first_line(cause)
        raise CheckpointWriteError(
            f"{path}: could not write checkpoint ({reason}); earlier checkpoints are intact"
        ) from None


class _FileWriter:
    """A binary file that remembers the OSError of a failed write (disk full, file too large).

    torch.save's zip writer reports such a failure as an opaque size mismatch; keeping the
    original error lets the message say what went wrong.
    """

    def __init__(self, f):
        self.f = f
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


class CheckpointTooNewError(CheckpointError):
    """A checkpoint written by newer code. It is not damaged: readers stop, and it stays where it is."""


# The entries each reader needs, with their types: a checkpoint written by other code (or edited)
# that lacks one is refused where it is read, with a message naming the file and the entry.
WEIGHTS_ENTRIES = {"model": dict, "model_args": dict, "step": int}  # sample, export, eval, init_from
RESUME_ENTRIES = {**WEIGHTS_ENTRIES, "optimizer": dict, "tokens_seen": int, "config": dict}


def require_entries(state: dict, entries: dict[str, type], path: Location, reader: str) -> dict:
    """state, once every entry `reader` needs is there with its type; else a CheckpointError naming it.

    A sharded checkpoint's model and optimizer are in its DCP files: there they count as present
    when DCP's index lists them."""
    for key, kind in entries.items():
        if state.get("sharded") and key in sharded.TENSOR_ENTRIES:
            if key not in state["tensor_entries"]:
                raise CheckpointError(f"{path}: checkpoint has no '{key}' entry, which {reader} needs "
                                      f"(written by other code, or edited)")
            continue
        if key not in state:
            raise CheckpointError(f"{path}: checkpoint has no '{key}' entry, which {reader} needs "
                                  f"(written by other code, or edited)")
        if not isinstance(state[key], kind) or isinstance(state[key], bool):
            raise CheckpointError(f"{path}: checkpoint entry '{key}' is a {type(state[key]).__name__}, "
                                  f"expected a {kind.__name__}")
    if "optimizer" in entries and not state.get("sharded"):
        for key in ("state", "param_groups"):
            if key not in state["optimizer"]:
                raise CheckpointError(f"{path}: checkpoint entry 'optimizer' has no '{key}', which {reader} needs")
    return state


def load_checkpoint(path: Location) -> dict:
    """A checkpoint's state; an unreadable one is a CheckpointError naming it.

    A file loads with weights_only=True, its tensors memory-mapped onto the CPU: they stay on
    disk until touched, so reading a checkpoint's metadata (choosing which one to resume) costs
    no memory, and each rank pages in only what it copies. A truncated file, or one that is not
    a checkpoint, still fails here: the zip directory (at the end of the file) and the pickled
    record are read in full. A sharded folder gives its commit file's entries (no tensors: see
    load_model_weights and Run.load_state_dict), once every part it lists is there in full.
    """
    path = storage.as_location(path) if isinstance(path, str) else path
    if storage.is_url(path) or sharded.is_sharded_checkpoint(path):
        state = _read_folder_metadata(path)
        if "step" not in state:
            raise CheckpointError(f"{path}: not a gpt2-repro checkpoint (no step entry)")
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: no such checkpoint") from None
        except Exception as e:  # truncated zip, garbage bytes, unpickling refusal...
            raise CheckpointError(f"{path}: unreadable checkpoint ({first_line(e)})") from None
        if not isinstance(state, dict) or not {"model", "step"} <= state.keys():
            raise CheckpointError(f"{path}: not a gpt2-repro checkpoint (no model/step entries)")
    version = state.get("format_version", 1)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointTooNewError(
            f"{path}: checkpoint format_version {version!r} is newer than this code reads ({FORMAT_VERSION}); "
            f"it was written by a newer gpt2-repro: update the code to use it (nothing was changed)")
    return state


def _read_folder_metadata(path: Location) -> dict:
    """A sharded checkpoint's metadata (every URL is read as one). A URL to a file is said to be one: file
    checkpoints are written locally only, and reading a commit file "inside" a file says "Not a directory"."""
    url_to_a_file = CheckpointError(f"{path} is a URL to a file; URLs hold sharded checkpoints (step_XXXXXXXX "
                                    f"folders) only: give the file's local path")
    if storage.is_url(path) and storage.name_of(path).endswith(".pt"):  # known before any I/O
        raise url_to_a_file
    try:
        return sharded.read_metadata(path)
    except CheckpointError:
        if storage.is_url(path) and _names_a_file(path):
            raise url_to_a_file from None
        raise


def _names_a_file(url: str) -> bool:
    """Whether a URL names a file (not a folder); False when that cannot be told."""
    try:
        return storage.exists(url) and not storage.is_dir(url)
    except OSError:
        return False


def load_model_weights(model: GPT, path: Location, state: dict) -> None:
    """Copy a checkpoint's model (its state from load_checkpoint) into a whole GPT on this process."""
    if state.get("sharded"):
        sharded.load_model(model, path)
    else:
        model.load_state_dict(state["model"])


def read_full_state(path: Location, state: dict | None = None) -> dict:
    """A checkpoint of either format as the file format holds it: `model` with every key of
    GPT.state_dict() (a tied weight under both names) and `optimizer` keyed by parameter index,
    with the entries beside them. What consolidation writes, and what tests compare."""
    from training.config import TrainConfig
    from training.optimizers import build_optimizer
    from training.parallel import by_index, parameter_names

    state = load_checkpoint(path) if state is None else state
    if not state.get("sharded"):
        return state
    require_entries(state, RESUME_ENTRIES, path, "consolidation")
    full = sharded.read_full_state(path)
    with torch.device("meta"):  # the names and their order only: no memory
        model = GPT(GPTConfig(**state["model_args"]))
    # the checkpoint's kind of optimizer (its groups order the parameters), with default settings
    saved_optimizer = state.get("config", {}).get("optimizer", "adamw")
    optimizer = build_optimizer(model, TrainConfig(optimizer=saved_optimizer), "cpu")
    names = parameter_names(model, optimizer)
    first_name = {id(p): name for name, p in reversed(list(model.state_dict(keep_vars=True).items()))}
    model_state = {name: full["model"][first_name[id(p)]] for name, p in model.state_dict(keep_vars=True).items()}
    extra = {k: v for k, v in state.items() if k not in ("sharded", "tensor_entries", "location")}
    return {**extra, "model": model_state, "optimizer": by_index(full["optimizer"], names)}


def consolidate(path: Location, target: Path) -> dict:
    """Write a sharded checkpoint as one `.pt` file (what older tools, or torch.load, read); its state."""
    state = read_full_state(path)
    save_checkpoint(state, target)
    return state


def newest_readable_checkpoint(folder: Location, warn=print_warning) -> tuple[Location, dict] | None:
    """The newest checkpoint in the folder that loads, and its state; None when there is none.

    A newer file that does not load (truncated by a crash mid-copy, damaged) is set aside (see
    `set_aside`), so it can no longer outrank good checkpoints in any later resume. A file of a
    newer format is not damaged: CheckpointTooNewError stops the reader, and the file stays.
    """
    for _, path in reversed(list_checkpoints(folder)):
        try:
            return path, load_checkpoint(path)
        except CheckpointTooNewError:
            raise
        except CheckpointError as e:
            set_aside(path, e, warn)
    return None


def set_aside(path: Location, error: CheckpointError, warn=print_warning) -> None:
    """Rename an unreadable checkpoint to `step_XXXXXXXX[.pt].unreadable` (kept for inspection)."""
    try:
        aside = storage.rename(path, storage.name_of(path) + ".unreadable")
        warn(f"skipping {error}; renamed it to {storage.name_of(aside)}")
    except OSError as rename_error:
        warn(f"skipping {error}; could not rename it aside ({rename_error.strerror or rename_error})")


def find_resume_checkpoint(folder: Location, resume: str, warn=print_warning) -> tuple[Location, dict, str] | None:
    """Resolve the `resume` key: (path, state, how it was chosen), or None for a fresh start.

    folder is the run's checkpoint folder. The checkpoints of one run always form one line of
    history, so `resume: auto` can never pick up another run's state:
    - auto: the newest readable checkpoint in the folder (unreadable newer ones are set aside).
    - never: a fresh start (the trainer refuses one into an out_dir that holds a run).
    - a path: that checkpoint, or the newest checkpoint in out_dir that continued from it
      (a relaunch that repeats the same arguments, under torchrun --max-restarts or a SLURM
      requeue, must not go back to the path each time). Checkpoints in the folder of another run,
      or newer ones that did not continue from the path (a rollback), are refused.
    """
    if resume == "never":
        return None
    if resume == "auto":
        found = newest_readable_checkpoint(folder, warn)
        return None if found is None else (*found, "the newest checkpoint in out_dir")
    path = storage.as_location(resume)
    if not storage.exists(path):
        raise ConfigError(f"resume: no checkpoint file or folder at {resume!r} (use auto, never, or the path of a "
                          f"step_XXXXXXXX.pt file or step_XXXXXXXX folder)")
    state = load_checkpoint(path)
    descendants = []
    for step, other in list_checkpoints(folder):
        if same_location(other, path):
            continue
        try:
            lineage = load_checkpoint(other)  # metadata only: the tensors stay on disk
        except CheckpointTooNewError:
            raise
        except CheckpointError as e:
            set_aside(other, e, warn)
            continue
        if lineage.get("run_id") != state.get("run_id"):
            raise ConfigError(
                f"resume: {other} belongs to another run than {path}; give this run another out_dir")
        if step > state["step"]:
            if state.get("checkpoint_id") is None or state["checkpoint_id"] not in lineage.get("ancestry", []):
                raise ConfigError(
                    f"resume: {other} is newer than {path} and did not continue from it; to go back to "
                    f"{storage.name_of(path)}, move the newer checkpoints out of {folder} or use another out_dir")
            descendants.append(other)
    if descendants:
        return descendants[-1], load_checkpoint(descendants[-1]), f"the newest checkpoint that continued from {path}"
    return path, state, "resume"


def same_location(a: Location, b: Location) -> bool:
    if isinstance(a, Path) and isinstance(b, Path):
        return a.resolve() == b.resolve()
    return str(a).rstrip("/") == str(b).rstrip("/")


def resolve_checkpoint(ckpt: str | Path) -> tuple[Location, dict]:
    """(path, state) of a checkpoint: a step file or folder, or the newest readable checkpoint of a
    run folder (in its checkpoint_dir, from its config.yaml) or of a checkpoint folder."""
    path = storage.as_location(str(ckpt))
    if step_of(path) is None and storage.is_dir(path):
        folder = run_checkpoints_folder(path) if isinstance(path, Path) else path
        found = newest_readable_checkpoint(folder)
        if found is None:
            raise CheckpointError(f"{path}: no checkpoints in {folder}")
        return found
    return path, load_checkpoint(path)


def run_checkpoints_folder(folder: Path) -> Location:
    """The checkpoint folder of a run folder (its config.yaml's checkpoint_dir, else checkpoints/),
    or the folder itself when it is not a run folder."""
    import yaml

    config = folder / "config.yaml"
    if config.is_file():
        try:
            checkpoint_dir = (yaml.safe_load(config.read_text()) or {}).get("checkpoint_dir") or ""
        except (OSError, yaml.YAMLError, AttributeError):
            checkpoint_dir = ""
        return checkpoints_folder(folder, checkpoint_dir)
    return folder / CHECKPOINT_DIR if (folder / CHECKPOINT_DIR).is_dir() else folder


def read_model(ckpt: str | Path, reader: str) -> tuple[GPT, dict, Location]:
    """The model of a checkpoint file or run folder (its newest readable checkpoint), on the CPU,
    with the checkpoint's state and path: what sample.py, eval_lm.py and export read."""
    path, state = resolve_checkpoint(ckpt)
    require_entries(state, WEIGHTS_ENTRIES, path, reader)
    try:
        model = GPT(GPTConfig(**state["model_args"]))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: checkpoint entry 'model_args' is not a GPT-2 shape ({e})") from None
    try:
        load_model_weights(model, path, state)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: the checkpoint's model does not fit its model_args ({first_line(e)})") from None
    return model, state, path


def remove_stale_temp_files(folder: Location) -> list[Location]:
    """Delete what saves that a killed process never finished left; what was deleted.

    Only save_checkpoint's temp files (`.step_X.pt.tmp`) and sharded step folders without their
    commit file, never a checkpoint. Call it only while no save can be running into the folder:
    rank 0, holding the run folder's lock, before its first save.
    """
    removed = []
    for name in sorted(storage.list_names(folder)):
        path = storage.join(folder, name)
        stale_file = name.startswith(".") and name.endswith(".tmp") and _FILE.match(name[1:-len(".tmp")])
        if stale_file or (_FOLDER.match(name) and not sharded.is_complete(path)):
            storage.remove(path)
            removed.append(path)
    return removed


def delete_checkpoint(path: Location) -> None:
    """A sharded checkpoint loses its commit file first: a deletion cut short leaves no 'complete' half."""
    if _FOLDER.match(storage.name_of(path)):
        sharded.uncommit(path)
    storage.remove(path)


def prune_checkpoints(folder: Location, keep_last: int, written_step: int, warn=print_warning) -> list[Location]:
    """After writing checkpoint `written_step`, delete older ones so that keep_last remain.

    Only checkpoints older than the one just written are ever candidates: the new file, and
    anything newer, are never deleted. A file that cannot be deleted is a warning, not an
    error: training goes on and the file stays.
    """
    older = [path for step, path in list_checkpoints(folder) if step < written_step]
    deleted = []
    for path in older[: max(len(older) - (keep_last - 1), 0)]:
        try:
            delete_checkpoint(path)
            deleted.append(path)
        except OSError as e:
            warn(f"could not delete old checkpoint {path} ({e.strerror or e}); it is kept")
    return deleted


def check_compatible(state: dict, model_args: dict, path: Location) -> None:
    """Refuse a checkpoint of another model shape, naming the first key that differs."""
    saved = state.get("model_args", {})
    for key in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
        if key in saved and saved[key] != model_args[key]:
            raise CheckpointError(
                f"{path}: checkpoint has {key}={saved[key]} but this run has {key}={model_args[key]} "
                f"(pick matching model settings, or resume=never / another out_dir)"
            )
