"""``densetrain ladder fit``: the laws of a ladder's points, with bootstrap intervals, into ``fit.json``.

- approach 3 on the final validation loss of every point (N = :data:`~densetrain.tools.ladder.grid.N_KEY`,
  D = its tokens), with the bootstrap laws kept for predictions (:func:`densetrain.law.fit_prediction`);
- approach 2 over the budgets that have 3+ sizes around a minimum (skipped, with the reason, otherwise);
- the compute-optimal tokens per parameter at the ladder's largest budget from both;
- bits per byte per nat (the held-out text's bytes per token, the same for every point), for bpb predictions;
- the schedule-aware curve (:class:`densetrain.law.Curve`) of every source and of all of them, on the
  validations of every run past warmup;
- the downstream two-step's step 2 (accuracy as a sigmoid of the val loss) for every task headline the points
  recorded (``eval.final_tasks`` in the ladder's config), from 4 points on;
- the trajectory law (:mod:`densetrain.law.trajectory`: ``E + ((A/N)^(alpha/beta) + B/S1)^beta - C D``) on
  every run's validations and binned train losses (:mod:`densetrain.tools.ladder.trajectories`), its bootstrap
  over runs and its own verdict (:func:`densetrain.law.judge.judge_trajectory`), under ``trajectory``: what
  predicts a new run's final loss from its N and its lr schedule (``ladder_check``);
- the verdict (:func:`densetrain.law.judge.judge_law`): ``degenerate`` (true / false), ``reasons`` and ``next``
  (what to run next); and ``cross_check``: approach 3 against the power law in compute through each budget's
  best point (:func:`densetrain.law.judge.cross_check`).

Points whose final validation loss is null (a diverged run) are left out, named in ``skipped_points``.
Seed replicas of a point (the protocol's largest rung, :mod:`densetrain.tools.ladder.protocol`: same N and
tokens) enter the fits as one point at their mean loss, so the law is not pulled towards the rung three times;
``seed_spread`` keeps their losses, mean and standard deviation (absolute and relative to the mean).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from densetrain.errors import ConfigError
from densetrain.fileio import atomic_write_json
from densetrain.law import (
    ANNEAL_MOMENTUM,
    LEVEL,
    bootstrap_isoflop,
    bootstrap_law,
    fit_accuracy,
    fit_curve,
    fit_isoflop,
    fit_law,
    isoflop_intervals,
    law_intervals,
)
from densetrain.law.judge import FEW, cross_check, judge_law, judge_trajectory
from densetrain.law.trajectory import bootstrap_trajectory, fit_trajectory
from densetrain.tools.ladder.grid import N_KEY
from densetrain.tools.ladder.launcher import collect
from densetrain.tools.ladder.trajectories import ladder_points


def fit_records(records: list[dict], samples: int = 200, seed: int = 0, points: list[tuple] | None = None) -> dict:
    """The fits of ``records`` (:func:`densetrain.tools.ladder.launcher.point_record`) as ``fit.json``'s dict.

    Args:
        samples: bootstrap resamples, 1 to :data:`MAX_SAMPLES` (the trajectory law's: at most
            :data:`TRAJECTORY_SAMPLES`).
        points: the runs' trajectory points ``(n, s1, drop, loss, kind, run)``
            (:func:`densetrain.tools.ladder.trajectories.ladder_points`); None: no trajectory law.
    Raises:
        ConfigError: fewer than 5 finished points (approach 3 has 5 parameters); ``samples`` out of range.
    """
    if not 1 <= samples <= MAX_SAMPLES:
        raise ConfigError(f"ladder fit: --samples {samples}: expected a number of bootstrap resamples in "
                          f"[1, {MAX_SAMPLES}]")
    recs = [r for r in records if isinstance(r["val"].get("all", {}).get("loss"), (int, float))]
    skipped = [r.get("name", "?") for r in records if not isinstance(r["val"].get("all", {}).get("loss"),
                                                                      (int, float))]
    recs, spread = merge_seeds(recs)
    if len(recs) < 5:
        raise ConfigError(f"ladder fit: {len(recs)} finished points with a validation loss; expected at least 5 "
                          f"(approach 3 has 5 parameters): run more of the ladder")
    n = np.array([r[N_KEY] for r in recs], float)
    d = np.array([r["tokens"] for r in recs], float)
    loss = np.array([r["val"]["all"]["loss"] for r in recs], float)
    top = float(max(r["budget"] for r in recs))
    law = fit_law(n, d, loss)
    boot = bootstrap_law(n, d, loss, law, samples, seed)
    out: dict = {"n_key": N_KEY, "points": len(recs), "level": LEVEL, "lam": ANNEAL_MOMENTUM,
                 "budgets": sorted({r["budget"] for r in recs}), "largest_budget": top,
                 "approach3": {"law": {k: getattr(law, k) for k in ("E", "A", "B", "alpha", "beta")},
                               "intervals": law_intervals(law, boot, top),
                               "bootstrap": [[b.E, b.A, b.B, b.alpha, b.beta] for b in boot]},
                 "loss_range": [float(loss.min()), float(loss.max())], "skipped_points": skipped,
                 "seed_spread": spread}
    out.update(judge_law(law, boot, n, d, loss, [r["budget"] for r in recs], top))
    budgets = np.array([r["budget"] for r in recs])
    best_i = [int(np.flatnonzero(budgets == c)[np.argmin(loss[budgets == c])]) for c in out["budgets"]]
    best = [float(loss[i]) for i in best_i]
    # the power law in C counts each best point's 6 N D (the budgets may count exact FLOPs: protocol 'exact'),
    # as a prediction's C does (densetrain.law.judge.checked_prediction: 6 n d)
    c6 = [float(6.0 * n[i] * d[i]) for i in best_i]
    out["cross_check"] = cross_check(law, boot, c6, best, max(c6))
    groups = [np.flatnonzero(budgets == c) for c in out["budgets"]]
    try:
        iso = fit_isoflop(n, d, loss, groups)
        out["approach2"] = isoflop_intervals(iso, bootstrap_isoflop(n, d, loss, samples, seed), top)
    except ValueError as e:
        out["approach2"] = {"skipped": str(e)}
    bpb = [r["val"]["all"].get("bpb") for r in recs]
    if all(isinstance(b, float) for b in bpb):
        out["bpb_per_nat"] = float(np.median(np.array(bpb) / loss))
    heads = sorted({k for r in recs for k in r.get("downstream", {}) if k.endswith("/headline")})
    for task in heads:  # the downstream two-step's step 2, where the ladder has task scores
        pts = [(r["val"]["all"]["loss"], r["downstream"][task]) for r in recs if task in r.get("downstream", {})]
        try:
            sig = fit_accuracy(*map(np.array, zip(*pts)))
        except ValueError as e:
            out.setdefault("downstream_skipped", {})[task] = str(e)
            continue
        out.setdefault("downstream", {})[task] = {"a": sig.a, "k": sig.k, "L0": sig.L0, "b": sig.b}
    out["curves"] = {}
    keys = sorted({k for r in recs for c in r["curve"] for k in c["loss"]})
    for key in keys:
        rows = [(r[N_KEY], c["s1"], c["s2"], c["loss"][key]) for r in recs for c in r["curve"] if key in c["loss"]]
        try:
            curve = fit_curve(*map(np.array, zip(*rows)))
        except ValueError as e:
            out.setdefault("curves_skipped", {})[key] = str(e)
            continue
        out["curves"][key] = {k: getattr(curve, k) for k in ("E", "A", "alpha", "B", "beta", "C", "scale")}
    if points is not None:
        out["trajectory"] = trajectory_fit(points, min(samples, TRAJECTORY_SAMPLES), seed)
    return out


TRAJECTORY_SAMPLES = 100
"""Most bootstrap resamples of the trajectory law (each refit of ~150 points takes seconds on a busy core)."""


def trajectory_fit(points: list[tuple], samples: int, seed: int = 0) -> dict:
    """``fit.json``'s ``trajectory``: the law fitted to ``points`` ``(n, s1, s2, loss, kind, run)``, its
    bootstrap over runs, its verdict, and the ranges it was fitted on; ``{"skipped": why}`` with too few points."""
    try:
        n, s1, drop, loss = (np.array([p[i] for p in points], float) for i in range(4))
        runs = [p[5] for p in points]
        law = fit_trajectory(n, s1, drop, loss)
    except ValueError as e:
        return {"skipped": str(e)}
    # fewer than 3 sizes: degenerate whatever the resamples say (judge_trajectory), so none are drawn
    boot = bootstrap_trajectory(n, s1, drop, loss, runs, law, samples, seed) if len(np.unique(n)) >= 3 else []
    out = {"form": "E + ((A/N)^(alpha/beta) + B/S1)^beta - C*D", "law": law.as_dict(),
           "bootstrap": [[b.E, b.A, b.alpha, b.B, b.beta, b.C] for b in boot], "points": len(points),
           "val_points": sum(p[4] == "val" for p in points), "runs": len(set(runs)),
           "n_range": [float(n.min()), float(n.max())], "s1_range": [float(s1.min()), float(s1.max())]}
    out.update(judge_trajectory(law, boot, n, s1, drop, loss))
    return out


def merge_seeds(recs: list[dict]) -> tuple[list[dict], list[dict]]:
    """``recs`` with each group of seed replicas (same N and tokens) replaced by its first record carrying the
    group's mean final loss (``val.all.loss``; other sources' and bpb means too), and one row per group:
    ``{"name", "seeds", "losses", "mean", "sd", "sd_rel"}`` (sd: sample standard deviation, ddof 1)."""
    groups: dict[tuple, list[dict]] = {}
    for r in recs:
        groups.setdefault((r[N_KEY], r["tokens"]), []).append(r)
    out, spread = [], []
    for reps in groups.values():
        if len(reps) == 1:
            out.append(reps[0])
            continue
        first = min(reps, key=lambda r: r.get("seed", 0))
        merged = dict(first, val={s: dict(v) for s, v in first["val"].items()})
        for src, v in merged["val"].items():
            for k in ("loss", "bpb"):
                vals = [r["val"].get(src, {}).get(k) for r in reps]
                if all(isinstance(x, (int, float)) for x in vals):
                    v[k] = float(np.mean(vals))
        out.append(merged)
        losses = [float(r["val"]["all"]["loss"]) for r in reps]
        sd = float(np.std(losses, ddof=1))
        spread.append({"name": first.get("name", "?"), "seeds": [r.get("seed", 0) for r in reps], "losses": losses,
                       "mean": float(np.mean(losses)), "sd": sd, "sd_rel": sd / float(np.mean(losses))})
    return out, spread


def fit_ladder(ladder_dir: Path, samples: int = 200) -> dict:
    """Collect the ladder's finished points, fit them, write ``LADDER_DIR/fit.json``; return the fit."""
    fit = fit_records(collect(ladder_dir), samples, points=ladder_points(ladder_dir))
    atomic_write_json(ladder_dir / "fit.json", fit)
    return fit


MAX_SAMPLES = 10_000
"""Most bootstrap resamples of ``ladder fit`` (each a refit: 10,000 take minutes on one core)."""


def _iv(d: dict, fmt: str = ".4g") -> str:
    v, lo, hi = (float("nan") if d[k] is None else d[k] for k in ("value", "lo", "hi"))  # null: a nan read back
    return f"{v:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"


def format_fit(fit: dict) -> str:
    """The fit in a few lines (intervals at the fit's level), led by the verdict when it is degenerate."""
    a3 = fit["approach3"]["intervals"]
    lines = []
    if fit.get("degenerate"):
        lines += ["DEGENERATE FIT: its predictions are no predictions (plan, train and the report withhold them):",
                  *(f"  - {r}" for r in fit["reasons"]), "run next: " + "; ".join(fit["next"])]
    if fit.get("skipped_points"):
        lines.append(f"left out (no final validation loss: diverged?): {', '.join(fit['skipped_points'])}")
    for g in fit.get("seed_spread", []):
        lines.append(f"seeds of {g['name']}: {', '.join(f'{x:.4f}' for x in g['losses'])}: mean {g['mean']:.4f}, "
                     f"sd {g['sd']:.4f} ({g['sd_rel']:.2%}); the fit takes the mean")
    lines += [f"{fit['points']} points, budgets {', '.join(f'{c:.3g}' for c in fit['budgets'])} FLOPs; "
             f"intervals: {fit['level']:.0%} bootstrap",
             f"approach 3: L(N, D) = E + A/N^alpha + B/D^beta (N = {fit['n_key']})",
             f"  E {_iv(a3['E'])}  A {_iv(a3['A'])}  B {_iv(a3['B'])}",
             f"  alpha {_iv(a3['alpha'])}  beta {_iv(a3['beta'])}  N_opt ~ C^{_iv(a3['a'], '.3f')}",
             f"  at {fit['largest_budget']:.3g} FLOPs: N_opt {_iv(a3['n_opt'])}, D_opt {_iv(a3['d_opt'])}, "
             f"tokens per parameter {_iv(a3['tokens_per_param'], '.3g')}"]
    a2 = fit["approach2"]
    if "skipped" in a2:
        lines.append(f"approach 2: skipped ({a2['skipped']})")
    else:
        lines.append(f"approach 2: N_opt ~ C^{_iv(a2['a'], '.3f')}, D_opt ~ C^{_iv(a2['b'], '.3f')}; tokens per "
                     f"parameter at {fit['largest_budget']:.3g} FLOPs {_iv(a2['tokens_per_param'], '.3g')}")
    x = fit.get("cross_check", {})
    if "power_law" in x:
        lines.append(f"cross-check at {x['at']:.3g} FLOPs: approach 3's frontier {x['approach3']:.4f} [{x['lo']:.4f}, "
                     f"{x['hi']:.4f}], the power law in C through each budget's best point {x['power_law']:.4f}: "
                     + ("within the interval" if x["agree"] else "OUTSIDE the interval: the two laws disagree"))
        if a2.get("distinct_resamples", FEW) < FEW:
            lines.append(f"  (approach 2's intervals come from {a2['distinct_resamples']} distinct refits: too few "
                         f"sizes per budget to resample; they are no measure of its uncertainty)")
    for t, g in fit.get("downstream", {}).items():
        lines.append(f"downstream {t}: {g['a']:.3g} / (1 + exp(-{g['k']:.3g} (L - {g['L0']:.4g}))) + {g['b']:.3g}")
    tr = fit.get("trajectory", {})
    if "skipped" in tr:
        lines.append(f"trajectory law: skipped ({tr['skipped']})")
    elif tr:
        t = tr["law"]
        lines.append(f"trajectory law {tr['form']} ({tr['points']} points of {tr['runs']} runs, {tr['val_points']} "
                     f"validations): E {t['E']:.4g} A {t['A']:.4g} alpha {t['alpha']:.3f} B {t['B']:.4g} beta "
                     f"{t['beta']:.3f} C {t['C']:.4g}; residual scale {t['scale']:.2%}; "
                     f"{len(tr['bootstrap'])} bootstrap refits over runs")
        if tr["degenerate"]:
            lines += ["  DEGENERATE (its predictions are withheld):", *(f"  - {r}" for r in tr["reasons"]),
                      "  run next: " + "; ".join(tr["next"])]
    for k, c in fit.get("curves", {}).items():
        lines.append(f"curve {k}: E {c['E']:.4g} A {c['A']:.4g} alpha {c['alpha']:.3f} B {c['B']:.4g} "
                     f"beta {c['beta']:.3f} C {c['C']:.4g}; residual scale {c['scale']:.2%}")
    return "\n".join(lines)
