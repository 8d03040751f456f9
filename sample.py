"""Generate text from a checkpoint, or from OpenAI's GPT-2 to compare with.

    python sample.py --ckpt out/demo --prompt "ROMEO:" --num_samples 2
    python sample.py --ckpt out/gpt2_124m/checkpoints/step_00019073.pt --temperature 0   # greedy
    python sample.py --ckpt gpt2 --prompt "Hello, I'm a language model,"               # OpenAI's 124M

--ckpt takes a checkpoint file, a run folder (its newest readable checkpoint), a GPT-2 preset
name (gpt2, gpt2-medium, gpt2-large, gpt2-xl: OpenAI's weights from the Hugging Face Hub,
cached after the first use) or a Hugging Face GPT-2 folder. An empty prompt starts from
<|endoftext|>, GPT-2's unconditional start. Generation uses the model's KV cache, so each new
token costs one position, not the whole context.
"""

from __future__ import annotations

import common.startup  # noqa: F401 - first: a Ctrl-C while the modules below load is one line

import sys
from pathlib import Path

import torch

from data.tokenizer import get_tokenizer
from common.errors import ArgumentParser, ConfigError, run_cli
from common.settings import path_argument, require
from hf_interop.convert import load_hf_gpt2
from model import GPT, PRESETS
from training.checkpoint.folder import WEIGHTS, read_model
from runtime.runtime import pick_device
from evals.samples import encode_prompt


def load_model(ckpt: str, device: torch.device, weights: str = "live") -> tuple[GPT, str]:
    """The model of --ckpt (see above), in eval mode on device, and what it is for the header line.
    weights: live, or ema (a checkpoint's EMA of the weights)."""
    if ckpt in PRESETS or (Path(ckpt) / "config.json").is_file():  # OpenAI's GPT-2, or an HF export
        require(weights == "live", "--weights", f"{weights} needs one of our checkpoints; {ckpt} has its weights only")
        model, what = load_hf_gpt2(ckpt), f"Hugging Face GPT-2 {ckpt}"
    else:
        model, state, path = read_model(ckpt, "sample.py", weights)
        what = f"step {state['step']} of {path}" + (" (EMA weights)" if weights == "ema" else "")
    return model.to(device).eval(), what


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="sample.py", description=__doc__)
    parser.add_argument("--ckpt", required=True, type=path_argument,
                        help="checkpoint .pt file, run folder, GPT-2 preset name or Hugging Face folder")
    parser.add_argument("--prompt", default="Hello, I'm a language model,",
                        help="text to continue ('' = unconditional)")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top_k", type=int, default=50, help="0 = no top-k filter")
    parser.add_argument("--num_samples", type=int, default=4)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--device", default="auto", help="auto, cuda, cuda:N, mps or cpu")
    parser.add_argument("--weights", default="live", choices=WEIGHTS,
                        help="live (the trained weights) or ema (the checkpoint's EMA of them)")
    args = parser.parse_args(argv)
    for name, low in (("max_new_tokens", 1), ("num_samples", 1), ("top_k", 0), ("temperature", 0), ("seed", 0)):
        require(getattr(args, name) >= low, f"--{name}", f"must be >= {low}, got {getattr(args, name)}")

    device = pick_device(args.device, 0)
    model, what = load_model(args.ckpt, device, args.weights)
    tokenizer = get_tokenizer()
    prompt = encode_prompt(tokenizer, args.prompt)
    if max(prompt) >= model.config.vocab_size:  # a model trained on other token ids than GPT-2's
        raise ConfigError(f"--prompt: token id {max(prompt)} is beyond the model's vocab_size "
                          f"{model.config.vocab_size}")
    idx = torch.tensor([prompt] * args.num_samples, dtype=torch.long, device=device)  # (num_samples, P)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    out = model.generate(idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None,
                         generator=generator, valid_vocab=tokenizer.n_vocab)
    print(f"# {what}")
    for i, row in enumerate(out.tolist()):
        print(f"--- sample {i}\n{tokenizer.decode(row)}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
