"""Confidence intervals and t-tests for the report card (eval_lm.py --card) and for comparing recipes over
seeds (compare_runs.py), in plain Python: no SciPy at run time (tests/test_stats.py checks them against it).

- Wilson's score interval for a proportion (an accuracy: k of n examples right). Unlike the normal
  approximation p +- 1.96 * stderr, it stays inside [0, 1] and keeps its coverage on small n and near 0 or 1.
- Student's t interval for a mean of n independent values (n - 1 degrees of freedom).
- Welch's t-test for the difference of two means with unequal variances (two groups of runs, each seed
  one value), and the paired t-test when both groups are the same runs (live vs EMA weights).

Student's t distribution's CDF comes from the regularized incomplete beta function, evaluated by its
continued fraction (modified Lentz); its quantile by bisection on the CDF.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

CONFIDENCE = 0.95
Z95 = NormalDist().inv_cdf(0.5 + CONFIDENCE / 2)  # 1.959963984540054


def _beta_continued_fraction(x: float, a: float, b: float) -> float:
    """The continued fraction of I_x(a, b) (valid for x < (a + 1) / (a + b + 2)), by modified Lentz."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 10_000):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),  # the even term d_2m
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):  # the odd term d_2m+1
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < eps:
            return result
    raise ArithmeticError(f"incomplete beta: no convergence for x={x}, a={a}, b={b}")


def regularized_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for 0 <= x <= 1 and a, b > 0."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    # x^a (1 - x)^b / B(a, b), in logarithms
    front = math.exp(a * math.log(x) + b * math.log1p(-x) - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)))
    if x < (a + 1) / (a + b + 2):
        return front * _beta_continued_fraction(x, a, b) / a
    return 1.0 - front * _beta_continued_fraction(1.0 - x, b, a) / b  # the symmetry I_x(a, b) = 1 - I_1-x(b, a)


def t_two_sided(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with df degrees of freedom: the two-sided p of a t statistic, from the
    incomplete beta directly (as 1 - P(T <= |t|) it would lose its digits and cancel to 0 below about 1e-16)."""
    return 0.0 if math.isinf(t) else regularized_beta(df / (df + t * t), df / 2, 0.5)


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df (> 0, not necessarily whole) degrees of freedom."""
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * t_two_sided(t, df)  # P(T > |t|)
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with t_cdf(t, df) = p, for 0 < p < 1 (bisection to a relative 1e-13)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        low, high = high, high * 2
    while high - low > 1e-13 * max(1.0, high):
        middle = (low + high) / 2
        low, high = (middle, high) if t_cdf(middle, df) < p else (low, middle)
    return (low + high) / 2


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval of a proportion successes / n (default 95%)."""
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n >= 1, got {successes} of {n}")
    p, z2 = successes / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    # at 0 or n successes the bound is exactly 0 or 1 (centre - half cancels to it up to rounding)
    return (0.0 if successes == 0 else centre - half), (1.0 if successes == n else centre + half)


@dataclass(frozen=True)
class Mean:
    """A sample mean with its 95% t interval (None for fewer than 2 values) and its sample standard deviation."""

    value: float
    interval: tuple[float, float] | None
    sd: float | None
    n: int


def mean_interval(values: list[float], confidence: float = CONFIDENCE) -> Mean:
    """The mean of values with Student's t interval (n - 1 degrees of freedom)."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    mean = math.fsum(values) / n
    if n < 2:
        return Mean(mean, None, None, n)
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n)
    return Mean(mean, (mean - half, mean + half), sd, n)


@dataclass(frozen=True)
class Difference:
    """B's mean minus A's, with its interval and a two-sided t-test of 'no difference'."""

    mean_a: float
    mean_b: float
    diff: float  # mean_b - mean_a
    interval: tuple[float, float] | None  # None where a group has fewer than 2 values
    t: float | None
    df: float | None
    p: float | None
    test: str  # "welch" or "paired"
    n_a: int
    n_b: int


def t_test(diff: float, se: float, df: float, confidence: float) -> tuple[tuple[float, float], float, float]:
    """(interval, t, p) of a difference with standard error se and df degrees of freedom. Zero spread (se 0):
    the interval is the difference itself and p is 1 for no difference, else 0 (every value says it)."""
    if se == 0:
        return (diff, diff), (0.0 if diff == 0 else math.copysign(math.inf, diff)), 1.0 if diff == 0 else 0.0
    half = t_quantile(0.5 + confidence / 2, df) * se
    t = diff / se
    return (diff - half, diff + half), t, t_two_sided(t, df)


def _require_finite(*groups: list[float]) -> None:
    """ValueError on a value that is NaN or infinite: its mean and spread would be too, and so would p, which
    no comparison with alpha reads correctly."""
    bad = next((v for group in groups for v in group if not math.isfinite(v)), None)
    if bad is not None:
        raise ValueError(f"values must be finite, got {bad}")


def welch(a: list[float], b: list[float], confidence: float = CONFIDENCE) -> Difference:
    """Welch's t-test of mean(b) - mean(a) (unequal variances; Welch-Satterthwaite degrees of freedom)."""
    _require_finite(a, b)
    ma, mb = mean_interval(a), mean_interval(b)
    diff = mb.value - ma.value
    if ma.n < 2 or mb.n < 2:
        return Difference(ma.value, mb.value, diff, None, None, None, None, "welch", ma.n, mb.n)
    va, vb = ma.sd ** 2 / ma.n, mb.sd ** 2 / mb.n  # the squared standard errors of the two means
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (ma.n - 1) + vb ** 2 / (mb.n - 1)) if se > 0 else ma.n + mb.n - 2
    interval, t, p = t_test(diff, se, df, confidence)
    return Difference(ma.value, mb.value, diff, interval, t, df, p, "welch", ma.n, mb.n)


def paired(a: list[float], b: list[float], confidence: float = CONFIDENCE) -> Difference:
    """The paired t-test of b - a, value by value (the same runs measured two ways)."""
    if len(a) != len(b):
        raise ValueError(f"paired values need as many in each group, got {len(a)} and {len(b)}")
    _require_finite(a, b)
    d = mean_interval([y - x for x, y in zip(a, b)])
    ma, mb = math.fsum(a) / len(a), math.fsum(b) / len(b)
    if d.n < 2:
        return Difference(ma, mb, d.value, None, None, None, None, "paired", d.n, d.n)
    interval, t, p = t_test(d.value, d.sd / math.sqrt(d.n), d.n - 1, confidence)
    return Difference(ma, mb, d.value, interval, t, d.n - 1, p, "paired", d.n, d.n)


def format_p(p: float) -> str:
    """0.026, 3.1e-05; 0 where no value in either group differs from its group's mean."""
    return f"{p:.3f}" if p >= 0.001 else f"{p:.1e}" if p > 0 else "0"


def verdict(result: Difference, lower_is_better: bool, alpha: float = 0.05, names: tuple[str, str] = ("A", "B")) -> str:
    """One plain sentence: which group is better at what p, or that they cannot be told apart."""
    a, b = names
    if result.p is None:
        return f"not testable: needs at least 2 runs in each group ({result.n_a} and {result.n_b})"
    runs = f"{result.n_a} paired runs" if result.test == "paired" else f"{result.n_a} and {result.n_b} runs"
    if result.p >= alpha:
        return f"not distinguishable with {runs} (p = {format_p(result.p)})"
    b_better = (result.diff < 0) == lower_is_better
    return f"{b if b_better else a} is better at p = {format_p(result.p)}"
