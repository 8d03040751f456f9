"""Per-example HellaSwag scores, for pick-by-pick comparisons in tests (the trainer needs only the counts).

Built on the evaluator's public `losses`, the generator its `accuracy` counts from.
"""

from __future__ import annotations

from dataclasses import dataclass

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
