"""The ladder's trajectory law (densetrain.law.trajectory): fitted to trajectories generated from a known law it
finds that law and predicts a run of a new size and a new schedule; a law it cannot pin is judged degenerate and
its prediction withheld."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from densetrain.errors import DataError
from densetrain.law import schedule_areas
from densetrain.law.files import check_fit, check_trajectory
from densetrain.law.forecast import anneal_drop
from densetrain.law.judge import judge_trajectory, trajectory_prediction
from densetrain.law.trajectory import Trajectory, bootstrap_trajectory, fit_trajectory
from densetrain.report.ladder import verdict_text
from densetrain.tools.ladder.fit import format_fit

TRUE = Trajectory(E=1.8, A=2.0e4, alpha=0.35, B=3.0e5, beta=0.3, C=0.15)
TOKENS = 2048.0  # a step


def lrs(steps: int, kind: str) -> np.ndarray:
    """lr / peak of each step: 10 warmup steps, then WSD (20% linear decay to 0.1) or cosine to 0.1."""
    i = np.arange(steps, dtype=float)
    warm = np.minimum((i + 1) / 10.0, 1.0)
    if kind == "wsd":
        start = steps - round(0.2 * steps)
        p = np.clip((i - start + 1) / (steps - start), 0.0, 1.0)
        return np.where(i < 10, warm, 1.0 - 0.9 * p)
    p = np.clip((i - 9) / (steps - 10), 0.0, 1.0)
    return np.where(i < 10, warm, 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * p)))


def areas(steps: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """The forward area S1 (tokens) and the annealing drop D after each step."""
    r = lrs(steps, kind)
    return schedule_areas(r, TOKENS, 1.0)[0], anneal_drop(r, 1.0)


def points(law: Trajectory, runs: list[tuple[float, int]], noise: float, seed: int = 0):
    """Every 80th step from 25% of each (n, steps) WSD run, its loss from ``law`` times (1 + noise x N(0, 1))."""
    rng = np.random.default_rng(seed)
    rows = []
    for n, steps in runs:
        s1, dr = areas(steps, "wsd")
        for k in range(steps // 4, steps, 80):
            rows.append((n, s1[k], dr[k], float(law.loss(n, s1[k], dr[k])) * (1 + noise * rng.standard_normal()),
                         f"n{n:g}_t{steps}"))
        rows.append((n, s1[-1], dr[-1], float(law.loss(n, s1[-1], dr[-1])), f"n{n:g}_t{steps}"))
    return [np.array([r[i] for r in rows], float) for i in range(4)] + [[r[4] for r in rows]]


LADDER = [(1e4, 1200), (3e4, 800), (1e5, 500), (3e5, 300), (1e4, 400), (3e4, 300)]


def test_fit_recovers_a_known_law_and_predicts_a_new_size_and_schedule():
    n, s1, dr, loss, runs = points(TRUE, LADDER, noise=0.001)
    law = fit_trajectory(n, s1, dr, loss)
    assert law.scale < 0.003
    # a run 3x larger than the largest, 4x longer than its run, on a cosine schedule the ladder never ran
    big_s1, big_dr = areas(1200, "cos")
    truth = float(TRUE.loss(9e5, big_s1[-1], big_dr[-1]))
    assert float(law.loss(9e5, big_s1[-1], big_dr[-1])) == pytest.approx(truth, rel=0.01)
    # the schedule matters: the cosine run's end differs from a WSD run's of the same length as the truth says
    w1, wd = areas(1200, "wsd")
    true_gap = truth - float(TRUE.loss(9e5, w1[-1], wd[-1]))
    fit_gap = float(law.loss(9e5, big_s1[-1], big_dr[-1]) - law.loss(9e5, w1[-1], wd[-1]))
    assert abs(true_gap) > 0.01 and fit_gap == pytest.approx(true_gap, abs=0.3 * abs(true_gap))
    boot = bootstrap_trajectory(n, s1, dr, loss, runs, law, samples=10)
    verdict = judge_trajectory(law, boot, n, s1, dr, loss)
    assert not verdict["degenerate"], verdict["reasons"]
    fit = {"trajectory": {"law": law.as_dict(), "bootstrap": [[b.E, b.A, b.alpha, b.B, b.beta, b.C] for b in boot],
                          "n_range": [1e4, 3e5], "s1_range": [float(s1.min()), float(s1.max())], **verdict}}
    p = trajectory_prediction(fit, 9e5, big_s1[-1], big_dr[-1])
    assert p["withheld"] is None and p["loss_lo"] <= p["loss"] <= p["loss_hi"]
    assert p["n_extrapolation"] == pytest.approx(3.0)


def test_a_law_with_a_parameter_at_its_bound_or_one_size_is_degenerate_and_withheld():
    # no annealing gain in the data: C ends at its lower bound 0
    flat = Trajectory(E=1.8, A=2.0e4, alpha=0.35, B=3.0e5, beta=0.3, C=0.0)
    n, s1, dr, loss, runs = points(flat, LADDER[:4], noise=0.001)
    law = fit_trajectory(n, s1, dr, loss)
    verdict = judge_trajectory(law, [], n, s1, dr, loss)
    assert verdict["degenerate"] and any(r.startswith("C = ") and "lower bound" in r for r in verdict["reasons"])
    fit = {"trajectory": {"law": law.as_dict(), "bootstrap": [], "n_range": [1e4, 3e5], "s1_range": [1.0, 1e6],
                          **verdict}}
    assert "degenerate" in trajectory_prediction(fit, 1e6, 2e6, 1e5)["withheld"]
    # one size: the N term is not measured, whatever law is judged on these points (the true one here)
    n, s1, dr, loss, runs = points(TRUE, [(3e4, 1200), (3e4, 600), (3e4, 300)], noise=0.001)
    verdict = judge_trajectory(TRUE, [], n, s1, dr, loss)
    assert verdict["degenerate"] and verdict["reasons"][0].startswith("1 sizes")
    assert "0 distinct bootstrap refits" in " ".join(verdict["reasons"])


def test_bad_points_are_refused():
    with pytest.raises(ValueError, match="6 parameters"):
        fit_trajectory([1e4] * 5, [1e5] * 5, [0.0] * 5, [3.0] * 5)
    with pytest.raises(ValueError, match="dr"):
        fit_trajectory([1e4] * 6, [1e5] * 6, [-1.0] * 6, [3.0] * 6)


def test_fit_json_trajectory_is_checked_on_read():
    good = {"law": TRUE.as_dict(), "bootstrap": [[1.8, 2e4, 0.35, 3e5, 0.3, 0.15]], "n_range": [1e4, 3e5],
            "s1_range": [1e4, 1e6], "degenerate": False}
    assert check_trajectory(good, "fit.json") is good
    with pytest.raises(DataError, match=r"fit.json: key 'trajectory.bootstrap\[0\]'.*expected \[E, A, alpha, B"):
        check_trajectory({**good, "bootstrap": [[1.8, 2e4]]}, "fit.json")
    with pytest.raises(DataError, match=r"key 'trajectory.law.C': got NaN"):
        check_trajectory({**good, "law": {**good["law"], "C": float("nan")}}, "fit.json")


def test_a_fit_read_back_with_null_intervals_prints():
    """fit.json writes a nan as null (approach 2's interval from 0 distinct refits): format_fit of the file read
    back printed nothing but a TypeError before; the issue-42 ladder's fit (benchmarks/ladder_h2_fit.json)."""
    fit = check_fit(json.loads((Path(__file__).parents[1] / "benchmarks" / "ladder_h2_fit.json").read_text()), "f")
    text = format_fit(fit)
    assert "approach 2: N_opt ~ C^0.401 [nan, nan]" in text
    assert "trajectory law E + ((A/N)^(alpha/beta) + B/S1)^beta - C*D (156 points of 14 runs" in text
    assert "median; more than 5%" in text


def test_the_panel_says_the_trajectory_verdict():
    fit = check_fit(json.loads((Path(__file__).parents[1] / "benchmarks" / "ladder_h2_fit.json").read_text()), "f")
    tr = {"degenerate": fit["trajectory"]["degenerate"], "reasons": fit["trajectory"]["reasons"]}
    text = verdict_text({"degenerate": None, "trajectory": tr})
    assert text == "trajectory law: DEGENERATE (the loss interval at the ladder's own points spans 5.1% (median; " \
                   "more than 5%))"
    both = verdict_text({"degenerate": {"reasons": ["E at its bound"], "next": ["another size"]},
                         "trajectory": {"degenerate": False, "reasons": []}})
    assert both == ("DEGENERATE FIT: no prediction (E at its bound); run next: another size; "
                    "trajectory law: not degenerate")
