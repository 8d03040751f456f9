"""Text samples from a prompt, seeded by the step: the same continuations on any number of ranks."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from data.tokenizer import EOT_TOKEN
from evals.base import Evaluator
from runtime.process_group import DistEnv, run_on_all_ranks

if TYPE_CHECKING:
    from training.distributed.strategies import Strategy
    from evals.settings import EvalSettings
    from runtime.context import Context


class Samples(Evaluator):
    """sample_count continuations of sample_prompt every sample_interval steps (not at step 0) and after the last."""

    kind = "sample"

    def __init__(self, interval: int, env: DistEnv, tokenizer, prompt: str, count: int, max_new_tokens: int,
                 seed: int, device: torch.device, autocast: Callable[[], contextlib.AbstractContextManager]):
        super().__init__(interval)
        self.env, self.tokenizer, self.prompt, self.count = env, tokenizer, prompt, count
        self.max_new_tokens, self.seed, self.device, self.autocast = max_new_tokens, seed, device, autocast

    @classmethod
    def from_settings(cls, settings: EvalSettings, ctx: Context, strategy: Strategy, tokenizer,
                      seed: int) -> Samples | None:
        if not settings.sample_interval:
            return None
        # seed: the run's one seed, which the samples' generator is drawn from too
        return cls(settings.sample_interval, ctx.env, tokenizer, settings.sample_prompt, settings.sample_count,
                   settings.sample_tokens, seed, ctx.runtime.device, ctx.runtime.autocast)

    def due(self, step: int, last_step: bool) -> bool:
        return step > 0 and super().due(step, last_step)

    def evaluate(self, run) -> list[dict]:
        """Rank 0 draws the samples (every rank under FSDP, whose forwards are collectives); a
        failure on any rank reaches every rank."""
        def generate() -> list[str]:
            if not (self.env.master_process or run.strategy.forwards_are_collective):
                return []
            return generate_samples(run.model, self.tokenizer, self.prompt, self.count, self.max_new_tokens,
                                    self.device, seed=(self.seed + run.step) % 2**64, autocast=self.autocast())

        return [{"text": text} for text in run_on_all_ranks(self.env, generate)]

    def describe(self, record: dict) -> str:
        return f"sample: {record['text']!r}"


@torch.no_grad()
def generate_samples(model: torch.nn.Module, tokenizer, prompt: str, count: int, max_new_tokens: int,
                     device: torch.device, seed: int, temperature: float = 1.0, top_k: int = 50,
                     autocast: contextlib.AbstractContextManager | None = None) -> list[str]:
    """`count` continuations of `prompt`, top-k sampled from a generator seeded with `seed`.

    No collective inside, but under FSDP its forwards are: there every rank calls it.
    """
    was_training = model.training
    model.eval()
    ids = torch.tensor([encode_prompt(tokenizer, prompt)] * count, dtype=torch.long, device=device)  # (count, P)
    generator = torch.Generator(device=device).manual_seed(seed)
    with autocast or contextlib.nullcontext():
        out = model.generate(ids, max_new_tokens, temperature=temperature, top_k=top_k,
                             generator=generator, valid_vocab=tokenizer.n_vocab)
    model.train(was_training)
    return [tokenizer.decode(row.tolist()) for row in out]


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """The prompt's token ids; an empty prompt is <|endoftext|>, GPT-2's unconditional start."""
    return tokenizer.encode(prompt, allowed_special="all") or [EOT_TOKEN]
