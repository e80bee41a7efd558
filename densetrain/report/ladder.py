"""The scaling panel of a ladder: ``LADDER_DIR/ladder.png`` and ``ladder.html`` (``densetrain ladder report``),
and the same panel in a run's report when the run was trained with ``eval.ladder`` (:func:`ladder_series`,
:func:`draw_axes` and :func:`scaling_figure`, called by :mod:`.png` and :mod:`.html`).

Two plots from ``ladder.jsonl`` and ``fit.json`` (read here, no training imports):

- **isoFLOP curves**: the final validation loss of every point against N, one colour per budget, with the
  fitted law (approach 3) along each budget's ``D = C / (6 N)``;
- **frontier**: the compute-optimal loss ``L(N_opt(C), D_opt(C))`` from the ladder's smallest budget to 1000x
  its largest, with the bootstrap band, each budget's best point, and (``run``) a run's predicted point with
  its interval and its outcome (``summary.json``'s ``prediction`` of a run trained with ``eval.ladder``).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
from matplotlib.figure import Figure
from plotly.subplots import make_subplots

from densetrain.fileio import atomic_write_bytes, read_json, read_jsonl
from densetrain.law import LEVEL, Law
from densetrain.report.run import PALETTE


def ladder_series(ladder_dir: Path, prediction: dict | None = None) -> dict:
    """What the panel draws: the ladder's points and fitted law (``ladder.jsonl``, ``fit.json``) and
    ``prediction`` (``summary.json``'s ``prediction`` of a run, or its ``prediction`` event's values: ``flops``,
    ``loss``, ``loss_lo``, ``loss_hi``, and ``actual_loss`` once the run ended).

    Raises:
        FileNotFoundError: no ``ladder.jsonl`` or ``fit.json`` in ``ladder_dir``.
    """
    recs = read_jsonl(ladder_dir / "ladder.jsonl", strict=True)[0]  # regular files, bounded, too deep refused (fileio)
    fit = read_json(ladder_dir / "fit.json")
    law = Law(**fit["approach3"]["law"])
    boot = [Law(*b) for b in fit["approach3"]["bootstrap"]]
    key = fit["n_key"]
    iso = []
    for c in fit["budgets"]:
        pts = sorted((r[key], r["val"]["all"]["loss"]) for r in recs if r["budget"] == c)
        n = np.geomspace(min(p[0] for p in pts) / 2, max(p[0] for p in pts) * 2, 60)
        iso.append({"budget": c, "points": pts, "n": n, "law": law.loss(n, c / (6 * n))})
    cs = np.geomspace(min(fit["budgets"]), 1000 * fit["largest_budget"], 80)
    front = law.loss(*law.optimal(cs))
    q = (1 - fit.get("level", LEVEL)) / 2
    band = np.quantile([b.loss(*b.optimal(cs)) for b in boot], [q, 1 - q], axis=0) if boot else None
    best = [(c["budget"], min(p[1] for p in c["points"])) for c in iso]
    return {"iso": iso, "cs": cs, "front": front, "band": band, "best": best, "pred": prediction, "key": key,
            "ladder_dir": ladder_dir}


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
    p = s["pred"]
    if p:
        ax2.errorbar([p["flops"]], [p["loss"]], yerr=[[p["loss"] - p["loss_lo"]], [p["loss_hi"] - p["loss"]]],
                     fmt="s", color=PALETTE[1], label="run: predicted")
        if p.get("actual_loss") is not None:
            ax2.plot([p["flops"]], [p["actual_loss"]], "*", ms=12, color=PALETTE[2], label="run: outcome")
    ax2.set(xscale="log", xlabel="compute C = 6 N D (FLOPs)", ylabel="val loss", title="compute-optimal frontier")
    ax2.legend(fontsize=8)


def scaling_figure(s: dict) -> go.Figure:
    """:func:`ladder_series`'s ``s`` as one plotly figure of two plots (isoFLOP curves, frontier)."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("isoFLOP curves (approach 3 fit)", "compute-optimal frontier"))
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
    p = s["pred"]
    if p:
        fig.add_trace(go.Scatter(x=[p["flops"]], y=[p["loss"]], mode="markers", marker={"symbol": "square"},
                                 error_y={"type": "data", "symmetric": False, "array": [p["loss_hi"] - p["loss"]],
                                          "arrayminus": [p["loss"] - p["loss_lo"]]}, name="run: predicted"), 1, 2)
        if p.get("actual_loss") is not None:
            fig.add_trace(go.Scatter(x=[p["flops"]], y=[p["actual_loss"]], mode="markers",
                                     marker={"symbol": "star", "size": 12}, name="run: outcome"), 1, 2)
    fig.update_xaxes(type="log")
    fig.update_layout(height=480, template="plotly_white", title=f"scaling ladder {s['ladder_dir']}")
    return fig


def write_ladder_report(ladder_dir: Path, run: Path | None = None) -> list[Path]:
    """Draw the panel into ``LADDER_DIR/ladder.png`` and ``ladder.html`` (plotly.js embedded: opens offline).

    Raises:
        FileNotFoundError: no ``ladder.jsonl`` or ``fit.json`` (run ``densetrain ladder fit`` first).
    """
    pred = None
    if run is not None and (run / "summary.json").exists():
        pred = read_json(run / "summary.json").get("prediction")
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
