"""Does the ladder predict a run it never saw? (issues 34, 42; not a test: an hour of CPU, numbers for RESULTS.md)

1. a ladder with the protocol of ``densetrain ladder`` (:mod:`densetrain.tools.ladder.protocol`: sizes on a
   staircase around each budget's optimum, the largest rung at 3 seeds, lr x 1/width, exact FLOPs) on real text;
2. ``ladder fit``: approaches 3 and 2 with bootstrap intervals, the verdict (degenerate or not), seed spread;
3. the held-out run at ``--factor`` x the largest budget C (default 12: the ladder costs <= 0.5x it) at
   ``--heldout-seeds`` seeds (default 3), of ``--heldout-size`` (default: the size nearest the fit's N_opt among
   the multiples of the head dimension), with the same recipe (:func:`densetrain.tools.ladder.grid.point_config`:
   WSD, lr rule, warmup);
4. prints the table of points, the fit, the prediction (:func:`densetrain.law.judge.checked_prediction`, withheld
   when the fit is degenerate) against the mean outcome with the seed spread, the ladder's compute against the
   held-out run's (exact FLOPs, ``densetrain.metrics.flops_per_token``: the count plan uses; branches counted past
   their start), the tokens every run repeated per source (:func:`densetrain.tools.ladder.launcher.repeated_tokens`),
   the CPU and load, and one line::

       ladder_check: error -0.4% at 12.0x (interval [-1.2%, +0.9%], seed sd 0.3%, 0 tokens repeated)

   (error: mean outcome / prediction - 1; interval: the prediction's, relative to it; seed sd: the held-out
   outcomes' sample standard deviation over their mean; the target |error| <= max(1%, 2 x seed sd), inside);
5. ``--h2-predict JSON`` (issue 42 session 16): the pre-registered H2 runs (:data:`H2_RUNS`) predicted from the
   ladder in ``OUT/ladder`` by the trajectory law (:mod:`densetrain.law.trajectory`), nothing trained; ``--h2 DIR``:
   those predictions against the runs finished in DIR, a table and the ladder_check line of wsd_d112;
6. with ``--compare-muon``: the same ladder with ``optim.name = "muon"`` (``--muon-lr``) on the same data, and
   Muon's compute multiplier over AdamW at each ladder budget (:func:`densetrain.law.compute_multiplier`).

Data: ``--preset`` / ``--config`` (your recipe over prepared shards: ``densetrain prepare`` first), or for
development ``--fineweb DIR`` (FineWeb Parquet files, prepared here with a BPE of ``--vocab`` tokens: too small).
The run of RESULTS.md ("issue 42: the ladder protocol")::

    densetrain prepare --preset ladder-corpus --data.corpus_dir=/work/data/ladder-corpus \
        --data.shards_dir=/work/data/ladder-shards-v1024 --data.tokenizer_vocab_size=1024 --model.vocab_size=1024
    python benchmarks/ladder_check.py --preset ladder-corpus --config benchmarks/ladder_protocol.toml \
        --out /work/data/ladder_run/check
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

from densetrain.config import load_config, to_dict
from densetrain.config.schema import StageConfig
from densetrain.data.prepare import prepare
from densetrain.law import Law, multiplier_intervals
from densetrain.law.judge import checked_prediction, trajectory_prediction
from densetrain.metrics import flops_per_token
from densetrain.tools.ladder.fit import fit_ladder, fit_records, format_fit
from densetrain.tools.ladder.grid import N_KEY, Point, build_grid, param_counts, point_config, size_config
from densetrain.tools.ladder.launcher import finished, open_ladder, repeated_tokens, run_ladder
from densetrain.tools.ladder.protocol import DEFAULT_BUDGETS, DEFAULT_SIZES, PROTOCOL
from densetrain.tools.ladder.trajectories import ladder_points, schedule_end
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
    ap.add_argument("--preset", help="preset the recipe starts from (with --config: applied over it)")
    ap.add_argument("--config", help="your recipe (TOML) over prepared shards")
    ap.add_argument("--fineweb", help="development data: a folder of FineWeb Parquet files")
    ap.add_argument("--vocab", type=int, default=2048, help="--fineweb: BPE vocabulary (default %(default)s)")
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="d_model values (default %(default)s)")
    ap.add_argument("--budgets", default=",".join(f"{b:g}" for b in DEFAULT_BUDGETS),
                    help="FLOP budgets up to C (default %(default)s)")
    ap.add_argument("--factor", type=float, default=12.0, help="the held-out run's budget / C (default %(default)s)")
    ap.add_argument("--heldout-size", type=int, default=0, help="the held-out run's d_model (default: the size "
                    "nearest the fit's N_opt at factor x C)")
    ap.add_argument("--heldout-seeds", type=int, default=3, help="seeds of the held-out run (default %(default)s)")
    ap.add_argument("--out", default="runs/ladder_check", help="work directory (default %(default)s)")
    ap.add_argument("--compare-muon", action="store_true", help="also ladder Muon on the same data: its compute "
                    "multiplier over AdamW and both recipes' tokens per parameter")
    ap.add_argument("--muon-lr", type=float, default=0.04, help="--compare-muon: optim.muon_lr (default %(default)s: "
                    "the best of the README's width sweep)")
    ap.add_argument("--no-unseen", action="store_true", help="skip the held-out run")
    ap.add_argument("--h2-predict", metavar="JSON", help="with --out holding a finished ladder: fit it (into "
                    "--fit-out) and write the predictions of the pre-registered H2 runs to JSON; nothing trained")
    ap.add_argument("--fit-out", default="", help="--h2-predict: where the fit goes (default OUT/h2_fit.json)")
    ap.add_argument("--h2", metavar="DIR", help="compare --h2-predict's JSON (--predictions) with the H2 runs "
                    "finished in DIR (DIR/<name>_s<seed>/summary.json)")
    ap.add_argument("--predictions", default="benchmarks/ladder_h2_predictions.json", help="--h2: the predictions")
    args = ap.parse_args()
    out = Path(args.out)
    if args.h2_predict:
        h2_predict(out, Path(args.h2_predict), Path(args.fit_out or out / "h2_fit.json"))
        return
    if args.h2:
        h2_compare(out, Path(args.h2), Path(args.predictions))
        return
    if args.fineweb:
        cfg = fineweb_config(Path(args.fineweb), out, args.vocab)
        prepare(cfg)
    else:
        cfg = load_config(preset=args.preset, path=args.config)
    sizes = [int(x) for x in args.sizes.split(",")]
    budgets = [float(x) for x in args.budgets.split(",")]
    t0 = time.time()
    run_ladder(cfg, sizes, budgets, out / "ladder", progress=True, protocol=PROTOCOL)
    ladder_s = time.time() - t0
    fit = fit_ladder(out / "ladder")
    print(f"CPU: {cpu_name()}, {os.cpu_count()} logical CPUs; load average now {os.getloadavg()[0]:.1f}; AdamW ladder "
          f"{ladder_s:.0f}s this call")
    print(format_fit(fit))
    if args.compare_muon:
        compare_muon(cfg, sizes, budgets, out, fit, args.muon_lr)
    if not args.no_unseen:
        unseen(cfg, out, fit, args)


def ladder_flops(ladder_dir: Path) -> float:
    """The ladder's compute in exact FLOPs (``flops`` of each record: flops_per_token x tokens), main runs and seed
    replicas in full, branches only past their branch point."""
    return sum(r["flops"] * (1 - r["branch_from"] / r["steps"]) for r in finished(ladder_dir).values())


def points_table(ladder_dir: Path) -> list[str]:
    """The ladder's points as a Markdown table, with the tokens each run repeated."""
    cfg, grid = open_ladder(ladder_dir)
    rows = ["| point | d_model | N | budget (FLOPs) | steps (branch from) | tokens | final val loss | repeated |",
            "|---|---|---|---|---|---|---|---|"]
    for r in sorted(finished(ladder_dir).values(), key=lambda r: (r["budget"], r["params_no_embed"], r["seed"])):
        p = next(q for q in grid.points if q.name == r["name"])
        rep = sum(repeated_tokens(Path(ladder_dir) / "runs" / p.name,
                                  point_config(cfg, grid, p, str(Path(ladder_dir) / "runs" / p.name))).values())
        rows.append(f"| {r['name']} | {r['d_model']} | {r[N_KEY]:,} | {r['budget']:.3g} | {r['steps']}"
                    + (f" ({r['branch_from']})" if r["branch_from"] else "") + f" | {r['tokens']:,.0f} | "
                    f"{r['val']['all']['loss']:.4f} | {rep} |")
    return rows


def heldout_runs(out: Path, d_model: int, factor: float, seeds: int) -> list[tuple[Path, object, int]]:
    """``(run_dir, config, steps)`` of the held-out run at each seed: size ``d_model`` at ``factor`` x the ladder's
    largest budget, the ladder's recipe (its grid's protocol and warmup, :func:`point_config`), ``train.seed`` +
    0, 1, ...; in ``OUT/heldout/s<seed>``."""
    bcfg, grid = open_ladder(out / "ladder")
    target = factor * max(grid.budgets)
    top = next(q for q in build_grid(bcfg, [d_model], [target], grid.protocol).points if not q.seed)
    runs = []
    for seed in range(seeds):
        run_dir = out / "heldout" / f"s{seed}"
        p = Point(name=f"heldout_s{seed}", d_model=d_model, budget=target, steps=top.steps, main=f"heldout_s{seed}",
                  seed=seed)
        runs.append((run_dir, point_config(bcfg, grid, p, str(run_dir)), top.steps))
    return runs


def unseen(cfg, out: Path, fit: dict, args) -> None:
    """The held-out run at ``factor`` x the largest budget, at ``heldout_seeds`` seeds, against the prediction."""
    ladder_dir = out / "ladder"
    bcfg, grid = open_ladder(ladder_dir)
    target = args.factor * max(grid.budgets)
    d_model = args.heldout_size
    if not d_model:  # the size nearest the fit's N_opt at factor x C, among multiples of the head dimension
        n_opt = float(Law(**fit["approach3"]["law"]).optimal(target)[0])
        head = grid.protocol.head_dim or bcfg.model.d_model // bcfg.model.n_heads
        d_model = min(range(head, 8 * max(grid.sizes) + 1, head),
                      key=lambda d: abs(param_counts(size_config(bcfg, d, grid.protocol))[N_KEY] - n_opt))
    outcomes, repeats, times, tokens = [], {}, [], None
    for run_dir, rcfg, run_steps in heldout_runs(out, d_model, args.factor, args.heldout_seeds):
        steps = run_steps
        t0 = time.time()
        if (run_dir / "config.toml").exists():  # a run started earlier (or elsewhere): it must be this recipe
            was, now = to_dict(load_config(path=run_dir / "config.toml")), to_dict(rcfg)
            differ = sorted(f"{k}.{f}" for k in now for f in now[k] if k != "faults" and isinstance(now[k], dict)
                            and was.get(k, {}).get(f) != now[k][f] and f != "run_dir")
            if differ:
                raise SystemExit(f"{run_dir}: the run there has another recipe ({', '.join(differ)} differ)")
        if not (run_dir / "summary.json").exists():
            train(rcfg, resume=True)
        times.append(time.time() - t0)
        summary = json.loads((run_dir / "summary.json").read_text())
        outcomes.append(summary["val"]["all"]["loss"])
        tokens = summary["tokens"]
        repeats[run_dir.name] = repeated_tokens(run_dir, rcfg)
    n = param_counts(rcfg)[N_KEY]
    pred = checked_prediction(fit, float(n), float(tokens))
    run_flops = flops_per_token(rcfg.model, rcfg.train.seq_len) * tokens
    lflops = ladder_flops(ladder_dir)
    ladder_reps = {}
    for q in grid.points:
        rd = ladder_dir / "runs" / q.name
        ladder_reps[q.name] = repeated_tokens(rd, point_config(bcfg, grid, q, str(rd)))
    total_rep = sum(sum(v.values()) for v in [*repeats.values(), *ladder_reps.values()])

    print("\n== ladder_check")
    print(f"load average (1, 5, 15 min) at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("\n".join(points_table(ladder_dir)))
    print(f"held-out: d_model {d_model} ({n:,} params without the input embedding) at {target:.3g} FLOPs "
          f"({args.factor:g}x C), {tokens:,} tokens, {steps} steps, seeds {list(range(args.heldout_seeds))}: "
          + ", ".join(f"{x:.4f}" for x in outcomes) + " (" + ", ".join(f"{t:.0f}s" for t in times) + " this call)")
    mean = statistics.mean(outcomes)
    sd = statistics.stdev(outcomes) / mean if len(outcomes) > 1 else float("nan")
    print(f"compute: ladder {lflops:.3g} FLOPs (exact; branches past their start, seed replicas in full) = "
          f"{lflops / run_flops:.3f}x the held-out run's {run_flops:.3g}")
    print("tokens repeated per source: held-out " + "; ".join(f"{k} {v}" for k, v in repeats.items())
          + f"; ladder: {sum(sum(v.values()) for v in ladder_reps.values())} in {len(ladder_reps)} runs")
    err = mean / pred["loss"] - 1
    if pred["withheld"]:  # no prediction: said so, with what the withheld law and the power law would have missed by
        print(f"no prediction: {pred['withheld']}; run next: {'; '.join(pred['next'])}")
        print(f"(withheld, for the record: approach 3 says {pred['loss']:.4f} [{pred['loss_lo']:.4f}, "
              f"{pred['loss_hi']:.4f}], the outcome's mean {mean:.4f} misses it by {err:+.2%}"
              + (f"; the power law in compute says {pred['power_law']:.4f}: {mean / pred['power_law'] - 1:+.2%}"
                 if "power_law" in pred else "") + ")")
        print(f"ladder_check: no prediction at {args.factor:.1f}x (degenerate fit; withheld approach 3 off by "
              f"{err:+.1%}, seed sd {sd:.1%}, {total_rep} tokens repeated)")
        return
    lo, hi = pred["loss_lo"] / pred["loss"] - 1, pred["loss_hi"] / pred["loss"] - 1
    inside = pred["loss_lo"] <= mean <= pred["loss_hi"]
    target_err = max(0.01, 2 * sd)
    print(f"prediction {pred['loss']:.4f} [{pred['loss_lo']:.4f}, {pred['loss_hi']:.4f}] vs mean outcome {mean:.4f} "
          f"(seed sd {sd:.2%}): error {err:+.2%}, {'inside' if inside else 'OUTSIDE'} the interval; target "
          f"|error| <= {target_err:.2%}: {'met' if abs(err) <= target_err and inside else 'MISSED'}")
    if "power_law" in pred:
        print(f"cross-check: the power law in compute through each budget's best point predicts "
              f"{pred['power_law']:.4f}: error {mean / pred['power_law'] - 1:+.2%} "
              f"({'inside' if pred['power_law_agrees'] else 'outside'} approach 3's interval)")
    print(f"ladder_check: error {err:+.1%} at {args.factor:.1f}x (interval [{lo:+.1%}, {hi:+.1%}], seed sd {sd:.1%}, "
          f"{total_rep} tokens repeated)")


def compare_muon(cfg, sizes: list[int], budgets: list[float], out: Path, fit: dict, muon_lr: float) -> None:
    """The same ladder with Muon; Muon's compute multiplier over AdamW per budget and both tokens per parameter."""
    mcfg = copy.deepcopy(cfg)
    mcfg.optim.name, mcfg.optim.muon_lr = "muon", muon_lr
    t0 = time.time()
    run_ladder(mcfg, sizes, budgets, out / "ladder_muon", progress=True, protocol=PROTOCOL)
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


# The pre-registered held-out set H2 (issue 42, session 16; the coordinator's h2.md): (name, d_model, schedule,
# a long-context stage from 0.8 of the run, seeds), each at 12 x the ladder's largest budget.
H2_RUNS = (("wsd_d112", 112, "wsd", False, (0, 1, 2)), ("cos_d80", 80, "cosine", False, (0,)),
           ("wsdlong_d96", 96, "wsd", True, (0,)), ("coslong_d128", 128, "cosine", True, (0,)),
           ("wsd_d64", 64, "wsd", False, (0,)))
H2_FACTOR = 12.0
H2_METHOD = ("the trajectory law E + ((A/N)^(alpha/beta) + B/S1)^beta - C*D (densetrain.law.trajectory) fitted "
             "to every ladder run's validations and 25-step bins of its train losses from 25% of the run; interval: "
             "95% bootstrap over the ladder's runs; N without the input embedding; S1 of the run's lr schedule "
             "at its last step, D its annealing drop (the long-context stage changes neither: same tokens a step)")


def h2_config(out: Path, h2_dir: Path, name: str, d_model: int, schedule: str, long: bool, seed: int):
    """One H2 run's config: :func:`heldout_runs`' at ``H2_FACTOR`` x C, ``schedule.kind`` ``schedule`` and, with
    ``long``, a stage from 0.8 of the run at seq_len 512, the same tokens a step, rope_theta 1e5."""
    _, cfg, steps = heldout_runs(out, d_model, H2_FACTOR, seed + 1)[seed]
    cfg = copy.deepcopy(cfg)
    cfg.train.run_dir = str(h2_dir / f"{name}_s{seed}")
    cfg.schedule.kind = schedule
    if long:
        cfg.stages = [cfg.stages[0], StageConfig(name="long", start=0.8, seq_len=512, batch_tokens=0, rope_theta=1e5)]
        cfg.train.micro_batch_size = min(cfg.train.micro_batch_size, 4)
    return cfg, steps


def h2_predict(out: Path, dest: Path, fit_path: Path) -> None:
    """Fit the ladder in ``OUT/ladder`` (every fit, the trajectory law included) into ``fit_path`` and write every
    H2 run's predicted final validation loss (primary: the trajectory law; for the record:
    approach 3 at the run's N and tokens, the power law in compute) to ``dest``."""
    ladder_dir = out / "ladder"
    points = ladder_points(ladder_dir)
    if fit_path.exists():
        fit = json.loads(fit_path.read_text())
    else:
        fit = fit_records(list(finished(ladder_dir).values()), 200, points=points)
        fit_path.write_text(json.dumps(fit))
    print(format_fit(fit))
    rows = []
    for name, d_model, schedule, long, seeds in H2_RUNS:
        cfg, steps = h2_config(out, Path("/nonexistent"), name, d_model, schedule, long, 0)
        n, s1, drop = schedule_end(cfg)
        tokens = float(steps * cfg.train.batch_size * cfg.train.seq_len)
        p = trajectory_prediction(fit, n, s1, drop)
        a3 = checked_prediction(fit, n, tokens)
        rows.append({"name": name, "d_model": d_model, "n_layers": cfg.model.n_layers, "N": n, "steps": steps,
                     "tokens": tokens, "schedule": schedule, "long_context_stage": long, "seeds": list(seeds),
                     "predicted": p["loss"], "interval": [p["loss_lo"], p["loss_hi"]], "withheld": p["withheld"],
                     "n_extrapolation": p["n_extrapolation"], "s1_extrapolation": p["s1_extrapolation"],
                     "also": {"approach3": a3["loss"],
                              "approach3_interval": [a3["loss_lo"], a3["loss_hi"]],
                              "power_law_in_compute": a3.get("power_law")}})
        print(f"{name}: d_model {d_model} ({cfg.model.n_layers} layers, N {n:,.0f}), {steps} steps, {schedule}"
              f"{' + long context' if long else ''}: predicted {p['loss']:.4f} [{p['loss_lo']:.4f}, {p['loss_hi']:.4f}]"
              f" (N {p['n_extrapolation']:.2f}x, S1 {p['s1_extrapolation']:.2f}x the ladder's largest)"
              + (f"; WITHHELD: {p['withheld']}" if p["withheld"] else ""))
    dev = None  # the development held-out run (d96 WSD at 12x, 3 seeds), where it exists: the method's dev error
    dev_runs = [rd for rd, _, _ in heldout_runs(out, 96, H2_FACTOR, 3) if (rd / "summary.json").exists()]
    if dev_runs:
        _, dcfg, _ = heldout_runs(out, 96, H2_FACTOR, 1)[0]
        p = trajectory_prediction(fit, *schedule_end(dcfg))
        mean = statistics.mean(json.loads((rd / "summary.json").read_text())["val"]["all"]["loss"] for rd in dev_runs)
        dev = {"run": "heldout d96 WSD (development data)", "predicted": p["loss"],
               "interval": [p["loss_lo"], p["loss_hi"]], "outcome_mean": mean, "error": mean / p["loss"] - 1}
        print(f"development held-out d96: predicted {p['loss']:.4f} [{p['loss_lo']:.4f}, {p['loss_hi']:.4f}], "
              f"outcome {mean:.4f}: {mean / p['loss'] - 1:+.2%}")
    if dev:  # a secondary column, tuned on the development run (allowed there): each prediction x its outcome ratio
        for r in rows:
            r["also"]["dev_scaled"] = r["predicted"] * (1 + dev["error"])
    doc = {"created_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "method": H2_METHOD, "dev": dev,
           "fit": str(fit_path), "fit_sha256": hashlib.sha256(fit_path.read_bytes()).hexdigest(),
           "trajectory_verdict": {k: fit["trajectory"].get(k) for k in ("degenerate", "reasons", "next")},
           "runs": rows}
    dest.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {dest}")


def h2_compare(out: Path, h2_dir: Path, pred_path: Path) -> None:
    """The H2 outcomes against the committed predictions: a table, and the ladder_check line of wsd_d112."""
    doc = json.loads(pred_path.read_text())
    print(f"predictions of {doc['created_utc']} UTC, fit sha256 {doc['fit_sha256'][:12]}; method: {doc['method']}")
    print("| run | N | steps | predicted | interval | outcome (seeds) | error | inside | approach 3 | power law | "
          "dev-scaled |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    line = None
    for r in doc["runs"]:
        outcomes, reps = [], 0
        for seed in r["seeds"]:
            rd = h2_dir / f"{r['name']}_s{seed}"
            if not (rd / "summary.json").exists():
                continue
            outcomes.append(json.loads((rd / "summary.json").read_text())["val"]["all"]["loss"])
            cfg, _ = h2_config(out, h2_dir, r["name"], r["d_model"], r["schedule"], r["long_context_stage"], seed)
            reps += sum(repeated_tokens(rd, cfg).values())
        if not outcomes:
            print(f"| {r['name']} | {r['N']:,.0f} | {r['steps']} | {r['predicted']:.4f} | - | not finished | | | | | |")
            continue
        mean = statistics.mean(outcomes)
        sd = statistics.stdev(outcomes) / mean if len(outcomes) > 1 else float("nan")
        lo, hi = r["interval"]
        err = mean / r["predicted"] - 1
        a = r["also"]
        pl = a["power_law_in_compute"]
        print(f"| {r['name']} | {r['N']:,.0f} | {r['steps']} | {r['predicted']:.4f} | [{lo:.4f}, {hi:.4f}] | "
              f"{', '.join(f'{x:.4f}' for x in outcomes)} | {err:+.2%} | {'yes' if lo <= mean <= hi else 'no'} | "
              f"{mean / a['approach3'] - 1:+.2%} | "
              + (f"{mean / pl - 1:+.2%}" if pl else "-") + " | "
              + (f"{mean / a['dev_scaled'] - 1:+.2%}" if a.get("dev_scaled") else "-") + " |")
        if r["name"] == "wsd_d112":
            line = (f"ladder_check: error {err:+.1%} at {H2_FACTOR:.1f}x (interval [{lo / r['predicted'] - 1:+.1%}, "
                    f"{hi / r['predicted'] - 1:+.1%}], seed sd {sd:.1%}, {reps} tokens repeated)"
                    + ("" if len(outcomes) == 3 else f" [{len(outcomes)} of 3 seeds]"))
    if line:
        print(line)


if __name__ == "__main__":
    main()
