"""A run's final validation loss forecast from its own start, and each source's progress against the others'
(pure math: numpy and scipy).

The curve of one run (its N fixed, so Chinchilla's N term is part of E) is ``L(t) = E + B / S1(t)^beta -
C * D(t)``: ``S1`` the forward area of the run's lr schedule (tokens, :func:`densetrain.law.fits.schedule_areas`;
Tissue et al. 2024, "Scaling law with learning rate annealing"), ``D`` the loss drop the lr's falls have bought
so far, in units of the peak lr (:func:`anneal_drop`): each fall ``r_(k-1) - r_k`` of the lr ratio pays off as
``1 - DROP_MEMORY^(t - k)`` of it. This is the multi-power law of Luo et al. 2025 ("A multi-power law for loss
curve prediction across learning rate schedules") with its saturation ``G`` taken exponential in steps:
what annealing buys is proportional to how far the lr fell, whichever the schedule. Tissue et al.'s
``C * S2`` (``S2`` the momentum of the falls summed over all later steps) did not transfer between schedules
on our runs: fitted to whole 1500-step runs its C was 0.25 for a cosine and 1.45 for a WSD schedule
(``S2 / S1`` form), where the loss each bought at the end was the same 0.13 (benchmarks/RESULTS.md, issue 42
session 15); with ``D`` the two Cs are 0.21 and 0.16.

A quarter into a run the curve cannot tell its floor E from its exponent beta (without a prior on beta, the
fit of the benchmark's cosine run at step 400 of 1500 put E at 0 and beta at 0.13, where the whole run says 3.2
and 0.70, and forecast -2.5%; the WSD run's -7.0%), and C is not seen before a WSD decay. So the fit is a maximum a
posteriori one (:func:`fit_run_curve`): Gaussian priors on beta and C (and E where a ladder gives it), from the
ladder's curve when the run has one (:func:`ladder_prior`; as sure as the ladder's bootstrap refits agree,
:func:`ladder_spread`), else :data:`DEFAULT_PRIOR`; the run's validations outweigh them as they accumulate. The
interval is the Laplace approximation of the fit's uncertainty propagated to the last step, 2 standard
deviations, at least :data:`MIN_BAND` of the forecast: a band for the alarm, not a calibrated probability.

:func:`source_excess`: the alarm's reference that does not bend with a fault (issue 42, item 5): each source's
log-loss drop since a reference validation, against the median drop of the other sources (which the shared lr
schedule and model move alike), the ratio fitted on the validations up to a lag behind (so a fault's start is
not in the fit that judges it).

Used by the training watcher (``train/watch/curve.py``) and ``benchmarks/forecast_check.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares
from scipy.stats import t as student_t

FORECAST_FROM = 0.25
"""The forecast starts at the first validation past this fraction of the run's steps (and past warmup)."""
FIT_FROM = 0.1
"""The forecast's fit starts at the first validation past this fraction of the run (and past warmup): a small
model's first steps fall faster than any power law in S1 (a fit from step 10 of a 200-step run missed by 20%)."""
MIN_POINTS = 4
"""Fewest validations the curve is fitted to."""
DROP_MEMORY = 0.97
"""Per step, the part of an lr fall not yet paid off as loss (:func:`anneal_drop`): ~33 steps to 1 - 1/e. Fitted
to whole runs (benchmarks/forecast_check.py, 1500 steps), 0.9-0.99 left the same residual scale (0.27-0.30%);
0.97 gave the closest C between the cosine and the WSD run."""
NOISE = 0.003
"""Relative noise of one validation loss assumed by the fit (the residual scale of whole 1500-step runs was
0.25-0.34%); it weighs the validations against the priors."""
MIN_BAND = 0.005
"""Narrowest half-width of the forecast's band, relative to the loss."""


@dataclass(frozen=True)
class Prior:
    """Gaussian priors of the run's curve: ``beta ~ N(beta, beta_sd)``, ``C ~ N(c, c_sd)`` and, where
    ``e_sd > 0``, ``E ~ N(e, e_sd)`` (loss units)."""

    beta: float
    beta_sd: float
    c: float
    c_sd: float
    e: float = 0.0
    e_sd: float = 0.0


DEFAULT_PRIOR = Prior(beta=0.48, beta_sd=0.1, c=0.156, c_sd=0.04)
"""Where the run has no ladder: beta and C of the curve fitted to the whole of the clean 1500-step WSD run over
web text and Python code of ``benchmarks/forecast_check.py`` (``mix clean``, not one of its five forecast runs;
benchmarks/RESULTS.md, issue 42 session 15); the sds let a quarter of a run move them. Those five runs' own
whole-run fits span beta 0.29-0.70 and C 0.14-0.21: a recipe far from this one (another tokenizer, model size or
lr) needs a ladder for a forecast this early."""


@dataclass(frozen=True)
class RunCurve:
    """``L(S1, D) = E + B / S1^beta - C * D`` of one run (module docstring); ``scale``: the robust scale
    (1.4826 x the median absolute value) of the relative residuals of the points it was fitted to."""

    E: float
    B: float
    beta: float
    C: float
    scale: float = 0.0

    def loss(self, s1, d):
        return self.E + self.B / np.asarray(s1, float) ** self.beta - self.C * np.asarray(d, float)


def anneal_drop(lrs, peak_lr: float, memory: float = DROP_MEMORY) -> np.ndarray:
    """``D`` after each step of a run whose step i ran at ``lrs[i]``: ``sum_k (r_(k-1) - r_k) * (1 -
    memory^(t - k))`` over the falls of the lr ratio ``r = lr / peak_lr`` (a rise, warmup's, buys nothing;
    module docstring). Dimensionless, between 0 and the lr's total fall (0.9 for a decay to 10% of the peak)."""
    r = np.asarray(lrs, float) / peak_lr
    fall = np.maximum(-np.diff(r, prepend=r[:1]), 0.0)
    pending = np.empty_like(r)
    acc = 0.0
    for i, x in enumerate(fall):
        acc = memory * acc + x
        pending[i] = acc
    return np.cumsum(fall) - pending


def fit_run_curve(s1, d, loss, prior: Prior = DEFAULT_PRIOR,
                  start: RunCurve | None = None) -> tuple[RunCurve, np.ndarray, Callable]:
    """:class:`RunCurve` fitted to one run's validations at ``(s1, d)`` with losses ``loss`` (maximum a
    posteriori: log-loss residuals over :data:`NOISE`, soft-L1 robust, and ``prior``'s Gaussian terms; trust-region
    least squares, scipy, from a grid of starts of E and beta; with ``start``, a previous fit of the same run,
    from it and one grid start, which keeps a refit at each validation cheap).

    Returns:
        ``(curve, cov, predict)``: the curve; the Laplace covariance of its parameters ``(log E, log B, beta, C)``
        (4 x 4); ``predict(x, s1, d)``, the loss at parameters ``x``.
    Raises:
        ValueError: fewer than :data:`MIN_POINTS` points, or a point not finite (s1 and loss > 0, d >= 0).
    """
    s1, d, loss = (np.asarray(a, float).ravel() for a in (s1, d, loss))
    if len(loss) < MIN_POINTS:
        raise ValueError(f"the run's curve needs {MIN_POINTS} validations; {len(loss)} given")
    if not (np.all(np.isfinite(np.r_[s1, d, loss])) and s1.min() > 0 and loss.min() > 0 and d.min() >= 0):
        raise ValueError("every S1 and loss must be a finite number > 0, every D >= 0")
    ls1, ll = np.log(s1), np.log(loss)

    def predict(x, s1_, d_):
        return np.exp(x[0]) + np.exp(x[1] - x[2] * np.log(s1_)) - x[3] * d_

    def residuals(x):
        with np.errstate(over="ignore", invalid="ignore"):
            pred = np.exp(x[0]) + np.exp(x[1] - x[2] * ls1) - x[3] * d
            data = (np.log(np.maximum(pred, 1e-9)) - ll) / NOISE
        pri = [(x[2] - prior.beta) / prior.beta_sd, (x[3] - prior.c) / prior.c_sd]
        if prior.e_sd > 0:
            pri.append((np.exp(x[0]) - prior.e) / prior.e_sd)
        return np.r_[np.nan_to_num(data, nan=1e6, posinf=1e6), pri]

    # E is the floor at the peak lr: a run's annealed losses go below it (by C * D), its stable ones never
    top = float(np.log(loss.min() + max(prior.c + 3 * prior.c_sd, 0.0) * d.max()))
    best = None
    e_starts = [np.log(prior.e)] if prior.e_sd > 0 and 0 < prior.e < np.exp(top) else []
    low, betas = float(np.log(loss.min())), dict.fromkeys([prior.beta, 0.25, 0.75])
    starts = []
    for e0, beta0 in itertools.product(e_starts + [low - 0.05, low - 0.3, low - 1.0], betas):
        b0 = np.log(max(loss.max() - np.exp(e0), 1e-3 * loss.max())) + beta0 * ls1.min()
        starts.append([e0, b0, beta0, prior.c])
    if start is not None:
        starts = [[np.log(start.E), np.log(start.B), start.beta, start.C], starts[(len(e_starts) + 1) * len(betas)]]
    for x0 in starts:
        x0 = np.clip(x0, [-20, -20, 0, 0], [top - 1e-6, 80, 3, 50])
        res = least_squares(residuals, x0, bounds=([-20, -20, 0, 0], [top, 80, 3, 50]), loss="soft_l1",
                            f_scale=3.0, x_scale=[1.0, 1.0, 0.1, 0.1])
        if best is None or res.cost < best.cost:
            best = res
    x = best.x
    curve = RunCurve(float(np.exp(x[0])), float(np.exp(x[1])), float(x[2]), float(x[3]))
    scale = float(1.4826 * np.median(np.abs(loss / curve.loss(s1, d) - 1.0)))
    j = best.jac
    cov = np.linalg.pinv(j.T @ j) * max(1.0, scale / NOISE) ** 2
    return RunCurve(curve.E, curve.B, curve.beta, curve.C, scale), cov, predict


def forecast(s1, d, steps, loss, prior: Prior = DEFAULT_PRIOR, start: RunCurve | None = None) -> dict:
    """The final loss of a run forecast from its validations so far.

    Args:
        s1, d: the run's forward area and :func:`anneal_drop` after each of its steps (``[k - 1]``: after k steps;
            the last: the run's end).
        steps: the steps of the validations so far (1-based, past warmup); ``loss``: their losses.
        prior, start: as :func:`fit_run_curve`.
    Returns:
        ``{"at_step", "predicted", "interval": [lo, hi], "curve": RunCurve}``.
    Raises:
        ValueError: as :func:`fit_run_curve`; or a forecast that is no loss (its interval reaching 0).
    """
    idx = np.asarray(steps, int) - 1
    s1, d = np.asarray(s1, float), np.asarray(d, float)
    curve, cov, predict = fit_run_curve(s1[idx], d[idx], loss, prior, start)
    x = np.array([np.log(curve.E), np.log(curve.B), curve.beta, curve.C])
    pred = float(predict(x, s1[-1], d[-1]))
    grad = np.array([(predict(x + h, s1[-1], d[-1]) - pred) / 1e-6 for h in np.eye(4) * 1e-6])
    half = max(2.0 * float(np.sqrt(max(grad @ cov @ grad, 0.0))), MIN_BAND * pred)
    if not 0 < pred - half:
        raise ValueError(f"the run's curve forecasts {pred:.4g} +- {half:.3g}: not a loss")
    return {"at_step": int(steps[-1]), "predicted": pred, "interval": [pred - half, pred + half], "curve": curve}


FIXED_SPREAD = (0.05, 0.02, 0.5)
"""The narrowest prior a ladder gives (:func:`ladder_spread`): beta's sd, E's sd over E, C's sd over C. Alone
(session 15's rule) where the fit has no bootstrap to derive wider ones from."""


@dataclass(frozen=True)
class Spread:
    """The sds of a ladder's prior for one run (:func:`ladder_spread`): ``beta_sd``; ``e_sd`` in loss units;
    ``c_sd`` in this module's C; ``source``: where they come from, in words (logged)."""

    beta_sd: float
    e_sd: float
    c_sd: float
    source: str


def robust_sd(x) -> float:
    """Half the 16-84 percentile range of ``x``: a normal's sd, not moved by a bootstrap's few wild refits."""
    lo, hi = np.percentile(np.asarray(x, float), [16, 84])
    return float(hi - lo) / 2


def ladder_spread(fit: dict, key: str, n: float, anneal: float) -> Spread:
    """How sure a ladder's fit (``fit.json`` as a dict) is of its curve ``fit["curves"][key]`` for a run of ``n``
    parameters; ``anneal`` converts the ladder's C to this module's (its ``S2 / S1`` over ``D`` at the run's end,
    :func:`ladder_prior`).

    The sds are the spread (:func:`robust_sd`) over the fit's bootstrap refits of the quantities the prior
    holds: the floor ``E + A / n^alpha``, beta and C, taken from

    1. refits of the curve itself, where the curve carries them (``curves.<key>.bootstrap``: ``[E, A, alpha, B,
       beta, C]`` each);
    2. else approach 3's refits (``approach3.bootstrap``, ``[E, A, B, alpha, beta]`` of ``E + A / N^alpha +
       B / D^beta``: its ``E + A / n^alpha`` is the same floor, its data exponent beta the same exponent at a
       constant lr); C has no refits there: half of it;

    never narrower than :data:`FIXED_SPREAD` (E's also never below the curve's residual scale); without refits,
    :data:`FIXED_SPREAD` alone. A degenerate fit's refits disagree, so its prior weighs little by itself.

    Raises:
        ValueError: a curve bootstrap that is not a list of 6-number refits (the key named).
    """
    curve = fit["curves"][key]
    e_run = curve["E"] + curve["A"] / n ** curve["alpha"]
    c = curve["C"] * anneal
    beta_sd, e_sd, c_sd = FIXED_SPREAD[0], FIXED_SPREAD[1] * e_run, FIXED_SPREAD[2] * c
    e_sd = max(e_sd, curve.get("scale", 0.0) * e_run)
    own, a3 = curve.get("bootstrap") or [], (fit.get("approach3") or {}).get("bootstrap") or []
    if len(own) >= 10:
        try:
            b = np.asarray(own, float)
        except (TypeError, ValueError):
            b = np.zeros((0, 0))
        if b.ndim != 2 or b.shape[1] != 6 or not np.all(np.isfinite(b)):
            raise ValueError(f"key 'curves.{key}.bootstrap': expected a list of [E, A, alpha, B, beta, C] refits")
        spread = (robust_sd(b[:, 4]), robust_sd(b[:, 0] + b[:, 1] / n ** b[:, 2]), robust_sd(b[:, 5] * anneal))
        source = f"{len(b)} bootstrap refits of the ladder's '{key}' curve"
    elif len(a3) >= 10:
        b = np.asarray(a3, float)
        spread = (robust_sd(b[:, 4]), robust_sd(b[:, 0] + b[:, 1] / n ** b[:, 3]), 0.0)
        source = f"{len(b)} bootstrap refits of the ladder's approach 3 (C: half of it)"
    else:
        return Spread(beta_sd, e_sd, max(c_sd, 1e-3), "fixed: the ladder's fit has no bootstrap")
    return Spread(max(beta_sd, spread[0]), max(e_sd, spread[1]), max(c_sd, spread[2], 1e-3), source)


def ladder_prior(curve, n: float, s1_end: float, s2_end: float, d_end: float,
                 spread: Spread | None = None) -> Prior:
    """The prior a ladder's schedule-aware curve (:class:`densetrain.law.Curve`, ``E + A / N^alpha + B /
    S1^beta - C * S2 / S1``) gives one run of ``n`` parameters: its beta, its floor ``E + A / n^alpha`` and the C
    that buys, at this run's end (areas ``s1_end``, ``s2_end``, drop ``d_end``), what the ladder's annealing term
    does there; sds from ``spread`` (:func:`ladder_spread`), by default :data:`FIXED_SPREAD`."""
    gain = curve.C * s2_end / s1_end
    c = gain / d_end if d_end > 0 else DEFAULT_PRIOR.c
    e = curve.E + curve.A / n ** curve.alpha
    if spread is None:
        spread = Spread(FIXED_SPREAD[0], FIXED_SPREAD[1] * e, max(FIXED_SPREAD[2] * c, 1e-3), "fixed")
    return Prior(beta=curve.beta, beta_sd=spread.beta_sd, c=c, c_sd=spread.c_sd, e=e, e_sd=spread.e_sd)


SOURCE_BAND = 0.01
"""Narrowest band of :func:`source_excess`, in log-loss (~1% of the loss)."""
SOURCE_LEVEL = 0.99865
"""One-sided level of :func:`source_excess`'s band: that of 3 standard deviations of a normal (the band was 3 x a
residual scale until issue 42 session 16; the level is kept, the scale's own uncertainty is now counted)."""


def source_excess(losses: dict[str, list[float]], ref: int, fit_to: int) -> dict[str, tuple[float, float]]:
    """How far each source's latest loss is above what the other sources' progress says it should be.

    ``losses[k][i]``: source k's validation loss at the i-th validation (the same validations for all, at least 3
    sources or 2). For each source, ``drop_k(i) = log L_k(ref) - log L_k(i)`` and the median drop of the others
    ``m_k(i)``; the ratio ``a_k`` of the two, fitted (least squares through 0) on the ``n = fit_to - ref``
    validations ``ref + 1 .. fit_to`` and frozen there, predicts the latest drop. Returns ``{k: (excess,
    band)}``: ``excess = a_k * m_k(last) - drop_k(last)`` (log-loss: > 0 when k fell less than the others say; ~
    its relative excess) and ``band``: the one-sided :data:`SOURCE_LEVEL` prediction interval of that regression
    at the latest validation (Student t with n - 1 degrees of freedom, e.g. Montgomery, Peck & Vining,
    "Introduction to Linear Regression Analysis", regression through the origin)::

        band = t(SOURCE_LEVEL, n - 1) * s * sqrt(1 + m_k(last)^2 / sum m_k(i)^2),  s^2 = sum resid^2 / (n - 1)

    never below :data:`SOURCE_BAND`; {} with fewer than 2 sources or fewer than :data:`MIN_POINTS` validations to
    fit. Why each factor (benchmarks/RESULTS.md, issue 42 item 5, session 16): ``s`` is the residuals' root mean
    square, not a median-based scale, because a minority source's loss falls in uneven steps (books, 1.7% of a
    mix, is trained on a window every few steps): a median ignores exactly those steps, which are the source's
    real jumpiness; ``t`` because the first judgements rest on 4-6 validations, whose scale is itself uncertain;
    the square root because the ratio, fitted on drops a few validations long, is extrapolated to drops several
    times longer (its error grows with the extrapolation). The former band, ``3 x`` a median-based scale of 4
    residuals, fired at the third judgement of 5 of 7 healthy H2 runs, always on a minority source.
    """
    keys = sorted(losses)
    n = fit_to - ref
    if len(keys) < 2 or n < MIN_POINTS:
        return {}
    lg = {k: np.log(np.asarray(losses[k], float)) for k in keys}
    drop = {k: lg[k][ref] - lg[k] for k in keys}
    t = float(student_t.ppf(SOURCE_LEVEL, n - 1))
    out = {}
    for k in keys:
        other = np.median([drop[j] for j in keys if j != k], axis=0)
        w = slice(ref + 1, fit_to + 1)
        den = float(other[w] @ other[w])
        if den <= 0:
            continue
        a = float(drop[k][w] @ other[w]) / den
        resid = drop[k][w] - a * other[w]
        s = float(np.sqrt(resid @ resid / (n - 1)))
        band = max(SOURCE_BAND, t * s * float(np.sqrt(1.0 + other[-1] ** 2 / den)))
        out[k] = (float(a * other[-1] - drop[k][-1]), band)
    return out
