"""Checkpoints: `step_XXXXXXXX.pt` files or `step_XXXXXXXX/` sharded folders in the checkpoint folder.

The checkpoint folder is `out_dir/checkpoints` unless `checkpoint_dir` names another place (a
local path or an fsspec URL, see runtime/storage.py). A checkpoint `step_s` holds the state
after s optimizer updates, in one of two formats (training/checkpoint/format.py says what they hold).
`format_of` (a path) and FORMATS (by name: the checkpoint_format a run writes, auto resolved by
training/checkpoint/settings.py's CheckpointSettings) are the only places that tell them
apart. Everything here takes both: listing, "newest readable", retention, and the readers
(sample.py, export_hf.py, eval_lm.py, init_from, consolidation) do not care which format a
checkpoint has. Which checkpoint a launch resumes, the lineage rules and what a resume loads
are in launch/resume.py.
"""

from __future__ import annotations

from pathlib import Path

from common.errors import CheckpointError, CheckpointWriteError, first_line, print_warning  # noqa: F401 - for callers
from common.log_fields import EMA_PREFIX
from model import GPT, GPTConfig
from training.checkpoint import sharded_format as sharded  # noqa: F401 - re-exported (tests write folders with it)
from runtime import storage
from training.checkpoint.format import (FORMAT_VERSION, CheckpointFormat, DamagedCheckpointError,  # noqa: F401
                                        ModelState, damaged)
from training.checkpoint.file_format import FileFormat, save_checkpoint
from training.checkpoint.settings import WEIGHTS  # noqa: F401 - the readers' --weights, for callers
from training.checkpoint.sharded_format import ShardedFormat
from runtime.storage import Location

CHECKPOINT_DIR = "checkpoints"
FILE, SHARDED = FileFormat(), ShardedFormat()
FORMATS: dict[str, CheckpointFormat] = {fmt.name: fmt for fmt in (FILE, SHARDED)}


def format_of(path: Location) -> CheckpointFormat:
    """The format of the checkpoint at path: a folder, or anything at a URL (only folders are written
    there), is a sharded checkpoint; anything else a file."""
    return SHARDED if storage.is_url(path) or storage.is_dir(path) else FILE


def checkpoints_folder(out_dir: str | Path, checkpoint_dir: str = "") -> Location:
    """Where a run's checkpoints are: checkpoint_dir when set (a path or a URL), else out_dir/checkpoints."""
    return storage.as_location(checkpoint_dir) if checkpoint_dir else Path(out_dir) / CHECKPOINT_DIR


def checkpoint_path(folder: Location, step: int, fmt: CheckpointFormat = FILE) -> Location:
    return fmt.path(folder, step)


def step_of(path: Location) -> int | None:
    """The step a checkpoint's name says (of either format); None for any other name."""
    steps = (fmt.step_of(storage.name_of(path)) for fmt in FORMATS.values())
    return next((step for step in steps if step is not None), None)


def list_checkpoints(folder: Location) -> list[tuple[int, Location]]:
    """(step, path) of every complete checkpoint in the folder, oldest first: `.pt` files and
    sharded folders whose save completed. At a URL only the folders: a `.pt` file there is no
    checkpoint this code reads (one copied there would be set aside as unreadable by auto-resume)."""
    found = []
    formats = [fmt for fmt in FORMATS.values() if fmt.lives_at(folder)]
    for name in storage.list_names(folder):
        path = storage.join(folder, name)
        for fmt in formats:
            step = fmt.step_of(name)
            if step is not None and fmt.is_complete(path):
                found.append((step, path))
    return sorted(found, key=lambda found: (found[0], storage.name_of(found[1])))


class CheckpointTooNewError(CheckpointError):
    """A checkpoint written by newer code. It is not damaged: readers stop, and it stays where it is."""


# The entries each reader needs, with their types: a checkpoint written by other code (or edited)
# that lacks one is refused where it is read, with a message naming the file and the entry.
WEIGHTS_ENTRIES = {"model": dict, "model_args": dict, "step": int}  # sample, export, eval, init_from
RESUME_ENTRIES = {**WEIGHTS_ENTRIES, "optimizer": dict, "tokens_seen": int, "config": dict}


def require_entries(state: dict, entries: dict[str, type], path: Location, reader: str) -> dict:
    """state, once every entry `reader` needs is there with its type; else a CheckpointError naming it."""
    return format_of(path).require_entries(state, entries, path, reader)


def load_checkpoint(path: Location) -> dict:
    """A checkpoint's entries, its tensors left on storage (see each format's read_metadata); an
    unreadable checkpoint, or one of a newer format_version, is a CheckpointError naming it."""
    path = storage.as_location(path) if isinstance(path, str) else path
    state = format_of(path).read_metadata(path)
    version = state.get("format_version", 1)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointTooNewError(
            f"{path}: checkpoint format_version {version!r} is newer than this code reads ({FORMAT_VERSION}); "
            f"it was written by a newer gpt2-repro: update the code to use it (nothing was changed)")
    return state


def load_model_weights(model: GPT, path: Location, state: dict) -> None:
    """Copy a checkpoint's model (its state from load_checkpoint) into a whole GPT on this process, once every tensor
    of it is there, of its shape (a DamagedCheckpointError naming the file and the tensor, before any is copied)."""
    fmt = format_of(path)
    if problem := ModelState(model).problem(fmt.tensor_layout(path, state).get("model")):
        raise damaged(path, "model", problem)
    fmt.read_model(model, path, state)


def read_full_state(path: Location, state: dict | None = None) -> dict:
    """A checkpoint of either format, whole in this process: `model` with every key of GPT.state_dict()
    and `optimizer` keyed by parameter name, with the entries beside them (format_version: this
    code's). What consolidation writes, and what tests compare."""
    path = storage.as_location(path) if isinstance(path, str) else path
    state = load_checkpoint(path) if state is None else state
    return format_of(path).read_full_state(path, state)


def consolidate(path: Location, target: Path) -> dict:
    """Write a checkpoint (a sharded one: what it is for) as one `.pt` file, which torch.load reads; its state."""
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


def require_average(state: dict, path: Location) -> None:
    """A CheckpointError naming the checkpoint unless it holds an EMA of the weights (`--weights ema`)."""
    if not format_of(path).holds(state, "ema"):
        raise CheckpointError(f"{path}: checkpoint has no EMA weights (trained with ema_decay 0, or saved before "
                              f"ema_start); use --weights live")


def with_average(state: dict) -> dict:
    """A whole checkpoint (read_full_state's) whose `model` holds the EMA weights (a tied weight under both
    names, as in the model's state dict; the buffers stay the model's), and whose `metrics` are those weights'
    own figures (the checkpoint's ema_<key> as <key>; the live weights' as live_<key>), marked `weights: ema`:
    what is exported is described as what it is (hf_interop/export.py's model card)."""
    model = {**state["model"], **state["ema"]}
    if "transformer.wte.weight" in state["ema"] and "lm_head.weight" in model:  # GPT's tied weight (model.py)
        model["lm_head.weight"] = state["ema"]["transformer.wte.weight"]
    metrics = state.get("metrics") or {}
    own = {key.removeprefix(EMA_PREFIX): value for key, value in metrics.items() if key.startswith(EMA_PREFIX)}
    live = {f"live_{key}": value for key, value in metrics.items() if not key.startswith(EMA_PREFIX)}
    return {**state, "model": model, "metrics": {**own, **live}, "weights": "ema"}


def read_model(ckpt: str | Path, reader: str, weights: str = "live") -> tuple[GPT, dict, Location]:
    """The model of a checkpoint file or run folder (its newest readable checkpoint), on the CPU,
    with the checkpoint's state and path: what sample.py, eval_lm.py and export read. weights: live
    (the trained weights) or ema (their average, where the checkpoint holds one)."""
    path, state = resolve_checkpoint(ckpt)
    require_entries(state, WEIGHTS_ENTRIES, path, reader)
    if weights == "ema":
        require_average(state, path)
    try:
        model = GPT(GPTConfig(**state["model_args"]))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: checkpoint entry 'model_args' is not a GPT-2 shape ({e})") from None
    try:
        load_model_weights(model, path, state)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: the checkpoint's model does not fit its model_args ({first_line(e)})") from None
    if weights == "ema":
        load_average(model, path, state)
    return model, state, path


def load_average(model: GPT, path: Location, state: dict) -> None:
    """Copy the checkpoint's EMA of the weights into a whole GPT's parameters (cast to their dtype)."""
    import torch

    params = dict(model.named_parameters())  # a tied weight once, under its first name, as the EMA keys it
    like = {name: torch.empty(p.shape, dtype=torch.promote_types(p.dtype, torch.float32)) for name, p in params.items()}
    average = format_of(path).read_entry(path, state, "ema", like)
    with torch.no_grad():
        for name, p in params.items():
            if name not in average or average[name].shape != p.shape:
                raise CheckpointError(f"{path}: the checkpoint's EMA does not fit its model_args ({name})")
            p.copy_(average[name])


def remove_stale_temp_files(folder: Location) -> list[Location]:
    """Delete what saves that a killed process never finished left; what was deleted.

    Only what each format calls a leftover (a file's `.step_X.pt.tmp`, a step folder without its
    commit file), never a checkpoint. Call it only while no save can be running into the folder:
    rank 0, holding the run folder's lock, before its first save.
    """
    removed = []
    for name in sorted(storage.list_names(folder)):
        path = storage.join(folder, name)
        if any(fmt.is_leftover(path) for fmt in FORMATS.values()):
            storage.remove(path)
            removed.append(path)
    return removed


def delete_checkpoint(path: Location) -> None:
    """Delete a checkpoint of either format; one whose deletion is cut short is no checkpoint."""
    format_of(path).delete(path)


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


def check_compatible(state: dict, model_args: dict, path: Location, remedy: str) -> None:
    """Refuse a checkpoint of another model shape, naming the first key that differs and what leads out (remedy:
    the caller's, since a resume and an init_from have different ways out)."""
    saved = state.get("model_args", {})
    for key in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
        if key in saved and saved[key] != model_args[key]:
            raise CheckpointError(f"{path}: checkpoint has {key}={saved[key]} but this run has {key}={model_args[key]} "
                                  f"({remedy})")
