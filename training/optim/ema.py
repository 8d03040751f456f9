"""An exponential moving average (EMA) of the weights, the `ema_decay` and `ema_start` keys.

After each applied optimizer update of step s >= start (start = floor(ema_start * max_steps) when the
run starts fresh, or when a resume turns it on, but no earlier than the checkpoint's step, the first
update that run makes; then kept as the run's state, so a resume with another max_steps keeps it),

    average = ema_decay * average + (1 - ema_decay) * weights      (one lerp per tensor)

and at the first such step the average is the weights themselves. A skipped update (a NaN
verdict, a loss spike, float16's overflow) is not folded in. The average is one tensor per
parameter, laid out like it (under FSDP a DTensor with the parameter's shard), in float32 (float64
in a float64 run): every rank updates its own part with torch._foreach ops on the device, with no
host synchronisation and no collective. It never feeds back into the training: with it on the
live weights, losses and checkpointed optimizer state are those of a run without it.

It is part of the run's state: saved in both checkpoint formats beside the model (`ema`, keyed by
parameter name), resumed exactly (launch/resume.py loads it, and the start its run kept),
and evaluated beside the live weights (evals/periodic.py swaps it
in for the evaluation, and back out). The readers (sample.py, export_hf.py, eval_lm.py) take it
with `--weights ema`.
"""

from __future__ import annotations

import contextlib
from typing import TypedDict

import torch

from runtime.fit import tensors_problem
from training.distributed.strategies import full_tensors, is_sharded, load_full_tensors, local_part


class EMAState(TypedDict):
    """The checkpoint's ema_state entry: what WeightAverage.load_state_dict reads."""

    decay: float
    start_step: int
    updates: int


class WeightAverage:
    """The EMA of a model's parameters (see the module docstring). Every rank holds one and does the same work."""

    def __init__(self, decay: float, start_step: int):
        self.decay, self.start_step = decay, start_step
        self.average: dict[str, torch.Tensor] | None = None  # parameter name -> average; None until start_step
        self.updates = 0  # updates folded in (the first one included)

    @property
    def ready(self) -> bool:
        """Whether there is an average (the same on every rank: decided by the step alone)."""
        return self.average is not None

    @torch.no_grad()
    def update(self, model: torch.nn.Module, step: int) -> None:
        """Fold in the weights after the applied update of `step`. No host sync, no collective."""
        if step < self.start_step:
            return
        if self.average is None:
            self.allocate(model)
        else:
            params = dict(model.named_parameters())
            torch._foreach_lerp_([local_part(a) for a in self.average.values()],
                                 [local_part(params[name]) for name in self.average], 1.0 - self.decay)
        self.updates += 1

    @torch.no_grad()
    def allocate(self, model: torch.nn.Module) -> None:
        """The average set to the model's weights (each laid out like its parameter)."""
        # float32, or the parameter's own dtype where that is wider (float64 runs)
        self.average = {name: p.detach().to(dtype=torch.promote_types(p.dtype, torch.float32), copy=True)
                        for name, p in model.named_parameters()}  # a tied weight once, under its first name

    # --- state: the checkpoint's ema_state entry (this), and its ema entry (AverageTensors) -----------
    def state_dict(self) -> EMAState:
        """Plain values (also before the start: start_step is state)."""
        return {"decay": self.decay, "start_step": self.start_step, "updates": self.updates}

    def load_state_dict(self, saved: EMAState) -> None:
        """Go on from a checkpoint's start and count (before AverageTensors: an average not started is dropped). Its
        run kept no EMA (decay 0): this run's start, but no earlier than saved's, the checkpoint's step."""
        self.start_step = saved["start_step"] if saved["decay"] else max(self.start_step, saved["start_step"])
        self.updates = saved["updates"]
        if not self.updates:
            self.average = None

    # --- evaluation ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def swapped_in(self, model: torch.nn.Module):
        """The average in the model's parameters for the context's duration, the live weights kept in the
        average's tensors meanwhile; both are back, bitwise, on exit (an exchange of equal dtypes is
        exact). Every rank swaps its own part: no collective. Enter it before the strategy's evaluation
        context, whose gathers then see the average."""
        self._exchange(model)
        try:
            yield
        finally:
            self._exchange(model)

    @torch.no_grad()
    def _exchange(self, model: torch.nn.Module) -> None:
        params = dict(model.named_parameters())
        for name, tensor in self.average.items():
            if is_sharded(params[name]) != is_sharded(tensor):
                # FSDP registers gathered copies while a module is unsharded: a swap into them would be undone
                # by the next gather from the shards, or lost (the strategy's evaluation context reshards on exit)
                raise RuntimeError(f"{name}: the EMA swaps with the parameters' shards, but the model holds it "
                                   f"gathered; reshard it first")
            live, average = local_part(params[name]), local_part(tensor)
            if live.dtype != average.dtype:  # weights are float32 or float64, as the average is
                raise TypeError(f"{name}: weights of {live.dtype} cannot exchange with an average of {average.dtype}")
            kept = live.clone()
            live.copy_(average)
            average.copy_(kept)


class AverageTensors:
    """The average as a part of the run's state (a TensorPart): the checkpoint's `ema` entry, once it started. The
    EMA's own entry, loaded first, says whether it had: then its tensors are allocated, to read the saved ones into."""

    def __init__(self, ema: WeightAverage, model: torch.nn.Module, master_process: bool):
        self.ema, self.model, self.master_process = ema, model, master_process

    def state_dict(self) -> dict:
        if self.ema.updates and not self.ema.ready:  # loading an average that had started
            self.ema.allocate(self.model)
        return self.ema.average or {}

    def load_state_dict(self, state: dict) -> None:
        load_full_tensors(self.state_dict(), state)  # DCP's tensors, read in place, or a file's whole ones

    def full_state_dict(self) -> dict:
        return full_tensors(self.ema.average, self.master_process) if self.ema.ready else {}

    load_full_state_dict = load_state_dict

    def problem(self, saved: dict) -> str | None:
        """An average of every parameter (a tied one under its first name), of its shape."""
        return tensors_problem(saved, dict(self.model.named_parameters()))
