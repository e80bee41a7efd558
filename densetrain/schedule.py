"""Pure functions of the step: the learning rate ``lr(step)`` and the active stage ``stage_at(step)``.

Both are rebuilt from the config on every (re)start and never read back from optimizer state, so a
resumed run gets exactly the values of an uninterrupted one.

Units: the run is always ``train.steps`` steps long. A *step* is one iteration of the loop (a batch
drawn, gradients computed, a verdict), whether its update is applied or skipped by the guard: the
schedule counts iterations, not applied optimizer updates, so a run with skipped steps ends at the
same step with the same final lr. With ``schedule.unit = 'steps'`` (default) stage starts,
warmup/decay fractions and the lr curve are measured in steps; with ``'tokens'`` they are measured
in tokens consumed, where step ``s`` consumes its stage's
``batch_tokens``. The two coincide exactly when every stage has the same ``batch_tokens``; they
differ when a stage changes the global batch (e.g. a batch-size ramp), see :func:`resolve_stages`
and :func:`lr_tokens`.

Step convention: ``step`` is the 0-based index of the iteration about to run; a run of ``steps``
iterations uses ``step = 0 .. steps - 1``. Warmup of ``W`` steps uses
``lr(step) = peak_lr * (step + 1) / W`` for ``step < W``, so the first step already has
``lr = peak_lr / W > 0`` and ``lr(W - 1) = peak_lr`` exactly (the last warmup step reaches the peak).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from fractions import Fraction

from densetrain.config import Config, ScheduleConfig
from densetrain.config.schema import RopeScalingConfig


def warmup_steps(sched: ScheduleConfig, total_steps: int) -> int:
    """Warmup length in steps (iterations): ``schedule.warmup_steps`` or ``warmup_fraction * total``, at least 1."""
    if sched.warmup_steps >= 0:
        return min(max(sched.warmup_steps, 1), total_steps)
    return min(max(1, round(sched.warmup_fraction * total_steps)), total_steps)


def lr_at(step: int, sched: ScheduleConfig, peak_lr: float, min_lr: float, total_steps: int) -> float:
    """Learning rate of step ``step`` (0-based iteration) before any stage multiplier, in steps.

    - warmup (``step < W``): ``peak * (step + 1) / W`` (linear from 0; the first step's lr > 0).
    - cosine: ``min + (peak - min) * 0.5 * (1 + cos(pi * p))`` with
      ``p = (step - (W - 1)) / (total - W)``, so ``lr(W - 1) = peak`` and ``lr(total - 1) = min``
      (Loshchilov & Hutter 2017, SGDR, without restarts).
    - wsd: ``peak`` until the decay starts at ``D = total - round(decay_fraction * total)``, then decays
      over the remaining steps to reach ``min`` at the last step with shape ``linear``
      (``1 - p``), ``cosine`` (``0.5 (1 + cos(pi p))``) or ``1-sqrt`` (``1 - sqrt(p)``), where
      ``p = (step - D + 1) / (total - D)`` (Hägele et al. 2024, "Scaling Laws and Compute-Optimal
      Training Beyond Fixed Training Durations"; Hu et al. 2024, MiniCPM).
    - constant: ``peak`` after warmup.

    This is the ``schedule.unit = 'steps'`` schedule; :func:`lr_tokens` is the same curve over tokens.

    Raises:
        ValueError: ``step`` outside ``[0, total_steps)``.
    """
    if not 0 <= step < total_steps:
        raise ValueError(f"step {step} outside [0, {total_steps})")
    return _lr_curve(step + 1, total_steps, warmup_steps(sched, total_steps), 1, sched, peak_lr, min_lr)


def _lr_curve(done: int, total: int, warmup: int, min_decay: int, sched: ScheduleConfig, peak_lr: float,
              min_lr: float) -> float:
    """The schedule's shape in integer progress units (steps, or token quanta in token mode).

    ``done`` is the progress at the *end* of the step whose lr is wanted (``1..total``), ``warmup``
    the warmup length and ``min_decay`` the shortest WSD decay, all in the same unit. Integer inputs
    keep the arithmetic exact up to the final float operations, so step and token mode agree to the
    last bit when they describe the same run.
    """
    if done <= warmup:
        return peak_lr * done / warmup
    if sched.kind == "constant":
        return peak_lr
    if sched.kind == "cosine":
        span = total - warmup
        p = (done - warmup) / span if span > 0 else 1.0
        return min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))
    if sched.kind == "wsd":
        n_decay = max(min_decay, round(sched.decay_fraction * total))
        d = max(warmup, total - n_decay)
        if done <= d:
            return peak_lr
        p = (done - d) / (total - d)
        if sched.decay_shape == "linear":
            f = 1.0 - p
        elif sched.decay_shape == "cosine":
            f = 0.5 * (1.0 + math.cos(math.pi * p))
        else:  # "1-sqrt"
            f = 1.0 - math.sqrt(p)
        return min_lr + (peak_lr - min_lr) * f
    raise ValueError(f"unknown schedule.kind '{sched.kind}'")


@dataclass(frozen=True)
class Stage:
    """A resolved row of the stage table: every field set (inherited values filled in).

    Attributes:
        index: position in the table. name: stage name.
        start_step: first optimizer step of the stage (see :func:`stage_start_steps`).
        mix: source name -> normalised weight (sums to 1).
        seq_len: tokens per sequence. rope_theta: RoPE base.
        batch_size: sequences per optimizer step (global) = batch_tokens / seq_len.
        micro_batch_size: sequences per forward per rank: ``train.micro_batch_size`` scaled by
            ``train.seq_len / seq_len`` (min 1), lowered until it divides batch_size.
        lr_mult: multiplier on lr(step).
        batch_tokens: tokens per optimizer step (global batch in tokens).
        rewarmup_steps: lr re-warmup length at the stage's start (0: none).
        start_tokens: planned tokens consumed before the stage's first step.
        rope_scaling: RoPE frequency scaling (type 'none' or a resolved table; never '').
        document_mask: attention stays within documents (the stage sets it, or it is longer than
            ``train.seq_len`` and ``model.document_mask`` is on). reset_positions: RoPE positions
            restart per document (``document_mask and train.reset_positions``).
        shuffle_seed: seed of the per-epoch window permutation (``train.seed`` when ``data.shuffle``),
            None for file order (:class:`densetrain.data.mixture.MixtureSampler`).
    """

    index: int
    name: str
    start_step: int
    mix: dict[str, float]
    seq_len: int
    rope_theta: float
    batch_size: int
    micro_batch_size: int
    lr_mult: float
    batch_tokens: int = 0
    rewarmup_steps: int = 0
    start_tokens: int = 0
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    document_mask: bool = False
    reset_positions: bool = False
    shuffle_seed: int | None = None


def stage_start_steps(cfg: Config, batch_tokens: list[int]) -> list[int]:
    """First step of each row of ``cfg.stages``, given each row's (inherited) batch_tokens.

    - ``schedule.unit = 'steps'``: ``round(start_i * train.steps)``.
    - ``schedule.unit = 'tokens'``: the run stays ``train.steps`` steps long and stage ``i`` gets the
      fraction ``f_i = start_{i+1} - start_i`` of its tokens (``start_n = 1``). Were boundaries allowed
      to fall inside a step, stage ``i`` would last ``f_i * T / B_i`` steps for ``B_i`` tokens per step,
      and ``sum_i f_i * T / B_i = train.steps`` fixes the token total ``T`` in closed form (no
      fixed-point search, which can oscillate between two integer solutions). Stage ``i`` therefore
      starts at ``round(train.steps * phi_i)`` with ``phi_i = sum_{j<i} (f_j / B_j) / sum_j (f_j / B_j)``,
      the step boundary nearest to where its token share begins. ``phi_i`` is computed exactly
      (``fractions.Fraction``) and rounded like step mode, so with equal ``B_i`` it is bit-for-bit
      step mode (``phi_i = start_i``). Each boundary is within half a step of the exact token split.
    """
    steps = cfg.train.steps
    if cfg.schedule.unit != "tokens":
        return [round(st.start * steps) for st in cfg.stages]
    fr = [Fraction(st.start) for st in cfg.stages] + [Fraction(1)]
    share = [(fr[j + 1] - fr[j]) / b for j, b in enumerate(batch_tokens)]  # steps per unit of T, per stage
    whole = sum(share, Fraction(0))
    out, acc = [], Fraction(0)
    for j in range(len(cfg.stages)):
        out.append(round(float(steps * acc / whole)))
        acc += share[j]
    return out


def resolve_stages(cfg: Config, available: set[str] | None = None) -> list[Stage]:
    """Fill inherited fields of ``cfg.stages`` and convert start fractions to steps.

    The global batch of a stage is ``batch_tokens`` tokens per optimizer step (inherited; the first
    stage defaults to ``train.batch_size * train.seq_len``), i.e. ``batch_tokens / seq_len``
    sequences: a stage with a longer seq_len and the same batch_tokens uses proportionally fewer
    sequences (and proportionally smaller micro-batches, so memory per forward stays about the same);
    a stage with larger batch_tokens takes more micro-batches (gradient accumulation). A stage with an
    empty mix in the first row means "all sources, equal weight". Sources not in ``available`` (when
    given: those with prepared data) are dropped from every mix and the remaining weights
    renormalised. Start steps follow :func:`stage_start_steps` (in steps or in tokens). A
    rope_scaling of type '' inherits the previous stage's; document masking is on in a stage that
    sets it and, with ``model.document_mask``, in every stage longer than ``train.seq_len``.

    Raises:
        ValueError: two stages would start at the same step (too few steps for the table), a
            stage's mix has no available source left, batch_tokens is not a multiple of seq_len
            (normally caught by ``validate``), a stage's rewarmup_steps exceeds its length, or (token
            mode) a stage's token share rounds to no step at all.
    """
    t = cfg.train
    default_mix = {s.name: 1.0 for s in cfg.data.sources}
    rows = []
    mix, seq_len, theta, batch_tokens = default_mix, t.seq_len, cfg.model.rope_theta, t.batch_size * t.seq_len
    scaling, scalings = cfg.model.rope_scaling, []
    for i, st in enumerate(cfg.stages):
        mix = dict(st.mix) if st.mix else mix
        seq_len = st.seq_len or seq_len
        theta = st.rope_theta or theta
        scaling = st.rope_scaling if st.rope_scaling.type else scaling
        scalings.append(dataclasses.replace(scaling))
        batch_tokens = st.batch_tokens or batch_tokens
        usable = {k: v for k, v in mix.items() if v > 0 and (available is None or k in available)}
        if not usable:
            raise ValueError(f"stages[{i}] '{st.name}': no source of its mix {sorted(mix)} has data")
        if batch_tokens % seq_len:
            raise ValueError(f"stages[{i}] '{st.name}': batch_tokens {batch_tokens} is not a multiple of "
                             f"seq_len {seq_len}")
        total_w = sum(usable.values())
        rows.append(({k: v / total_w for k, v in usable.items()}, seq_len, theta, batch_tokens))
    starts = stage_start_steps(cfg, [r[3] for r in rows])
    ends = starts[1:] + [t.steps]
    unit = ""
    if cfg.schedule.unit == "tokens":
        unit = " (schedule.unit='tokens': starts are fractions of the run's tokens)"
    out: list[Stage] = []
    start_tokens = 0
    for i, (st, (norm_mix, seq_len, theta, batch_tokens)) in enumerate(zip(cfg.stages, rows)):
        start = starts[i]
        if out and start <= out[-1].start_step:
            raise ValueError(
                f"stages[{i}] '{st.name}' starts at step {start}, not after stage '{out[-1].name}' "
                f"(step {out[-1].start_step}); train.steps={t.steps} is too small for this stage table{unit}"
            )
        if start >= t.steps:  # a stage that never runs is a config mistake, not something to drop silently
            share = f"its token share is less than half a step at batch_tokens {batch_tokens}" if unit else \
                f"start {st.start} x {t.steps} steps rounds to the end of the run"
            raise ValueError(f"stages[{i}] '{st.name}' would start at step {start} >= train.steps={t.steps}: "
                             f"{share}{unit}")
        if st.rewarmup_steps > ends[i] - start:
            raise ValueError(f"stages[{i}] '{st.name}': rewarmup_steps ({st.rewarmup_steps}) is longer than the "
                             f"stage ({ends[i] - start} steps, {start}..{ends[i] - 1})")
        if out:
            start_tokens += (start - out[-1].start_step) * out[-1].batch_tokens
        batch = batch_tokens // seq_len
        micro = max(1, t.micro_batch_size * t.seq_len // seq_len)
        micro = min(micro, batch)
        while batch % micro:  # keep an integer number of micro-batches
            micro -= 1
        masked = st.document_mask or (cfg.model.document_mask and seq_len > t.seq_len)
        out.append(Stage(i, st.name, start, norm_mix, seq_len, theta, batch, micro, st.lr_mult,
                         batch_tokens=batch_tokens, rewarmup_steps=st.rewarmup_steps, start_tokens=start_tokens,
                         rope_scaling=scalings[i], document_mask=masked,
                         reset_positions=masked and t.reset_positions,
                         shuffle_seed=t.seed if cfg.data.shuffle else None))
    return out


def stage_at(step: int, stages: list[Stage]) -> Stage:
    """The stage that step ``step`` belongs to (the last one whose start_step <= step)."""
    cur = stages[0]
    for st in stages:
        if st.start_step <= step:
            cur = st
    return cur


def tokens_before(step: int, stages: list[Stage]) -> int:
    """Planned tokens consumed by steps ``0 .. step - 1`` (step ``s`` consumes its stage's batch_tokens)."""
    total = 0
    for st, nxt in zip(stages, [*stages[1:], None]):
        end = step if nxt is None else min(step, nxt.start_step)
        if end > st.start_step:
            total += (end - st.start_step) * st.batch_tokens
    return total


def lr_tokens(step: int, cfg: Config, stages: list[Stage]) -> float:
    """Learning rate of step ``step`` before stage multipliers, with progress counted in tokens.

    The curve of :func:`lr_at` with every step count replaced by a token count: progress of step
    ``s`` is the tokens consumed through the end of that step, ``tokens_before(s + 1)``, out of the
    run's ``T = tokens_before(train.steps)``. Warmup is ``warmup_fraction * T`` tokens (at least the
    first step's tokens) or, with ``warmup_steps >= 0``, the tokens of the first ``warmup_steps``
    steps; the WSD decay is the last ``decay_fraction * T`` tokens (at least the last step's). So
    ``lr(last step) = min_lr``, and the peak is reached exactly when warmup ends on a step boundary.
    Tokens are counted in quanta of ``gcd(batch_tokens of all stages)``, which keeps every position an
    integer; with equal batch_tokens a quantum is one step and the values equal :func:`lr_at` bit for
    bit. Pure function of the config and the resolved stages.

    Raises:
        ValueError: ``step`` outside ``[0, train.steps)``.
    """
    steps, sched = cfg.train.steps, cfg.schedule
    if not 0 <= step < steps:
        raise ValueError(f"step {step} outside [0, {steps})")
    q = math.gcd(*(st.batch_tokens for st in stages))
    total = tokens_before(steps, stages) // q
    if sched.warmup_steps >= 0:
        warm = tokens_before(warmup_steps(sched, steps), stages) // q
    else:
        warm = min(max(stages[0].batch_tokens // q, round(sched.warmup_fraction * total)), total)
    min_decay = stage_at(steps - 1, stages).batch_tokens // q
    done = tokens_before(step + 1, stages) // q
    return _lr_curve(done, total, warm, min_decay, sched, cfg.optim.peak_lr, cfg.optim.min_lr)


def lr_for(step: int, cfg: Config, stages: list[Stage]) -> float:
    """Learning rate of step ``step``: the schedule (in steps or tokens) x the stage's lr_mult x re-warmup.

    Re-warmup (``rewarmup_steps = R > 0``): the ``k``-th step of the stage (``k = step - start_step``)
    with ``k < R`` uses ``scheduled * (k + 1) / R``, a linear ramp from 0 (the first step's is already
    > 0) to the scheduled value, as studied for continual pre-training by Gupta et al. 2023,
    "Continual Pre-Training of Large Language Models: How to (re)warm your model?". ``R`` counts steps
    in both units.
    """
    if cfg.schedule.unit == "tokens":
        base = lr_tokens(step, cfg, stages)
    else:
        base = lr_at(step, cfg.schedule, cfg.optim.peak_lr, cfg.optim.min_lr, cfg.train.steps)
    st = stage_at(step, stages)
    lr = base * st.lr_mult
    k = step - st.start_step
    if k < st.rewarmup_steps:
        lr = lr * (k + 1) / st.rewarmup_steps
    return lr
