"""The file checkpoint format: one `step_XXXXXXXX.pt`, written whole by rank 0.

Under FSDP the tensor parts are gathered onto rank 0's CPU first (training/checkpoint/format.py's TensorPart).
Tensors and plain Python values only, so it loads with `torch.load(weights_only=True)`. The
write goes to a temp file in the same folder (`.step_XXXXXXXX.pt.tmp`), is flushed and
fsynced, then renamed over the final name: a crash or a full disk mid-write never leaves a
half-written `step_*.pt`, so every one there is complete. Files are written locally only (a
URL holds sharded checkpoints).

A file loads memory-mapped: its tensors stay on disk until touched, so reading its metadata
(choosing which checkpoint to resume) costs no memory, and each rank pages in only what it
copies. A truncated file, or one that is not a checkpoint, still fails at once: the zip
directory (at the end of the file) and the pickled record are read in full.

Files of format_version 1 and 2 hold the optimizer state keyed by parameter index (torch's
Optimizer.state_dict numbering); they are converted to names where their optimizer is read
(`optimizer_by_name`, the legacy path).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from common.atomic_file import atomic_write
from common.errors import CheckpointError, CheckpointWriteError, first_line
from runtime import storage
from training.checkpoint.format import CheckpointFormat, TensorPart, TrainingState, tensor_parts
from runtime.storage import Location

_TEMP = re.compile(r"^\.step_\d{8}\.pt\.tmp$")  # atomic_write's temp file of a checkpoint
BY_NAME_VERSION = 3  # the first format_version whose optimizer state is keyed by parameter name


class FileFormat(CheckpointFormat):
    name = "file"
    suffix = ".pt"

    def lives_at(self, folder: Location) -> bool:
        # a .pt file at a URL is no checkpoint this code reads (one copied there would be set aside as unreadable)
        return not storage.is_url(folder)

    def is_complete(self, path: Location) -> bool:
        return True  # renamed into place once written in full

    def is_leftover(self, path: Location) -> bool:
        return bool(_TEMP.match(storage.name_of(path)))

    def delete(self, path: Location) -> None:
        storage.remove(path)

    def save(self, run: TrainingState, path: Location, metadata: dict, asynchronous: bool = False,
             process_group=None) -> None:
        """Gather the tensor parts (a collective under FSDP), then rank 0 writes the file; returns once written."""
        tensors = {name: part.full_state_dict() for name, part in tensor_parts(run).items()}  # {} on other ranks
        if run.strategy.env.master_process:  # an EMA that has not started saves nothing
            save_checkpoint({**metadata, **{name: state for name, state in tensors.items() if state}}, path)
        return None

    def amend(self, path: Location, entries: dict) -> None:
        """The file written again whole, its tensors read from the old one (memory-mapped: the rename over it leaves
        the mapping intact)."""
        save_checkpoint({**self.read_metadata(path), **entries}, path)

    def read_metadata(self, path: Location) -> dict:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: no such checkpoint") from None
        except Exception as e:  # truncated zip, garbage bytes, unpickling refusal...
            raise CheckpointError(f"{path}: unreadable checkpoint ({first_line(e)})") from None
        if not isinstance(state, dict) or not {"model", "step"} <= state.keys():
            raise CheckpointError(f"{path}: not a gpt2-repro checkpoint (no model/step entries)")
        return state

    def require_entries(self, state: dict, entries: dict[str, type], path: Location, reader: str) -> dict:
        super().require_entries(state, entries, path, reader)
        if "optimizer" in entries:
            for key in ("state", "param_groups"):
                if key not in state["optimizer"]:
                    raise CheckpointError(f"{path}: checkpoint entry 'optimizer' has no '{key}', which {reader} needs")
        return state

    def load_tensors(self, state: dict, parts: dict[str, TensorPart], path: Location) -> None:
        """Every rank has the whole file (memory-mapped) and keeps its part."""
        state = self.read_full_state(path, state)  # a file of format_version 1 or 2: its optimizer keyed by name
        for name, part in parts.items():
            part.load_full_state_dict(state[name])

    def tensor_layout(self, path: Location, state: dict) -> dict:
        """Its own entries: their tensors are memory-mapped, their shapes read with the file's record (an optimizer of
        format_version 1 or 2 keyed by name; a file the readers take may hold none)."""
        return {**state, "optimizer": optimizer_by_name(state)} if "optimizer" in state else state

    def read_model(self, model: torch.nn.Module, path: Location, state: dict) -> None:
        model.load_state_dict(state["model"])

    def read_entry(self, path: Location, state: dict, entry: str, like: dict[str, torch.Tensor]) -> dict:
        return {name: state[entry][name] for name in like if name in state[entry]}

    def read_full_state(self, path: Location, state: dict) -> dict:
        if state.get("format_version", 1) >= BY_NAME_VERSION:
            return state
        return {**state, "optimizer": optimizer_by_name(state), "format_version": BY_NAME_VERSION}


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


def optimizer_by_name(state: dict) -> dict:
    """A file's optimizer state keyed by parameter name: as it is (format_version 3 on), or converted (1, 2)."""
    if state.get("format_version", 1) >= BY_NAME_VERSION:
        return state["optimizer"]
    return legacy_optimizer_by_name(state)


def legacy_optimizer_by_name(state: dict) -> dict:
    """LEGACY (format_version 1 and 2): the optimizer state keyed by parameter index -> by name.

    Such a file numbers the parameters as torch's Optimizer.state_dict() does: through the
    optimizer's groups, in order. The groups are those of the checkpoint's model (model_args)
    under its kind of optimizer (config's optimizer; adamw before that key), which decide the
    order whatever the settings; so both are rebuilt, on the meta device (no memory), to name
    the indices. The only place a model is rebuilt to read a checkpoint.
    """
    from model import GPT, GPTConfig
    from training.optim.optimizers import build_optimizer
    from training.optim.settings import OptimizerSettings
    from training.distributed.strategies import by_name, parameter_names

    with torch.device("meta"):
        model = GPT(GPTConfig(**state["model_args"]))
    kind = state.get("config", {}).get("optimizer", "adamw")
    optimizer = build_optimizer(model, OptimizerSettings(optimizer=kind), 6e-4, "cpu")  # the groups' order only
    return by_name(state["optimizer"], parameter_names(model, optimizer))
