"""A run's final validation loss forecast from its own start (pure math: numpy and scipy).

The curve is the schedule-aware one of :mod:`densetrain.law.fits` for one run (its N fixed, so Chinchilla's N
term is part of E): ``L(s) = E + B / S1(s)^beta - C * S2(s) / S1(s)`` with ``S1``, ``S2`` the forward and
annealing areas of the run's own lr schedule (tokens, :func:`densetrain.law.fits.schedule_areas`), fitted to the
run's validations so far by Huber on log-loss (:func:`fit_run_curve`). Evaluated at the last step's areas it is
the forecast of the final loss (:func:`forecast`).

C, what annealing buys, is seen only once the lr has fallen: before the decay of a WSD run (and early in a
cosine one) ``S2 / S1`` stays below :data:`ANNEAL_SEEN` and C is taken from a prior instead: the ladder's
curve when the run has one (``fit.json``'s ``curves.all.C``), else :data:`DEFAULT_C` (measured on the healthy
runs of ``benchmarks/forecast_check.py``, see ``benchmarks/RESULTS.md``). The interval is the forecast
``+- max(2 x the fit's robust residual scale, MIN_BAND)`` widened by what the prior's C would change at the
end when C was not seen (``+-50%`` of it): a band for the alarm, not a calibrated probability.

Used by the training watcher (``train/watch/curve.py``: the ``forecast`` events, the off_curve band) and
``benchmarks/forecast_check.py``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize

from densetrain.law.fits import HUBER_DELTA, huber

FORECAST_FROM = 0.25
"""The forecast starts at the first validation past this fraction of the run's steps (and past warmup)."""
FIT_FROM = 0.1
"""The forecast's fit starts at the first validation past this fraction of the run (and past warmup): a small
model's first steps fall faster than any power law in S1 (a fit from step 10 of a 200-step run missed by 20%)."""
MIN_POINTS = 4
"""Fewest validations the curve is fitted to (it has 3 free parameters, 4 where C is seen)."""
ANNEAL_SEEN = 0.05
"""Below this range of ``S2 / S1`` over the fitted validations, C is the prior's (module docstring): a quarter
into a cosine run ``S2 / S1`` has moved by ~0.035, too little to fit C (a free C missed the final loss by 1.4% on
a generated curve, ``tests/test_law_forecast.py``); a WSD decay of 20% moves it by ~0.09."""
DEFAULT_C = 0.1
"""C where neither the run nor a ladder shows it: calibrated on the benchmark's WSD runs (benchmarks/RESULTS.md)."""
MIN_BAND = 0.005
"""Narrowest half-width of the forecast's band, relative to the loss: the validation set's own noise."""


@dataclass(frozen=True)
class RunCurve:
    """``L(S1, S2) = E + B / S1^beta - C * S2 / S1`` of one run (module docstring); ``scale``: the robust scale
    (1.4826 x the median absolute value) of the relative residuals of the points it was fitted to."""

    E: float
    B: float
    beta: float
    C: float
    scale: float = 0.0

    def loss(self, s1, s2):
        s1 = np.asarray(s1, float)
        return self.E + self.B / s1 ** self.beta - self.C * np.asarray(s2, float) / s1


def fit_run_curve(s1, s2, loss, c_prior: float | None = None, start: RunCurve | None = None,
                  c_free: bool | None = None) -> RunCurve:
    """:class:`RunCurve` fitted to one run's validations at areas ``(s1, s2)`` with losses ``loss``: Huber
    (delta 1e-3) on log-loss by L-BFGS-B from a small grid of starts (with ``start``, a previous fit of the same
    run: from it and one grid start, which keeps a refit at each validation cheap); C free (>= 0) where
    ``S2 / S1`` spans at least :data:`ANNEAL_SEEN` (or as ``c_free`` says), else fixed at ``c_prior`` (``None``:
    :data:`DEFAULT_C`).

    Raises:
        ValueError: fewer than :data:`MIN_POINTS` points, or a point not finite (s1 and loss > 0, s2 >= 0).
    """
    s1, s2, loss = (np.asarray(a, float).ravel() for a in (s1, s2, loss))
    if len(loss) < MIN_POINTS:
        raise ValueError(f"the run's curve needs {MIN_POINTS} validations; {len(loss)} given")
    if not (np.all(np.isfinite(np.r_[s1, s2, loss])) and s1.min() > 0 and loss.min() > 0 and s2.min() >= 0):
        raise ValueError("every S1 and loss must be a finite number > 0, every S2 >= 0")
    frac, ll, ls1 = s2 / s1, np.log(loss), np.log(s1)
    free_c = frac.max() - frac.min() >= ANNEAL_SEEN if c_free is None else c_free
    c_fixed = DEFAULT_C if c_prior is None else float(c_prior)

    def obj(x):
        e, b, beta = x[:3]
        c = x[3] if free_c else c_fixed
        with np.errstate(over="ignore", invalid="ignore"):
            ts = np.exp(b - beta * ls1)
            pred = np.exp(e) + ts - c * frac
            if not np.all(np.isfinite(pred)) or np.any(pred <= 0):
                return 1e6, np.zeros(len(x))
        lo, dr = huber(np.log(pred) - ll, HUBER_DELTA)
        g = dr / pred
        grad = [g @ np.full_like(pred, np.exp(e)), g @ ts, -(g * ls1) @ ts] + ([-(g @ frac)] if free_c else [])
        return float(lo.sum()), np.array(grad)

    top = np.log(loss.min())
    bounds = [(-20.0, top), (-20.0, 50.0), (0.0, 3.0)] + ([(0.0, None)] if free_c else [])
    best = None
    starts = []
    for e0, beta0 in itertools.product([top - 0.1, top - 1.0, -3.0], [0.2, 0.5, 1.0]):
        b0 = np.log(max(loss.max() - np.exp(e0), 1e-3 * loss.max())) + beta0 * ls1.min()
        starts.append([e0, b0, beta0] + ([c_fixed] if free_c else []))
    if start is not None:
        starts = [[min(np.log(start.E), top), np.log(start.B), start.beta] + ([start.C] if free_c else []),
                  starts[4]]
    for x0 in starts:
        res = minimize(obj, x0, jac=True, method="L-BFGS-B", bounds=bounds,
                       options={"ftol": 1e-15, "gtol": 1e-12, "maxiter": 2000})
        if best is None or res.fun < best.fun:
            best = res
    e, b, beta = best.x[:3]
    c = float(best.x[3]) if free_c else c_fixed
    curve = RunCurve(float(np.exp(e)), float(np.exp(b)), float(beta), c)
    scale = float(1.4826 * np.median(np.abs(loss / curve.loss(s1, s2) - 1.0)))
    return RunCurve(curve.E, curve.B, curve.beta, c, scale)


def forecast(s1, s2, steps, loss, c_prior: float | None = None, start: RunCurve | None = None) -> dict:
    """The final loss of a run forecast from its validations so far.

    Args:
        s1, s2: the run's areas after each of its steps (``[k - 1]``: after k steps; the last: the run's end).
        steps: the steps of the validations so far (1-based, past warmup); ``loss``: their losses.
        c_prior: C where the validations do not show it (module docstring); ``start``: as :func:`fit_run_curve`.
    Returns:
        ``{"at_step", "predicted", "interval": [lo, hi], "c_seen": bool, "curve": RunCurve}``.
    Raises:
        ValueError: as :func:`fit_run_curve`; or a forecast that is no loss (its interval reaching 0, or above
            every validation so far).
    """
    idx = np.asarray(steps, int) - 1
    s1, s2 = np.asarray(s1, float), np.asarray(s2, float)
    frac = s2[idx] / s1[idx]
    # C from the run only once it has annealed at least half of what it will: extrapolating the first few percent
    # of a cosine's annealing put C at 11.7 and the forecast below zero (benchmarks/forecast_check.py, 200 steps)
    c_seen = bool(frac.max() - frac.min() >= max(ANNEAL_SEEN, 0.5 * s2[-1] / s1[-1]))
    curve = fit_run_curve(s1[idx], s2[idx], loss, c_prior, start, c_free=c_seen)
    pred = float(curve.loss(s1[-1], s2[-1]))
    half = pred * max(2.0 * curve.scale, MIN_BAND) + (0.0 if c_seen else 0.5 * curve.C * s2[-1] / s1[-1])
    if not 0 < pred - half or pred > max(loss):
        raise ValueError(f"the run's curve forecasts {pred:.4g} +- {half:.3g}: not a loss below the run's own")
    return {"at_step": int(steps[-1]), "predicted": pred, "interval": [pred - half, pred + half], "c_seen": c_seen,
            "curve": curve}
