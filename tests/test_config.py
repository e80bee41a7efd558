"""Config loading, overrides and one-line validation errors."""

import sys

import forked
import pytest

from densetrain.config import load_config, parse_overrides, save_config
from densetrain.errors import ConfigError


def test_presets_load_with_published_shapes():
    import torch

    from densetrain.model.llama import Transformer

    g = load_config("gpt2-124m")
    # SwiGLU width 2048 gives the MLP GPT-2's parameters (3 * 768 * 2048 = 2 * 768 * 3072).
    assert (g.model.n_layers, g.model.d_model, g.model.n_heads, g.model.d_ff) == (12, 768, 12, 2048)
    assert (g.train.seq_len, g.train.batch_size, g.optim.peak_lr, g.optim.min_lr, g.schedule.warmup_steps) == (
        1024, 64, 6e-4, 6e-5, 100)
    assert g.data.tokenizer == "gpt2" and [(s.kind, s.format) for s in g.data.sources] == [("web", "parquet")]
    assert g.train.steps * g.train.batch_size * g.train.seq_len == pytest.approx(10e9, rel=1e-6)  # 10B tokens
    ll = load_config("llama3-8b")
    assert (ll.model.n_layers, ll.model.d_model, ll.model.n_heads, ll.model.n_kv_heads) == (32, 4096, 32, 8)
    assert (ll.model.d_ff, ll.model.vocab_size, ll.model.rope_theta) == (14336, 128256, 500000.0)
    assert ll.data.tokenizer == "llama3"
    assert ll.train.steps * ll.train.batch_size * ll.train.seq_len == pytest.approx(15e12, rel=1e-5)  # 15T tokens
    with torch.device("meta"):
        assert Transformer(g.model).num_params() == pytest.approx(124e6, rel=0.01)  # GPT-2 small: 124M
        assert Transformer(ll.model).num_params() == pytest.approx(8.03e9, rel=0.001)  # Llama 3 8B: 8.03B


@pytest.mark.parametrize("preset", ["tiny", "gpt2-124m", "llama3-8b", "llama3-70b", "llama3-405b"])
def test_smoke_keeps_the_recipe_at_laptop_scale(preset):
    from densetrain.config.smoke import scale_down
    from densetrain.schedule import resolve_stages

    full = load_config(preset)
    small = scale_down(full)
    assert small.train.run_dir == full.train.run_dir.rstrip("/") + "-smoke"
    assert small.model.vocab_size == full.model.vocab_size and small.data == full.data
    assert small.model.n_heads // small.model.n_kv_heads == min(4, full.model.n_heads // full.model.n_kv_heads)
    stages = resolve_stages(small, available={s.name for s in full.data.sources} or None)
    assert [st.name for st in stages] == [st.name for st in full.stages]  # every stage, in order
    lengths = [st.end_step - st.start_step if hasattr(st, "end_step") else None for st in stages]
    starts = [st.start_step for st in stages] + [small.train.steps]
    assert all(b > a for a, b in zip(starts, starts[1:])), (starts, lengths)  # each stage runs >= 1 step
    full_seq = [st.seq_len for st in resolve_stages(full, available={s.name for s in full.data.sources} or None)]
    assert [st.seq_len / stages[0].seq_len for st in stages] == [q / full_seq[0] for q in full_seq]
    assert small.train.steps <= 40 and max(st.batch_tokens for st in stages) <= 4 * max(st.seq_len for st in stages)


def test_overrides_parse_toml_values():
    ov = parse_overrides(
        ["--optim.peak_lr=3e-4", "--schedule.kind=wsd", "--train.steps", "7", "--model.tie_embeddings=true"])
    assert ov == [("optim.peak_lr", 3e-4), ("schedule.kind", "wsd"), ("train.steps", 7), ("model.tie_embeddings", True)]
    cfg = load_config("tiny", overrides=ov)
    assert cfg.optim.peak_lr == 3e-4 and cfg.schedule.kind == "wsd" and cfg.train.steps == 7
    cfg = load_config("tiny", overrides=[("stages.1.start", 0.8)])
    assert cfg.stages[1].start == 0.8


@pytest.mark.parametrize(
    "overrides,msg",
    [
        ([("model.n_kv_heads", 3)], "model.n_heads (4) must be divisible by model.n_kv_heads (3)"),
        ([("optim.peak_lrr", 1e-3)], "unknown config key 'optim.peak_lrr'; did you mean 'optim.peak_lr'?"),
        ([("optim.peak_lr", "fast")], "optim.peak_lr: expected a number, got 'fast'"),
        ([("schedule.kind", "cosin")], "schedule.kind must be cosine, wsd or constant"),
        ([("train.batch_size", 10)], "train.batch_size (10) must be divisible by train.micro_batch_size (8)"),
        ([("stages.1.mix", {"wbe": 1.0})], "unknown source 'wbe'; did you mean 'web'?"),
        ([("optim.min_lr", 1.0)], "optim.min_lr must be in [0, optim.peak_lr"),
        # A tie in difflib's score goes to the longer common prefix, not the larger string ('pp').
        ([("parallel.cpp", 2)], "unknown config key 'parallel.cpp'; did you mean 'parallel.cp'?"),
        ([("parallel.cp", True)], "parallel.cp: expected an integer, got true (a boolean)"),  # TOML's spelling
        ([("stages", [{"name": "m", "start": 0.0, "parallel": {"cp": True}}])],
         "stages[0].parallel.cp: expected an integer, got true (a boolean)"),
        ([("stages", [{"name": "m", "start": 0.0, "parallel": {"cpp": 2}}])],
         "unknown config key 'stages[0].parallel.cpp'; did you mean 'cp'?"),
    ],
)
def test_errors_name_the_key(overrides, msg):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", overrides=overrides)
    assert msg in str(e.value)
    assert "\n" not in str(e.value)


def test_unknown_preset_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'tiny'"):
        load_config("tinyy")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nd_model = 3\n")
    with pytest.raises(ConfigError, match="bad.toml: invalid TOML"):
        load_config(path=bad)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config("tiny", overrides=[("optim.peak_lr", 1e-2), ("train.steps", 123)])
    save_config(cfg, tmp_path / "config.toml")
    again = load_config(path=tmp_path / "config.toml")
    assert again == cfg


def test_cli_error_is_one_line():
    r = forked.run([sys.executable, "-m", "densetrain", "train", "--preset", "tiny", "--model.n_kv_heads=3"],
                   capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "densetrain: error: model.n_heads (4) must be divisible by model.n_kv_heads (3) (see densetrain train --help)"]


def test_partial_config_file_applies_over_a_named_preset(tmp_path):
    from densetrain.cli import _config_from, build_parser

    f = tmp_path / "m.toml"
    f.write_text("[train]\nsteps = 20\n")
    args, rest = build_parser().parse_known_args(["train", "--preset", "tiny", "--config", str(f)])
    cfg = _config_from(args, rest)
    assert cfg.train.steps == 20
    assert [s.name for s in cfg.data.sources] == [s.name for s in load_config("tiny").data.sources]


@pytest.mark.parametrize("key,value,msg", [
    ("optim.eps", 0.0, "optim.eps must be positive"),
    ("optim.peak_lr", float("inf"), "optim.peak_lr must be a finite number, got inf"),
    ("model.norm_eps", -1.0, "model.norm_eps must be positive"),
    ("logging.every", 0, "logging.every must be >= 1"),
    ("schedule.warmup_steps", 2000, "schedule.warmup_steps (2000) must be shorter than train.steps (1500)"),
])
def test_values_that_would_break_training_are_rejected(key, value, msg):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", overrides=[(key, value)])
    assert msg in str(e.value)
