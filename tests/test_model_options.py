"""Architecture options off the Llama default: QK-norm and logit soft-capping (model.qk_norm, model.logit_softcap)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from densetrain.config import ModelConfig
from densetrain.hf import hf_config_dict
from densetrain.model.init import build_model

BASE = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
TOKENS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))


def test_qk_norm_makes_attention_blind_to_the_scale_of_queries_and_keys():
    plain, normed = build_model(BASE, 0), build_model(dataclasses.replace(BASE, qk_norm=True), 0)
    assert plain.state_dict().keys() == normed.state_dict().keys()  # no new parameters
    normed.load_state_dict(plain.state_dict())
    with torch.no_grad():
        before = normed(TOKENS)
        assert not torch.allclose(before, plain(TOKENS), atol=1e-4)
        for layer in (normed.layers[0].attention, plain.layers[0].attention):
            layer.wq.weight.mul_(7.0)
            layer.wk.weight.mul_(0.2)
        assert torch.allclose(normed(TOKENS), before, atol=1e-5)  # unit-RMS q, k: the scales cancel
        assert not torch.allclose(plain(TOKENS), before, atol=1e-3)


def test_logit_softcap_bounds_the_logits_by_tanh():
    plain, capped = build_model(BASE, 0), build_model(dataclasses.replace(BASE, logit_softcap=0.05), 0)
    capped.load_state_dict(plain.state_dict())
    with torch.no_grad():
        raw, out = plain(TOKENS), capped(TOKENS)
    assert raw.abs().max() > 0.05 > out.abs().max()
    assert torch.allclose(out, 0.05 * torch.tanh(raw / 0.05), atol=1e-6)


@pytest.mark.parametrize("option", [{"qk_norm": True}, {"logit_softcap": 15.0}])
def test_options_llama_cannot_express_refuse_hf_export(option):
    with pytest.raises(ValueError, match="no LlamaForCausalLM equivalent"):
        hf_config_dict(dataclasses.replace(BASE, **option))
