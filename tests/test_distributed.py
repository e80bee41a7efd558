"""Real torch.distributed: 2 gloo processes under torchrun give the single-process trajectory."""

import os
import subprocess
import sys

import pytest

from densetrain.config import save_config
from densetrain.metrics import read_metrics
from densetrain.train import train


def _losses(run_dir):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(run_dir) if r["kind"] == "train"]


def test_two_process_ddp_matches_single_process(prepared, tmp_path):
    _, make = prepared
    single = make(tmp_path / "single", **{"train.steps": 6})
    train(single)

    ddp = make(tmp_path / "ddp", **{"train.steps": 6})
    cfg_path = tmp_path / "ddp.toml"
    save_config(ddp, cfg_path)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "densetrain", "train", "--config", str(cfg_path)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = _losses(tmp_path / "single" / "run"), _losses(tmp_path / "ddp" / "run")
    assert [s for s, _, _ in a] == [s for s, _, _ in b] == list(range(1, 7))
    for (_, la, ga), (_, lb, gb) in zip(a, b):
        # Same samples, same per-token normalisation; only the all-reduce summation order differs.
        assert lb == pytest.approx(la, rel=1e-5)
        assert gb == pytest.approx(ga, rel=1e-4)
    # Validation (windows split over ranks, sums reduced) gives the same number too.
    val_single = [r for r in read_metrics(tmp_path / "single" / "run") if r["kind"] == "eval"][-1]
    val_ddp = [r for r in read_metrics(tmp_path / "ddp" / "run") if r["kind"] == "eval"][-1]
    assert val_ddp["val/email/loss"] == pytest.approx(val_single["val/email/loss"], rel=1e-5)
