"""Pure functions of the step: the learning rate ``lr(step)`` and the active stage ``stage_at(step)``.

Both are rebuilt from the config on every (re)start and never read back from optimizer state, so a
resumed run gets exactly the values of an uninterrupted one.

Step convention: ``step`` is the 0-based index of the optimizer update about to be taken; a run of
``steps`` updates uses ``step = 0 .. steps - 1``. Warmup of ``W`` steps uses
``lr(step) = peak_lr * (step + 1) / W`` for ``step < W``, so the first update already has
``lr = peak_lr / W > 0`` and ``lr(W - 1) = peak_lr`` exactly (the last warmup step reaches the peak).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from densetrain.config import Config, ScheduleConfig, StageConfig


def warmup_steps(sched: ScheduleConfig, total_steps: int) -> int:
    """Warmup length in optimizer steps: ``schedule.warmup_steps`` or ``warmup_fraction * total``, at least 1."""
    if sched.warmup_steps >= 0:
        return min(max(sched.warmup_steps, 1), total_steps)
    return min(max(1, round(sched.warmup_fraction * total_steps)), total_steps)


def lr_at(step: int, sched: ScheduleConfig, peak_lr: float, min_lr: float, total_steps: int) -> float:
    """Learning rate of optimizer update ``step`` (0-based) before any stage multiplier.

    - warmup (``step < W``): ``peak * (step + 1) / W`` (linear from 0; first update > 0).
    - cosine: ``min + (peak - min) * 0.5 * (1 + cos(pi * p))`` with
      ``p = (step - (W - 1)) / (total - W)``, so ``lr(W - 1) = peak`` and ``lr(total - 1) = min``
      (Loshchilov & Hutter 2017, SGDR, without restarts).
    - wsd: ``peak`` until the decay starts at ``D = total - round(decay_fraction * total)``, then decays
      over the remaining steps to reach ``min`` at the last step with shape ``linear``
      (``1 - p``), ``cosine`` (``0.5 (1 + cos(pi p))``) or ``1-sqrt`` (``1 - sqrt(p)``), where
      ``p = (step - D + 1) / (total - D)`` (Hägele et al. 2024, "Scaling Laws and Compute-Optimal
      Training Beyond Fixed Training Durations"; Hu et al. 2024, MiniCPM).
    - constant: ``peak`` after warmup.

    Raises:
        ValueError: ``step`` outside ``[0, total_steps)``.
    """
    if not 0 <= step < total_steps:
        raise ValueError(f"step {step} outside [0, {total_steps})")
    w = warmup_steps(sched, total_steps)
    if step < w:
        return peak_lr * (step + 1) / w
    if sched.kind == "constant":
        return peak_lr
    if sched.kind == "cosine":
        span = total_steps - w
        p = (step - (w - 1)) / span if span > 0 else 1.0
        return min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))
    if sched.kind == "wsd":
        n_decay = max(1, round(sched.decay_fraction * total_steps))
        d = max(w, total_steps - n_decay)
        if step < d:
            return peak_lr
        p = (step - d + 1) / (total_steps - d)
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
        start_step: first optimizer step of the stage (``round(start * total_steps)``).
        mix: source name -> normalised weight (sums to 1).
        seq_len: tokens per sequence. rope_theta: RoPE base.
        batch_size: sequences per optimizer step (global) = tokens per step / seq_len.
        micro_batch_size: sequences per forward per rank, scaled like batch_size (min 1).
        lr_mult: multiplier on lr(step).
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


def resolve_stages(cfg: Config, available: set[str] | None = None) -> list[Stage]:
    """Fill inherited fields of ``cfg.stages`` and convert start fractions to steps.

    Tokens per optimizer step (``train.batch_size * train.seq_len``) stay constant across stages: a
    stage with a longer seq_len uses proportionally fewer sequences (and proportionally smaller
    micro-batches, so memory per forward stays about the same). A stage with an empty mix in the
    first row means "all sources, equal weight". Sources not in ``available`` (when given: those
    with prepared data) are dropped from every mix and the remaining weights renormalised.

    Raises:
        ValueError: two stages would start at the same step (too few steps for the table), or a
            stage's mix has no available source left.
    """
    t = cfg.train
    tokens_per_step = t.batch_size * t.seq_len
    default_mix = {s.name: 1.0 for s in cfg.data.sources}
    out: list[Stage] = []
    mix, seq_len, theta = default_mix, t.seq_len, cfg.model.rope_theta
    for i, st in enumerate(cfg.stages):
        mix = dict(st.mix) if st.mix else mix
        seq_len = st.seq_len or seq_len
        theta = st.rope_theta or theta
        usable = {k: v for k, v in mix.items() if v > 0 and (available is None or k in available)}
        if not usable:
            raise ValueError(f"stages[{i}] '{st.name}': no source of its mix {sorted(mix)} has data")
        total_w = sum(usable.values())
        norm_mix = {k: v / total_w for k, v in usable.items()}
        start = round(st.start * t.steps)
        if out and start <= out[-1].start_step:
            raise ValueError(
                f"stages[{i}] '{st.name}' starts at step {start}, not after stage '{out[-1].name}' "
                f"(step {out[-1].start_step}); train.steps={t.steps} is too small for this stage table"
            )
        batch = tokens_per_step // seq_len
        micro = max(1, t.micro_batch_size * t.seq_len // seq_len)
        micro = min(micro, batch)
        while batch % micro:  # keep an integer number of micro-batches
            micro -= 1
        out.append(Stage(i, st.name, start, norm_mix, seq_len, theta, batch, micro, st.lr_mult))
    return out


def stage_at(step: int, stages: list[Stage]) -> Stage:
    """The stage that optimizer update ``step`` belongs to (the last one whose start_step <= step)."""
    cur = stages[0]
    for st in stages:
        if st.start_step <= step:
            cur = st
    return cur


def lr_for(step: int, cfg: Config, stages: list[Stage]) -> float:
    """Scheduled learning rate of update ``step`` times the active stage's lr_mult."""
    base = lr_at(step, cfg.schedule, cfg.optim.peak_lr, cfg.optim.min_lr, cfg.train.steps)
    return base * stage_at(step, stages).lr_mult
