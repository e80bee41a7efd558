"""The ladder's trajectory law: one law fitted to every ladder run's whole loss trajectory, predicting a new
run's final loss from its N and its lr schedule (pure math: numpy and scipy).

Form (:class:`Trajectory`)::

    L(N, S1, D) = E + ((A / N)^(alpha / beta) + B / S1)^beta - C * D

N parameters without the input embedding; ``S1`` the forward area of the run's lr schedule up to the step
(tokens, :func:`densetrain.law.fits.schedule_areas`; Tissue et al. 2024), ``D`` what the lr's falls have bought
so far in units of the peak lr (:func:`densetrain.law.forecast.anneal_drop`: the multi-power law's annealing
term, Luo et al. 2025). The bracket is Kaplan et al. 2020 ("Scaling Laws for Neural Language Models", eq. 1.5,
``L(N, D) = [(N_c / N)^(alpha_N / alpha_D) + D_c / D]^alpha_D``) with the forward area in place of their D (under
a constant lr S1 is the tokens seen), with an irreducible E as in Hoffmann et al. 2022. The annealing term is
``C * D``, not the ``C * S2 / S1`` of :class:`densetrain.law.fits.Curve`: fitted to whole runs, ``S2 / S1``'s C
was 0.25 for a cosine and 1.45 for a WSD run where D's were 0.21 and 0.16 (benchmarks/RESULTS.md, issue 42
session 15), and a ladder of WSD runs sees ``S2 / S1`` only up to ~0.1 where a cosine run ends at 0.3-0.6.
Why this form and not the additive ``Curve``
(``E + A / N^alpha + B / S1^beta``): in the additive form the loss bought by more steps does not depend on N,
where larger models are more sample-efficient (Kaplan et al. 2020, section 1: they reach a loss in fewer steps
and keep improving longer); a held-out run larger and longer than the ladder's runs gains from both at once.
At ``S1 -> inf`` it is ``E + (A / N)^alpha`` (the parameter term), at ``N -> inf`` ``E + (B / S1)^beta``
(before annealing).

The fit (:func:`fit_trajectory`): Huber (delta 1e-3, Hoffmann et al. 2022) on log-loss residuals, L-BFGS-B with
the analytic gradient from a small grid of starts; the parameters are fitted as ``(log E, log A, alpha, log B,
beta, C)`` within :data:`TRAJ_BOUNDS`. The interval (:func:`bootstrap_trajectory`): the law refitted on
resamples of the ladder's *runs* with replacement (a run's points move together: the points of one run are not
independent draws), each refit started from the full fit; percentile intervals.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import minimize

from densetrain.law.fits import _TIGHT, HUBER_DELTA, LEVEL, Interval, LossLaw, huber

TRAJ_BOUNDS = ((-20.0, None), (-20.0, 60.0), (1e-3, 3.0), (-20.0, 60.0), (1e-3, 3.0), (0.0, 20.0))
"""Bounds of ``(log E, log A, alpha, log B, beta, C)``; ``log E``'s upper bound is set per fit at the log of the
lowest point's loss (E is below every loss). Exponents outside (0, 3] are no scaling law seen in language
models; A and B past e^60 mean the term never bends within any N or S1 a computer holds; C above 20 nats would
make a cooldown buy more than any loss there is. A fit that ends on one is degenerate (``judge_trajectory``)."""
_NAMES = ("E", "A", "alpha", "B", "beta", "C")


@dataclass(frozen=True)
class Trajectory(LossLaw):
    """``L(N, S1, D) = E + ((A / N)^(alpha / beta) + B / S1)^beta - C * D`` (module docstring)."""

    def loss(self, n, s1, drop):
        """The loss (nats per token) at ``n`` parameters, forward area ``s1`` (tokens) and annealing drop ``drop``
        (arrays broadcast)."""
        return _predict(_vector(self), np.log(np.asarray(n, float)), np.log(np.asarray(s1, float)),
                        np.asarray(drop, float))[0]

    def as_dict(self) -> dict:
        return asdict(self)


def _vector(t: Trajectory) -> np.ndarray:
    return np.array([np.log(t.E), np.log(t.A), t.alpha, np.log(t.B), t.beta, t.C])


def _of(x: np.ndarray, scale: float = 0.0) -> Trajectory:
    e, a, alpha, b, beta, c = (float(v) for v in x)
    return Trajectory(E=float(np.exp(e)), A=float(np.exp(a)), alpha=alpha, B=float(np.exp(b)), beta=beta, C=c,
                      scale=scale)


def _predict(x, ln, ls1, frac):
    """The loss at parameter vector ``x`` (``frac``: the annealing drop D) and its parts: ``(pred, T, wu, wv,
    log_inner)``, ``wu``, ``wv`` the shares of ``(A/N)^r`` and ``B / S1`` in the bracket, ``T`` its power (logs
    throughout: the terms span many decades)."""
    e, a, alpha, b, beta, c = x
    r = alpha / beta
    lu, lv = r * (a - ln), b - ls1
    log_inner = np.logaddexp(lu, lv)
    with np.errstate(over="ignore"):
        t = np.exp(beta * log_inner)
    wu, wv = np.exp(lu - log_inner), np.exp(lv - log_inner)  # u / inner, v / inner
    return np.exp(e) + t - c * frac, t, wu, wv, log_inner


def _objective(x, ln, ls1, frac, ll, delta):
    pred, t, wu, wv, log_inner = _predict(x, ln, ls1, frac)
    if not np.all(np.isfinite(pred)) or np.any(pred <= 0):
        return 1e6, np.zeros(6)
    loss, dr = huber(np.log(pred) - ll, delta)
    g = dr / pred
    e, a, alpha, b, beta, c = x
    # d T / d log A = beta * r * wu * T; d T / d alpha = (a - ln) * wu * T (r = alpha / beta);
    # d T / d log B = beta * wv * T; d T / d beta = T * (log_inner - alpha / beta * (a - ln) * wu)
    grad = np.array([g @ np.full_like(pred, np.exp(e)), g @ (alpha * wu * t), g @ ((a - ln) * wu * t),
                     g @ (beta * wv * t), g @ (t * (log_inner - alpha / beta * (a - ln) * wu)), -(g @ frac)])
    return float(loss.sum()), grad


def fit_trajectory(n, s1, drop, loss, delta: float = HUBER_DELTA, start: Trajectory | None = None) -> Trajectory:
    """:class:`Trajectory` fitted to points ``(n, s1, drop, loss)`` (module docstring).

    Args:
        start: a previous fit to start from (bootstrap refits); None: a grid of 12 starts.
    Raises:
        ValueError: fewer than 6 points, or an n, s1 or loss not finite and positive, or a drop negative.
    """
    n, s1, drop, loss = (np.asarray(v, float).ravel() for v in (n, s1, drop, loss))
    if not len(n) == len(s1) == len(drop) == len(loss):
        raise ValueError(f"points of unequal lengths {[len(n), len(s1), len(drop), len(loss)]}")
    if len(n) < 6:
        raise ValueError(f"the trajectory law has 6 parameters; {len(n)} points are too few")
    for name, v in (("n", n), ("s1", s1), ("loss", loss)):
        if not np.all(np.isfinite(v)) or np.any(v <= 0):
            raise ValueError(f"every {name} must be a finite number > 0")
    if not np.all(np.isfinite(drop)) or np.any(drop < 0):
        raise ValueError("every drop must be a finite number >= 0")
    ln, ls1, frac, ll = np.log(n), np.log(s1), drop, np.log(loss)
    bounds = list(TRAJ_BOUNDS)
    bounds[0] = (-20.0, float(np.log(loss.min())))
    if start is not None:
        starts = [np.clip(_vector(start), [b[0] for b in bounds], [b[1] for b in bounds])]
    else:  # E below the lowest loss or near 0; the N and S1 scales at the points' middle
        starts = [np.array([e0, ln.mean() + a0, alpha0, ls1.mean() + b0, beta0, 0.1])
                  for e0, alpha0, beta0, (a0, b0) in itertools.product(
                      [float(np.log(loss.min())) - 0.3, -1.0], [0.3, 1.0], [0.3, 0.8], [(0.0, 0.0), (-3.0, 3.0)])]
    best = None
    for x0 in starts:
        res = minimize(_objective, x0, args=(ln, ls1, frac, ll, delta), jac=True, method="L-BFGS-B",
                       bounds=bounds, options=_TIGHT)
        if best is None or res.fun < best.fun:
            best = res
    fit = _of(best.x)
    rel = loss / fit.loss(n, s1, drop) - 1.0
    return _of(best.x, scale=float(1.4826 * np.median(np.abs(rel))))


def at_bounds(t: Trajectory, lowest_loss: float, tol: float = 1e-3) -> list[str]:
    """The parameters of ``t`` within ``tol`` of a bound of :data:`TRAJ_BOUNDS` (E's upper bound: the log of
    ``lowest_loss``), each as ``"NAME = V at its lower/upper bound"``."""
    out = []
    bounds = list(TRAJ_BOUNDS)
    bounds[0] = (-20.0, float(np.log(lowest_loss)))
    for name, v, (lo, hi) in zip(_NAMES, _vector(t), bounds):
        if v - lo < tol or (hi is not None and hi - v < tol):
            side = "lower" if v - lo < tol else "upper"
            out.append(f"{name} = {getattr(t, name):.4g} at its {side} bound")
    return out


def bootstrap_trajectory(n, s1, drop, loss, runs, law: Trajectory, samples: int = 200, seed: int = 0,
                         delta: float = HUBER_DELTA) -> list[Trajectory]:
    """The law refitted on ``samples`` resamples of the runs (``runs[i]``: the run point i belongs to; a
    resample draws as many runs as there are, with replacement, with all their points), each from ``law``.
    Resamples with fewer than 3 distinct runs or 6 points are skipped."""
    n, s1, drop, loss = (np.asarray(v, float).ravel() for v in (n, s1, drop, loss))
    names = sorted(set(runs))
    idx_of = {k: np.flatnonzero(np.asarray(runs) == k) for k in names}
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(samples):
        pick = rng.integers(0, len(names), len(names))
        if len(set(pick.tolist())) < 3:
            continue
        idx = np.concatenate([idx_of[names[i]] for i in pick])
        if len(idx) < 6:
            continue
        out.append(fit_trajectory(n[idx], s1[idx], drop[idx], loss[idx], delta, start=law))
    return out


def predict_trajectory(law: Trajectory, boot: list[Trajectory], n: float, s1: float, drop: float,
                       level: float = LEVEL) -> Interval:
    """The loss of a run of ``n`` parameters ending at forward area ``s1`` and annealing drop ``drop``, with its
    bootstrap interval."""
    return Interval.of(float(law.loss(n, s1, drop)), [float(b.loss(n, s1, drop)) for b in boot], level)
