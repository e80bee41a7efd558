"""The ``densetrain ladder`` command: run (or print) a ladder, ``ladder fit``, ``ladder report``.

The work is imported when a command runs (as :mod:`densetrain.tools.commands` does): building the parser
must not load torch."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from densetrain.errors import ConfigError
from densetrain.fileio import mark_kind, other_kind

PLAN = "ladder.json"  # as densetrain.tools.ladder.launcher.PLAN (not imported here: it loads torch)


def _numbers(kind: type, what: str):
    """An argparse type: comma-separated positive finite numbers of ``kind`` (``--sizes``, ``--budgets``)."""
    def parse(text: str) -> list:
        try:  # int(float('nan')) is a ValueError, int(float('inf')) an OverflowError: both one line
            floats = [float(x) for x in text.split(",") if x.strip()]
            if not all(math.isfinite(x) for x in floats):
                raise ValueError(text)
            out = [kind(x) for x in floats]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got '{text}'") from None
        if not out or min(out) <= 0:
            raise argparse.ArgumentTypeError(f"expected positive {what}, got '{text}'")
        return out
    return parse


def _samples(text: str) -> int:
    """An argparse type: ``ladder fit --samples``, a whole number in [20, 10,000] (fewer than 10 distinct refits
    measure nothing, densetrain.law.judge.FEW, and some resamples are dropped; 10,000 refits take minutes)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of bootstrap resamples, got '{text}'") from None
    if not 20 <= n <= 10_000:
        raise argparse.ArgumentTypeError(f"expected 20 to 10000 bootstrap resamples, got {n}")
    return n


def ladder_dir_arg(path: str) -> Path:
    """``path`` as a ladder directory.

    Raises:
        ConfigError: no ladder there.
    """
    p = Path(path)
    if not (p / PLAN).exists():
        raise ConfigError(f"{p}: no {PLAN} here; expected a ladder directory of densetrain ladder")
    return p


def cmd_ladder(args: argparse.Namespace) -> int:
    """Run the ladder here (or print its commands), from a preset / config with overrides."""
    from densetrain.config import load_config
    from densetrain.tools.ladder.launcher import print_commands, run_ladder

    if args.sizes is None or args.budgets is None or args.out is None:
        raise ConfigError("densetrain ladder needs --sizes, --budgets and --out (or: ladder fit / ladder report "
                          "LADDER_DIR)")
    cfg = load_config(preset=args.preset or (None if args.config else "tiny"), path=args.config,
                      overrides=args.overrides)
    out = Path(args.out)
    if why := other_kind(out, "ladder", "ladder --out"):  # e.g. a training run's directory: never written into
        raise ConfigError(why)
    if args.print_commands:
        print("\n".join(print_commands(cfg, args.sizes, args.budgets, out)))
        mark_kind(out, "ladder")  # (its ladder.json, written first, says so meanwhile)
        print(f"# then: densetrain ladder fit {out}")
        return 0
    records = run_ladder(cfg, args.sizes, args.budgets, out, progress=not args.no_progress)
    mark_kind(out, "ladder")
    print(f"ladder {out}: {len(records)} points; next: densetrain ladder fit {out}")
    return 0


def cmd_fit(args: argparse.Namespace) -> int:
    from densetrain.tools.ladder.fit import fit_ladder, format_fit

    ladder_dir = ladder_dir_arg(args.ladder_dir)
    fit = fit_ladder(ladder_dir, samples=args.samples)
    print(format_fit(fit))
    print(f"wrote {ladder_dir / 'fit.json'}")
    return 0


def plan_prediction(args: argparse.Namespace) -> int | None:
    """``densetrain plan --ladder LADDER_DIR --preset/--config ...`` (or a config with ``eval.ladder`` and no
    ``--gpus``): print the run's predicted final val loss and bpb; None when the plan asks for no prediction."""
    from densetrain.config import load_config

    if not (args.ladder or ((args.preset or args.config) and args.gpus is None)):
        return None
    if not (args.preset or args.config):
        raise ConfigError("plan --ladder predicts the run of a --preset or --config (with its overrides)")
    cfg = load_config(preset=args.preset, path=args.config, overrides=getattr(args, "overrides", []))
    ladder = args.ladder or cfg.eval.ladder
    if not ladder:
        return None

    from densetrain.law.judge import checked_prediction
    from densetrain.schedule import resolve_stages
    from densetrain.tools.ladder.grid import N_KEY, param_counts
    from densetrain.train.watch.curve import planned_tokens, prediction_line, read_fit

    try:
        stages = resolve_stages(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    p = checked_prediction(read_fit(ladder), float(param_counts(cfg)[N_KEY]), planned_tokens(cfg, stages))
    print(f"ladder {ladder}: {prediction_line(p)}")
    return 0


def add_ladder_command(subparsers: argparse._SubParsersAction, cmd_report) -> None:
    """Add ``ladder`` (with ``fit`` and ``report``) to ``subparsers``; each sets ``func(args) -> int``.
    ``cmd_report(args) -> int`` draws the panel: the caller's (the cli), as tools do not import report."""
    h = "scaling ladder: isoFLOP grid of model sizes x compute budgets (WSD runs with cooldown branches)"
    p = subparsers.add_parser("ladder", help=h, description=h + "; then `ladder fit` and `ladder report`. Any "
                              "--section.key=value override applies to the base config.")
    p.add_argument("--preset", help="preset the sizes are scaled from (default tiny, none with --config)")
    p.add_argument("--config", help="TOML config the sizes are scaled from (with --preset: applied over it)")
    p.add_argument("--sizes", type=_numbers(int, "d_model values"), help="comma-separated d_model values, each a "
                   "multiple of the base config's head dimension (d_model / n_heads: it stays, n_heads follows)")
    p.add_argument("--budgets", type=_numbers(float, "FLOP budgets"), help="comma-separated compute budgets, FLOPs "
                   "(6 N D, N without the input embedding)")
    p.add_argument("--out", help="ladder directory (created; a re-run continues it)")
    p.add_argument("--print-commands", action="store_true", help="write each run's config and print one command "
                   "per run (for a cluster) instead of running here, then the total tokens, FLOPs and GPU-hours")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_ladder)
    sub = p.add_subparsers(dest="ladder_command")
    f = sub.add_parser("fit", help="fit the laws of a ladder: fit.json", description="Chinchilla approaches 2 and 3 "
                       "with bootstrap intervals, tokens per parameter, the schedule-aware curves: LADDER_DIR/fit.json")
    f.add_argument("ladder_dir", help="ladder directory")
    f.add_argument("--samples", type=_samples, default=200, help="bootstrap resamples, 20 to 10000 (default "
                   "%(default)s)")
    f.set_defaults(func=cmd_fit)
    r = sub.add_parser("report", help="scaling panel of a ladder: ladder.html / ladder.png",
                       description="isoFLOP curves and the fitted frontier with its band: LADDER_DIR/ladder.html, .png")
    r.add_argument("ladder_dir", help="ladder directory")
    r.add_argument("--run", help="a run directory trained with eval.ladder: its predicted point and outcome")
    r.set_defaults(func=cmd_report)
