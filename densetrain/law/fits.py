"""Scaling laws: the forms, their fits, predictions and bootstrap intervals (pure math: numpy and scipy).

- **Approach 3** (Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models", eq. 2; fitted
  as re-done by Besiroglu et al. 2024, "Chinchilla Scaling: A replication attempt"):
  ``L(N, D) = E + A / N^alpha + B / D^beta`` with N parameters and D training tokens. The fit minimises the
  Huber loss (delta 1e-3) of ``log L`` against ``LSE(a - alpha log N, b - beta log D, e)`` (``A = e^a``,
  ``B = e^b``, ``E = e^e``) with L-BFGS-B from the best starts of a grid (the replication's grid: alpha,
  beta in 0..2, e in -1..1, a, b in 0..25), :func:`fit_law`.
- **Approach 2** (Hoffmann et al. 2022, section 3.2): per isoFLOP budget a parabola of the loss in log N;
  its minimum is that budget's N_opt; a line through ``log N_opt`` against ``log C`` gives
  ``N_opt = k C^a`` and ``D_opt = C / (6 N_opt)`` so ``b = 1 - a``, :func:`fit_isoflop`.
- **Bootstrap intervals** for every fitted number: the points resampled with replacement (within each
  budget for approach 2), refitted, percentile intervals, :func:`bootstrap_law`, :func:`bootstrap_isoflop`.
- **The schedule-aware curve** of one run (our choice, after Tissue et al. 2024, "Scaling Law with Learning
  Rate Annealing"): ``L(N, s) = E + A / N^alpha + B / S1^beta - C * S2 / S1``, where ``S1`` is the
  lr-weighted tokens seen by step s (sum of ``lr_i / peak_lr * tokens_i``, the forward area; it is D under
  a constant lr) and ``S2`` the annealing area with momentum (``m_i = lam * m_{i-1} + (lr_{i-1} - lr_i) /
  peak_lr``, ``S2 = sum m_i * tokens_i``, lam = 0.999 per step as in the paper). Tissue et al. subtract
  ``C * S2``; we divide S2 by S1 so that a cooldown over the same fraction of a run buys the same loss at
  every length (Hägele et al. 2024 find the cooldown's gain does not grow with the run), and we add
  Chinchilla's N term so one fit covers every size of a ladder. :func:`schedule_areas`, :func:`fit_curve`.
- **Compute multiplier** of one recipe over another (e.g. Muon over AdamW; the "effective compute" of
  Kaplan et al. 2020 and of Liu et al. 2025, "Muon is Scalable for LLM Training", fig. 3): at budget C the
  other recipe's compute-optimal loss ``L_new(C)``, and the compute ``C_ref`` at which the reference law's
  frontier ``L_ref(N_opt(C_ref), D_opt(C_ref))`` reaches it; the multiplier is ``C_ref / C`` (inf where the
  new loss lies below the reference's E). With ``B_new = B_ref / k^beta`` (the new recipe uses each token as
  k tokens) it is k at every budget. :func:`compute_multiplier`, :func:`multiplier_intervals`.
- **Downstream, step 2** (Bhagia et al. 2024, "Establishing Task Scaling Laws via Compute-Efficient Model
  Ladders", eq. 2; Llama 3's two-step): a task's accuracy as a sigmoid of the loss,
  ``Acc(L) = a / (1 + exp(-k (L - L0))) + b`` (k < 0: accuracy rises as the loss falls); step 1 is the loss
  prediction above. :func:`fit_accuracy`.

Units: N in parameters, D and S1/S2 in tokens, C in FLOPs (``6 N D``), losses in nats per token.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import brentq, curve_fit, minimize
from scipy.special import logsumexp

HUBER_DELTA = 1e-3
"""Huber delta on log-loss residuals (Hoffmann et al. 2022, section D.2)."""
LEVEL = 0.95
"""Default coverage of the bootstrap percentile intervals."""
ANNEAL_MOMENTUM = 0.999
"""lam of the annealing area's momentum, per step (Tissue et al. 2024, section 3)."""

# The replication's grid of starts (Besiroglu et al. 2024, section 2): 5 x 5 x 5 x 6 x 6.
_GRID = {"e": np.arange(-1.0, 1.01, 0.5), "a": np.arange(0.0, 25.1, 5.0), "b": np.arange(0.0, 25.1, 5.0),
         "alpha": np.arange(0.0, 2.01, 0.5), "beta": np.arange(0.0, 2.01, 0.5)}
_KEEP_STARTS = 24  # L-BFGS-B runs from this many of the grid's starts with the lowest objective
# The Huber objective with delta 1e-3 is tiny (its gradient is clipped to +-delta per point): scipy's default
# tolerances (gtol 1e-5) stop L-BFGS-B near its start, which left bootstrap refits where they began.
_TIGHT = {"ftol": 1e-15, "gtol": 1e-12, "maxiter": 5000}


def huber(r: np.ndarray, delta: float = HUBER_DELTA) -> tuple[np.ndarray, np.ndarray]:
    """Huber loss of residuals ``r`` and its derivative (quadratic within ``delta``, linear outside)."""
    a = np.abs(r)
    loss = np.where(a <= delta, 0.5 * r * r, delta * (a - 0.5 * delta))
    return loss, np.clip(r, -delta, delta)


@dataclass(frozen=True)
class Law:
    """``L(N, D) = E + A / N^alpha + B / D^beta`` (approach 3)."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def loss(self, n, d):
        """Predicted loss (nats per token) at ``n`` parameters and ``d`` tokens (arrays broadcast)."""
        return self.E + self.A / np.asarray(n, float) ** self.alpha + self.B / np.asarray(d, float) ** self.beta

    @property
    def a(self) -> float:
        """Exponent of ``N_opt proportional to C^a``: beta / (alpha + beta) (Hoffmann et al. 2022, eq. 4)."""
        return self.beta / (self.alpha + self.beta)

    def optimal(self, c):
        """Compute-optimal ``(N_opt, D_opt)`` at ``c`` FLOPs with ``C = 6 N D`` (Hoffmann et al. 2022, eq. 4):
        ``N_opt = G (C/6)^a``, ``D_opt = (C/6)^b / G``, ``G = (alpha A / (beta B))^(1 / (alpha + beta))``."""
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / (self.alpha + self.beta))
        x = np.asarray(c, float) / 6.0
        return g * x ** self.a, x ** (1.0 - self.a) / g

    def tokens_per_param(self, c) -> float:
        """``D_opt / N_opt`` at ``c`` FLOPs (depends on c unless alpha = beta)."""
        n, d = self.optimal(c)
        return d / n


def _lse_terms(x: np.ndarray, ln: np.ndarray, ld: np.ndarray) -> np.ndarray:
    """The three log-terms (a - alpha log N, b - beta log D, e) of parameter vectors ``x`` (..., 5)."""
    e, a, b, alpha, beta = (x[..., i, None] for i in range(5))
    return np.stack([a - alpha * ln, b - beta * ld, np.broadcast_to(e, (a - alpha * ln).shape)], axis=-1)


def _objective(x: np.ndarray, ln: np.ndarray, ld: np.ndarray, ll: np.ndarray, delta: float):
    t = _lse_terms(x, ln, ld)  # (points, 3)
    pred = logsumexp(t, axis=-1)
    w = np.exp(t - pred[:, None])  # softmax: d pred / d term
    loss, dr = huber(pred - ll, delta)
    grad = np.array([dr @ w[:, 2], dr @ w[:, 0], dr @ w[:, 1], -(dr * ln) @ w[:, 0], -(dr * ld) @ w[:, 1]])
    return float(loss.sum()), grad


def _law_of(x: np.ndarray) -> Law:
    e, a, b, alpha, beta = (float(v) for v in x)
    return Law(E=float(np.exp(e)), A=float(np.exp(a)), B=float(np.exp(b)), alpha=alpha, beta=beta)


def _check_points(*arrays) -> list[np.ndarray]:
    out = [np.asarray(a, float).ravel() for a in arrays]
    if len({len(a) for a in out}) != 1:
        raise ValueError(f"points of unequal lengths {[len(a) for a in out]}")
    if any(not np.all(np.isfinite(a)) or np.any(a <= 0) for a in out):
        raise ValueError("every N, D and loss must be a finite number > 0")
    return out


LAW_BOUNDS = ((-20.0, 20.0), (-20.0, 100.0), (-20.0, 100.0), (0.0, 5.0), (0.0, 5.0))
"""Bounds of approach 3's fit on ``(e, a, b, alpha, beta)`` (``E = e^e``, ``A = e^a``, ``B = e^b``): negative
exponents are no scaling law; E = e^-20 is zero for any loss (a lower bound keeps it a number where the data
puts E at 0), e^100 the largest coefficient that keeps the fit's arithmetic finite. A fit that ends on one is
degenerate (:mod:`densetrain.law.judge`)."""


def fit_law(n, d, loss, delta: float = HUBER_DELTA, starts: np.ndarray | None = None) -> Law:
    """Approach 3 fitted to points ``(n[i], d[i], loss[i])`` (module docstring).

    Args:
        starts: parameter vectors ``(e, a, b, alpha, beta)`` to start L-BFGS-B from; None: the best
            ``_KEEP_STARTS`` of the replication's grid by their objective.
    Raises:
        ValueError: fewer than 5 points, or a point not finite and positive.
    """
    n, d, loss = _check_points(n, d, loss)
    if len(n) < 5:
        raise ValueError(f"approach 3 has 5 parameters; {len(n)} points are too few")
    ln, ld, ll = np.log(n), np.log(d), np.log(loss)
    if starts is None:
        grid = np.array(list(itertools.product(*_GRID.values())))  # (4500, 5)
        t = _lse_terms(grid, ln, ld)  # (4500, points, 3)
        obj = huber(logsumexp(t, axis=-1) - ll, delta)[0].sum(axis=1)
        starts = grid[np.argsort(obj)[:_KEEP_STARTS]]
    bounds = LAW_BOUNDS
    best = None
    for x0 in starts:
        res = minimize(_objective, x0, args=(ln, ld, ll, delta), jac=True, method="L-BFGS-B", bounds=bounds,
                       options=_TIGHT)
        if best is None or res.fun < best.fun:
            best = res
    return _law_of(best.x)


def law_vector(law: Law) -> np.ndarray:
    """``law`` as the fit's parameter vector ``(e, a, b, alpha, beta)`` (a start for refits)."""
    return np.array([np.log(law.E), np.log(law.A), np.log(law.B), law.alpha, law.beta])


@dataclass(frozen=True)
class Interval:
    """A fitted number and its bootstrap percentile interval ``[lo, hi]`` at ``level``."""

    value: float
    lo: float
    hi: float
    level: float = LEVEL

    @classmethod
    def of(cls, value: float, samples, level: float = LEVEL) -> Interval:
        s = np.asarray(samples, float)
        s = s[np.isfinite(s)]
        q = (1.0 - level) / 2.0
        lo, hi = (np.quantile(s, [q, 1.0 - q]) if len(s) else (np.nan, np.nan))
        return cls(float(value), float(lo), float(hi), level)

    def __str__(self) -> str:
        return f"{self.value:.4g} [{self.lo:.4g}, {self.hi:.4g}]"


def bootstrap_law(n, d, loss, law: Law, samples: int = 200, seed: int = 0, delta: float = HUBER_DELTA) -> list[Law]:
    """Approach 3 refitted on ``samples`` resamples of the points (with replacement), each started from the
    full fit ``law`` (a resample's optimum lies near it; the grid search would cost 50x more)."""
    n, d, loss = _check_points(n, d, loss)
    rng = np.random.default_rng(seed)
    starts = law_vector(law)[None]
    out = []
    for _ in range(samples):
        idx = rng.integers(0, len(n), len(n))
        if len(np.unique(idx)) < 5:
            continue
        refit = fit_law(n[idx], d[idx], loss[idx], delta, starts=starts)
        if np.all(np.isfinite(law_vector(refit))):
            out.append(refit)
    return out


def law_intervals(law: Law, boot: list[Law], budget: float, level: float = LEVEL) -> dict:
    """Every fitted number of approach 3 with its interval, and the compute-optimal point at ``budget`` FLOPs
    (``n_opt``, ``d_opt``, ``tokens_per_param``)."""
    out = {k: asdict(Interval.of(getattr(law, k), [getattr(b, k) for b in boot], level))
           for k in ("E", "A", "B", "alpha", "beta", "a")}
    for i, k in enumerate(("n_opt", "d_opt")):
        out[k] = asdict(Interval.of(float(law.optimal(budget)[i]), [float(b.optimal(budget)[i]) for b in boot], level))
    out["tokens_per_param"] = asdict(Interval.of(law.tokens_per_param(budget),
                                                 [b.tokens_per_param(budget) for b in boot], level))
    return out


def predict(law: Law, boot: list[Law], n: float, d: float, level: float = LEVEL) -> Interval:
    """The loss at ``n`` parameters and ``d`` tokens with its bootstrap interval."""
    return Interval.of(float(law.loss(n, d)), [float(b.loss(n, d)) for b in boot], level)


_HUGE = 1e30  # the largest multiplier solved for


def frontier(law: Law, c):
    """The compute-optimal loss ``L(N_opt(c), D_opt(c))`` at ``c`` FLOPs (decreasing in c, down to E)."""
    return law.loss(*law.optimal(c))


def compute_multiplier(ref: Law, new: Law, c: float) -> float:
    """The compute the reference law needs to reach, on its frontier, the new law's compute-optimal loss at
    ``c`` FLOPs, over ``c`` (module docstring): > 1 where the new recipe is better. Solved in ``log C`` by
    brentq (the frontier is monotone), within 1e-12 relative in C.

    Returns:
        the multiplier; ``inf`` when the new loss is at or below the reference's E (no compute reaches it),
        ``nan`` past 1e30 times (a law too flat to say).
    """
    target = float(frontier(new, c))
    if target <= ref.E:
        return float("inf")
    gap = lambda x: float(frontier(ref, c * np.exp(x))) - target  # noqa: E731  (decreasing in x)
    lo, hi = -np.log(_HUGE), np.log(_HUGE)
    if gap(hi) > 0 or gap(lo) < 0:
        return float("nan")
    return float(np.exp(brentq(gap, lo, hi, xtol=1e-12)))


def multiplier_intervals(ref: Law, ref_boot: list[Law], new: Law, new_boot: list[Law], budgets,
                         level: float = LEVEL) -> list[dict]:
    """:func:`compute_multiplier` at each of ``budgets`` with a bootstrap interval: the i-th bootstrap law of
    each recipe paired (they are independent resamples of two independent ladders), percentile interval over
    the pairs (an infinite multiplier counts as the largest; a nan pair is dropped).

    Returns:
        per budget ``{"budget", "value", "lo", "hi", "level"}``.
    """
    pairs = list(zip(ref_boot, new_boot))
    out = []
    for c in budgets:
        samples = [compute_multiplier(r, m, c) for r, m in pairs]
        s = np.array([min(x, _HUGE) for x in samples if not np.isnan(x)])  # inf - inf is nan in the quantile
        q = (1.0 - level) / 2.0
        lo, hi = (np.where(np.quantile(s, [q, 1.0 - q]) >= _HUGE, np.inf, np.quantile(s, [q, 1.0 - q]))
                  if len(s) else (np.nan, np.nan))
        out.append({"budget": float(c), "value": compute_multiplier(ref, new, c), "lo": float(lo), "hi": float(hi),
                    "level": level})
    return out


def fit_compute_power(c, loss) -> tuple[float, float]:
    """``L*(C) = k * C^gamma`` by least squares of ``log L*`` on ``log C`` through each budget's best loss
    ``loss`` at budgets ``c`` (FLOPs): the loss-against-compute power law of Kaplan et al. 2020 (eq. 1.3, with
    no irreducible term), a cross-check of approach 3's extrapolation that needs no E, alpha or beta.

    Returns:
        ``(k, gamma)`` (gamma < 0 where the loss falls with compute).
    Raises:
        ValueError: fewer than 2 budgets, or a budget or loss not finite and positive.
    """
    c, loss = _check_points(c, loss)
    if len(np.unique(c)) < 2:
        raise ValueError(f"a power law in C needs at least 2 budgets; {len(np.unique(c))} given")
    gamma, logk = np.polyfit(np.log(c), np.log(loss), 1)
    return float(np.exp(logk)), float(gamma)


# --- approach 2 -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class IsoFlop:
    """Approach 2: ``N_opt = k * C^a`` (and ``D_opt = C / (6 N_opt)``, so ``b = 1 - a``), from the minima
    ``n_opt`` of the parabolas at ``budgets``."""

    a: float
    k: float
    budgets: tuple[float, ...]
    n_opt: tuple[float, ...]

    @property
    def b(self) -> float:
        return 1.0 - self.a

    def optimal(self, c: float) -> tuple[float, float]:
        n = self.k * c ** self.a
        return n, c / (6.0 * n)

    def tokens_per_param(self, c: float) -> float:
        n, d = self.optimal(c)
        return d / n


def budget_groups(n, d, rtol: float = 0.05) -> list[np.ndarray]:
    """Indices of the points grouped by compute budget ``6 N D`` (equal within ``rtol``), ascending."""
    logc = np.log(6.0 * np.asarray(n, float) * np.asarray(d, float))
    order = np.argsort(logc)
    groups, cur = [], [order[0]]
    for i in order[1:]:
        if logc[i] - logc[cur[0]] <= np.log1p(rtol):
            cur.append(i)
        else:
            groups.append(np.array(cur))
            cur = [i]
    groups.append(np.array(cur))
    return groups


def fit_isoflop(n, d, loss, groups: list[np.ndarray] | None = None) -> IsoFlop:
    """Approach 2 on points ``(n, d, loss)``: a parabola of loss in ``log N`` per budget (groups of at least 3
    distinct sizes whose parabola has its minimum between their smallest and largest N), its vertex ``N_opt``,
    then least squares of ``log N_opt`` on ``log C``.

    Raises:
        ValueError: fewer than 2 budgets with a usable parabola.
    """
    n, d, loss = _check_points(n, d, loss)
    groups = budget_groups(n, d) if groups is None else groups
    cs, opts = [], []
    for g in groups:
        if len(np.unique(n[g])) < 3:
            continue
        ln = np.log(n[g])
        c2, c1, _ = np.polyfit(ln, loss[g], 2)
        if c2 <= 0 or not ln.min() <= -c1 / (2.0 * c2) <= ln.max():
            continue  # no minimum among the budget's sizes: they all sit on one side of the optimum
        cs.append(float(np.exp(np.mean(np.log(6.0 * n[g] * d[g])))))
        opts.append(float(np.exp(-c1 / (2.0 * c2))))
    if len(cs) < 2:
        raise ValueError(f"approach 2 needs at least 2 budgets with 3+ sizes around a minimum; {len(cs)} found")
    a, logk = np.polyfit(np.log(cs), np.log(opts), 1)
    return IsoFlop(a=float(a), k=float(np.exp(logk)), budgets=tuple(cs), n_opt=tuple(opts))


def bootstrap_isoflop(n, d, loss, samples: int = 200, seed: int = 0) -> list[IsoFlop]:
    """Approach 2 refitted on resamples of each budget's points (with replacement, within the budget)."""
    n, d, loss = _check_points(n, d, loss)
    rng = np.random.default_rng(seed)
    groups = budget_groups(n, d)
    out = []
    for _ in range(samples):
        pick = [g[rng.integers(0, len(g), len(g))] for g in groups]
        idx = np.concatenate(pick)
        offsets = np.cumsum([0] + [len(p) for p in pick])
        try:
            out.append(fit_isoflop(n[idx], d[idx], loss[idx],
                                   [np.arange(offsets[i], offsets[i + 1]) for i in range(len(pick))]))
        except ValueError:
            continue
    return out


def isoflop_intervals(fit: IsoFlop, boot: list[IsoFlop], budget: float, level: float = LEVEL) -> dict:
    """Approach 2's exponents, ``N_opt``/``D_opt`` and tokens per parameter at ``budget`` with intervals, and
    ``distinct_resamples``: how many different refits the intervals come from."""
    out = {"a": asdict(Interval.of(fit.a, [b.a for b in boot], level)),
           "b": asdict(Interval.of(fit.b, [b.b for b in boot], level))}
    for i, k in enumerate(("n_opt", "d_opt")):
        out[k] = asdict(Interval.of(fit.optimal(budget)[i], [b.optimal(budget)[i] for b in boot], level))
    out["tokens_per_param"] = asdict(Interval.of(fit.tokens_per_param(budget),
                                                 [b.tokens_per_param(budget) for b in boot], level))
    out["budgets"], out["n_opt_per_budget"] = list(fit.budgets), list(fit.n_opt)
    # With 3 sizes a budget, a resample keeps a budget's parabola only when it redraws its 3 points (6 times in
    # 27), so every refit is the fit of a subset of the original budgets: few distinct values, no real interval.
    out["distinct_resamples"] = len({round(b.a, 12) for b in boot})
    return out


# --- the schedule-aware curve -----------------------------------------------------------------------------

def schedule_areas(lrs, tokens, peak_lr: float, lam: float = ANNEAL_MOMENTUM) -> tuple[np.ndarray, np.ndarray]:
    """The forward area ``S1`` and annealing area ``S2`` (tokens) after each step of a run whose step i
    ran at ``lrs[i]`` on ``tokens[i]`` tokens (module docstring; Tissue et al. 2024, eq. 1).

    Returns:
        ``(S1, S2)``, two arrays of ``len(lrs)``: the areas at the end of each step.
    """
    r = np.asarray(lrs, float) / peak_lr
    t = np.broadcast_to(np.asarray(tokens, float), r.shape)
    drop = np.diff(r, prepend=r[:1]) * -1.0  # lr_{i-1} - lr_i (0 at the first step)
    drop[drop < 0] = 0.0  # warmup's rises are no annealing
    m = np.empty_like(r)
    acc = 0.0
    for i, x in enumerate(drop):
        acc = lam * acc + x
        m[i] = acc
    return np.cumsum(r * t), np.cumsum(m * t)


@dataclass(frozen=True)
class LossLaw:
    """The six constants of a loss law in model size ``N`` and the schedule (:class:`Curve` here, the
    trajectory law of :mod:`densetrain.law.trajectory`), each law with its own formula, and its fit's spread."""

    E: float
    A: float
    alpha: float
    B: float
    beta: float
    C: float
    scale: float = 0.0
    """Robust scale of the fit's relative residuals (1.4826 x their median absolute value)."""


@dataclass(frozen=True)
class Curve(LossLaw):
    """``L(N, S1, S2) = E + A / N^alpha + B / S1^beta - C * S2 / S1`` (module docstring)."""

    def loss(self, n, s1, s2):
        s1 = np.asarray(s1, float)
        return self.E + self.A / np.asarray(n, float) ** self.alpha + self.B / s1 ** self.beta - self.C * s2 / s1


def _curve_of(x: np.ndarray) -> tuple[float, ...]:
    e, a, alpha, b, beta, c = x
    return float(np.exp(e)), float(np.exp(a)), float(alpha), float(np.exp(b)), float(beta), float(c)


def fit_curve(n, s1, s2, loss, delta: float = HUBER_DELTA) -> Curve:
    """The schedule-aware curve fitted to validation points ``(n, s1, s2, loss)`` of ladder runs: Huber
    (``delta``) on log-loss, L-BFGS-B from a small grid of starts (E, A, B as logs; C >= 0).

    Raises:
        ValueError: fewer than 6 points, or a point not finite and positive (s2 may be 0).
    """
    n, s1, loss = _check_points(n, s1, loss)
    s2 = np.asarray(s2, float).ravel()
    if len(n) < 6:
        raise ValueError(f"the schedule-aware curve has 6 parameters; {len(n)} points are too few")
    ll, ln, ls1, frac = np.log(loss), np.log(n), np.log(s1), s2 / s1

    def obj(x):
        e, a, alpha, b, beta, c = x
        with np.errstate(over="ignore", invalid="ignore"):  # a step far out: rejected below, not an error
            tn, ts = np.exp(a - alpha * ln), np.exp(b - beta * ls1)
            pred = np.exp(e) + tn + ts - c * frac
            if not np.all(np.isfinite(pred)) or np.any(pred <= 0):
                return 1e6, np.zeros(6)
            lo, dr = huber(np.log(pred) - ll, delta)
            g = dr / pred
            return float(lo.sum()), np.array([g @ np.full_like(pred, np.exp(e)), g @ tn, -(g * ln) @ tn, g @ ts,
                                              -(g * ls1) @ ts, -(g @ frac)])

    bounds = [(-20.0, np.log(loss.min())), (-20.0, 100.0), (0.0, 3.0), (-20.0, 100.0), (0.0, 3.0), (0.0, None)]
    best = None
    for e0, alpha0, beta0 in itertools.product([-1.0, 0.5 * np.log(loss.min())], [0.3, 1.0], [0.3, 0.8]):
        x0 = [min(e0, np.log(loss.min()) - 0.1), np.log(0.3 * loss.min()) + alpha0 * ln.mean(), alpha0,
              np.log(0.3 * loss.min()) + beta0 * ls1.mean(), beta0, 0.1]
        res = minimize(obj, x0, jac=True, method="L-BFGS-B", bounds=bounds, options=_TIGHT)
        if best is None or res.fun < best.fun:
            best = res
    c = Curve(*_curve_of(best.x))
    rel = loss / c.loss(n, s1, s2) - 1.0
    return Curve(*_curve_of(best.x), scale=float(1.4826 * np.median(np.abs(rel))))


@dataclass(frozen=True)
class Sigmoid:
    """``Acc(L) = a / (1 + exp(-k (L - L0))) + b`` (module docstring)."""

    a: float
    k: float
    L0: float
    b: float

    def acc(self, loss):
        return self.a / (1.0 + np.exp(-self.k * (np.asarray(loss, float) - self.L0))) + self.b


def fit_accuracy(loss, acc) -> Sigmoid:
    """Step 2 of the downstream two-step: the sigmoid of a task's accuracy ``acc`` against the loss ``loss``
    (least squares, scipy's curve_fit; started at the observed range and a slope of -5 per nat).

    Raises:
        ValueError: fewer than 4 points, or no fit converged.
    """
    loss, acc = np.asarray(loss, float), np.asarray(acc, float)
    if len(loss) < 4:
        raise ValueError(f"the accuracy sigmoid has 4 parameters; {len(loss)} points are too few")
    p0 = [max(acc.max() - acc.min(), 1e-3), -5.0, float(np.median(loss)), float(acc.min())]
    try:
        p, _ = curve_fit(lambda x, a, k, l0, b: Sigmoid(a, k, l0, b).acc(x), loss, acc, p0=p0, maxfev=20000)
    except RuntimeError as e:
        raise ValueError(f"the accuracy sigmoid did not converge: {e}") from None
    return Sigmoid(*(float(v) for v in p))


def fit_prediction(fit: dict, n: float, d: float) -> dict:
    """The predicted final loss (and bpb) of a run of ``n`` parameters on ``d`` tokens from a ladder's fit
    (``fit.json`` of ``densetrain ladder fit`` as a dict: ``approach3`` with ``law`` and ``bootstrap``,
    ``bpb_per_nat``, ``largest_budget``, ``level``, ``downstream``), with its interval and ``extrapolation``:
    ``6 n d`` over the ladder's largest budget; ``downstream``: per task the accuracy at the predicted loss and
    at the interval's ends ``[value, at lo, at hi]``."""
    a3 = fit["approach3"]
    law = Law(**a3["law"])
    boot = [Law(*b) for b in a3.get("bootstrap", [])]
    level = fit.get("level", LEVEL)
    p = predict(law, boot, n, d, level) if boot else Interval(float(law.loss(n, d)), np.nan, np.nan, level)
    out = {"n": n, "d": d, "flops": 6.0 * n * d, "loss": p.value, "loss_lo": p.lo, "loss_hi": p.hi, "level": level,
           "extrapolation": 6.0 * n * d / fit["largest_budget"]}
    r = fit.get("bpb_per_nat")
    out.update({"bpb": p.value * r, "bpb_lo": p.lo * r, "bpb_hi": p.hi * r} if r else {"bpb": None})
    if fit.get("downstream"):  # step 2 at the predicted loss and at its interval's ends
        out["downstream"] = {t: [float(Sigmoid(**s).acc(x)) for x in (p.value, p.lo, p.hi)]
                             for t, s in fit["downstream"].items()}
    return out
