"""train/watch/guard.py: the spike z-score, robust (median/MAD, the default) or OLMo-core's mean/std."""

from __future__ import annotations

import math

import pytest

from densetrain.config import load_config
from densetrain.config.recovery import GuardConfig
from densetrain.errors import ConfigError
from densetrain.train.step import StepResult, StepStats
from densetrain.train.watch.guard import Guard, _as_metrics, loss_z, nonfinite_what
from densetrain.train.watchers import Verdict

ALTERNATING = [2.9, 3.1] * 10  # a loss that alternates between two levels


def test_zscores_of_the_same_loss_under_both_conventions():
    z, med = loss_z(3.7, ALTERNATING, "robust")  # (3.7 - 3.0) / (1.4826 * 0.1)
    assert med == pytest.approx(3.0) and z == pytest.approx(0.7 / 0.14826, rel=1e-9)
    z, mean = loss_z(3.7, ALTERNATING, "mean_std")  # sample std of 20 values: 0.1 * sqrt(20 / 19)
    assert mean == pytest.approx(3.0) and z == pytest.approx(0.7 / (0.1 * (20 / 19) ** 0.5), rel=1e-9)
    assert round(loss_z(3.7, ALTERNATING, "robust")[0], 1) == 4.7
    assert round(loss_z(3.7, ALTERNATING, "mean_std")[0], 1) == 6.8


@pytest.mark.parametrize("method, verdict", [("robust", Verdict.APPLY), ("mean_std", Verdict.SKIP)])
def test_3_7_after_alternating_losses_is_a_spike_only_for_mean_std(method, verdict):
    guard = Guard(GuardConfig(zscore=method, min_history=20), max_nonfinite=3)
    guard.history.extend(ALTERNATING)
    result = StepResult(index=20, stage=None, lr=1e-3, loss=3.7, grad_norm=1.0, stats=StepStats(),
                        first_sample=0, data_s=0.0)
    assert guard.judge(None, result) == verdict
    assert guard.cfg.spike_zscore == 6.0  # the same threshold (OLMo-core's sigma_factor) under both


def test_default_is_robust_and_a_wrong_name_is_a_one_line_error():
    assert GuardConfig().zscore == "robust"
    with pytest.raises(ConfigError, match="guard.zscore must be 'robust' or 'mean_std', got 'mad'"):
        load_config(preset="tiny", overrides=[("guard.zscore", "mad")])


def test_skip_event_names_what_was_not_finite_and_the_step_metrics_and_replay_count():
    def result(loss, grad_norm, ranks):
        return StepResult(index=7, stage=None, lr=1e-3, loss=loss, grad_norm=grad_norm,
                          stats=StepStats(nonfinite_ranks=ranks), first_sample=0, data_s=0.0)

    assert nonfinite_what(result(5.87, math.nan, 1)) == "non-finite grad_norm"  # the finite loss is not blamed
    assert nonfinite_what(result(math.inf, math.nan, 2)) == "non-finite loss and grad_norm"
    # both reduced numbers finite: one rank's own gradient overflowed (the bit-flip rehearsal, test_sdc)
    assert nonfinite_what(result(6.19, 0.94, 1)) == "non-finite loss or grad_norm on 1 rank"
    assert _as_metrics(7) == "metrics.jsonl step 8, densetrain replay RUN 8"
