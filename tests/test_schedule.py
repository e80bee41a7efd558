"""Exact learning-rate values and stage resolution."""

import math

import pytest

from densetrain.config import ConfigError, ScheduleConfig, load_config
from densetrain.schedule import lr_at, lr_for, resolve_stages, stage_at, warmup_steps


def test_warmup_then_cosine_exact_values():
    sched = ScheduleConfig(kind="cosine", warmup_steps=1000)
    peak, lo, total = 1e-3, 1e-4, 10_000
    # First update already moves the weights; the last warmup step sits exactly at the peak.
    assert lr_at(0, sched, peak, lo, total) == pytest.approx(1e-6, rel=1e-12)
    assert lr_at(0, sched, peak, lo, total) > 0
    assert lr_at(499, sched, peak, lo, total) == pytest.approx(5e-4, rel=1e-12)
    assert lr_at(999, sched, peak, lo, total) == peak
    # Cosine midpoint: p = 0.5 -> (peak + min) / 2.
    mid = 999 + (total - 1000) // 2
    assert lr_at(mid, sched, peak, lo, total) == pytest.approx((peak + lo) / 2, rel=1e-9)
    assert lr_at(total - 1, sched, peak, lo, total) == pytest.approx(lo, rel=1e-12)
    vals = [lr_at(s, sched, peak, lo, total) for s in range(999, total)]
    assert all(a >= b for a, b in zip(vals, vals[1:])), "cosine must not increase after warmup"
    with pytest.raises(ValueError):
        lr_at(total, sched, peak, lo, total)


@pytest.mark.parametrize(
    "shape,f",
    [("linear", lambda p: 1 - p), ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))), ("1-sqrt", lambda p: 1 - math.sqrt(p))],
)
def test_wsd_stable_and_decay(shape, f):
    sched = ScheduleConfig(kind="wsd", warmup_steps=10, decay_fraction=0.2, decay_shape=shape)
    peak, lo, total = 2e-3, 0.0, 100
    assert lr_at(9, sched, peak, lo, total) == peak
    # Stable part: exactly the peak until the decay starts at step 80.
    assert all(lr_at(s, sched, peak, lo, total) == peak for s in range(10, 80))
    # Decay over steps 80..99 with p = (step - 79) / 20.
    for s in (80, 85, 90, 99):
        assert lr_at(s, sched, peak, lo, total) == pytest.approx(peak * f((s - 79) / 20), abs=1e-15)
    assert lr_at(99, sched, peak, lo, total) == pytest.approx(0.0, abs=1e-15)
    vals = [lr_at(s, sched, peak, lo, total) for s in range(80, 100)]
    assert all(a > b for a, b in zip(vals, vals[1:]))


def test_constant_and_warmup_fraction():
    sched = ScheduleConfig(kind="constant", warmup_steps=-1, warmup_fraction=0.005)
    assert warmup_steps(sched, 10_000) == 50
    assert warmup_steps(sched, 10) == 1  # at least one step
    assert lr_at(0, sched, 1.0, 0.0, 10) == 1.0  # W = 1: the first update is at the peak
    assert lr_at(9, sched, 1.0, 0.0, 10) == 1.0


def test_stage_table_resolution():
    cfg = load_config("tiny", overrides=[("train.steps", 200)])
    stages = resolve_stages(cfg)
    assert [s.name for s in stages] == ["main", "anneal", "long_context"]
    assert [s.start_step for s in stages] == [0, 170, 190]
    # Tokens per step stay fixed: 16 x 256 = 4 x 1024.
    assert [s.batch_size * s.seq_len for s in stages] == [4096] * 3
    assert stages[2].batch_size == 4 and stages[2].micro_batch_size == 2
    assert [s.rope_theta for s in stages] == [10000.0, 10000.0, 500000.0]
    assert stages[1].seq_len == 256  # inherited
    assert sum(stages[0].mix.values()) == pytest.approx(1.0)
    assert stage_at(169, stages).name == "main" and stage_at(170, stages).name == "anneal"
    assert stage_at(189, stages).name == "anneal" and stage_at(190, stages).name == "long_context"
    assert lr_for(0, cfg, stages) > 0


def test_stage_table_too_short_for_steps():
    cfg = load_config("tiny", overrides=[("train.steps", 3)])
    with pytest.raises(ValueError, match="too small"):
        resolve_stages(cfg)


def test_stage_seq_len_must_divide_tokens_per_step():
    with pytest.raises(ConfigError, match=r"stages\[2\].seq_len"):
        load_config("tiny", overrides=[("stages.2.seq_len", 1000)])
