"""densetrain.law.forecast: a run's final loss forecast from its own validations (issue 42, item 4), on curves
generated from the form with known parameters; the known sharp changes the alarm waits out (item 5)."""

from __future__ import annotations

import numpy as np
import pytest

from densetrain.config import load_config
from densetrain.law import schedule_areas
from densetrain.law.forecast import ANNEAL_SEEN, RunCurve, fit_run_curve, forecast
from densetrain.schedule import resolve_stages
from densetrain.train.watch.curve import sharp_changes

TRUE = RunCurve(E=2.0, B=40.0, beta=0.3, C=0.6)
STEPS, TOKENS = 2000, 65536.0


def areas(kind: str) -> tuple[np.ndarray, np.ndarray]:
    """S1, S2 of a 2000-step run: 20 warmup steps, then WSD (stable, last 20% linear to 0.1x) or cosine."""
    i = np.arange(STEPS)
    warm = np.minimum((i + 1) / 20, 1.0)
    if kind == "wsd":
        decay = np.clip((i - 0.8 * STEPS) / (0.2 * STEPS), 0, 1)
        lr = warm * (1 - 0.9 * decay)
    else:
        lr = warm * (0.1 + 0.45 * (1 + np.cos(np.pi * np.clip((i - 20) / (STEPS - 20), 0, 1))))
    return schedule_areas(lr, TOKENS, 1.0)


@pytest.mark.parametrize("kind", ["wsd", "cosine"])
def test_forecast_from_a_quarter_of_the_run(kind):
    s1, s2 = areas(kind)
    steps = np.arange(40, STEPS + 1, 40)
    loss = TRUE.loss(s1[steps - 1], s2[steps - 1]) * (1 + np.random.default_rng(0).normal(0, 5e-4, len(steps)))
    final = float(TRUE.loss(s1[-1], s2[-1]))
    quarter = steps <= STEPS // 4
    f = forecast(s1, s2, steps[quarter], loss[quarter], c_prior=TRUE.C)
    assert f["at_step"] == 480 and abs(f["predicted"] / final - 1) < 0.005, (f["predicted"], final)
    assert f["interval"][0] <= final <= f["interval"][1]
    # by 25% neither shows what annealing buys (WSD: nothing annealed; cosine: S2/S1 moved by 0.035): the prior's C
    assert f["c_seen"] is False and f["curve"].C == TRUE.C
    if kind == "wsd":
        # a wrong prior moves the forecast by what annealing buys at the end; the interval says how far
        off = forecast(s1, s2, steps[quarter], loss[quarter], c_prior=TRUE.C / 2)
        assert off["predicted"] > final and off["interval"][0] <= final + 0.5 * TRUE.C / 2 * s2[-1] / s1[-1]
    # every validation: the whole run's curve recovered
    whole = fit_run_curve(s1[steps - 1], s2[steps - 1], loss)
    assert whole.C == pytest.approx(TRUE.C, rel=0.1) and whole.scale < 1e-3
    assert (s2[steps - 1] / s1[steps - 1]).max() >= ANNEAL_SEEN


def test_too_few_validations_is_a_value_error():
    with pytest.raises(ValueError, match="needs 4 validations; 3 given"):
        fit_run_curve([1e6, 2e6, 3e6], [0, 0, 0], [5.0, 4.5, 4.2])


def test_sharp_changes_are_stage_starts_and_the_wsd_decay():
    stages = [{"name": "main", "start": 0.0, "mix": {"web": 1.0}},
              {"name": "anneal", "start": 0.5, "mix": {"web": 1.0}},
              {"name": "long_context", "start": 0.75, "seq_len": 512, "rope_theta": 100000.0}]
    src = [{"name": "web", "kind": "web", "paths": ["*.txt"], "format": "text"}]
    cfg = load_config(preset="tiny", overrides=[("train.steps", 200), ("schedule.kind", "wsd"),
                                                 ("schedule.decay_fraction", 0.1), ("stages", stages),
                                                 ("data.sources", src), ("schedule.warmup_steps", 5)])
    st = resolve_stages(cfg)
    assert sharp_changes(cfg, st) == sorted({st[1].start_step, st[2].start_step, 180})
    cfg.schedule.kind = "cosine"  # the cosine's lr falls from the start: no sharp change of its own
    assert sharp_changes(cfg, st) == [st[1].start_step, st[2].start_step]
