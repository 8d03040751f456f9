"""Write a sharded checkpoint as one `.pt` file: the whole model and optimizer in one place.

    python consolidate_checkpoint.py out/gpt2_xl/checkpoints/step_00005000 gpt2_xl_step5000.pt
    python consolidate_checkpoint.py s3://bucket/gpt2_xl/step_00005000 gpt2_xl_step5000.pt

Nothing in this repository needs it: the trainer, sample.py, export_hf.py, eval_lm.py and
init_from read sharded checkpoints as they are. It is for carrying a checkpoint elsewhere as one
file (torch.load(path, weights_only=True) reads it) or for code that expects the file format. The
file holds exactly the state of the folder; the trainer resumes from it like from the folder.
The whole state passes through this process's memory (about 16 bytes per parameter).
"""

from __future__ import annotations

import common.startup  # noqa: F401 - first: a Ctrl-C while the modules below load is one line

import sys
from pathlib import Path

from common.errors import ArgumentParser, run_cli
from common.settings import path_argument, require
from runtime import storage
from training.checkpoint.folder import consolidate, step_of


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="consolidate_checkpoint.py", description=__doc__)
    parser.add_argument("ckpt", type=path_argument,
                        help="a sharded checkpoint: a step_XXXXXXXX folder (a path or an fsspec URL)")
    parser.add_argument("out", type=path_argument,
                        help="the .pt file to write (step_XXXXXXXX.pt keeps it readable as a checkpoint name)")
    args = parser.parse_args(argv)
    source = storage.as_location(args.ckpt)
    require(step_of(source) is not None and storage.is_dir(source), "ckpt",
            f"{args.ckpt} is not a sharded checkpoint folder (step_XXXXXXXX)")
    out = Path(args.out)
    require(not out.exists(), "out", f"{out} exists; give another name (nothing is overwritten)")
    state = consolidate(source, out)
    print(f"wrote {out}: step {state['step']}, {out.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
