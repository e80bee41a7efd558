"""Does the ladder predict a run it never saw? (issue 34; not a test: minutes of training, numbers for RESULTS.md)

1. a ladder (``densetrain.tools.ladder``: sizes x budgets up to C, WSD runs with cooldown branches) on real text;
2. ``ladder fit``: approaches 3 and 2 with bootstrap intervals;
3. one run at ``--factor`` x C (default 8) that the fit never saw, of the compute-optimal size the fit names
   among the sizes the config scales to (the d_model nearest N_opt), with the same recipe (WSD, same decay);
4. prints the prediction (with its interval) against the outcome, the fitted numbers, the ladder's compute
   against the run's, and whether any run repeated a token (it trains more tokens than the data has);
5. with ``--compare-muon``: the same ladder with ``optim.name = "muon"`` (``--muon-lr``) on the same data, and
   Muon's compute multiplier over AdamW at each ladder budget (the compute AdamW's fitted frontier needs to reach
   Muon's compute-optimal loss, :func:`densetrain.law.compute_multiplier`, with a bootstrap interval) and the
   compute-optimal tokens per parameter of each (approaches 3 and 2). ``--no-unseen`` skips step 3.

Data: ``--config FILE`` (your recipe over your prepared shards: ``densetrain prepare --config FILE`` first), or
for development ``--fineweb DIR`` (a folder of FineWeb Parquet files, e.g. ``/work/shared/data/fineweb_sample``:
~1.6M tokens, prepared here with a BPE tokenizer of ``--vocab`` tokens; too small for a serious check).

    python benchmarks/ladder_check.py --fineweb /work/shared/data/fineweb_sample --out runs/ladder_check \\
        --sizes 32,48,64 --budgets 2e10,4e10,8e10 --factor 8
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from pathlib import Path

from densetrain.config import load_config
from densetrain.data.prepare import prepare
from densetrain.data.streams import open_streams
from densetrain.law import Law, fit_compute_power, multiplier_intervals
from densetrain.tools.ladder.fit import fit_ladder, format_fit
from densetrain.tools.ladder.grid import N_KEY, Point, build_grid, param_counts, point_config, scaled_model
from densetrain.tools.ladder.launcher import finished, run_ladder
from densetrain.train import train


def fineweb_config(src: Path, out: Path, vocab: int):
    """A small recipe over the Parquet files of ``src``: BPE ``vocab``, seq_len 128, batch 16, AdamW 3e-3."""
    return load_config(overrides=[
        ("data.demo_corpus", False), ("data.corpus_dir", str(src)), ("data.shards_dir", str(out / "shards")),
        ("data.tokenizer", "bpe"), ("data.tokenizer_vocab_size", vocab), ("data.val_fraction", 0.05),
        ("data.sources", [{"name": "web", "kind": "web", "paths": ["*.parquet"], "format": "parquet",
                           "filters": ["none"]}]),
        ("stages", [{"name": "main", "start": 0.0, "mix": {"web": 1.0}}]),
        ("model.vocab_size", vocab), ("model.d_model", 64), ("model.n_layers", 2), ("model.n_heads", 4),
        ("model.n_kv_heads", 2), ("model.d_ff", 176), ("train.seq_len", 128), ("train.batch_size", 16),
        ("train.micro_batch_size", 16), ("train.dtype", "fp32"), ("optim.peak_lr", 3e-3), ("optim.min_lr", 3e-4),
        ("schedule.warmup_steps", 10), ("schedule.decay_fraction", 0.2), ("eval.every", 25), ("eval.max_batches", 8),
        ("eval.tasks", ""), ("eval.final_tasks", ""), ("eval.position_buckets", []), ("logging.every", 100),
        ("logging.tensorboard", False), ("logging.peak_flops", 1e11), ("train.run_dir", str(out / "run")),
    ])


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", help="your recipe (TOML) over prepared shards")
    ap.add_argument("--fineweb", help="development data: a folder of FineWeb Parquet files")
    ap.add_argument("--vocab", type=int, default=2048, help="--fineweb: BPE vocabulary (default %(default)s)")
    ap.add_argument("--sizes", default="32,48,64", help="d_model values (default %(default)s)")
    ap.add_argument("--budgets", default="2e10,4e10,8e10", help="FLOP budgets up to C (default %(default)s)")
    ap.add_argument("--factor", type=float, default=8.0, help="the unseen run's budget / C (default %(default)s)")
    ap.add_argument("--out", default="runs/ladder_check", help="work directory (default %(default)s)")
    ap.add_argument("--compare-muon", action="store_true", help="also ladder Muon on the same data: its compute "
                    "multiplier over AdamW and both recipes' tokens per parameter")
    ap.add_argument("--muon-lr", type=float, default=0.04, help="--compare-muon: optim.muon_lr (default %(default)s: "
                    "the best of the README's width sweep)")
    ap.add_argument("--no-unseen", action="store_true", help="skip the unseen run at --factor x C")
    args = ap.parse_args()
    out = Path(args.out)
    if args.fineweb:
        cfg = fineweb_config(Path(args.fineweb), out, args.vocab)
        prepare(cfg)
    else:
        cfg = load_config(path=args.config)
    sizes = [int(x) for x in args.sizes.split(",")]
    budgets = [float(x) for x in args.budgets.split(",")]
    t0 = time.time()
    run_ladder(cfg, sizes, budgets, out / "ladder", progress=True)
    ladder_s = time.time() - t0
    fit = fit_ladder(out / "ladder")
    print(f"CPU: {cpu_name()}; AdamW ladder {ladder_s:.0f}s")
    print(format_fit(fit))
    if args.compare_muon:
        compare_muon(cfg, sizes, budgets, out, fit, args.muon_lr)
    if not args.no_unseen:
        unseen(cfg, sizes, budgets, out, fit, args.factor, ladder_s)


def compare_muon(cfg, sizes: list[int], budgets: list[float], out: Path, fit: dict, muon_lr: float) -> None:
    """The same ladder with Muon; Muon's compute multiplier over AdamW per budget and both tokens per parameter."""
    mcfg = copy.deepcopy(cfg)
    mcfg.optim.name, mcfg.optim.muon_lr = "muon", muon_lr
    t0 = time.time()
    run_ladder(mcfg, sizes, budgets, out / "ladder_muon", progress=True)
    muon_s = time.time() - t0
    mfit = fit_ladder(out / "ladder_muon")
    print(f"\n== Muon ladder (optim.muon_lr {muon_lr:g}, AdamW peak_lr {cfg.optim.peak_lr:g} for the rest), "
          f"{muon_s:.0f}s")
    print(format_fit(mfit))

    def laws(f):
        return Law(**f["approach3"]["law"]), [Law(*b) for b in f["approach3"]["bootstrap"]]

    # the multiplier at the ladder's budgets and a decade past its largest (extrapolated)
    at = sorted(set(budgets)) + [10 * max(budgets)]
    rows = multiplier_intervals(*laws(fit), *laws(mfit), at)
    print("Muon's compute multiplier over AdamW (the compute AdamW's frontier needs to reach Muon's compute-optimal "
          f"loss; {rows[0]['level']:.0%} bootstrap, resamples paired):")
    for r in rows:
        print(f"  at {r['budget']:.3g} FLOPs: {r['value']:.3g}x [{r['lo']:.3g}, {r['hi']:.3g}]"
              + ("  (past the ladder)" if r["budget"] > max(budgets) else ""))
    for name, f in (("AdamW", fit), ("Muon", mfit)):
        a2 = f["approach2"]
        tpp2 = ("skipped" if "skipped" in a2 else "{value:.3g} [{lo:.3g}, {hi:.3g}]".format(**a2["tokens_per_param"]))
        print(f"  {name}: tokens per parameter at {max(budgets):.3g} FLOPs: approach 3 "
              + "{value:.3g} [{lo:.3g}, {hi:.3g}]".format(**f["approach3"]["intervals"]["tokens_per_param"])
              + f", approach 2 {tpp2}")
    recs = {name: list(finished(out / d).values()) for name, d in (("AdamW", "ladder"), ("Muon", "ladder_muon"))}
    print("  best ladder loss per budget (AdamW / Muon): " + ", ".join(
        f"{c:.3g}: " + " / ".join(f"{min(r['val']['all']['loss'] for r in rs if r['budget'] == c):.4f}"
                                  for rs in recs.values()) for c in sorted(set(budgets))))
    for name, rs in recs.items():
        print(f"  {name} points: " + ", ".join(f"{r['name']} {r['val']['all']['loss']:.4f}"
                                              for r in sorted(rs, key=lambda r: r["name"])))
    (out / "compare_muon.json").write_text(json.dumps({"multiplier": rows, "muon_lr": muon_lr}, indent=1))


def unseen(cfg, sizes: list[int], budgets: list[float], out: Path, fit: dict, factor: float, ladder_s: float) -> None:
    """One run at ``factor`` x the largest budget that the fit never saw, against its prediction."""
    # the unseen run: the size nearest the fit's N_opt at factor x C, among d_model multiples of the head dim
    target = factor * max(budgets)
    n_opt = float(Law(**fit["approach3"]["law"]).optimal(target)[0])
    head = cfg.model.d_model // cfg.model.n_heads
    cands = [d for d in range(head, 8 * max(sizes) + 1, head)]
    d_model = min(cands, key=lambda d: abs(param_counts(scaled_model(cfg, d))[N_KEY] - n_opt))
    grid = build_grid(cfg, [d_model], [target])
    p = Point(name="unseen", d_model=d_model, budget=target, steps=grid.points[-1].steps, main="unseen")
    rcfg = point_config(cfg, grid, p, str(out / "unseen"))
    rcfg.schedule.warmup_steps = json.loads((out / "ladder" / "ladder.json").read_text())["warmup_steps"]
    rcfg.eval.ladder = str(out / "ladder")
    t0 = time.time()
    summary = train(rcfg, resume=True)
    run_s = time.time() - t0
    pred = json.loads((out / "unseen" / "summary.json").read_text())["prediction"]
    actual = summary["val"]["all"]["loss"]

    recs = list(finished(out / "ladder").values())
    # the ladder's cost: main runs in full, branches only past their branch point
    ladder_flops = sum(r["flops_6nd"] * (1 - r["branch_from"] / r["steps"]) for r in recs)
    train_tokens = sum(len(s) for s in open_streams(rcfg, "train").values())
    most = max([r["tokens"] for r in recs] + [pred["d"]])
    print("\n== ladder_check")
    print(f"sizes {sizes} x budgets {budgets}: {len(recs)} points in {ladder_s:.0f}s; unseen run d_model {d_model} "
          f"({pred['n']:.4g} params without embedding) at {target:.3g} FLOPs ({factor:g}x C), "
          f"{pred['d']:.4g} tokens, {run_s:.0f}s")
    err = actual / pred["loss"] - 1
    inside = pred["loss_lo"] <= actual <= pred["loss_hi"]
    print(f"prediction {pred['loss']:.4f} [{pred['loss_lo']:.4f}, {pred['loss_hi']:.4f}] vs outcome {actual:.4f}: "
          f"error {err:+.2%}, {'inside' if inside else 'OUTSIDE'} the interval; off_curve events: {pred['off_curve']}")
    # cross-check (issue 34's 1% target was missed by approach 3): a power law in C through each budget's best
    # ladder loss, which has no E, alpha or beta to pin, extrapolated to the unseen run's compute
    budgets_ = sorted({r["budget"] for r in recs})
    best = [min(r["val"]["all"]["loss"] for r in recs if r["budget"] == c) for c in budgets_]
    k, gamma = fit_compute_power(budgets_, best)
    alt = k * pred["flops"] ** gamma
    print(f"cross-check: best loss per budget ~ {k:.4g} C^{gamma:.4f} predicts {alt:.4f}: error "
          f"{actual / alt - 1:+.2%} (the unseen run is the size nearest N_opt, so near the frontier)")
    print(f"ladder compute {ladder_flops:.3g} FLOPs (6ND, branches past their start) = "
          f"{ladder_flops / pred['flops']:.2f}x the unseen run's {pred['flops']:.3g}")
    print(f"training text {train_tokens:,} tokens; the longest run trains {most:,.0f}: "
          + ("no token repeated" if most <= train_tokens else "TOKENS REPEATED (more epochs than one)"))


if __name__ == "__main__":
    main()
