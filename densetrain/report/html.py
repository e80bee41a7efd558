"""``report.html``: the run as one self-contained interactive page (plotly; plotly.js is embedded, so it
opens offline and can be mailed or archived as a single file).

Plot panels (each a ``<div id="panel-NAME">`` that plotly fills in the browser; :data:`PANELS` lists
them): train loss with stage bands, validation points, the points on each side of a stage switch, the
unigram baseline and event markers; validation loss and bits per byte per source; lr; grad_norm;
tokens/s and MFU per rank; memory; downstream headline scores (bits per byte on an axis of their own);
for a run trained with ``eval.ladder``, the scaling panel (``#panel-scaling``, :mod:`densetrain.report.ladder`).
Then tables: the final validation
against the unigram baseline, the evaluations of checkpoints by ``densetrain eval`` (``RUN_DIR/evals/``;
also diamonds in the validation and downstream panels), the stage switches with the validation loss
before and after, every event, and the run's config.toml.
"""

from __future__ import annotations

import datetime
import html
from pathlib import Path

import plotly.graph_objects as go
import plotly.io as pio
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from densetrain.fileio import atomic_write_bytes
from densetrain.report.ladder import scaling_figure
from densetrain.report.run import (
    PALETTE,
    STAGE_FILLS,
    RunData,
    event_color,
    format_values,
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

PANELS = ("loss", "val", "lr", "grad_norm", "throughput", "memory", "downstream")
"""Plot panel names; panel ``NAME`` is the element ``#panel-NAME`` of the page."""

_PLOT_CONFIG = {"displaylogo": False, "responsive": True}


def write_html(data: RunData, out: Path, scaling: dict | None = None) -> Path:
    """Write the page to ``out`` and return ``out``; with ``scaling``
    (:func:`densetrain.report.ladder.ladder_series`), the panel ``#panel-scaling`` after the validation panel:
    the ladder's isoFLOP curves and frontier with this run's predicted point and outcome."""
    figs = {"loss": _loss_fig(data), "val": _val_fig(data), "lr": _line_fig(data, "lr", "lr"),
            "grad_norm": _line_fig(data, "grad_norm", "grad_norm (before clipping)"),
            "throughput": _throughput_fig(data), "memory": _memory_fig(data), "downstream": _downstream_fig(data)}
    div = {name: pio.to_html(fig, full_html=False, include_plotlyjs=False, div_id=f"panel-{name}",
                             config=_PLOT_CONFIG, default_height=f"{fig.layout.height}px", default_width="100%")
           for name, fig in {**figs, **({"scaling": scaling_figure(scaling)} if scaling else {})}.items()}
    body = [
        f"<h1>densetrain run report</h1><p class='meta'>{_meta(data)}</p>",
        _final_table(data),
        div["loss"], div["val"], div.get("scaling", ""),
        f"<div class='pair'>{div['lr']}{div['grad_norm']}</div>",
        div["throughput"],
        f"<div class='pair'>{div['memory']}{div['downstream']}</div>",
        _checkpoint_eval_table(data), _boundary_table(data), _events_table(data),
        "<h2>Config</h2>" + (f"<pre class='config'>{html.escape(data.config_text)}</pre>" if data.config_text
                             else "<p class='none'>no config.toml in this run</p>"),
    ]
    page = (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<title>densetrain report: {html.escape(str(data.run_dir))}</title><style>{_CSS}</style>"
            f"<script type='text/javascript'>{get_plotlyjs()}</script></head>\n"
            f"<body>\n" + "\n".join(body) + "\n</body></html>\n")
    atomic_write_bytes(out, page.encode("utf-8"))  # a killed report leaves the old page, never half of one
    return out


_CSS = """
body { font-family: system-ui, sans-serif; margin: 16px 24px; color: #222; }
h1 { font-size: 20px; margin: 4px 0; } h2 { font-size: 16px; margin: 22px 0 6px; }
.meta { color: #555; margin: 0 0 10px; } .none { color: #888; }
.pair { display: grid; grid-template-columns: 1fr 1fr; gap: 8px; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border-bottom: 1px solid #ddd; padding: 3px 10px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.nowrap { white-space: nowrap; }
.swatch { display: inline-block; width: 9px; height: 9px; border-radius: 2px; margin-right: 5px; }
pre.config { background: #f8f8f8; padding: 8px; font-size: 12px; max-height: 480px; overflow: auto; }
"""


def _meta(data: RunData) -> str:
    s, last = data.summary, data.train[-1]
    parts = [html.escape(str(data.run_dir))]
    if s:
        parts.append(f"{s.get('steps')} steps, {s.get('tokens', 0):,} tokens, wall {s.get('wall_s', 0):.0f} s"
                     + (f", {s['params'] / 1e6:.2f}M parameters" if "params" in s else "")
                     + (f", {s['skipped_steps']} skipped steps" if s.get("skipped_steps") else ""))
    else:
        parts.append(f"no summary.json yet: logged up to step {last['step']} (running or stopped)")
    parts.append(f"written {datetime.datetime.now().isoformat(timespec='seconds')}")
    return " · ".join(parts)


def _figure(title: str, height: int = 380, rows: int = 1, cols: int = 1, titles=None) -> go.Figure:
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=titles) if rows * cols > 1 else go.Figure()
    fig.update_layout(title={"text": title, "x": 0.01, "font": {"size": 15}}, height=height, template="plotly_white",
                      margin={"l": 60, "r": 20, "t": 60, "b": 40}, legend={"font": {"size": 11}},
                      hovermode="closest")
    fig.update_xaxes(title_text="step")
    return fig


def _bands(fig: go.Figure, data: RunData, label: bool = False, grid: bool = False) -> None:
    """Shade each stage's steps (in every subplot with ``grid``) and give every panel the same x range;
    with ``label``, name the stage at the top left of its band."""
    fig.update_xaxes(range=list(step_range(data)))
    for i, sp in enumerate(data.spans):
        # every subplot, including ones with no trace yet (plotly skips those by default)
        kw = {"row": "all", "col": "all", "exclude_empty_subplots": False} if grid else {}
        fig.add_vrect(x0=sp.first - 0.5, x1=sp.last + 0.5, fillcolor=STAGE_FILLS[i % len(STAGE_FILLS)], opacity=1,
                      layer="below", line_width=0, **kw,
                      **({"annotation_text": sp.name, "annotation_position": "top left",
                          "annotation_font": {"size": 11, "color": "#555"}} if label else {}))


def _trace(fig, pts, name, color, mode="lines", row=None, col=None, **kw) -> None:
    if not pts:
        return
    if len(pts) == 1 and mode == "lines":
        mode = "lines+markers"  # a line through one point draws nothing
    x, y = zip(*pts)
    fig.add_trace(go.Scatter(x=x, y=y, name=name, mode=mode, line={"color": color, "width": 1.5},
                             marker={"color": color, "size": 6}, **kw), row=row, col=col)


def _empty(fig: go.Figure, what: str) -> go.Figure:
    fig.add_annotation(text=f"no {what} in this run", xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False,
                       font={"size": 14, "color": "#888"})
    return fig


def _loss_fig(data: RunData) -> go.Figure:
    fig = _figure("train loss (nats/token): stage bands, validation, unigram baseline, events", height=480)
    _bands(fig, data, label=True)
    _trace(fig, points(data.train, "loss"), "train loss", PALETTE[0])
    for i, k in enumerate(keys(data.train, "train/", "/loss")):
        _trace(fig, points(data.train, k), f"train {source_name(k)}", PALETTE[(i + 2) % len(PALETTE)],
               visible="legendonly")
    _trace(fig, points(data.evals, "val/all/loss"), "val loss (all)", PALETTE[1], mode="lines+markers")
    edge = [(r["step"], r["val/all/loss"], f"{side} the switch {b.before} → {b.after} (step {b.step})")
            for b in data.boundaries for side, r in (("before", b.eval_before), ("after", b.eval_after)) if r]
    if edge:
        x, y, text = zip(*edge)
        fig.add_trace(go.Scatter(x=x, y=y, mode="markers", name="val at a stage switch", hovertext=text,
                                 marker={"symbol": "diamond-open", "size": 13, "color": "black", "line": {"width": 2}}))
    base = unigram_baselines(data.summary).get("all")
    if base is not None:
        x0, x1 = data.train[0]["step"], data.train[-1]["step"]
        fig.add_trace(go.Scatter(x=[x0, x1], y=[base, base], mode="lines", name=f"unigram entropy {base:.3f}",
                                 line={"color": "#555", "dash": "dash", "width": 1.2}))
    by_kind: dict[str, list] = {}
    for e in data.events:
        y = loss_at(data.train, e.step)
        if y is not None:
            text = (f"step {e.step} · {e.kind}" + (f" · rank {e.rank}" if e.rank is not None else "")
                    + (f" · action {e.action}" if e.action else "") + f"<br>{html.escape(e.text)}"
                    + (f"<br>{html.escape(format_values(e.values))}" if e.values else ""))
            by_kind.setdefault(e.kind, []).append((e.step, y, text))
    for kind, rows in by_kind.items():
        x, y, text = zip(*rows)
        fig.add_trace(go.Scatter(x=x, y=y, mode="markers", name=f"event: {kind}", hovertext=text, hoverinfo="text",
                                 marker={"symbol": "triangle-down", "size": 11, "color": event_color(kind),
                                         "line": {"width": 1, "color": "white"}}))
    fig.update_yaxes(title_text="nats/token")
    return fig


def _val_fig(data: RunData) -> go.Figure:
    fig = _figure("validation per source", rows=1, cols=2,
                  titles=["loss (nats/token); dotted: unigram entropy", "bits per byte"])
    _bands(fig, data, grid=True)
    base = unigram_baselines(data.summary)
    srcs = [source_name(k) for k in keys(data.evals, "val/", "/loss")]
    srcs += [s for s in (source_name(k) for k in keys(data.checkpoint_evals, "val/", "/loss")) if s not in srcs]
    for i, s in enumerate(srcs):
        color = PALETTE[i % len(PALETTE)]
        _trace(fig, points(data.evals, f"val/{s}/loss"), s, color, "lines+markers", 1, 1, legendgroup=s)
        _trace(fig, points(data.evals, f"val/{s}/bpb"), s, color, "lines+markers", 1, 2, legendgroup=s,
               showlegend=False)
        for col, metric in ((1, "loss"), (2, "bpb")):  # `densetrain eval` of a checkpoint: diamonds
            _trace(fig, points(data.checkpoint_evals, f"val/{s}/{metric}"), f"{s} (densetrain eval)", color,
                   "markers", 1, col, legendgroup=s, showlegend=col == 1, marker_symbol="diamond", marker_size=9)
        if s in base:
            x0, x1 = data.train[0]["step"], data.train[-1]["step"]
            _trace(fig, [(x0, base[s]), (x1, base[s])], f"{s} unigram", color, row=1, col=1, legendgroup=s,
                   showlegend=False, line_dash="dot", hovertemplate=f"{s} unigram entropy %{{y:.3f}}<extra></extra>")
    return fig if srcs else _empty(fig, "validation records")


def _line_fig(data: RunData, key: str, title: str) -> go.Figure:
    fig = _figure(title, height=320)
    _bands(fig, data)
    _trace(fig, points(data.train, key), key, PALETTE[0])
    fig.update_layout(showlegend=False, hovermode="x unified")
    return fig if points(data.train, key) else _empty(fig, key)


def _throughput_fig(data: RunData) -> go.Figure:
    fig = _figure("throughput per rank", rows=1, cols=2, titles=["tokens/s", "MFU (%)"])
    _bands(fig, data, grid=True)
    tps, mfu = per_rank(data, "tokens_per_sec"), per_rank(data, "mfu")
    for i, label in enumerate(sorted(set(tps) | set(mfu))):
        color = PALETTE[i % len(PALETTE)]
        _trace(fig, tps.get(label, []), label, color, row=1, col=1, legendgroup=label)
        _trace(fig, [(s, v * 100) for s, v in mfu.get(label, [])], label, color, "lines+markers", 1, 2,
               legendgroup=label, showlegend=label not in tps)
    return fig if tps or mfu else _empty(fig, "throughput records")


def _memory_fig(data: RunData) -> go.Figure:
    fig = _figure("memory (GiB)", height=340)
    _bands(fig, data)
    mem = keys(data.train + data.perf, "mem/")
    n = 0
    for k in mem:
        for label, pts in per_rank(data, k).items():
            name = k[len("mem/"):] + ("" if label == "all ranks" else f" {label}")
            _trace(fig, pts, name, PALETTE[n % len(PALETTE)], "lines+markers")
            n += 1
    return fig if mem else _empty(fig, "memory records")


def _downstream_fig(data: RunData) -> go.Figure:
    scores, bpb = headline_keys(data.evals + data.final_evals + data.checkpoint_evals)
    groups = [(ks, title) for ks, title in ((scores, "score (higher is better)"),
                                            (bpb, "bits per byte (lower is better)")) if ks]
    fig = _figure("downstream headline (star: final evaluation)", height=340, cols=max(len(groups), 1),
                  titles=[title for _, title in groups])
    _bands(fig, data, grid=len(groups) > 1)
    grid, colors = len(groups) > 1, task_colors(scores + bpb)
    for col, (heads, _) in enumerate(groups, start=1):
        at = {"row": 1, "col": col} if grid else {}
        for k in heads:
            color, task = colors[k], source_name(k)
            _trace(fig, points(data.evals, k), task, color, "lines+markers", legendgroup=task, **at)
            _trace(fig, points(data.final_evals, k), f"{task} (final)", color, "markers", legendgroup=task,
                   showlegend=not points(data.evals, k), marker_symbol="star", marker_size=14, **at)
            _trace(fig, points(data.checkpoint_evals, k), f"{task} (densetrain eval)", color, "markers",
                   legendgroup=task, marker_symbol="diamond", marker_size=11, **at)
    return fig if groups else _empty(fig, "downstream evaluations")


def _table(head: list[str], rows: list[list[str]], num: set[int] = frozenset(), nowrap: set[int] = frozenset()) -> str:
    """An HTML table of already-escaped cells; columns in ``num`` right-aligned, in ``nowrap`` unbroken."""
    th = "".join(f"<th>{h}</th>" for h in head)
    cls = {**{j: " class='nowrap'" for j in nowrap}, **{j: " class='num'" for j in num}}
    tr = "".join("<tr>" + "".join(f"<td{cls.get(j, '')}>{c}</td>" for j, c in enumerate(row)) + "</tr>"
                 for row in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{tr}</tbody></table>"


def _f(v, digits: int = 4) -> str:
    return f"{v:.{digits}f}" if isinstance(v, (int, float)) else "–"


def _final_table(data: RunData) -> str:
    val = data.summary.get("val", {})
    if not val:
        return "<h2>Final validation</h2><p class='none'>no validation table in summary.json (run not finished)</p>"
    rows = [[html.escape(s), _f(v.get("loss")), _f(v.get("bpb")), _f(v.get("unigram_entropy")),
             _f(v["loss"] - v["unigram_entropy"]) if "loss" in v and "unigram_entropy" in v else "–"]
            for s, v in val.items()]
    out = "<h2>Final validation</h2>" + _table(["source", "loss (nats/token)", "bits per byte",
                                                 "unigram entropy", "loss − unigram"], rows, {1, 2, 3, 4})
    ds = {k: v for k, v in data.summary.get("downstream", {}).items() if k.endswith("/headline")}
    if ds:
        out += "<p>downstream (headline): " + ", ".join(f"{html.escape(k.split('/')[0])} {_f(v, 3)}"
                                                         for k, v in ds.items()) + "</p>"
    return out


def _checkpoint_eval_table(data: RunData) -> str:
    out = "<h2>Evaluations of checkpoints (<code>densetrain eval</code>, RUN_DIR/evals/)</h2>"
    if not data.checkpoint_evals:
        return out + "<p class='none'>none: <code>densetrain eval RUN_DIR</code> evaluates the newest checkpoint</p>"
    tasks = keys(data.checkpoint_evals, "eval/", "/headline")
    rows = [[str(r["step"]), html.escape(str(r.get("stage") or "")), _f(r.get("val/all/loss")),
             _f(r.get("val/all/bpb")), *(_f(r.get(k), 3) for k in tasks), html.escape(r["file"])]
            for r in data.checkpoint_evals]
    head = ["step", "stage", "val loss (all)", "bits per byte (all)", *(html.escape(source_name(k)) for k in tasks),
            "file"]
    return out + _table(head, rows, set(range(2, 4 + len(tasks))) | {0})


def _boundary_table(data: RunData) -> str:
    out = "<h2>Stage switches</h2>"
    if not data.boundaries:
        return out + "<p class='none'>one stage only</p>"
    rows = []
    for b in data.boundaries:
        def cell(r):
            return f"{_f(r['val/all/loss'])} (step {r['step']})" if r else "no evaluation in the stage"
        change = (_f(b.eval_after["val/all/loss"] - b.eval_before["val/all/loss"])
                  if b.eval_before and b.eval_after else "–")
        rows.append([str(b.step), html.escape(f"{b.before} → {b.after}"), cell(b.eval_before), cell(b.eval_after),
                     change])
    return out + _table(["step", "switch", "val loss (all) before", "after", "change"], rows, {0, 4}, {1, 2, 3})


def _events_table(data: RunData) -> str:
    out = f"<h2>Events ({len(data.events)})</h2>"
    if not data.events:
        return out + "<p class='none'>no events</p>"
    rows = [[str(e.step), f"<span class='swatch' style='background:{event_color(e.kind)}'></span>{html.escape(e.kind)}",
             "" if e.rank is None else str(e.rank), html.escape(e.action or ""), html.escape(e.text),
             html.escape(format_values(e.values))] for e in data.events]
    return out + _table(["step", "kind", "rank", "action", "text", "values"], rows, {0}, {1, 3})
