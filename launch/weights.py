"""Initial weights for a fresh run: random (scratch), one of our checkpoints, or Hugging Face GPT-2.

`init_from` is `scratch`, a checkpoint (a `.pt` file, or a sharded `step_X/` folder, local or at a URL), a GPT-2
preset (`gpt2`, `gpt2-medium`, `gpt2-large`, `gpt2-xl`: OpenAI's weights from the Hugging Face
Hub) or a Hugging Face folder (a directory with config.json). The trainer builds the model from
its own config first; the weights must fit its shape (n_layer, n_head, n_embd). HF weights have
50,257 vocabulary rows; the run's padding rows (50,304 by default) start at the mean embedding
row, see hf_interop/convert.fit_to_model for why not zeros.
"""

from __future__ import annotations

from common.errors import ConfigError
from hf_interop.convert import HFInteropError, load_hf_into
from model import GPT, PRESETS
from training.checkpoint.folder import (WEIGHTS_ENTRIES, check_compatible, load_checkpoint, load_model_weights,
                                        require_entries, step_of)
from runtime.storage import as_location, is_url
from training.run.settings import unknown_init_from


def load_initial_weights(model: GPT, init_from: str) -> None:
    """Replace the random init with init_from's weights (the optimizer always starts fresh)."""
    if init_from == "scratch":
        return
    path = as_location(init_from)
    # a .pt file, a sharded step folder, or a URL (which holds sharded checkpoints only: load_checkpoint says so)
    if is_url(path) or path.is_file() or (path.is_dir() and step_of(path) is not None):
        state = require_entries(load_checkpoint(path), WEIGHTS_ENTRIES, path, "init_from")
        check_compatible(state, model.config.to_dict(), path, "give this run the model settings it was trained "
                                                              "with, or init_from a checkpoint of this model")
        load_model_weights(model, path, state)
        return
    if init_from in PRESETS or path.is_dir():
        try:
            load_hf_into(model, init_from)
        except HFInteropError as e:
            raise ConfigError(f"init_from: {e}") from None
        return
    raise ConfigError(f"init_from: {unknown_init_from(init_from)}")
