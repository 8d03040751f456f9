"""evals/scaling_law.py: the fit of L(C) = E + A (C / C0)^-alpha against SciPy's curve_fit on synthetic laws, its
bootstrap intervals and predictions, and the slope of a trend against scipy.stats.linregress."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import optimize, stats

from evals.scaling_law import fit_power_law, fit_with_bootstrap, trend

# Two laws of the shape a ladder gives, (E, A, alpha). (A shallower law whose reducible part is a small share of the
# loss, (4.0, 0.6, 0.12), is fitted as closely, but its exponent is less determined by the points themselves: with
# this noise it scatters by about 5%, which the bootstrap interval then shows.)
LAWS = [(2.5, 1.2, 0.35), (3.0, 2.0, 0.25)]


def synthetic(law, rungs=5, seeds=2, noise=0.002, seed=0):
    """Runs on a law: rungs budgets a factor 4 apart (from 1e15 FLOPs), seeds runs each, Gaussian noise on the loss."""
    e, a, alpha = law
    compute = np.repeat(1e15 * 4.0 ** np.arange(rungs), seeds)
    rng = np.random.default_rng(seed)
    loss = e + a * (compute / compute[0]) ** -alpha + rng.normal(0, noise, compute.shape)
    return compute, loss


@pytest.mark.parametrize("law", LAWS)
@pytest.mark.parametrize("draw", range(5))
def test_the_fit_recovers_the_exponent_of_a_synthetic_law_as_scipy_does(law, draw):
    """5 rungs, 2 seeds each, noise of sd 0.002 on the loss (5 draws of it): the exponent within 2% of the law's,
    and the fit the same least squares as SciPy's."""
    compute, loss = synthetic(law, seed=draw)
    ours = fit_power_law(compute, loss)
    assert abs(ours.alpha - law[2]) / law[2] < 0.02, (ours, law)

    # SciPy's Levenberg-Marquardt on the same model and the same least squares, from a generic start
    def model(c, e, a, alpha):
        return e + a * (c / compute.min()) ** -alpha

    (e, a, alpha), _ = optimize.curve_fit(model, compute, loss, p0=(loss.min() * 0.9, 1.0, 0.3), maxfev=20000)
    assert abs(alpha - law[2]) / law[2] < 0.02
    assert ours.alpha == pytest.approx(alpha, rel=1e-6) and ours.E == pytest.approx(e, rel=1e-6)
    assert ours.A == pytest.approx(a, rel=1e-6)
    sse = lambda p: float(((model(compute, *p) - loss) ** 2).sum())  # noqa: E731
    assert sse((ours.E, ours.A, ours.alpha)) <= sse((e, a, alpha)) * (1 + 1e-9)


def test_the_fit_keeps_e_and_a_at_or_above_zero():
    """Points that fall like a pure power law towards 0 (E would be negative) and flat ones (A would be)."""
    compute = 1e12 * 3.0 ** np.arange(5)
    falling = fit_with_bootstrap(compute, 5 * (compute / 1e12) ** -0.2 - 0.3, replicates=0)
    assert falling.law.E == 0 and falling.law.A > 0 and falling.at_bound == ("E",)  # said in the report
    rising = fit_with_bootstrap(compute, [3.0, 3.1, 3.2, 3.3, 3.4], replicates=0)
    assert rising.law.A == 0 and rising.law.E == pytest.approx(3.2) and "A" in rising.at_bound
    assert fit_with_bootstrap(*synthetic(LAWS[0]), replicates=0).at_bound == ()


def test_the_bootstrap_intervals_hold_the_law_and_one_run_is_wider_than_the_law():
    law = LAWS[0]
    compute, loss = synthetic(law, rungs=4, seeds=2, noise=0.01, seed=3)
    fit = fit_with_bootstrap(compute, loss, replicates=1000, seed=0)
    assert fit.replicates["alpha"].shape == (1000,)
    for name, true in zip(("E", "A", "alpha"), law):
        interval = fit.interval(name)
        assert interval.low < getattr(fit.law, name) < interval.high
    following = compute.max() * 4
    p = fit.predict(following)
    true_loss = law[0] + law[1] * (following / compute.min()) ** -law[2]
    assert p.law.contains(p.loss) and p.run.low < p.law.low and p.law.high < p.run.high
    assert p.run.contains(true_loss)
    low, high = fit.band([following])
    assert (low[0], high[0]) == (p.law.low, p.law.high)
    again = fit_with_bootstrap(compute, loss, replicates=1000, seed=0).predict(following)
    assert again == p  # the same inputs and seed: the same numbers, bit for bit


def test_three_runs_fit_exactly_and_have_no_interval():
    compute, loss = synthetic(LAWS[0], rungs=3, seeds=1, noise=0.0)
    fit = fit_with_bootstrap(compute, loss)
    assert fit.replicates is None and fit.interval("alpha") is None and fit.predict(1e18).run is None
    assert fit.law.alpha == pytest.approx(LAWS[0][2], rel=1e-6)


def test_fewer_budgets_than_parameters_are_refused():
    with pytest.raises(ValueError, match="at least 3 distinct budgets"):
        fit_power_law([1e15, 1e15, 4e15, 4e15], [3.0, 3.01, 2.9, 2.91])


def test_the_trend_is_scipys_least_squares_line_with_its_t_interval():
    x = np.log10([1e15, 4e15, 1.6e16, 6.4e16, 2.56e17])
    y = np.array([-0.30, -0.33, -0.35, -0.40, -0.41])
    t = trend(x, y)
    ref = stats.linregress(x, y)
    half = stats.t.ppf(0.975, len(x) - 2) * ref.stderr
    assert t.slope == pytest.approx(ref.slope, rel=1e-12) and t.p == pytest.approx(ref.pvalue, rel=1e-9)
    assert (t.interval.low, t.interval.high) == pytest.approx((ref.slope - half, ref.slope + half), rel=1e-9)
    assert trend(x[:2], y[:2]).interval is None  # two sizes: a slope, no interval
