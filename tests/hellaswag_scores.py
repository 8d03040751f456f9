"""Per-example HellaSwag scores, for pick-by-pick comparisons in tests (the trainer needs only the counts).

Built on the evaluator's public `losses`, the generator its `accuracy` counts from. Also the
body of the multi-rank HellaSwag tests (tests/test_hellaswag.py), run on every rank.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class ExampleScore:
    """One example's losses, per ending."""

    index: int
    label: int
    sum_losses: tuple[float, ...]
    mean_losses: tuple[float, ...]

    @property
    def pred_norm(self) -> int:
        """The ending with the lowest mean loss per token (first one on a tie, like argmin)."""
        return min(range(len(self.mean_losses)), key=self.mean_losses.__getitem__)

    @property
    def pred(self) -> int:
        """The ending with the lowest summed loss."""
        return min(range(len(self.sum_losses)), key=self.sum_losses.__getitem__)


@torch.no_grad()
def per_example_scores(evaluator, model, autocast=None) -> list[ExampleScore]:
    """The evaluator's per-example losses for this rank's share, by example index. No collective."""
    scores = []
    for batch, sums, means in evaluator.losses(model, autocast):
        for index, label, s, m in zip(batch.indices, batch.labels.tolist(), sums.tolist(), means.tolist()):
            scores.append(ExampleScore(index=index, label=label, sum_losses=tuple(s), mean_losses=tuple(m)))
    return sorted(scores, key=lambda score: score.index)


def score_jobs_on_every_rank(argv: list[str]) -> int:
    """A rank of the multi-rank tests: argv[0] is a JSON spec of a tiny model and evaluator jobs.

    Writes, per job, this rank's {result, predictions} (or the {error} its evaluator raised) to
    OUT/rank{r}.json. Every rank builds the same weights (seed 0), as the trainer does.
    """
    from data.tokenizer import get_tokenizer
    from evals.hellaswag import HellaSwag, HellaSwagDataError
    from model import GPT, GPTConfig
    from runtime.process_group import setup_distributed, teardown_distributed

    spec = json.loads(Path(argv[0]).read_text())
    env = setup_distributed(torch.device("cpu"), datetime.timedelta(minutes=5))
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**spec["model"])).eval()
        results = []
        for job in spec["jobs"]:
            try:
                evaluator = HellaSwag(job["path"], job["limit"], env, get_tokenizer(), batch_examples=job["batch_examples"],
                                      cache_dir=job["cache_dir"], url=job["url"], timeout=1)
            except HellaSwagDataError as e:
                results.append({"error": str(e)})
                continue
            predictions = [[s.index, s.pred_norm, s.pred] for s in per_example_scores(evaluator, model)]
            results.append({"result": evaluator.accuracy(model), "predictions": predictions})
        Path(spec["out"], f"rank{env.rank}.json").write_text(json.dumps(results))
    finally:
        teardown_distributed()
    return 0
