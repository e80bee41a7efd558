"""The ``densetrain ladder`` command: run (or print) a ladder, ``ladder fit``, ``ladder report``.

The work is imported when a command runs (as :mod:`densetrain.tools.commands` does): building the parser
must not load torch."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from densetrain.errors import ConfigError
from densetrain.fileio import mark_kind, other_kind
from densetrain.tools.ladder.protocol import DEFAULT_BUDGETS, DEFAULT_SIZES, FLOP_COUNTS, LR_RULES, PROTOCOL, Protocol

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


def _count(lo: int, hi: int, what: str):
    """An argparse type: a whole number in [lo, hi] (``--per-budget``, ``--seeds``, ``--head-dim``)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number of {what}, got '{text}'") from None
        if not lo <= n <= hi:
            raise argparse.ArgumentTypeError(f"expected {lo} to {hi} {what}, got {n}")
        return n
    return parse


def protocol_args(args: argparse.Namespace) -> Protocol:
    """The protocol of ``densetrain ladder``'s flags (each defaults to :data:`PROTOCOL`'s value)."""
    return Protocol(per_budget=args.per_budget, seeds=args.seeds, lr_rule=args.lr_rule, head_dim=args.head_dim,
                    flops=args.flops).check()


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

    if args.out is None:
        raise ConfigError("densetrain ladder needs --out LADDER_DIR (or: ladder fit / ladder report LADDER_DIR)")
    protocol = protocol_args(args)
    sizes = args.sizes or list(DEFAULT_SIZES)
    budgets = args.budgets or list(DEFAULT_BUDGETS)
    cfg = load_config(preset=args.preset or (None if args.config else "tiny"), path=args.config,
                      overrides=args.overrides)
    out = Path(args.out)
    if why := other_kind(out, "ladder", "ladder --out"):  # e.g. a training run's directory: never written into
        raise ConfigError(why)
    if args.print_commands:
        print("\n".join(print_commands(cfg, sizes, budgets, out, protocol)))
        mark_kind(out, "ladder")  # (its ladder.json, written first, says so meanwhile)
        print(f"# then: densetrain ladder fit {out}")
        return 0
    records = run_ladder(cfg, sizes, budgets, out, progress=not args.no_progress, protocol=protocol)
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
    h = ("scaling ladder: isoFLOP grid of model sizes x compute budgets (WSD runs with cooldown branches); the "
         "defaults are the protocol of docs (README 'densetrain ladder')")
    p = subparsers.add_parser("ladder", help=h, description=h + "; then `ladder fit` and `ladder report`. Any "
                              "--section.key=value override applies to the base config.")
    p.add_argument("--preset", help="preset the sizes are scaled from (default tiny, none with --config)")
    p.add_argument("--config", help="TOML config the sizes are scaled from (with --preset: applied over it)")
    p.add_argument("--sizes", type=_numbers(int, "d_model values"), help="comma-separated d_model values, each a "
                   "multiple of the head dimension (--head-dim; n_heads follows, n_layers keeps the config's aspect "
                   "ratio); default " + ",".join(map(str, DEFAULT_SIZES)))
    p.add_argument("--budgets", type=_numbers(float, "FLOP budgets"), help="comma-separated compute budgets, FLOPs "
                   "(--flops: exact = plan's count x tokens, 6nd = 6 N D; N without the input embedding); default "
                   + ",".join(f"{b:g}" for b in DEFAULT_BUDGETS))
    p.add_argument("--per-budget", type=_count(0, 20, "sizes per budget"), default=PROTOCOL.per_budget,
                   help="sizes per budget, a window moving up the sizes with the budget (0: every size at every "
                   "budget; default %(default)s)")
    p.add_argument("--seeds", type=_count(1, 10, "seeds"), default=PROTOCOL.seeds, help="seeds of the largest rung "
                   "(the largest size at its largest budget; default %(default)s)")
    p.add_argument("--lr-rule", choices=LR_RULES, default=PROTOCOL.lr_rule, help="lr per size: inverse-width scales "
                   "peak_lr and min_lr by the config's d_model / d_model; config keeps them (default %(default)s)")
    p.add_argument("--head-dim", type=_count(0, 1024, "head dimension"), default=PROTOCOL.head_dim,
                   help="head dimension of every size (0: the config's; default %(default)s)")
    p.add_argument("--flops", choices=FLOP_COUNTS, default=PROTOCOL.flops, help="what a budget counts (default "
                   "%(default)s)")
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
