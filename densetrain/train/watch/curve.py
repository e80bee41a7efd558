"""The run's own forecast and the on-track alarm: each validation against the run's own curve and each source
against the others.

Every run that validates during training (``eval.every > 0``; with or without a ladder):

- from the first validation past warmup and :data:`~densetrain.law.forecast.FORECAST_FROM` of the run (with at
  least :data:`~densetrain.law.forecast.MIN_POINTS` validations past warmup and
  :data:`~densetrain.law.forecast.FIT_FROM`), forecasts its final validation loss from the schedule-aware curve
  fitted to its own validations past those (:func:`densetrain.law.forecast.forecast`; its priors from the
  ladder's curve when ``eval.ladder`` has one, as sure as the fit's bootstrap refits agree
  (:func:`densetrain.law.forecast.ladder_spread`: a degenerate fit's weigh little), else the defaults): one ``forecast``
  event at the first forecast, ``forecast/loss``, ``forecast/lo``, ``forecast/hi`` metrics (``kind="forecast"``)
  at every one, and ``summary.json``'s ``forecast``: the first forecast (``at_step``, ``predicted``,
  ``interval``), the ``final`` value beside it and its ``error``, and the ``latest`` forecast;
- the alarm, within the current *segment*: the validations since the last known sharp change (a stage's start:
  an anneal's mix, a seq_len switch; the WSD decay's start), which is waited out. ``all`` (and the source of a
  one-source run) against the curve fitted to its validations of the segment before this one, from the
  segment's :data:`~densetrain.law.forecast.MIN_POINTS`-th on: above its band when its loss exceeds the curve by
  ``eval.off_curve_margin`` (0: 3 x the segment's first fit's residual scale, at least 1%) and the lowest loss
  of the segment so far (a loss that still falls, only slower than the fit extrapolates, is no alarm). With two
  or more sources, each source against the others (:func:`densetrain.law.forecast.source_excess`): its log-loss
  drop since the segment's first validation past :data:`CURVE_FROM` of the run, against the median drop of the
  others times the ratio of the two fitted on validations at least :data:`SOURCE_LAG` of the run earlier (and no
  later while a source that was inside its band in the segment is above it); above when it fell less than that
  by its band (``eval.off_curve_margin``, or the ratio fit's prediction interval at the validation judged, at
  least :data:`~densetrain.law.forecast.SOURCE_BAND`: few validations, jumpy residuals and a long extrapolation
  widen it). A refit of a source's own curve bends with a fault that
  slows its fall (the seed's 7.1 case: windows repeated from the middle on); the others' progress does not.
  With a ladder whose fit is not degenerate, ``all`` must also be above its curve on the ladder
  (:class:`densetrain.law.Curve`). One ``off_curve`` event when a key is above for ``eval.off_curve_patience``
  validations in a row; it names a source only when that source left its band while others did not (all of
  them at once is a change of the run, not of one source's data).

With ``eval.ladder = LADDER_DIR`` (a ladder fitted by ``densetrain ladder fit``, its ``fit.json``), the watcher
also logs the predicted final validation loss and bpb of this run (N without the input embedding table, D its
planned tokens) with the ladder's interval and how far past the ladder's largest budget the run extrapolates (a
warning beyond :data:`FAR`) at the first step, or "no prediction" and why (a degenerate fit,
:mod:`densetrain.law.judge`), and adds ``prediction`` (with the outcome and the off-curve sources) to
``summary.json``.

The loop validates after the watchers' ``after_step``, so a validation is judged at the next step; the final
one only enters the summary.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from densetrain.config import Config
from densetrain.errors import ConfigError
from densetrain.fileio import atomic_write_json, read_json
from densetrain.law import ANNEAL_MOMENTUM, Curve, schedule_areas
from densetrain.law.files import read_fit as read_ladder_fit
from densetrain.law.forecast import (
    DEFAULT_PRIOR,
    FIT_FROM,
    FORECAST_FROM,
    MIN_POINTS,
    RunCurve,
    anneal_drop,
    fit_run_curve,
    forecast,
    ladder_prior,
    ladder_spread,
    source_excess,
)
from densetrain.law.judge import checked_prediction
from densetrain.schedule import Stage, lr_for, stage_at, warmup_steps
from densetrain.train.watchers import Verdict, Watcher

CURVE_FROM = 0.25
"""The curve covers validations from this fraction of a run's steps on, in the fit and in the checks: the first
steps of a small model's loss fall faster than any power law in S1 (a micro ladder's fit on them left residuals
from -25% early to +3% late)."""
SOURCE_LAG = 0.1
"""A source's progress is judged against the other sources' with the ratio fitted on validations at least this
fraction of the run's steps before the one judged (:func:`densetrain.law.forecast.source_excess`): a fault's
first validations are not in the fit that judges them, so the reference does not bend with it."""
CURVE_KEYS = ("E", "A", "alpha", "B", "beta", "C", "scale")
"""The parameters of a ladder's curve in ``fit.json`` (other keys, e.g. its bootstrap, are for
:func:`densetrain.law.forecast.ladder_spread`)."""
FAR = 100.0
"""Extrapolation factor (run FLOPs / the ladder's largest budget) beyond which a prediction is flagged."""


def run_areas(cfg: Config, stages: list[Stage], lam: float = ANNEAL_MOMENTUM) -> tuple[np.ndarray, np.ndarray]:
    """The forward and annealing areas (tokens, :func:`densetrain.law.schedule_areas`) after each of the
    ``cfg.train.steps`` steps of this config's lr schedule (``[k - 1]``: after k steps)."""
    steps = range(cfg.train.steps)
    return schedule_areas([lr_for(i, cfg, stages) for i in steps],
                          [stage_at(i, stages).batch_tokens for i in steps], cfg.optim.peak_lr, lam)


def run_drops(cfg: Config, stages: list[Stage]) -> np.ndarray:
    """What the lr's falls have bought after each of the ``cfg.train.steps`` steps
    (:func:`densetrain.law.forecast.anneal_drop`; ``[k - 1]``: after k steps)."""
    return anneal_drop([lr_for(i, cfg, stages) for i in range(cfg.train.steps)], cfg.optim.peak_lr)


def planned_tokens(cfg: Config, stages: list[Stage]) -> float:
    """The tokens of the whole schedule (every step's stage batch)."""
    return float(sum(stage_at(i, stages).batch_tokens for i in range(cfg.train.steps)))


def read_fit(ladder_dir: str | Path) -> dict:
    """``LADDER_DIR/fit.json`` as written by ``densetrain ladder fit``, read and checked
    (:func:`densetrain.law.files.read_fit`).

    Raises:
        ConfigError: no fit there, or one that is not a fit (a bad value named by key).
    """
    path = Path(ladder_dir) / "fit.json"
    try:
        return read_ladder_fit(Path(ladder_dir))
    except FileNotFoundError:
        raise ConfigError(f"eval.ladder: {path}: no fit there; expected the fit of a ladder (densetrain ladder fit "
                          f"{ladder_dir})") from None
    except (OSError, ValueError) as e:  # DataError naming the key, ReadRefused (not a regular file, too large)
        raise ConfigError(f"eval.ladder: {e}") from None


def prediction_line(p: dict) -> str:
    """One line of a prediction (:func:`densetrain.law.judge.checked_prediction`); a withheld one says why and
    what to run next, never a number."""
    if p.get("withheld"):
        nxt = f"; run next: {'; '.join(p['next'])}" if p.get("next") else ""
        return f"no prediction: {p['withheld']}{nxt}"
    pct = int(round(p["level"] * 100))
    bpb = (f", bpb {p['bpb']:.4f} [{p['bpb_lo']:.4f}, {p['bpb_hi']:.4f}]" if p.get("bpb") is not None else "")
    far = (f"; WARNING: {p['extrapolation']:.0f}x past the ladder's largest budget (beyond {FAR:.0f}x the law is "
           f"a guess)" if p["extrapolation"] > FAR else f"; {p['extrapolation']:.3g}x the ladder's largest budget")
    cross = ""
    if "power_law" in p:
        cross = (f"; the power law in compute through each budget's best point gives {p['power_law']:.4f}"
                 + ("" if p["power_law_agrees"] else ", OUTSIDE the interval: the two laws disagree"))
    return (f"predicted final val loss {p['loss']:.4f} [{p['loss_lo']:.4f}, {p['loss_hi']:.4f}] ({pct}%){bpb} at "
            f"N = {p['n']:.4g} parameters (no input embedding), D = {p['d']:.4g} tokens{far}{cross}")


def sharp_changes(cfg: Config, stages: list[Stage]) -> list[int]:
    """The steps where the loss may jump by design: each later stage's start (a mix or seq_len change) and, in a
    WSD schedule, the first step whose lr falls after the stable phase (its decay's start)."""
    out = {st.start_step for st in stages[1:]}
    if cfg.schedule.kind == "wsd":
        w = warmup_steps(cfg.schedule, cfg.train.steps)
        prev = lr_for(w, cfg, stages) if w < cfg.train.steps else 0.0
        for i in range(w + 1, cfg.train.steps):
            lr = lr_for(i, cfg, stages)
            if lr < prev * (1 - 1e-9) and stage_at(i, stages) is stage_at(i - 1, stages):
                out.add(i)
                break
            prev = lr
    return sorted(out)


class OffCurve(Watcher):
    """The forecast, the prediction and the on-track alarm (module docstring)."""

    name = "off_curve"

    def __init__(self, cfg: Config, rank: int):
        self.cfg, self.rank = cfg, rank
        self.fit = read_fit(cfg.eval.ladder) if cfg.eval.ladder else None
        usable = self.fit is not None and not self.fit.get("degenerate", False)
        self.curves = ({k: Curve(**{f: x for f, x in v.items() if f in CURVE_KEYS}) for k, v in
                        self.fit["curves"].items()} if usable else {})
        # the forecast's prior takes the ladder's curve even from a degenerate fit: its sds come from the fit's
        # bootstrap (ladder_spread), so a fit that knows little weighs little; the alarm takes only a usable one
        self.prior_curve = (Curve(**{k: v for k, v in self.fit["curves"]["all"].items() if k in CURVE_KEYS})
                            if self.fit is not None and "all" in self.fit["curves"] else None)
        self.prior = DEFAULT_PRIOR
        self.prediction: dict | None = None
        self.n = 0.0
        self.s1 = self.s2 = self.d = None
        self.changes: list[int] = []
        self.seen = None  # the run.last_val judged last
        self.points: dict[str, list[list[float]]] = {}  # per key: [step, loss] of every validation past warmup
        self.scale: dict[str, list] = {}  # per key: [segment start, the segment's first residual scale]
        self.fits: dict[str, RunCurve] = {}  # per fit ('all', 'forecast'): the latest (the next starts from it)
        self.frozen: float | None = None  # the last step of the sources' ratio fit (_sources)
        self.inside: dict[str, int] = {}  # per source: the segment start of its last judgement inside its band
        self.first: dict | None = None  # the first forecast
        self.latest: dict | None = None
        self.above: dict[str, int] = {}  # consecutive validations above the band, per source / 'all'
        self.flagged: list[str] = []
        self.history: list[dict] = []

    def margin(self, key: str) -> float:
        return self.cfg.eval.off_curve_margin or max(0.01, 3.0 * self.scale.get(key, [0, 0.0])[1])

    def before_step(self, run) -> None:
        if self.s1 is not None:
            return
        self.s1, self.s2 = run_areas(self.cfg, run.stages, (self.fit or {}).get("lam", ANNEAL_MOMENTUM))
        self.d = run_drops(self.cfg, run.stages)
        self.changes = sharp_changes(self.cfg, run.stages)
        if self.fit is None:
            return
        m = self.cfg.model
        self.n = float(run.model.num_params() - m.vocab_size * m.d_model)
        if self.prior_curve is not None:
            anneal = self.s2[-1] / self.s1[-1] / self.d[-1] if self.d[-1] > 0 else 0.0
            try:
                spread = ladder_spread(self.fit, "all", self.n, anneal)
            except ValueError as e:
                raise ConfigError(f"eval.ladder: {Path(self.cfg.eval.ladder) / 'fit.json'}: {e}") from None
            self.prior = ladder_prior(self.prior_curve, self.n, self.s1[-1], self.s2[-1], self.d[-1], spread)
            if self.rank == 0 and run.state.step == 0:
                p = self.prior
                run.log.event(0, f"forecast prior from the ladder's curve: beta {p.beta:.3g} +- {p.beta_sd:.2g}, E "
                                 f"{p.e:.4g} +- {p.e_sd:.2g}, C {p.c:.3g} +- {p.c_sd:.2g} (sds: {spread.source}"
                                 f"{'; the fit is degenerate' if self.fit.get('degenerate') else ''})",
                              kind="forecast")
        self.prediction = checked_prediction(self.fit, self.n, planned_tokens(self.cfg, run.stages))
        if self.rank == 0 and run.state.step == 0:
            run.log.event(0, f"ladder {self.cfg.eval.ladder}: {prediction_line(self.prediction)}", kind="prediction",
                          values=self.prediction)

    def after_step(self, run, result, verdict: Verdict) -> None:
        val = getattr(run, "last_val", None)
        if verdict == Verdict.ROLLBACK or not val or val is self.seen:
            return
        self.seen = val
        step = run.state.step - 1  # the loop validated after the previous step (module docstring)
        warm = warmup_steps(self.cfg.schedule, self.cfg.train.steps)
        if step <= warm or step >= self.cfg.train.steps:
            return
        tokens = sum(v["tokens"] for v in val.values())
        actual = {**{s: v["loss"] for s, v in val.items()},
                  "all": sum(v["loss"] * v["tokens"] for v in val.values()) / tokens if tokens else math.nan}
        sources = [k for k in actual if k != "all"]
        seg = max([c for c in self.changes if c <= step], default=0)  # the current segment's first step
        row: dict = {"step": step}
        for key, loss in actual.items():
            if not math.isfinite(loss) or loss <= 0:
                continue
            before = [p for p in self.points.get(key, []) if p[0] >= seg]
            self.points.setdefault(key, []).append([step, loss])
            if key != "all":
                continue  # one source: it is 'all'; more: judged against the others (_sources)
            if step <= FORECAST_FROM * self.cfg.train.steps or len(before) < MIN_POINTS:
                continue
            up = self._own(key, step, loss, before, row)
            if key in self.curves:  # the ladder's curve too: both must say it left
                ladder = float(self.curves[key].loss(self.n, self.s1[step - 1], self.s2[step - 1]))
                up = up and loss > ladder * (1 + self.margin(key))
            self.above[key] = self.above.get(key, 0) + 1 if up else 0
        if len(sources) > 1:
            self._sources(step, seg, sources, row)
        elif "all" in row:
            row[sources[0]], self.above[sources[0]] = row["all"], self.above["all"]
        self._forecast(run, step)
        self.history.append(row)
        self._alarm(run, step, row, sources)

    def _own(self, key: str, step: int, loss: float, before: list, row: dict) -> bool:
        """``key``'s validation at ``step`` against the curve fitted to the segment's validations ``before`` it:
        above its band and above the segment's best so far (a loss that still falls, only slower than the fit
        extrapolates, is no alarm; bad data makes it creep up)."""
        idx = np.array([int(p[0]) - 1 for p in before])
        try:
            curve, _, _ = fit_run_curve(self.s1[idx], self.d[idx], [p[1] for p in before], self.prior,
                                        self.fits.get(key))
        except ValueError:
            return False
        self.fits[key] = curve
        pred = float(curve.loss(self.s1[step - 1], self.d[step - 1]))
        if self.scale.get(key, [None])[0] != (seg := int(before[0][0])):
            self.scale[key] = [seg, curve.scale]
        row[key] = [loss, pred]
        return loss > pred * (1 + self.margin(key)) and loss > min(p[1] for p in before)

    def _sources(self, step: int, seg: int, sources: list[str], row: dict) -> None:
        """Each source's drop since the segment's first validation past :data:`CURVE_FROM` of the run against the
        other sources' (:func:`densetrain.law.forecast.source_excess`), the ratio fitted up to
        :data:`SOURCE_LAG` of the run before ``step`` (and no further while a source that was inside its band in the
        segment is above it); a source is above when its excess passes its band."""
        first = max(seg, CURVE_FROM * self.cfg.train.steps)
        at = [int(p[0]) for p in self.points[sources[0]] if p[0] >= first]
        losses = {k: [p[1] for p in self.points[k] if p[0] >= first] for k in sources}
        if any(len(v) != len(at) for v in losses.values()) or not at:
            return  # a source missing from a validation: no common reference
        last = step - SOURCE_LAG * self.cfg.train.steps
        # a source above its band after being inside it in this segment: its fault stays out of the fit that judges
        # it. One above from its first judgement left nothing: its ratio rests on the first few validations (a
        # minority source's stair there, issue 42 item 5), and a fit frozen on them would judge it forever
        if (self.frozen is not None and self.frozen >= first
                and any(self.above.get(k, 0) and self.inside.get(k) == seg for k in sources)):
            last = min(last, self.frozen)
        self.frozen = last
        fit_to = max((i for i, s in enumerate(at) if s <= last), default=0)
        for k, (excess, band) in source_excess(losses, 0, fit_to).items():
            row[k] = [losses[k][-1], losses[k][-1] / math.exp(excess)]  # the loss, the loss the others say
            self.scale[k] = [seg, band / 3.0]
            self.above[k] = self.above.get(k, 0) + 1 if excess > self.margin(k) else 0
            if not self.above[k]:
                self.inside[k] = seg

    def _forecast(self, run, step: int) -> None:
        """The final loss forecast from every validation of 'all' past warmup (the areas carry the schedule)."""
        pts = [p for p in self.points.get("all", []) if p[0] > FIT_FROM * self.cfg.train.steps]
        if step <= FORECAST_FROM * self.cfg.train.steps or len(pts) < MIN_POINTS:
            return
        try:
            f = forecast(self.s1, self.d, [int(p[0]) for p in pts], [p[1] for p in pts], self.prior,
                         self.fits.get("forecast"))
        except ValueError:
            return
        self.fits["forecast"] = f["curve"]
        self.latest = {"at_step": step, "predicted": f["predicted"], "interval": f["interval"]}
        if self.rank != 0:
            return
        run.log.log(step, {"forecast/loss": f["predicted"], "forecast/lo": f["interval"][0],
                           "forecast/hi": f["interval"][1]}, kind="forecast")
        if self.first is None:
            self.first = dict(self.latest)
            lo, hi = f["interval"]
            src = "the ladder's curve" if "all" in self.curves else "the defaults"
            run.log.event(step, f"forecast at step {step} of {self.cfg.train.steps}: final val loss "
                                f"{f['predicted']:.4f} [{lo:.4f}, {hi:.4f}] (the run's own curve, priors from "
                                f"{src}: beta {f['curve'].beta:.3g}, annealing's gain C {f['curve'].C:.3g})",
                          kind="forecast", values=self.first)

    def _alarm(self, run, step: int, row: dict, sources: list[str]) -> None:
        out = [k for k, c in self.above.items() if c >= self.cfg.eval.off_curve_patience and k not in self.flagged]
        if not out:
            return
        self.flagged += out
        up = [k for k in sources if self.above.get(k, 0) >= self.cfg.eval.off_curve_patience]
        named = up if up and (len(up) < len(sources) or len(sources) == 1) else []
        why = (f"sources {named} left their curves while the others did not (bad data? see the data probe and "
               f"densetrain blame)" if named else "every source moved together: a change of the run (lr, optimizer, "
               "numerics), not of one source's data" if up else "no source has left the others' progress (yet): a "
               "change of the run, or one source's data before its own band is passed")
        text = ", ".join(f"'{k}' {row[k][0]:.4f} vs {row[k][1]:.4f} ({row[k][0] / row[k][1] - 1:+.1%}, band "
                         f"{self.margin(k):.1%})" for k in out if k in row)
        run.log.event(step, f"off_curve: validation loss above its band (a source: what the other sources' "
                            f"progress says; 'all': the run's own curve) for {self.cfg.eval.off_curve_patience} "
                            f"evaluations in a row: {text}; {why}",
                      kind="off_curve", action="report",
                      values={"sources": named, "keys": out, **{k: row[k] for k in out if k in row}})

    def state_dict(self) -> dict:
        return {"above": self.above, "flagged": self.flagged, "history": self.history, "points": self.points,
                "scale": self.scale, "first": self.first, "latest": self.latest,
                "fits": {k: vars(c) for k, c in self.fits.items()}, "frozen": self.frozen,
                "inside": self.inside}

    def load_state_dict(self, d: dict) -> None:
        self.above, self.flagged = dict(d.get("above", {})), list(d.get("flagged", []))
        self.history, self.points = list(d.get("history", [])), dict(d.get("points", {}))
        self.scale, self.first, self.latest = dict(d.get("scale", {})), d.get("first"), d.get("latest")
        self.fits = {k: RunCurve(**v) for k, v in d.get("fits", {}).items()}
        self.frozen, self.inside = d.get("frozen"), dict(d.get("inside", {}))

    def close(self) -> None:
        """Add the forecast (and the prediction) with the outcome to ``summary.json`` (written by the loop just
        before)."""
        path = Path(self.cfg.train.run_dir) / "summary.json"
        if self.rank != 0 or (self.first is None and self.prediction is None) or not path.exists():
            return
        try:
            summary = read_json(path)  # written by the loop just before: a regular file of a few KiB
        except (OSError, ValueError):
            return
        if not isinstance(summary, dict) or summary.get("steps") != self.cfg.train.steps:
            return
        actual = summary.get("val", {}).get("all", {})
        final = actual.get("loss")
        if self.first is not None:
            err = self.first["predicted"] / final - 1 if isinstance(final, float) and final > 0 else None
            summary["forecast"] = {**self.first, "final": final, "error": err, "latest": self.latest}
        if self.prediction is not None:
            summary["prediction"] = {**self.prediction, "ladder": self.cfg.eval.ladder, "actual_loss": final,
                                     "actual_bpb": actual.get("bpb"), "off_curve": self.flagged,
                                     "curve": self.history}
        atomic_write_json(path, summary)
