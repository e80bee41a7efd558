"""Hugging Face interop (densetrain/hf/): export -> LlamaForCausalLM parity, import round trip."""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import pytest
import torch

from densetrain.config import ModelConfig
from densetrain.hf import export_hf, from_hf_state_dict, hf_config_dict, import_hf, to_hf_state_dict
from densetrain.model.init import init_weights
from densetrain.model.llama import Transformer

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def tiny_cfg(**kw) -> ModelConfig:
    # init_std 0.05 (not 0.02) makes the logits less linear in the weights, so mapping mistakes show more.
    base = dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=160, rope_theta=10000.0,
                init_std=0.05)
    base.update(kw)
    return ModelConfig(**base)


def build(cfg: ModelConfig, seed: int = 0) -> Transformer:
    m = Transformer(cfg)
    torch.manual_seed(seed)
    init_weights(m, cfg)
    # Norm gains are 1 after init; perturb them so that a swapped norm mapping would show in the logits.
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return m.eval()


def hf_logits(path, tokens: torch.Tensor) -> torch.Tensor:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    hf = transformers.LlamaForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager", local_files_only=True
    ).eval()
    with torch.no_grad():
        return hf(input_ids=tokens).logits


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.mark.parametrize("tied", [False, True])
def test_logit_parity_with_transformers(tmp_path, tied):
    pytest.importorskip("transformers", reason="transformers is not installed")
    cfg = tiny_cfg(tie_embeddings=tied, rope_theta=50000.0)
    m = build(cfg)
    out = export_hf(m, cfg, tmp_path / "export", max_position_embeddings=64)
    conf = json.loads((out / "config.json").read_text())
    assert conf["tie_word_embeddings"] is tied
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = m(tokens)
    theirs = hf_logits(out, tokens)
    assert theirs.shape == ours.shape
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_parity_after_set_rope_theta(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed")
    cfg = tiny_cfg()
    m = build(cfg)
    m.set_rope_theta(500000.0)
    cfg.rope_theta = 500000.0  # export the config the model now runs with
    out = export_hf(m, cfg, tmp_path / "e")
    tokens = torch.randint(0, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = m(tokens)
    assert (ours - hf_logits(out, tokens)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("tied", [False, True])
def test_mup_model_exports_with_folded_multipliers(tmp_path, tied):
    pytest.importorskip("transformers", reason="transformers is not installed")
    cfg = tiny_cfg(init="mup", base_d_model=16, tie_embeddings=tied)  # width_mult 4
    m = build(cfg)
    assert m.logit_mult == 0.25 and m.attn_scale == 1 / 16
    out = export_hf(m, cfg, tmp_path / "mup")
    conf = json.loads((out / "config.json").read_text())
    assert conf["tie_word_embeddings"] is False  # folded readout cannot stay tied
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = m(tokens)
    assert (ours - hf_logits(out, tokens)).abs().max().item() <= 1e-4
    # Importing gives a standard-parameterisation model with the same logits.
    cfg2, sd = import_hf(out)
    assert cfg2.init == "standard" and not cfg2.tie_embeddings
    m2 = Transformer(cfg2)
    m2.load_state_dict(sd, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(m2(tokens), ours, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_import_round_trip_identical(tmp_path, tied):
    cfg = tiny_cfg(tie_embeddings=tied, rope_theta=123456.0, norm_eps=1e-6)
    m = build(cfg)
    out = export_hf(m, cfg, tmp_path / "rt")
    cfg2, sd = import_hf(out)
    for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "rope_theta", "norm_eps",
              "tie_embeddings"):
        assert getattr(cfg2, f) == getattr(cfg, f), f
    ref = m.state_dict()
    assert sd.keys() == ref.keys()
    for k in ref:
        assert torch.equal(sd[k], ref[k]), k
    if tied:
        assert sd["output.weight"] is sd["tok_embeddings.weight"]
    m2 = Transformer(cfg2)
    m2.load_state_dict(sd, strict=True)


def test_export_is_atomic_replace_and_bf16(tmp_path):
    cfg = tiny_cfg()
    m = build(cfg)
    target = tmp_path / "exp"
    export_hf(m, cfg, target)
    export_hf(m, cfg, target, dtype=torch.bfloat16)  # replaces the old export
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["exp"]  # no temp/old dirs left behind
    conf = json.loads((target / "config.json").read_text())
    assert conf["dtype"] == "bfloat16"
    _, sd = import_hf(target)
    assert sd["tok_embeddings.weight"].dtype == torch.bfloat16


def test_hf_config_dict_fields():
    cfg = tiny_cfg(rope_theta=500000.0, tie_embeddings=True)
    d = hf_config_dict(cfg, max_position_embeddings=8192, extra={"eos_token_id": 3})
    assert d["architectures"] == ["LlamaForCausalLM"] and d["model_type"] == "llama"
    assert (d["hidden_size"], d["intermediate_size"], d["num_hidden_layers"]) == (64, 160, 2)
    assert (d["num_attention_heads"], d["num_key_value_heads"], d["head_dim"]) == (4, 2, 16)
    assert d["rope_parameters"] == {"rope_type": "default", "rope_theta": 500000.0}
    assert d["rope_theta"] == 500000.0 and d["max_position_embeddings"] == 8192
    assert d["attention_bias"] is False and d["mlp_bias"] is False and d["hidden_act"] == "silu"
    assert d["tie_word_embeddings"] is True and d["eos_token_id"] == 3
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    hc = transformers.LlamaConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    assert hc.rope_parameters["rope_theta"] == 500000.0 and hc.num_key_value_heads == 2


def test_state_dict_names_and_errors():
    cfg = tiny_cfg()
    m = build(cfg)
    sd = to_hf_state_dict(m)
    assert "model.layers.1.mlp.gate_proj.weight" in sd and "lm_head.weight" in sd
    assert torch.equal(sd["model.layers.1.mlp.gate_proj.weight"], m.layers[1].feed_forward.w1.weight)
    assert torch.equal(sd["model.layers.0.mlp.down_proj.weight"], m.layers[0].feed_forward.w2.weight)
    assert torch.equal(sd["model.layers.0.mlp.up_proj.weight"], m.layers[0].feed_forward.w3.weight)
    # No q/k permutation: same half-split RoPE convention as HF.
    assert torch.equal(sd["model.layers.0.self_attn.q_proj.weight"], m.layers[0].attention.wq.weight)
    bad = dict(sd)
    bad["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    with pytest.raises(ValueError, match="unexpected"):
        from_hf_state_dict(bad, cfg)
    missing = dict(sd)
    del missing["model.norm.weight"]
    with pytest.raises(ValueError, match="missing"):
        from_hf_state_dict(missing, cfg)


def test_import_rejects_unsupported_rope_and_missing_files(tmp_path):
    cfg = tiny_cfg()
    out = export_hf(build(cfg), cfg, tmp_path / "x")
    conf = json.loads((out / "config.json").read_text())
    # linear, llama3 and yarn import (tests/test_rope_scaling.py); dynamic NTK scaling is not computed here.
    conf["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 500000.0, "factor": 8.0}
    (out / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="RoPE"):
        import_hf(out)
    os.remove(out / "config.json")
    with pytest.raises(FileNotFoundError):
        import_hf(out)


def test_cli_export_to_transformers_and_import_back(prepared, tmp_path):
    """The command line end to end: train -> export --format hf -> transformers (model and tokenizer,
    offline) -> import-hf, logits compared at every hop."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from densetrain.checkpoint import load_checkpoint
    from densetrain.cli import main
    from densetrain.config import load_config, save_config
    from densetrain.data.tokenizer import load_tokenizer
    from densetrain.model.init import build_model
    from densetrain.schedule import resolve_stages, stage_at
    from densetrain.tools.offline_eval import find_checkpoint

    shards, make = prepared
    # 5 steps end in the long-context stage (RoPE base 1e5, seq_len 64): the export must carry both
    cfg = make(tmp_path, **{"train.steps": 5, "eval.every": 0})
    save_config(cfg, tmp_path / "cfg.toml")
    run, out, imported = tmp_path / "run", tmp_path / "hf", tmp_path / "imported"
    assert main(["train", "--config", str(tmp_path / "cfg.toml")]) == 0
    assert main(["export", str(run), "--format", "hf", str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}

    # ours: the checkpoint as `densetrain eval` loads it, at the RoPE base of its stage
    model = build_model(cfg.model, cfg.train.seed, torch.device("cpu")).eval()
    state = load_checkpoint(find_checkpoint(run), model, None)
    st = stage_at(state["step"] - 1, resolve_stages(cfg))
    assert (state["step"], st.name, st.rope_theta, st.seq_len) == (5, "long_context", 100000.0, 64)
    model.set_rope_theta(st.rope_theta)
    tok = load_tokenizer("bpe", shards)
    text = (STDLIB / "json" / "__init__.py").read_text(encoding="utf-8")[:1500] + "\n# naïve café, 数据, 😀\n"
    ids = torch.tensor([tok.encode(text)[-st.seq_len:]])
    with torch.no_grad():
        ours = model(ids)

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, local_files_only=True).eval()
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.rope_parameters["rope_theta"] == 100000.0
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-4

    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    assert hf_tok.decode(tok.encode(text)) == tok.decode(tok.encode(text)) == text
    # HF knows where documents end: the tokenizer's EOS and the model config agree with ours; PAD is the EOS;
    # no BOS in any of them (before, config.json said 0 against the tokenizer's None, then generation_config.json
    # still did)
    assert hf_tok.eos_token == tok.eos_token and hf_tok.eos_token_id == tok.eos_id == hf.config.eos_token_id
    assert hf_tok.pad_token_id == hf.config.pad_token_id == tok.eos_id
    assert hf_tok.bos_token_id is None and hf.config.bos_token_id is None and tok.bos_id is None
    assert hf.generation_config.bos_token_id is None
    # Batched greedy generation of prompts of different lengths continues each as it would alone: the padding
    # is on the left (on the right, the short prompt's continuation followed its PAD tokens and changed).
    prompts = [text[:40], text[:400]]
    batch = hf_tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        together = hf.generate(**batch, max_new_tokens=6, do_sample=False)[:, batch["input_ids"].shape[1]:]
        for row, prompt in enumerate(prompts):
            one = hf_tok(prompt, return_tensors="pt", add_special_tokens=False)
            alone = hf.generate(**one, max_new_tokens=6, do_sample=False)[0, one["input_ids"].shape[1]:]
            assert together[row].tolist() == alone.tolist(), (row, prompt)
    assert len({(f.stat().st_mode & 0o777) for f in out.iterdir()}) == 1  # weights as readable as the rest

    assert main(["import-hf", str(out), "--out", str(imported)]) == 0
    cfg2 = load_config(path=imported / "config.toml")
    assert cfg2.model.rope_theta == 100000.0
    model2 = build_model(cfg2.model, cfg2.train.seed, torch.device("cpu")).eval()
    load_checkpoint(find_checkpoint(imported), model2, None)
    with torch.no_grad():
        torch.testing.assert_close(model2(ids), ours, atol=1e-5, rtol=1e-5)


def test_import_hf_makes_the_models_tokenizer_the_runs(prepared, tmp_path, capsys):
    """A folder written by transformers (model and tokenizer): the imported run's data.tokenizer is a copy
    of its tokenizer.json, with the same ids as transformers, even once the HF folder is gone."""
    import shutil

    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from densetrain.cli import main
    from densetrain.config import load_config
    from densetrain.data.tokenizer import load_tokenizer
    from densetrain.hf import tokenizer_files

    shards, _ = prepared
    tok = load_tokenizer("bpe", shards)
    hf_dir, run = tmp_path / "hf", tmp_path / "run"
    conf = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    transformers.LlamaForCausalLM(conf).save_pretrained(str(hf_dir))
    (hf_dir / "tokenizer.json").write_bytes(tokenizer_files(tok, 64)["tokenizer.json"])
    transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json")).save_pretrained(str(hf_dir))
    text = (STDLIB / "json" / "decoder.py").read_text(encoding="utf-8")[:800] + "\n# naïve café, 数据\n"
    want = transformers.AutoTokenizer.from_pretrained(str(hf_dir))(text, add_special_tokens=False)["input_ids"]

    assert main(["import-hf", str(hf_dir), "--out", str(run)]) == 0
    assert f"data.tokenizer {(run / 'tokenizer.json').resolve()}" in capsys.readouterr().out
    shutil.rmtree(hf_dir)
    cfg = load_config(path=run / "config.toml")
    assert cfg.data.tokenizer == str((run / "tokenizer.json").resolve())
    mine = load_tokenizer(cfg.data.tokenizer, cfg.data.shards_dir)
    assert mine.encode(text) == want == tok.encode(text) and mine.eos_id == tok.eos_id

    # Without a tokenizer.json the import says that data.tokenizer is left as configured.
    transformers.LlamaForCausalLM(conf).save_pretrained(str(hf_dir))
    assert main(["import-hf", str(hf_dir), "--out", str(tmp_path / "run2")]) == 0
    assert "no tokenizer.json in" in capsys.readouterr().out
    assert load_config(path=tmp_path / "run2" / "config.toml").data.tokenizer == "bpe"
    # One densetrain cannot use (no EOS token to end documents with): the weights import, the tokenizer is named.
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel

    HFTokenizer(WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(hf_dir / "tokenizer.json"))
    assert main(["import-hf", str(hf_dir), "--out", str(tmp_path / "run3")]) == 0
    assert "tokenizer.json: no EOS token" in capsys.readouterr().out
    assert load_config(path=tmp_path / "run3" / "config.toml").data.tokenizer == "bpe"
