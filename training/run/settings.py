"""The run floor's section: the model (the architecture, and the initial weights launch/weights.py loads).

Torch-free, as every settings section is (launch/config.py): the trainer checks a configuration before it imports
torch, and so before model.py, which holds the presets' shapes (PRESETS) and imports nothing of the project.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.settings import OrNone, Settings, option, require, section

if TYPE_CHECKING:
    from model import GPTConfig

# model.py's presets, by name (tests/test_config.py checks that they are PRESETS' names): what `model` may name
PRESET_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


@section
class ModelSettings(Settings):
    """The model section: the architecture, made into model.py's GPTConfig (model.py itself imports nothing of
    the project), and the initial weights (init_from, weights.py's load_initial_weights)."""

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
            require(self.model in PRESET_NAMES, "model",
                    f"unknown model {self.model!r}; choose one of {', '.join(PRESET_NAMES)} or custom")
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
        """model.py's GPTConfig of these settings, imported here, where a model is built: the settings are read
        before torch is."""
        from model import PRESETS, GPTConfig

        shape = PRESETS.get(self.model) or dict(n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd)
        return GPTConfig(block_size=self.block_size, vocab_size=self.vocab_size, dropout=self.dropout, **shape)


def unknown_init_from(init_from: str) -> str:
    """What an `init_from` that names none of what it may name is told (weights.py's load_initial_weights;
    launch/early_checks.py, before torch, where it names no file or folder)."""
    return f"{init_from!r} is not scratch, a checkpoint file, a GPT-2 preset or a HF folder"
