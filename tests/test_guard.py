"""train/guard.py: the spike z-score, robust (median/MAD, the default) or OLMo-core's mean/std."""

from __future__ import annotations

import pytest

from densetrain.config import load_config
from densetrain.config.recovery import GuardConfig
from densetrain.errors import ConfigError
from densetrain.train.guard import Guard, loss_z
from densetrain.train.step import StepResult, StepStats
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
