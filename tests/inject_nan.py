"""Run train_gpt2.py with a NaN injected into one rank's loss (fault-injection tests only).

    torchrun ... tests/inject_nan.py TRAINER_ARGS...   with NAN_STEP=s NAN_RANK=r in the environment

The loss of rank r's first micro-batch of optimizer step s becomes NaN (the step count starts at
the run's first step). Nothing in the trainer knows about this: it must notice on its own.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import model  # noqa: E402
import train_gpt2  # noqa: E402

NAN_STEP = int(os.environ["NAN_STEP"])
NAN_RANK = int(os.environ.get("NAN_RANK", "0"))
_forward = model.GPT.forward
_calls = {"train_forwards": 0}


def forward_with_nan(self, idx, targets=None, **kwargs):
    logits, loss = _forward(self, idx, targets, **kwargs)
    if self.training and targets is not None:
        accum = int(os.environ["GRAD_ACCUM"])
        if _calls["train_forwards"] == NAN_STEP * accum and int(os.environ.get("RANK", 0)) == NAN_RANK:
            loss = loss * float("nan")
        _calls["train_forwards"] += 1
    return logits, loss


model.GPT.forward = forward_with_nan

if __name__ == "__main__":
    sys.exit(train_gpt2.cli(sys.argv[1:]))
