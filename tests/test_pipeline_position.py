"""The loss by position (densetrain/evals/position_loss.py) under pipeline parallelism with FSDP2: held-out
documents of many lengths on the data-parallel ranks (review of issue 41: with ``eval.position_len`` above the
documents' lengths, pp 2 x dp_shard 2 hung after the final validation, a new input shape's stand-in forward
all-gathering on one data-parallel rank and not the other; downstream tasks hung the same way). The fix is in the
pipeline's forward (parallel/pipeline.py ``_new_shape_together``: a shape new to any rank is built anew on every
rank), which this guards for every evaluation. Real runs on 4 gloo ranks against one process."""

from __future__ import annotations

import pytest
from conftest import small_config
from test_sdc import _launch

from densetrain.data.prepare import prepare
from densetrain.metrics import read_metrics
from densetrain.train import train

JOB = {"data.sources": [{"name": "lib", "kind": "code", "paths": ["email", "json", "http", "logging", "unittest"],
                         "format": "text", "long_docs": True}],
       "data.val_fraction": 0.3, "stages": [{"name": "main", "start": 0.0, "mix": {"lib": 1.0}}],
       "model.tie_embeddings": False, "train.steps": 3, "train.batch_size": 8, "checkpoint.every": 0,
       "eval.every": 0, "logging.tensorboard": False, "watchdog.every": 0, "probe.every": 0, "eval.samples": 0,
       "eval.position_len": 512, "eval.position_docs": 16, "eval.position_buckets": [0, 64, 256]}


@pytest.mark.slow
def test_position_loss_under_pp_and_fsdp2_on_documents_of_many_lengths(tmp_path):
    shards = tmp_path / "shards"  # held-out documents of many lengths
    prepare(small_config(tmp_path / "one", shards, **JOB))
    train(small_config(tmp_path / "one", shards, **JOB))
    _launch(tmp_path, [{**JOB, "shards": str(shards), "tmp": str(tmp_path / "pp"), "parallel.pp": 2,
                        "parallel.dp_shard": 2, "parallel.dp_replicate": 1}], world=4)
    got, want = ({k: v for r in read_metrics(tmp_path / d / "run") for k, v in r.items() if k.startswith("val_pos/")}
                 for d in ("pp", "one"))
    lengths = {v for k, v in want.items() if k.endswith("/tokens")}
    assert len(want) >= 6 and len(lengths) > 1, want  # buckets filled by documents of different lengths
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-5), k
