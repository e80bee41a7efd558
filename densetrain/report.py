"""``densetrain report RUN_DIR``: a PNG of the run (loss by stage, lr, grad_norm, throughput/mfu,
validation loss per source) and a printed summary. Reads only ``metrics.jsonl`` and ``summary.json``,
so it works on a finished, running or killed run.
"""

from __future__ import annotations

import json
from pathlib import Path

from densetrain.metrics import read_metrics


def write_report(run_dir: Path) -> str:
    """Write ``RUN_DIR/report.png``; return a short text summary.

    Raises:
        FileNotFoundError: the run directory has no metrics.jsonl.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    recs = read_metrics(run_dir)
    train = [r for r in recs if r.get("kind") == "train"]
    evals = [r for r in recs if r.get("kind") == "eval"]
    if not train:
        raise FileNotFoundError(f"{run_dir / 'metrics.jsonl'}: no training records")
    steps = [r["step"] for r in train]

    # Stage spans: consecutive steps with the same stage name.
    spans, start = [], steps[0]
    for prev, cur in zip(train, train[1:] + [None]):
        if cur is None or cur["stage"] != prev["stage"]:
            spans.append((prev["stage"], start, prev["step"]))
            if cur is not None:
                start = cur["step"]
    colors = ["#e8f0fe", "#fdecea", "#e6f4ea", "#fef7e0", "#f3e8fd"]

    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    ax = axes[0][0]
    ax.plot(steps, [r["loss"] for r in train], lw=0.8, label="train loss")
    val_keys = sorted({k for r in evals for k in r if k.startswith("val/") and k.endswith("/loss")})
    for k in val_keys:
        pts = [(r["step"], r[k]) for r in evals if k in r]
        ax.plot(*zip(*pts), marker="o", ms=3, lw=1, label=k)
    ax.set_ylabel("loss (nats/token)")
    ax.legend(fontsize=7)
    panels = [
        (axes[0][1], "lr", "lr"),
        (axes[1][0], "grad_norm", "grad_norm"),
        (axes[1][1], "tokens_per_sec", "tokens_per_sec"),
    ]
    for a, key, label in panels:
        a.plot(steps, [r.get(key, float("nan")) for r in train], lw=0.8)
        a.set_ylabel(label)
    mfu = [(r["step"], r["mfu"] * 100) for r in train if "mfu" in r]
    if mfu:
        a2 = axes[1][1].twinx()
        a2.plot(*zip(*mfu), color="tab:red", lw=0.8, marker=".", ms=2)
        a2.set_ylabel("mfu (%)", color="tab:red")
    for row in axes:
        for a in row:
            for i, (name, s0, s1) in enumerate(spans):
                a.axvspan(s0 - 0.5, s1 + 0.5, color=colors[i % len(colors)], zorder=0)
            a.set_xlabel("step")
    for name, s0, s1 in spans:  # stage names written vertically at each span's start: short spans stay legible
        for a in (axes[0][0], axes[0][1]):
            a.text(s0, 0.98, f" {name}", transform=a.get_xaxis_transform(), rotation=90, va="top", ha="left",
                   fontsize=8, color="0.3")
    fig.suptitle(f"densetrain run: {run_dir}")
    fig.tight_layout()
    out = run_dir / "report.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)

    lines = [f"report: {out}"]
    summary_path = run_dir / "summary.json"
    if summary_path.exists():
        s = json.loads(summary_path.read_text())
        lines.append(f"steps {s['steps']}, tokens {s['tokens']}, wall {s['wall_s']:.0f}s")
        for src, v in s.get("val", {}).items():
            lines.append(f"  {src:<12} val loss {v['loss']:.3f}   unigram entropy {v['unigram_entropy']:.3f}")
        heads = {k.split("/")[0]: v for k, v in s.get("downstream", {}).items() if k.endswith("/headline")}
        if heads:
            lines.append("  downstream (headline metric): " + ", ".join(f"{t} {v:.3f}" for t, v in heads.items()))
    return "\n".join(lines)
