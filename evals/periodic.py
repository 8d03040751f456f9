"""The trainer's periodic evaluations: the registry (EVALUATORS: what one is, evals/base.py), and the runner the
training loop calls each step, which schedules each, logs its records and keeps its figure for checkpoints.

With an EMA of the weights (training/optim/ema.py), an evaluator whose `averaged` is set runs again on
the average, swapped into the model and back out (bitwise), and its figures join the live record
prefixed `ema_` (val's `ema_loss`: val/ema_loss in W&B and TensorBoard, its own curve in plot_log.py).
"""

from __future__ import annotations

from collections.abc import Callable

from evals.base import EMA_PREFIX, Evaluator
from evals.hellaswag import HellaSwag
from evals.samples import Samples
from evals.val_loss import ValLoss
from training.distributed.strategies import Strategy
from evals.settings import EvalSettings
from runtime.context import Context

EVALUATORS: tuple[type[Evaluator], ...] = (ValLoss, HellaSwag, Samples)  # in the order they run at a step


class PeriodicEvaluation:
    """The configured evaluators, each at its interval and after the last step.

    Every rank makes one (HellaSwag's data is fetched and agreed on here) and calls `run_due`
    at every step.
    """

    def __init__(self, settings: EvalSettings, ctx: Context, strategy: Strategy, tokenizer, seed: int):
        """settings: the evaluation section, what every evaluator is made from; seed: the runtime section's."""
        self.logger = ctx.logger
        self.settings = settings
        self.evaluators = [e for cls in EVALUATORS
                           if (e := cls.from_settings(settings, ctx, strategy, tokenizer, seed))]
        self.unlogged_skips = [e for e in self.evaluators if e.skip_reason]  # logged at the launch's first step

    def run_due(self, run, last_step: bool, agree_to_stop: Callable[[], bool]) -> bool:
        """Each evaluation due at run.step, unless the ranks agree to stop; whether they did.

        The ranks agree before each evaluation and once after the last one (eval steps only),
        so a stop signal skips the rest and, arriving mid-eval, costs no extra training step.
        At the last step they do not agree after the last one: no step follows, and with every
        final evaluation logged the run is finished (a stop then only waits for the final save).
        """
        for evaluator in self.unlogged_skips:  # a record beside the launch's warning: the log says why
            self.logger.log({"kind": "skip_eval", "step": run.step, "tokens": run.tokens_seen, "eval": evaluator.kind,
                             "reason": evaluator.skip_reason})
        self.unlogged_skips = []
        due = [e for e in self.evaluators if e.due(run.step, last_step)]
        for evaluator in due:
            if agree_to_stop():
                return True
            with run.strategy.evaluation(run.model):
                records = evaluator.evaluate(run)
            averaged = self.evaluate_average(evaluator, run)
            for record, average in zip(records, averaged or [None] * len(records)):
                self.logger.log({"kind": evaluator.kind, "step": run.step, "tokens": run.tokens_seen, **record,
                                 **({} if average is None else averaged_fields(evaluator, average))})
                self.logger.console(f"step {run.step:6d} | {evaluator.describe(record)}")
                if average is not None:
                    self.logger.console(f"step {run.step:6d} | ema {evaluator.describe(average)}")
            if evaluator.metric and records:
                key, field = evaluator.metric
                run.metrics[key] = records[-1][field]
                if averaged:
                    run.metrics[f"ema_{key}"] = averaged[-1][field]
        return bool(due) and not last_step and agree_to_stop()

    @staticmethod
    def evaluate_average(evaluator: Evaluator, run) -> list[dict] | None:
        """The evaluator's records of the EMA weights, or None where there is none to evaluate (decided by
        the step alone: the same on every rank, so every rank runs the same collectives). The average is
        swapped in before the strategy's evaluation context (whose gathers must see it) and out after."""
        ema = getattr(run, "ema", None)
        if not evaluator.averaged or ema is None or not ema.ready:
            return None
        with ema.swapped_in(run.model), run.strategy.evaluation(run.model):
            return evaluator.evaluate(run)


def averaged_fields(evaluator: Evaluator, record: dict) -> dict:
    """The EMA's record as fields of the live one: each prefixed ema_, but those that do not depend on the
    weights (HellaSwag's example count)."""
    return {EMA_PREFIX + key: value for key, value in record.items() if key not in evaluator.unweighted_fields}
