"""A scaling law fitted to final val losses: L(C) = E + A * (C / C0)^-alpha over training compute C, with bootstrap
intervals, the loss it predicts at a larger C, and the trend of a difference with scale (ladder.py). numpy only.

Least squares on the loss itself (the seed noise is additive and about as wide at every rung). For a fixed alpha
the law is linear in E and A (variable projection): a closed-form least squares with E >= 0 and A >= 0, leaving a
search over alpha alone, a log grid then golden-section refinement, with no starting guess, on every bootstrap
replicate at once. C is divided by C0, the smallest compute fitted, so (C / C0)^-alpha stays in (0, 1]. The
intervals are a residual bootstrap: the budgets are the ladder's design, fixed; each replicate adds residuals
drawn from all runs' to the law and fits again. docs/SCALING.md, "The law": why each choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from evals.stats import CONFIDENCE, t_test

ALPHA_RANGE = (1e-3, 3.0)  # the exponents searched; one at either end is reported as at its bound
GRID = np.geomspace(*ALPHA_RANGE, 241)  # adjacent exponents 3.4% apart: refinement only polishes the best one
PARAMETERS = 3  # E, A, alpha
GOLDEN = (math.sqrt(5) - 1) / 2


@dataclass(frozen=True)
class PowerLaw:
    """L(C) = E + A * (C / c0)^-alpha."""

    E: float
    A: float
    alpha: float
    c0: float

    def __call__(self, compute) -> np.ndarray | float:
        return self.E + self.A * (np.asarray(compute, dtype=float) / self.c0) ** -self.alpha

    def formula(self) -> str:
        return f"L(C) = {self.E:.4f} + {self.A:.4f} * (C / {self.c0:.3e})^-{self.alpha:.4f}"


def _linear_part(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(E, A, sum of squared residuals) of y ~ E + A x with E >= 0 and A >= 0, over the last axis (x, y: (..., n)).

    The unconstrained solution where it is feasible; else the better of the two edges, E = 0 (A its own least
    squares, at least 0) and A = 0 (E the mean): the problem is convex in (E, A), so its constrained minimum lies
    on an edge whenever the unconstrained one lies outside."""
    xm, ym = x.mean(-1, keepdims=True), y.mean(-1, keepdims=True)
    sxx = ((x - xm) ** 2).sum(-1)
    a = ((x - xm) * (y - ym)).sum(-1) / np.where(sxx > 0, sxx, np.inf)  # x all equal: no slope to fit
    e = ym[..., 0] - a * xm[..., 0]

    def sse(e, a):
        return ((e[..., None] + a[..., None] * x - y) ** 2).sum(-1)

    feasible = (e >= 0) & (a >= 0)
    a_edge = np.maximum(0.0, (x * y).sum(-1) / (x * x).sum(-1))  # on E = 0
    e_edge = np.maximum(0.0, ym[..., 0])  # on A = 0
    zero = np.zeros_like(a)
    sse_e0, sse_a0 = sse(zero, a_edge), sse(e_edge, zero)
    e = np.where(feasible, e, np.where(sse_e0 <= sse_a0, 0.0, e_edge))
    a = np.where(feasible, a, np.where(sse_e0 <= sse_a0, a_edge, 0.0))
    return e, a, sse(e, a)


def _fit_alpha(scaled: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(E, A, alpha, sse) of every row of y (..., n) against the fixed scaled compute (n,): the grid over alpha,
    then golden-section search between the best grid point's neighbours (60 steps: the bracket shrinks below
    1e-12 of its width)."""
    x = scaled[None, :] ** -GRID[:, None]  # (G, n)
    _, _, sse = _linear_part(np.broadcast_to(x, (*y.shape[:-1], *x.shape)), y[..., None, :])  # (..., G)
    best = sse.argmin(-1)
    lo = np.log(GRID[np.maximum(best - 1, 0)])
    hi = np.log(GRID[np.minimum(best + 1, len(GRID) - 1)])

    def cost(log_alpha):
        return _linear_part(scaled ** -np.exp(log_alpha)[..., None], y)[2]

    m1, m2 = hi - GOLDEN * (hi - lo), lo + GOLDEN * (hi - lo)
    f1, f2 = cost(m1), cost(m2)
    for _ in range(60):
        left = f1 <= f2  # the minimum lies in [lo, m2]
        hi, lo = np.where(left, m2, hi), np.where(left, lo, m1)
        m1, m2, f1_old = np.where(left, hi - GOLDEN * (hi - lo), m2), np.where(left, m1, lo + GOLDEN * (hi - lo)), f1
        f1, f2 = np.where(left, cost(m1), f2), np.where(left, f1_old, cost(m2))
    alpha = np.exp((lo + hi) / 2)
    e, a, sse = _linear_part(scaled ** -alpha[..., None], y)
    return e, a, alpha, sse


def fit_power_law(compute, loss) -> PowerLaw:
    """The least-squares L(C) = E + A * (C / C0)^-alpha through the points (compute, loss); C0 = min(compute)."""
    compute, loss = _points(compute, loss)
    c0 = float(compute.min())
    e, a, alpha, _ = _fit_alpha(compute / c0, loss)
    return PowerLaw(float(e), float(a), float(alpha), c0)


def _points(compute, loss) -> tuple[np.ndarray, np.ndarray]:
    compute, loss = np.asarray(compute, dtype=float), np.asarray(loss, dtype=float)
    if compute.shape != loss.shape or compute.ndim != 1:
        raise ValueError(f"compute and loss must be two lists of one length, got shapes {compute.shape}, {loss.shape}")
    if not (np.isfinite(compute).all() and np.isfinite(loss).all() and (compute > 0).all()):
        raise ValueError("compute must be positive and every value finite")
    if len(np.unique(compute)) < PARAMETERS:
        raise ValueError(f"the law has {PARAMETERS} parameters: it needs at least {PARAMETERS} distinct budgets, "
                         f"got {len(np.unique(compute))}")
    return compute, loss


@dataclass(frozen=True)
class Interval:
    low: float
    high: float

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high


@dataclass(frozen=True)
class Prediction:
    """The law at one compute: its value, the 95% interval of the law there, and of one run's final loss there."""

    compute: float
    loss: float
    law: Interval | None  # None: too few runs for intervals
    run: Interval | None


@dataclass(frozen=True)
class LawFit:
    """A fitted law with its bootstrap: the replicates' parameters, and the residual pool a new run draws from."""

    law: PowerLaw
    n: int  # runs fitted
    budgets: int  # distinct compute values among them
    residual_sd: float  # of the runs about the law, with n - 3 degrees of freedom (0 with none)
    at_bound: tuple[str, ...]  # the parameters at a bound of their search: E or A at 0, alpha at an end of ALPHA_RANGE
    replicates: dict[str, np.ndarray] | None  # {"E", "A", "alpha"}: (B,) each; None with n <= 3
    residuals: np.ndarray | None  # the scaled, centred residuals of the runs
    seed: int

    def interval(self, name: str, confidence: float = CONFIDENCE) -> Interval | None:
        """The bootstrap percentile interval of E, A or alpha."""
        return None if self.replicates is None else _percentiles(self.replicates[name], confidence)

    def predict(self, compute: float, confidence: float = CONFIDENCE) -> Prediction:
        """The law at compute, with the intervals of the law there and of one run's final loss there."""
        value = float(self.law(compute))
        if self.replicates is None:
            return Prediction(compute, value, None, None)
        curve = self._replicate_curve(np.array([compute]))[:, 0]  # (B,)
        # one more run: its own residual on top of its replicate's law (drawn by a generator of its own, so that
        # the law's interval does not depend on whether the run's was asked for)
        noise = np.random.default_rng([self.seed, 1]).choice(self.residuals, size=curve.shape)
        return Prediction(compute, value, _percentiles(curve, confidence), _percentiles(curve + noise, confidence))

    def band(self, compute, confidence: float = CONFIDENCE) -> tuple[np.ndarray, np.ndarray] | None:
        """The law's 95% band at each compute (low, high), or None without replicates."""
        if self.replicates is None:
            return None
        curves = self._replicate_curve(np.asarray(compute, dtype=float))
        tail = (1 - confidence) / 2 * 100
        return np.percentile(curves, tail, axis=0), np.percentile(curves, 100 - tail, axis=0)

    def _replicate_curve(self, compute: np.ndarray) -> np.ndarray:
        r = self.replicates
        return r["E"][:, None] + r["A"][:, None] * (compute[None, :] / self.law.c0) ** -r["alpha"][:, None]


def _percentiles(values: np.ndarray, confidence: float) -> Interval:
    tail = (1 - confidence) / 2 * 100
    return Interval(float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail)))


def fit_with_bootstrap(compute, loss, replicates: int = 2000, seed: int = 0) -> LawFit:
    """The law through the runs (compute, loss), and `replicates` residual-bootstrap refits (none with 3 runs or
    fewer: no residual is left to resample). The same inputs and seed give the same numbers, bit for bit."""
    compute, loss = _points(compute, loss)
    law = fit_power_law(compute, loss)
    n = len(loss)
    residuals = loss - law(compute)
    dof = n - PARAMETERS
    residual_sd = float(math.sqrt((residuals ** 2).sum() / dof)) if dof > 0 else 0.0
    at_bound = tuple(name for name, bound in (("E", law.E == 0), ("A", law.A == 0),
                                              ("alpha", not GRID[1] < law.alpha < GRID[-2])) if bound)
    if dof <= 0 or replicates <= 0:
        return LawFit(law, n, len(np.unique(compute)), residual_sd, at_bound, None, None, seed)
    pool = (residuals - residuals.mean()) * math.sqrt(n / dof)
    rng = np.random.default_rng([seed, 0])
    samples = law(compute)[None, :] + rng.choice(pool, size=(replicates, n))  # (B, n)
    e, a, alpha, _ = _fit_alpha(compute / law.c0, samples)
    return LawFit(law, n, len(np.unique(compute)), residual_sd, at_bound, {"E": e, "A": a, "alpha": alpha}, pool,
                  seed)


@dataclass(frozen=True)
class Trend:
    """The least-squares slope of y against x, with its t interval (n - 2 degrees of freedom) and the two-sided p
    of 'no slope'; interval and p are None with fewer than 3 points."""

    slope: float
    intercept: float
    interval: Interval | None
    p: float | None
    n: int


def trend(x, y, confidence: float = CONFIDENCE) -> Trend:
    """How y changes with x: the ordinary least-squares line, its slope's interval and test."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    n = len(x)
    if n < 2 or len(np.unique(x)) < 2:
        raise ValueError(f"a slope needs at least 2 distinct x, got {len(np.unique(x))}")
    sxx = float(((x - x.mean()) ** 2).sum())
    slope = float(((x - x.mean()) * (y - y.mean())).sum() / sxx)
    intercept = float(y.mean() - slope * x.mean())
    if n < 3:
        return Trend(slope, intercept, None, None, n)
    se = math.sqrt(float(((y - intercept - slope * x) ** 2).sum()) / (n - 2) / sxx)
    (low, high), _, p = t_test(slope, se, n - 2, confidence)
    return Trend(slope, intercept, Interval(low, high), p, n)
