"""Initial weights for a fresh run: random (scratch) or the weights of one of our checkpoints."""

from __future__ import annotations

from pathlib import Path

from model import GPT
from training.checkpoint import check_compatible, load_checkpoint
from training.config import ConfigError


def load_initial_weights(model: GPT, init_from: str) -> None:
    """Replace the random init with init_from's weights (the optimizer always starts fresh)."""
    if init_from == "scratch":
        return
    path = Path(init_from)
    if path.is_file():
        state = load_checkpoint(path)
        check_compatible(state, model.config.to_dict(), path)
        model.load_state_dict(state["model"])
        return
    raise ConfigError(f"init_from: {init_from!r} is not scratch or a checkpoint file")
