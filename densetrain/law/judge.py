"""Fits that know when they know nothing: the checks that mark a ladder's approach 3 fit *degenerate*, the
cross-check against the power law in compute, and the checks that withhold a prediction.

A fit is degenerate (:func:`judge_law`) when any of these holds, each with what to run next:

- **one budget** (or fewer than 2 sizes): N and D vary together along one isoFLOP line, so the law cannot
  separate the parameter term from the data term;
- **a parameter at a bound** of :data:`~densetrain.law.fits.LAW_BOUNDS` (within :data:`AT_BOUND`): the
  optimum lies outside what the law's form allows (E at e^-20: the points never flatten; alpha or beta at 0
  or 5: the points do not constrain that exponent);
- **intervals wider than** :data:`WIDE` (``hi / lo`` of the compute-optimal N or D at the largest budget):
  the fit cannot say where the optimum lies within an order of magnitude;
- **too few distinct bootstrap refits** (fewer than :data:`FEW`): the resamples repeat one another, so the
  intervals measure nothing;
- **residual scale above** :data:`NOISE` (1.4826 x the median absolute relative residual of the points
  against the law): the points scatter more than seed noise at small scale does (a few percent at most;
  Bhagia et al. 2024 find ~1-2% between seeds at 190M), so the law does not describe them.

**Cross-check** (:func:`cross_check`): the loss-against-compute power law through each budget's best point
(:func:`densetrain.law.fits.fit_compute_power`) against approach 3's frontier at :data:`CROSS_AT` times the
largest budget; they disagree when the power law falls outside approach 3's bootstrap interval there.

A prediction is withheld (:func:`withheld`) when its fit is degenerate, when it or its interval is not a
finite number, or when it lies outside ``(0, CEILING x the ladder's largest point loss]``.

The trajectory law (:mod:`densetrain.law.trajectory`) is judged the same way (:func:`judge_trajectory`): a
parameter at a bound of its ``TRAJ_BOUNDS``, too few distinct bootstrap refits, a residual scale above
:data:`NOISE`, fewer than 3 sizes or an N span under :data:`N_SPAN`, or a loss interval at the ladder's own
a loss interval at the ladder's own points (median) wider than :data:`WIDE_LOSS` (the fit does not pin the law
even inside the ladder).
"""

from __future__ import annotations

import numpy as np

from densetrain.law.fits import LAW_BOUNDS, LEVEL, Law, fit_compute_power, fit_prediction, frontier, law_vector
from densetrain.law.trajectory import Trajectory, at_bounds, predict_trajectory

AT_BOUND = 1e-3
"""Distance (in the fitted vector: log E, log A, log B, alpha, beta) within which a parameter is at its bound."""
WIDE = 10.0
"""Largest ``hi / lo`` of the compute-optimal N (or D) interval at the ladder's largest budget."""
FEW = 10
"""Fewest distinct bootstrap refits whose percentiles are an interval (a 95% interval of fewer values is their
range: it measures nothing)."""
NOISE = 0.02
"""Largest robust scale of the relative residuals of the points against the law (2%, module docstring)."""
CROSS_AT = 10.0
"""The cross-check compares the two laws at this many times the ladder's largest budget."""
CEILING = 2.0
"""A prediction above this many times the ladder's largest final loss is no prediction (nor one <= 0)."""
N_SPAN = 10.0
"""Smallest ``max N / min N`` of a ladder whose N exponent the trajectory law is asked for (issue 42's protocol)."""
WIDE_LOSS = 0.05
"""Widest trajectory-law loss interval (``hi / lo - 1``, the median over the ladder's own points: a run left out
of a resample is extrapolated to, so the largest is the smallest size's without it): more than
twice the largest rung's seed spread of the issue-42 ladder (2.1%), which is as large as the differences between
its sizes at one budget; a law that uncertain inside its ladder says nothing past it."""
MAX_LOSS = 20.0
"""Where a fit has no loss range (an older fit.json): the largest loss taken as a prediction, in nats
(ln 20 ~ a uniform guess over 485M tokens: no vocabulary is that large)."""

_NAMES = ("E", "A", "B", "alpha", "beta")
_NEXT_BOUND = {"E": "a larger size and a larger budget (the points do not yet flatten towards E)",
               "A": "another size, spanning at least 10x in N", "alpha": "another size, spanning at least 10x in N",
               "B": "another budget, spanning at least 30x in compute",
               "beta": "another budget, spanning at least 30x in compute"}


def residual_scale(law: Law, n, d, loss) -> float:
    """1.4826 x the median of ``|loss / law(n, d) - 1|`` (a robust standard deviation of relative residuals)."""
    rel = np.asarray(loss, float) / law.loss(n, d) - 1.0
    return float(1.4826 * np.median(np.abs(rel)))


def judge_law(law: Law, boot: list[Law], n, d, loss, budgets, largest: float) -> dict:
    """The verdict on approach 3's fit ``law`` (bootstrap refits ``boot``) of points ``(n, d, loss)`` at isoFLOP
    ``budgets`` (module docstring).

    Returns:
        ``{"degenerate": bool, "reasons": [str], "next": [str], "residual_scale": float,
        "distinct_refits": int}``: one reason per failed check, what to run next for each (deduplicated).
    """
    reasons, nexts = [], []

    def fail(reason: str, nxt: str) -> None:
        reasons.append(reason)
        if nxt not in nexts:
            nexts.append(nxt)

    sizes = len(np.unique(np.round(np.asarray(n, float))))
    if len(set(budgets)) < 2:
        fail(f"{len(set(budgets))} budget: N and D vary together, the law cannot tell them apart",
             "at least 3 budgets spanning at least 30x in compute")
    if sizes < 2:
        fail(f"{sizes} size: the parameter term is not measured", "at least 4 sizes spanning at least 10x in N")
    for name, v, (lo, hi) in zip(_NAMES, law_vector(law), LAW_BOUNDS):
        if v - lo < AT_BOUND or hi - v < AT_BOUND:
            side = "lower" if v - lo < AT_BOUND else "upper"
            fail(f"{name} = {getattr(law, name):.4g} at its {side} bound", _NEXT_BOUND[name])
    for i, key in enumerate(("N_opt", "D_opt")):
        vals = np.array([b.optimal(largest)[i] for b in boot], float)
        vals = vals[np.isfinite(vals) & (vals > 0)]
        if len(vals):
            q = (1.0 - LEVEL) / 2.0
            lo, hi = np.quantile(vals, [q, 1.0 - q])
            if hi / lo > WIDE:
                fail(f"the {key} interval at {largest:.3g} FLOPs spans {hi / lo:.3g}x (more than {WIDE:g}x)",
                     f"a size near the optimum of the largest budget (N ~ {law.optimal(largest)[0]:.3g}) and a "
                     f"larger budget")
    distinct = len({tuple(np.round(law_vector(b), 6)) for b in boot})
    if distinct < FEW:
        fail(f"{distinct} distinct bootstrap refits (fewer than {FEW}): the intervals measure nothing",
             f"more points (sizes x budgets) and at least {FEW} bootstrap samples")
    scale = residual_scale(law, n, d, loss)
    if scale > NOISE:
        fail(f"the points scatter {scale:.1%} around the law (more than {NOISE:.0%} of seed noise)",
             "check each point's run (repeated data? divergence?) or run the noisy points at more seeds")
    return {"degenerate": bool(reasons), "reasons": reasons, "next": nexts, "residual_scale": scale,
            "distinct_refits": distinct}


def cross_check(law: Law, boot: list[Law], budgets, best, largest: float, level: float = LEVEL) -> dict:
    """Approach 3's frontier against the power law in compute through each budget's best loss ``best`` (at
    ``budgets``), both at ``CROSS_AT x largest`` FLOPs (module docstring).

    Returns:
        ``{"at", "approach3", "lo", "hi", "power_law", "k", "gamma", "agree"}``, or ``{"skipped": why}`` with
        fewer than 2 budgets.
    """
    try:
        k, gamma = fit_compute_power(budgets, best)
    except ValueError as e:
        return {"skipped": str(e)}
    at = CROSS_AT * largest
    q = (1.0 - level) / 2.0
    front = [float(frontier(b, at)) for b in boot]
    front = [f for f in front if np.isfinite(f)]
    lo, hi = (np.quantile(front, [q, 1.0 - q]) if front else (np.nan, np.nan))
    power = k * at ** gamma
    return {"at": at, "approach3": float(frontier(law, at)), "lo": float(lo), "hi": float(hi), "power_law": power,
            "k": k, "gamma": gamma, "agree": bool(lo <= power <= hi)}


def withheld(p: dict, fit: dict) -> str | None:
    """Why prediction ``p`` (:func:`densetrain.law.fits.fit_prediction`) of ``fit`` (``fit.json``) is no
    prediction, or None when it is one (module docstring)."""
    if fit.get("degenerate"):
        return "the ladder's fit is degenerate (" + "; ".join(fit.get("reasons", [])) + ")"
    vals = [p["loss"], p["loss_lo"], p["loss_hi"]]
    if not all(isinstance(v, float) and np.isfinite(v) for v in vals):
        return "the prediction or its interval is not a number (no bootstrap refits in fit.json?)"
    rng = fit.get("loss_range")
    ceiling = CEILING * rng[1] if rng else MAX_LOSS
    if not 0 < min(vals) or max(vals) > ceiling:
        return (f"the law's loss or its interval lies outside (0, {ceiling:.4g}] nats, {CEILING:g}x the ladder's "
                f"highest final loss (a size or length far outside the ladder's)")
    return None


def checked_prediction(fit: dict, n: float, d: float) -> dict:
    """:func:`densetrain.law.fits.fit_prediction` of a run of ``n`` parameters on ``d`` tokens with ``withheld``
    (:func:`withheld`: why it is no prediction, or None), ``next`` (what to run next, from the fit's verdict) and,
    where the fit has its cross-check, ``power_law`` (the power law in compute at the run's FLOPs) and
    ``power_law_agrees`` (within the prediction's interval)."""
    p = fit_prediction(fit, n, d)
    p["withheld"], p["next"] = withheld(p, fit), list(fit.get("next", []))
    x = fit.get("cross_check") or {}
    if isinstance(x.get("k"), float) and isinstance(x.get("gamma"), float):
        p["power_law"] = x["k"] * p["flops"] ** x["gamma"]
        p["power_law_agrees"] = bool(p["loss_lo"] <= p["power_law"] <= p["loss_hi"])
    return p


def judge_trajectory(law: Trajectory, boot: list[Trajectory], n, s1, drop, loss) -> dict:
    """The verdict on the trajectory law ``law`` (bootstrap refits ``boot``) fitted to points ``(n, s1, drop, loss)``
    (module docstring).

    Returns:
        ``{"degenerate", "reasons", "next", "residual_scale", "distinct_refits"}`` as :func:`judge_law`.
    """
    reasons, nexts = [], []

    def fail(reason: str, nxt: str) -> None:
        reasons.append(reason)
        if nxt not in nexts:
            nexts.append(nxt)

    n, s1, drop, loss = (np.asarray(v, float) for v in (n, s1, drop, loss))
    sizes = np.unique(np.round(n))
    if len(sizes) < 3 or sizes.max() / sizes.min() < N_SPAN:
        fail(f"{len(sizes)} sizes spanning {sizes.max() / sizes.min():.3g}x in N (expected 3+ over {N_SPAN:g}x)",
             f"more sizes, spanning at least {N_SPAN:g}x in N")
    for r in at_bounds(law, float(loss.min())):
        fail(r, "another size and longer runs of the largest sizes (the trajectories do not pin this term)")
    distinct = len({tuple(np.round([b.E, b.A, b.alpha, b.B, b.beta, b.C], 6)) for b in boot})
    if distinct < FEW:
        fail(f"{distinct} distinct bootstrap refits (fewer than {FEW}): the intervals measure nothing",
             f"more runs and at least {FEW} bootstrap samples")
    if law.scale > NOISE:
        fail(f"the points scatter {law.scale:.1%} around the law (more than {NOISE:.0%} of seed noise)",
             "check each run (repeated data? divergence?) or run the noisy points at more seeds")
    if boot:  # the interval at a typical point of the ladder (the median over its points: inside the ladder)
        at = [b.loss(n, s1, drop) for b in boot]
        lo, hi = (np.quantile(at, q, axis=0) for q in ((1 - LEVEL) / 2, (1 + LEVEL) / 2))
        width = float(np.median(hi / lo - 1.0))
        if not width <= WIDE_LOSS:
            fail(f"the loss interval at the ladder's own points spans {width:.1%} (median; more than {WIDE_LOSS:.0%})",
                 "longer runs of the largest sizes, more seeds")
    return {"degenerate": bool(reasons), "reasons": reasons, "next": nexts, "residual_scale": law.scale,
            "distinct_refits": distinct}


def trajectory_prediction(fit: dict, n: float, s1: float, drop: float) -> dict:
    """The final loss of a run of ``n`` parameters whose lr schedule ends at forward area ``s1`` and annealing
    drop ``drop`` from
    ``fit["trajectory"]`` (``fit.json``), with its interval, how far it extrapolates (``n`` and ``s1`` over the
    ladder's largest), and ``withheld`` (why it is no prediction: the law degenerate, or not a number) or None."""
    tr = fit["trajectory"]
    law = Trajectory(**tr["law"])
    boot = [Trajectory(*b) for b in tr.get("bootstrap", [])]
    level = fit.get("level", LEVEL)
    p = predict_trajectory(law, boot, n, s1, drop, level)
    out = {"n": n, "s1": s1, "drop": drop, "loss": p.value, "loss_lo": p.lo, "loss_hi": p.hi, "level": level,
           "n_extrapolation": n / tr["n_range"][1], "s1_extrapolation": s1 / tr["s1_range"][1], "withheld": None,
           "next": list(tr.get("next", []))}
    if tr.get("degenerate"):
        out["withheld"] = "the trajectory law is degenerate (" + "; ".join(tr.get("reasons", [])) + ")"
    elif not all(np.isfinite([p.value, p.lo, p.hi])):
        out["withheld"] = "the prediction or its interval is not a number (no bootstrap refits in fit.json?)"
    return out
