"""evals/stats.py: the report card's intervals and the seed comparison's t-tests.

Each is checked on a case worked by hand (the arithmetic in the comments) and against SciPy on fixed
numbers (SciPy is a test-only dependency: the code never imports it).
"""

from __future__ import annotations

import math

import pytest

from evals.stats import format_p, mean_interval, paired, regularized_beta, t_cdf, t_quantile, verdict, welch, wilson_interval


def test_wilson_interval_by_hand():
    # 12 right of 20, z = 1.959964 (z^2 = 3.841459): p = 0.6, 1 + z^2/n = 1.192073
    # centre = (0.6 + 3.841459 / 40) / 1.192073 = 0.583887
    # half = 1.959964 / 1.192073 * sqrt(0.24 / 20 + 3.841459 / 1600) = 1.644166 * 0.120004 = 0.197306
    low, high = wilson_interval(12, 20)
    assert low == pytest.approx(0.583887 - 0.197306, abs=2e-6) and high == pytest.approx(0.583887 + 0.197306, abs=2e-6)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0  # inside [0, 1], unlike p +- 1.96 se
    assert 0 < wilson_interval(0, 10)[1] < 0.35


def test_t_distribution_by_hand():
    # df = 2 has a closed form: F(t) = 1/2 + t / (2 sqrt(2 + t^2)); df = 1 is Cauchy's: F(t) = 1/2 + atan(t) / pi
    for t in (-3.0, -0.4, 0.0, 1.5, 6.0):
        assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-14)
        assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-14)
    assert t_quantile(0.975, 1) == pytest.approx(math.tan(math.pi * 0.475), rel=1e-12)  # 12.7062
    assert t_quantile(0.975, 2) == pytest.approx(4.302653, rel=1e-6)  # t = sqrt(2) * (2p - 1) / sqrt(1 - (2p - 1)^2)
    assert regularized_beta(0.3, 1, 1) == pytest.approx(0.3, abs=1e-15)  # the uniform distribution's CDF


def test_mean_interval_by_hand():
    # 2, 4, 9: mean 5, sd sqrt((9 + 1 + 16) / 2) = sqrt(13); half = t(0.975, 2) * sqrt(13 / 3) = 4.302653 * 2.081666 = 8.956686
    mean = mean_interval([2.0, 4.0, 9.0])
    assert (mean.value, mean.n) == (5.0, 3) and mean.sd == pytest.approx(math.sqrt(13), rel=1e-15)
    assert mean.interval == pytest.approx((5 - 8.956686, 5 + 8.956686), abs=2e-6)
    assert mean_interval([3.0]).interval is None


def test_welch_and_paired_by_hand():
    # a = 1, 2, 3 and b = 3, 4, 5: variances 1, standard error sqrt(1/3 + 1/3) = 0.816497, t = 2 / 0.816497 = sqrt(6),
    # df = (2/3)^2 / ((1/3)^2 / 2 * 2) = 4; with df = 4, F(t) = 1/2 + 3/8 * x * (1 - x^2 / 12), x = t / sqrt(1 + t^2/4):
    # x = 2.449490 / sqrt(2.5) = 1.549193, F = 0.5 + 0.375 * 1.549193 * (1 - 2.4 / 12) = 0.964758, p = 2 (1 - F) = 0.070484;
    # interval 2 +- t(0.975, 4) * 0.816497 = 2 +- 2.776445 * 0.816497
    result = welch([1.0, 2.0, 3.0], [3.0, 4.0, 5.0])
    assert (result.diff, result.df) == (2.0, 4.0) and result.t == pytest.approx(math.sqrt(6), rel=1e-15)
    assert result.p == pytest.approx(0.070484, abs=1e-6)
    assert result.interval == pytest.approx((2 - 2.266958, 2 + 2.266958), abs=2e-6)
    assert verdict(result, lower_is_better=True) == "not distinguishable with 3 and 3 runs (p = 0.070)"
    # paired: b - a = 0.5, 0.7, 0.4, mean 0.533333, sd 0.152753, t = 0.533333 / (0.152753 / sqrt(3)) = 6.047432,
    # df 2: p = 2 (1 - 1/2 - t / (2 sqrt(2 + t^2))) = 1 - 6.047432 / sqrt(38.571429) = 0.026271
    result = paired([1.0, 2.0, 3.0], [1.5, 2.7, 3.4])
    assert result.p == pytest.approx(0.026271, abs=1e-6) and result.df == 2
    assert verdict(result, lower_is_better=True) == "A is better at p = 0.026"  # b is higher: worse for a loss
    assert verdict(result, lower_is_better=False, names=("live", "EMA")) == "EMA is better at p = 0.026"


def test_degenerate_groups():
    assert welch([1.0], [2.0, 3.0]).p is None
    assert verdict(welch([1.0], [2.0, 3.0]), True) == "not testable: needs at least 2 runs in each group (1 and 2)"
    same = welch([1.0, 1.0], [1.0, 1.0])  # no spread, no difference
    assert (same.p, same.interval) == (1.0, (0.0, 0.0))
    apart = welch([1.0, 1.0], [2.0, 2.0])  # no spread, every value says b is higher
    assert apart.p == 0.0 and verdict(apart, lower_is_better=False) == "B is better at p = 0"


# Fixed numbers: final val losses of 4 and 5 seeds of two recipes, and 3 runs' live and EMA losses
A = [5.9701, 5.9842, 6.0206, 5.9911]
B = [5.7207, 5.7062, 5.6892, 5.7342, 5.7013]
LIVE, EMA = [5.9701, 5.9842, 6.0206], [5.9426, 5.9529, 5.9853]


def test_a_small_p_keeps_its_digits_against_scipy():
    """The regression of p = 0 (printed "0") for well separated groups: p as 1 - P(T <= |t|) cancelled to 0 below
    about 1e-16, and lost digits from about 1e-4 on."""
    from scipy import stats
    a, b = [5.3086, 5.3085, 5.3087, 5.3086], [5.9378, 5.9379, 5.9377, 5.9378]  # spread 1e-4, 0.63 apart
    ours, theirs = welch(a, b), stats.ttest_ind(b, a, equal_var=False)
    assert ours.p == pytest.approx(theirs.pvalue, rel=1e-9, abs=0) and ours.p < 1e-22
    assert format_p(ours.p) == "4.0e-23" and verdict(ours, lower_is_better=True) == "A is better at p = 4.0e-23"
    live = [5.9378, 5.9279, 5.9404, 5.9301]
    ema = [x - 0.0312 + d for x, d in zip(live, (1e-5, -1e-5, 0.0, 2e-5))]
    ours, theirs = paired(live, ema), stats.ttest_rel(ema, live)
    assert ours.p == pytest.approx(theirs.pvalue, rel=1e-9, abs=0) and ours.p < 1e-10  # 1 - P kept 5 digits of 11


def test_against_scipy():
    from scipy import stats  # requirements.txt's tests section: make test installs it
    for df in (1, 2, 2.7, 4, 9.3, 30, 1000):
        for t in (-7.0, -1.3, 0.0, 0.5, 2.1, 40.0):
            assert t_cdf(t, df) == pytest.approx(stats.t.cdf(t, df), abs=1e-13)
        for p in (0.025, 0.6, 0.975, 0.995):
            assert t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), rel=1e-11)
    for k, n in ((0, 5), (3, 7), (12, 20), (1000, 10042), (20, 20)):
        ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        assert wilson_interval(k, n) == pytest.approx((ci.low, ci.high), abs=1e-12)
    ours, theirs = welch(A, B), stats.ttest_ind(B, A, equal_var=False)
    assert (ours.t, ours.p, ours.df) == pytest.approx((theirs.statistic, theirs.pvalue, theirs.df), rel=1e-9)
    ci = theirs.confidence_interval(0.95)
    assert ours.interval == pytest.approx((ci.low, ci.high), rel=1e-9)
    ours, theirs = paired(LIVE, EMA), stats.ttest_rel(EMA, LIVE)
    assert (ours.t, ours.p) == pytest.approx((theirs.statistic, theirs.pvalue), rel=1e-9)
    ci = theirs.confidence_interval(0.95)
    assert ours.interval == pytest.approx((ci.low, ci.high), rel=1e-9)
    mean, ci = mean_interval(A), stats.t.interval(0.95, len(A) - 1, loc=sum(A) / len(A), scale=stats.sem(A))
    assert mean.interval == pytest.approx(ci, rel=1e-12)
