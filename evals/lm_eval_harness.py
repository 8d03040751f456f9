"""Our GPT as an lm-evaluation-harness model (`lm_eval.api.model.LM`), for eval_lm.py.

Why a wrapper rather than lm_eval's Hugging Face model (`--model hf` on an export_hf folder):
it scores exactly the model code and weights that trained, with no export step and no second
implementation of GPT-2 in the loop, and it scores the way the trainer's in-loop HellaSwag
does (evals/hellaswag.py): the same tokenizer, the same rendering of a (context,
continuation) pair into one row, the same left cut of long contexts, the same softmax over
the model's full (padded) vocabulary. So on the same data and checkpoint lm_eval's `acc`
and the trainer's `acc` are the same number, and a trainer-style token-normalised acc_norm
defined as an lm_eval metric agrees too (tests/test_lm_eval.py).

Log-likelihoods are normalised over all vocab_size logits (50304), like the training loss
and the in-loop HellaSwag; the exported HF model has only the 50257 real rows, so its
log-likelihoods are higher by at most the padding rows' share of the probability mass
(which training drives towards zero). Where a padding id could be *chosen*, it is masked:
the greedy check of `loglikelihood` and generation only consider the 50257 real tokens.

Scoring is batched (longest rows first, right-padded; attention is causal, so padding never
reaches a real position) and only the positions that predict a continuation token go through
lm_head. Generation runs one request at a time (the model's KV cache has no padding support).

Shapes in comments: B = rows in a batch, L = padded row length, N = scored positions in the
batch, C = n_embd, V = vocab_size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from data.tokenizer import EOT_TOKEN
from evals.hellaswag import LOGIT_CHUNK, render_rows
from model import GPT

# Tokens generated between checks for a stop sequence: a generation that stops early costs
# at most this many extra tokens, and re-reading the prompt once per chunk is cheap.
GENERATION_CHUNK = 32
EOT_TEXT = "<|endoftext|>"


class GPTLM(LM):
    """lm_eval's three request types over a GPT in eval mode, on one device."""

    def __init__(self, model: GPT, tokenizer, device: torch.device, batch_size: int = 16,
                 autocast: contextlib.AbstractContextManager | None = None, seed: int = 1234,
                 progress: Callable[[int, int], None] | None = None):
        """tokenizer: the GPT-2 tiktoken encoding (data.tokenizer.get_tokenizer); batch_size: rows
        per forward pass; autocast: the forward's precision context (bf16 autocast, or none);
        seed: for generation requests that ask to sample; progress: called as progress(done, total)
        after each batch of scored requests (eval_lm.py's progress line)."""
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self._device = device
        self.batch_size = batch_size
        self.autocast = autocast or contextlib.nullcontext()
        self.seed = seed
        self.progress = progress
        self.block_size = model.config.block_size
        self.valid_vocab = tokenizer.n_vocab  # 50257: ids above are embedding padding, never tokens

    # --- lm_eval's interface ------------------------------------------------------------------

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        """(log P(continuation | context), whether greedy decoding would produce it) per request."""
        return self.score_pairs([self.encode_pair(*request.args) for request in requests])

    def loglikelihood_rolling(self, requests) -> list[float]:
        """log P(text) per request, every token predicted once, after <|endoftext|>.

        Texts longer than block_size are cut into windows by lm_eval's own helper: each window
        predicts new tokens only, with as much preceding text as fits as its context.
        """
        pairs, owners = [], []
        for i, request in enumerate(requests):
            (text,) = request.args
            windows = get_rolling_token_windows(self.tokenizer.encode_ordinary(text), prefix_token=EOT_TOKEN,
                                                max_seq_len=self.block_size, context_len=1)
            for window in map(make_disjoint_window, windows):
                pairs.append(window)
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self.score_pairs(pairs)):
            totals[owner] += logprob
        return totals

    def generate_until(self, requests) -> list[str]:
        """The continuation of each context up to (not including) its first stop sequence.

        Honours the task's gen_kwargs `until`, `max_gen_toks` (default 256), `do_sample`,
        `temperature` and `top_k`; greedy unless do_sample is true. Generation also stops at
        <|endoftext|>.
        """
        generator = torch.Generator(device=self._device).manual_seed(self.seed)
        return [self._generate(context, dict(gen_kwargs), generator)
                for context, gen_kwargs in (request.args for request in requests)]

    # --- scoring ------------------------------------------------------------------------------

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of context and continuation, encoded separately (as the in-loop HellaSwag does).

        Whitespace at the end of the context moves to the start of the continuation: GPT-2's
        BPE attaches a space to the word after it (" word" is one token), so "ctx " + "word"
        must score the tokens of " word". (The in-loop HellaSwag renders context + " " + ending,
        so its contexts never end in whitespace and the two encodings are the same.)
        """
        stripped = context.rstrip()
        continuation = context[len(stripped):] + continuation
        return self.tokenizer.encode_ordinary(stripped), self.tokenizer.encode_ordinary(continuation)

    @torch.no_grad()
    def score_pairs(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[float, bool]]:
        """(summed log-probability of the continuation tokens, all of them the argmax) per pair.

        Each pair becomes one row, context + continuation, by evals.hellaswag.render_rows:
        an empty context becomes <|endoftext|>, and a row longer than block_size + 1 loses
        context tokens from the left. An empty continuation has probability 1: (0.0, True).
        """
        rows = [render_rows(context, [continuation], self.block_size)[0] for context, continuation in pairs]
        # longest rows first: little padding per batch, and a batch too big for the device fails at once
        order = sorted((i for i, (_, n_cont) in enumerate(rows) if n_cont), key=lambda i: len(rows[i][0]),
                       reverse=True)
        results = [(0.0, True)] * len(rows)
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            for i, result in zip(batch, self._score_rows([rows[i] for i in batch])):
                results[i] = result
            if self.progress:
                self.progress(start + len(batch), len(order))
        return results

    def _score_rows(self, rows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """Score one batch of (tokens, continuation length) rows."""
        L = max(len(tokens) - 1 for tokens, _ in rows)
        inputs, positions, targets, counts = [], [], [], []
        for r, (tokens, n_cont) in enumerate(rows):
            n_in = len(tokens) - 1  # the model reads tokens[:-1] and predicts tokens[1:]
            inputs.append(tokens[:-1] + [EOT_TOKEN] * (L - n_in))
            positions += range(r * L + n_in - n_cont, r * L + n_in)  # the positions predicting the continuation
            targets += tokens[-n_cont:]
            counts.append(n_cont)
        device = self._device
        inputs = torch.tensor(inputs, device=device)  # (B, L)
        positions = torch.tensor(positions, device=device)  # (N,)
        targets = torch.tensor(targets, device=device)  # (N,)
        logprobs, greedy = [], []
        with self.autocast:
            hidden = self.model.hidden_states(inputs).flatten(0, 1)[positions]  # (N, C)
            # lm_head and a float32 softmax over the 50K classes, LOGIT_CHUNK positions at a time
            chunks = self.model.logits_and_losses(hidden, targets, LOGIT_CHUNK)  # (n, V) and (n,) each
            for (logits, losses), t in zip(chunks, targets.split(LOGIT_CHUNK)):
                logprobs.append(-losses)  # (n,)
                greedy.append(logits[:, :self.valid_vocab].argmax(dim=-1) == t)  # (n,)
        per_row = zip(torch.cat(logprobs).cpu().split(counts), torch.cat(greedy).cpu().split(counts))
        return [(lp.sum().item(), bool(g.all())) for lp, g in per_row]

    # --- generation ---------------------------------------------------------------------------

    @torch.no_grad()
    def _generate(self, context: str, gen_kwargs: dict, generator: torch.Generator) -> str:
        until = gen_kwargs.pop("until", None) or []
        stops = [stop for stop in ([until] if isinstance(until, str) else until) if stop] + [EOT_TEXT]
        max_new = int(gen_kwargs.pop("max_gen_toks", 256))
        sample = bool(gen_kwargs.pop("do_sample", False))
        temperature = float(gen_kwargs.pop("temperature", 1.0)) if sample else 0.0
        top_k = gen_kwargs.pop("top_k", None) if sample else None
        # keep the newest context tokens, leaving room for the continuation (at least half the window)
        keep = max(self.block_size - max_new, self.block_size // 2)
        prompt = (self.tokenizer.encode_ordinary(context) or [EOT_TOKEN])[-keep:]
        generated: list[int] = []
        text = ""
        while len(generated) < max_new:
            n = min(GENERATION_CHUNK, max_new - len(generated))
            idx = torch.tensor([prompt + generated], device=self._device)  # (1, T)
            with self.autocast:
                out = self.model.generate(idx, n, temperature=temperature, top_k=top_k, generator=generator,
                                          valid_vocab=self.valid_vocab)  # (1, T + n)
            generated += out[0, -n:].tolist()
            text = self.tokenizer.decode(generated)
            if any(stop in text for stop in stops):
                break
        cut = min((text.find(stop) for stop in stops if stop in text), default=len(text))
        return text[:cut]
