"""What a checkpoint format is: the one interface both formats implement, and the state they both hold.

Two formats lay a checkpoint `step_s` (the state after s optimizer updates) out on storage:

- FileFormat (training/checkpoint/file_format.py): one `step_XXXXXXXX.pt` that rank 0 writes whole;
- ShardedFormat (training/checkpoint/sharded_format.py): a `step_XXXXXXXX/` folder that every rank
  writes its part of, possibly in the background.

training/checkpoint/folder.py picks the format of a path (`format_of`) or by name (`FORMATS`, a
run's checkpoint_format); nothing else asks which format a checkpoint has. Both hold the same state, so
a checkpoint of either resumes in the other, under any strategy and world size: the run's parts
(training/run/run.py's Run.parts), each under its entry. Those that hold tensors (TensorPart, below):

- `model`: the unwrapped, uncompiled GPT's state dict (every key of GPT.state_dict());
- `optimizer`: keyed by parameter name, as torch.distributed.checkpoint's
  get_optimizer_state_dict gives it: {"state": {name: {...}}, "param_groups": [{..., "params":
  [names]}]} (a tied weight under its first name);
- `ema` (only where the run keeps an EMA of the weights, training/optim/ema.py, and it has started):
  the average, keyed by parameter name like the model's parameters (a tied weight under its first
  name), float32 (float64 in float64 runs); saved and read like the model.

Every other entry is a plain Python value, the same on every rank: the other parts' state and the run's own
values (Run.state_dict), and what wrote the checkpoint (training/checkpoint/checkpointer.py's
checkpoint_metadata), format_version included.

Before a checkpoint is loaded into a run, every entry its parts load is checked against them (`check_fits`,
runtime/fit.py): one that does not fit is a DamagedCheckpointError naming the file and the entry,
raised while nothing of it is loaded yet.
"""

from __future__ import annotations

import re
from concurrent.futures import Future
from typing import ClassVar, Protocol, runtime_checkable

import torch

from common.errors import CheckpointError
from model import GPT
from runtime.fit import optimizer_problem, tensors_problem
from runtime import storage
from runtime.storage import Location
from training.distributed.strategies import (Strategy, by_index, by_name, is_sharded, own_cpu_state,
                                             parameter_names)

# 1: the first format. 2: lineage (run_id, checkpoint_id, ancestry) and provenance; no RNG state.
# 3: a file's optimizer state keyed by parameter name, as a sharded folder's always was (a file of
#    1 or 2 is keyed by index: converted on read, see training/checkpoint/file_format.py).
# 4: an entry per part: 3's long_run split into the spike window, skips in a row, rollbacks and data offset
#    (launch/resume.py's current_layout converts checkpoints of older code).
# The sharded format's commit file carries the same number.
FORMAT_VERSION = 4
TENSOR_ENTRIES = ("model", "optimizer")  # the tensor entries every checkpoint holds (the EMA's, only once it started)


class DamagedCheckpointError(CheckpointError):
    """A checkpoint that reads, but whose entries do not fit the run that loads it: a tensor missing, one too many,
    of another shape or kind, a plain entry without its fields (damaged, or edited). Found before anything of it
    is loaded: a launch that chose it itself sets it aside, as one that does not read (launch/resume.py)."""


def damaged(path: Location, entry: str, problem: str) -> DamagedCheckpointError:
    """The error for an entry of the checkpoint at path that does not fit (problem: runtime/fit.py's)."""
    return DamagedCheckpointError(f"{path}: checkpoint entry {entry!r}{problem} (damaged, or edited)")


@runtime_checkable
class TensorPart(Protocol):
    """A part (Stateful) whose state is tensors laid out like the parameters. state_dict / load_state_dict: this
    rank's part, which DCP saves and reads back in place, resharded; full_state_dict / load_full_state_dict: whole,
    gathered onto rank 0 (a collective) / every rank keeping its part. {}: nothing to save (an EMA not started)."""

    def full_state_dict(self) -> dict: ...

    def load_full_state_dict(self, state: dict) -> None: ...

    def problem(self, saved: dict) -> str | None: ...  # what in its checkpoint entry does not fit it (fit.py's words)


def _dcp():
    """torch.distributed.checkpoint's state dict functions, imported where used: the import takes a second."""
    import torch.distributed.checkpoint.state_dict as dcp_state

    return dcp_state


class ModelState:
    """The model's weights as a part of the run's state: the `model` entry, DCP's model state dict."""

    def __init__(self, model: GPT):
        self.model = model

    def state_dict(self) -> dict:
        return _dcp().get_model_state_dict(self.model)

    def load_state_dict(self, state: dict) -> None:
        _dcp().set_model_state_dict(self.model, state)

    def full_state_dict(self) -> dict:  # parameters spread over the ranks: gathered onto rank 0's CPU
        return _dcp().get_model_state_dict(self.model, options=_dcp().StateDictOptions(
            full_state_dict=True, cpu_offload=spread(self.model)))

    def load_full_state_dict(self, state: dict) -> None:
        _dcp().set_model_state_dict(self.model, state, options=_dcp().StateDictOptions(full_state_dict=True))

    def problem(self, saved: dict) -> str | None:
        """Every tensor of the model's state dict, of its shape; a tied weight's second name may be missing (the
        sharded format keeps one). DCP's full-state load would fill a missing one from the model as it is."""
        tensors = self.model.state_dict(keep_vars=True)  # under FSDP DTensors, of the whole shape
        first = {}
        tied = [name for name, tensor in tensors.items() if first.setdefault(id(tensor), name) != name]
        return tensors_problem(saved, tensors, optional=tied)


class OptimizerState:
    """The optimizer's state as a part of the run's state: the `optimizer` entry, keyed by parameter name; loaded
    with this run's settings (with_current_settings)."""

    def __init__(self, model: GPT, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return _dcp().get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        _dcp().set_optimizer_state_dict(self.model, self.optimizer, with_current_settings(state, self.optimizer))

    def full_state_dict(self) -> dict:
        """Spread over the ranks (FSDP): gathered onto rank 0's CPU. Else its own state dict, indices named: DCP's
        without the zero-gradient step DCP takes to fill an optimizer with no state yet (float16's skipped updates)."""
        if spread(self.model):
            return _dcp().get_optimizer_state_dict(self.model, self.optimizer, options=_dcp().StateDictOptions(
                full_state_dict=True, cpu_offload=True))
        return by_name(self.optimizer.state_dict(), parameter_names(self.model, self.optimizer))

    def load_full_state_dict(self, state: dict) -> None:
        state = with_current_settings(state, self.optimizer)
        if spread(self.model):  # every rank keeps its shard
            _dcp().set_optimizer_state_dict(self.model, self.optimizer, state,
                                            options=_dcp().StateDictOptions(full_state_dict=True))
        else:  # as it is (DCP's would turn this run's settings' tuples into lists)
            self.optimizer.load_state_dict(by_index(state, parameter_names(self.model, self.optimizer)))
        own_cpu_state(self.optimizer)

    def problem(self, saved: dict) -> str | None:
        """Its groups of this optimizer's parameters, and each parameter's state of its shape: torch's
        Optimizer.load_state_dict takes a moment of any shape, which the first step then fails on."""
        names, groups = iter(parameter_names(self.model, self.optimizer)), []
        for group in self.optimizer.param_groups:
            groups.append([next(names) for _ in group["params"]])
        return optimizer_problem(saved, groups, dict(self.model.named_parameters()))


def spread(model: GPT) -> bool:
    """Whether the model's parameters are spread over the ranks (DTensors: FSDP)."""
    return any(is_sharded(p) for p in model.parameters())


def with_current_settings(saved: dict, optimizer: torch.optim.Optimizer) -> dict:
    """The saved optimizer state (AdamW moments, step counts) with every setting of this run: its lr, betas, eps,
    weight decay and kernel choice replace the old run's, so a resume with changed settings trains with what
    config.yaml says (weight decay stays on the decay group only)."""
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved['param_groups'])} parameter groups, "
                              f"this run's {len(optimizer.param_groups)}")
    groups = [{**group, **{k: v for k, v in current.items() if k != "params"}}
              for group, current in zip(saved["param_groups"], optimizer.param_groups)]
    return {**saved, "param_groups": groups}


class TrainingState(Protocol):
    """What a checkpoint is written from and read into: the only view of a run this floor has (training/run/
    run.py's Run is one; training/checkpoint/checkpointer.py writes one, the formats save and load it)."""

    model: GPT  # unwrapped and uncompiled (sharded in place under FSDP)
    strategy: Strategy  # env: who writes
    step: int  # the updates applied: the checkpoint's step
    start_step: int  # the step this launch (or a rollback) loaded: it is on storage already
    resumed_from: Location | None  # the checkpoint this launch resumed (None: a fresh start)

    def parts(self) -> dict: ...  # every part with state (DCP's Stateful), under its entry

    def state_dict(self) -> dict: ...  # the plain entries, the same on every rank

    def load_state_dict(self, state: dict) -> list[str]: ...  # them back; what changed since, in words

    def state_problem(self, state: dict) -> tuple[str, str] | None: ...  # the first of them that does not fit, and why

    def evaluation_state(self) -> dict: ...  # those of them that the evaluations at this step change


def tensor_parts(run: TrainingState) -> dict[str, TensorPart]:
    """The run's parts that hold tensors laid out like the parameters, by entry."""
    return {name: part for name, part in run.parts().items() if isinstance(part, TensorPart)}


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
        """Write the run's tensor parts, with metadata (the plain entries) beside them. Every rank calls it (a
        collective).

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

    def tensor_layout(self, path: Location, state: dict) -> dict:
        """The checkpoint's tensor entries (state: its read_metadata), keyed as the module docstring says, each tensor
        with its shape and dtype, its data left on storage: what check_fits compares with the run's parts."""
        raise NotImplementedError

    def check_fits(self, run: TrainingState, path: Location, state: dict) -> None:
        """Check every entry the run's parts would load from the checkpoint (state: its read_metadata, in this code's
        layout) against them, before anything is loaded: the run's own values and plain parts (Run.state_problem),
        and the tensor parts it holds (each part's `problem`). A DamagedCheckpointError names the first that does
        not fit. Every rank checks its own run, without a collective."""
        problem = run.state_problem(state)
        if problem is None:
            layout = self.tensor_layout(path, state)
            problem = next(((name, words) for name, part in tensor_parts(run).items()
                            if name in layout and (words := part.problem(layout[name]))), None)
        if problem is not None:
            raise damaged(path, *problem)

    def load_into(self, run: TrainingState, path: Location, state: dict) -> list[str]:
        """Load the checkpoint (state: its read_metadata, in this code's layout: launch/resume.py's current_layout)
        into the run's parts, every rank its part. Collective. What changed since it was written, in words. The
        plain entries first: they say which tensors a part expects (the EMA's count: whether its average started)."""
        changes = run.load_state_dict(state)
        parts = {name: part for name, part in tensor_parts(run).items() if self.holds(state, name) or part.state_dict()}
        self.load_tensors(self.require_entries(state, dict.fromkeys(parts, dict), path, "resuming"), parts, path)
        return changes

    def load_tensors(self, state: dict, parts: dict[str, TensorPart], path: Location) -> None:
        """Read the checkpoint's tensor entries into those parts, every rank its part."""
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
