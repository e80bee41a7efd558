"""The off_curve watcher (train/watch/curve.py) fed validations generated from the forecast's form on a real
config's WSD schedule (issue 42, items 4-5): healthy sources raise nothing through the decay, one source whose
fall slows from the middle (the seed's 7.1 case) is named alone before the run's last evaluation, and the
forecast is logged. The run is a stand-in carrying what the watcher reads (stages, step, the validation, a real
MetricsLogger); the watcher, the config, the schedule and the log files are the shipped ones."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from densetrain.config import load_config
from densetrain.law.forecast import RunCurve
from densetrain.metrics import MetricsLogger, read_events
from densetrain.schedule import resolve_stages
from densetrain.train.watch.curve import OffCurve, run_areas, run_drops
from densetrain.train.watchers import Verdict

STEPS, EVERY = 1000, 25
SOURCES = {"web": RunCurve(3.0, 300.0, 0.45, 0.15), "code": RunCurve(1.6, 900.0, 0.55, 0.2),
           "books": RunCurve(3.3, 150.0, 0.4, 0.12)}


def config():
    src = [{"name": k, "kind": "web", "paths": [f"{k}/*.txt"], "format": "text"} for k in SOURCES]
    return load_config(preset="tiny", overrides=[
        ("train.steps", STEPS), ("schedule.kind", "wsd"), ("schedule.decay_fraction", 0.2),
        ("schedule.warmup_steps", 10), ("eval.every", EVERY), ("data.sources", src),
        ("stages", [{"name": "main", "start": 0.0, "mix": {k: 1 / 3 for k in SOURCES}}])])


def replay(tmp_path, slow: str = "") -> tuple[OffCurve, list[dict], float]:
    """Every validation of the run through the watcher; ``slow``'s fall keeps a fifth of its pace from step 500.
    Returns the watcher, the run's events and the healthy run's final loss over all sources."""
    cfg = config()
    stages = resolve_stages(cfg)
    s1, _ = run_areas(cfg, stages)
    d = run_drops(cfg, stages)
    steps = np.arange(EVERY, STEPS, EVERY)
    rng = np.random.default_rng(3)
    losses = {k: c.loss(s1[steps - 1], d[steps - 1]) * (1 + rng.normal(0, 1e-3, len(steps))) for k, c in
              SOURCES.items()}
    if slow:
        i = int(np.searchsorted(steps, 500))
        losses[slow][i:] = losses[slow][i] - 0.2 * (losses[slow][i] - losses[slow][i:])
    w = OffCurve(cfg, 0)
    run = SimpleNamespace(stages=stages, state=SimpleNamespace(step=0), last_val=None,
                          log=MetricsLogger(tmp_path, 0, tensorboard=False))
    w.before_step(run)
    for j, step in enumerate(steps):
        run.last_val = {k: {"loss": float(v[j]), "tokens": 4096} for k, v in losses.items()}
        run.state.step = int(step) + 1  # the loop validates after the watchers: judged at the next step
        w.after_step(run, None, Verdict.APPLY)
    run.log.close()
    return w, read_events(tmp_path), float(np.mean([c.loss(s1[-1], d[-1]) for c in SOURCES.values()]))


def test_healthy_sources_raise_nothing_and_the_run_forecasts(tmp_path):
    w, events, final = replay(tmp_path)
    assert not [e for e in events if e["kind"] == "off_curve"]
    forecasts = [e for e in events if e["kind"] == "forecast"]
    # the first validation past 25% of the run, with 4 past 10%: one event, its values as summary.json takes them
    assert len(forecasts) == 1 and forecasts[0]["step"] == 275 and w.first["at_step"] == 275
    lo, hi = w.first["interval"]
    # the sum of three curves is no curve of the form, and the default priors are another recipe's: the latest
    # forecast (step 975, the decay seen) within 1%, the first within its interval
    assert lo < final < hi and w.latest["at_step"] == 975 and w.latest["predicted"] == pytest.approx(final, rel=0.01)


def test_one_source_slowing_is_named_alone_before_the_end(tmp_path):
    _, events, _ = replay(tmp_path, slow="code")
    alarms = [e for e in events if e["kind"] == "off_curve"]
    assert len(alarms) == 1 and alarms[0]["values"]["sources"] == ["code"], alarms
    assert 500 < alarms[0]["step"] < STEPS - EVERY
    assert "'code'" in alarms[0]["text"] and "left their curves while the others did not" in alarms[0]["text"]
