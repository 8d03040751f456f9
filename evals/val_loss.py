"""Val loss: mean token cross-entropy over each val set's fixed window, the same figure on any number of ranks.

One val set (the default: data_dir's val split) gives today's record, {"loss": L}. Several (val_sets,
or a mixture's sources) give one record with every set's loss under its name, and `loss` the first
set's: {"loss": L_edu, "edu": L_edu, "code": L_code}; W&B and TensorBoard show them as val/<name>.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from data.loader import ValLoader
from evals.base import EMA_PREFIX, Evaluator, Progress, Series, in_lockstep
from training.distributed.process_group import DistEnv, all_reduce_sum

if TYPE_CHECKING:
    from training.distributed.strategies import Strategy
    from training.train.config import EvalSettings
    from training.train.context import Context


class ValLoss(Evaluator):
    """Every eval_interval steps and after the last one, over the val_tokens of the val window."""

    kind = "val"
    series = Series("val", "loss", "loss", "loss")
    metric = ("val_loss", "loss")
    averaged = True

    def __init__(self, interval: int, env: DistEnv, autocast: Callable[[], contextlib.AbstractContextManager],
                 console: Callable[[str], None] = lambda text: None):
        super().__init__(interval)
        self.env, self.autocast, self.console = env, autocast, console

    @classmethod
    def from_settings(cls, settings: EvalSettings, ctx: Context, strategy: Strategy, tokenizer) -> ValLoss:
        # always on: a run ends with its val loss
        return cls(settings.eval_interval, ctx.env, ctx.runtime.autocast, ctx.logger.console)

    def evaluate(self, run) -> list[dict]:
        def progress(name: str, loader: ValLoader) -> Progress:
            return Progress(f"step {run.step:6d} | val loss{'' if name == 'val' else ' ' + name}",
                            loader.batches_per_rank, self.console)

        losses = {name: evaluate_val_loss(run.model, loader, self.env, self.autocast(),
                                          idle_forward=lambda: run.strategy.idle_forward(run.model),
                                          progress=progress(name, loader))
                  for name, loader in run.val_loaders.items()}  # every rank, every set, in the same order
        first = next(iter(losses.values()))
        return [{"loss": first} if list(losses) == ["val"] else {"loss": first, **losses}]

    def describe(self, record: dict) -> str:
        sets = [f"{name} {loss:.4f}" for name, loss in record.items()
                if name not in ("kind", "step", "tokens", "loss") and not name.startswith(EMA_PREFIX)]
        return "val loss " + (" | ".join(sets) if sets else f"{record['loss']:.4f}")  # "val loss edu 3.2 | code 2.9"


@torch.no_grad()
def evaluate_val_loss(model: torch.nn.Module, val_loader: ValLoader, env: DistEnv,
                      autocast: contextlib.AbstractContextManager, chunk_tokens: int = 8192,
                      idle_forward: Callable[[], None] | None = None,
                      progress: Callable[[int], None] | None = None) -> float:
    """Mean token cross-entropy over the whole val window, the same number for any world size.

    Every rank calls this (it ends in an all-reduce), including ranks with no batch. Each val
    batch is the same rows on any world size (ValLoader), and its summed token loss goes into
    its own slot of a float64 vector; the all-reduce adds only zeros to each slot, and every
    rank then sums the slots in the same order. So 1, 2 or 8 ranks give a bitwise-equal figure.
    A rank with fewer batches than rank 0 calls idle_forward() once for each one it lacks
    (forwards are collectives under FSDP). progress(n) hears of each of this rank's batches done (Progress).
    """
    was_training = model.training
    model.eval()
    acc_dtype = torch.float32 if env.device_type == "mps" else torch.float64  # MPS has no float64
    sums = torch.zeros(val_loader.num_batches, device=env.device, dtype=acc_dtype)
    batches = in_lockstep(val_loader.batches(), val_loader.batches_per_rank, idle_forward)
    for done, (index, x, y) in enumerate(batches, start=1):
        x, y = x.to(env.device), y.to(env.device)  # (b, T)
        with autocast:
            hidden = model.hidden_states(x).flatten(0, 1)  # (b*T, C)
            for _, losses in model.logits_and_losses(hidden, y.flatten(), chunk_tokens):  # (n,) per chunk
                sums[index] += losses.to(acc_dtype).sum()
        if progress is not None:
            progress(done)
    all_reduce_sum(sums, env)
    model.train(was_training)
    return sums.sum().item() / (val_loader.num_rows * val_loader.stream.seq_len)
