"""The GPT-2 tokenizer, built offline from the BPE ranks file shipped beside this module.

tiktoken's own `get_encoding("gpt2")` downloads its vocabulary on first use, which fails on
cluster nodes without internet. We ship the 50,256 byte-pair ranks (tiktoken's text format:
one `base64(token) rank` pair per line), check their sha256, and add `<|endoftext|>` = 50256.
"""

from __future__ import annotations

import base64
import functools
import hashlib
from pathlib import Path

BPE_RANKS_PATH = Path(__file__).with_name("gpt2.tiktoken")
BPE_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"

EOT_TOKEN = 50256  # <|endoftext|>: precedes every document in our shards
GPT2_VOCAB_SIZE = 50257  # 50,256 BPE ranks + <|endoftext|>

# GPT-2's pre-tokenisation regex (contractions, letters, numbers, punctuation, whitespace runs),
# as tiktoken writes it for its "gpt2"/"r50k_base" encodings.
GPT2_SPLIT_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)


def load_bpe_ranks(path: Path = BPE_RANKS_PATH) -> dict[bytes, int]:
    """Read and verify the ranks file; a damaged file is an error that names it."""
    raw = path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != BPE_RANKS_SHA256:
        raise ValueError(f"{path}: sha256 {digest} does not match the GPT-2 BPE ranks file")
    ranks = {}
    for line in raw.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@functools.lru_cache(maxsize=1)
def get_tokenizer():
    """The GPT-2 `tiktoken.Encoding`; identical to `tiktoken.get_encoding("gpt2")`."""
    import tiktoken

    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_SPLIT_PATTERN,
        mergeable_ranks=load_bpe_ranks(),
        special_tokens={"<|endoftext|>": EOT_TOKEN},
        explicit_n_vocab=GPT2_VOCAB_SIZE,
    )


def tokenize_document(text: str):
    """<|endoftext|> followed by the document's tokens, as a uint16 numpy array.

    Top-level (picklable) so prep scripts can map it over a multiprocessing pool; each worker
    builds its own tokenizer once. Special-token text inside a document is encoded as
    ordinary text, never as a control token.
    """
    import numpy as np

    ids = np.array([EOT_TOKEN, *get_tokenizer().encode_ordinary(text)], dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= 2**16):
        raise ValueError(f"token id {ids.max()} does not fit in uint16")
    return ids.astype(np.uint16)


@functools.lru_cache(maxsize=1)
def token_byte_lengths():
    """The UTF-8 bytes of text each token id stands for, as an int64 numpy array indexed by any
    uint16 id (65,536 entries): what bits per byte divides by (evals/val_loss.py).

    A token's bytes are its BPE bytes, so the ids of a text add up to the UTF-8 length of that
    text. <|endoftext|> counts 0: it separates documents and is no text of theirs. Ids past
    GPT-2's vocabulary (the embedding's padding rows) never occur in shards and count 0.
    """
    import numpy as np

    lengths = np.zeros(2**16, dtype=np.int64)
    for token, rank in load_bpe_ranks().items():
        lengths[rank] = len(token)
    return lengths
