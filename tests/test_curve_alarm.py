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
from densetrain.law.forecast import SOURCE_BAND, RunCurve, source_excess
from densetrain.metrics import MetricsLogger, read_events
from densetrain.schedule import resolve_stages
from densetrain.train.watch.curve import OffCurve, run_areas, run_drops
from densetrain.train.watchers import Verdict

STEPS, EVERY = 1000, 25
SOURCES = {"web": RunCurve(3.0, 300.0, 0.45, 0.15), "code": RunCurve(1.6, 900.0, 0.55, 0.2),
           "books": RunCurve(3.3, 150.0, 0.4, 0.12)}


MIX4 = {**SOURCES, "reference": RunCurve(3.1, 250.0, 0.45, 0.14)}
"""Four sources, as the H2 mix (books, reference, technical, code): the median of three others is not moved by
one jumpy source (with three sources it is the mean of the other two, which is)."""


def config(sources=SOURCES):
    src = [{"name": k, "kind": "web", "paths": [f"{k}/*.txt"], "format": "text"} for k in sources]
    return load_config(preset="tiny", overrides=[
        ("train.steps", STEPS), ("schedule.kind", "wsd"), ("schedule.decay_fraction", 0.2),
        ("schedule.warmup_steps", 10), ("eval.every", EVERY), ("data.sources", src),
        ("stages", [{"name": "main", "start": 0.0, "mix": {k: 1 / len(sources) for k in sources}}])])


def replay(tmp_path, slow: str = "", jumpy: str = "", sources=SOURCES) -> tuple[OffCurve, list[dict], float]:
    """Every validation of the run through the watcher; ``slow``'s fall keeps a fifth of its pace from step 500;
    ``jumpy`` falls 3% more than its curve just past the reference (25% of the run), then along it. Returns the
    watcher, the run's events and the healthy run's final loss over all sources."""
    cfg = config(sources)
    stages = resolve_stages(cfg)
    s1, _ = run_areas(cfg, stages)
    d = run_drops(cfg, stages)
    steps = np.arange(EVERY, STEPS, EVERY)
    rng = np.random.default_rng(3)
    losses = {k: c.loss(s1[steps - 1], d[steps - 1]) * (1 + rng.normal(0, 1e-3, len(steps))) for k, c in
              sources.items()}
    if jumpy:
        # a stair: 3% more fall than its curve over the two validations past the reference (step 250), then along
        # it (a minority source learnt in a step, as books in H2: its ratio to the others' drop fitted early is off)
        losses[jumpy] = losses[jumpy] * np.exp(-0.03 * np.clip((steps - 250) / 50, 0, 1))
    if slow:
        i = int(np.searchsorted(steps, 500))
        losses[slow][i:] = losses[slow][i] - 0.2 * (losses[slow][i] - losses[slow][i:])
    w = OffCurve(cfg, 0)
    tmp_path.mkdir(parents=True, exist_ok=True)
    run = SimpleNamespace(stages=stages, state=SimpleNamespace(step=0), last_val=None,
                          log=MetricsLogger(tmp_path, 0, tensorboard=False))
    w.before_step(run)
    for j, step in enumerate(steps):
        run.last_val = {k: {"loss": float(v[j]), "tokens": 4096} for k, v in losses.items()}
        run.state.step = int(step) + 1  # the loop validates after the watchers: judged at the next step
        w.after_step(run, None, Verdict.APPLY)
    run.log.close()
    return w, read_events(tmp_path), float(np.mean([c.loss(s1[-1], d[-1]) for c in sources.values()]))


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


def test_a_jumpy_healthy_source_is_not_named_a_slowed_one_is(tmp_path):
    # a minority source learnt in a step just past the reference (issue 42 item 5: books, 1.7% of the H2 mix,
    # named in 3 of 7 healthy runs at the earliest step the rule allows): its ratio to the others' drop, fitted on
    # the first 4 validations, is far above its later one. The former rule (3 x a median-based scale of 4
    # residuals; the ratio fit frozen while it was above, so for good) named it at step 500; the prediction
    # interval (few validations, their root mean square, the extrapolation) does not, and the fit moves on
    w, events, _ = replay(tmp_path / "jumpy", jumpy="books", sources=MIX4)
    assert not [e for e in events if e["kind"] == "off_curve"], [e["text"] for e in events if e["kind"] == "off_curve"]
    swings = [r["books"][0] / r["books"][1] - 1 for r in w.history if "books" in r]
    assert max(swings) > 0.01  # the step is seen: above the 1% floor band at its first judgements
    # the same stairs on 'books' with 'code' slowed from the middle: 'code' still named alone before the end
    _, events, _ = replay(tmp_path / "both", slow="code", jumpy="books", sources=MIX4)
    alarms = [e for e in events if e["kind"] == "off_curve"]
    assert len(alarms) == 1 and alarms[0]["values"]["sources"] == ["code"], [e["text"] for e in alarms]
    assert 500 < alarms[0]["step"] < STEPS - EVERY


def test_a_ratio_fitted_on_few_stairs_is_not_extrapolated_as_sure():
    # issue 42 item 5: the first judgements of a source rest on 4 validations past the reference; a minority
    # source falling in stairs there (a jump, flat, a jump, flat) gives a ratio to the others' drop that is far
    # from its long-run one. The former band, 3 x a median-based scale of those 4 residuals, ignored the stairs
    # (2.8% here) and named the source when its ratio came back to the others' (excess 3.7%); the prediction
    # interval (root mean square of the residuals, Student t with 3 degrees of freedom, the extrapolation from
    # drops of 0.01-0.04 to 0.10) is ~21%
    others = [np.exp(-0.01 * i) * 3.0 for i in range(11)]
    books = np.exp(-np.array([0, 0.03, 0.031, 0.045, 0.046, 0.055, 0.062, 0.07, 0.08, 0.09, 0.1])) * 4.0
    losses = {"books": list(books), "code": others, "reference": [x * 1.2 for x in others],
              "technical": [x * 1.1 for x in others]}
    ex = source_excess(losses, 0, 4)
    excess, band = ex["books"]
    assert excess == pytest.approx(0.037, abs=0.002)
    assert band == pytest.approx(0.21, abs=0.01) and excess < band
    # a source whose fall stopped after a long clean fit is still above its band
    stalled = {**losses, "books": [x * 4 / 3 for x in others[:6]] + [others[5] * 4 / 3] * 5}
    excess, band = source_excess(stalled, 0, 5)["books"]
    assert band == SOURCE_BAND and excess == pytest.approx(0.05, abs=1e-6) and excess > band
