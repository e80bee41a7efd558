"""The ladder's grid: model sizes scaled from a config, isoFLOP budgets, and the runs that train them.

**Sizes.** Each size is a ``d_model``; the rest of the shape scales the way the config's model does: the
head dimension stays (``n_heads = d_model / head_dim``), the GQA ratio stays (``n_kv_heads = n_heads *
n_kv_heads / n_heads`` of the config, at least 1), the aspect ratio stays (``n_layers = round(n_layers *
d_model / config's d_model)``, at least 1) and so does the MLP ratio (``d_ff = d_ff * d_model / config's
d_model``, a multiple of 8). ``model.init`` (μP or standard) and ``base_d_model`` stay as configured.

**Budgets.** A point of size N at budget C trains on ``D = C / (6 N)`` tokens, N the parameters the
law counts (:data:`N_KEY`). D is rounded to whole steps of the config's ``batch_tokens``.

**Runs.** One WSD run per size (``schedule.kind = 'wsd'``, the config's decay fraction and shape) as long as
the size's largest budget; each smaller budget is a *cooldown branch*: the main run's checkpoint at the
step where the branch's own decay begins, continued with ``train.steps`` = the branch's length (the WSD lr
up to that step is the main run's, so the branch is the run a WSD run of that length would have been;
Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations"). A main
run trains in segments that end at its branch starts (``train --stop-after``: each segment's last step is
checkpointed), and each start checkpoint is copied into its branch's run directory at once, so the config's
own ``checkpoint.every`` and ``keep`` stay as they are.
Warmup is a fixed number of steps (the config's, or its fraction of the shortest run) so every branch shares
it. A ladder trains one stage: the config's first stage's mix (stage starts are fractions of a run's length,
which branches of different lengths would move).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from densetrain.config import Config, StageConfig, validate
from densetrain.errors import ConfigError
from densetrain.tools.plan import model_counts

N_KEY = "params_no_embed"
"""The N of the law: parameters without the input embedding table (the head, a matmul, counted). At ladder
scale the table is a large share of the parameters but costs no FLOPs and moves the loss little (Kaplan et
al. 2020, section 3.1, fit non-embedding parameters for this reason)."""


@dataclass
class Point:
    """One point of the grid: a size trained for ``steps`` steps (``run`` the directory name)."""

    name: str
    d_model: int
    budget: float
    steps: int
    main: str
    """The size's main WSD run (its own name when this point is the main run)."""
    branch_from: int = 0
    """The main run's step this cooldown branch starts from (0: the point is a main run)."""


@dataclass
class Grid:
    sizes: list[int]
    budgets: list[float]
    points: list[Point] = field(default_factory=list)
    warmup_steps: int = 0


def scaled_model(cfg: Config, d_model: int) -> Config:
    """``cfg`` with its model resized to ``d_model`` as the module docstring says.

    Raises:
        ConfigError: ``d_model`` not a multiple of the head dimension.
    """
    m = cfg.model
    head_dim = m.d_model // m.n_heads
    if d_model % head_dim:
        raise ConfigError(f"ladder size d_model={d_model}: expected a multiple of the head dimension {head_dim} "
                          f"(model.d_model / model.n_heads of the config)")
    out = copy.deepcopy(cfg)
    ratio = d_model / m.d_model
    n_heads = d_model // head_dim
    out.model.d_model, out.model.n_heads = d_model, n_heads
    out.model.n_kv_heads = max(1, n_heads * m.n_kv_heads // m.n_heads)
    while n_heads % out.model.n_kv_heads:
        out.model.n_kv_heads -= 1
    out.model.n_layers = max(1, round(m.n_layers * ratio))
    out.model.d_ff = max(8, 8 * round(m.d_ff * ratio / 8))
    return out


def param_counts(cfg: Config) -> dict:
    """``params`` (all) and ``params_no_embed`` (without the input embedding table) of ``cfg``'s model."""
    total = model_counts(cfg.model)["params"]
    return {"params": total, N_KEY: total - cfg.model.vocab_size * cfg.model.d_model}


MAX_BUDGET = 1e27
"""Largest ladder budget, FLOPs: above the largest training runs to date (~5e25); a typo like 1e30 is refused."""
MAX_STEPS = 10**8
"""Most steps of one ladder point (a budget far too large for the batch: lower it)."""


def _wsd_total(start: int, decay_fraction: float) -> int:
    """The smallest run length T whose WSD decay begins at step ``start`` (``T - round(f T) == start``,
    :func:`densetrain.schedule.lr_at`), or 0 when no length has it."""
    t = max(start + 1, int(start / (1.0 - decay_fraction)) - 2)
    while t - round(decay_fraction * t) <= start:
        if t - round(decay_fraction * t) == start and round(decay_fraction * t) >= 1:
            return t
        t += 1
    return 0


def build_grid(cfg: Config, sizes: list[int], budgets: list[float]) -> Grid:
    """The points of ``sizes`` x ``budgets`` (FLOPs, ``6 N D``) for ``cfg``, with their branch structure.

    Raises:
        ConfigError: a point shorter than a few steps (raise the budget), or sizes / budgets not positive.
    """
    if not sizes or not budgets or min(sizes) <= 0 or min(budgets) <= 0:
        raise ConfigError(f"ladder: expected positive sizes and budgets, got sizes={sizes} budgets={budgets}")
    if max(budgets) > MAX_BUDGET:
        raise ConfigError(f"ladder: budget {max(budgets):.3g} FLOPs; expected at most {MAX_BUDGET:.0e} (more than any "
                          f"model has been trained with; a ladder's rungs are far smaller)")
    batch_tokens = cfg.train.batch_size * cfg.train.seq_len
    f = cfg.schedule.decay_fraction
    grid = Grid(sorted(set(sizes)), sorted(set(budgets)))
    lengths = {}
    for d in grid.sizes:
        n = param_counts(scaled_model(cfg, d))[N_KEY]
        for c in grid.budgets:
            steps = round(c / (6.0 * n) / batch_tokens)
            if steps > MAX_STEPS:
                raise ConfigError(f"ladder: size d_model={d} at budget {c:.3g} FLOPs trains {steps:.3g} steps of "
                                  f"{batch_tokens} tokens; expected at most {MAX_STEPS:.0e}: lower the budgets")
            if steps < 8:
                raise ConfigError(f"ladder: size d_model={d} at budget {c:.3g} FLOPs trains {steps} steps of "
                                  f"{batch_tokens} tokens; expected at least 8: raise the budgets")
            lengths[d, c] = steps
    shortest = min(lengths.values())
    w = cfg.schedule.warmup_steps
    grid.warmup_steps = w if w >= 0 else max(1, round(cfg.schedule.warmup_fraction * shortest))
    for d in grid.sizes:
        main = f"d{d}_c{len(grid.budgets) - 1}"
        for j, c in enumerate(grid.budgets):
            steps = lengths[d, c]
            start = steps - round(f * steps)
            if j < len(grid.budgets) - 1:  # a branch: its length must put its decay start on a whole step
                steps = _wsd_total(start, f) or steps
                start = steps - round(f * steps)
                if start <= grid.warmup_steps:
                    raise ConfigError(f"ladder: size d_model={d} at budget {c:.3g} FLOPs decays from step {start}, "
                                      f"inside the {grid.warmup_steps} warmup steps: raise the budgets")
            grid.points.append(Point(f"d{d}_c{j}", d, c, steps, main, start if j < len(grid.budgets) - 1 else 0))
    return grid


def point_config(cfg: Config, grid: Grid, p: Point, run_dir: str) -> Config:
    """The config of point ``p``: the resized model, one stage, WSD with fixed warmup, its length, no faults."""
    out = scaled_model(cfg, p.d_model)
    out.stages = [StageConfig(name="main", start=0.0, mix=dict(cfg.stages[0].mix))]
    out.schedule.kind, out.schedule.unit, out.schedule.warmup_steps = "wsd", "steps", grid.warmup_steps
    out.train.steps, out.train.run_dir = p.steps, run_dir
    out.faults = []
    out.eval.ladder = ""
    validate(out)
    return out

