"""Export a checkpoint as a Hugging Face GPT-2 folder (weights, config, tokenizer, model card).

    python export_hf.py out/gpt2_124m hf/gpt2-124m            # a run folder: its newest checkpoint
    python export_hf.py out/demo/checkpoints/step_00000400.pt hf/demo

The folder loads offline with `GPT2LMHeadModel.from_pretrained` / `AutoTokenizer.from_pretrained`
and evaluates with lm-evaluation-harness:

    lm_eval --model hf --model_args pretrained=hf/gpt2-124m --tasks hellaswag --device cuda:0 --batch_size 16
"""

from __future__ import annotations

import common.startup  # noqa: F401 - first: a Ctrl-C while the modules below load is one line

import sys

from common.errors import ArgumentParser, WriteError, run_cli
from common.settings import path_argument
from hf_interop.export import export_hf
from training.checkpoint.folder import (WEIGHTS, WEIGHTS_ENTRIES, read_full_state, require_average, require_entries,
                                        resolve_checkpoint, with_average)


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="export_hf.py", description=__doc__)
    parser.add_argument("ckpt", type=path_argument,
                        help="checkpoint (.pt file or sharded step folder), or a run folder (its newest)")
    parser.add_argument("out_dir", type=path_argument, help="folder to write the Hugging Face files into")
    parser.add_argument("--weights", default="live", choices=WEIGHTS,
                        help="live (the trained weights) or ema (the checkpoint's EMA of them)")
    parser.add_argument("--license", default="mit", help="license named in the model card (default mit)")
    args = parser.parse_args(argv)
    path, state = resolve_checkpoint(args.ckpt)
    require_entries(state, WEIGHTS_ENTRIES, path, "export_hf.py")
    if args.weights == "ema":
        require_average(state, path)
    state = read_full_state(path, state)  # a sharded checkpoint's tensors, whole (a file's are already)
    if args.weights == "ema":
        state = with_average(state)
    try:
        out = export_hf(state, args.out_dir, license=args.license)
    except OSError as e:  # the output folder cannot be written
        raise WriteError(f"{args.out_dir}: {e.strerror or e}") from None
    print(f"exported {args.ckpt} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
