"""Running a ladder: locally one point after another, or as one command per run for a cluster.

The ladder directory::

    LADDER_DIR/ladder.json     the plan: sizes, budgets, points, the base config (written once; a re-run with
                               other sizes or budgets is refused)
    LADDER_DIR/base.toml       the config the sizes were scaled from
    LADDER_DIR/ladder.jsonl    one record per finished point (rewritten atomically with each new one)
    LADDER_DIR/runs/NAME/      each point's run directory (NAME = d<d_model>_c<budget index>)
    LADDER_DIR/configs/        with --print-commands: each run's config

A re-run skips the points in ``ladder.jsonl`` and resumes an unfinished run from its newest checkpoint.
A size's main run trains in segments that end at its branches' starts (``stop_after``); each segment's last
checkpoint is copied into its branch's ``checkpoints/`` at once, so the main run's retention may delete it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tqdm import tqdm

from densetrain.checkpoint import latest_checkpoint, read_trainer_state
from densetrain.config import Config, load_config, save_config, to_dict
from densetrain.cost import Parallel, load_hardware, step_time
from densetrain.data.streams import open_streams
from densetrain.errors import ConfigError, DataError
from densetrain.fileio import (
    MAX_LOG_BYTES,
    atomic_write_bytes,
    atomic_write_json,
    json_text,
    read_bytes_bounded,
)
from densetrain.law.files import PLAN, POINTS, read_plan, read_points, read_summary
from densetrain.metrics import flops_per_token, read_metrics
from densetrain.schedule import resolve_stages, warmup_steps
from densetrain.tools.ladder.grid import (
    N_KEY,
    Grid,
    Point,
    Protocol,
    build_grid,
    param_counts,
    point_config,
    scaled_model,
)
from densetrain.train import train
from densetrain.train.watch.curve import CURVE_FROM, run_areas

# PLAN, POINTS: densetrain.law.files (command.py repeats PLAN: it imports no torch)


def open_ladder(ladder_dir: Path, cfg: Config | None = None, sizes: list[int] | None = None,
                budgets: list[float] | None = None, protocol: Protocol | None = None) -> tuple[Config, Grid]:
    """The ladder's base config and grid: planned now from ``cfg``, ``sizes``, ``budgets`` and ``protocol``
    (default :class:`~densetrain.tools.ladder.grid.Protocol`'s: every size at every budget) and written to
    ``ladder.json``, or read back from ``ladder.json`` when they are None (its protocol too).

    Raises:
        ConfigError: no ladder there, or another ladder (other sizes / budgets / protocol / config) already there.
    """
    plan_path = ladder_dir / PLAN
    if plan_path.exists():
        plan = read_plan(plan_path)  # bounded regular read, sizes and budgets checked (one line naming the key)
        planned = Protocol.from_dict(plan.get("protocol", {}), str(plan_path))
        if protocol is not None and protocol != planned:
            raise ConfigError(f"{plan_path}: a ladder of protocol {planned.as_dict()} is there; expected the same "
                              f"protocol to continue it, got {protocol.as_dict()} (or another LADDER_DIR)")
        protocol = planned
        if cfg is None:
            cfg = load_config(path=ladder_dir / "base.toml")
            sizes, budgets = plan["sizes"], plan["budgets"]
        elif sorted(set(sizes)) != plan["sizes"] or sorted(set(budgets)) != plan["budgets"]:
            raise ConfigError(f"{plan_path}: a ladder of sizes {plan['sizes']} x budgets {plan['budgets']} is there; "
                              f"expected the same sizes and budgets to continue it (or another LADDER_DIR)")
        else:  # points of two recipes in one fit would be no law of either
            base = to_dict(load_config(path=ladder_dir / "base.toml"))
            changed = sorted(k for k, v in to_dict(cfg).items() if base.get(k) != v)
            if changed:
                raise ConfigError(f"{ladder_dir / 'base.toml'}: the ladder there was started from another config "
                                  f"(sections {changed} differ); expected the same config to continue it")
    elif cfg is None:
        raise ConfigError(f"{ladder_dir}: no {PLAN}; expected a ladder directory of densetrain ladder")
    grid = build_grid(cfg, sizes, budgets, protocol)
    if not plan_path.exists():
        ladder_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, ladder_dir / "base.toml")
        atomic_write_json(plan_path, {"sizes": grid.sizes, "budgets": grid.budgets, "warmup_steps": grid.warmup_steps,
                                      "protocol": grid.protocol.as_dict(), "left_out": grid.left_out,
                                      "points": [vars(p) for p in grid.points]})
    return cfg, grid


def describe(cfg: Config, grid: Grid) -> str:
    """One line saying how the ladder's runs differ from ``cfg`` (the decisions the grid makes for them)."""
    mains = sum(1 for p in grid.points if not p.branch_from)
    pr = grid.protocol
    line = (f"ladder: {len(grid.points)} points ({len(grid.sizes)} sizes x {len(grid.budgets)} budgets), {mains} WSD "
            f"runs + {len(grid.points) - mains} cooldown branches; every run: schedule wsd (decay_fraction "
            f"{cfg.schedule.decay_fraction:g}, {cfg.schedule.decay_shape}), warmup {grid.warmup_steps} steps, one "
            f"stage with the mix of the config's first stage, no faults")
    if pr != Protocol():
        line += (f"; protocol: {pr.per_budget or 'every'} sizes a budget, the largest rung at {pr.seeds} seeds, "
                 f"lr {pr.lr_rule}, head_dim {pr.head_dim or 'of the config'}, {pr.flops} FLOPs"
                 + (f"; left out (too short to decay after the warmup): {', '.join(grid.left_out)}" if grid.left_out
                    else ""))
    return line + head_note(cfg, grid)


def head_note(cfg: Config, grid: Grid) -> str:
    """A note when N (parameters without the input embedding, the fit's N) spans less than the protocol's 10x over
    the ladder's sizes, naming the output head's share of N at the smallest size when it is the reason (an untied
    ``vocab_size x d_model`` head grows with d_model like the blocks' rows, not their squares: at BPE 8192 and
    d_model 16-64 N spans 4.6x; the protocol's recipe, benchmarks/ladder_protocol.toml, trains BPE 512: 10.8x).
    Empty otherwise."""
    models = [scaled_model(cfg, d, grid.protocol.head_dim) for d in (min(grid.sizes), max(grid.sizes))]
    (n_lo, n_hi) = (param_counts(m)[N_KEY] for m in models)
    if n_hi >= 10 * n_lo:
        return ""
    m = models[0].model
    head = "" if m.tie_embeddings else (f"; at d_model {m.d_model} the output head (vocab_size {m.vocab_size} x "
                                        f"d_model) is {m.vocab_size * m.d_model / n_lo:.0%} of N")
    return (f"; note: N spans {n_hi / n_lo:.1f}x over the sizes (the protocol asks >= 10x: wider sizes or a smaller "
            f"vocabulary, e.g. benchmarks/ladder_protocol.toml's BPE 512){head}")


def finished(ladder_dir: Path) -> dict[str, dict]:
    """The records of ``ladder.jsonl`` by point name, each checked (:func:`densetrain.law.files.read_points`: a
    bad value, a bad line or a point recorded twice is one line naming PATH:LINE and the key)."""
    path = ladder_dir / POINTS
    if not path.exists():
        return {}
    return read_points(path)


def record_point(ladder_dir: Path, rec: dict) -> None:
    """Add ``rec`` to ``ladder.jsonl`` (the whole file rewritten atomically: a kill leaves the old or the new)."""
    path = ladder_dir / POINTS
    old = read_bytes_bounded(path, MAX_LOG_BYTES) if path.exists() else b""
    atomic_write_bytes(path, old + (json_text(rec) + "\n").encode())


def point_record(cfg: Config, p: Point, run_dir: Path) -> dict:
    """What the ladder keeps of a finished point (module docstring of the package)."""
    summary = read_summary(run_dir / "summary.json")
    if "tokens" not in summary:
        raise DataError(f"{run_dir / 'summary.json'}: key 'tokens' missing; expected the summary of a finished run")
    counts = param_counts(cfg)
    d = float(summary["tokens"])
    stages = resolve_stages(cfg)
    s1, s2 = run_areas(cfg, stages)
    curve, first = [], max(warmup_steps(cfg.schedule, cfg.train.steps), CURVE_FROM * cfg.train.steps)
    for r in read_metrics(run_dir):
        if r.get("kind") == "eval" and "val/all/loss" in r and r["step"] > first:
            curve.append({"step": r["step"], "s1": float(s1[r["step"] - 1]), "s2": float(s2[r["step"] - 1]),
                          "loss": {k.split("/")[1]: v for k, v in r.items()
                                   if k.startswith("val/") and k.endswith("/loss") and isinstance(v, float)}})
    return {"name": p.name, "d_model": p.d_model, "n_layers": cfg.model.n_layers, "budget": p.budget,
            "steps": p.steps, "branch_from": p.branch_from, **counts, "tokens": d,
            "flops_6nd": 6.0 * counts[N_KEY] * d, "flops_6nd_all": 6.0 * counts["params"] * d,
            "flops": flops_per_token(cfg.model, cfg.train.seq_len) * d, "seed": p.seed,
            "val": {s: {k: v.get(k) for k in ("loss", "bpb")} for s, v in summary.get("val", {}).items()},
            "downstream": summary.get("downstream", {}), "curve": curve, "run_dir": str(run_dir),
            "repeated_tokens": repeated_tokens(run_dir, cfg)}


def repeated_tokens(run_dir: Path, cfg: Config) -> dict[str, int]:
    """Per source, the tokens run ``run_dir`` (of config ``cfg``, one stage) trained on more than once, from its
    newest checkpoint's sampler state against each source's train tokens (:func:`open_streams`).

    A source whose first pass is unfinished (``epoch`` 0) repeated nothing; once a pass ends, every window of
    the next passes repeats text: ``max(window, drawn - W)`` windows of ``seq_len`` tokens (``window``: drawn in
    the current pass, ``drawn``: in the run, ``W = (tokens - 1) // seq_len`` windows a pass; the sampler ends
    a pass early only by the few windows a batch cannot take, densetrain.data.mixture).

    Raises:
        DataError: no checkpoint in ``run_dir`` (the ladder's runs save one at their end).
    """
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise DataError(f"{run_dir}: no checkpoint; expected a finished run with its final checkpoint (to count "
                        "the tokens it repeated)")
    st = read_trainer_state(ckpt)["sampler"]
    seq_len = cfg.train.seq_len
    out = {}
    for name, stream in open_streams(cfg, "train").items():
        epoch, window = st["epoch"].get(name, 0), st["window"].get(name, 0)
        drawn = st["stage_drawn"].get(name, 0)
        w = (len(stream) - 1) // seq_len
        out[name] = 0 if not epoch else max(window, drawn - w) * seq_len
    return out


def _order(grid: Grid) -> list[Point]:
    """Each size's main run before its branches (they start from its checkpoints)."""
    return sorted(grid.points, key=lambda p: (p.d_model, p.branch_from != 0, p.budget))


def _branches(grid: Grid, main: Point) -> list[Point]:
    """The cooldown branches of main run ``main``, by their start step."""
    return sorted((b for b in grid.points if b.main == main.name and b.branch_from), key=lambda b: b.branch_from)


def _branch_start(main_dir: Path, run_dir: Path, step: int) -> None:
    """Give a branch its start: the main run's checkpoint of ``step`` copied into ``run_dir/checkpoints``
    (copied to a temporary name, then renamed, so a kill leaves no partial checkpoint)."""
    dest = run_dir / "checkpoints" / f"step_{step:08d}"
    if dest.exists() or (run_dir / "summary.json").exists():
        return
    src = main_dir / "checkpoints" / f"step_{step:08d}"
    if not src.is_dir():
        raise ConfigError(f"{src}: the main run has no checkpoint at step {step} for this cooldown branch "
                          f"(deleted?); expected the checkpoints of densetrain ladder's main runs")
    tmp = dest.with_name(dest.name + ".copy")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    tmp.rename(dest)


def run_ladder(cfg: Config, sizes: list[int], budgets: list[float], ladder_dir: Path,
               progress: bool = True, protocol: Protocol | None = None) -> list[dict]:
    """Train every point of the ladder not yet finished, one after another in this process; return all records."""
    cfg, grid = open_ladder(ladder_dir, cfg, sizes, budgets, protocol)
    done = finished(ladder_dir)
    todo = [p for p in _order(grid) if p.name not in done]
    print(describe(cfg, grid))
    if len(todo) < len(grid.points):
        print(f"ladder {ladder_dir}: {len(grid.points) - len(todo)} of {len(grid.points)} points done, skipped")
    for p in tqdm(todo, desc="ladder", unit="run", disable=not progress):
        run_dir = ladder_dir / "runs" / p.name
        pcfg = point_config(cfg, grid, p, str(run_dir))
        if not p.branch_from:  # in segments ending at the branch starts, each start given to its branch at once
            for b in _branches(grid, p):
                branch_dir = ladder_dir / "runs" / b.name
                if not (branch_dir / "checkpoints" / f"step_{b.branch_from:08d}").is_dir():
                    train(pcfg, resume=True, stop_after=b.branch_from)
                    _branch_start(run_dir, branch_dir, b.branch_from)
        else:
            _branch_start(ladder_dir / "runs" / p.main, run_dir, p.branch_from)
        if not (run_dir / "summary.json").exists():  # (a run killed after its last checkpoint: the summary now)
            train(pcfg, resume=True)
        record_point(ladder_dir, point_record(pcfg, p, run_dir))
    return list(finished(ladder_dir).values())


def collect(ladder_dir: Path) -> list[dict]:
    """The ladder's records, first adding those of runs finished outside :func:`run_ladder` (a cluster's,
    after ``--print-commands``)."""
    cfg, grid = open_ladder(ladder_dir)
    done = finished(ladder_dir)
    for p in grid.points:
        run_dir = ladder_dir / "runs" / p.name
        if p.name not in done and (run_dir / "summary.json").exists():
            s = read_summary(run_dir / "summary.json")
            if s.get("steps") == p.steps:
                record_point(ladder_dir, point_record(point_config(cfg, grid, p, str(run_dir)), p, run_dir))
    return list(finished(ladder_dir).values())


def print_commands(cfg: Config, sizes: list[int], budgets: list[float], ladder_dir: Path,
                   protocol: Protocol | None = None) -> list[str]:
    """One shell command per run (main runs, then the branches that need their checkpoints), with each run's
    config written to ``LADDER_DIR/configs``; ``densetrain ladder fit`` collects the finished runs."""
    cfg, grid = open_ladder(ladder_dir, cfg, sizes, budgets, protocol)
    lines = [f"# {describe(cfg, grid)}"]
    for p in _order(grid):
        run_dir = ladder_dir / "runs" / p.name
        conf = ladder_dir / "configs" / f"{p.name}.toml"
        conf.parent.mkdir(parents=True, exist_ok=True)
        save_config(point_config(cfg, grid, p, str(run_dir)), conf)
        if not p.branch_from:  # in segments, each start copied for its branch (see run_ladder)
            stops = [b.branch_from for b in _branches(grid, p)]
            cmds = [f"densetrain train --config {conf}" + (f" --stop-after {stops[0]}" if stops else "")]
            for i, b in enumerate(_branches(grid, p)):
                dest = ladder_dir / "runs" / b.name / "checkpoints"
                cmds.append(f"mkdir -p {dest} && cp -r {run_dir}/checkpoints/step_{b.branch_from:08d} {dest}/")
                cmds.append(f"densetrain train --resume {run_dir}"
                            + (f" --stop-after {stops[i + 1]}" if i + 1 < len(stops) else ""))
            lines.append(" && ".join(cmds))
        else:
            lines.append(f"cp {conf} {run_dir}/config.toml && densetrain train --resume {run_dir}")
    lines.append(f"# {ladder_totals(cfg, grid)}")
    return lines


def ladder_totals(cfg: Config, grid: Grid) -> str:
    """The grid's total tokens and FLOPs (:func:`flops_per_token`; a branch counts only the steps after its
    start) and the time on one H100 SXM at the cost model's predicted speed (:func:`densetrain.cost.step_time`),
    for a ladder printed for a cluster."""
    tokens = flops = seconds = 0.0
    hw = load_hardware("h100-sxm")
    for p in grid.points:
        c = point_config(cfg, grid, p, f"runs/{p.name}")  # a run directory name only: nothing is written
        st = resolve_stages(c)[0]
        steps = p.steps - p.branch_from
        tokens += steps * st.batch_tokens
        flops += steps * st.batch_tokens * flops_per_token(c.model, st.seq_len)
        seconds += steps * step_time(c.model, Parallel(), hw, st.seq_len, st.batch_size, st.micro_batch_size)["step_s"]
    return (f"total: {len(grid.points)} runs, {tokens:.3g} tokens, {flops:.3g} FLOPs; about {seconds / 3600:.3g} "
            "GPU-hours on one H100 SXM at the cost model's speed (docs/planner.md); a laptop CPU is ~1000x slower")

