"""What an evaluation is to the trainer: a name, when it runs, the records it logs, what it plots.

An evaluation is one `Evaluator` subclass plus its keys in the evaluation section (EvalSettings,
evals/settings.py), listed in evals/periodic.py's EVALUATORS. Every rank builds the same
evaluators from those settings and calls `evaluate` at the same steps, so an evaluation may
contain collectives (every rank reaches them); under FSDP every forward is one, so a rank with
less to do joins the others' forwards (`in_lockstep`). Evaluations run on the unwrapped,
uncompiled model: no DDP hooks fire, and a compiled training model never recompiles for
eval-only shapes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from common.log_fields import EMA_PREFIX
from runtime.logger import format_duration

if TYPE_CHECKING:
    from training.distributed.strategies import Strategy
    from evals.settings import EvalSettings
    from runtime.context import Context


@dataclass(frozen=True)
class Series:
    """A curve plot_log.py draws: the `field` of the log records of `kind`, in the panel titled `panel`.

    Series of one panel share its y axis (`ylabel`); `percent` plots fractions as percentages.
    """

    kind: str
    field: str
    panel: str
    ylabel: str
    percent: bool = False


TRAIN_LOSS = Series("train", "loss", "loss", "loss")  # not an evaluation, but val shares its panel


def averaged_series(series: Series) -> Series:
    """The curve of the same figure of the EMA weights, in the same panel."""
    return Series(series.kind, EMA_PREFIX + series.field, series.panel, series.ylabel, series.percent)


class Evaluator:
    """One periodic evaluation of the model being trained."""

    kind: ClassVar[str]  # the `kind` of the log.jsonl records it writes
    series: ClassVar[Series | None] = None  # what plot_log.py draws of those records
    # (key in the checkpoint's metrics, record field): the latest figure, saved with checkpoints
    # (the Hugging Face model card shows it)
    metric: ClassVar[tuple[str, str] | None] = None
    # whether it also runs on the EMA of the weights, where there is one (evals/periodic.py): its figures
    # then join the record prefixed ema_, but unweighted_fields (the same for any weights)
    averaged: ClassVar[bool] = False
    unweighted_fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self, interval: int):
        self.interval = interval  # every N steps, and after the last step; 0: only after the last
        # why this launch cannot run it (its data could not be had), the same on every rank; None: it runs.
        # evals/periodic.py logs it as the launch's skip_eval record of this evaluation
        self.skip_reason: str | None = None

    @classmethod
    def from_settings(cls, settings: EvalSettings, ctx: Context, strategy: Strategy, tokenizer,
                      seed: int) -> Evaluator | None:
        """The evaluator the evaluation section asks for, or None when it is off. Called on every rank.

        Its own keys come from `settings`; ctx gives the processes, the device and the logger; seed is
        the runtime section's, the run's one seed, what an evaluation that draws (the samples) draws
        from. An evaluation that splits its examples over the ranks takes its share from the
        strategy's data-parallel view (strategy.dp_rank of strategy.dp_size), as the loaders do."""
        raise NotImplementedError

    def due(self, step: int, last_step: bool) -> bool:
        return last_step or (self.interval > 0 and step % self.interval == 0)

    def evaluate(self, run) -> list[dict]:
        """The records of one evaluation of run.model at run.step (the runner adds kind, step, tokens).

        Called on every rank, inside the strategy's evaluation context. Ranks other than 0 may
        return anything: only rank 0 logs.
        """
        raise NotImplementedError

    def describe(self, record: dict) -> str:
        """The console line of one of its records (after `step N |`)."""
        raise NotImplementedError


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


class Progress:
    """Progress lines for an evaluation that takes a while (val loss over a large window, HellaSwag's 10,042
    examples): none for one that ends within `after_s` seconds, then one every `every_s` seconds while batches
    are left (the last one's line would only precede the result's), through `console` (rank 0's logger: a
    no-op on the other ranks).

    Host-side only: no collective and no synchronisation with the device. On a GPU the host runs ahead
    by the batches it has queued, so the count is of batches queued, and the lines start once the host
    has had to wait for them.
    """

    AFTER_S, EVERY_S = 5.0, 10.0

    def __init__(self, what: str, total: int, console: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic):
        self.what, self.total, self.console, self.clock = what, total, console, clock
        self.started = clock()
        self.said = None  # when the last line was printed

    def __call__(self, done: int) -> None:
        """done of total batches are through."""
        now = self.clock()
        elapsed = now - self.started
        if elapsed < self.AFTER_S or (self.said is not None and now - self.said < self.EVERY_S) \
                or not 0 < done < self.total:
            return
        self.said = now
        left = elapsed / done * (self.total - done)
        self.console(f"{self.what}: {done}/{self.total} batches ({100 * done / max(self.total, 1):.0f}%) | "
                     f"elapsed {format_duration(elapsed)} | eta {format_duration(left)}")
