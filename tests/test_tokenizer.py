"""The offline GPT-2 tokenizer."""

from __future__ import annotations

import numpy as np
import pytest

from data import tokenizer as tok


def test_known_encoding_and_special_token():
    enc = tok.get_tokenizer()
    assert enc.encode("Hello, I'm a language model,") == [15496, 11, 314, 1101, 257, 3303, 2746, 11]
    assert enc.n_vocab == 50257 and enc.eot_token == 50256
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]
    text = "Ünïcödé  spaces\t\ttabs\n\nnumbers 1234567 and code: def f(x): return x**2  # ok"
    assert enc.decode(enc.encode(text)) == text


def test_ranks_file_hash_is_checked(tmp_path):
    bad = tmp_path / "gpt2.tiktoken"
    bad.write_bytes(tok.BPE_RANKS_PATH.read_bytes()[:-10])
    with pytest.raises(ValueError, match="does not match"):
        tok.load_bpe_ranks(bad)
    assert len(tok.load_bpe_ranks()) == 50256


def test_tokenize_document_prefixes_endoftext_and_is_uint16():
    ids = tok.tokenize_document("Hello, I'm a language model,")
    assert ids.dtype == np.uint16
    assert ids.tolist() == [50256, 15496, 11, 314, 1101, 257, 3303, 2746, 11]
    # special-token text inside a document stays ordinary text
    assert 50256 not in tok.tokenize_document("a <|endoftext|> b")[1:].tolist()
