"""The optimizer sections: the optimizer (training/optim/optimizers/), the EMA of the weights (ema.py) and the
loss spikes' skips and rollbacks (spikes.py); the schedule's section is schedule.py's own.

Torch-free, as every settings section is (launch/config.py): the trainer checks a configuration before it imports
torch. The one rule that needs torch, whether this PyTorch runs the optimizer named, is the optimizer's entry's
(training/optim/optimizers/).
"""

from __future__ import annotations

import math

from common.settings import Settings, option, require, section
from training.optim.optimizers import optimizers


def muon_on(config: dict) -> bool:
    """on_resume of Muon's settings: nothing reads them under AdamW. config: the resumed run's keys, flat."""
    return config["optimizer"] == "muon"


@section
class OptimizerSettings(Settings):
    """The optimizer section: which optimizer, and its hyperparameters (its peak lr is the schedule's max_lr)."""

    SECTION = "optimizer"
    SUMMARY = "AdamW (GPT-2/3's) or Muon + AdamW, and gradient clipping"

    optimizer: str = option("adamw", " or ".join(f"{e.name} ({e.help})" for e in optimizers().values())
                            + ". A checkpoint resumes only with the optimizer it was written with",
                            on_resume="trajectory")
    weight_decay: float = option(0.1, "AdamW weight decay, on 2-D weights only", on_resume="trajectory")
    beta1: float = option(0.9, "AdamW beta1", on_resume="trajectory")
    beta2: float = option(0.95, "AdamW beta2", on_resume="trajectory")
    adam_eps: float = option(1e-8, "AdamW epsilon", on_resume="trajectory")
    grad_clip: float = option(1.0, "clip the global gradient norm to this (0: no clipping; the norm is still logged)",
                              on_resume="trajectory")
    muon_lr: float = option(0.02, "muon: peak learning rate of the Muon matrices, scaled by the schedule like "
                                  "max_lr (0.02: Keller Jordan's Muon default; the orthogonalised update has "
                                  "singular values near 1, so this lr is not on AdamW's scale)", on_resume=muon_on)
    muon_momentum: float = option(0.95, "muon: Nesterov momentum (0.95: the Muon paper and modded-nanogpt)",
                                  on_resume=muon_on)
    muon_weight_decay: float = option(0.0, "muon: decoupled weight decay, applied as w *= 1 - lr * wd with the "
                                           "Muon lr (0: as Keller Jordan's Muon and the modded-nanogpt speedruns; "
                                           "torch's default 0.1 is meant for AdamW-sized lrs and would shrink the "
                                           "weights 0.2% a step at lr 0.02)", on_resume=muon_on)

    def validate(self) -> None:
        for key in ("weight_decay", "grad_clip"):
            require(getattr(self, key) >= 0, key, f"must be >= 0, got {getattr(self, key)}")
        for key in ("beta1", "beta2"):
            require(0 <= getattr(self, key) < 1, key, f"must be in [0, 1), got {getattr(self, key)}")
        require(self.adam_eps > 0, "adam_eps", f"must be positive, got {self.adam_eps}")
        require(self.optimizer in optimizers(), "optimizer",
                f"unknown optimizer {self.optimizer!r}; choose {', '.join(optimizers())}")
        require(self.muon_lr >= 0, "muon_lr", f"must be >= 0, got {self.muon_lr}")
        require(0 <= self.muon_momentum < 1, "muon_momentum", f"must be in [0, 1), got {self.muon_momentum}")
        require(self.muon_weight_decay >= 0, "muon_weight_decay", f"must be >= 0, got {self.muon_weight_decay}")
        # whether this PyTorch runs it is checked once torch is imported (optimizers' require_available)


@section
class EMASettings(Settings):
    """The ema section: an average of the weights, evaluated and saved beside them (never trained on)."""

    SECTION = "ema"
    SUMMARY = "an exponential moving average of the weights, evaluated and saved beside them"

    ema_decay: float = option(0.0, "EMA of the weights: average = decay * average + (1 - decay) * weights after "
                                   "each applied update, in (0, 1) (0: off); evaluated beside the live weights "
                                   "(val/ema_loss, hellaswag/ema_acc_norm) and saved with the checkpoints",
                              on_resume="none")  # an average kept beside the weights: the training never reads it
    ema_start: float = option(0.0, "the share of max_steps after which the EMA starts, in [0, 1): it is the "
                                   "weights after update floor(ema_start * max_steps), then averages on (0: from "
                                   "the first update; 0.5: a tail average of the second half); set at a fresh "
                                   "start, kept by resumes", on_resume="none")

    def validate(self) -> None:
        require(self.ema_decay == 0 or 0 < self.ema_decay < 1, "ema_decay",
                f"must be 0 (off) or in (0, 1), got {self.ema_decay}")
        require(0 <= self.ema_start < 1, "ema_start", f"must be in [0, 1), got {self.ema_start}")

    def start_step(self, max_steps: int) -> int:
        """The first update the average holds (max_steps: the schedule section's), as a fresh run sets it."""
        return math.floor(self.ema_start * max_steps)


def spike_skip_on(config: dict) -> bool:
    """on_resume of the spike settings: another value changes the training math only while spike_skip is on (off,
    nothing reads them). config: the resumed run's keys, flat."""
    return config["spike_skip"]


def rollbacks_on(config: dict) -> bool:
    """on_resume of what steers the rollbacks (how many, and, through the checkpoint cadence, where to): nothing
    changes while neither rollback_after nor rollback_on_nonfinite asks for them."""
    return bool(config["rollback_after"] or config["rollback_on_nonfinite"])


@section
class LongRunSettings(Settings):
    """The long-run section: which updates are skipped as spikes, and when the run rolls back instead."""

    SECTION = "long_run"
    SUMMARY = "loss spikes: skipped updates and rollbacks"

    spike_skip: bool = option(False, "skip an update whose loss or grad norm is more than spike_threshold standard "
                                     "deviations above the mean of the last spike_window applied steps (every rank "
                                     "skips the same one; a skip record says why)", on_resume="trajectory")
    spike_window: int = option(128, "applied steps in the spike window; nothing is skipped until it is full",
                               on_resume=spike_skip_on)
    spike_threshold: float = option(6.0, "standard deviations above the window's mean that make a spike",
                                    on_resume=spike_skip_on)
    rollback_after: int = option(0, "after N skipped steps in a row, reload the newest checkpoint and continue past "
                                    "the batches since it (0: never; needs spike_skip)", on_resume=spike_skip_on)
    rollback_on_nonfinite: bool = option(False, "a NaN/inf loss or grad norm rolls back like rollback_after instead "
                                                "of stopping the run (exit 3)", on_resume="trajectory")
    max_rollbacks: int = option(3, "rollbacks in one run; the next one stops it with an error (exit 3)",
                                on_resume=rollbacks_on)

    def validate(self) -> None:
        for key in ("rollback_after", "max_rollbacks"):
            require(getattr(self, key) >= 0, key, f"must be >= 0, got {getattr(self, key)}")
        require(self.spike_window >= 2, "spike_window", f"must be >= 2, got {self.spike_window}")
        require(self.spike_threshold > 0, "spike_threshold", f"must be positive, got {self.spike_threshold}")
        require(not self.rollback_after or self.spike_skip, "rollback_after",
                "counts skipped steps, so it needs spike_skip: true")
