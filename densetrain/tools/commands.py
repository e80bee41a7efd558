"""Argparse glue for ``densetrain mup-check | lr-sweep | plan``.

:func:`add_subcommands` adds the three subcommands to an ``argparse`` subparsers object; each sets
``func`` (``func(args) -> int``, the exit status) with ``set_defaults``. Bad values (an unparsable
list, a missing throughput, ...) print one line ``densetrain: error: ...`` and return 2.

Examples::

    densetrain mup-check --out runs/mup-check --steps 10 --widths 64,128,256,512
    densetrain lr-sweep --init both --widths 64,256 --lrs 5e-4,1e-3,2e-3,4e-3,8e-3 --steps 100
    densetrain lr-sweep --optim muon --init standard --widths 64,256 --lrs 5e-3,1e-2,2e-2,4e-2,8e-2
    densetrain plan --flops 1.21e20 --peak-flops 8e15 --mfu 0.4
    densetrain plan --hours 24 --tokens-per-sec 2.5e5
    densetrain plan --preset llama3-8b --gpus 64 --gpu-memory-gib 80
    densetrain plan --preset llama3-405b --gpus 16384 --hardware h100-sxm --json
    densetrain plan --params 1.2e9 --tokens 2.4e10 --gpus 8 --gpu-memory-gib 40
    densetrain plan --preset llama3-8b --gpus 64 --gpu-memory-gib 80 --parallel.dp_replicate=8 --parallel.dp_shard=8

The memory plan (and ``train --dry-run``) takes ``--section.key=value`` overrides like ``train``, e.g.
``--parallel.*`` to see whether a layout fits.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from densetrain.cost.hardware import profile_names
from densetrain.fileio import atomic_write_json, json_text


def _positive_list(text: str, kind: type, what: str) -> list:
    """``'1e-3,3e-3'`` -> ``[0.001, 0.003]``: comma-separated positive values of ``kind`` (argparse type).

    Raises:
        argparse.ArgumentTypeError: a value does not parse or is not positive.
    """
    try:
        vals = [kind(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        vals = []
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive comma-separated {what}, got '{text}'")
    return vals


def _floats(text: str) -> list[float]:
    return _positive_list(text, float, "numbers")


def _ints(text: str) -> list[int]:
    return _positive_list(text, int, "integers")


def _price(text: str) -> float:
    """``--gpu-hour-price``: USD per GPU-hour, a finite number >= 0 (argparse type, so a bad one is an argument
    error with the ``(see densetrain plan --help)`` hint, as every other).

    Raises:
        argparse.ArgumentTypeError: not a number, negative or not finite.
    """
    try:
        price = float(text)
    except ValueError:
        price = math.nan
    if not (math.isfinite(price) and price >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number of USD >= 0, got '{text}'")
    return price


def _error(msg: str) -> int:
    print(f"densetrain: error: {msg}", file=sys.stderr)
    return 2


def cmd_mup_check(args: argparse.Namespace) -> int:
    """Run the coordinate check under μP and standard init; write PNG, markdown and JSON into ``--out``."""
    from densetrain.tools.mup import write_coord_check

    if len(args.widths) < 2:
        return _error("--widths needs at least two widths")
    print(f"coordinate check: widths {args.widths}, {args.steps} Adam steps at lr {args.lr:g}, seeds {args.seeds}")
    try:
        res = write_coord_check(
            args.out, widths=args.widths, steps=args.steps, lr=args.lr, seeds=tuple(range(args.seeds)), log=print,
            base_d_model=args.base_d_model,
        )
    except ValueError as e:
        return _error(str(e))
    print()
    print(Path(res["markdown"]).read_text().split("\n\n", 2)[-1].rstrip())
    print(f"\nwrote {res['png']}, {res['markdown']}, {res['json']}")
    return 0


def cmd_lr_sweep(args: argparse.Namespace) -> int:
    """Run :func:`densetrain.tools.mup.lr_sweep` for one or both inits and print a loss table per init."""
    from densetrain.tools.mup import format_lr_sweep, lr_sweep

    inits = ("mup", "standard") if args.init == "both" else (args.init,)
    results = []
    try:
        for init in inits:
            r = lr_sweep(
                lrs=args.lrs, widths=args.widths, init=init, steps=args.steps, base_d_model=args.base_d_model,
                optimizer=args.optim, adamw_lr=args.adamw_lr, log=print if args.verbose else None,
            )
            results.append(r)
            print(format_lr_sweep(r))
            print(f"({r['seconds']:.0f} s)\n")
    except ValueError as e:
        return _error(str(e))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        # JSON object keys must be strings: widths and lrs become their str().
        def keyed(d):
            return {str(k): keyed(v) if isinstance(v, dict) else v for k, v in d.items()}
        atomic_write_json(out, [keyed(r) for r in results])
        print(f"wrote {out}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the Chinchilla plan (one of --flops/--params/--tokens/--hours), or, with ``--gpus``, the
    memory and layout plan of a preset / config (``--params N --tokens D`` may replace its size and
    length); ``--json`` prints the result as JSON."""
    from densetrain.tools.ladder.command import plan_prediction
    from densetrain.tools.plan import format_plan, plan

    if (code := plan_prediction(args)) is not None:  # --ladder (or eval.ladder): the run's predicted loss
        return code
    if args.gpus is not None or args.preset or args.config:
        return _layout_plan(args)
    if getattr(args, "overrides", None):
        return _error("--section.key=value overrides apply to the memory plan: add --gpus with --preset/--config")
    given = [k for k in ("flops", "params", "tokens", "hours") if getattr(args, k) is not None]
    if len(given) != 1:
        return _error(f"give exactly one of --flops, --params, --tokens, --hours (got {', '.join(given) or 'none'}), "
                      "or --gpus with --preset/--config (or --params and --tokens) for the memory plan")
    try:
        res = plan(
            flops=args.flops, params=args.params, tokens=args.tokens, hours=args.hours,
            tokens_per_sec=args.tokens_per_sec, peak_flops=args.peak_flops, mfu=args.mfu,
            tokens_per_param=args.tokens_per_param, gpu_peak_flops=args.gpu_peak_flops,
            gpu_hour_price=args.gpu_hour_price,
        )
    except ValueError as e:
        return _error(str(e))
    print(json_text(res, indent=1) if args.json else format_plan(res))
    return 0


def _layout_plan(args: argparse.Namespace) -> int:
    from densetrain.config import load_config
    from densetrain.cost import load_hardware
    from densetrain.errors import ConfigError
    from densetrain.tools.plan import format_layout_plan, gpu_cost, layout_plan, nearest_preset
    from densetrain.tools.plan.report import layout_plan_json, refusals

    if args.gpus is None:
        return _error("the memory plan needs --gpus (and --gpu-memory-gib, else the --hardware profile's memory)")
    if args.flops is not None or args.hours is not None:
        return _error("--flops / --hours belong to the Chinchilla plan, not to the memory plan (--gpus)")
    # unused by the memory plan, but a value no plan accepts is a typo to report, as the Chinchilla plan does
    if not 0 < args.mfu <= 1:
        return _error(f"--mfu: expected a fraction in (0, 1], got {args.mfu}")
    if not 0 < args.tokens_per_param < float("inf"):
        return _error(f"--tokens-per-param: expected a positive finite number, got {args.tokens_per_param}")
    preset, note = args.preset, ""
    if not preset and not args.config:
        if args.params is None or args.tokens is None:
            return _error("the memory plan needs --preset/--config, or --params and --tokens together")
        preset = nearest_preset(args.params)["name"]
        note = f"(shape of preset '{preset}', the nearest to {args.params:.3g} parameters, for the activations)\n"
    try:
        hw = load_hardware(args.hardware)
        # as in train: a --config file alone is the whole config, not one over the tiny preset
        cfg = load_config(preset=preset, path=args.config, overrides=getattr(args, "overrides", []))
        res = layout_plan(cfg, args.gpus, args.gpu_memory_gib, hardware=hw, tokens=args.tokens, params=args.params,
                          preset=preset, sequence_parallel=cfg.parallel.sequence_parallel)
        if note:  # --params on a preset's shape: no configured layout of the user's to judge
            res["configured_stages"] = []
        if res["seconds"] is not None:
            res["cost"] = gpu_cost(args.gpus * res["seconds"] / 3600.0, args.gpu_hour_price)
    except (ValueError, ConfigError) as e:
        return _error(str(e))
    if args.json:
        print(json_text(layout_plan_json(res), indent=1, default=str), flush=True)
    else:
        print(note + format_layout_plan(res), flush=True)
    return _refuse(refusals(res))


def _refuse(reasons: list[str]) -> int:
    """After a plan is printed: each reason it cannot run as configured on its own ``densetrain: error:`` line,
    and exit status 2; 0 without any."""
    for why in reasons:
        _error(why)
    return 2 if reasons else 0


def print_dry_run(cfg, world_size: int | None = None, rank: int | None = None, ranks: str | None = None,
                  gpu_memory_gib: float | None = None) -> int:
    """``densetrain train --dry-run``: the memory and layout plan of ``cfg`` for this launch (``world_size``,
    else ``WORLD_SIZE`` GPUs; ``gpu_memory_gib``, else this GPU's memory, or 80 GiB without one), from the model
    built on the meta device; no data is read and no process group is created. With ``rank`` / ``ranks``
    (``'0,517,-1'``): those ranks of the job, each built on a fake process group
    (:mod:`densetrain.tools.plan.rank`) instead.

    Returns 2 after the plan (each reason on a ``densetrain: error:`` line) when a stage cannot run as
    configured: no layout, its configured layout's checks or memory (the planner's usable budget of the
    device), or, per rank, a stage the rank does not run or whose planned bytes exceed that budget."""
    import os

    import torch

    from densetrain.errors import ConfigError
    from densetrain.parallel.stage_layout import stage_layouts
    from densetrain.schedule import resolve_stages
    from densetrain.tools.plan import format_layout_plan, layout_plan
    from densetrain.tools.plan.rank import dry_run_rank, format_rank, parse_ranks, rank_refusals, world_words
    from densetrain.tools.plan.report import refusals

    if world_size is not None and world_size < 1:
        return _error(f"--world-size: expected a number of processes >= 1, got {world_size} "
                      "(see densetrain train --help)")
    if gpu_memory_gib is not None and not 0 < gpu_memory_gib <= 1e6:  # inf would reach the planner's own check
        return _error(f"--gpu-memory-gib: expected GiB in (0, 1e6], got {gpu_memory_gib} (see densetrain train --help)")
    given = world_size is not None or "WORLD_SIZE" in os.environ
    gpus = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    # Every stage's layout (its own, stages[i].parallel, or [parallel]) can run it, as train checks before its first
    # step; an unfit [parallel] is the plan's note, or (--rank) the launch's own line.
    why = world_words(cfg.parallel, gpus, given)
    if why and (rank is not None or ranks):  # the launch's own line, with the nearest world sizes that run it
        return _error(why)
    unfit = None  # a stage's own layout that does not run at this world size: after the plan, as its reason
    try:
        stage_layouts(cfg, resolve_stages(cfg), gpus, skip_unfit_base=rank is None and not ranks)
    except (ConfigError, ValueError) as e:
        if rank is not None or ranks:
            return _error(str(e))
        unfit = str(e)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or 8)
    if gpu_memory_gib is not None:
        mem, src = gpu_memory_gib, " (given)"
    elif torch.cuda.is_available():
        mem, src = torch.cuda.get_device_properties(0).total_memory / 1024**3, ""
    else:
        mem, src = 80.0, " (assumed: no GPU here; --gpu-memory-gib sets it)"
    if rank is not None or ranks:
        reasons = []
        try:
            picked = parse_ranks(ranks or str(rank), gpus)
        except ConfigError as e:
            msg = str(e) if ranks else str(e).replace("--ranks:", "--rank:", 1)
            hint = "" if given else " (no --world-size or WORLD_SIZE given: a plain run is one process)"
            return _error(f"{msg}{hint}")
        for r in picked:
            built = dry_run_rank(cfg, gpus, r, per_node)
            print(format_rank(built), flush=True)
            reasons += rank_refusals(built, mem)
        return _refuse(reasons)
    res = layout_plan(cfg, gpus, mem, mixed_precision=cfg.train.dtype != "fp32", given=given)
    if os.environ.get("RANK", "0") != "0":  # rank 0 prints the plan and the reasons, once for the job
        return 2 if refusals(res) or unfit else 0
    print(f"dry run: {gpus} process(es), {mem:g} GiB per GPU{src}")
    print(format_layout_plan(res), flush=True)  # an unfit [parallel] in the verdict's lines (world_words)
    reasons = refusals(res)
    return _refuse(reasons + [unfit] if unfit and unfit not in reasons else reasons)


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    """Add ``mup-check``, ``lr-sweep`` and ``plan`` to ``subparsers`` (each with ``func(args) -> int``)."""
    h = "μP coordinate check: activation size vs width after a few Adam steps (μP vs standard init)"
    p = subparsers.add_parser("mup-check", help=h, description=h)
    p.add_argument("--out", default="runs/mup-check",
                   help="output directory (coord_check.png/.md/.json); default %(default)s")
    p.add_argument("--steps", type=int, default=10, help="Adam steps per width (default %(default)s)")
    p.add_argument("--widths", type=_ints, default=[64, 128, 256, 512],
                   help="comma-separated d_model values (default 64,128,256,512)")
    p.add_argument("--lr", type=float, default=3e-3, help="base Adam learning rate (default %(default)s)")
    p.add_argument("--seeds", type=int, default=4, help="init seeds averaged per width (default %(default)s)")
    p.add_argument("--base-d-model", type=int, default=64, help="μP base width (default %(default)s)")
    p.set_defaults(func=cmd_mup_check)

    h = "learning-rate sweep at several widths on real text; best lr per width"
    p = subparsers.add_parser("lr-sweep", help=h, description=h)
    p.add_argument("--lrs", type=_floats, default=[5e-4, 1e-3, 2e-3, 4e-3, 8e-3],
                   help="comma-separated base lrs (default 5e-4,1e-3,2e-3,4e-3,8e-3)")
    p.add_argument("--widths", type=_ints, default=[64, 256], help="comma-separated d_model values (default 64,256)")
    p.add_argument("--init", choices=("mup", "standard", "both"), default="both",
                   help="parameterisation (default %(default)s)")
    p.add_argument("--steps", type=int, default=100, help="training steps per run (default %(default)s)")
    p.add_argument("--base-d-model", type=int, default=64, help="μP base width (default %(default)s)")
    p.add_argument("--optim", choices=("adamw", "muon"), default="adamw",
                   help="optimizer; muon sweeps the hidden matrices' Muon lr (default %(default)s)")
    p.add_argument("--adamw-lr", type=float, default=3e-3,
                   help="with --optim muon: AdamW lr of embeddings, head and norms (default %(default)s)")
    p.add_argument("--out", help="also write the results as JSON to this file")
    p.add_argument("-v", "--verbose", action="store_true", help="print one line per finished run")
    p.set_defaults(func=cmd_lr_sweep)

    h = ("Chinchilla-optimal params / tokens / compute / wall time (Hoffmann et al. 2022); with --gpus the per-GPU "
         "memory and parallel-layout plan of a preset or config")
    p = subparsers.add_parser("plan", help=h, description=h + ". Chinchilla: give exactly one of --flops, --params, "
                              "--tokens, --hours. Memory: --preset/--config (or --params with --tokens) and --gpus.")
    p.add_argument("--flops", type=float, help="training compute budget, FLOPs")
    p.add_argument("--params", type=float, help="model parameters (all, incl. embeddings)")
    p.add_argument("--tokens", type=float, help="training tokens")
    p.add_argument("--hours", type=float, help="wall-clock hours (needs --tokens-per-sec or --peak-flops)")
    p.add_argument("--tokens-per-sec", type=float,
                   help="measured/declared training throughput of the whole job, tokens/s")
    p.add_argument("--peak-flops", type=float, help="peak FLOP/s of the whole job (all accelerators)")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation used with --peak-flops / "
                   "--gpu-peak-flops (default %(default)s)")
    p.add_argument("--tokens-per-param", type=float, default=20.0,
                   help="compute-optimal tokens per parameter (default %(default)s)")
    p.add_argument("--preset", help="memory plan: preset name (e.g. llama3-8b)")
    p.add_argument("--config", help="memory plan: TOML config file, the whole config (with --preset: applied over it)")
    p.add_argument("--gpus", type=int, help="memory plan: number of GPUs")
    p.add_argument("--gpu-memory-gib", type=float, help="memory plan: memory per GPU, GiB (default: the --hardware "
                   "profile's)")
    p.add_argument("--hardware", default="h100-sxm", metavar="NAME|FILE",
                   help=f"memory plan: the GPU and its links, a shipped profile ({', '.join(profile_names())}) or "
                        "a .toml/.json file (densetrain doctor --profile FILE writes this machine's); default "
                        "%(default)s")
    p.add_argument("--gpu-peak-flops", type=float, default=989e12,
                   help="peak FLOP/s per GPU, for the Chinchilla plan's GPU-hours (default "
                        "%(default)g, H100 SXM dense bf16)")
    p.add_argument("--gpu-hour-price", type=_price,
                   help="USD per GPU-hour: the plan prints the cost (GPU-hours at --mfu of --gpu-peak-flops, or "
                        "GPUs x wall time)")
    p.add_argument("--json", action="store_true", help="print the result as JSON (the memory plan: per stage name, "
                   "seq_len, layout degrees, step_s, mfu, memory_gib, days)")
    p.add_argument("--ladder", help="a fitted ladder directory (densetrain ladder fit): print the predicted final "
                   "val loss and bpb of the --preset/--config run (also when its eval.ladder is set, without --gpus)")
    p.set_defaults(func=cmd_plan)
