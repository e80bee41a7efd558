"""RoPE scaling (densetrain/model/rope.py): the Llama 3.1 transform frequency by frequency, linear and
YaRN against transformers' implementation, export -> transformers logits, import of scaled configs,
and the per-stage config (inherit, switch off)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from densetrain.config import ModelConfig, load_config
from densetrain.config.schema import RopeScalingConfig
from densetrain.errors import ConfigError
from densetrain.hf import export_hf, import_hf
from densetrain.model.init import init_weights
from densetrain.model.llama import Transformer
from densetrain.model.rope import attention_factor, plain_inv_freq, rope_frequencies
from densetrain.schedule import resolve_stages

LLAMA31 = RopeScalingConfig(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=8192)


def hf_inv_freq(kind: str, head_dim: int, theta: float, rs: RopeScalingConfig, max_pos: int = 131072):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": kind, "rope_theta": theta, "factor": rs.factor}
    if kind in ("llama3", "yarn"):
        params["original_max_position_embeddings"] = rs.original_max_position_embeddings
    if kind == "llama3":
        params |= {"low_freq_factor": rs.low_freq_factor, "high_freq_factor": rs.high_freq_factor}
    if kind == "yarn":
        params |= {"beta_fast": rs.beta_fast, "beta_slow": rs.beta_slow}
    conf = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                                    max_position_embeddings=max_pos, rope_parameters=params)
    return ROPE_INIT_FUNCTIONS[kind](conf, "cpu")


def test_llama3_changes_exactly_the_frequencies_the_formula_says():
    # head_dim 128, theta 5e5: wavelength of pair i is 2 pi 5e5^(i/64). Unchanged below 8192/4 = 2048
    # tokens: i/64 < ln(2048 / 2 pi) / ln(5e5) = 0.4410, i <= 28 (29 pairs); divided by 8 above 8192
    # tokens: i/64 > ln(8192 / 2 pi) / ln(5e5) = 0.5466, i >= 35 (29 pairs); interpolated i = 29..34 (6).
    base = plain_inv_freq(128, 5e5)
    got = rope_frequencies(128, 5e5, LLAMA31)
    assert got.dtype == torch.float32 and got.shape == (64,)
    unchanged = torch.isclose(got, base, rtol=0, atol=0)
    scaled = torch.isclose(got, base / 8, rtol=1e-6, atol=0)
    between = ~unchanged & ~scaled
    assert (int(unchanged.sum()), int(scaled.sum()), int(between.sum())) == (29, 29, 6)
    assert unchanged[:29].all() and scaled[35:].all() and between[29:35].all()
    # interpolated pairs lie strictly between their two limits, and the weight follows the formula
    assert ((got[29:35] < base[29:35]) & (got[29:35] > base[29:35] / 8)).all()
    wavelen = 2 * math.pi / base[29:35].double()
    g = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    expect = (1 - g) * base[29:35].double() / 8 + g * base[29:35].double()
    assert torch.allclose(got[29:35].double(), expect, rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", ["llama3", "linear", "yarn"])
def test_matches_transformers_implementation(kind):
    rs = {"llama3": LLAMA31, "linear": RopeScalingConfig(type="linear", factor=4.0),
          "yarn": RopeScalingConfig(type="yarn", factor=16.0, original_max_position_embeddings=4096)}[kind]
    theirs, their_attn = hf_inv_freq(kind, 128, 5e5, rs)
    ours = rope_frequencies(128, 5e5, rs)
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-6), (ours - theirs).abs().max()
    assert attention_factor(rs) == pytest.approx(their_attn, abs=1e-12)


def test_yarn_ramp_and_attention_factor():
    rs = RopeScalingConfig(type="yarn", factor=16.0, original_max_position_embeddings=4096)
    base, got = plain_inv_freq(64, 1e4), rope_frequencies(64, 1e4, rs)
    rotations = 4096 * base / (2 * math.pi)  # turns over the original context
    assert torch.equal(got[rotations > 32 * 2], base[rotations > 32 * 2])  # fast pairs kept
    assert torch.allclose(got[rotations < 0.5], base[rotations < 0.5] / 16)  # slow pairs interpolated
    assert attention_factor(rs) == pytest.approx(0.1 * math.log(16) + 1)


def _model(cfg: ModelConfig) -> Transformer:
    m = Transformer(cfg)
    torch.manual_seed(0)
    init_weights(m, cfg)
    return m.eval()


@pytest.mark.parametrize("kind", ["llama3", "yarn", "linear"])
def test_export_to_transformers_logits_equal_and_import_round_trip(tmp_path, monkeypatch, kind):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rs = {"llama3": RopeScalingConfig(type="llama3", factor=8.0, original_max_position_embeddings=32),
          "yarn": RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=32),
          "linear": RopeScalingConfig(type="linear", factor=2.0)}[kind]
    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=128, rope_theta=5e5,
                      init_std=0.05, rope_scaling=rs)
    m = _model(cfg)
    out = export_hf(m, cfg, tmp_path / "hf", max_position_embeddings=128)
    conf = json.loads((out / "config.json").read_text())
    assert conf["rope_parameters"]["rope_type"] == kind and conf["rope_scaling"]["factor"] == rs.factor
    tokens = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(0))  # beyond 32 positions
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32, attn_implementation="eager",
                                                       local_files_only=True).eval()
    with torch.no_grad():
        ours, theirs = m(tokens), hf(input_ids=tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
    plain = ModelConfig(**{**cfg.__dict__, "rope_scaling": RopeScalingConfig()})
    with torch.no_grad():
        assert (_model(plain)(tokens) - ours).abs().max().item() > 1e-3  # the scaling mattered
    icfg, sd = import_hf(out)
    assert icfg.rope_scaling == rs
    back = Transformer(icfg)
    back.load_state_dict(sd)
    with torch.no_grad():
        assert torch.equal(back.eval()(tokens), ours)


def test_stage_rope_scaling_inherits_and_switches_off():
    llama3 = {"type": "llama3", "factor": 4.0, "original_max_position_embeddings": 256}
    stages = [{"name": "main", "start": 0.0},
              {"name": "long", "start": 0.5, "seq_len": 512, "rope_scaling": llama3},
              {"name": "longer", "start": 0.7},
              {"name": "plain", "start": 0.9, "rope_scaling": {"type": "none"}}]
    cfg = load_config(preset="tiny", overrides=[("stages", stages), ("train.steps", 20)])
    got = [st.rope_scaling.type for st in resolve_stages(cfg)]
    assert got == ["none", "llama3", "llama3", "none"]
    assert resolve_stages(cfg)[2].rope_scaling.factor == 4.0
    with pytest.raises(ConfigError, match="rope_scaling.type"):
        load_config(preset="tiny", overrides=[("model.rope_scaling.type", "ntk")])
    with pytest.raises(ConfigError, match="factor"):
        load_config(preset="tiny", overrides=[("model.rope_scaling", {"type": "linear", "factor": 0.5})])


def test_model_set_rope_switches_tables_and_keeps_cache_when_unchanged():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)
    m = Transformer(cfg)
    m.rope_cache(16)
    cached = m.rope_cos
    m.set_rope(cfg.rope_theta, RopeScalingConfig())
    assert m.rope_cos is cached  # same RoPE: no recomputation
    m.set_rope(cfg.rope_theta, RopeScalingConfig(type="linear", factor=2.0))
    cos, _ = m.rope_cache(16)
    # linear interpolation: position 2p of the scaled table is position p of the plain one
    assert torch.allclose(cos[2::2][:7], cached[1:8], atol=1e-6)
