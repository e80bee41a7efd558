"""The scaling panel of a ladder: ``LADDER_DIR/ladder.png`` and ``ladder.html`` (``densetrain ladder report``),
and the same panel in a run's report when the run was trained with ``eval.ladder`` (:func:`ladder_series`,
:func:`draw_axes` and :func:`scaling_figure`, called by :mod:`.png` and :mod:`.html`).

Two plots from ``ladder.jsonl`` and ``fit.json`` (read here, no training imports):

- **isoFLOP curves**: the final validation loss of every point against N, one colour per budget, with the
  fitted law (approach 3) along each budget's ``D = C / (6 N)``;
- **frontier**: the compute-optimal loss ``L(N_opt(C), D_opt(C))`` from the ladder's smallest budget to 1000x
  its largest, with the bootstrap band, each budget's best point, the power law in compute through them (the
  cross-check), and (``run``) a run's predicted point with its interval and its outcome (``summary.json``'s
  ``prediction`` of a run trained with ``eval.ladder``).

A degenerate fit (``fit.json``'s ``degenerate``, :mod:`densetrain.law.judge`) is drawn under the title
"DEGENERATE FIT: no prediction" with its reasons and what to run next, and no run's predicted point is drawn
(a withheld prediction, or any prediction of a degenerate fit): only the run's outcome. The verdict line also says
the trajectory law's verdict (``fit.json``'s ``trajectory``, :func:`densetrain.law.judge.judge_trajectory`) where
the fit has one.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
from matplotlib.figure import Figure
from plotly.subplots import make_subplots

from densetrain.errors import ConfigError
from densetrain.fileio import atomic_write_bytes
from densetrain.law import LEVEL, Law
from densetrain.law.files import POINTS, read_fit, read_points, read_summary
from densetrain.report.run import PALETTE


def ladder_series(ladder_dir: Path, prediction: dict | None = None) -> dict:
    """What the panel draws: the ladder's points and fitted law (``ladder.jsonl``, ``fit.json``) and
    ``prediction`` (``summary.json``'s ``prediction`` of a run, or its ``prediction`` event's values: ``flops``,
    ``loss``, ``loss_lo``, ``loss_hi``, and ``actual_loss`` once the run ended).

    Raises:
        FileNotFoundError: no ``ladder.jsonl`` or ``fit.json`` in ``ladder_dir``; DataError: a bad value in them
        (densetrain.law.files: one line naming file, line and key).
    """
    recs = list(read_points(ladder_dir / POINTS).values())
    fit = read_fit(ladder_dir)
    law = Law(**fit["approach3"]["law"])
    boot = [Law(*b) for b in fit["approach3"]["bootstrap"]]
    key = fit["n_key"]
    iso = []
    for c in fit["budgets"]:
        pts = sorted((r[key], r["val"]["all"]["loss"]) for r in recs
                     if r["budget"] == c and r["val"]["all"]["loss"] is not None)
        if not pts:
            continue
        n = np.geomspace(min(p[0] for p in pts) / 2, max(p[0] for p in pts) * 2, 60)
        iso.append({"budget": c, "points": pts, "n": n, "law": law.loss(n, c / (6 * n))})
    cs = np.geomspace(min(fit["budgets"]), 1000 * fit["largest_budget"], 80)
    front = law.loss(*law.optimal(cs))
    q = (1 - fit.get("level", LEVEL)) / 2
    band = np.quantile([b.loss(*b.optimal(cs)) for b in boot], [q, 1 - q], axis=0) if boot else None
    best = [(c["budget"], min(p[1] for p in c["points"])) for c in iso]
    x = fit.get("cross_check") or {}
    power = x["k"] * cs ** x["gamma"] if "k" in x else None
    degenerate = fit.get("degenerate") and {"reasons": fit.get("reasons", []), "next": fit.get("next", [])}
    if prediction and (degenerate or prediction.get("withheld")):  # no predicted point: only the outcome
        prediction = {k: prediction.get(k) for k in ("flops", "actual_loss", "withheld")}
    tr = fit.get("trajectory") or {}
    return {"iso": iso, "cs": cs, "front": front, "band": band, "best": best, "pred": prediction, "key": key,
            "ladder_dir": ladder_dir, "power": power, "degenerate": degenerate or None,
            "trajectory": ({"degenerate": tr.get("degenerate", False), "reasons": tr.get("reasons", [])}
                           if "law" in tr else None)}


def verdict_text(s: dict) -> str:
    """The panel's verdict line: "DEGENERATE FIT: no prediction (reasons); run next: ..." or '', then the
    trajectory law's: "trajectory law: DEGENERATE (reasons)" or "trajectory law: not degenerate" where there is one."""
    d, t = s.get("degenerate"), s.get("trajectory")
    out = f"DEGENERATE FIT: no prediction ({'; '.join(d['reasons'])}); run next: {'; '.join(d['next'])}" if d else ""
    if t:
        out += ("; " if out else "") + (f"trajectory law: DEGENERATE ({'; '.join(t['reasons'])})" if t["degenerate"]
                                        else "trajectory law: not degenerate")
    return out


def _has_predicted(p: dict | None) -> bool:
    return bool(p) and p.get("loss") is not None and p.get("loss_lo") is not None


def draw_axes(ax1, ax2, s: dict) -> None:
    """Draw :func:`ladder_series`'s ``s``: the isoFLOP curves into matplotlib axes ``ax1``, the frontier into
    ``ax2``."""
    for i, c in enumerate(s["iso"]):
        color = PALETTE[i % len(PALETTE)]
        ax1.plot(c["n"], c["law"], color=color, lw=1)
        ax1.plot(*zip(*c["points"]), "o", color=color, label=f"{c['budget']:.3g} FLOPs")
    ax1.set(xscale="log", xlabel=f"N ({s['key']})", ylabel="final val loss", title="isoFLOP curves (approach 3 fit)")
    ax1.legend(fontsize=8)
    ax2.plot(s["cs"], s["front"], color="black", lw=1.2, label="L(N_opt(C), D_opt(C))")
    if s["band"] is not None:
        ax2.fill_between(s["cs"], s["band"][0], s["band"][1], color="grey", alpha=0.3, label="bootstrap band")
    ax2.plot(*zip(*s["best"]), "o", color=PALETTE[0], label="best point per budget")
    if s.get("power") is not None:
        ax2.plot(s["cs"], s["power"], "--", color=PALETTE[3], lw=1, label="power law in C (cross-check)")
    p = s["pred"]
    if _has_predicted(p):
        ax2.errorbar([p["flops"]], [p["loss"]], yerr=[[p["loss"] - p["loss_lo"]], [p["loss_hi"] - p["loss"]]],
                     fmt="s", color=PALETTE[1], label="run: predicted")
    if p and p.get("actual_loss") is not None and p.get("flops") is not None:
        ax2.plot([p["flops"]], [p["actual_loss"]], "*", ms=12, color=PALETTE[2], label="run: outcome")
    title = "compute-optimal frontier"
    if s.get("degenerate"):
        title = "DEGENERATE FIT: no prediction"
        d = s["degenerate"]
        ax2.text(0.02, 0.02, "\n".join(d["reasons"] + ["run next: " + "; ".join(d["next"])]), transform=ax2.transAxes,
                 fontsize=7, color="red", va="bottom", wrap=True)
    ax2.set(xscale="log", xlabel="compute C = 6 N D (FLOPs)", ylabel="val loss", title=title)
    ax2.legend(fontsize=8)


def scaling_figure(s: dict) -> go.Figure:
    """:func:`ladder_series`'s ``s`` as one plotly figure of two plots (isoFLOP curves, frontier)."""
    right = "DEGENERATE FIT: no prediction" if s.get("degenerate") else "compute-optimal frontier"
    fig = make_subplots(rows=1, cols=2, subplot_titles=("isoFLOP curves (approach 3 fit)", right))
    for i, c in enumerate(s["iso"]):
        color = PALETTE[i % len(PALETTE)]
        fig.add_trace(go.Scatter(x=c["n"], y=c["law"], mode="lines", line={"color": color, "width": 1},
                                 showlegend=False), 1, 1)
        x, y = zip(*c["points"])
        fig.add_trace(go.Scatter(x=x, y=y, mode="markers", marker={"color": color}, name=f"{c['budget']:.3g} FLOPs"),
                      1, 1)
    if s["band"] is not None:
        fig.add_trace(go.Scatter(x=np.r_[s["cs"], s["cs"][::-1]], y=np.r_[s["band"][1], s["band"][0][::-1]],
                                 fill="toself", fillcolor="rgba(128,128,128,0.3)", line={"width": 0},
                                 name="bootstrap band"), 1, 2)
    fig.add_trace(go.Scatter(x=s["cs"], y=s["front"], mode="lines", line={"color": "black"}, name="frontier"), 1, 2)
    fig.add_trace(go.Scatter(x=[b[0] for b in s["best"]], y=[b[1] for b in s["best"]], mode="markers",
                             name="best point per budget"), 1, 2)
    if s.get("power") is not None:
        fig.add_trace(go.Scatter(x=s["cs"], y=s["power"], mode="lines", line={"dash": "dash", "width": 1},
                                 name="power law in C (cross-check)"), 1, 2)
    p = s["pred"]
    if _has_predicted(p):
        fig.add_trace(go.Scatter(x=[p["flops"]], y=[p["loss"]], mode="markers", marker={"symbol": "square"},
                                 error_y={"type": "data", "symmetric": False, "array": [p["loss_hi"] - p["loss"]],
                                          "arrayminus": [p["loss"] - p["loss_lo"]]}, name="run: predicted"), 1, 2)
    if p and p.get("actual_loss") is not None and p.get("flops") is not None:
        fig.add_trace(go.Scatter(x=[p["flops"]], y=[p["actual_loss"]], mode="markers",
                                 marker={"symbol": "star", "size": 12}, name="run: outcome"), 1, 2)
    fig.update_xaxes(type="log")
    verdict = verdict_text(s)
    fig.update_layout(height=480, template="plotly_white", title=f"scaling ladder {s['ladder_dir']}")
    if verdict:  # the reasons under the plots, where the reader looks for the prediction
        fig.add_annotation(text=verdict, xref="paper", yref="paper", x=0, y=-0.18, showarrow=False,
                           font={"color": "red", "size": 12}, align="left")
        fig.update_layout(margin={"b": 110})
    return fig


def write_ladder_report(ladder_dir: Path, run: Path | None = None) -> list[Path]:
    """Draw the panel into ``LADDER_DIR/ladder.png`` and ``ladder.html`` (plotly.js embedded: opens offline).

    Raises:
        FileNotFoundError: no ``ladder.jsonl`` or ``fit.json`` (run ``densetrain ladder fit`` first).
        ConfigError: ``run`` has no summary.json, or was not trained with this ladder (no ``prediction``).
        DataError: a bad value in the ladder's files or the run's summary.json (one line naming file and key).
    """
    pred = None
    if run is not None:
        if not (run / "summary.json").exists():
            raise ConfigError(f"--run {run}: no summary.json there; expected a finished run trained with "
                              f"--eval.ladder={ladder_dir}")
        pred = read_summary(run / "summary.json").get("prediction")
        if not pred or Path(str(pred.get("ladder", ""))).resolve() != ladder_dir.resolve():
            used = f"with the ladder {pred.get('ladder')}" if pred else "without eval.ladder"
            raise ConfigError(f"--run {run}: that run was trained {used} (its summary.json has no prediction of "
                              f"{ladder_dir}); expected a run trained with --eval.ladder={ladder_dir}")
    s = ladder_series(ladder_dir, pred)
    fig = Figure(figsize=(13, 5))
    draw_axes(*fig.subplots(1, 2), s)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png")
    atomic_write_bytes(ladder_dir / "ladder.png", buf.getvalue())
    atomic_write_bytes(ladder_dir / "ladder.html",
                       scaling_figure(s).to_html(include_plotlyjs=True, full_html=True).encode("utf-8"))
    return [ladder_dir / "ladder.png", ladder_dir / "ladder.html"]
