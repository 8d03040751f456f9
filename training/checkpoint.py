"""Checkpoints: `out_dir/checkpoints/step_XXXXXXXX.pt`, written atomically by rank 0.

A checkpoint `step_s` holds the state after s optimizer updates (see training/run.py for its
entries): tensors and plain Python values only, so it loads with `torch.load(weights_only=True)`.
The model's state dict comes from the unwrapped, uncompiled module (no `module.` /
`_orig_mod.` prefixes).

Writes go to a temp file in the same folder, are flushed and fsynced, then renamed over the
final name: a crash or a full disk mid-write never leaves a half-written `step_*.pt`, and the
previous checkpoint is untouched.

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

CHECKPOINT_DIR = "checkpoints"
# 1: the first format. 2: lineage (run_id, checkpoint_id, ancestry) and provenance; no RNG state.
FORMAT_VERSION = 2
_NAME = re.compile(r"^step_(\d{8})\.pt$")


def checkpoint_path(out_dir: str | Path, step: int) -> Path:
    return Path(out_dir) / CHECKPOINT_DIR / f"step_{step:08d}.pt"


def list_checkpoints(out_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every finished checkpoint in out_dir, oldest first."""
    folder = Path(out_dir) / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


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


def require_entries(state: dict, entries: dict[str, type], path: str | Path, reader: str) -> dict:
    """state, once every entry `reader` needs is there with its type; else a CheckpointError naming it."""
    for key, kind in entries.items():
        if key not in state:
            raise CheckpointError(f"{path}: checkpoint has no '{key}' entry, which {reader} needs "
                                  f"(written by other code, or edited)")
        if not isinstance(state[key], kind) or isinstance(state[key], bool):
            raise CheckpointError(f"{path}: checkpoint entry '{key}' is a {type(state[key]).__name__}, "
                                  f"expected a {kind.__name__}")
    if "optimizer" in entries:
        for key in ("state", "param_groups"):
            if key not in state["optimizer"]:
                raise CheckpointError(f"{path}: checkpoint entry 'optimizer' has no '{key}', which {reader} needs")
    return state


def load_checkpoint(path: str | Path) -> dict:
    """Load with weights_only=True; an unreadable file is a CheckpointError naming it.

    The tensors are memory-mapped onto the CPU: they stay on disk until touched, so reading a
    checkpoint's metadata (choosing which one to resume) costs no memory, and each rank pages
    in only what it copies. A truncated file, or one that is not a checkpoint, still fails here:
    the zip directory (at the end of the file) and the pickled record are read in full.
    """
    path = Path(path)
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


def newest_readable_checkpoint(out_dir: str | Path, warn=print_warning) -> tuple[Path, dict] | None:
    """The newest checkpoint in out_dir that loads, and its state; None when there is none.

    A newer file that does not load (truncated by a crash mid-copy, damaged) is set aside (see
    `set_aside`), so it can no longer outrank good checkpoints in any later resume. A file of a
    newer format is not damaged: CheckpointTooNewError stops the reader, and the file stays.
    """
    for _, path in reversed(list_checkpoints(out_dir)):
        try:
            return path, load_checkpoint(path)
        except CheckpointTooNewError:
            raise
        except CheckpointError as e:
            set_aside(path, e, warn)
    return None


def set_aside(path: Path, error: CheckpointError, warn=print_warning) -> None:
    """Rename an unreadable checkpoint to `step_XXXXXXXX.pt.unreadable` (kept for inspection)."""
    aside = path.with_name(path.name + ".unreadable")
    try:
        path.rename(aside)
        warn(f"skipping {error}; renamed it to {aside.name}")
    except OSError as rename_error:
        warn(f"skipping {error}; could not rename it aside ({rename_error.strerror or rename_error})")


def find_resume_checkpoint(out_dir: str | Path, resume: str, warn=print_warning) -> tuple[Path, dict, str] | None:
    """Resolve the `resume` key: (path, state, how it was chosen), or None for a fresh start.

    The checkpoints of one out_dir always form one line of history, so `resume: auto` can
    never pick up another run's state:
    - auto: the newest readable checkpoint in out_dir (unreadable newer ones are set aside).
    - never: a fresh start (the trainer refuses one into an out_dir that holds a run).
    - a path: that checkpoint, or the newest checkpoint in out_dir that continued from it
      (a relaunch that repeats the same arguments, under torchrun --max-restarts or a SLURM
      requeue, must not go back to the path each time). out_dir checkpoints of another run,
      or newer ones that did not continue from the path (a rollback), are refused.
    """
    if resume == "never":
        return None
    if resume == "auto":
        found = newest_readable_checkpoint(out_dir, warn)
        return None if found is None else (*found, "the newest checkpoint in out_dir")
    path = Path(resume)
    if not path.is_file():
        raise ConfigError(f"resume: no checkpoint file at {resume!r} (use auto, never or a path to a .pt file)")
    state = load_checkpoint(path)
    descendants = []
    for step, other in list_checkpoints(out_dir):
        if other.resolve() == path.resolve():
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
                    f"{path.name}, move the newer checkpoints out of {other.parent} or use another out_dir")
            descendants.append(other)
    if descendants:
        return descendants[-1], load_checkpoint(descendants[-1]), f"the newest checkpoint that continued from {path}"
    return path, state, "resume"


def resolve_checkpoint(ckpt: str | Path) -> tuple[Path, dict]:
    """A checkpoint file, or the newest readable checkpoint of a run folder: (path, state)."""
    path = Path(ckpt)
    if path.is_dir():
        found = newest_readable_checkpoint(path)
        if found is None:
            raise CheckpointError(f"{path}: no checkpoints in {path / CHECKPOINT_DIR}")
        return found
    return path, load_checkpoint(path)


def read_model(ckpt: str | Path, reader: str) -> tuple[GPT, dict, Path]:
    """The model of a checkpoint file or run folder (its newest readable checkpoint), on the CPU,
    with the checkpoint's state and path: what sample.py, eval_lm.py and export read."""
    path, state = resolve_checkpoint(ckpt)
    require_entries(state, WEIGHTS_ENTRIES, path, reader)
    try:
        model = GPT(GPTConfig(**state["model_args"]))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: checkpoint entry 'model_args' is not a GPT-2 shape ({e})") from None
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise CheckpointError(f"{path}: the checkpoint's model does not fit its model_args ({first_line(e)})") from None
    return model, state, path


def remove_stale_temp_files(out_dir: str | Path) -> list[Path]:
    """Delete the temp files of saves that a killed process never finished; what was deleted.

    Only names of save_checkpoint's temp pattern (never a checkpoint). Call it only while no
    save can be running into out_dir: rank 0, holding the run folder's lock, before its first save.
    """
    folder = Path(out_dir) / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    removed = []
    for tmp in sorted(folder.glob(".step_*.pt.tmp")):  # atomic_file.temp_path of a checkpoint_path
        if _NAME.match(tmp.name[1:-len(".tmp")]):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def prune_checkpoints(out_dir: str | Path, keep_last: int, written_step: int, warn=print_warning) -> list[Path]:
    """After writing checkpoint `written_step`, delete older ones so that keep_last remain.

    Only checkpoints older than the one just written are ever candidates: the new file, and
    anything newer, are never deleted. A file that cannot be deleted is a warning, not an
    error: training goes on and the file stays.
    """
    older = [path for step, path in list_checkpoints(out_dir) if step < written_step]
    deleted = []
    for path in older[: max(len(older) - (keep_last - 1), 0)]:
        try:
            path.unlink(missing_ok=True)
            deleted.append(path)
        except OSError as e:
            warn(f"could not delete old checkpoint {path} ({e.strerror or e}); it is kept")
    return deleted


def check_compatible(state: dict, model_args: dict, path: str | Path) -> None:
    """Refuse a checkpoint of another model shape, naming the first key that differs."""
    saved = state.get("model_args", {})
    for key in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
        if key in saved and saved[key] != model_args[key]:
            raise CheckpointError(
                f"{path}: checkpoint has {key}={saved[key]} but this run has {key}={model_args[key]} "
                f"(pick matching model settings, or resume=never / another out_dir)"
            )
