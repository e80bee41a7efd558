"""The chunked cross-entropy (:func:`densetrain.loss.chunked_head_losses`) computes plain cross-entropy
(losses, z-loss, per-source sums, gradients of the logits' input and of the head's weight) without
holding the logits of more than one chunk for the backward."""

import pytest
import torch

from densetrain.config import ModelConfig
from densetrain.loss import (
    IGNORE_INDEX,
    LOGIT_CHUNK_ELEMENTS,
    chunk_tokens_for,
    chunked_head_losses,
    token_losses,
    z_loss_sum,
    z_loss_sum_from_lse,
)
from densetrain.model.init import init_weights
from densetrain.model.llama import Transformer
from densetrain.train.step import forward_backward

Z = 1e-2  # a z-loss coefficient large enough that its gradient shows in the comparison


def _head(V=1000, D=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(D, V, bias=False, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(V, D, generator=g))  # logits of size ~4: a peaked softmax
    h = torch.randn(3, 21, D, generator=g, dtype=dtype)
    y = torch.randint(0, V, (3, 21), generator=g)
    y[0, :5] = IGNORE_INDEX
    y[2, -3:] = IGNORE_INDEX
    return lin, h, y


def _close(a, b, tol=1e-6):
    """max |a - b| <= tol * max |b|."""
    a, b = a.detach(), b.detach()
    assert float((a - b).abs().max()) <= tol * float(b.abs().max()), (float((a - b).abs().max()), float(b.abs().max()))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-6), (torch.float32, 1e-5)])
def test_chunked_equals_plain_cross_entropy_with_z_loss(dtype, tol):
    """In float64 the two agree to 1e-6 (the same math); in fp32 to rounding (``log Z - z_target`` is not
    ``F.cross_entropy``'s order of operations)."""
    lin, h0, y = _head(dtype=dtype)
    mask = y != IGNORE_INDEX
    h = h0.clone().requires_grad_()
    logits = lin(h)
    want = token_losses(logits, y)
    (want.sum() + Z * z_loss_sum(logits, mask)).backward()
    want_h, want_w = h.grad.clone(), lin.weight.grad.clone()
    lin.weight.grad = None
    for chunk in (1, 8, 63, 1000):  # 63 tokens in all: uneven chunks, one token, one chunk
        hc = h0.clone().requires_grad_()
        got, lse = chunked_head_losses(lin, hc, y, chunk)
        assert got.shape == y.shape and bool((got[~mask] == 0).all())
        _close(got, want, tol)
        _close(lse, torch.logsumexp(lin(h0), -1), tol)
        (got.sum() + Z * z_loss_sum_from_lse(lse, mask)).backward()
        _close(hc.grad, want_h, tol)  # the gradient reaching the logits' input
        _close(lin.weight.grad, want_w, tol)
        lin.weight.grad = None


def test_chunked_saves_one_chunk_not_the_logits():
    """The bytes autograd keeps for the backward: plain cross-entropy keeps the (n, V) logits' log-softmax;
    the chunked one keeps each chunk's input only (the logits are recomputed per chunk in the backward)."""
    lin, h0, y = _head()
    n, V = y.numel(), lin.weight.shape[0]

    def saved_bytes(fn):
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return total[0]

    h = h0.clone().requires_grad_()
    assert saved_bytes(lambda: token_losses(lin(h), y)) >= n * V * 4
    assert saved_bytes(lambda: chunked_head_losses(lin, h, y, 8)) < 8 * V * 4


def test_chunk_size_rule():
    # Llama 3's vocabulary at a 4096-token micro-batch: 523 tokens per chunk (2**26 logits).
    assert chunk_tokens_for(128256, 4096) == LOGIT_CHUNK_ELEMENTS // 128256 == 523
    # The golden trajectory's micro-batches (2 x 64 tokens, vocabulary 512) and the tiny preset's (8 x 256,
    # 8192): no chunking, the plain path.
    assert chunk_tokens_for(512, 128) == 0 and chunk_tokens_for(8192, 2048) == 0


def test_forward_backward_chunked_equals_plain():
    """The step with the chunked head (forced, 5 tokens per chunk) gives the plain step's loss sums,
    z-loss, per-source sums and parameter gradients, with the μP logit multiplier and tied embeddings."""
    cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, tie_embeddings=True)
    torch.manual_seed(0)
    m = Transformer(cfg)
    init_weights(m, cfg)
    m = m.double()  # float64: the comparison shows the math, not fp32 rounding
    m.logit_mult = 0.5
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 97, (4, 24), generator=g)
    y = torch.randint(0, 97, (4, 24), generator=g)
    y[1, 7:] = IGNORE_INDEX
    micro = [(x[:2], y[:2], ["a", "b"]), (x[2:], y[2:], ["a", "a"])]
    n = int((y != IGNORE_INDEX).sum())
    runs = []
    for chunk in (0, 5):
        m.zero_grad(set_to_none=True)
        stats = forward_backward(m, micro, n, z_loss=Z, loss_chunk_tokens=chunk)
        runs.append((stats, {k: p.grad.clone() for k, p in m.named_parameters()}))
    (plain, g_plain), (chunked, g_chunked) = runs
    assert chunked.n_tokens == plain.n_tokens == n
    assert abs(chunked.loss_sum - plain.loss_sum) <= 1e-6 * plain.loss_sum
    assert abs(chunked.z_loss_sum - plain.z_loss_sum) <= 1e-6 * plain.z_loss_sum
    for src in ("a", "b"):
        assert chunked.per_source[src][1] == plain.per_source[src][1]
        assert abs(chunked.per_source[src][0] - plain.per_source[src][0]) <= 1e-6 * plain.per_source[src][0]
    for k in g_plain:
        _close(g_chunked[k], g_plain[k])
