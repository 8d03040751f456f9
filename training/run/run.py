"""A training run: its state in one place, what a checkpoint holds of it.

launch/build.py builds it at launch (fresh, or continued from the checkpoint that
launch/resume.py picks and loads); training/checkpoint/checkpointer.py writes its
state as a checkpoint. A checkpoint `step_s` holds the state after s updates.
"""

from __future__ import annotations

import copy
import typing
import uuid
from dataclasses import dataclass, field, fields
from typing import TypedDict

import torch

from data.loader import TrainLoader, ValLoader
from data.mixture import MixtureLoader, MixtureState
from model import GPT
from runtime.fit import value_problem
from training.checkpoint.format import ModelState, OptimizerState, TensorPart
from runtime.storage import Location
from training.distributed.strategies import Strategy
from training.optim.ema import AverageTensors, WeightAverage
from training.optim.spikes import SpikeWindow


STATE = {"state": True}  # the metadata of a field of the run's own state: the checkpoint entry of its name


@dataclass
class Run:
    """What one process holds between steps. `model` is the unwrapped, uncompiled module:
    checkpoints, evaluation and sampling use it; the training forward goes through its
    compiled / DDP wrapper.

    Its state, what a checkpoint holds, is its parts (`parts`: the model, the optimizer, float16's loss scale, the
    EMA of the weights, the spike window, where each source of the train data stands) and its own values (fields
    of STATE: the step, the tokens seen, the lineage, the latest figures and whether they are the final ones, the
    W&B run id, the skips in a row, the rollbacks and the batches they passed over). Nothing else is needed to
    resume exactly: the data position is a function of the step, data_offset and where each source stood, and
    dropout masks are reseeded from (seed, step, rank) every step.
    """

    model: GPT
    optimizer: torch.optim.Optimizer
    strategy: Strategy  # how model and optimizer are spread over the ranks
    scaler: torch.amp.GradScaler  # float16's loss scale (a no-op in every other dtype)
    # one folder, or several mixed by weight (data/mixture.py); None: a run without data, whose checkpoints
    # benchmarks/bench_checkpoint.py times
    train_loader: TrainLoader | MixtureLoader | None
    val_loaders: dict[str, ValLoader]  # the val sets by name (one, `val`, by default)
    grad_accum_steps: int
    data_fingerprint: str  # of the shards in data_dir (each source's, for a mixture): data/mixture.py
    spikes: SpikeWindow | None = None  # with spike_skip: the recent steps a spike is judged against
    ema: WeightAverage | None = None  # with ema_decay: the average of the weights (training/optim/ema.py)
    # --- its own state
    step: int = field(default=0, metadata=STATE)  # optimizer updates applied so far
    tokens_seen: int = field(default=0, metadata=STATE)
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex, metadata=STATE)  # drawn fresh, kept by resumes
    # checkpoint_ids it resumed from, oldest first (None: one of format_version 1, which had none)
    ancestry: list[str | None] = field(default_factory=list, metadata=STATE)
    metrics: dict = field(default_factory=dict, metadata=STATE)  # the latest val / HellaSwag figures
    # the step whose final evaluations (those after the last step) are logged, and in metrics: a checkpoint of that
    # step is of a finished run. None until then; a stop at the last step saves before them, and the relaunch runs them
    finished_at: int | None = field(default=None, metadata=STATE)
    wandb_run_id: str | None = field(default=None, metadata=STATE)  # set on rank 0 when W&B starts (a resume goes on)
    skips_in_a_row: int = field(default=0, metadata=STATE)  # spikes skipped since the last applied update
    rollbacks: int = field(default=0, metadata=STATE)  # rollbacks so far in this run (max_rollbacks bounds them)
    data_offset: int = field(default=0, metadata=STATE)  # step s trains on the data of step s + data_offset (rollbacks)
    # --- this launch
    start_step: int = 0  # where this launch began: 0, or the step of the checkpoint it resumed
    resumed_from: Location | None = None  # the checkpoint it resumed (a rollback candidate, wherever it lies)
    resumed_step: int = 0  # and its step
    # every key, flat, as this launch runs them: the validated configuration's, with the B micro_batch_size auto
    # chose (config.yaml, W&B and every checkpoint store it; a resume compares it with the checkpoint's)
    config: dict = field(default_factory=dict)
    checkpoints: Location | None = None  # the run's checkpoint folder (None: a run that saves none)
    micro_batch_size: int = 0  # B, set or chosen (micro_batch_size auto)
    micro_batch: dict | None = None  # micro_batch_size auto: how this launch chose it (run.json)

    @property
    def val_loader(self) -> ValLoader:
        """The first val set: the one the val loss of the console and the checkpoints' metrics is."""
        return next(iter(self.val_loaders.values()))

    def parts(self) -> dict:
        """Every part with state (torch.distributed.checkpoint's Stateful: state_dict / load_state_dict), under its
        checkpoint entry: registered here, once. The tensor parts (training/checkpoint/format.py's TensorPart) are
        saved as each format saves tensors; the others' state is plain values."""
        parts = {"model": ModelState(self.model), "scaler": LossScale(self.scaler),
                 "optimizer": OptimizerState(self.model, self.optimizer)}
        if isinstance(self.train_loader, MixtureLoader):  # one folder's position is a function of the step alone
            parts["mixture"] = DataPosition(self.train_loader, self)
        if self.ema is not None:
            parts["ema"] = AverageTensors(self.ema, self.model, self.strategy.env.master_process)
            parts["ema_state"] = self.ema
        if self.spikes is not None:
            parts["spike_window"] = self.spikes
        return parts

    def state_dict(self) -> dict:
        """A checkpoint's plain entries, the same on every rank: the run's own values (copied: a save in flight
        keeps them as they were) and its plain parts' state (the tensor parts are the formats' to save)."""
        own = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.metadata.get("state")}
        return {**own, **{name: part.state_dict() for name, part in self.parts().items()
                          if not isinstance(part, TensorPart)}}

    def load_state_dict(self, state: dict) -> list[str]:
        """A checkpoint's plain entries back (launch/resume.py's current_layout). One it lacks or holds empty (its run
        had no loss scale, no spike window, one folder) leaves its part as it is. What a part says changed, in words."""
        for f in fields(self):
            if f.metadata.get("state"):
                setattr(self, f.name, copy.deepcopy(state[f.name]))
        said = [part.load_state_dict(state[name]) for name, part in self.parts().items()
                if not isinstance(part, TensorPart) and state.get(name)]
        return [words for words in said if words]

    def state_problem(self, state: dict) -> tuple[str, str] | None:
        """The first of a checkpoint's plain entries (in this code's layout) that load_state_dict could not load, and
        what is wrong with it (runtime/fit.py's words); None when they all fit. One of the run's own values
        must be of its field's type; a plain part's state (one it would load: not empty) of the type its state_dict
        returns."""
        types = typing.get_type_hints(Run)
        for f in fields(self):
            if f.metadata.get("state"):
                if f.name not in state:
                    return f.name, " is missing"
                if problem := value_problem(state[f.name], types[f.name]):
                    return f.name, problem
        for name, part in self.parts().items():
            if not isinstance(part, TensorPart) and state.get(name):
                kind = typing.get_type_hints(part.state_dict).get("return", dict)
                if problem := value_problem(state[name], kind):
                    return name, problem
        return None

    def evaluation_state(self) -> dict:
        """What the evaluations at this step change of a checkpoint's entries: the latest figures, and whether they
        are the final ones (a checkpoint saved before its final evaluations gets these once they ran)."""
        return {"metrics": dict(self.metrics), "finished_at": self.finished_at}


class DataPosition:
    """Where the train data stands after the run's step, as a part of its state (`mixture`; data/mixture.py)."""

    def __init__(self, loader: MixtureLoader, run: Run):
        self.loader, self.run = loader, run

    def state_dict(self) -> MixtureState:
        return self.loader.state_dict(self.run.step, self.run.step + self.run.data_offset)

    def load_state_dict(self, state: MixtureState) -> str | None:
        return self.loader.load_state_dict(state)


class LossScaleState(TypedDict):
    """The checkpoint's scaler entry: torch.amp.GradScaler's state_dict, the fields it documents."""

    scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    _growth_tracker: int


class LossScale:
    """float16's loss scale as a part of the run's state (`scaler`): torch's GradScaler, with the type of its state
    said (Run.state_problem checks a checkpoint's against it). A scaler that is off (any dtype but float16) saves
    {} and loads nothing."""

    def __init__(self, scaler: torch.amp.GradScaler):
        self.scaler = scaler

    def state_dict(self) -> LossScaleState:
        return self.scaler.state_dict()

    def load_state_dict(self, state: LossScaleState) -> None:
        self.scaler.load_state_dict(state)
