"""The repository's own text as token shards: the corpus the GPU checks train and time on (scripts/gpu_check.sh's
benchmarks, tests/test_gpu.py). Real text, so losses fall and compare across variants."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script: the repository's packages

from data.shards import shard_name, write_shard  # noqa: E402
from data.tokenizer import tokenize_document  # noqa: E402


def repo_text_documents() -> list[str]:
    """The repository's own prose and code, one document per file, in a fixed order."""
    patterns = ("*.md", "docs/*.md", "*.py", "*/*.py", "configs/*.yaml")
    paths = sorted({p for pattern in patterns for p in REPO.glob(pattern)
                    if not any(part.startswith(".") for part in p.relative_to(REPO).parts)})
    return [p.read_text(encoding="utf-8", errors="replace") for p in paths]


def write_corpus_shards(folder: str | Path, train_tokens: int, val_tokens: int = 65_537) -> Path:
    """A val and a train shard of the repository's text (~180K tokens), repeated to the sizes asked.

    The repetition does not matter for speed or for comparing two runs on the same tokens. The val window repeats
    train text: it only has to exist (65,537 tokens: one B=64 micro-batch at T=1024, what scripts/bench.py reads).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokens = np.concatenate([tokenize_document(text) for text in repo_text_documents()])
    write_shard(folder / shard_name("repo", "val", 0), np.resize(tokens, val_tokens))
    write_shard(folder / shard_name("repo", "train", 1), np.resize(tokens, train_tokens))
    return folder


if __name__ == "__main__":  # python benchmarks/corpus.py FOLDER TRAIN_TOKENS
    write_corpus_shards(sys.argv[1], int(sys.argv[2]))
