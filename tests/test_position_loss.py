"""Validation loss by position in long documents (densetrain/evals/position_loss.py): bucket counts and
values, and the training loop writing it before the long-context stage and at the end."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from densetrain.config import ModelConfig
from densetrain.data.shards import TokenFiles, write_shard
from densetrain.evals.position_loss import bucket_names, evaluate_position_loss, position_metrics
from densetrain.loss import token_losses
from densetrain.metrics import read_metrics
from densetrain.model.llama import Transformer
from densetrain.train import train


def test_buckets_count_and_average_the_right_positions(tmp_path):
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(1, 64, n - 1), 0) for n in (300, 1100, 50)]  # EOS-terminated, 0 = EOS
    write_shard(tmp_path / "000000", docs, token_size=4)
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64))
    res = evaluate_position_loss(m, {"books": TokenFiles(tmp_path)}, 1200, 2, [0, 256, 1024], torch.device("cpu"))
    assert bucket_names([0, 256, 1024]) == ["0-255", "256-1023", "1024+"]
    # the two longest documents: 1099 and 299 predictions
    assert {b: v["tokens"] for b, v in res["books"].items()} == {"0-255": 512, "256-1023": 811, "1024+": 75}
    with torch.no_grad():
        t = torch.from_numpy(docs[1])[None]
        want = token_losses(m(t[:, :-1]), t[:, 1:])[0, 1024:].double().mean().item()
    assert res["books"]["1024+"]["loss"] == pytest.approx(want, rel=1e-6)
    assert res["all"] == res["books"]
    short = evaluate_position_loss(m, {"books": TokenFiles(tmp_path)}, 256, 2, [0, 256, 1024], torch.device("cpu"))
    assert short["books"]["1024+"]["tokens"] == 0 and math.isnan(short["books"]["1024+"]["loss"])
    assert "val_pos/books/1024+/loss" not in position_metrics(short)
    assert position_metrics(res)["val_pos/all/0-255/tokens"] == 512


def test_training_writes_position_loss_before_the_long_stage_and_at_the_end(prepared, tmp_path):
    shards, make = prepared
    sources = [{"name": "email", "kind": "code", "paths": ["email"], "format": "text", "long_docs": True},
               {"name": "json", "kind": "code", "paths": ["json", "http"], "format": "text"}]
    summary = train(make(tmp_path, **{"data.sources": sources, "eval.every": 0, "checkpoint.every": 0,
                                      "eval.position_buckets": [0, 16, 48], "eval.position_docs": 4,
                                      "eval.position_len": 0}))  # 0: the longest stage (64)
    assert summary["steps"] == 10
    recs = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "eval" and "position_eval" in r]
    assert [(r["step"], r["position_eval"]) for r in recs] == [(8, "before long_context"), (10, "final")]
    for r in recs:  # long_context has seq_len 64: positions 0..63 of at most 4 documents, only the long-document source
        n_docs = r["val_pos/email/0-15/tokens"] // 16
        assert 1 <= n_docs <= 4 and r["val_pos/email/0-15/tokens"] == 16 * n_docs
        assert 0 < r["val_pos/email/48+/tokens"] <= 16 * n_docs
        assert not any(k.startswith("val_pos/json/") for k in r)
        assert all(math.isfinite(r[f"val_pos/all/{b}/loss"]) for b in ("0-15", "16-47", "48+"))
    # the long stage trains on document-masked windows (64 > train.seq_len 32) and logs it
    train_recs = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert train_recs[-1]["stage"] == "long_context"
