"""``report.png``: the run on one static page (matplotlib, no display needed), nine panels in a 3 x 3
grid: train loss (stage bands, validation points, the points on each side of a stage switch, the
unigram baseline, event markers), validation loss and bits per byte per source, lr, grad_norm,
tokens/s and MFU per rank, memory, downstream headline scores (bits per byte on axes of their own);
for a run trained with ``eval.ladder``, a fourth row: the scaling panel (:mod:`densetrain.report.ladder`).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from densetrain.fileio import atomic_write_bytes
from densetrain.report.ladder import draw_axes
from densetrain.report.run import (
    PALETTE,
    STAGE_FILLS,
    RunData,
    event_color,
    headline_keys,
    keys,
    loss_at,
    per_rank,
    points,
    source_name,
    step_range,
    task_colors,
    unigram_baselines,
)


def write_png(data: RunData, out: Path, scaling: dict | None = None) -> Path:
    """Draw the run into ``out`` (PNG, 110 dpi) and return ``out``; with ``scaling``
    (:func:`densetrain.report.ladder.ladder_series`), a fourth row: the ladder's isoFLOP curves and frontier
    with this run's predicted point and outcome."""
    fig = Figure(figsize=(18, 18 if scaling else 13))
    grid = fig.add_gridspec(4 if scaling else 3, 3)
    axes = np.array([[fig.add_subplot(grid[r, c]) for c in range(3)] for r in range(3)])
    if scaling:
        draw_axes(fig.add_subplot(grid[3, 0]), fig.add_subplot(grid[3, 1:]), scaling)
    loss_ax, val_ax, bpb_ax = axes[0]
    lr_ax, gn_ax, tps_ax = axes[1]
    mfu_ax, mem_ax, ds_ax = axes[2]
    base = unigram_baselines(data.summary)

    _loss(loss_ax, data, base)
    val_recs = data.evals + data.checkpoint_evals
    for ax, metric in ((val_ax, "loss"), (bpb_ax, "bpb")):
        for i, k in enumerate(keys(val_recs, "val/", f"/{metric}")):
            color = PALETTE[i % len(PALETTE)]
            _line(ax, points(data.evals, k), source_name(k), color, marker="o")
            pts = points(data.checkpoint_evals, k)  # `densetrain eval` of a checkpoint
            if pts:
                ax.plot(*zip(*pts), ls="none", marker="D", ms=6, color=color)
            if metric == "loss" and source_name(k) in base:
                ax.axhline(base[source_name(k)], color=color, ls=":", lw=0.8)
    _finish(val_ax, "validation loss (nats/token); dotted: unigram entropy", bool(keys(val_recs, "val/", "/loss")))
    _finish(bpb_ax, "validation bits per byte (diamond: densetrain eval)", bool(keys(val_recs, "val/", "/bpb")))

    _line(lr_ax, points(data.train, "lr"), None, PALETTE[0])
    _finish(lr_ax, "lr", True)
    _line(gn_ax, points(data.train, "grad_norm"), None, PALETTE[0])
    _finish(gn_ax, "grad_norm (before clipping)", True)
    for ax, key, scale, title in ((tps_ax, "tokens_per_sec", 1.0, "tokens/s"), (mfu_ax, "mfu", 100.0, "MFU (%)")):
        series = per_rank(data, key)
        for i, (label, pts) in enumerate(series.items()):
            _line(ax, [(s, v * scale) for s, v in pts], label, PALETTE[i % len(PALETTE)], marker=".")
        _finish(ax, title, bool(series))
    mem = keys(data.train + data.perf, "mem/")
    for i, k in enumerate(mem):
        for j, (label, pts) in enumerate(per_rank(data, k).items()):
            name = k[len("mem/"):] + ("" if label == "all ranks" else f" {label}")
            _line(mem_ax, pts, name, PALETTE[(i + j) % len(PALETTE)], marker=".")
    _finish(mem_ax, "memory (GiB)", bool(mem))
    scores, bpb = headline_keys(data.evals + data.final_evals + data.checkpoint_evals)
    panels = [ds_ax]
    if scores and bpb:  # bits per byte (lower better, unbounded) never share the scores' axis: split the cell
        cell = ds_ax.get_subplotspec().subgridspec(2, 1, hspace=0.7)
        ds_ax.remove()
        panels = [fig.add_subplot(cell[0]), fig.add_subplot(cell[1])]
    groups = [(ks, title) for ks, title in ((scores, "downstream score"), (bpb, "downstream bits per byte")) if ks]
    colors = task_colors(scores + bpb)
    for ax, (heads, title) in zip(panels, groups or [([], "downstream headline")]):
        for k in heads:
            color = colors[k]
            _line(ax, points(data.evals, k), source_name(k), color, marker="o")
            for recs, marker, ms in ((data.final_evals, "*", 11), (data.checkpoint_evals, "D", 7)):
                pts = points(recs, k)
                if pts:
                    ax.plot(*zip(*pts), ls="none", marker=marker, ms=ms, color=color)
        _finish(ax, f"{title} (star: final eval, diamond: densetrain eval)", bool(heads))

    for ax in [*(a for a in axes.flat if a is not ds_ax), *panels]:
        for i, sp in enumerate(data.spans):
            ax.axvspan(sp.first - 0.5, sp.last + 0.5, color=STAGE_FILLS[i % len(STAGE_FILLS)], zorder=0, lw=0)
        ax.set_xlim(*step_range(data))
        ax.set_xlabel("step")
    for sp in data.spans:  # names written vertically at each span's start, so short spans stay legible
        for ax in (loss_ax, lr_ax):
            ax.text(sp.first, 0.98, f" {sp.name}", transform=ax.get_xaxis_transform(), rotation=90, va="top",
                    ha="left", fontsize=8, color="0.3")
    fig.suptitle(f"densetrain run: {data.run_dir}")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png")
    atomic_write_bytes(out, buf.getvalue())  # a killed report leaves the old image, never half of one
    return out


def _loss(ax, data: RunData, base: dict[str, float]) -> None:
    _line(ax, points(data.train, "loss"), "train loss", PALETTE[0], lw=0.8)
    val = points(data.evals, "val/all/loss")
    if val:
        _line(ax, val, "val loss (all)", PALETTE[1], marker="o", lw=1)
    edge = [(r["step"], r["val/all/loss"]) for b in data.boundaries for r in (b.eval_before, b.eval_after) if r]
    if edge:
        ax.plot(*zip(*edge), ls="none", marker="D", ms=7, mfc="none", mec="black", mew=1.2,
                label="val at a stage switch")
    if "all" in base:
        ax.axhline(base["all"], color="0.35", ls="--", lw=1, label=f"unigram entropy {base['all']:.2f}")
    seen = set()
    for e in data.events:
        y = loss_at(data.train, e.step)
        if y is None:
            continue
        ax.plot([e.step], [y], ls="none", marker="v", ms=7, color=event_color(e.kind), zorder=5,
                label=None if e.kind in seen else f"event: {e.kind}")
        seen.add(e.kind)
    _finish(ax, "train loss (nats/token)", True)


def _line(ax, pts, label, color, marker=None, lw=1.0, ms=3) -> None:
    if pts:  # a line through one point draws nothing: mark it
        ax.plot(*zip(*pts), lw=lw, color=color, marker=marker or ("o" if len(pts) == 1 else None), ms=ms, label=label)


def _finish(ax, title: str, has_data: bool) -> None:
    ax.set_title(title, fontsize=10)
    if not has_data:
        ax.text(0.5, 0.5, "no data in this run", transform=ax.transAxes, ha="center", va="center", color="0.5")
    elif ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
