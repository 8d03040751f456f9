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
from common.settings import OrNone, Settings, option, require, section
from hf_interop.convert import HFInteropError, load_hf_into
from model import GPT, PRESETS, GPTConfig
from training.checkpoint.folder import (WEIGHTS_ENTRIES, check_compatible, load_checkpoint, load_model_weights,
                                 require_entries, step_of)
from training.core.storage import as_location, is_url


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
    raise ConfigError(f"init_from: {init_from!r} is not scratch, a checkpoint file, a GPT-2 preset or a HF folder")


@section
class ModelSettings(Settings):
    """The model section: the architecture, made into model.py's GPTConfig (model.py itself imports nothing of
    the project), and the initial weights (init_from, load_initial_weights above)."""

    SECTION = "model"
    SUMMARY = "the architecture and the initial weights"

    model: str = option("gpt2", "gpt2, gpt2-medium, gpt2-large, gpt2-xl, or custom (with n_layer, n_head, n_embd)",
                        on_resume="trajectory")
    n_layer: OrNone[int] = option(None, "transformer blocks (model=custom only)", on_resume="trajectory")
    n_head: OrNone[int] = option(None, "attention heads (model=custom only)", on_resume="trajectory")
    n_embd: OrNone[int] = option(None, "width of the residual stream (model=custom only)", on_resume="trajectory")
    vocab_size: int = option(50304, "embedding rows: GPT-2's 50257 padded to a multiple of 128 for faster matmuls "
                                    "(smaller only for data of other token ids: HellaSwag and samples need 50257)",
                             on_resume="trajectory")
    block_size: int = option(1024, "longest sequence the position table covers", on_resume="trajectory")
    dropout: float = option(0.0, "dropout probability (0 for pretraining)", on_resume="trajectory")
    init_from: str = option("scratch", "initial weights: scratch, a GPT-2 preset or HF folder, or a checkpoint .pt "
                                    "(weights only)", on_resume="none")  # a resumed run's weights are its checkpoint's

    def validate(self) -> None:
        shape = ("n_layer", "n_head", "n_embd")
        if self.model == "custom":
            for key in shape:
                require(getattr(self, key) is not None, key, "must be set when model is custom")
        else:
            require(self.model in PRESETS, "model",
                    f"unknown model {self.model!r}; choose one of {', '.join(PRESETS)} or custom")
            for key in shape:
                require(getattr(self, key) is None, key, f"only used with model=custom (model is {self.model})")
        for key in (*shape, "vocab_size", "block_size"):
            value = getattr(self, key)
            require(value is None or value > 0, key, f"must be positive, got {value}")
        require(0 <= self.dropout < 1, "dropout", f"must be in [0, 1), got {self.dropout}")
        if self.model == "custom":
            require(self.n_embd % self.n_head == 0, "n_embd", f"{self.n_embd} is not divisible by n_head {self.n_head}")
        # init_from is checked where its weights are read

    def model_config(self) -> GPTConfig:
        shape = PRESETS.get(self.model) or dict(n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd)
        return GPTConfig(block_size=self.block_size, vocab_size=self.vocab_size, dropout=self.dropout, **shape)
