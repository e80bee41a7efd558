"""End-to-end training on real text: stage switches, resume in a fresh process, metrics sinks."""

import json
import os
import subprocess
import sys

import pytest

from densetrain.checkpoint import list_complete
from densetrain.monitor import read_metrics
from densetrain.train import train


def _train_records(run_dir):
    return [r for r in read_metrics(run_dir) if r["kind"] == "train"]


def test_stages_switch_exactly_at_configured_steps(prepared, tmp_path):
    _, make = prepared
    cfg = make(tmp_path)
    train(cfg)
    recs = _train_records(tmp_path / "run")
    assert [r["step"] for r in recs] == list(range(1, 11))
    # steps are 1-based in records: record k is optimizer update k-1. Stages start at 0, 5, 8.
    assert [r["stage"] for r in recs] == ["main"] * 5 + ["anneal"] * 3 + ["long_context"] * 2
    assert [r["seq_len"] for r in recs] == [32] * 8 + [64] * 2
    assert [r["rope_theta"] for r in recs] == [10000.0] * 8 + [100000.0] * 2
    # Mix: main draws from both sources, anneal only from 'email'; long_context inherits anneal's mix.
    assert all("train/json/loss" in r and "train/email/loss" in r for r in recs[:5])
    assert all("train/json/loss" not in r for r in recs[5:])
    # Tokens per step constant across the seq_len change: 8 x 32 = 4 x 64 targets.
    assert {r["tokens"] - p["tokens"] for p, r in zip(recs, recs[1:])} == {256}
    assert recs[0]["lr"] > 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    for src, v in summary["val"].items():
        assert v["loss"] > 0 and v["unigram_entropy"] > 0
    assert [s for s, _ in list_complete(tmp_path / "run")] == [5, 10]


def test_resume_in_fresh_process_matches_uninterrupted(prepared, tmp_path):
    _, make = prepared
    full = make(tmp_path / "full")
    train(full)
    part = make(tmp_path / "part")
    train(part, stop_after=5)
    assert [s for s, _ in list_complete(tmp_path / "part" / "run")] == [5]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "densetrain", "train", "--resume", str(tmp_path / "part" / "run")],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    a = _train_records(tmp_path / "full" / "run")
    b = _train_records(tmp_path / "part" / "run")
    assert [x["step"] for x in b] == list(range(1, 11))
    # micro-batch 2 x accumulation 4 = 8 samples per step: the resumed step 6 starts at global sample 40.
    assert b[5]["sample_index"] == 40
    for x, y in zip(a, b):
        assert x["sample_index"] == y["sample_index"]
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-6), x["step"]
        assert x["lr"] == y["lr"]
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5)


def test_tensorboard_events_read_back(prepared, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, make = prepared
    cfg = make(tmp_path, **{"train.steps": 4, "stages": [{"name": "main", "start": 0.0}]})
    train(cfg)
    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "grad_norm", "lr", "tokens_per_sec", "mfu", "val/email/loss"} <= tags
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3, 4]
    jl = _train_records(tmp_path / "run")
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx([r["loss"] for r in jl], rel=1e-6)
    assert all(0 < e.value < 1 for e in acc.Scalars("mfu"))
