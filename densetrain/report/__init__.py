"""``densetrain report RUN_DIR``: ``report.html`` (interactive, self-contained, opens offline),
``report.png`` (the same panels, static) and a printed summary.

Reads only files of the run directory (``metrics.jsonl``, ``events.jsonl``, ``summary.json``,
``config.toml``, and ``evals/``: what ``densetrain eval`` wrote; for a run trained with ``eval.ladder``, the
ladder's ``ladder.jsonl`` and ``fit.json`` for the scaling panel), so it works on a finished, running
or killed run. :mod:`.run` reads them,
:mod:`.png` and :mod:`.html` draw the same series.
"""

from __future__ import annotations

from pathlib import Path

from densetrain.fileio import sweep_temps_of
from densetrain.report.html import PANELS, write_html
from densetrain.report.ladder import ladder_series
from densetrain.report.png import write_png
from densetrain.report.run import RunData, load_run, read_events, source_name

__all__ = ["PANELS", "RunData", "load_run", "read_events", "write_report"]


def write_report(run_dir: Path) -> str:
    """Write ``RUN_DIR/report.png`` and ``RUN_DIR/report.html``; return a short text summary.

    Raises:
        FileNotFoundError: the run directory has no training records in metrics.jsonl.
    """
    data = load_run(Path(run_dir))
    for name in ("report.png", "report.html"):  # what a killed report left (.report.html.tmpPID of a dead PID)
        sweep_temps_of(data.run_dir / name)
    scaling, note = None, None
    if data.ladder_dir is not None:  # eval.ladder: the scaling panel, once the ladder is fitted
        try:
            scaling = ladder_series(data.ladder_dir, data.prediction)
        except (OSError, ValueError, KeyError) as e:
            note = (f"  no scaling panel: the ladder {data.ladder_dir} has no readable ladder.jsonl / fit.json "
                    f"({type(e).__name__}: {e})")
    png = write_png(data, data.run_dir / "report.png", scaling)
    page = write_html(data, data.run_dir / "report.html", scaling)
    lines = [f"report: {page} (open in a browser; works offline)", f"        {png}"]
    if note:
        lines.append(note)
    s = data.summary
    if s:
        lines.append(f"steps {s['steps']}, tokens {s['tokens']}, wall {s['wall_s']:.0f}s")
        for src, v in s.get("val", {}).items():
            lines.append(f"  {src:<12} val loss {v['loss']:.3f}   unigram entropy {v['unigram_entropy']:.3f}")
        heads = {k.split("/")[0]: v for k, v in s.get("downstream", {}).items() if k.endswith("/headline")}
        if heads:
            lines.append("  downstream (headline metric): " + ", ".join(f"{t} {v:.3f}" for t, v in heads.items()))
        p = s.get("prediction")  # eval.ladder (train/watch/curve.py): the ladder's prediction and the outcome
        if p and p.get("withheld"):  # a degenerate fit's prediction is no prediction (densetrain.law.judge)
            out = p.get("actual_loss")
            lines.append(f"  ladder: no prediction ({p['withheld']}); outcome "
                         + (f"{out:.3f}" if isinstance(out, float) else "-") + f"; off_curve: "
                         f"{', '.join(p.get('off_curve', [])) or 'none'}")
        elif p and isinstance(p.get("actual_loss"), float):
            lines.append(f"  ladder prediction: val loss {p['loss']:.3f} [{p['loss_lo']:.3f}, {p['loss_hi']:.3f}], "
                         f"outcome {p['actual_loss']:.3f}; off_curve: {', '.join(p['off_curve']) or 'none'}")
    for r in data.checkpoint_evals:
        heads = ", ".join(f"{source_name(k)} {v:.3f}" for k, v in r.items()
                          if k.startswith("eval/") and k.endswith("/headline") and isinstance(v, (int, float)))
        loss = r.get("val/all/loss")
        lines.append(f"  densetrain eval of step {r['step']}: val loss "
                     + (f"{loss:.3f}" if isinstance(loss, (int, float)) else "–") + (f"; {heads}" if heads else ""))
    for b in data.boundaries:
        if b.eval_before and b.eval_after:
            lines.append(f"  stage {b.before} -> {b.after} at step {b.step}: val loss "
                         f"{b.eval_before['val/all/loss']:.3f} (step {b.eval_before['step']}) -> "
                         f"{b.eval_after['val/all/loss']:.3f} (step {b.eval_after['step']})")
    if data.events:
        kinds: dict[str, int] = {}
        for e in data.events:
            kinds[e.kind] = kinds.get(e.kind, 0) + 1
        lines.append("  events: " + ", ".join(f"{k} {n}" for k, n in kinds.items()))
    return "\n".join(lines)
