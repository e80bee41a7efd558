"""densetrain.law.forecast: a run's final loss forecast from its own validations (issue 42, item 4), on curves
generated from the form with known parameters; each source's progress against the others' and the known sharp
changes the alarm waits out (item 5)."""

from __future__ import annotations

import numpy as np
import pytest

from densetrain.config import load_config
from densetrain.law.fits import Curve
from densetrain.law.forecast import (
    DEFAULT_PRIOR,
    SOURCE_BAND,
    Prior,
    RunCurve,
    anneal_drop,
    fit_run_curve,
    forecast,
    ladder_prior,
    source_excess,
)
from densetrain.schedule import resolve_stages
from densetrain.train.watch.curve import sharp_changes

TRUE = RunCurve(E=3.0, B=400.0, beta=0.5, C=0.2)
STEPS, TOKENS = 2000, 65536.0


def schedule(kind: str) -> np.ndarray:
    """The lr ratio of a 2000-step run: 20 warmup steps, then WSD (stable, last 20% linear to 0.1x) or cosine."""
    i = np.arange(STEPS)
    warm = np.minimum((i + 1) / 20, 1.0)
    if kind == "wsd":
        return warm * (1 - 0.9 * np.clip((i - 0.8 * STEPS) / (0.2 * STEPS), 0, 1))
    return warm * (0.1 + 0.45 * (1 + np.cos(np.pi * np.clip((i - 20) / (STEPS - 20), 0, 1))))


def test_anneal_drop_pays_each_fall_off_exponentially():
    lr = np.array([0.5, 1.0, 1.0, 0.6, 0.6, 0.6, 0.6])  # a warmup rise (buys nothing), one fall of 0.4 at step 3
    d = anneal_drop(lr * 3e-3, 3e-3, memory=0.5)
    assert d == pytest.approx([0, 0, 0, 0, 0.4 * 0.5, 0.4 * 0.75, 0.4 * 0.875])
    wsd = anneal_drop(schedule("wsd"), 1.0)
    # 0.9 x 399 / 400 fallen by the last step, 1 / (1 - 0.97) steps of the fall (0.9 / 400 each) not yet paid
    assert wsd[int(0.8 * STEPS) - 1] == 0 and wsd[-1] == pytest.approx(0.9 * 399 / 400 - 0.9 / 400 / 0.03, abs=1e-4)


@pytest.mark.parametrize("kind", ["wsd", "cosine"])
def test_forecast_from_a_quarter_of_the_run(kind):
    lr = schedule(kind)
    s1, d = np.cumsum(lr * TOKENS), anneal_drop(lr, 1.0)
    steps = np.arange(40, STEPS + 1, 40)
    loss = TRUE.loss(s1[steps - 1], d[steps - 1]) * (1 + np.random.default_rng(0).normal(0, 5e-4, len(steps)))
    final = float(TRUE.loss(s1[-1], d[-1]))
    quarter = (steps > 0.1 * STEPS) & (steps <= STEPS // 4)
    # priors centred on the truth, as wide as the defaults: the quarter's validations pin E and B
    prior = Prior(beta=TRUE.beta, beta_sd=0.1, c=TRUE.C, c_sd=0.04)
    f = forecast(s1, d, steps[quarter], loss[quarter], prior)
    assert f["at_step"] == 480 and abs(f["predicted"] / final - 1) < 0.005, (f["predicted"], final)
    assert f["interval"][0] <= final <= f["interval"][1]
    # a wrong C prior (half the truth) moves a WSD forecast up by about what the missing half buys at the end
    off = forecast(s1, d, steps[quarter], loss[quarter], Prior(TRUE.beta, 0.1, TRUE.C / 2, 0.02))
    assert off["predicted"] > f["predicted"] + 0.5 * TRUE.C / 2 * d[-1] * (kind == "wsd")
    # every validation: the whole run's curve recovered, priors or not
    whole, _, _ = fit_run_curve(s1[steps - 1], d[steps - 1], loss, Prior(0.3, 1.0, 0.5, 1.0))
    assert whole.C == pytest.approx(TRUE.C, rel=0.1) and whole.beta == pytest.approx(TRUE.beta, rel=0.1)
    assert whole.scale < 1e-3


def test_ladder_prior_carries_the_ladders_annealing_gain_to_the_run():
    curve = Curve(E=2.0, A=50.0, alpha=0.3, B=400.0, beta=0.45, C=1.5)
    p = ladder_prior(curve, 1e6, s1_end=1e8, s2_end=9e6, d_end=0.9)
    assert p.beta == 0.45 and p.e == pytest.approx(2.0 + 50.0 / 1e6 ** 0.3)
    assert p.c * 0.9 == pytest.approx(1.5 * 9e6 / 1e8)  # the same loss bought at the run's end
    assert ladder_prior(curve, 1e6, 1e8, 0.0, 0.0).c == DEFAULT_PRIOR.c  # no fall at all: the default


def test_too_few_validations_is_a_value_error():
    with pytest.raises(ValueError, match="needs 4 validations; 3 given"):
        fit_run_curve([1e6, 2e6, 3e6], [0, 0, 0], [5.0, 4.5, 4.2])


def sources(slow: str = "", from_i: int = 20, n: int = 40) -> dict[str, list[float]]:
    """Three sources' validation losses on one WSD-like run: their own floors and scales, the same schedule (a
    sharp shared fall over the last 8 validations), 0.1% noise; ``slow``'s drop stalls from ``from_i`` on."""
    t = np.arange(1, n + 1, dtype=float) * 50
    fall = np.clip((np.arange(n) - (n - 8)) / 8, 0, 1) * 0.08
    rng = np.random.default_rng(1)
    out = {}
    for k, (e, b) in {"web": (3.0, 6.0), "code": (1.5, 5.0), "books": (3.4, 4.0)}.items():
        curve = e + b * t ** -0.4 - fall * e
        if k == slow:  # its loss keeps falling, at a fifth of the pace (e.g. windows repeated from the middle)
            curve[from_i:] = curve[from_i] - 0.2 * (curve[from_i] - curve[from_i:])
        out[k] = list(curve * (1 + rng.normal(0, 1e-3, n)))
    return out


def test_each_source_against_the_others():
    # healthy: up to the shared fall at the end, nobody leaves its band
    for end in range(10, 32):
        ex = source_excess({k: v[:end + 1] for k, v in sources().items()}, 0, end - 4)
        assert set(ex) == {"web", "code", "books"} and all(e < band for e, band in ex.values()), (end, ex)
    # the fall moves the sources by other ratios than their stable phases did (here: each by 8% of its floor):
    # judged from before it, 'code' would leave its band; the watcher restarts the reference at the fall instead
    # (a sharp change), where 8 validations are too few for a fit 4 behind: the fall is waited out
    healthy = sources()
    ex = source_excess(healthy, 0, 35)
    assert ex["code"][0] > ex["code"][1] and source_excess({k: v[32:] for k, v in healthy.items()}, 0, 3) == {}
    # one source slowing from validation 20: named alone, before the run's end, against a fit that ended earlier
    named = []
    for end in range(21, 40):
        ex = source_excess({k: v[:end + 1] for k, v in sources("code").items()}, 0, end - 4)
        named.append([k for k, (e, band) in ex.items() if e > band])
    assert named[-1] == ["code"] and all(n in ([], ["code"]) for n in named)
    assert named.index(["code"]) < 10
    assert source_excess({"web": [4.0] * 9}, 0, 8) == {} and SOURCE_BAND == 0.01  # one source: nothing to compare


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
