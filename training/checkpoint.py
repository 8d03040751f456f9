"""Checkpoints: `out_dir/checkpoints/step_XXXXXXXX.pt`, written atomically by rank 0.

A checkpoint `step_s` holds the state after s optimizer updates: the model's state dict (from
the unwrapped, uncompiled module, so no `module.` / `_orig_mod.` prefixes), the optimizer,
the step, tokens seen, the resolved config, the model shape, RNG states, the W&B run id and
the latest metrics. Only tensors and plain Python types, so it loads with
`torch.load(weights_only=True)`.

Writes go to a temp file in the same folder, are flushed and fsynced, then renamed over the
final name: a crash or a full disk mid-write never leaves a half-written `step_*.pt`, and the
previous checkpoint is untouched.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import torch

CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"^step_(\d{8})\.pt$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or used; the message names the file."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, permissions); earlier ones are intact."""


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
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            writer = _FileWriter(f)
            torch.save(state, writer)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch's zip writer turns a failed write into a RuntimeError
        tmp.unlink(missing_ok=True)
        cause = writer.error if "writer" in locals() and writer.error else e
        reason = getattr(cause, "strerror", None) or str(cause).strip().splitlines()[0]
        raise CheckpointWriteError(
            f"{path}: could not write checkpoint ({reason}); earlier checkpoints are intact"
        ) from None
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


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


def load_checkpoint(path: str | Path, map_location="cpu") -> dict:
    """Load with weights_only=True; an unreadable file is a CheckpointError naming it."""
    path = Path(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint") from None
    except Exception as e:  # truncated zip, garbage bytes, unpickling refusal...
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: unreadable checkpoint ({reason[:200]})") from None
    if not isinstance(state, dict) or not {"model", "step"} <= state.keys():
        raise CheckpointError(f"{path}: not a gpt2-repro checkpoint (no model/step entries)")
    return state


def find_resume_checkpoint(out_dir: str | Path, resume: str) -> tuple[Path, dict] | None:
    """Resolve the `resume` key to a loaded checkpoint, or None for a fresh start.

    auto: the newest checkpoint in out_dir that loads, skipping (with a warning) any newer
    file that is truncated or corrupt; none at all is a fresh start. never: fresh start.
    A path: that file, and it must load.
    """
    if resume == "never":
        return None
    if resume != "auto":
        return Path(resume), load_checkpoint(resume)
    for step, path in reversed(list_checkpoints(out_dir)):
        try:
            return path, load_checkpoint(path)
        except CheckpointError as e:
            print(f"warning: skipping {e}", file=sys.stderr)
    return None


def remove_stale_temp_files(out_dir: str | Path) -> None:
    """Delete temp files of writes that a killed process never finished (never a real checkpoint)."""
    folder = Path(out_dir) / CHECKPOINT_DIR
    if folder.is_dir():
        for tmp in folder.glob(".step_*.pt.tmp"):
            tmp.unlink(missing_ok=True)


def prune_checkpoints(out_dir: str | Path, keep_last: int, protect: Path | None = None) -> list[Path]:
    """Delete all but the newest keep_last checkpoints, never the protected one (resumed from)."""
    found = list_checkpoints(out_dir)
    doomed = [p for _, p in found[: max(len(found) - keep_last, 0)]]
    if protect is not None:
        doomed = [p for p in doomed if p.resolve() != Path(protect).resolve()]
    for p in doomed:
        p.unlink(missing_ok=True)
    return doomed


def check_compatible(state: dict, model_args: dict, path: str | Path) -> None:
    """Refuse a checkpoint of another model shape, naming the first key that differs."""
    saved = state.get("model_args", {})
    for key in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
        if key in saved and saved[key] != model_args[key]:
            raise CheckpointError(
                f"{path}: checkpoint has {key}={saved[key]} but this run has {key}={model_args[key]} "
                f"(pick matching model settings, or resume=never / another out_dir)"
            )
