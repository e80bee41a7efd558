"""Tests of densetrain/model/llama.py and densetrain/model/init.py (CPU, small shapes)."""

from __future__ import annotations

import math

import pytest
import torch

from densetrain.config import ModelConfig
from densetrain.model.init import init_weights, mup_lr_scale
from densetrain.model.llama import (
    Attention,
    RMSNorm,
    Transformer,
    apply_rope,
    rope_cos_sin,
    rope_inv_freq,
)


def tiny_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=160)
    base.update(kw)
    return ModelConfig(**base)


def build(cfg: ModelConfig, seed: int = 0) -> Transformer:
    m = Transformer(cfg)
    torch.manual_seed(seed)  # after construction: init_weights alone decides the values
    init_weights(m, cfg)
    return m


def explicit_attention(att: Attention, x: torch.Tensor, cos, sin, kv_of_head, scale: float) -> torch.Tensor:
    """Reference: per-head softmax(q k^T * scale + causal mask) v, with an explicit head -> KV-head map."""
    B, T, D = x.shape
    hd = att.head_dim
    q = (x @ att.wq.weight.T).view(B, T, att.n_heads, hd).transpose(1, 2)
    k = (x @ att.wk.weight.T).view(B, T, att.n_kv_heads, hd).transpose(1, 2)
    v = (x @ att.wv.weight.T).view(B, T, att.n_kv_heads, hd).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    heads = []
    for h in range(att.n_heads):
        g = kv_of_head(h)
        s = (q[:, h] @ k[:, g].transpose(-1, -2)) * scale  # (B, T, T)
        s = s.masked_fill(~mask, float("-inf"))
        heads.append(torch.softmax(s, dim=-1) @ v[:, g])  # (B, T, hd)
    y = torch.stack(heads, dim=1).transpose(1, 2).reshape(B, T, D)
    return y @ att.wo.weight.T


# ---- attention ------------------------------------------------------------------------------------


def test_gqa_matches_explicit_per_head_attention():
    torch.manual_seed(0)
    att = Attention(d_model=64, n_heads=8, n_kv_heads=2)  # head_dim 8, 4 query heads per KV head
    x = torch.randn(2, 12, 64)
    cos, sin = rope_cos_sin(8, 10000.0, 12)
    with torch.no_grad():
        out = att(x, cos, sin)
        ref = explicit_attention(att, x, cos, sin, lambda h: h // 4, 1 / math.sqrt(8))
        wrong = explicit_attention(att, x, cos, sin, lambda h: h % 2, 1 / math.sqrt(8))
    assert out.shape == (2, 12, 64)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # The test can tell groupings apart: interleaved assignment gives a different result.
    assert (out - wrong).abs().max() > 1e-3


def test_mha_when_kv_heads_equal_heads_and_custom_scale():
    torch.manual_seed(1)
    att = Attention(d_model=32, n_heads=4, n_kv_heads=4)
    x = torch.randn(3, 10, 32)
    cos, sin = rope_cos_sin(8, 10000.0, 10)
    with torch.no_grad():
        torch.testing.assert_close(
            att(x, cos, sin), explicit_attention(att, x, cos, sin, lambda h: h, 1 / math.sqrt(8)), atol=1e-5, rtol=1e-5
        )
        att.attn_scale = 1 / 8  # μP-style 1/head_dim
        torch.testing.assert_close(
            att(x, cos, sin), explicit_attention(att, x, cos, sin, lambda h: h, 1 / 8), atol=1e-5, rtol=1e-5
        )


def test_attention_rejects_bad_head_counts():
    with pytest.raises(ValueError):
        Attention(d_model=64, n_heads=8, n_kv_heads=3)


# ---- RoPE -----------------------------------------------------------------------------------------


def _scores(q, k, theta, positions, shift):
    """q·k after rotating q to position m+shift and k to n+shift, for (m, n) in positions."""
    T = max(max(p) for p in positions) + shift + 1
    cos, sin = rope_cos_sin(q.shape[-1], theta, T)
    out = []
    for m, n in positions:
        qr = apply_rope(q.view(1, 1, 1, -1), cos[m + shift : m + shift + 1], sin[m + shift : m + shift + 1])
        kr = apply_rope(k.view(1, 1, 1, -1), cos[n + shift : n + shift + 1], sin[n + shift : n + shift + 1])
        out.append((qr * kr).sum().item())
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_rope_scores_depend_only_on_relative_offset(theta):
    torch.manual_seed(2)
    q, k = torch.randn(16), torch.randn(16)
    pos = [(5, 2), (7, 7), (3, 9), (20, 0)]
    base = _scores(q, k, theta, pos, 0)
    for shift in (1, 13, 100):
        torch.testing.assert_close(_scores(q, k, theta, pos, shift), base, atol=1e-4, rtol=1e-4)
    # ...and scores do depend on the offset itself.
    assert abs(base[0] - base[2]) > 1e-3


def test_rope_pairs_i_with_i_plus_half():
    cos, sin = rope_cos_sin(8, 10000.0, 4)
    x = torch.zeros(1, 1, 4, 8)
    x[..., 1] = 1.0  # unit vector on dim 1: rotation must move it into dim 1 + 4 only
    y = apply_rope(x, cos, sin)
    inv = rope_inv_freq(8, 10000.0)
    for p in range(4):
        expect = torch.zeros(8)
        expect[1] = math.cos(p * inv[1].item())
        expect[5] = math.sin(p * inv[1].item())
        torch.testing.assert_close(y[0, 0, p], expect, atol=1e-6, rtol=0)


def test_set_rope_theta_changes_inv_freq_and_cache():
    cfg = tiny_cfg(rope_theta=10000.0)
    m = build(cfg)
    hd = cfg.head_dim
    expect = lambda th: torch.tensor([1.0 / th ** (2 * i / hd) for i in range(hd // 2)], dtype=torch.float32)
    torch.testing.assert_close(m.rope_inv_freq(), expect(10000.0))
    cos_old, _ = m.rope_cache(32)
    cos_old = cos_old.clone()
    m.set_rope_theta(500000.0)
    assert m.rope_theta == 500000.0
    assert m.rope_cos.shape[0] == 0  # cache invalidated
    torch.testing.assert_close(m.rope_inv_freq(), expect(500000.0))
    cos_new, sin_new = m.rope_cache(32)
    ref_cos, ref_sin = rope_cos_sin(hd, 500000.0, 32)
    torch.testing.assert_close(cos_new, ref_cos)
    torch.testing.assert_close(sin_new, ref_sin)
    assert not torch.allclose(cos_new, cos_old)
    # Relative-position property still holds with the model's own cache.
    torch.manual_seed(3)
    q, k = torch.randn(hd), torch.randn(hd)

    def score(a, b):
        qr = apply_rope(q.view(1, 1, 1, -1), cos_new[a : a + 1], sin_new[a : a + 1])
        kr = apply_rope(k.view(1, 1, 1, -1), cos_new[b : b + 1], sin_new[b : b + 1])
        return (qr * kr).sum()

    torch.testing.assert_close(score(10, 3), score(27, 20), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError):
        m.set_rope_theta(0.0)


def test_rope_cache_grows_with_sequence_length():
    m = build(tiny_cfg())
    m(torch.randint(0, 512, (1, 8)))
    assert m.rope_cos.shape[0] == 8
    m(torch.randint(0, 512, (1, 24)))
    assert m.rope_cos.shape[0] == 24
    m(torch.randint(0, 512, (1, 4)))  # shorter: reuse, do not shrink
    assert m.rope_cos.shape[0] == 24
    assert "rope_cos" not in m.state_dict()  # non-persistent


def test_rope_runs_in_fp32_under_autocast():
    m = build(tiny_cfg())
    x = torch.randint(0, 512, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = m(x)
    assert logits.dtype == torch.bfloat16
    assert m.rope_cos.dtype == torch.float32
    assert (logits.float() - m(x)).abs().max() < 0.1


# ---- whole model ----------------------------------------------------------------------------------


def test_forward_shape_dtype_and_param_names():
    cfg = tiny_cfg()
    m = build(cfg)
    logits = m(torch.randint(0, cfg.vocab_size, (2, 9)))
    assert logits.shape == (2, 9, cfg.vocab_size) and logits.dtype == torch.float32
    names = set(dict(m.named_parameters()))
    expected = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    for i in range(cfg.n_layers):
        expected |= {f"layers.{i}.attention_norm.weight", f"layers.{i}.ffn_norm.weight"}
        expected |= {f"layers.{i}.attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")}
        expected |= {f"layers.{i}.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")}
    assert names == expected
    assert m.layers[0].attention.wk.weight.shape == (cfg.n_kv_heads * cfg.head_dim, cfg.d_model)


def test_causality():
    cfg = tiny_cfg()
    m = build(cfg)
    torch.manual_seed(4)
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    t = 9
    y = x.clone()
    y[:, t] = (y[:, t] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = m(x), m(y)
    torch.testing.assert_close(a[:, :t], b[:, :t], atol=1e-6, rtol=0)
    assert (a[:, t] - b[:, t]).abs().max() > 1e-4


def test_llama3_8b_param_count_on_meta():
    cfg = ModelConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      d_ff=14336, rope_theta=500000.0, tie_embeddings=False)
    with torch.device("meta"):
        m = Transformer(cfg)
    assert m.tok_embeddings.weight.is_meta
    n = m.num_params()
    assert n == 8_030_261_248
    assert round(n / 1e9, 2) == 8.03
    assert m.num_params(exclude_embeddings=True) == n - 128256 * 4096


def test_num_params_tied():
    cfg = tiny_cfg(tie_embeddings=True)
    m = build(cfg)
    assert m.output.weight is m.tok_embeddings.weight
    untied = build(tiny_cfg())
    assert m.num_params() == untied.num_params() - cfg.vocab_size * cfg.d_model
    assert m.num_params(exclude_embeddings=True) == m.num_params()


def test_meta_then_to_empty_then_init():
    cfg = tiny_cfg(tie_embeddings=True)
    with torch.device("meta"):
        m = Transformer(cfg)
    m.to_empty(device="cpu")
    torch.manual_seed(0)
    init_weights(m, cfg)
    assert m.output.weight is m.tok_embeddings.weight  # re-tied
    ref = build(cfg, seed=0)
    x = torch.randint(0, cfg.vocab_size, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref(x))


def test_no_biases_anywhere():
    m = build(tiny_cfg())
    for name, mod in m.named_modules():
        if isinstance(mod, torch.nn.Linear):
            assert mod.bias is None, name
    assert not any("bias" in n for n, _ in m.named_parameters())


# ---- init -----------------------------------------------------------------------------------------


def test_standard_init_stds():
    cfg = ModelConfig(vocab_size=1024, d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=512)
    m = build(cfg)
    resid = 0.02 / math.sqrt(2 * cfg.n_layers)
    L = m.layers[1]
    for w in (L.attention.wq, L.attention.wk, L.attention.wv, L.feed_forward.w1, L.feed_forward.w3):
        assert abs(w.weight.std().item() / 0.02 - 1) < 0.05
    for w in (L.attention.wo, L.feed_forward.w2):
        assert abs(w.weight.std().item() / resid - 1) < 0.05
    assert abs(m.tok_embeddings.weight.std().item() / 0.02 - 1) < 0.05
    assert abs(m.output.weight.std().item() / 0.02 - 1) < 0.05
    assert abs(m.layers[0].attention.wq.weight.mean().item()) < 1e-3
    for n, p in m.named_parameters():
        if n.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), n
    assert m.attn_scale is None and m.logit_mult == 1.0
    assert all(mup_lr_scale(n, cfg) == 1.0 for n, _ in m.named_parameters())


def test_rmsnorm():
    n = RMSNorm(8, eps=1e-5)
    x = torch.randn(3, 8) * 5
    ref = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(n(x), ref)
    assert n(x.bfloat16()).dtype == torch.float32  # fp32 gain promotes; under autocast the gain is cast


def test_mup_init_and_hooks():
    base_cfg = ModelConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256,
                           init="mup", base_d_model=128)
    wide_cfg = ModelConfig(vocab_size=256, d_model=512, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=1024,
                           init="mup", base_d_model=128)
    base, wide = build(base_cfg), build(wide_cfg)
    wm = 4.0
    assert wide.logit_mult == pytest.approx(1 / wm)
    assert wide.attn_scale == pytest.approx(1 / wide_cfg.head_dim)
    assert all(blk.attention.attn_scale == pytest.approx(1 / 128) for blk in wide.layers)
    assert base.logit_mult == 1.0 and base.attn_scale == pytest.approx(1 / base_cfg.head_dim)

    resid = 1 / math.sqrt(2 * 2)
    wq = wide.layers[0].attention.wq.weight.std().item()
    assert wq == pytest.approx(0.02 / math.sqrt(wm), rel=0.05)
    assert base.layers[0].attention.wq.weight.std().item() / wq == pytest.approx(math.sqrt(wm), rel=0.05)
    assert wide.layers[0].feed_forward.w2.weight.std().item() == pytest.approx(0.02 / math.sqrt(wm) * resid, rel=0.05)
    # Embeddings and readout keep the width-independent init (output is scaled by logit_mult instead).
    assert wide.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert wide.output.weight.std().item() == pytest.approx(0.02, rel=0.05)

    assert mup_lr_scale("layers.0.attention.wq.weight", wide_cfg) == pytest.approx(1 / wm)
    assert mup_lr_scale("_orig_mod.layers.1.feed_forward.w2.weight", wide_cfg) == pytest.approx(1 / wm)
    assert mup_lr_scale("tok_embeddings.weight", wide_cfg) == 1.0
    assert mup_lr_scale("output.weight", wide_cfg) == 1.0
    assert mup_lr_scale("layers.0.ffn_norm.weight", wide_cfg) == 1.0

    # logit_mult really multiplies the logits.
    x = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        a = wide(x)
        wide.logit_mult = 1.0
        torch.testing.assert_close(a * wm, wide(x))


def test_init_rejects_unknown_kind():
    cfg = tiny_cfg()
    m = Transformer(cfg)
    cfg.init = "xavier"
    with pytest.raises(ValueError):
        init_weights(m, cfg)
