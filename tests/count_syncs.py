"""Run train_gpt2.py counting the host synchronisations that the repository's own code asks for.

    python tests/count_syncs.py REPORT.json TRAINER_ARGS...

A host sync is anything that makes the CPU wait for a tensor's value: .item(), .tolist(),
.cpu(), .numpy(), bool()/float()/int() of a tensor. On a GPU each one stalls the launch queue.
Calls made directly by this repository's code are counted per call site (library internals,
such as the CPU AdamW's step counter, are not ours to change and do not sync on CUDA), and the counts are written to REPORT.json when the run ends.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

SYNCING_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")
counts: collections.Counter = collections.Counter()


def call_site() -> str | None:
    """file:line of the caller when it is the repository's own code (not tests, not a library)."""
    frame = sys._getframe(2)
    path = Path(frame.f_code.co_filename)
    if REPO in path.parents:
        parts = path.relative_to(REPO).parts
        if not {"tests", "site-packages", ".venv"} & set(parts):
            return f"{path.relative_to(REPO)}:{frame.f_lineno}"
    return None


def counting(name: str):
    original = getattr(torch.Tensor, name)

    def method(self, *args, **kwargs):
        site = call_site()
        if site is not None:
            counts[site] += 1
        return original(self, *args, **kwargs)

    return method


for name in SYNCING_METHODS:
    setattr(torch.Tensor, name, counting(name))

import train_gpt2  # noqa: E402

if __name__ == "__main__":
    report = sys.argv[1]
    try:
        code = train_gpt2.cli(sys.argv[2:])
    finally:
        Path(report).write_text(json.dumps(dict(counts)))
    sys.exit(code)
