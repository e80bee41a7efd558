"""Gradient accumulation normalises by the step's total target tokens, not by micro-batch means."""

import torch

from densetrain.config import ModelConfig
from densetrain.loss import IGNORE_INDEX, token_losses
from densetrain.model.init import init_weights
from densetrain.model.llama import Transformer
from densetrain.train.step import forward_backward


def _model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
    m = Transformer(cfg)
    init_weights(m, cfg)
    with torch.no_grad():  # sharper logits, so per-sequence losses differ clearly from each other
        m.output.weight.mul_(30)
    return m.double()


def _grads(m):
    return torch.cat([p.grad.flatten() for p in m.parameters()])


def test_uneven_micro_batches_match_one_batch():
    m = _model()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 97, (2, 128), generator=g)
    y = torch.randint(0, 97, (2, 128), generator=g)
    y[0, 10:] = IGNORE_INDEX  # sequence 0 has 10 targets
    y[1, 100:] = IGNORE_INDEX  # sequence 1 has 100 targets

    stats = forward_backward(m, [(x, y, ["a", "b"])], n_tokens_global=110)
    g_one = _grads(m)
    m.zero_grad()
    stats2 = forward_backward(m, [(x[:1], y[:1], ["a"]), (x[1:], y[1:], ["b"])], n_tokens_global=110)
    g_two = _grads(m)

    rel = (g_one - g_two).norm() / g_one.norm()
    assert rel < 1e-6
    with torch.no_grad():
        total = token_losses(m(x), y).sum().item()
    assert stats.n_tokens == stats2.n_tokens == 110
    # The logged loss is the sum of token losses over both micro-batches / 110.
    assert abs(stats2.loss_sum / stats2.n_tokens - total / 110) < 1e-9
    # The mean of micro-batch means weighs the 10-token sequence 10x more per token: not what we do.
    with torch.no_grad():
        l0 = token_losses(m(x[:1]), y[:1]).sum().item() / 10
        l1 = token_losses(m(x[1:]), y[1:]).sum().item() / 100
    assert abs((l0 + l1) / 2 - total / 110) > 1e-3
    assert stats2.per_source["a"][1] == 10 and stats2.per_source["b"][1] == 100
