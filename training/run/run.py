"""A training run: its state in one place, what a checkpoint holds of it.

launch/build.py builds it at launch (fresh, or continued from the checkpoint that
launch/resume.py picks and loads); training/checkpoint/checkpointer.py writes its
state_dict as a checkpoint. A checkpoint `step_s` holds the state after s updates.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import torch

from data.loader import TrainLoader, ValLoader
from data.mixture import MixtureLoader
from model import GPT
from training.core.storage import Location
from training.distributed.strategies import Strategy, full_tensors
from training.optim.ema import WeightAverage
from training.optim.spikes import SpikeWindow


@dataclass
class Run:
    """What one process holds between steps. `model` is the unwrapped, uncompiled module:
    checkpoints, evaluation and sampling use it; the training forward goes through its
    compiled / DDP wrapper.

    Its state, what a checkpoint holds, is `state_dict()` (it goes back with launch/resume.py's
    `load_state`):
    the model, the optimizer, float16's loss scale, the step, the tokens seen, the lineage, the
    latest evaluation figures and whether they are the final ones, the W&B run id, and what steers a
    long run (the spike window, skips in a row, rollbacks and the batches they passed over).
    Nothing else is needed to resume exactly: the data position is a function of the step and
    data_offset (data/loader.py), and of where each source of a mixture stood (its `mixture`
    entry, data/mixture.py), and dropout masks are reseeded from (seed, step, rank) every step.
    """

    model: GPT
    optimizer: torch.optim.Optimizer
    strategy: Strategy  # how model and optimizer are spread over the ranks
    scaler: torch.amp.GradScaler  # float16's loss scale (a no-op in every other dtype)
    # one folder, or several mixed by weight (data/mixture.py); None: a run without data, whose checkpoints
    # scripts/bench_checkpoint.py times
    train_loader: TrainLoader | MixtureLoader | None
    val_loaders: dict[str, ValLoader]  # the val sets by name (one, `val`, by default)
    grad_accum_steps: int
    data_fingerprint: str  # of the shards in data_dir (each source's, for a mixture): data/mixture.py
    # --- the state (state_dict / load_state_dict)
    step: int = 0  # optimizer updates applied so far
    tokens_seen: int = 0
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # drawn by a fresh start, kept by resumes
    ancestry: list[str] = field(default_factory=list)  # checkpoint_ids this run resumed from, oldest first
    metrics: dict = field(default_factory=dict)  # the latest val / HellaSwag figures
    # the step whose final evaluations (those after the last step) are logged, and in metrics: a checkpoint of that
    # step is of a finished run. None until then; a stop at the last step saves before them, and the relaunch runs them
    finished_at: int | None = None
    wandb_run_id: str | None = None  # set on rank 0 when W&B starts (a resume continues that W&B run)
    spikes: SpikeWindow | None = None  # with spike_skip: the recent steps a spike is judged against
    ema: WeightAverage | None = None  # with ema_decay: the average of the weights (training/optim/ema.py)
    skips_in_a_row: int = 0  # spikes skipped since the last applied update
    rollbacks: int = 0  # rollbacks so far in this run (max_rollbacks bounds them)
    data_offset: int = 0  # batches passed over by rollbacks: step s trains on the data of step s + data_offset
    # --- this launch
    start_step: int = 0  # where this launch began: 0, or the step of the checkpoint it resumed
    resumed_from: Location | None = None  # the checkpoint it resumed (a rollback candidate, wherever it lies)
    resumed_step: int = 0  # and its step
    micro_batch: dict | None = None  # micro_batch_size auto: how this launch chose it (run.json)

    @property
    def val_loader(self) -> ValLoader:
        """The first val set: the one the val loss of the console and the checkpoints' metrics is."""
        return next(iter(self.val_loaders.values()))

    def state_dict(self) -> dict:
        """Tensors and plain Python values only (loads with torch.load(weights_only=True)).

        A collective: under FSDP the model and optimizer are gathered onto rank 0's CPU (the
        other ranks get empty dicts for them); the optimizer's state is keyed by parameter name.
        The file format writes it; the sharded format saves the same entries: the model and
        optimizer through DCP, each rank its part, and `progress_state()` beside them.
        """
        model_state, optimizer_state = self.strategy.full_state(self.model, self.optimizer)
        extra = {entry: full_tensors(tensors, self.strategy.env.master_process)
                 for entry, tensors in self.extra_tensors().items()}  # gathered like the model
        return {"model": model_state, "optimizer": optimizer_state, **extra, **self.progress_state()}

    def extra_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """The tensor entries beside the model and optimizer, each keyed by parameter name and laid out like
        the parameters (this rank's shards under FSDP): the EMA of the weights, once it has started."""
        return {"ema": self.ema.average} if self.ema is not None and self.ema.ready else {}

    def evaluation_state(self) -> dict:
        """What the evaluations at this step change of a checkpoint's entries: the latest figures, and whether they
        are the final ones (a checkpoint saved before its final evaluations gets these once they ran)."""
        return {"metrics": dict(self.metrics), "finished_at": self.finished_at}

    def progress_state(self) -> dict:
        """The state beside the model and optimizer: plain Python values, the same on every rank."""
        return {
            "scaler": self.scaler.state_dict(),  # {} unless float16
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "run_id": self.run_id,
            "ancestry": list(self.ancestry),
            **self.evaluation_state(),
            "wandb_run_id": self.wandb_run_id,
            "ema_state": self.ema.progress_state() if self.ema is not None else None,  # its start, before it too
            # a mixture: each source's rows read and tokens given (None: one folder)
            "mixture": (self.train_loader.state_dict(self.step, self.step + self.data_offset)
                        if self.train_loader is not None else None),
            "long_run": {"spike_window": self.spikes.state_dict() if self.spikes else None,
                         "skips_in_a_row": self.skips_in_a_row, "rollbacks": self.rollbacks,
                         "data_offset": self.data_offset},
        }
