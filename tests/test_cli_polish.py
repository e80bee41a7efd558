"""A new user's first commands: each bad value is named by its own key with a pointer to the subcommand's
help, an unknown eval task fails before any model loads, a --config file is the whole config (not the
tiny demo preset underneath), an export's config.json and tokenizer name the same special ids, and
``densetrain train`` ends with a few lines instead of the whole summary.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import forked
import pytest
import torch

from densetrain.cli import main
from densetrain.config import load_config, save_config
from densetrain.errors import TrainError
from densetrain.metrics import read_metrics
from densetrain.train import train

ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _cli(*args):
    return forked.run([sys.executable, "-m", "densetrain", *args], capture_output=True, text=True, env=ENV)


def _error(capsys, *argv: str) -> str:
    """The one stderr line of ``densetrain argv`` run in this process (exit status 2)."""
    rc = main(list(argv))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, (rc, err)
    return err.rstrip("\n")


@pytest.mark.parametrize("flag,key", [
    ("--train.steps=-5", "train.steps"),  # was reported as schedule.warmup_steps (-1) >= train.steps
    ("--train.batch_size=0", "train.batch_size"),  # was "train.batch_size and train.micro_batch_size"
    ("--train.micro_batch_size=0", "train.micro_batch_size"),
    ("--train.seq_len=0", "train.seq_len"),
])
def test_a_bad_train_size_is_named_by_its_own_key(capsys, flag, key):
    value = flag.split("=")[1]
    assert _error(capsys, "train", flag) == (f"densetrain: error: {key} must be a positive integer, got {value} "
                                             "(see densetrain train --help)")


def test_a_negative_peak_lr_names_optim_peak_lr(capsys):
    assert _error(capsys, "train", "--optim.peak_lr=-1") == (
        "densetrain: error: optim.peak_lr must be a positive finite number, got -1.0 (see densetrain train --help)")


def test_the_help_pointer_names_the_subcommand_of_the_command_line(tmp_path):
    r = _cli("eval", "--limit", "-1", "--preset", "tiny", str(tmp_path))
    assert r.returncode == 2
    assert r.stderr.splitlines() == ["densetrain: error: --limit -1: expected a number of examples per task >= 0 "
                                     "(0 = all) (see densetrain eval --help)"]


def test_an_unknown_eval_task_fails_before_the_checkpoint_is_looked_at(capsys, tmp_path):
    """The run directory holds no checkpoint at all: the task name is what is reported (before, the
    missing checkpoint was, or with one the model loaded first)."""
    err = _error(capsys, "eval", str(tmp_path), "--tasks", "light, nosuch")
    assert err.startswith("densetrain: error: unknown downstream task 'nosuch' (valid: light, all,"), err
    assert "hellaswag" in err and "gsm8k" in err


def test_a_config_file_alone_is_the_whole_config(tmp_path):
    """Its unset keys take the built-in defaults: not tiny's demo corpus, sources and stages."""
    f = tmp_path / "mine.toml"
    f.write_text('[train]\nsteps = 20\nrun_dir = "runs/mine"\n')
    alone = _cli("train", "--config", str(f), "--help-config")
    over_tiny = _cli("train", "--preset", "tiny", "--config", str(f), "--help-config")
    assert alone.returncode == over_tiny.returncode == 0, alone.stderr + over_tiny.stderr
    for out in (alone.stdout, over_tiny.stdout):
        assert "--train.steps=20\n" in out and '--train.run_dir="runs/mine"\n' in out
    assert "--data.demo_corpus=false\n" in alone.stdout and "--data.sources=[0 tables]\n" in alone.stdout
    assert "--data.demo_corpus=true\n" in over_tiny.stdout and "--data.sources=[6 tables]\n" in over_tiny.stdout


def test_plan_reads_a_config_file_alone_as_the_whole_config(tmp_path):
    """As train does: the file's stages have no sources without tiny's underneath."""
    f = tmp_path / "mine.toml"
    f.write_text("[train]\nsteps = 20\n")
    plan = ("plan", "--config", str(f), "--gpus", "1", "--gpu-memory-gib", "80")
    alone, over_tiny = _cli(*plan), _cli(*plan, "--preset", "tiny")
    assert over_tiny.returncode == 0 and "dp_replicate=1 dp_shard=1 tp=1" in over_tiny.stdout, over_tiny.stderr
    assert alone.returncode == 2 and alone.stderr.startswith("densetrain: error: stages[0] 'main': no source"), \
        alone.stderr


def test_prepare_with_a_config_file_without_sources_says_so(capsys, tmp_path, monkeypatch):
    """Before, the tiny preset underneath built the demo corpus for it (into ./.cache: hence the chdir)."""
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "mine.toml"
    f.write_text(f'[data]\nshards_dir = "{tmp_path / "shards"}"\n')
    assert _error(capsys, "prepare", "--config", str(f)) == (
        "densetrain: error: data.sources is empty: configure at least one source (or set data.demo_corpus = true)")
    assert not (tmp_path / "shards").exists()


def test_train_ends_with_a_short_summary_and_keeps_summary_json(prepared, tmp_path):
    from densetrain.config import save_config
    from densetrain.metrics import format_rate, read_metrics

    _, make = prepared
    cfg = make(tmp_path, **{"train.steps": 4, "eval.every": 0, "checkpoint.every": 0,
                            "stages": [{"name": "main", "start": 0.0}]})
    save_config(cfg, tmp_path / "cfg.toml")
    r = _cli("train", "--config", str(tmp_path / "cfg.toml"))
    assert r.returncode == 0, r.stderr[-2000:]
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and "val" in summary and "email" in summary["val"]  # the file is whole
    train = [x for x in read_metrics(run) if x["kind"] == "train"]
    rates = sorted(x["tokens_per_sec"] for x in train)
    tail = r.stdout[r.stdout.index("done: "):].splitlines()
    allv = summary["val"]["all"]
    assert tail == [
        f"done: 4 steps, {summary['tokens']:,} tokens",
        f"final train loss {train[-1]['loss']:.4f} (step 4), median {format_rate((rates[1] + rates[2]) / 2)}",
        f"val loss {allv['loss']:.4f}, {allv['bpb']:.4f} bits per byte",
        f"files: {run}/ (summary.json, metrics.jsonl, checkpoints); densetrain report {run} for the full report",
    ]
    assert '"unigram_entropy"' not in r.stdout  # the per-source tables stay in summary.json


def test_export_config_and_tokenizer_name_the_same_special_ids(tmp_path):
    """Llama 3's tokenizer (a BOS of its own) and GPT-2's (none): what transformers reads from the export's
    config.json, generation_config.json and tokenizer files."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from densetrain.config import ModelConfig
    from densetrain.data.tokenizer import load_tokenizer
    from densetrain.hf import generation_config_file, hf_config_dict, special_token_ids, tokenizer_files

    for name, bos in (("llama3", 128000), ("gpt2", None)):
        tok = load_tokenizer(name, ".")
        out = tmp_path / name
        out.mkdir()
        files = {**tokenizer_files(tok, 256), "generation_config.json": generation_config_file(tok)}
        for fname, content in files.items():
            (out / fname).write_bytes(content)
        cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)
        (out / "config.json").write_text(json.dumps(hf_config_dict(cfg, extra=special_token_ids(tok))))
        hc = transformers.AutoConfig.from_pretrained(str(out), local_files_only=True)
        ht = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
        gen = transformers.GenerationConfig.from_pretrained(str(out), local_files_only=True)
        assert (hc.bos_token_id, hc.eos_token_id, hc.pad_token_id) == (bos, tok.eos_id, tok.eos_id)
        assert (ht.bos_token_id, ht.eos_token_id, ht.pad_token_id) == (bos, tok.eos_id, tok.eos_id)
        assert ht.padding_side == "left"  # a decoder's batched generate() continues from the last position
        assert ht(["a", "a longer text"], padding=True)["input_ids"][0][0] == tok.eos_id  # padding works
        # generation_config.json names the ids config.json does (a BOS only where the tokenizer has one)
        assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (bos, tok.eos_id, tok.eos_id)


@pytest.mark.parametrize("flag,line", [
    ("--eval.every=-1", "eval.every must be >= 0, got -1"),  # was accepted: validation after every step
    ("--eval.tasks_every=-2", "eval.tasks_every must be >= 0, got -2"),
    ("--eval.samples=-1", "eval.samples must be >= 0, got -1"),
    ("--eval.max_batches=0", "eval.max_batches must be >= 1, got 0"),
    ("--optim.grad_clip=-1", "optim.grad_clip must be >= 0, got -1.0"),  # was "weight_decay, grad_clip, z_loss"
])
def test_negative_eval_and_optim_values_are_named(capsys, flag, line):
    assert _error(capsys, "train", flag) == f"densetrain: error: {line} (see densetrain train --help)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_without_a_gpu_is_one_line(prepared, tmp_path, capsys):
    """Was a RuntimeError traceback through cli, loop and setup (exit 1)."""
    _, make = prepared
    save_config(make(tmp_path), tmp_path / "cfg.toml")
    err = _error(capsys, "train", "--config", str(tmp_path / "cfg.toml"), "--train.device=cuda")
    assert err.startswith("densetrain: error: train.device is 'cuda' but torch sees no CUDA device here"), err


def test_a_start_that_failed_before_its_first_step_is_no_run_to_protect(prepared, tmp_path):
    """A failed start leaves config.toml, the lock and an empty metrics.jsonl. The corrected command used to
    be refused ('already holds a run; continue it with --resume'), and that --resume trained from the failed
    start's config.toml. Now it starts; a run that recorded a step is still protected."""
    _, make = prepared
    cfg = make(tmp_path, **{"train.steps": 4, "eval.every": 0, "checkpoint.every": 0, "logging.tensorboard": False})
    run = Path(cfg.train.run_dir)
    run.mkdir(parents=True)
    save_config(make(tmp_path, **{"train.steps": 99}), run / "config.toml")  # the failed start's config
    (run / "metrics.jsonl").touch()
    train(cfg)
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"] == [1, 2, 3, 4]
    assert load_config(path=run / "config.toml").train.steps == 4  # the corrected config, not the failed one's
    with pytest.raises(TrainError, match="already holds a run; continue it with --resume"):
        train(cfg)


def test_the_scale_entry_point_fails_in_one_line_with_status_2(capsys, tmp_path):
    """``python -m densetrain.data.prepare.scale`` with a missing --config: one line and exit status 2 as the
    densetrain command gives (it exited 1 through SystemExit's message)."""
    pytest.importorskip("datatrove")
    from densetrain.data.prepare.scale.pipeline import main as scale_main

    with pytest.raises(SystemExit) as e:
        scale_main(["--config", str(tmp_path / "none.toml"), "--source", "web", "--output", str(tmp_path / "out")])
    assert e.value.code == 2
    assert capsys.readouterr().err == f"densetrain: error: {tmp_path / 'none.toml'}: config file not found\n"
