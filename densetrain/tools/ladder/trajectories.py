"""The ladder runs' whole loss trajectories as points of the trajectory law (:mod:`densetrain.law.trajectory`),
and the areas of a new run's schedule that the law predicts from.

A point is ``(N, S1, D, loss, kind, run)`` with the forward area ``S1`` (:func:`run_areas`) and the annealing
drop ``D`` (:func:`run_drops`) of the run's own lr schedule (the config's ``lr_for`` at every step, the main
run's schedule before a branch's start included) after the updates the loss saw:

- every validation (``val/all/loss``) past :data:`FROM` of the run (and past warmup);
- the per-step train losses, on text no run repeats (the ladder corpus; ``ladder_check`` counts repeats): each
  step's loss is the model's loss on fresh text before its update, an unbiased draw of the same expected loss
  as a validation on that source's held-out split. Per bin of :data:`BIN` steps, per source the mean of the steps
  whose batch held it, then the mean over the sources weighted as ``val/all`` weighs them (the validation's mean
  over its sources, equal weights: ``val/all/loss`` is their mean); a bin missing a source is dropped. The
  bin's S1 and D are those after its mean step's previous update.

No step is counted twice: a branch's metrics hold only its own steps (past ``branch_from``; its earlier steps
are its main run's), seed replicas are separate runs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from densetrain.config import Config
from densetrain.metrics import read_metrics
from densetrain.schedule import resolve_stages, warmup_steps
from densetrain.tools.ladder.grid import N_KEY, param_counts, point_config
from densetrain.tools.ladder.launcher import finished, open_ladder
from densetrain.train.watch.curve import run_areas, run_drops

FROM = 0.25
"""Points start past this fraction of each run's steps (as the ladder's curves and the run's forecast do,
:data:`densetrain.train.watch.curve.CURVE_FROM`): a small model's first steps fall faster than any power law."""
BIN = 25
"""Steps of train loss averaged into one point (at 2048 tokens a step, ~1% noise per step: ~0.2% a bin)."""


def run_points(cfg: Config, run_dir: Path, first_step: int = 0, train_points: bool = True) -> list[tuple]:
    """The trajectory points ``(n, s1, drop, loss, kind)`` of one finished run of config ``cfg`` (module
    docstring); train rows at or before ``first_step`` are left out (a branch's rows start after it)."""
    n = float(param_counts(cfg)[N_KEY])
    stages = resolve_stages(cfg)
    s1, drop = run_areas(cfg, stages)[0], run_drops(cfg, stages)
    first = max(warmup_steps(cfg.schedule, cfg.train.steps), FROM * cfg.train.steps)
    sources = [s.name for s in cfg.data.sources]
    out, rows = [], []
    for r in read_metrics(run_dir):
        if r.get("kind") == "eval" and isinstance(r.get("val/all/loss"), float) and r["step"] > first:
            out.append((n, float(s1[r["step"] - 1]), float(drop[r["step"] - 1]), r["val/all/loss"], "val"))
        elif r.get("kind") == "train" and r["step"] > max(first, first_step):
            rows.append(r)
    if not train_points:
        return out
    for i in range(0, len(rows) - BIN // 2, BIN):  # a last bin shorter than half of BIN is dropped
        b = rows[i:i + BIN]
        means = [np.mean(v) for v in ([r[f"train/{s}/loss"] for r in b if f"train/{s}/loss" in r] for s in sources)
                 if v]
        if len(means) < len(sources):
            continue
        k = int(round(np.mean([r["step"] for r in b]))) - 1  # the loss of step k + 1 is after k updates
        if k >= 1:
            out.append((n, float(s1[k - 1]), float(drop[k - 1]), float(np.mean(means)), "train"))
    return out


def ladder_points(ladder_dir: Path, train_points: bool = True) -> list[tuple]:
    """The trajectory points ``(n, s1, drop, loss, kind, run)`` of every finished run of the ladder."""
    cfg, grid = open_ladder(ladder_dir)
    done = finished(ladder_dir)
    out = []
    for p in grid.points:
        if p.name not in done:
            continue
        run_dir = Path(ladder_dir) / "runs" / p.name
        pcfg = point_config(cfg, grid, p, str(run_dir))
        out += [(*pt, p.name) for pt in run_points(pcfg, run_dir, p.branch_from, train_points)]
    return out


def schedule_end(cfg: Config) -> tuple[float, float, float]:
    """``(n, s1, drop)`` of a run of config ``cfg`` at its last step: what the trajectory law predicts from."""
    stages = resolve_stages(cfg)
    return float(param_counts(cfg)[N_KEY]), float(run_areas(cfg, stages)[0][-1]), float(run_drops(cfg, stages)[-1])
