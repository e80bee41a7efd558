"""Exact learning-rate values and stage resolution."""

import math

import pytest

from densetrain.config import ScheduleConfig, load_config
from densetrain.errors import ConfigError
from densetrain.schedule import lr_at, lr_for, resolve_stages, stage_at, tokens_before, warmup_steps


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
    [("linear", lambda p: 1 - p), ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))),
     ("1-sqrt", lambda p: 1 - math.sqrt(p))],
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
    with pytest.raises(ValueError, match="train.steps=3"):
        resolve_stages(cfg)


def test_stage_seq_len_must_divide_tokens_per_step():
    with pytest.raises(ConfigError, match=r"stages\[2\].seq_len"):
        load_config("tiny", overrides=[("stages.2.seq_len", 1000)])


# --------------------------------------------------------------------------------------------------
# Per-stage batch_tokens, token-based progress, re-warmup
# --------------------------------------------------------------------------------------------------


def _table(steps, stages, **over):
    """The tiny preset (seq_len 256, batch 16, micro 8) with its stage table replaced."""
    ov = [("train.steps", steps), ("stages", stages)] + list(over.items())
    return load_config("tiny", overrides=ov)


def test_batch_tokens_inherit_and_set_sequences_per_step():
    cfg = load_config("tiny", overrides=[("train.steps", 200), ("stages.1.batch_tokens", 8192)])
    stages = resolve_stages(cfg)
    # main: default 16 x 256; anneal: 8192 / 256 = 32 sequences; long_context inherits 8192 at 1024 -> 8.
    assert [s.batch_tokens for s in stages] == [4096, 8192, 8192]
    assert [s.batch_size for s in stages] == [16, 32, 8]
    # Micro-batches scale with seq_len only (8 at 256, 2 at 1024): a bigger batch means more accumulation.
    assert [s.micro_batch_size for s in stages] == [8, 8, 2]
    assert [s.start_step for s in stages] == [0, 170, 190]  # step mode: starts unchanged
    assert [s.start_tokens for s in stages] == [0, 170 * 4096, 170 * 4096 + 20 * 8192]
    assert tokens_before(200, stages) == 170 * 4096 + 30 * 8192
    assert tokens_before(171, stages) == 170 * 4096 + 8192


@pytest.mark.parametrize(
    "overrides,message",
    [
        ([("stages.1.batch_tokens", 1000)],
         "stages[1].batch_tokens (1000) must be a multiple of the stage's seq_len (256)"),
        ([("stages.2.batch_tokens", 2560)],
         "stages[2].batch_tokens (2560) must be a multiple of the stage's seq_len (1024)"),
        ([("stages.1.batch_tokens", 4352)], "stages[2].seq_len (1024) must divide the inherited batch_tokens (4352)"),
        ([("stages.1.batch_tokens", -256)], "stages[1].batch_tokens must be >= 0 (0 inherits), got -256"),
        ([("schedule.unit", "tokenz")], "schedule.unit must be steps or tokens, got 'tokenz'"),
        ([("stages.0.rewarmup_steps", 5)], "stages[0].rewarmup_steps must be 0"),
        ([("stages.1.rewarmup_steps", -1)], "stages[1].rewarmup_steps must be >= 0, got -1"),
    ],
)
def test_stage_batch_and_unit_validation(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", overrides=overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "sched",
    [
        {"schedule.kind": "cosine", "schedule.warmup_steps": -1, "schedule.warmup_fraction": 0.02},
        {"schedule.kind": "cosine", "schedule.warmup_steps": 7},
        {"schedule.kind": "wsd", "schedule.warmup_steps": -1, "schedule.warmup_fraction": 0.05,
         "schedule.decay_fraction": 0.2, "schedule.decay_shape": "1-sqrt"},
        {"schedule.kind": "wsd", "schedule.warmup_steps": 3, "schedule.decay_fraction": 0.15,
         "schedule.decay_shape": "cosine"},
        {"schedule.kind": "constant", "schedule.warmup_steps": -1, "schedule.warmup_fraction": 0.005},
    ],
)
def test_token_unit_equals_step_unit_when_batch_tokens_equal(sched):
    # batch_tokens set explicitly (equal) so the token path runs with a quantum of 4096 tokens; a
    # seq_len change and a re-warmup / lr_mult stage are included. Starts 0.25 and 0.85 hit ties.
    table = [
        {"name": "main", "start": 0.0, "batch_tokens": 4096},
        {"name": "anneal", "start": 0.25, "lr_mult": 0.5, "rewarmup_steps": 2},
        {"name": "long", "start": 0.85, "seq_len": 1024, "batch_tokens": 4096},
    ]
    for steps in (10, 22, 37, 101, 600):
        by_step = _table(steps, table, **sched)
        by_tok = _table(steps, table, **sched, **{"schedule.unit": "tokens"})
        s1, s2 = resolve_stages(by_step), resolve_stages(by_tok)
        assert [s.start_step for s in s1] == [s.start_step for s in s2] == [0, round(0.25 * steps), round(0.85 * steps)]
        assert [lr_for(k, by_step, s1) for k in range(steps)] == [lr_for(k, by_tok, s2) for k in range(steps)], steps


def test_token_unit_with_batch_ramp_exact_boundaries():
    # Token shares 1/4, 1/4, 1/2 at 512, 1024, 2048 tokens per step (quanta 1, 2, 4 of 512): the
    # steps per stage are proportional to 1/4 : 1/8 : 1/8, so stages start at steps 0, 10, 15 of 20.
    table = [
        {"name": "a", "start": 0.0, "batch_tokens": 512},
        {"name": "b", "start": 0.25, "batch_tokens": 1024},
        {"name": "c", "start": 0.5, "batch_tokens": 2048},
    ]
    cfg = _table(20, table, **{"schedule.unit": "tokens"})
    stages = resolve_stages(cfg)
    assert [s.start_step for s in stages] == [0, 10, 15]
    assert [s.batch_size for s in stages] == [2, 4, 8]
    total = tokens_before(20, stages)
    assert total == 10 * 512 + 5 * 1024 + 5 * 2048 == 20480
    assert [s.start_tokens / total for s in stages] == [0.0, 0.25, 0.5]  # exact token split
    # Step mode on the same table: 0, 5, 10 (a quarter and a half of the steps).
    assert [s.start_step for s in resolve_stages(_table(20, table))] == [0, 5, 10]


def test_token_unit_lr_is_a_function_of_tokens():
    # Batch doubles at the token midpoint: 512 -> 1024 tokens/step. Shares 1/2 : 1/2 -> steps 1/512 :
    # 1/1024, so stage b starts at round(10 * 2/3) = 7. Progress in quanta of 512 tokens after each
    # update: 1..7, then 9, 11, 13 (T = 13 quanta = 6656 tokens).
    table = [{"name": "a", "start": 0.0, "batch_tokens": 512}, {"name": "b", "start": 0.5, "batch_tokens": 1024}]
    peak, lo = 1e-3, 1e-4
    base = {"optim.peak_lr": peak, "optim.min_lr": lo, "schedule.unit": "tokens"}
    done = [1, 2, 3, 4, 5, 6, 7, 9, 11, 13]

    cfg = _table(10, table, **base,
                 **{"schedule.kind": "cosine", "schedule.warmup_steps": -1, "schedule.warmup_fraction": 0.1})
    stages = resolve_stages(cfg)
    assert [s.start_step for s in stages] == [0, 7] and tokens_before(10, stages) == 6656
    assert [tokens_before(k + 1, stages) // 512 for k in range(10)] == done
    # warmup = max(1 step, round(0.1 * 13)) = 1 quantum; cosine over the remaining 12 quanta.
    want = [peak] + [lo + (peak - lo) * 0.5 * (1 + math.cos(math.pi * (d - 1) / 12)) for d in done[1:]]
    got = [lr_for(k, cfg, stages) for k in range(10)]
    assert got == pytest.approx(want, rel=1e-12)
    assert got[-1] == pytest.approx(lo, rel=1e-12)
    assert got[7] == pytest.approx(lo + (peak - lo) * 0.5 * (1 + math.cos(math.pi * 8 / 12)), rel=1e-12)

    # WSD: decay = last round(0.2 * 13) = 3 quanta (D = 10): stable through update 7 (9 quanta),
    # update 8 at p = 1/3, update 9 at p = 1. Explicit warmup_steps=2 -> the first 2 steps' tokens.
    cfg = _table(10, table, **base,
                 **{"schedule.kind": "wsd", "schedule.warmup_steps": 2, "schedule.decay_fraction": 0.2})
    stages = resolve_stages(cfg)
    got = [lr_for(k, cfg, stages) for k in range(10)]
    assert got[:8] == [peak / 2] + [peak] * 7
    assert got[8] == pytest.approx(lo + (peak - lo) * (2 / 3), rel=1e-12)
    assert got[9] == pytest.approx(lo, rel=1e-12)
    # Step mode would decay over the last 2 steps and switch at step 5.
    steps_cfg = _table(10, table, **{**base, "schedule.unit": "steps"},
                       **{"schedule.kind": "wsd", "schedule.warmup_steps": 2, "schedule.decay_fraction": 0.2})
    st2 = resolve_stages(steps_cfg)
    assert [s.start_step for s in st2] == [0, 5]
    assert [lr_for(k, steps_cfg, st2) for k in range(10)][7:] == [peak, pytest.approx(lo + (peak - lo) * 0.5), lo]


def test_token_unit_rejects_impossible_tables():
    # A last stage whose half of the tokens at 64x the batch is < half a step of 10.
    table = [{"name": "a", "start": 0.0, "batch_tokens": 256}, {"name": "b", "start": 0.5, "batch_tokens": 256 * 64}]
    with pytest.raises(ValueError, match=r"stages\[1\] 'b' would start at step 10 >= train.steps=10"):
        resolve_stages(_table(10, table, **{"schedule.unit": "tokens"}))
    # A middle stage squeezed to zero steps.
    table = [{"name": "a", "start": 0.0, "batch_tokens": 256}, {"name": "b", "start": 0.5, "batch_tokens": 256 * 64},
             {"name": "c", "start": 0.52, "batch_tokens": 256}]
    with pytest.raises(ValueError, match=r"too small for this stage table \(schedule.unit='tokens'"):
        resolve_stages(_table(10, table, **{"schedule.unit": "tokens"}))


def test_rewarmup_exact_values():
    peak = 1e-3
    table = [{"name": "main", "start": 0.0}, {"name": "anneal", "start": 0.5, "rewarmup_steps": 4, "lr_mult": 0.5},
             {"name": "long", "start": 0.8}]
    cfg = _table(20, table, **{"schedule.kind": "constant", "schedule.warmup_steps": 2, "optim.peak_lr": peak})
    stages = resolve_stages(cfg)
    assert [s.start_step for s in stages] == [0, 10, 16] and [s.rewarmup_steps for s in stages] == [0, 4, 0]
    lrs = [lr_for(k, cfg, stages) for k in range(20)]
    assert lrs[:2] == [peak / 2, peak] and lrs[2:10] == [peak] * 8
    # Updates 10..13 ramp from 0 (first > 0) to the scheduled peak * 0.5; not inherited by 'long'.
    assert lrs[10:14] == pytest.approx([1.25e-4, 2.5e-4, 3.75e-4, 5e-4], rel=1e-15)
    assert lrs[14:16] == [5e-4, 5e-4] and lrs[16:] == [peak] * 4
    # On a decaying schedule the ramp multiplies the scheduled value of that step.
    cfg = _table(20, table, **{"schedule.kind": "cosine", "schedule.warmup_steps": 2})
    stages = resolve_stages(cfg)
    for k in range(10, 14):
        sched = lr_at(k, cfg.schedule, cfg.optim.peak_lr, cfg.optim.min_lr, 20) * 0.5
        assert lr_for(k, cfg, stages) == sched * (k - 10 + 1) / 4
    assert lr_for(14, cfg, stages) == lr_at(14, cfg.schedule, cfg.optim.peak_lr, cfg.optim.min_lr, 20) * 0.5


def test_rewarmup_longer_than_stage_is_rejected():
    table = [{"name": "main", "start": 0.0}, {"name": "anneal", "start": 0.5, "rewarmup_steps": 6},
             {"name": "long", "start": 0.7}]
    msg = r"stages\[1\] 'anneal': rewarmup_steps \(6\) is longer than the stage \(4 steps, 10..13\)"
    with pytest.raises(ValueError, match=msg):
        resolve_stages(_table(20, table))


def test_stage_that_would_never_run_is_an_error():
    # long_context starts at 0.95: with 10 steps it would start at round(9.5) = 10, i.e. never.
    cfg = load_config("tiny", overrides=[("train.steps", 10)])
    with pytest.raises(ValueError, match=r"stages\[2\] 'long_context' would start at step 10 >= train.steps=10"):
        resolve_stages(cfg)


def test_stages_carry_the_data_order_and_the_attention_rule():
    table = [{"name": "main", "start": 0.0}, {"name": "long", "start": 0.5, "seq_len": 1024}]
    shuffled = resolve_stages(_table(10, table, **{"train.seed": 5}))
    assert [s.shuffle_seed for s in shuffled] == [5, 5]
    assert [(s.document_mask, s.reset_positions) for s in shuffled] == [(False, False), (True, True)]
    ordered = resolve_stages(_table(10, table, **{"data.shuffle": False}))
    assert [s.shuffle_seed for s in ordered] == [None, None]
