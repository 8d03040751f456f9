"""Val loss and bits per byte: each val set's fixed window, the same figures on any number of ranks.

One val set (the default: data_dir's val split) gives the record {"loss": L, "bpb": B}. Several (val_sets,
or a mixture's sources) give one record with every set's loss under its name and its bits per byte under
bpb_<name>, `loss` and `bpb` the first set's: {"loss": L_edu, "bpb": B_edu, "edu": L_edu, "code": L_code,
"bpb_edu": B_edu, "bpb_code": B_code}; W&B and TensorBoard show them as val/<field>.

Bits per byte compares runs whatever their tokenizer or data mixture: bpb = loss_sum / (bytes * ln 2), the
window's summed token loss in nats over the bytes of text its target tokens stand for (data/tokenizer.py's
token_byte_lengths: the <|endoftext|> between documents counts no byte, its loss counts). The bytes of a
window are counted once, at its first evaluation, over the whole window on every rank.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from common.log_fields import BPB, BPB_PREFIX, val_set_names
from data.loader import ValLoader
from data.tokenizer import token_byte_lengths
from evals.base import Evaluator, Progress, Series, in_lockstep
from runtime.process_group import DistEnv, all_reduce_sum

if TYPE_CHECKING:
    from training.distributed.strategies import Strategy
    from evals.settings import EvalSettings
    from runtime.context import Context

def bits_per_byte(loss_sum: float, n_bytes: int) -> float | None:
    """Summed token loss in nats over n_bytes bytes of text, in bits per byte; None for a window of no text."""
    return loss_sum / (n_bytes * math.log(2)) if n_bytes else None


class ValLoss(Evaluator):
    """Every eval_interval steps and after the last one, over the val_tokens of the val window."""

    kind = "val"
    series = Series("val", "loss", "loss", "loss")
    metric = ("val_loss", "loss")
    averaged = True

    def __init__(self, interval: int, env: DistEnv, autocast: Callable[[], contextlib.AbstractContextManager],
                 byte_lengths: np.ndarray, console: Callable[[str], None] = lambda text: None):
        super().__init__(interval)
        self.env, self.autocast, self.byte_lengths, self.console = env, autocast, byte_lengths, console
        self.window_bytes: dict[str, int] = {}  # each val set's target bytes, counted at its first evaluation

    @classmethod
    def from_settings(cls, settings: EvalSettings, ctx: Context, strategy: Strategy, tokenizer,
                      seed: int) -> ValLoss:
        # always on: a run ends with its val loss; the shards hold GPT-2 token ids (data/tokenizer.py)
        return cls(settings.eval_interval, ctx.env, ctx.runtime.autocast, token_byte_lengths(), ctx.logger.console)

    def evaluate(self, run) -> list[dict]:
        def progress(name: str, loader: ValLoader) -> Progress:
            return Progress(f"step {run.step:6d} | val loss{'' if name == 'val' else ' ' + name}",
                            loader.batches_per_rank, self.console)

        losses, bpb = {}, {}
        for name, loader in run.val_loaders.items():  # every rank, every set, in the same order
            rows = val_row_losses(run.model, loader, self.env, self.autocast(),
                                  idle_forward=lambda: run.strategy.idle_forward(run.model),
                                  progress=progress(name, loader))
            if name not in self.window_bytes:
                self.window_bytes[name] = loader.target_bytes(self.byte_lengths)
            losses[name] = mean_loss(rows, loader.stream.seq_len)
            bpb[name] = bits_per_byte(rows.sum().item(), self.window_bytes[name])
        first = next(iter(losses))
        record = {"loss": losses[first], BPB: bpb[first]}
        if list(losses) != ["val"]:
            record.update({**losses, **{BPB_PREFIX + name: value for name, value in bpb.items()}})
        return [record]

    def describe(self, record: dict) -> str:
        def figure(loss: float, bpb: float | None) -> str:
            return f"{loss:.4f}" + ("" if bpb is None else f" ({bpb:.4f} bpb)")

        sets = [f"{name} {figure(record[name], record.get(BPB_PREFIX + name))}" for name in val_set_names(record)]
        # "val loss 4.1234 (1.7000 bpb)", or "val loss edu 3.2000 (1.1000 bpb) | code 2.9000 (0.9000 bpb)"
        return "val loss " + (" | ".join(sets) if sets else figure(record["loss"], record.get(BPB)))


@torch.no_grad()
def val_row_losses(model: torch.nn.Module, val_loader: ValLoader, env: DistEnv,
                   autocast: contextlib.AbstractContextManager, chunk_tokens: int = 8192,
                   idle_forward: Callable[[], None] | None = None,
                   progress: Callable[[int], None] | None = None) -> torch.Tensor:
    """Each row's summed token cross-entropy over the whole val window, (num_rows,) float64 on the CPU,
    the same numbers for any world size.

    Every rank calls this (it ends in an all-reduce), including ranks with no batch. Each val
    batch is the same rows on any world size (ValLoader), and each row's summed loss goes into
    its own slot of a float64 vector; the all-reduce adds only zeros to each slot. So 1, 2 or 8
    ranks give bitwise-equal rows, and every sum of them in the same order is equal too.
    A rank with fewer batches than rank 0 calls idle_forward() once for each one it lacks
    (forwards are collectives under FSDP). progress(n) hears of each of this rank's batches done (Progress).
    """
    was_training = model.training
    model.eval()
    acc_dtype = torch.float32 if env.device_type == "mps" else torch.float64  # MPS has no float64
    sums = torch.zeros(val_loader.num_rows, device=env.device, dtype=acc_dtype)
    batches = in_lockstep(val_loader.batches(), val_loader.batches_per_rank, idle_forward)
    for done, (index, x, y) in enumerate(batches, start=1):
        x, y = x.to(env.device), y.to(env.device)  # (b, T)
        first = index * val_loader.batch_size
        with autocast:
            hidden = model.hidden_states(x).flatten(0, 1)  # (b*T, C)
            losses = [losses.to(acc_dtype) for _, losses in model.logits_and_losses(hidden, y.flatten(), chunk_tokens)]
        sums[first:first + x.size(0)] = torch.cat(losses).view_as(y).sum(dim=1)  # (b,)
        if progress is not None:
            progress(done)
    all_reduce_sum(sums, env)
    model.train(was_training)
    return sums.to("cpu", torch.float64)


def evaluate_val_loss(model: torch.nn.Module, val_loader: ValLoader, env: DistEnv,
                      autocast: contextlib.AbstractContextManager, chunk_tokens: int = 8192,
                      idle_forward: Callable[[], None] | None = None) -> float:
    """Mean token cross-entropy over the whole val window, the same number for any world size (val_row_losses)."""
    return mean_loss(val_row_losses(model, val_loader, env, autocast, chunk_tokens, idle_forward),
                     val_loader.stream.seq_len)


def mean_loss(row_losses: torch.Tensor, seq_len: int) -> float:
    """The mean token loss of rows of seq_len targets, from their summed losses (num_rows,)."""
    return row_losses.sum().item() / (row_losses.numel() * seq_len)
