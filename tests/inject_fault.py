"""Run train_gpt2.py with a fault injected into one rank's training step (fault-injection tests only).

    torchrun ... tests/inject_fault.py TRAINER_ARGS...
    with FAULT=nan|batch|hang|signal, FAULT_STEP=s, FAULT_RANK=r in the environment,
    or FAULT=spike, FAULT_POSITIONS=p1,p2,..., FAULT_FACTOR=f (default 1000; nan for a NaN loss)
    or FAULT=slow, FAULT_RANK=r, FAULT_SLEEP=seconds (default 0.2), FAULT_STEP=s (default: from the first step),
       FAULT_MARK=path (created as step s's pause begins: a signal sent once it exists lands inside step s)
    or FAULT=slow_exit, FAULT_RANK=r, FAULT_SLEEP=seconds (default 60)
    or FAULT=unreadable_checkpoint|missing_init_from, FAULT_RANK=r

The trainer runs unchanged; only the step function it is given differs, and only on rank r at
optimizer step s (counted from the run's first step, 0):
  nan:   a weight of rank r's replica becomes NaN before the step, so its loss is NaN;
  batch: rank r cannot read its first micro-batch of the step (a DataError from the batches);
  hang:  rank r stops responding (sleeps) before the step, as a hung GPU or a deadlock would;
  signal: rank r gets a SIGTERM during the step, after the step read its stop flag (the next vote
         carries it), as a preemption landing mid-step would.
The trainer must notice on its own and stop every rank (one line each, or a timeout), or, for a
signal, save and stop as a preemption does.

slow: rank r sleeps before every step's work, as a slower GPU would compute: a straggler (with
FAULT_STEP=s, before the work of step s and of every step after it).

slow_exit: rank r's process-group teardown at the end lasts until a signal reaches it (at most
FAULT_SLEEP s), as NCCL's teardown can take seconds: the other ranks end first, and torchrun
then sends rank r SIGTERM while it is still tearing down.

unreadable_checkpoint: rank r cannot read the tensors of the checkpoint file it resumes (a CheckpointError where
the file format reads them), as a read error of its node's storage would have it; missing_init_from: rank r does
not find the init_from file, as a node without it would not. Both before the first step: an error that rank
alone sees during start-up.

spike is a property of the data, as a real spike's cause would be: on every rank, the loss of
the steps that read the batches of the given data positions (step + data_offset) is multiplied
by f, and so are its gradients. A rollback that passes over those batches leaves the spike behind.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from pathlib import Path

import torch

import train_gpt2  # the repository is on PYTHONPATH (tests/conftest.py's run_trainer)
from common.errors import CheckpointError, DataError, run_cli

FAULT = os.environ["FAULT"]
FAULT_STEP = int(os.environ.get("FAULT_STEP", -1))
FAULT_POSITIONS = {int(p) for p in os.environ.get("FAULT_POSITIONS", "").split(",") if p}
FAULT_FACTOR = float(os.environ.get("FAULT_FACTOR", "1000"))
ON_THIS_RANK = int(os.environ.get("RANK", 0)) == int(os.environ.get("FAULT_RANK", "0"))


class UnreadableFirstBatch:
    """The batches of a step whose first micro-batch this rank cannot read."""

    def __init__(self, batches):
        self.batches = batches

    def get(self, step: int, micro_step: int):
        if micro_step == 0:
            self.batches.get(step, micro_step)  # consumed, as a real read would be
            raise DataError(f"injected: rank {os.environ.get('RANK', 0)} could not read step {step}")
        return self.batches.get(step, micro_step)


class ScaledLoss:
    """The training model, with its loss (and so its gradients) multiplied by a factor."""

    def __init__(self, model, factor: float):
        self.model, self.factor = model, factor

    def __call__(self, *args, **kwargs):
        logits, loss = self.model(*args, **kwargs)
        return logits, loss * self.factor

    def __getattr__(self, name):  # no_sync and the rest: the wrapped model's
        return getattr(self.model, name)


def with_fault(step):
    """The trainer's step (Lockstep.step), with the fault injected before it on rank r at step s."""
    def faulty_step(run, model, batches, stop_requested):
        if FAULT == "spike" and run.step + run.data_offset in FAULT_POSITIONS:
            model = ScaledLoss(model, FAULT_FACTOR)
        if FAULT == "slow" and ON_THIS_RANK and run.step - run.start_step >= FAULT_STEP:
            if run.step - run.start_step == FAULT_STEP and os.environ.get("FAULT_MARK"):
                open(os.environ["FAULT_MARK"], "w").close()  # stop_requested was read already: inside the step
            time.sleep(float(os.environ.get("FAULT_SLEEP", "0.2")))
        if ON_THIS_RANK and run.step - run.start_step == FAULT_STEP:
            if FAULT == "nan":
                weight = run.model.lm_head.weight
                with torch.no_grad():  # under FSDP, this rank's shard of it
                    (weight.to_local() if hasattr(weight, "to_local") else weight)[0, 0] = float("nan")
            elif FAULT == "batch":
                batches = UnreadableFirstBatch(batches)
            elif FAULT == "hang":  # stuck for good; killable (not saving) when torchrun stops the workers
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                time.sleep(3600)
            elif FAULT == "signal":  # the trainer's handler sets its flag (stop_requested was read already)
                os.kill(os.getpid(), signal.SIGTERM)
        return step(run, model, batches, stop_requested)

    return faulty_step


def slow_teardown(teardown):
    """The trainer's process-group teardown, once a signal has come (at most FAULT_SLEEP s). A signal with a handler
    wakes it through the wakeup file descriptor; one without kills the process, as it would any slow teardown."""
    def slow():
        woken, wake = os.pipe()
        os.set_blocking(wake, False)
        previous = signal.set_wakeup_fd(wake)
        try:
            select.select([woken], [], [], float(os.environ.get("FAULT_SLEEP", "60")))
        finally:
            signal.set_wakeup_fd(previous)
            os.close(woken)
            os.close(wake)
        teardown()

    return slow


def unreadable_tensors(fmt, state, parts, path):
    """The file format's load_tensors on a rank whose storage fails to read the file's tensors."""
    raise CheckpointError(f"{path}: could not read the checkpoint's tensors (injected on rank {os.environ['RANK']})")


def main(argv: list[str]) -> int:
    if FAULT not in ("nan", "batch", "hang", "signal", "spike", "slow", "slow_exit", "unreadable_checkpoint",
                     "missing_init_from"):
        raise SystemExit(f"unknown FAULT {FAULT!r}")
    if FAULT == "slow_exit" and ON_THIS_RANK:
        train_gpt2.teardown_distributed = slow_teardown(train_gpt2.teardown_distributed)
    if FAULT == "unreadable_checkpoint" and ON_THIS_RANK:
        from training.checkpoint.file_format import FileFormat

        FileFormat.load_tensors = unreadable_tensors
    if FAULT == "missing_init_from" and ON_THIS_RANK:
        from launch import weights

        weights.as_location = lambda init_from: Path(f"{init_from}.not-on-this-node")
    return train_gpt2.main(argv, wrap_step=with_fault)


if __name__ == "__main__":
    sys.exit(run_cli(main))
