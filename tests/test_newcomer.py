"""Small things a newcomer hit (issue 36, item 10): a fresh `make demo`'s resume line, the plan's cost,
the export's BOS, `out/` in .gitignore, and lm-eval-harness' acc_norm beside OLMES' acc_per_char."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from densetrain.cli import main
from densetrain.data.tokenizer import load_tokenizer
from densetrain.evals.downstream import choice_metrics
from densetrain.evals.scoring import build_requests
from densetrain.hf import generation_config_file, special_token_ids

ROOT = Path(__file__).resolve().parents[1]


def test_a_fresh_run_with_resume_says_it_is_new(prepared, tmp_path):
    from densetrain.metrics import read_events
    from densetrain.train import train

    _, make = prepared
    cfg = make(tmp_path, **{"train.steps": 3, "eval.every": 0, "checkpoint.every": 0, "logging.tensorboard": False,
                            "stages": [{"name": "main", "start": 0.0}]})
    train(cfg, resume=True)  # what `make demo` runs on a fresh clone
    said = [e["text"] for e in read_events(tmp_path / "run") if e["kind"] == "resume"]
    assert said == [f"{tmp_path / 'run'}: a new run (nothing to resume there yet)"]


def test_plan_prints_the_cost(capsys):
    # 124M parameters x 2.48B tokens = 1.845e18 FLOPs at 40% of an A100's 312 TFLOP/s: 4.11 GPU-hours
    assert main(["plan", "--params", "124e6", "--peak-flops", "1.248e15", "--gpu-peak-flops", "312e12",
                 "--gpu-hour-price", "1.5"]) == 0
    out = capsys.readouterr().out
    assert "  cost      4.11 GPU-hours x $1.50 = $6 (at mfu 0.4 of 312 TFLOP/s per GPU)" in out.splitlines()
    assert main(["plan", "--preset", "gpt2-124m", "--gpus", "4", "--gpu-memory-gib", "80", "--gpu-peak-flops",
                 "312e12", "--gpu-hour-price", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["cost"]["gpu_hours"] == pytest.approx(4 * res["days"] * 24)  # 4 GPUs for the plan's days
    assert res["cost"]["usd"] == pytest.approx(2 * res["cost"]["gpu_hours"])
    with pytest.raises(SystemExit) as e:  # a negative price: one line, with the hint every argument error has
        main(["plan", "--params", "1e8", "--gpu-hour-price", "-1"])
    assert e.value.code == 2
    assert capsys.readouterr().err == ("densetrain: error: argument --gpu-hour-price: expected a finite number of "
                                       "USD >= 0, got '-1' (see densetrain plan --help)\n")


@pytest.mark.parametrize("name", ["gpt2", "llama3"])
def test_generation_config_names_the_bos_config_json_names(name):
    tok = load_tokenizer(name, ".")
    assert json.loads(generation_config_file(tok)) == special_token_ids(tok)
    assert special_token_ids(tok)["bos_token_id"] == tok.bos_id


@pytest.mark.skipif(not (ROOT / ".git").exists() or not shutil.which("git"), reason="not a git checkout")
def test_export_folder_is_ignored_by_git():
    r = subprocess.run(["git", "check-ignore", "-q", "out/hf/model.safetensors"], cwd=ROOT)
    assert r.returncode == 0


def test_harness_acc_norm_divides_by_the_choice_without_its_leading_space():
    tok = load_tokenizer("gpt2", ".")
    reqs = build_requests(tok, [("Answer: ", "a"), ("Answer:", " abcd")])  # the context's space moves over
    assert [(r.n_chars, r.n_chars_choice) for r in reqs] == [(2, 1), (5, 4)]
    # per character with the space (OLMES acc_per_char): -1.5/2 > -4.2/5; without it (harness): -1.5 < -4.2/4
    m = choice_metrics([-1.5, -4.2], [r.n_chars for r in reqs], [r.n_bytes for r in reqs], 1,
                       [r.n_chars_choice for r in reqs])
    assert (m["acc"], m["acc_norm"], m["acc_norm_harness"]) == (0.0, 0.0, 1.0)
