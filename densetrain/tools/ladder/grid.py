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

**The protocol** (which sizes at which budget, seeds, lr per size, head dimension, FLOP count):
:mod:`densetrain.tools.ladder.protocol`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from densetrain.config import Config, StageConfig, validate
from densetrain.errors import ConfigError
from densetrain.metrics import flops_per_token
from densetrain.tools.ladder.protocol import Protocol
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
    seed: int = 0
    """Added to the config's ``train.seed`` (a replica of the largest rung: 1, 2, ...)."""


@dataclass
class Grid:
    sizes: list[int]
    budgets: list[float]
    points: list[Point] = field(default_factory=list)
    warmup_steps: int = 0
    protocol: Protocol = field(default_factory=Protocol)
    left_out: list[str] = field(default_factory=list)
    """Placed points too short to decay after the warmup (named, with their steps)."""


def scaled_model(cfg: Config, d_model: int, head_dim: int = 0) -> Config:
    """``cfg`` with its model resized to ``d_model`` as the module docstring says (heads ``head_dim`` wide; 0:
    the config's).

    Raises:
        ConfigError: ``d_model`` not a multiple of the head dimension.
    """
    m = cfg.model
    head_dim = head_dim or m.d_model // m.n_heads
    if d_model % head_dim:
        raise ConfigError(f"ladder size d_model={d_model}: expected a multiple of the head dimension {head_dim} "
                          f"(the protocol's head_dim, else model.d_model / model.n_heads of the config)")
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


def size_config(cfg: Config, d_model: int, protocol: Protocol | None = None) -> Config:
    """``cfg`` at size ``d_model`` under ``protocol`` (:func:`scaled_model` with its head dimension, and its lr
    rule: ``inverse-width`` multiplies ``peak_lr`` and ``min_lr`` by ``cfg.model.d_model / d_model``)."""
    protocol = protocol or Protocol()
    out = scaled_model(cfg, d_model, protocol.head_dim)
    if protocol.lr_rule == "inverse-width":
        scale = cfg.model.d_model / d_model
        # (optim.muon_lr stays: Muon's orthogonalised update does not grow with width, RESULTS.md's lr-sweep)
        out.optim.peak_lr, out.optim.min_lr = cfg.optim.peak_lr * scale, cfg.optim.min_lr * scale
    return out


def tokens_for(cfg: Config, budget: float, protocol: Protocol) -> float:
    """Tokens D a model ``cfg`` (already sized) trains at ``budget`` FLOPs: ``C / flops_per_token`` (exact) or
    ``C / (6 N)``."""
    if protocol.flops == "exact":
        return budget / flops_per_token(cfg.model, cfg.train.seq_len)
    return budget / (6.0 * param_counts(cfg)[N_KEY])


def placement(sizes: list[int], budgets: list[float], per_budget: int) -> dict[float, list[int]]:
    """The sizes each budget trains (``sizes`` ascending in N, ``budgets`` ascending): all of them when
    ``per_budget`` is 0 or covers them, else the staircase of windows of the module docstring."""
    k, b = per_budget, len(budgets)
    if not k or k >= len(sizes):
        return {c: list(sizes) for c in budgets}
    starts = [round(i * (len(sizes) - k) / (b - 1)) if b > 1 else len(sizes) - k for i in range(b)]
    return {c: list(sizes[s:s + k]) for c, s in zip(budgets, starts)}


def build_grid(cfg: Config, sizes: list[int], budgets: list[float], protocol: Protocol | None = None) -> Grid:
    """The points of ``sizes`` x ``budgets`` (FLOPs) for ``cfg`` under ``protocol`` (default: every size at every
    budget, one seed, the config's lr and heads, 6ND), with their branch structure and seed replicas.

    Raises:
        ConfigError: a point shorter than a few steps (raise the budget), sizes / budgets not positive, a
            protocol value out of range.
    """
    protocol = (protocol or Protocol()).check()
    if not sizes or not budgets or min(sizes) <= 0 or min(budgets) <= 0:
        raise ConfigError(f"ladder: expected positive sizes and budgets, got sizes={sizes} budgets={budgets}")
    if max(budgets) > MAX_BUDGET:
        raise ConfigError(f"ladder: budget {max(budgets):.3g} FLOPs; expected at most {MAX_BUDGET:.0e} (more than any "
                          f"model has been trained with; a ladder's rungs are far smaller)")
    batch_tokens = cfg.train.batch_size * cfg.train.seq_len
    f = cfg.schedule.decay_fraction
    grid = Grid(sorted(set(sizes)), sorted(set(budgets)), protocol=protocol)
    sized = {d: size_config(cfg, d, protocol) for d in grid.sizes}
    by_n = sorted(grid.sizes, key=lambda d: param_counts(sized[d])[N_KEY])
    placed = placement(by_n, grid.budgets, protocol.per_budget)
    w = cfg.schedule.warmup_steps
    lengths = {}
    for c in grid.budgets:
        for d in placed[c]:
            steps = round(tokens_for(sized[d], c, protocol) / batch_tokens)
            if steps > MAX_STEPS:
                raise ConfigError(f"ladder: size d_model={d} at budget {c:.3g} FLOPs trains {steps:.3g} steps of "
                                  f"{batch_tokens} tokens; expected at most {MAX_STEPS:.0e}: lower the budgets")
            if protocol.per_budget and (steps < 8 or steps - round(f * steps) <= max(w, 0) + 1):
                grid.left_out.append(f"d{d} at {c:.3g} FLOPs ({steps} steps)")  # a placed point too short
                continue
            if steps < 8:
                raise ConfigError(f"ladder: size d_model={d} at budget {c:.3g} FLOPs trains {steps} steps of "
                                  f"{batch_tokens} tokens; expected at least 8: raise the budgets")
            lengths[d, c] = steps
    shortest = min(lengths.values())
    grid.warmup_steps = w if w >= 0 else max(1, round(cfg.schedule.warmup_fraction * shortest))
    for d in grid.sizes:
        mine = [j for j, c in enumerate(grid.budgets) if (d, c) in lengths]
        if not mine:
            continue
        top = mine[-1]
        main = f"d{d}_c{top}"
        for j in mine:
            steps = lengths[d, grid.budgets[j]]
            start = steps - round(f * steps)
            if j < top:  # a branch: its length must put its decay start on a whole step
                steps = _wsd_total(start, f) or steps
                start = steps - round(f * steps)
                if start <= grid.warmup_steps:
                    raise ConfigError(f"ladder: size d_model={d} at budget {grid.budgets[j]:.3g} FLOPs decays from "
                                      f"step {start}, inside the {grid.warmup_steps} warmup steps: raise the budgets")
            grid.points.append(Point(f"d{d}_c{j}", d, grid.budgets[j], steps, main, start if j < top else 0))
    rung = max((p for p in grid.points if not p.branch_from), key=lambda p: (p.d_model, p.budget))
    for k in range(1, protocol.seeds):  # the largest rung's replicas: whole runs of their own
        grid.points.append(Point(f"{rung.name}_s{k}", rung.d_model, rung.budget, rung.steps, f"{rung.name}_s{k}",
                                 seed=k))
    return grid


def point_config(cfg: Config, grid: Grid, p: Point, run_dir: str) -> Config:
    """The config of point ``p``: the size (:func:`size_config`: heads, lr rule), one stage, WSD with fixed warmup,
    its length, its seed, no faults."""
    out = size_config(cfg, p.d_model, grid.protocol)
    out.stages = [StageConfig(name="main", start=0.0, mix=dict(cfg.stages[0].mix))]
    out.schedule.kind, out.schedule.unit, out.schedule.warmup_steps = "wsd", "steps", grid.warmup_steps
    out.train.steps, out.train.run_dir = p.steps, run_dir
    out.train.seed = cfg.train.seed + p.seed
    out.faults = []
    out.eval.ladder = ""
    validate(out)
    return out

