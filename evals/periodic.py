"""The periodic evaluation of a run: val loss over the fixed val window, HellaSwag, text samples.

All run on the unwrapped, uncompiled model: no DDP hooks fire, and a compiled training
model never recompiles for eval-only shapes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from torch.nn import functional as F

from data.loader import ValLoader
from data.tokenizer import EOT_TOKEN
from model import upcast
from training.config import TrainConfig
from training.distributed import DistEnv, all_reduce_sum, run_on_all_ranks
from training.hellaswag import HellaSwagEval
from training.run import Run
from training.run_logger import RunLogger
from training.runtime import Runtime


class PeriodicEvaluation:
    """Val loss, HellaSwag and samples, each at its interval and after the last step.

    Every rank makes one (the HellaSwag data is fetched and agreed on here) and calls
    `run_due` at every step: val loss and HellaSwag are collectives, samples are drawn by
    rank 0 alone but their failure reaches every rank.
    """

    def __init__(self, cfg: TrainConfig, env: DistEnv, runtime: Runtime, logger: RunLogger, tokenizer):
        self.cfg, self.env, self.runtime, self.logger, self.tokenizer = cfg, env, runtime, logger, tokenizer
        self.hellaswag = (HellaSwagEval(cfg.hellaswag_path, cfg.hellaswag_limit, env, tokenizer, warn=logger.warn)
                          if cfg.hellaswag_interval else None)

    def due(self, step: int, last_step: bool) -> list[Callable[[Run], None]]:
        """The evaluations of this step, in the order they run."""
        cfg = self.cfg

        def every(interval: int) -> bool:
            return last_step or (interval > 0 and step % interval == 0)

        due = []
        if every(cfg.eval_interval):
            due.append(self.val_loss)
        if self.hellaswag is not None and every(cfg.hellaswag_interval):
            due.append(self.hellaswag_accuracy)
        if cfg.sample_interval and step > 0 and every(cfg.sample_interval):
            due.append(self.samples)
        return due

    def run_due(self, run: Run, last_step: bool, agree_to_stop: Callable[[], bool]) -> bool:
        """Each evaluation due at run.step, unless the ranks agree to stop; whether they did.

        The ranks agree before each evaluation and once after the last one (eval steps only),
        so a stop signal skips the rest and, arriving mid-eval, costs no extra training step.
        """
        due = self.due(run.step, last_step)
        for evaluate in due:
            if agree_to_stop():
                return True
            with run.strategy.evaluation(run.model):
                evaluate(run)
        return bool(due) and agree_to_stop()

    def val_loss(self, run: Run) -> None:
        loss = evaluate_val_loss(run.model, run.val_loader, self.env, self.runtime.autocast(),
                                 idle_forward=lambda: run.strategy.idle_forward(run.model))
        run.metrics["val_loss"] = loss
        self.logger.log({"kind": "val", "step": run.step, "loss": loss, "tokens": run.tokens_seen})
        self.logger.console(f"step {run.step:6d} | val loss {loss:.4f}")

    def hellaswag_accuracy(self, run: Run) -> None:
        result = self.hellaswag.evaluate(run.model, self.runtime.autocast(),  # a collective; None if unavailable
                                         idle_forward=lambda: run.strategy.idle_forward(run.model))
        if result is not None:
            run.metrics["hellaswag_acc_norm"] = result["acc_norm"]
            self.logger.log({"kind": "hellaswag", "step": run.step, "tokens": run.tokens_seen, **result})
            self.logger.console(f"step {run.step:6d} | hellaswag acc_norm {result['acc_norm']:.4f} "
                                f"({result['n']} examples)")

    def samples(self, run: Run) -> None:
        cfg = self.cfg

        def generate() -> None:  # rank 0 alone (every rank under FSDP); a failure reaches every rank
            if not (self.env.master_process or run.strategy.samples_on_every_rank):
                return
            texts = generate_samples(run.model, self.tokenizer, cfg.sample_prompt, cfg.sample_count,
                                     cfg.sample_tokens, self.runtime.device, seed=(cfg.seed + run.step) % 2**64,
                                     autocast=self.runtime.autocast())
            for text in texts:
                self.logger.log({"kind": "sample", "step": run.step, "text": text})
                self.logger.console(f"step {run.step:6d} | sample: {text!r}")

        run_on_all_ranks(self.env, generate)


@torch.no_grad()
def evaluate_val_loss(model: torch.nn.Module, val_loader: ValLoader, env: DistEnv,
                      autocast: contextlib.AbstractContextManager, chunk_tokens: int = 8192,
                      idle_forward: Callable[[], None] | None = None) -> float:
    """Mean token cross-entropy over the whole val window, the same number for any world size.

    Every rank calls this (it ends in an all-reduce), including ranks with no batch. Each val
    batch is the same rows on any world size (ValLoader), and its summed token loss goes into
    its own slot of a float64 vector; the all-reduce adds only zeros to each slot, and every
    rank then sums the slots in the same order. So 1, 2 or 8 ranks give a bitwise-equal figure.
    A rank with fewer batches than rank 0 calls idle_forward() once for each one it lacks
    (forwards are collectives under FSDP).
    """
    was_training = model.training
    model.eval()
    acc_dtype = torch.float32 if env.device_type == "mps" else torch.float64  # MPS has no float64
    sums = torch.zeros(val_loader.num_batches, device=env.device, dtype=acc_dtype)
    for index, x, y in in_lockstep(val_loader.batches(), val_loader.batches_per_rank, idle_forward):
        x, y = x.to(env.device), y.to(env.device)  # (b, T)
        with autocast:
            hidden = model.hidden_states(x).flatten(0, 1)  # (b*T, C)
        targets = y.flatten()  # (b*T,)
        # lm_head a chunk of tokens at a time: whole (b*T, V) logits would be 13 GB in fp32 at b=64
        for h, t in zip(hidden.split(chunk_tokens), targets.split(chunk_tokens)):
            with autocast:
                logits = model.lm_head(h)  # (n, V)
            sums[index] += F.cross_entropy(upcast(logits), t, reduction="none").to(acc_dtype).sum()
    all_reduce_sum(sums, env)
    model.train(was_training)
    return sums.sum().item() / (val_loader.num_rows * val_loader.stream.seq_len)


def in_lockstep(items: Iterable, rounds: int, idle_forward: Callable[[], None] | None):
    """Yield items, then call idle_forward() until `rounds` forwards were made in all.

    For a rank whose share of an evaluation is smaller than the largest rank's: under FSDP
    every forward is a collective, so each rank runs `rounds` of them (see Strategy.idle_forward).
    """
    made = 0
    for item in items:
        made += 1
        yield item
    if idle_forward is not None:
        for _ in range(rounds - made):
            idle_forward()


@torch.no_grad()
def generate_samples(model: torch.nn.Module, tokenizer, prompt: str, count: int, max_new_tokens: int,
                     device: torch.device, seed: int, temperature: float = 1.0, top_k: int = 50,
                     autocast: contextlib.AbstractContextManager | None = None) -> list[str]:
    """`count` continuations of `prompt`, top-k sampled from a generator seeded with `seed`.

    No collective inside: rank 0 alone calls it while the others go on to the next step.
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
