"""How well does a run forecast its own final validation loss from 25% in? (issue 42, item 4; not a test: minutes
of training, numbers for RESULTS.md)

Five healthy runs of different shapes and schedules (cosine and WSD, with and without a long-context stage at
the end, two widths) on FineWeb text that none of them repeats; each run's ``summary.json`` ``forecast`` (the
first forecast past :data:`densetrain.law.forecast.FORECAST_FROM` of the run, from the run's own validations,
``train/watch/curve.py``) against its final validation loss, and the ``off_curve`` alarms each raised (none
expected: they are healthy). Prints one table row per run and the largest |error|; target 0.5%.

    python benchmarks/forecast_check.py --fineweb /work/shared/data/fineweb_sample --out runs/forecast_check \\
        --steps 300
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from ladder_check import cpu_name, fineweb_config  # this folder's ladder benchmark: the same small recipe

from densetrain.config import load_config, save_config
from densetrain.data.prepare import prepare
from densetrain.law.forecast import FIT_FROM, FORECAST_FROM, MIN_POINTS, forecast
from densetrain.metrics import read_events, read_metrics
from densetrain.schedule import resolve_stages, warmup_steps
from densetrain.train import train
from densetrain.train.watch.curve import run_areas

LONG = {"name": "long_context", "start": 0.8, "seq_len": 256, "rope_theta": 100000.0}
RUNS = {  # name: overrides of the recipe (fineweb_config)
    "cosine": [("schedule.kind", "cosine")],
    "wsd": [("schedule.kind", "wsd")],
    "cosine+long": [("schedule.kind", "cosine"), ("stages", [{"name": "main", "start": 0.0, "mix": {"web": 1.0}},
                                                              LONG])],
    "wsd+long": [("schedule.kind", "wsd"), ("stages", [{"name": "main", "start": 0.0, "mix": {"web": 1.0}}, LONG])],
    "wsd d96": [("schedule.kind", "wsd"), ("model.d_model", 96), ("model.d_ff", 256), ("model.n_heads", 6),
                ("model.n_kv_heads", 3)],
}


def first_forecast(cfg, run: Path, start: float = FORECAST_FROM) -> dict:
    """The watcher's first forecast of ``run`` past ``start`` of it, replayed from its metrics (module docstring),
    with ``final`` and ``error``; {} when there is none."""
    s1, s2 = run_areas(cfg, resolve_stages(cfg))
    steps = cfg.train.steps
    first = max(warmup_steps(cfg.schedule, steps), FIT_FROM * steps)
    pts = [(r["step"], r["val/all/loss"]) for r in read_metrics(run)
           if r.get("kind") == "eval" and "val/all/loss" in r and first < r["step"] < steps]
    final = json.loads((run / "summary.json").read_text())["val"]["all"]["loss"]
    for k in range(MIN_POINTS, len(pts) + 1):
        if pts[k - 1][0] > start * steps:
            try:
                f = forecast(s1, s2, [p[0] for p in pts[:k]], [p[1] for p in pts[:k]])
            except ValueError:
                continue
            return {**f, "final": final, "error": f["predicted"] / final - 1}
    return {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fineweb", required=True, help="folder of FineWeb Parquet files")
    ap.add_argument("--out", required=True, help="working folder (shards, runs)")
    ap.add_argument("--steps", type=int, default=1500, help="steps per run (2048 tokens each)")
    ap.add_argument("--every", type=int, default=25, help="validation every this many steps")
    ap.add_argument("--vocab", type=int, default=512, help="BPE vocabulary (512: 4.9M tokens of the sample)")
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset of " + ", ".join(RUNS))
    args = ap.parse_args()
    out = Path(args.out)
    base = fineweb_config(Path(args.fineweb), out, args.vocab)
    if not (out / "shards" / "manifest.json").exists():
        prepare(base)
    save_config(base, out / "base.toml")
    rows = []
    for name in args.runs.split(","):
        cfg = load_config(path=out / "base.toml", overrides=[
            *RUNS[name], ("train.steps", args.steps), ("eval.every", args.every), ("checkpoint.every", 10 * args.steps),
            ("train.run_dir", str(out / name.replace(" ", "_").replace("+", "_")))])
        run = Path(cfg.train.run_dir)
        if not (run / "summary.json").exists():
            train(cfg)
        f = first_forecast(cfg, run)
        f["half"] = first_forecast(cfg, run, 0.5).get("error")
        alarms = [e for e in read_events(run) if e["kind"] == "off_curve"]
        rows.append((name, f, alarms))
    print(f"forecast_check: {args.steps} steps per run, validation every {args.every}; {cpu_name()} "
          f"({platform.machine()})")
    print(f"{'run':<12} {'at step':>8} {'forecast':>9} {'interval':>19} {'final':>8} {'error':>8} {'inside':>6} "
          f"{'off_curve':>9} {'error at 50%':>12}")
    worst = 0.0
    for name, f, alarms in rows:
        if "predicted" not in f:
            print(f"{name:<12} no forecast (fewer than 4 validations past 25%?)  off_curve {len(alarms)}")
            continue
        lo, hi = f["interval"]
        inside = lo <= f["final"] <= hi
        worst = max(worst, abs(f["error"]))
        print(f"{name:<12} {f['at_step']:>8} {f['predicted']:>9.4f} [{lo:>8.4f}, {hi:>8.4f}] {f['final']:>8.4f} "
              f"{f['error']:>+8.2%} {'yes' if inside else 'no':>6} {len(alarms):>9} "
              + (f"{f['half']:>+12.2%}" if f.get("half") is not None else f"{'-':>12}"))
    print(f"largest |error| of the 25% forecast: {worst:.2%} (target 0.5%); off_curve alarms on these healthy runs: "
          f"{sum(len(a) for _, _, a in rows)}")


if __name__ == "__main__":
    main()
