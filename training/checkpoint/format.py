"""What a checkpoint format is: the one interface both formats implement, and the state they both hold.

Two formats lay a checkpoint `step_s` (the state after s optimizer updates) out on storage:

- FileFormat (training/checkpoint/file_format.py): one `step_XXXXXXXX.pt` that rank 0 writes whole;
- ShardedFormat (training/checkpoint/sharded_format.py): a `step_XXXXXXXX/` folder that every rank
  writes its part of, possibly in the background.

training/checkpoint/folder.py picks the format of a path (`format_of`) or by name (`FORMATS`, a
run's checkpoint_format); nothing else asks which format a checkpoint has. Both hold the same state, so
a checkpoint of either resumes in the other, under any strategy and world size:

- `model`: the unwrapped, uncompiled GPT's state dict (every key of GPT.state_dict());
- `optimizer`: keyed by parameter name, as torch.distributed.checkpoint's
  get_optimizer_state_dict gives it: {"state": {name: {...}}, "param_groups": [{..., "params":
  [names]}]} (a tied weight under its first name);
- `ema` (only where the run keeps an EMA of the weights, training/optim/ema.py, and it has started):
  the average, keyed by parameter name like the model's parameters (a tied weight under its first
  name), float32 (float64 in float64 runs); saved and read like the model;
- beside them, plain Python values: the run's progress (training/run/run.py's Run.progress_state)
  and what wrote it (training/checkpoint/checkpointer.py's checkpoint_metadata), format_version included.
"""

from __future__ import annotations

import re
from concurrent.futures import Future
from typing import Callable, ClassVar, Protocol

import torch

from common.errors import CheckpointError
from model import GPT
from training.core import storage
from training.core.storage import Location
from training.distributed.strategies import Strategy

# 1: the first format. 2: lineage (run_id, checkpoint_id, ancestry) and provenance; no RNG state.
# 3: a file's optimizer state keyed by parameter name, as a sharded folder's always was (a file of
#    1 or 2 is keyed by index: converted on read, see training/checkpoint/file_format.py).
# The sharded format's commit file carries the same number.
FORMAT_VERSION = 3
TENSOR_ENTRIES = ("model", "optimizer")  # the entries that hold tensors; every other one is a plain value
OPTIONAL_TENSOR_ENTRIES = ("ema",)  # tensor entries a checkpoint may lack: the run's extra_tensors()


class TrainingState(Protocol):
    """What a checkpoint is written from and read into: the only view of a run this floor has (training/run/
    run.py's Run is one; training/checkpoint/checkpointer.py writes one, the formats save and load it)."""

    model: GPT  # unwrapped and uncompiled (sharded in place under FSDP)
    optimizer: torch.optim.Optimizer
    strategy: Strategy  # full_state / load_full_state, and env (who writes)
    step: int  # the updates applied: the checkpoint's step
    start_step: int  # the step this launch (or a rollback) loaded: it is on storage already
    resumed_from: Location | None  # the checkpoint this launch resumed (None: a fresh start)

    def state_dict(self) -> dict: ...  # everything a checkpoint holds of the run (a collective under FSDP)

    def progress_state(self) -> dict: ...  # its plain values, the same on every rank

    def evaluation_state(self) -> dict: ...  # those of them that the evaluations at this step change

    def extra_tensors(self) -> dict[str, dict[str, torch.Tensor]]: ...  # entry -> {name: tensor}, like the weights


class CheckpointFormat:
    """One way to lay a checkpoint out. Stateless: training/checkpoint/folder.py holds one instance of each."""

    name: ClassVar[str]  # the checkpoint_format setting that picks it
    suffix: ClassVar[str]  # of its names, step_XXXXXXXX{suffix}: ".pt" for a file, "" for a folder
    writes_in_background: ClassVar[bool] = False  # whether checkpoint_async applies to its saves

    # --- names in a checkpoint folder ------------------------------------------------------------
    def path(self, folder: Location, step: int) -> Location:
        """Where checkpoint `step` of this format goes in the folder."""
        return storage.join(folder, f"step_{step:08d}{self.suffix}")

    def step_of(self, name: str) -> int | None:
        """The step a name of this format says (complete or not); None for any other name."""
        m = re.fullmatch(r"step_(\d{8})" + re.escape(self.suffix), name)
        return int(m.group(1)) if m else None

    def lives_at(self, folder: Location) -> bool:
        """Whether checkpoints of this format are written into (so read from) that folder."""
        return True

    def is_complete(self, path: Location) -> bool:
        """Whether the save of the checkpoint at path (a name of this format) finished."""
        raise NotImplementedError

    def is_leftover(self, path: Location) -> bool:
        """Whether path is what a save that never finished left behind (never a checkpoint)."""
        raise NotImplementedError

    def delete(self, path: Location) -> None:
        """Delete a checkpoint; one whose deletion is cut short is no complete checkpoint."""
        raise NotImplementedError

    # --- writing ---------------------------------------------------------------------------------
    def save(self, run: TrainingState, path: Location, metadata: dict, asynchronous: bool = False,
             process_group=None) -> Future | None:
        """Write the run's model and optimizer, with metadata beside them. Every rank calls it (a collective).

        Returns None once written, or (asynchronous, where writes_in_background) a Future that
        completes when the files are. The checkpoint counts once `commit` returned.
        """
        raise NotImplementedError

    def commit(self, path: Location, metadata: dict, world_size: int) -> None:
        """rank 0, once every rank's save returned (or its Future completed): mark the checkpoint complete."""

    def amend(self, path: Location, entries: dict) -> None:
        """rank 0: replace plain-value entries of the complete checkpoint at path (its figures, once the evaluations
        of its step ran after it was saved), in one atomic write: a failure leaves it as it was, complete."""
        raise NotImplementedError

    # --- reading ---------------------------------------------------------------------------------
    def read_metadata(self, path: Location) -> dict:
        """The checkpoint's entries, its tensors left on storage (choosing a checkpoint reads no tensors);
        a CheckpointError naming it when it is not a readable checkpoint."""
        raise NotImplementedError

    def holds(self, state: dict, key: str) -> bool:
        """Whether the checkpoint (its read_metadata) has the entry."""
        return key in state

    def require_entries(self, state: dict, entries: dict[str, type], path: Location, reader: str) -> dict:
        """state, once every entry `reader` needs is there with its type; else a CheckpointError naming it."""
        for key, kind in entries.items():
            if not self.holds(state, key):
                raise CheckpointError(f"{path}: checkpoint has no '{key}' entry, which {reader} needs "
                                      f"(written by other code, or edited)")
            if key in state and (not isinstance(state[key], kind) or isinstance(state[key], bool)):
                raise CheckpointError(f"{path}: checkpoint entry '{key}' is a {type(state[key]).__name__}, "
                                      f"expected a {kind.__name__}")
        return state

    def load_into(self, run: TrainingState, path: Location, state: dict,
                  adapt_optimizer: Callable[[dict], dict]) -> None:
        """Load the checkpoint's model and optimizer into the run, every rank its part. Collective.

        state: its read_metadata. adapt_optimizer(saved optimizer state, by name) -> the state to load.
        """
        raise NotImplementedError

    def read_model(self, model: torch.nn.Module, path: Location, state: dict) -> None:
        """Copy the checkpoint's model into a whole GPT in this process."""
        raise NotImplementedError

    def read_entry(self, path: Location, state: dict, entry: str, like: dict[str, torch.Tensor]) -> dict:
        """A tensor entry keyed by parameter name (`ema`), whole in this process: `like` gives its names,
        shapes and dtypes; the caller has checked that the checkpoint holds it."""
        raise NotImplementedError

    def read_full_state(self, path: Location, state: dict) -> dict:
        """The whole checkpoint in this process: its entries with `model` and `optimizer` as the module
        docstring says (what consolidation writes, and what tests compare). It holds everything."""
        raise NotImplementedError
