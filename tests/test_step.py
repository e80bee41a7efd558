"""train/step.py: the sums a step's verdict is taken from."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from densetrain.train.step import forward_backward, local_nonfinite


class _FixedLogits(torch.nn.Module):
    """Logits (b, T, 2) = (0, w * scale) per token: with target 1 each token's loss is -w*scale nats
    (log(1 + e^(w*scale)) - w*scale, exactly -w*scale in fp32 for w*scale <= -1e3)."""

    def __init__(self, scale: float):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))
        self.scale = scale
        self.cfg = SimpleNamespace(vocab_size=2)  # what forward_backward reads to size its loss chunks

    def forward(self, x):
        z = torch.zeros(x.shape, dtype=torch.float32)
        return torch.stack([z, self.w * self.scale + z], dim=-1)


def _step(scale: float, rows: int = 2, T: int = 8):
    x = torch.zeros(rows, T, dtype=torch.long)
    y = torch.ones(rows, T, dtype=torch.long)
    model = _FixedLogits(scale)
    stats = forward_backward(model, [(x, y, ["web"] * rows)], n_tokens_global=rows * T)
    return stats, float(model.w.grad.abs())


def test_large_finite_token_losses_are_finite_and_not_skipped():
    # 1e38 nats per token is finite in fp32, but 8 of them in a row sum to inf in fp32
    stats, grad = _step(-1e38)
    assert stats.n_tokens == 16
    assert math.isfinite(stats.loss_sum) and stats.loss_sum == pytest.approx(16e38, rel=1e-6)
    assert stats.per_source["web"][0] == pytest.approx(16e38, rel=1e-6)
    assert local_nonfinite(stats, grad) == 0


def test_an_infinite_token_loss_is_still_non_finite():
    stats, grad = _step(-math.inf)
    assert not math.isfinite(stats.loss_sum)
    assert local_nonfinite(stats, grad) == 1
    stats, grad = _step(-1e3)  # an ordinary loss, summed as before: 1000 nats per token
    assert stats.loss_sum == 16e3 and local_nonfinite(stats, grad) == 0
