"""How well does a run forecast its own final validation loss from 25% in, and does the off_curve alarm stay quiet
on healthy runs and name the bad source in the seed's 7.1 case? (issue 42, items 4 and 5; not a test: minutes of
training, numbers for RESULTS.md)

Forecast: five healthy runs of different shapes and schedules (cosine and WSD, with and without a long-context
stage over the last 20%, two widths) on the FineWeb development sample (BPE 512: 4.9M tokens; a run trains on at
most 3.7M of them, so nothing repeats). Alarm: those five plus two runs over three sources (``web``: FineWeb;
``code_a``, ``code_b``: Python standard library packages, under ``OUT/mix/corpus`` as links), a clean one and the
7.1 case (``code_b``'s windows duplicated from the middle of the run, the ``duplicate_data`` fault).

Each run's validations are replayed through the training watcher (``train/watch/curve.py``'s ``OffCurve``, the
rule a run applies as it trains) so the table always shows the current rule, even for runs trained before it:
the first forecast past :data:`densetrain.law.forecast.FORECAST_FROM` of the run against the final validation
loss, the one past 50%, and the ``off_curve`` events. Prints a table and the lines ``forecast_check: largest
|error| of the 25% forecast X% over 5 runs`` and ``off_curve: ...``.

    python benchmarks/forecast_check.py --fineweb /work/shared/data/fineweb_sample --out runs/forecast_check

With ``--h2 DIR --ladder LADDER_DIR`` (issue 42, session 16): no training; the finished runs of the held-out set
H2 (``/work/data/h2/run_h2.py``: five shapes at 12x the ladder's largest budget, and two more seeds of one for
the alarm; ``--names`` for other run folders) replayed with the ladder's curve as the forecast's prior (the
watcher's rule, its sds from the fit's bootstrap: :func:`densetrain.law.forecast.ladder_spread`), with session
15's fixed sds, and without a ladder; the same table and lines, one line per variant::

    python benchmarks/forecast_check.py --h2 /work/data/h2 --ladder /work/data/ladder_run/check/ladder
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sysconfig
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from ladder_check import cpu_name, fineweb_config  # this folder's ladder benchmark: the same small recipe

from densetrain.config import load_config, save_config
from densetrain.data.prepare import prepare
from densetrain.law.forecast import ladder_prior
from densetrain.metrics import read_metrics
from densetrain.schedule import resolve_stages
from densetrain.tools.plan import model_counts
from densetrain.train import train
from densetrain.train.watch.curve import OffCurve
from densetrain.train.watchers import Verdict

LONG = {"name": "long_context", "start": 0.8, "seq_len": 256, "rope_theta": 100000.0}
MAIN = {"name": "main", "start": 0.0, "mix": {"web": 1.0}}
RUNS = {  # name: overrides of the recipe (fineweb_config)
    "cosine": [("schedule.kind", "cosine")],
    "wsd": [("schedule.kind", "wsd")],
    "cosine+long": [("schedule.kind", "cosine"), ("stages", [MAIN, LONG])],
    "wsd+long": [("schedule.kind", "wsd"), ("stages", [MAIN, LONG])],
    "wsd d96": [("schedule.kind", "wsd"), ("model.d_model", 96), ("model.d_ff", 256), ("model.n_heads", 6),
                ("model.n_kv_heads", 3)],
}
PY = ["asyncio", "email", "unittest", "multiprocessing"], ["idlelib", "tkinter", "lib2to3", "xml"]
SOURCES = [{"name": "web", "kind": "web", "paths": ["web/*.parquet"], "format": "parquet", "filters": ["none"]},
           {"name": "code_a", "kind": "code", "paths": [f"py/{p}" for p in PY[0]], "format": "text"},
           {"name": "code_b", "kind": "code", "paths": [f"py/{p}" for p in PY[1]], "format": "text"}]
MIX = {"name": "main", "start": 0.0, "mix": {"web": 0.4, "code_a": 0.25, "code_b": 0.35}}  # no source repeats
MIXED = {"mix clean": [], "mix 7.1": [{"kind": "duplicate_data", "step": 0.5, "source": "code_b"}]}


class _Log:
    """The replayed watcher's log: its events and forecast metrics, kept."""

    def __init__(self):
        self.events, self.metrics = [], []

    def event(self, step, text, kind="note", action=None, values=None, **_):
        self.events.append({"step": step, "text": text, "kind": kind, "values": values or {}})

    def log(self, step, metrics, kind="train"):
        self.metrics.append({"step": step, "kind": kind, **metrics})


def replay(cfg, run: Path, prior: Callable | None = None) -> dict:
    """The watcher of a run (module docstring) fed the run's recorded validations, each source weighted alike
    (the metrics keep no token counts; equal batches per source): its first forecast, the first past 50% of the
    run, the final loss, the off_curve events, the prior it used. ``prior(watcher)``: another prior than the
    watcher's own (a variant compared)."""
    w = OffCurve(cfg, 0)
    state = SimpleNamespace(step=0)
    model = SimpleNamespace(num_params=lambda: model_counts(cfg.model)["params"])  # the count plan uses
    r = SimpleNamespace(stages=resolve_stages(cfg), state=state, log=_Log(), last_val=None, model=model)
    w.before_step(r)
    if prior is not None:
        w.prior = prior(w)
    for rec in read_metrics(run):
        if rec.get("kind") != "eval" or rec["step"] >= cfg.train.steps:
            continue
        r.last_val = {k.split("/")[1]: {"loss": v, "tokens": 1} for k, v in rec.items()
                      if k.startswith("val/") and k.endswith("/loss") and k != "val/all/loss"}
        state.step = rec["step"] + 1  # the loop validates after the watchers: judged at the next step
        w.after_step(r, None, Verdict.APPLY)
    final = json.loads((run / "summary.json").read_text())["val"]["all"]["loss"]
    fc = [m for m in r.log.metrics if m["kind"] == "forecast"]
    half = next((m for m in fc if m["step"] > 0.5 * cfg.train.steps), None)
    return {"first": w.first, "half": half and half["forecast/loss"], "final": final,
            "alarms": [e for e in r.log.events if e["kind"] == "off_curve"], "prior": w.prior,
            "notes": [e["text"] for e in r.log.events if e["kind"] == "forecast" and e["step"] == 0]}


def mix_config(fineweb: Path, out: Path, vocab: int):
    """Three sources (module docstring) under ``out/corpus`` (links to the FineWeb folder and the stdlib)."""
    corpus = out / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for name, target in (("web", fineweb.resolve()), ("py", Path(sysconfig.get_paths()["stdlib"]))):
        if not (corpus / name).exists():
            os.symlink(target, corpus / name)
    save_config(fineweb_config(corpus, out, vocab), out / "recipe.toml")
    return load_config(path=out / "recipe.toml", overrides=[("schedule.kind", "wsd"), ("stages", [MIX]),
                                                             ("data.sources", SOURCES)])


def run_all(base_path: Path, out: Path, runs: dict, steps: int, every: int) -> list:
    rows = []
    for name, over in runs.items():
        cfg = load_config(path=base_path, overrides=[
            *over, ("train.steps", steps), ("eval.every", every), ("checkpoint.every", 10 * steps),
            ("train.run_dir", str(out / name.replace(" ", "_").replace("+", "_").replace(".", "")))])
        run = Path(cfg.train.run_dir)
        if not (run / "summary.json").exists():
            train(cfg)
        rows.append((name, cfg, replay(cfg, run)))
    return rows


H2_SHAPES = ["wsd_d112_s0", "cos_d80_s0", "wsdlong_d96_s0", "coslong_d128_s0", "wsd_d64_s0"]
"""The five forecast shapes of the pre-registered held-out set H2 (/work/data/h2/run_h2.py); its other runs
(wsd_d112 at seeds 1 and 2) count for the alarm."""
H2_MORE = ["wsd_d112_s1", "wsd_d112_s2"]


def fixed_prior(w: OffCurve):
    """The ladder's prior with session 15's fixed sds (beta 0.05, E 2%, C half): the variant compared."""
    return ladder_prior(w.prior_curve, w.n, w.s1[-1], w.s2[-1], w.d[-1])


def error(r: dict) -> float | None:
    return r["first"]["predicted"] / r["final"] - 1 if r["first"] else None


def h2_check(h2: Path, ladder: Path, shapes: list[str] = H2_SHAPES, more: list[str] = H2_MORE) -> None:
    """The finished runs ``shapes`` (forecast and alarm) and ``more`` (alarm) under ``h2`` replayed (``replay``)
    with the ladder's prior (the watcher's rule: sds from the fit's bootstrap), with fixed sds and without a
    ladder; the table of the first, the comparison, the summary lines."""
    variants = {"ladder prior": (str(ladder), None), "fixed sds": (str(ladder), fixed_prior),
                "no ladder": ("", None)}
    rows, missing = [], []
    for name in shapes + more:
        run = h2 / name
        if not (run / "summary.json").exists():
            missing.append(name)
            continue
        out = {}
        for v, (lad, pri) in variants.items():
            cfg = load_config(path=run / "config.toml", overrides=[("eval.ladder", lad)])
            out[v] = replay(cfg, run, pri)
        rows.append((name, cfg, out))
    print(f"forecast_check --h2 {h2} --ladder {ladder}: {cpu_name()} ({platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}); not finished: {missing or 'none'}")
    for _, _, out in rows[:1]:
        print("\n".join(out["ladder prior"]["notes"]))
    print("| run | steps | at step | forecast | interval | final | error | inside | error from 50% | off_curve |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    for name, cfg, out in rows:
        r = out["ladder prior"]
        f, final = r["first"], r["final"]
        alarms = "; ".join(f"step {e['step']}: {e['values'].get('sources') or e['values'].get('keys')}"
                           for e in r["alarms"]) or "0"
        if f is None:
            print(f"| {name} | {cfg.train.steps} | no forecast | | | {final:.4f} | | | | {alarms} |")
            continue
        lo, hi = f["interval"]
        half = f"{r['half'] / final - 1:+.2%}" if r["half"] else "-"
        print(f"| {name} | {cfg.train.steps} | {f['at_step']} | {f['predicted']:.4f} | [{lo:.4f}, {hi:.4f}] | "
              f"{final:.4f} | {error(r):+.2%} | {'yes' if lo <= final <= hi else 'no'} | {half} | {alarms} |")
    print("\n| run | prior (ladder's, bootstrap sds): beta, E, C | " + " | ".join(f"error, {v}" for v in variants)
          + " |\n|---|---|" + "---|" * len(variants))
    for name, _, out in rows:
        p = out["ladder prior"]["prior"]
        errs = " | ".join(f"{error(out[v]):+.2%}" if out[v]["first"] else "-" for v in variants)
        print(f"| {name} | {p.beta:.3f}+-{p.beta_sd:.3f}, {p.e:.3f}+-{p.e_sd:.3f}, {p.c:.3f}+-{p.c_sd:.3f} | "
              f"{errs} |")
    for v in variants:
        errs = [abs(error(out[v])) for n, _, out in rows if n in shapes and out[v]["first"]]
        worst = max(errs, default=float("nan"))
        alarms = sum(len(out[v]["alarms"]) for _, _, out in rows)
        tag = "" if v == "ladder prior" else f" ({v})"
        print(f"forecast_check{tag}: largest |error| of the 25% forecast {worst:.2%} over {len(errs)} runs "
              f"(target 0.5%)")
        print(f"off_curve{tag}: {alarms} alarms on {len(rows)} healthy runs (target 0)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fineweb", help="folder of FineWeb Parquet files (the development table, no ladder)")
    ap.add_argument("--out", help="working folder (shards, runs) of --fineweb")
    ap.add_argument("--h2", help="instead: the folder of the finished H2 runs, replayed with --ladder's prior")
    ap.add_argument("--ladder", help="with --h2: the ladder's folder (its fit.json)")
    ap.add_argument("--names", help="with --h2: other run folders under it (comma-separated; default: H2's 5 "
                    "shapes, and its 2 more seeds for the alarm)")
    ap.add_argument("--steps", type=int, default=1500, help="steps per run (2048 tokens each)")
    ap.add_argument("--every", type=int, default=25, help="validation every this many steps")
    ap.add_argument("--vocab", type=int, default=512, help="BPE vocabulary (512: 4.9M tokens of the sample)")
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset of " + ", ".join(RUNS))
    ap.add_argument("--no-mix", action="store_true", help="skip the two three-source runs (the 7.1 case)")
    args = ap.parse_args()
    if args.h2:
        if not args.ladder:
            ap.error("--h2 needs --ladder LADDER_DIR")
        names = args.names.split(",") if args.names else None
        h2_check(Path(args.h2), Path(args.ladder), *((names, []) if names else ()))
        return
    if not (args.fineweb and args.out):
        ap.error("--fineweb and --out (or --h2 and --ladder)")
    out = Path(args.out)
    base = fineweb_config(Path(args.fineweb), out, args.vocab)
    if not (out / "shards" / "manifest.json").exists():
        prepare(base)
    save_config(base, out / "base.toml")
    rows = run_all(out / "base.toml", out, {k: RUNS[k] for k in args.runs.split(",")}, args.steps, args.every)
    mixed = []
    if not args.no_mix:
        mix = mix_config(Path(args.fineweb), out / "mix", args.vocab)
        if not (out / "mix" / "shards" / "manifest.json").exists():
            prepare(mix)
        save_config(mix, out / "mix" / "base.toml")
        faults = {k: [{**f, "step": int(f["step"] * args.steps)} for f in v] for k, v in MIXED.items()}
        mixed = run_all(out / "mix" / "base.toml", out / "mix", {k: [("faults", v)] for k, v in faults.items()},
                        args.steps, args.every)
    print(f"forecast_check: {args.steps} steps per run, validation every {args.every}; {cpu_name()} "
          f"({platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f})")
    print("| run | at step | forecast | interval | final | error | inside | error from 50% | off_curve |\n"
          "|---|---|---|---|---|---|---|---|---|")
    worst, healthy_alarms = 0.0, 0
    for name, cfg, r in rows + mixed:
        f, final = r["first"], r["final"]
        alarms = "; ".join(f"step {e['step']}: {e['values'].get('sources') or e['values'].get('keys')}"
                           for e in r["alarms"]) or "0"
        healthy_alarms += len(r["alarms"]) if "7.1" not in name else 0
        if f is None:
            print(f"| {name} | no forecast | | | {final:.4f} | | | | {alarms} |")
            continue
        lo, hi = f["interval"]
        err = f["predicted"] / final - 1
        if (name, cfg, r) in rows:
            worst = max(worst, abs(err))
        half = f"{r['half'] / final - 1:+.2%}" if r["half"] else "-"
        print(f"| {name} | {f['at_step']} | {f['predicted']:.4f} | [{lo:.4f}, {hi:.4f}] | {final:.4f} | {err:+.2%} | "
              f"{'yes' if lo <= final <= hi else 'no'} | {half} | {alarms} |")
    print(f"forecast_check: largest |error| of the 25% forecast {worst:.2%} over {len(rows)} runs (target 0.5%)")
    if mixed:
        bad = mixed[-1][2]["alarms"]
        last = (args.steps - 1) // args.every * args.every
        caught = ", ".join(f"{e['values'].get('sources') or e['values'].get('keys')} at step {e['step']}"
                           for e in bad) or "nothing"
        print(f"off_curve: {healthy_alarms} alarms on {len(rows) + len(mixed) - 1} healthy runs; the 7.1 case "
              f"(code_b duplicated from step {args.steps // 2}): {caught} (last evaluation before the end: {last})")


if __name__ == "__main__":
    main()
