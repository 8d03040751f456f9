"""The optimizers a run trains with (the `optimizer` key): one module each in this package, which registers its
entry as it is imported. The entry drives everything the project does with that optimizer: the names the key
accepts and the help --help prints (training/optim/settings.py), the check that this PyTorch runs it (before any
work: train_gpt2.py's main), and the build. A checkpoint resumes only with the optimizer it was written with
(launch/resume.py): each one's state fits no other.

Every module here imports no torch at module level (the configuration is checked before torch is imported): what
an entry needs of torch it imports when it is built. A new optimizer is one module here (its entry, and keys of its
own in training/optim/settings.py's optimizer section if it has any) and its test.

Every optimizer is one torch.optim.Optimizer to the rest of the code (zero_grad, step, param_groups, state_dict /
load_state_dict, DCP's get_state_dict / set_state_dict, GradScaler.unscale_). The training loop sets every group's
"lr" to the schedule's value, in max_lr's units (training/run/step.py).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

from common.settings import require


@dataclass(frozen=True)
class OptimizerEntry:
    name: str  # the value of the optimizer key
    help: str  # what --help says of it (the key's help lists every entry's)
    # (model, optimizer section, peak lr: the schedule's max_lr, device type) -> the optimizer over the model's
    # trainable (possibly FSDP-sharded) parameters, every group's lr in the schedule's units
    build: Callable
    unavailable: Callable[[], str | None] = lambda: None  # why this PyTorch cannot run it; None when it can


_ENTRIES: dict[str, OptimizerEntry] = {}


def register(entry: OptimizerEntry) -> OptimizerEntry:
    """Add an optimizer (each module of this package, once, as it is imported)."""
    if entry.name in _ENTRIES:
        raise ValueError(f"optimizer {entry.name!r} is registered twice")
    _ENTRIES[entry.name] = entry
    return entry


def optimizers() -> dict[str, OptimizerEntry]:
    """Every optimizer of this package, by name, in the order of their modules' names."""
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        importlib.import_module(f"{__name__}.{module}")  # each registers its entry on its first import
    return dict(sorted(_ENTRIES.items()))


def require_available(settings) -> None:
    """The optimizer section's one rule that needs torch (settings: that section): the optimizer it names runs on
    this PyTorch. A ConfigError naming optimizer, which the trainer raises once torch is imported, before any work."""
    missing = optimizers()[settings.optimizer].unavailable()
    require(missing is None, "optimizer", missing)


def build_optimizer(model, settings, peak_lr: float, device_type: str):
    """The optimizer the optimizer section (settings) names, over the model's (possibly FSDP-sharded) parameters;
    peak_lr is the schedule's max_lr (every group's lr in the schedule's units)."""
    require_available(settings)  # the trainer checked it already; a tool that builds one itself is told here
    return optimizers()[settings.optimizer].build(model, settings, peak_lr, device_type)
