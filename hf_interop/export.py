"""Export a checkpoint's model as a Hugging Face GPT-2 folder, loadable offline.

Writes `config.json`, `model.safetensors` (vocabulary trimmed to GPT-2's 50,257 rows, the tied
matrix stored once: safetensors refuses tensors that share memory, and transformers re-ties
`lm_head.weight`), `generation_config.json`, the GPT-2 tokenizer files rebuilt from our own BPE
ranks (`vocab.json`, `merges.txt`, `tokenizer_config.json`, `special_tokens_map.json`) and a
`README.md` model card, so `from_pretrained(folder)`, `AutoTokenizer.from_pretrained(folder)`
and lm-evaluation-harness work offline. Reading the checkpoint is the caller's (export_hf.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from common.atomic_file import atomic_write
from data.tokenizer import EOT_TOKEN, GPT2_VOCAB_SIZE, load_bpe_ranks
from hf_interop.convert import HFInteropError, hf_config_from_gpt, ours_to_hf, param_names
from model import GPTConfig


# --- tokenizer files ----------------------------------------------------------------------------


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, as vocab.json and merges.txt spell tokens.

    Bytes that are printable, non-space Latin-1 characters stand for themselves; the other 68
    (controls, space, 0x7F-0xA0, soft hyphen) map to code points 256, 257, ... in byte order,
    so every token is a visible string with no whitespace in it.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in table)
    for offset, b in enumerate(shifted):
        table[b] = chr(256 + offset)
    return table


def _bpe_split(token: bytes, ranks: dict[bytes, int], max_rank: int) -> list[bytes]:
    """Byte-pair encode token using only merges ranked below max_rank (lowest rank merges first)."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best_rank, best_at = max_rank, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1], max_rank)
            if rank < best_rank:
                best_rank, best_at = rank, i
        if best_at < 0:
            break
        parts[best_at:best_at + 2] = [parts[best_at] + parts[best_at + 1]]
    return parts


def recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list (in rank order) that rebuilds each multi-byte token from two lower-ranked ones.

    Running BPE on a token with only the merges ranked below it stops one merge short: at the
    pair whose merge creates the token. tiktoken's ranks are exactly GPT-2's merge order, so
    a merges.txt in this order tokenizes like tiktoken.
    """
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = _bpe_split(token, ranks, rank)
        if len(parts) != 2:
            raise ValueError(f"BPE ranks: token {token!r} (rank {rank}) is not a merge of two lower-ranked tokens")
        merges.append((parts[0], parts[1]))
    return merges


def write_tokenizer_files(out_dir: Path, model_max_length: int) -> None:
    """vocab.json, merges.txt, tokenizer_config.json, special_tokens_map.json from our BPE ranks."""
    ranks = load_bpe_ranks()
    table = byte_to_unicode()

    def spell(token: bytes) -> str:
        return "".join(table[b] for b in token)

    vocab = {spell(token): rank for token, rank in sorted(ranks.items(), key=lambda item: item[1])}
    vocab["<|endoftext|>"] = EOT_TOKEN
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    lines = ["#version: 0.2", *(f"{spell(a)} {spell(b)}" for a, b in recover_merges(ranks))]
    (out_dir / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    special = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
    tokenizer_config = {
        "tokenizer_class": "GPT2Tokenizer",
        "model_max_length": model_max_length,
        "add_prefix_space": False,
        "add_bos_token": False,
        # byte-level BPE decodes losslessly; the clean-up would turn " don't" into "don't"
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        **special,
        "added_tokens_decoder": {str(EOT_TOKEN): {"content": "<|endoftext|>", "special": True, "lstrip": False,
                                                  "rstrip": False, "normalized": True, "single_word": False}},
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "special_tokens_map.json", special)


def _write_json(path: Path, data: dict) -> None:
    with atomic_write(path, "w") as f:
        f.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


# --- export -------------------------------------------------------------------------------------


def export_hf(state: dict, out_dir: str | Path, license: str = "mit") -> Path:
    """Write a transformers-loadable GPT-2 folder (weights, config, tokenizer, model card) of a
    checkpoint's state (its model, model_args, and the config and metrics for the card)."""
    config = GPTConfig(**state["model_args"])
    if config.vocab_size < GPT2_VOCAB_SIZE:
        raise HFInteropError(f"vocab_size: the model has {config.vocab_size} rows, "
                             f"fewer than GPT-2's {GPT2_VOCAB_SIZE}")
    names = set(param_names(config))
    if mismatched := sorted(names ^ state["model"].keys()):
        key = mismatched[0]
        where = "missing from" if key in names else "unexpected in"
        raise HFInteropError(f"{key}: {where} the checkpoint's model (n_layer {config.n_layer})")
    tensors = ours_to_hf(state["model"])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})  # transformers checks "format"
    _write_json(out / "config.json", hf_config_from_gpt(config))
    _write_json(out / "generation_config.json", {"bos_token_id": EOT_TOKEN, "eos_token_id": EOT_TOKEN,
                                                 "pad_token_id": EOT_TOKEN})
    write_tokenizer_files(out, config.block_size)
    num_params = sum(t.numel() for t in tensors.values())
    with atomic_write(out / "README.md", "w") as f:
        f.write(model_card(state, config, num_params, out, license))
    return out


def model_card(state: dict, config: GPTConfig, num_params: int, out_dir: Path, license: str) -> str:
    """README.md for the Hub: front matter, what was trained, metrics, config, how to load and evaluate."""
    train_config = state.get("config") or {}
    metrics = state.get("metrics") or {}
    init_from = train_config.get("init_from", "scratch")
    origin = "trained from scratch" if init_from == "scratch" else f"initialised from `{init_from}` and trained"
    averaged = state.get("weights") == "ema"  # training/checkpoint/folder.py's with_average: its metrics are the EMA's
    lines = [
        "---",
        f"license: {license}",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags:",
        "- gpt2",
        "- text-generation",
        "- gpt2-repro",
        "---",
        "",
        f"# {out_dir.name}",
        "",
        f"A GPT-2 language model ({num_params:,} parameters: n_layer {config.n_layer}, n_head {config.n_head}, "
        f"n_embd {config.n_embd}, context {config.block_size}) {origin} with gpt2-repro, "
        f"exported after step {int(state.get('step', 0)):,} ({int(state.get('tokens_seen', 0)):,} tokens seen). "
        "It uses the GPT-2 tokenizer; the training vocabulary padding rows are not exported.",
        "",
    ]
    if averaged:
        ema = state.get("ema_state") or {}
        how = f"ema_decay {ema['decay']}, from update {ema['start_step']}, {ema['updates']} updates" \
            if {"decay", "start_step", "updates"} <= ema.keys() else f"ema_decay {train_config.get('ema_decay')}"
        lines += [f"The weights are the exponential moving average (EMA) of the trained weights ({how}), not the "
                  "weights after the last step. The metrics are the EMA's own; `live_` ones are those of the "
                  "trained weights at the same step.", ""]
    lines += ["## Metrics", ""]
    if metrics:
        lines += ["| metric | value |", "| --- | --- |"]
        lines += [f"| {key} | {_cell(value, digits=4)} |" for key, value in metrics.items()]
    else:
        lines.append("No evaluation metrics were recorded in this checkpoint.")
    lines += ["", "## Training configuration", ""]
    if train_config:
        lines += ["| key | value |", "| --- | --- |"]
        lines += [f"| `{key}` | {_cell(value)} |" for key, value in train_config.items()]
    else:
        lines.append("The checkpoint holds no training configuration.")
    lines += [
        "",
        "## Usage",
        "",
        "```python",
        "from transformers import AutoTokenizer, GPT2LMHeadModel",
        "",
        f'tokenizer = AutoTokenizer.from_pretrained("{out_dir}")  # this folder, or its Hub repo id',
        f'model = GPT2LMHeadModel.from_pretrained("{out_dir}")',
        'ids = tokenizer("Hello, I\'m a language model,", return_tensors="pt").input_ids',
        "out = model.generate(ids, max_new_tokens=32, do_sample=True, top_k=50)",
        "print(tokenizer.decode(out[0]))",
        "```",
        "",
        "## Evaluation",
        "",
        "With [lm-evaluation-harness](https://github.com/EleutherAI/lm-evaluation-harness):",
        "",
        "```bash",
        f"lm_eval --model hf --model_args pretrained={out_dir} --tasks hellaswag --device cuda:0 --batch_size 16",
        "```",
        "",
    ]
    return "\n".join(lines)


def _cell(value, digits: int | None = None) -> str:
    """A Markdown table cell: floats as given (or to `digits` decimals), lists comma-separated, pipes escaped."""
    if isinstance(value, float) and digits is not None:
        text = f"{value:.{digits}f}"
    elif isinstance(value, (list, tuple)):
        text = ", ".join(str(v) for v in value)
    else:
        text = str(value)
    return text.replace("|", "\\|") or " "
