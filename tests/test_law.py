"""densetrain.law: the fitters recover the laws that generated their points."""

from __future__ import annotations

import numpy as np
import pytest

from densetrain.law import (
    Law,
    bootstrap_isoflop,
    bootstrap_law,
    compute_multiplier,
    fit_accuracy,
    fit_compute_power,
    fit_curve,
    fit_isoflop,
    fit_law,
    fit_prediction,
    frontier,
    isoflop_intervals,
    law_intervals,
    multiplier_intervals,
    predict,
    schedule_areas,
)

# Chinchilla's fit (Hoffmann et al. 2022, eq. 10)
TRUE = Law(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)
BUDGETS = np.geomspace(1e18, 1e24, 4)


def isoflop_grid():
    """4 budgets x 5 sizes: per budget, N from 1/8 to 8 times the true N_opt, D = C / (6 N)."""
    n = np.array([TRUE.optimal(c)[0] * f for c in BUDGETS for f in np.geomspace(1 / 8, 8, 5)])
    d = np.repeat(BUDGETS, 5) / (6 * n)
    return n, d


def noisy(n, d, seed):
    return TRUE.loss(n, d) * (1 + 0.01 * np.random.default_rng(seed).standard_normal(len(n)))


def test_approach3_recovers_chinchilla_law():
    # 1% noise on 20 points: the prediction at 100x the largest budget has an error of std 0.9% over noise
    # draws (14 of 20 draws within 1%), so five draws are checked: each exponent within 0.05, the median
    # prediction error within 1%.
    n, d = isoflop_grid()
    n_big, d_big = TRUE.optimal(100 * BUDGETS[-1])
    errors = []
    for seed in range(5):
        law = fit_law(n, d, noisy(n, d, seed))
        assert abs(law.alpha - TRUE.alpha) < 0.05 and abs(law.beta - TRUE.beta) < 0.05, (seed, law)
        errors.append(law.loss(n_big, d_big) / TRUE.loss(n_big, d_big) - 1)
    assert np.median(np.abs(errors)) < 0.01, errors
    # noiseless points: the fit is the law
    exact = fit_law(n, d, TRUE.loss(n, d))
    assert exact.alpha == pytest.approx(TRUE.alpha, abs=2e-3) and exact.E == pytest.approx(TRUE.E, rel=1e-2)


def test_bootstrap_intervals_and_tokens_per_param():
    n, d = isoflop_grid()
    loss = noisy(n, d, 0)
    law = fit_law(n, d, loss)
    boot = bootstrap_law(n, d, loss, law, samples=40)
    assert len(boot) == 40
    iv = law_intervals(law, boot, BUDGETS[-1])
    for k in ("alpha", "beta", "E"):
        assert iv[k]["lo"] < iv[k]["value"] < iv[k]["hi"]
        assert iv[k]["lo"] < getattr(TRUE, k) < iv[k]["hi"], (k, iv[k])  # the truth is inside at this draw
    assert iv["alpha"]["hi"] - iv["alpha"]["lo"] > 0.005  # refits moved: not stuck at their start
    # the closed form of N_opt against a numerical minimum of the loss along the isoFLOP curve at 1e24
    grid_n = np.geomspace(1e9, 1e12, 200001)
    best = grid_n[np.argmin(TRUE.loss(grid_n, 1e24 / (6 * grid_n)))]
    assert TRUE.optimal(1e24)[0] == pytest.approx(best, rel=1e-3)
    assert TRUE.tokens_per_param(1e24) == pytest.approx(1e24 / (6 * best * best), rel=3e-3)  # ~98: eq. 10's own
    assert iv["tokens_per_param"]["value"] == pytest.approx(law.tokens_per_param(BUDGETS[-1]))
    p = predict(law, boot, *TRUE.optimal(100 * BUDGETS[-1]))
    assert p.lo < p.value < p.hi


def test_approach2_recovers_n_opt_exponent():
    n, d = isoflop_grid()
    loss = noisy(n, d, 0)
    iso = fit_isoflop(n, d, loss)
    assert len(iso.budgets) == 4
    assert iso.a == pytest.approx(TRUE.beta / (TRUE.alpha + TRUE.beta), abs=0.05)
    assert iso.b == pytest.approx(1 - iso.a)
    iv = isoflop_intervals(iso, bootstrap_isoflop(n, d, loss, samples=100), BUDGETS[-1])
    assert iv["a"]["lo"] < iv["a"]["value"] < iv["a"]["hi"] and iv["a"]["hi"] - iv["a"]["lo"] < 0.5
    assert iv["distinct_resamples"] > 50
    # 3 sizes a budget: a budget keeps its parabola only where the resample redraws its 3 points, so every refit
    # is the fit of a subset of the original budgets: at most 11 distinct ones (2, 3 or 4 of the 4 budgets)
    keep = np.isin(np.arange(len(n)) % 5, [1, 2, 3])
    few = isoflop_intervals(iso, bootstrap_isoflop(n[keep], d[keep], loss[keep], samples=100), BUDGETS[-1])
    assert few["distinct_resamples"] <= 11
    with pytest.raises(ValueError, match="at least 2 budgets"):
        fit_isoflop(n[:5], d[:5], loss[:5])


def test_schedule_areas():
    # warmup 2 steps, constant 3, linear decay over 3 (lr/peak 1, 2/3, 1/3): 10 tokens a step
    lrs = np.array([0.5, 1, 1, 1, 1, 2 / 3, 1 / 3]) * 3e-3
    s1, s2 = schedule_areas(lrs, 10, 3e-3, lam=0.5)
    assert s1[-1] == pytest.approx(10 * (0.5 + 4 + 1))
    # momentum: m = 0 (warmup rises are no annealing) x5, 1/3, 0.5 * 1/3 + 1/3
    assert s2 == pytest.approx(np.cumsum([0, 0, 0, 0, 0, 10 / 3, 10 * (1 / 6 + 1 / 3)]))


def test_curve_recovers_schedule_aware_law():
    # WSD runs of three sizes and three lengths (20% linear cooldown), losses from a known curve with 0.3% noise
    # (two sizes leave E, A and alpha unidentified: only E + A / N^alpha at those two N is)
    true = dict(E=1.5, A=40.0, alpha=0.3, B=60.0, beta=0.35, C=0.4)
    rows = []
    for n in (1e6, 3e6, 1e7):
        for steps in (200, 400, 800):
            lr = np.ones(steps)
            k = steps // 5
            lr[-k:] = np.linspace(1, 0, k + 1)[1:]
            s1, s2 = schedule_areas(lr * 1e-3, 4096, 1e-3)
            for i in range(19, steps, 20):
                rows.append((n, s1[i], s2[i]))
    n, s1, s2 = map(np.array, zip(*rows))
    f = lambda p, n, s1, s2: p["E"] + p["A"] / n ** p["alpha"] + p["B"] / s1 ** p["beta"] - p["C"] * s2 / s1  # noqa: E731
    loss = f(true, n, s1, s2) * (1 + 0.003 * np.random.default_rng(0).standard_normal(len(n)))
    curve = fit_curve(n, s1, s2, loss)
    # the cooldown's gain at a run's end and the loss of a run twice as long as any seen, within 1%
    end = schedule_areas(np.r_[np.ones(1280), np.linspace(1, 0, 321)[1:]] * 1e-3, 4096, 1e-3)
    assert curve.loss(2e6, end[0][-1], end[1][-1]) == pytest.approx(f(true, 2e6, end[0][-1], end[1][-1]), rel=0.01)
    assert curve.C == pytest.approx(true["C"], rel=0.25)
    assert 0.001 < curve.scale < 0.006  # the residual scale is the noise's (0.3%)


def test_accuracy_sigmoid_and_two_step_prediction():
    # accuracy from 25% (chance) to 75% as the loss falls through 3.2 nats, 0.5 points of noise
    loss = np.linspace(4.5, 2.8, 12)
    true = 0.5 / (1 + np.exp(4.0 * (loss - 3.2))) + 0.25
    sig = fit_accuracy(loss, true + 0.005 * np.random.default_rng(0).standard_normal(12))
    assert sig.L0 == pytest.approx(3.2, abs=0.1) and sig.k == pytest.approx(-4.0, rel=0.25)
    assert sig.acc(2.6) == pytest.approx(0.5 / (1 + np.exp(4.0 * (2.6 - 3.2))) + 0.25, abs=0.02)
    # step 1 + step 2 from a fit.json-shaped dict: the accuracy at the predicted loss and its interval's ends
    n, d = isoflop_grid()
    law = fit_law(n, d, TRUE.loss(n, d))
    fit = {"approach3": {"law": {k: getattr(law, k) for k in ("E", "A", "B", "alpha", "beta")},
                         "bootstrap": [[law.E * f, law.A, law.B, law.alpha, law.beta] for f in (0.98, 1.0, 1.02)]},
           "largest_budget": BUDGETS[-1], "downstream": {"t/headline": {"a": sig.a, "k": sig.k, "L0": sig.L0,
                                                                        "b": sig.b}}}
    p = fit_prediction(fit, *TRUE.optimal(BUDGETS[-1]))
    assert p["extrapolation"] == pytest.approx(1.0) and p["bpb"] is None
    acc, at_lo, at_hi = p["downstream"]["t/headline"]
    assert acc == pytest.approx(float(sig.acc(p["loss"]))) and at_hi < acc < at_lo  # lower loss, higher accuracy


def test_compute_multiplier_of_a_recipe_worth_k_tokens_per_token():
    # a recipe that uses each token as k = 2.5 tokens: B_new = B / k^beta, so its frontier at C is the
    # reference's at k C and the multiplier is k at every budget; a law below the reference's E: inf
    k = 2.5
    new = Law(E=TRUE.E, A=TRUE.A, B=TRUE.B / k ** TRUE.beta, alpha=TRUE.alpha, beta=TRUE.beta)
    for c in BUDGETS:
        assert frontier(new, c) == pytest.approx(frontier(TRUE, k * c), rel=1e-12)
        assert compute_multiplier(TRUE, new, c) == pytest.approx(k, rel=1e-9)
    assert compute_multiplier(new, TRUE, 1e20) == pytest.approx(1 / k, rel=1e-9)
    assert compute_multiplier(TRUE, Law(E=1.5, A=TRUE.A, B=TRUE.B, alpha=0.34, beta=0.28), 1e30) == np.inf
    # intervals over paired bootstrap laws: k from 2 to 3 in the new recipe's resamples
    boot_new = [Law(E=TRUE.E, A=TRUE.A, B=TRUE.B / x ** TRUE.beta, alpha=TRUE.alpha, beta=TRUE.beta)
                for x in np.linspace(2, 3, 41)]
    iv = multiplier_intervals(TRUE, [TRUE] * 41, new, boot_new, BUDGETS[:2])
    assert [r["budget"] for r in iv] == list(BUDGETS[:2])
    assert iv[0]["value"] == pytest.approx(k) and iv[0]["lo"] == pytest.approx(2.025, rel=1e-6)
    assert iv[1]["hi"] == pytest.approx(2.975, rel=1e-6)


def test_compute_power_law():
    c = np.geomspace(1e10, 1e12, 4)
    k, gamma = fit_compute_power(c, 30.0 * c ** -0.06)
    assert k == pytest.approx(30.0, rel=1e-9) and gamma == pytest.approx(-0.06, rel=1e-9)
    with pytest.raises(ValueError, match="at least 2 budgets"):
        fit_compute_power([1e10, 1e10], [4.0, 4.1])
