"""The forecast's prior from a ladder (issue 42, item 4): its sds derived from the ladder fit's bootstrap refits
(densetrain.law.forecast.ladder_spread), and the watcher taking it from a fit.json, even a degenerate one, with
the alarm not taking that fit's curve."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from densetrain.config import load_config
from densetrain.errors import ConfigError
from densetrain.law.fits import Curve
from densetrain.law.forecast import FIXED_SPREAD, ladder_prior, ladder_spread, robust_sd
from densetrain.metrics import MetricsLogger, read_events
from densetrain.schedule import resolve_stages
from densetrain.tools.plan import model_counts
from densetrain.train.watch.curve import OffCurve

CURVE = {"E": 3.0, "A": 50.0, "alpha": 0.3, "B": 400.0, "beta": 0.45, "C": 1.5, "scale": 0.004}
N, ANNEAL = 1e6, 0.08  # the run's parameters; its S2 / S1 over D at the end


def approach3_refits(e_sd: float, beta_sd: float, k: int = 400) -> list[list[float]]:
    """``k`` refits [E, A, B, alpha, beta] of approach 3: E and beta spread by the given sds, A and alpha fixed."""
    rng = np.random.default_rng(0)
    return [[2.9 + e_sd * rng.normal(), 50.0, 300.0, 0.3, 0.5 + beta_sd * rng.normal()] for _ in range(k)]


def test_robust_sd_is_a_normals_sd_and_ignores_a_few_wild_refits():
    x = np.random.default_rng(1).normal(0, 0.3, 4000)
    assert robust_sd(x) == pytest.approx(0.3, rel=0.05)
    assert robust_sd(np.r_[x, [1e6] * 40]) == pytest.approx(0.3, rel=0.07)  # 1% of refits at a bound


def test_spread_from_approach_3_refits_then_from_the_curves_own():
    e_run = 3.0 + 50.0 / N ** 0.3
    s = ladder_spread({"curves": {"all": CURVE}, "approach3": {"bootstrap": approach3_refits(0.3, 0.2)}}, "all", N,
                      ANNEAL)
    # the floor E + A / n^alpha and beta spread as the refits do; C has no refits there: half of it
    assert s.e_sd == pytest.approx(0.3, rel=0.1) and s.beta_sd == pytest.approx(0.2, rel=0.1)
    assert s.c_sd == pytest.approx(0.5 * 1.5 * ANNEAL) and "approach 3" in s.source
    # the curve's own refits (C among them) win over approach 3's
    rng = np.random.default_rng(2)
    own = [[3.0 + 0.1 * rng.normal(), 50.0, 0.3, 400.0, 0.45 + 0.1 * rng.normal(), 1.5 + 1.0 * rng.normal()]
           for _ in range(400)]
    s = ladder_spread({"curves": {"all": {**CURVE, "bootstrap": own}}, "approach3": {"bootstrap":
                       approach3_refits(0.3, 0.2)}}, "all", N, ANNEAL)
    assert s.e_sd == pytest.approx(0.1, rel=0.12) and s.beta_sd == pytest.approx(0.1, rel=0.12)
    assert s.c_sd == pytest.approx(1.0 * ANNEAL, rel=0.12) and "curve" in s.source
    # refits that all agree: never narrower than the fixed sds (and E than the curve's residual scale)
    for fit in ({"curves": {"all": CURVE}, "approach3": {"bootstrap": approach3_refits(1e-5, 1e-5)}},
                {"curves": {"all": CURVE}}):
        s = ladder_spread(fit, "all", N, ANNEAL)
        assert (s.beta_sd, s.e_sd, s.c_sd) == pytest.approx((FIXED_SPREAD[0], FIXED_SPREAD[1] * e_run,
                                                             FIXED_SPREAD[2] * 1.5 * ANNEAL))
    wide = ladder_spread({"curves": {"all": {**CURVE, "scale": 0.05}}}, "all", N, ANNEAL)
    assert wide.e_sd == pytest.approx(0.05 * e_run) and "no bootstrap" in wide.source
    # the prior carries them
    p = ladder_prior(Curve(**CURVE), N, 1e8, ANNEAL * 0.9 * 1e8, 0.9, s)
    assert (p.beta_sd, p.e_sd, p.c_sd) == (s.beta_sd, s.e_sd, s.c_sd) and p.c == pytest.approx(1.5 * ANNEAL)
    with pytest.raises(ValueError, match="key 'curves.all.bootstrap': expected a list of"):
        ladder_spread({"curves": {"all": {**CURVE, "bootstrap": [[1, 2, 3]] * 10}}}, "all", N, ANNEAL)


def degenerate_fit(tmp_path, curve: dict) -> str:
    """A ladder folder whose fit.json is degenerate (its approach 3 refits spread wide) and has an 'all' curve."""
    fit = {"level": 0.95, "lam": 0.999, "largest_budget": 1e12, "budgets": [1e11, 1e12],
           "approach3": {"law": {"E": 2.9, "A": 50.0, "B": 300.0, "alpha": 0.3, "beta": 0.5},
                         "bootstrap": approach3_refits(0.3, 0.2)},
           "curves": {"all": curve}, "degenerate": True, "reasons": ["the N_opt interval spans 276x"],
           "next": ["a larger budget"]}
    (tmp_path / "ladder").mkdir()
    (tmp_path / "ladder" / "fit.json").write_text(json.dumps(fit))
    return str(tmp_path / "ladder")


def start(tmp_path, ladder: str):
    cfg = load_config(preset="tiny", overrides=[("train.steps", 400), ("schedule.kind", "wsd"),
                                                ("eval.every", 10), ("eval.ladder", ladder),
                                                ("train.run_dir", str(tmp_path / "run"))])
    w = OffCurve(cfg, 0)
    (tmp_path / "run").mkdir()
    run = SimpleNamespace(stages=resolve_stages(cfg), state=SimpleNamespace(step=0), last_val=None,
                          model=SimpleNamespace(num_params=lambda: model_counts(cfg.model)["params"]),
                          log=MetricsLogger(tmp_path / "run", 0, tensorboard=False))
    w.before_step(run)
    run.log.close()
    return cfg, w


def test_the_watcher_takes_a_degenerate_fits_curve_as_a_wide_prior_not_for_the_alarm(tmp_path):
    cfg, w = start(tmp_path, degenerate_fit(tmp_path, CURVE))
    n = model_counts(cfg.model)["params"] - cfg.model.vocab_size * cfg.model.d_model
    assert w.curves == {} and w.prior.e == pytest.approx(3.0 + 50.0 / n ** 0.3)
    assert w.prior.e_sd == pytest.approx(0.3, rel=0.1) and w.prior.beta_sd == pytest.approx(0.2, rel=0.1)
    note = [e for e in read_events(tmp_path / "run") if e["kind"] == "forecast"]
    assert len(note) == 1 and "approach 3" in note[0]["text"] and "the fit is degenerate" in note[0]["text"]


def test_a_malformed_curve_bootstrap_is_a_config_error_naming_the_file(tmp_path):
    ladder = degenerate_fit(tmp_path, {**CURVE, "bootstrap": [["x"]] * 12})
    with pytest.raises(ConfigError, match=r"eval.ladder: .*fit.json: key 'curves.all.bootstrap'"):
        start(tmp_path, ladder)
