"""``densetrain export`` from sharded checkpoints (densetrain/hf/export.py ``export_hf_from_checkpoint``): a
checkpoint saved by 2 FSDP2 ranks exports to safetensors that ``transformers`` LlamaForCausalLM loads
with our logits; small file limits give HF's sharded layout with an index; μP multipliers are folded
as in the in-memory export; the export reads one tensor at a time (peak memory well below the model)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import forked
import pytest
import torch
from safetensors import safe_open

from densetrain.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from densetrain.cli import main
from densetrain.config import ModelConfig, load_config, save_config
from densetrain.hf import export_hf_from_checkpoint
from densetrain.model.init import build_model, init_weights
from densetrain.model.llama import Transformer
from densetrain.optim import build_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_parallel_train import launch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAIN = [{"name": "main", "start": 0.0, "mix": {"email": 0.5, "json": 0.5}}]
QUIET = {"eval.every": 0, "logging.tensorboard": False, "stages": MAIN, "watchdog.every": 0, "probe.every": 0}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def hf_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    hf = transformers.LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager",
                                                       local_files_only=True).eval()
    with torch.no_grad():
        return hf(input_ids=tokens).logits


def our_logits(cfg, ckpt: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = build_model(cfg.model, cfg.train.seed + 1, "cpu")  # other init: every weight must come from ckpt
    load_checkpoint(ckpt, model, None)
    with torch.no_grad():
        return model.eval()(tokens)


@pytest.fixture(scope="module")
def fsdp_run(prepared, tmp_path_factory):
    """A 2-rank FSDP2 run (tied embeddings) whose step-4 checkpoint is sharded over both ranks."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    _, make = prepared
    tmp = tmp_path_factory.mktemp("fsdp_export")
    cfg = make(tmp, **QUIET, **{"train.steps": 4, "checkpoint.every": 4, "model.tie_embeddings": True,
                                "parallel.dp_replicate": 1, "parallel.dp_shard": 2})
    save_config(cfg, tmp / "cfg.toml")
    res = launch(["train", "--config", str(tmp / "cfg.toml")])
    assert all(r.returncode == 0 for r in res), "\n".join(r.stderr[-3000:] for r in res)
    ckpt = latest_checkpoint(Path(cfg.train.run_dir))
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # one file per rank
    return cfg, ckpt


def test_cli_export_of_a_two_rank_fsdp2_checkpoint_matches_our_logits(fsdp_run, tmp_path):
    cfg, ckpt = fsdp_run
    out = tmp_path / "hf"
    assert main(["export", str(ckpt.parent.parent), "--format", "hf", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer.json", "tokenizer_config.json"]
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    ours, theirs = our_logits(cfg, ckpt, tokens), hf_logits(out, tokens)
    assert theirs.shape == ours.shape and (ours - theirs).abs().max().item() <= 1e-4


def test_small_file_limit_gives_an_indexed_sharded_export(fsdp_run, tmp_path):
    cfg, ckpt = fsdp_run
    limit = 40_000  # bytes: every file but those of single larger tensors stays under it
    out = export_hf_from_checkpoint(ckpt, cfg.model, tmp_path / "hf", max_position_embeddings=64,
                                    max_shard_bytes=limit)
    files = sorted(out.glob("*.safetensors"))
    n = len(files)
    assert n > 3 and [f.name for f in files] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in files}
    assert "lm_head.weight" not in index["weight_map"]  # tied: HF re-ties it
    total = 0
    for f in files:
        with safe_open(str(f), "pt") as st:
            sizes = [st.get_tensor(k).nbytes for k in st.keys()]
            assert sum(sizes) <= limit or len(sizes) == 1, (f.name, sizes)
            assert all(index["weight_map"][k] == f.name for k in st.keys())
            total += sum(sizes)
    assert index["metadata"]["total_size"] == total
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
    ours, theirs = our_logits(cfg, ckpt, tokens), hf_logits(out, tokens)
    assert (ours - theirs).abs().max().item() <= 1e-4


@pytest.mark.parametrize("tied", [False, True])
def test_mup_checkpoint_exports_with_folded_multipliers(tmp_path, tied):
    cfg = ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=160, init="mup",
                      base_d_model=16, tie_embeddings=tied, init_std=0.05)
    torch.manual_seed(0)
    model = Transformer(cfg)
    init_weights(model, cfg)
    assert model.logit_mult == 0.25 and model.attn_scale == 1 / 16
    full = load_config("tiny")
    full.model = cfg
    path = save_checkpoint(tmp_path / "run", 1, model, build_optimizer(model, full), {"step": 1})
    out = export_hf_from_checkpoint(path, cfg, tmp_path / "hf", max_shard_bytes=100_000)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False  # folded readout
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model.eval()(tokens)
    assert (ours - hf_logits(out, tokens)).abs().max().item() <= 1e-4


def test_mismatched_config_is_one_line(tmp_path, capsys):
    cfg = ModelConfig(vocab_size=512, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)
    model = Transformer(cfg)
    full = load_config("tiny", overrides=[("model.vocab_size", 512), ("model.d_model", 64), ("model.n_layers", 1),
                                          ("model.n_heads", 2), ("model.n_kv_heads", 1), ("model.d_ff", 64)])
    save_checkpoint(tmp_path / "run", 1, model, build_optimizer(model, full), {"step": 1})
    # shards_dir exists (no tokenizer needed: the model is refused first), wherever the test runs from
    full.data.shards_dir = str(tmp_path)
    save_config(full, tmp_path / "run" / "config.toml")  # says d_model 64: not the checkpoint's
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "do not match the config" in err[0], err


_PEAK = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    from densetrain.config import ModelConfig
    from densetrain.hf import export_hf_from_checkpoint
    cfg = ModelConfig(**json.loads(sys.argv[2]))
    def status(key):  # kB, from /proc/self/status
        return int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith(key + ":")))
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the current RSS
        f.write("5")
    export_hf_from_checkpoint(sys.argv[3], cfg, sys.argv[4], max_shard_bytes=int(sys.argv[5]))
    print(json.dumps({"before_kib": before, "peak_kib": status("VmHWM")}))
""")


def test_export_reads_one_tensor_at_a_time(tmp_path):
    # ~68M parameters (270 MB in fp32), no tensor above 8 MB (the embedding), exported into 8 MB files by
    # a fresh process. Its peak resident memory (VmHWM) grows by one file plus a few copies of the largest
    # tensor (DCP's read buffer, the allocator's cache): 50-57 MiB measured, a fifth of the model.
    shape = dict(vocab_size=4096, d_model=512, n_layers=16, n_heads=8, n_kv_heads=4, d_ff=2048)
    cfg = ModelConfig(**shape)
    with torch.device("cpu"):
        model = Transformer(cfg)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    full = load_config("tiny")
    full.model = cfg
    path = save_checkpoint(tmp_path / "run", 1, model, build_optimizer(model, full), {"step": 1})
    del model
    script = tmp_path / "peak.py"
    script.write_text(_PEAK)
    r = forked.run([sys.executable, str(script), str(ROOT), json.dumps(shape), str(path), str(tmp_path / "hf"),
                    str(8 * 2**20)], capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    rss = json.loads(r.stdout.strip().splitlines()[-1])
    grown = (rss["peak_kib"] - rss["before_kib"]) * 1024
    print(f"export peak RSS growth {grown / 2**20:.1f} MiB for a {model_bytes / 2**20:.0f} MiB model")
    assert grown < 0.4 * model_bytes, (grown / 2**20, model_bytes / 2**20)
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 30
