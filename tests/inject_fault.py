"""Run train_gpt2.py with a fault injected on one rank (fault-injection tests only).

    torchrun ... tests/inject_fault.py TRAINER_ARGS...
    with FAULT=nan|batch, FAULT_STEP=s, FAULT_RANK=r in the environment

nan:   the loss of rank r's first micro-batch of optimizer step s becomes NaN.
batch: reading rank r's first micro-batch of step s raises a DataError (in the prefetch thread).
Steps count from 0 whatever the run's first step. Nothing in the trainer knows about this: it
must notice on its own and stop every rank with one line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import data.loader  # noqa: E402
import model  # noqa: E402
import train_gpt2  # noqa: E402
from errors import DataError  # noqa: E402

FAULT = os.environ["FAULT"]
STEP = int(os.environ["FAULT_STEP"])
ON_THIS_RANK = int(os.environ.get("RANK", 0)) == int(os.environ.get("FAULT_RANK", "0"))
_calls = {"forward": 0, "first_step": None}


def forward_with_nan(self, idx, targets=None, _forward=model.GPT.forward, **kwargs):
    logits, loss = _forward(self, idx, targets, **kwargs)
    if self.training and targets is not None:
        accum = int(os.environ["GRAD_ACCUM"])
        if _calls["forward"] == STEP * accum and ON_THIS_RANK:
            loss = loss * float("nan")
        _calls["forward"] += 1
    return logits, loss


def micro_batch_that_fails(self, step, micro_step, _micro_batch=data.loader.TrainLoader.micro_batch):
    first = _calls["first_step"] = step if _calls["first_step"] is None else _calls["first_step"]
    if ON_THIS_RANK and step - first == STEP and micro_step == 0:
        raise DataError(f"injected: rank {os.environ.get('RANK', 0)} could not read step {step}")
    return _micro_batch(self, step, micro_step)


if FAULT == "nan":
    model.GPT.forward = forward_with_nan
elif FAULT == "batch":
    data.loader.TrainLoader.micro_batch = micro_batch_that_fails
else:
    raise SystemExit(f"unknown FAULT {FAULT!r}")

if __name__ == "__main__":
    sys.exit(train_gpt2.cli(sys.argv[1:]))
