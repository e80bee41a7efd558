"""The on-track alarm: each validation against the run's predicted curve for its own lr schedule.

With ``eval.ladder = LADDER_DIR`` (a ladder fitted by ``densetrain ladder fit``, its ``fit.json``), the
watcher

- logs the predicted final validation loss and bpb of this run (N its parameters without the input
  embedding table, D its planned tokens) with the ladder's bootstrap interval and how far past the ladder's
  largest budget the run extrapolates (a warning beyond :data:`FAR`), at the first step;
- at each validation, compares the loss of every source and of all of them with the schedule-aware curve
  fitted on the ladder's runs (:class:`densetrain.law.Curve`: the forward and annealing areas of *this*
  run's lr schedule up to that step, :func:`run_areas`), and raises one ``off_curve`` event when
  ``eval.off_curve_patience`` validations in a row are above the band (``eval.off_curve_margin``, or 3 times
  the curve's own residual scale, at least 1%), naming the sources whose loss left their own curves: the slow
  rise of a run fed bad data that no spike detector sees (the seed's post-mortem 7.1);
- adds ``prediction`` (predicted, interval, outcome, the off-curve sources) to ``summary.json`` when the run
  ends (after the loop wrote it).

The loop validates after the watchers' ``after_step``, so a validation is judged at the next step; the
final one only enters the summary. Checks start after warmup and :data:`CURVE_FROM` of the run, where the fit
starts.
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
from densetrain.law.judge import checked_prediction
from densetrain.schedule import Stage, lr_for, stage_at, warmup_steps
from densetrain.train.watchers import Verdict, Watcher

CURVE_FROM = 0.25
"""The curve covers validations from this fraction of a run's steps on, in the fit and in the checks: the first
steps of a small model's loss fall faster than any power law in S1 (a micro ladder's fit on them left residuals
from -25% early to +3% late)."""
FAR = 100.0
"""Extrapolation factor (run FLOPs / the ladder's largest budget) beyond which a prediction is flagged."""


def run_areas(cfg: Config, stages: list[Stage], lam: float = ANNEAL_MOMENTUM) -> tuple[np.ndarray, np.ndarray]:
    """The forward and annealing areas (tokens, :func:`densetrain.law.schedule_areas`) after each of the
    ``cfg.train.steps`` steps of this config's lr schedule (``[k - 1]``: after k steps)."""
    steps = range(cfg.train.steps)
    return schedule_areas([lr_for(i, cfg, stages) for i in steps],
                          [stage_at(i, stages).batch_tokens for i in steps], cfg.optim.peak_lr, lam)


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


class OffCurve(Watcher):
    """The prediction and the on-track alarm (module docstring)."""

    name = "off_curve"

    def __init__(self, cfg: Config, rank: int):
        self.cfg, self.rank = cfg, rank
        self.fit = read_fit(cfg.eval.ladder)
        self.curves = {k: Curve(**v) for k, v in self.fit["curves"].items()}
        self.prediction: dict | None = None
        self.n = 0.0
        self.s1 = self.s2 = None
        self.seen = None  # the run.last_val judged last
        self.above: dict[str, int] = {}  # consecutive validations above the band, per source / 'all'
        self.flagged: list[str] = []
        self.history: list[dict] = []

    def margin(self, key: str) -> float:
        return self.cfg.eval.off_curve_margin or max(0.01, 3.0 * self.curves[key].scale)

    def before_step(self, run) -> None:
        if self.s1 is not None:
            return
        self.s1, self.s2 = run_areas(self.cfg, run.stages, self.fit.get("lam", ANNEAL_MOMENTUM))
        m = self.cfg.model
        self.n = float(run.model.num_params() - m.vocab_size * m.d_model)
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
        if step <= max(warmup_steps(self.cfg.schedule, self.cfg.train.steps), CURVE_FROM * self.cfg.train.steps):
            return
        s1, s2 = self.s1[step - 1], self.s2[step - 1]
        tokens = sum(v["tokens"] for v in val.values())
        actual = {**{s: v["loss"] for s, v in val.items()},
                  "all": sum(v["loss"] * v["tokens"] for v in val.values()) / tokens if tokens else math.nan}
        row = {"step": step}
        for key, loss in actual.items():
            if key not in self.curves or not math.isfinite(loss):
                continue
            pred = float(self.curves[key].loss(self.n, s1, s2))
            row[key] = [loss, pred]
            self.above[key] = self.above.get(key, 0) + 1 if loss > pred * (1 + self.margin(key)) else 0
        self.history.append(row)
        out = [k for k, c in self.above.items() if c >= self.cfg.eval.off_curve_patience and k not in self.flagged]
        if out:
            self.flagged += out
            sources = [k for k in out if k != "all"] or out
            text = ", ".join(f"'{k}' {row[k][0]:.4f} vs {row[k][1]:.4f} ({row[k][0] / row[k][1] - 1:+.1%}, band "
                             f"{self.margin(k):.1%})" for k in out)
            run.log.event(step, f"off_curve: validation loss above the predicted curve for "
                                f"{self.cfg.eval.off_curve_patience} evaluations in a row: {text}; sources "
                                f"{sources} left their curves (bad data? see the data probe and densetrain blame)",
                          kind="off_curve", action="report",
                          values={"sources": sources, "keys": out, **{k: row[k] for k in out}})

    def state_dict(self) -> dict:
        return {"above": self.above, "flagged": self.flagged, "history": self.history}

    def load_state_dict(self, d: dict) -> None:
        self.above, self.flagged = dict(d.get("above", {})), list(d.get("flagged", []))
        self.history = list(d.get("history", []))

    def close(self) -> None:
        """Add the prediction and the outcome to ``summary.json`` (written by the loop just before)."""
        path = Path(self.cfg.train.run_dir) / "summary.json"
        if self.rank != 0 or self.prediction is None or not path.exists():
            return
        try:
            summary = read_json(path)  # written by the loop just before: a regular file of a few KiB
        except (OSError, ValueError):
            return
        if summary.get("steps") != self.cfg.train.steps:
            return
        actual = summary.get("val", {}).get("all", {})
        summary["prediction"] = {**self.prediction, "ladder": self.cfg.eval.ladder, "actual_loss": actual.get("loss"),
                                 "actual_bpb": actual.get("bpb"), "off_curve": self.flagged,
                                 "curve": self.history}
        atomic_write_json(path, summary)
