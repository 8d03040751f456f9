"""Hugging Face GPT-2 <-> our GPT: configs and weights, and reading an HF folder or preset.

Import: a local folder holding `config.json` and `model.safetensors` (or a sharded
`model.safetensors.index.json`, or a legacy `pytorch_model.bin`), or a preset name (`gpt2`,
`gpt2-medium`, `gpt2-large`, `gpt2-xl`) fetched from the Hub into the Hugging Face cache.
hf_interop/export.py writes our checkpoints the other way, as an HF folder.

Two layout differences between the formats:
- HF's `Conv1D` stores a weight as (in, out); our `nn.Linear` stores (out, in): the four matmul
  weights of every block are transposed both ways.
- HF has 50,257 vocabulary rows; our training default pads to 50,304 (a multiple of 128, for
  faster matmuls). Import keeps the source's row count, so `from_pretrained` is exact; export
  drops the padding rows, which no real token ever uses.
Both formats tie the output layer to the token embedding: exports store the matrix once
(safetensors refuses tensors that share memory) and transformers re-ties `lm_head.weight`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from data.tokenizer import EOT_TOKEN, GPT2_VOCAB_SIZE
from common.errors import DataError, first_line
from model import GPT, PRESETS, GPTConfig

# Where the presets live on the Hub (the historic un-namespaced names redirect there).
HUB_REPOS = {name: f"openai-community/{name}" for name in PRESETS}

# Matmul weights that HF keeps as Conv1D (in, out) and we keep as nn.Linear (out, in).
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Per-block parameters, identical names in both formats (below `transformer.h.{i}.`).
BLOCK_PARAMS = ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                "mlp.c_proj.weight", "mlp.c_proj.bias")
# Non-parameter buffers older transformers saved in every block (the causal mask and -1e4).
LEGACY_BUFFERS = ("attn.bias", "attn.masked_bias")

# GPT2Config's defaults, used like transformers does for a key a config.json leaves out.
HF_DEFAULTS = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                   activation_function="gelu_new", layer_norm_epsilon=1e-5, scale_attn_weights=True,
                   scale_attn_by_inverse_layer_idx=False, add_cross_attention=False, tie_word_embeddings=True,
                   model_type="gpt2")
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")  # both are the tanh approximation our MLP uses
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which our model uses


class HFInteropError(DataError):
    """A Hugging Face folder, config or checkpoint we cannot convert; the message names the file or key."""


# --- configs ------------------------------------------------------------------------------------


def gpt_config_from_hf(hf: dict, source: str, dropout: float = 0.0) -> GPTConfig:
    """Our GPTConfig for an HF GPT-2 config.json, refusing any field our model cannot represent.

    reorder_and_upcast_attn is accepted: it only computes attention scores in float32, which
    changes rounding, not the function.
    """
    cfg = {**HF_DEFAULTS, **hf}

    def refuse(key: str, why: str) -> None:
        raise HFInteropError(f"{source}: {key}={cfg[key]!r} is not supported ({why})")

    if cfg["model_type"] != "gpt2":
        refuse("model_type", "only GPT-2 checkpoints convert")
    if cfg["activation_function"] not in TANH_GELUS:
        refuse("activation_function", f"our MLP uses the tanh GELU: {' or '.join(TANH_GELUS)}")
    if cfg["layer_norm_epsilon"] != LAYER_NORM_EPS:
        refuse("layer_norm_epsilon", f"our LayerNorms use eps {LAYER_NORM_EPS}")
    if not cfg["scale_attn_weights"]:
        refuse("scale_attn_weights", "our attention always scales scores by 1/sqrt(head size)")
    if cfg["scale_attn_by_inverse_layer_idx"]:
        refuse("scale_attn_by_inverse_layer_idx", "our attention has no per-layer score scaling")
    if cfg["add_cross_attention"]:
        refuse("add_cross_attention", "our blocks have no cross-attention")
    if not cfg["tie_word_embeddings"]:
        refuse("tie_word_embeddings", "our output layer is tied to the token embedding")
    if cfg["n_inner"] is not None and cfg["n_inner"] != 4 * cfg["n_embd"]:
        refuse("n_inner", f"our MLP width is 4 * n_embd = {4 * cfg['n_embd']}")
    block_size = hf.get("n_positions", hf.get("n_ctx", HF_DEFAULTS["n_positions"]))
    try:
        return GPTConfig(block_size=block_size, vocab_size=cfg["vocab_size"], n_layer=cfg["n_layer"],
                         n_head=cfg["n_head"], n_embd=cfg["n_embd"], dropout=dropout, bias=True)
    except (TypeError, ValueError) as e:
        raise HFInteropError(f"{source}: {e}") from None


def hf_config_from_gpt(config: GPTConfig) -> dict:
    """A GPT2Config (as config.json) for our model, with the vocabulary trimmed to GPT-2's 50,257."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": GPT2_VOCAB_SIZE,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,  # read by older transformers releases
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,  # 4 * n_embd
        "activation_function": "gelu_new",
        "layer_norm_epsilon": LAYER_NORM_EPS,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": EOT_TOKEN,
        "eos_token_id": EOT_TOKEN,
    }


# --- state dicts --------------------------------------------------------------------------------


def param_names(config: GPTConfig) -> list[str]:
    """Our model's state-dict keys (lm_head.weight is the tied wte.weight)."""
    names = ["transformer.wte.weight", "transformer.wpe.weight"]
    names += [f"transformer.h.{i}.{p}" for i in range(config.n_layer) for p in BLOCK_PARAMS]
    return names + ["transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight"]


def hf_to_ours(hf_state: dict[str, torch.Tensor], config: GPTConfig, source: str) -> dict[str, torch.Tensor]:
    """Our state dict (including the tied `lm_head.weight`) from a GPT2LMHeadModel/GPT2Model one.

    Accepts keys with or without the `transformer.` prefix (the original OpenAI conversion
    saved a bare GPT2Model), drops the legacy attention buffers, and refuses an untied
    `lm_head.weight`, a missing parameter or an unknown one, naming the key.
    """
    state: dict[str, torch.Tensor] = {}
    lm_head = None
    for key, tensor in hf_state.items():
        name = key.removeprefix("transformer.")
        if name == "lm_head.weight":
            lm_head = tensor
            continue
        in_block = re.fullmatch(r"h\.\d+\.(.+)", name)
        if in_block and in_block.group(1) in LEGACY_BUFFERS:
            continue  # a buffer, not a parameter
        if name.endswith(CONV1D_WEIGHTS):
            tensor = tensor.t()  # (in, out) -> (out, in)
        state[f"transformer.{name}"] = tensor
    expected = param_names(config)
    expected.remove("lm_head.weight")  # checked against wte below
    for key in expected:
        if key not in state:
            raise HFInteropError(f"{source}: weights have no {key.removeprefix('transformer.')}")
    if unexpected := sorted(state.keys() - set(expected)):
        raise HFInteropError(f"{source}: unexpected weight {unexpected[0]} (not part of a GPT-2 LM)")
    wte = state["transformer.wte.weight"]
    if lm_head is not None and not torch.equal(lm_head, wte):
        raise HFInteropError(f"{source}: lm_head.weight differs from wte.weight; our output layer is tied to it")
    state["lm_head.weight"] = wte
    return state


def ours_to_hf(state: dict[str, torch.Tensor], vocab_size: int = GPT2_VOCAB_SIZE) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel tensors for safetensors: Conv1D layout, vocab trimmed, lm_head left out.

    Every tensor is a fresh contiguous float32 copy, so none shares memory with another (the
    tied lm_head is stored once, as `transformer.wte.weight`); float64 runs export as float32.
    """
    out = {}
    for key, tensor in state.items():
        if key == "lm_head.weight":
            continue  # tied: transformers rebuilds it from transformer.wte.weight
        if key == "transformer.wte.weight":
            tensor = tensor[:vocab_size]  # (V_padded, C) -> (50257, C): padding rows are never real tokens
        elif key.endswith(CONV1D_WEIGHTS):
            tensor = tensor.t()  # (out, in) -> (in, out)
        out[key] = tensor.detach().to("cpu", torch.float32).contiguous().clone()
    return out


def fit_to_model(state: dict[str, torch.Tensor], source_config: GPTConfig, target: GPTConfig,
                 source: str) -> dict[str, torch.Tensor]:
    """Adapt converted weights to a model the trainer already built from its own config.

    n_layer, n_head and n_embd must match; the position table may be longer than the run's
    block_size (its first rows are kept: later positions are never used); the vocabulary may be
    shorter than the run's padded one. Padding rows start at the mean of the real rows, not at
    zero: with tied weights a zero row scores logit 0 for every input, far above a trained
    GPT-2's logits (typically tens below zero), and would take most of the probability mass at
    step 0. A mean row scores the mean of the real logits, and since exp(mean) <= mean(exp),
    the P padding rows of a V-row table take at most P / V of the mass (47 / 50304 < 0.1%,
    so the loss rises by under 0.001); training then pushes them down.
    """
    for key in ("n_layer", "n_head", "n_embd"):
        have, want = getattr(source_config, key), getattr(target, key)
        if have != want:
            raise HFInteropError(f"{key}: {source} has {key}={have} but this run has {key}={want}")
    if source_config.block_size < target.block_size:
        raise HFInteropError(f"block_size: {source} has n_positions={source_config.block_size} but this run has "
                             f"block_size={target.block_size}")
    if source_config.vocab_size > target.vocab_size:
        raise HFInteropError(f"vocab_size: {source} has vocab_size={source_config.vocab_size} but this run has "
                             f"vocab_size={target.vocab_size}")
    state = dict(state)
    state["transformer.wpe.weight"] = state["transformer.wpe.weight"][: target.block_size]
    wte = state["transformer.wte.weight"]  # (V_source, C)
    if pad := target.vocab_size - wte.size(0):
        wte = torch.cat([wte, wte.float().mean(dim=0, keepdim=True).to(wte.dtype).expand(pad, -1)])
    state["transformer.wte.weight"] = state["lm_head.weight"] = wte  # (V_target, C)
    return state


# --- reading a Hugging Face folder or preset ----------------------------------------------------


def resolve_hf_source(name_or_path: str | Path) -> Path:
    """The local folder for a preset name (downloaded into the HF cache once) or a folder path."""
    path, name = Path(name_or_path), str(name_or_path)
    if (path / "config.json").is_file():
        return path
    if name not in HUB_REPOS:
        if path.is_dir():
            raise HFInteropError(f"{path}: no config.json (expected a Hugging Face GPT-2 folder)")
        raise HFInteropError(f"{name}: not a folder nor one of the presets {', '.join(HUB_REPOS)}")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise HFInteropError(f"{name}: loading it needs huggingface_hub (pip install huggingface_hub)") from None
    try:
        folder = snapshot_download(HUB_REPOS[name], allow_patterns=["config.json", "*.safetensors",
                                                                    "model.safetensors.index.json"])
    except Exception as e:  # offline, no such repo, HTTP errors: all end the same way for the user
        raise HFInteropError(f"{name}: could not fetch {HUB_REPOS[name]} from the Hugging Face Hub "
                             f"({first_line(e, 160)}); check the network or pass a local folder") from None
    return Path(folder)


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The raw HF state dict of a folder: safetensors (single or sharded) first, then pytorch_model.bin."""
    if (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    elif (folder / "model.safetensors.index.json").is_file():
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        files = [folder / f for f in sorted(set(index["weight_map"].values()))]
    elif (folder / "pytorch_model.bin").is_file():
        try:
            return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:
            raise HFInteropError(f"{folder / 'pytorch_model.bin'}: unreadable ({first_line(e, 160)})") from None
    else:
        raise HFInteropError(f"{folder}: no model.safetensors or pytorch_model.bin")
    from safetensors.torch import load_file

    state = {}
    for file in files:
        try:
            state.update(load_file(file))
        except Exception as e:
            raise HFInteropError(f"{file}: unreadable safetensors file ({first_line(e, 160)})") from None
    return state


def read_hf_gpt2(name_or_path: str | Path, dropout: float = 0.0) -> tuple[GPTConfig, dict[str, torch.Tensor], str]:
    """(our config, our state dict, a name for messages) for a HF folder or preset."""
    folder = resolve_hf_source(name_or_path)
    source = str(name_or_path)
    try:
        hf_config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise HFInteropError(f"{folder / 'config.json'}: unreadable ({e})") from None
    config = gpt_config_from_hf(hf_config, source, dropout)
    state = hf_to_ours(read_hf_weights(folder), config, source)
    return config, state, source


def load_hf_gpt2(name_or_path: str | Path, dropout: float = 0.0) -> GPT:
    """Our GPT with the weights of an HF GPT-2 (same vocabulary size, so logits match exactly)."""
    config, state, source = read_hf_gpt2(name_or_path, dropout)
    model = GPT(config)
    _load_state(model, state, source)
    return model


def load_hf_into(model: GPT, name_or_path: str | Path) -> None:
    """Copy an HF GPT-2's weights into a model built from a training config (see fit_to_model)."""
    config, state, source = read_hf_gpt2(name_or_path)
    _load_state(model, fit_to_model(state, config, model.config, source), source)


def _load_state(model: GPT, state: dict[str, torch.Tensor], source: str) -> None:
    try:
        model.load_state_dict(state)
    except RuntimeError as e:  # a tensor of another shape than its config.json says
        detail = str(e).strip().splitlines()[-1].strip()  # "size mismatch for KEY: ..."
        raise HFInteropError(f"{source}: weights do not match config.json ({detail})") from None
