"""Failures handled by the run itself, rehearsed with injected faults on real training runs: loss spikes
(skip, then rollback), NaN gradients on one rank, a slow rank, duplicated data, a kill during the
checkpoint write, a manual rollback, and provenance of a step's batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import forked
import numpy as np
import pytest
import torch
from conftest import gloo_env

from densetrain.checkpoint import list_complete
from densetrain.config import save_config
from densetrain.data.shards import TokenFiles
from densetrain.metrics import read_events, read_metrics
from densetrain.tools.blame import blame
from densetrain.train import train

ROOT = Path(__file__).resolve().parents[1]
MAIN = [{"name": "main", "start": 0.0, "mix": {"email": 0.5, "json": 0.5}}]
QUIET = {"eval.every": 0, "logging.tensorboard": False, "stages": MAIN, "watchdog.every": 0, "probe.every": 0}


def _train_records(run):
    return [r for r in read_metrics(run) if r["kind"] == "train"]


def _events(run, kind):
    return [e for e in read_events(run) if e["kind"] == kind]


def test_loss_spikes_skip_then_roll_back_past_the_bad_data(prepared, tmp_path):
    _, make = prepared
    spikes = [{"kind": "loss_spike", "step": s, "factor": 10.0} for s in (24, 25, 26)]
    ov = {**QUIET, "train.steps": 40, "checkpoint.every": 10, "checkpoint.keep": 5, "guard.min_history": 8}
    cfg = make(tmp_path / "faulty", **ov, faults=spikes)
    train(cfg)
    run = tmp_path / "faulty" / "run"
    skips = _events(run, "loss_spike")
    assert [(e["step"], e["action"]) for e in skips] == [(24, "skip"), (25, "skip")]  # one spike at a time: skip
    assert all(e["values"]["z"] > 6 and e["values"]["documents"] for e in skips)  # events name the documents
    assert {"file", "line", "doc_id", "source"} <= set(skips[0]["values"]["documents"][0])
    (rb,) = _events(run, "rollback")  # the third within the window: back to the checkpoint before the first
    assert (rb["values"]["from_step"], rb["values"]["to_step"], rb["values"]["skipped_samples"]) == (26, 20, [160, 216])
    recs = _train_records(run)
    assert [r["step"] for r in recs] == list(range(1, 41))  # one trajectory in the rewritten metrics
    assert max(r["loss"] for r in recs) < 8  # no spike left in it
    final = list_complete(run)[-1][1]
    assert final.name == "step_00000040"

    # The clean run on the same data minus the skipped batches: 20 steps, skip 7 batches, 20 more.
    clean = make(tmp_path / "clean", **ov)
    train(clean, stop_after=20)
    train(clean, resume=True, rollback_to=20, skip_batches=7)
    ref = _train_records(tmp_path / "clean" / "run")
    assert [r["sample_index"] for r in ref] == [r["sample_index"] for r in recs]
    assert recs[-1]["loss"] == pytest.approx(ref[-1]["loss"], rel=0.02)
    for a, b in zip(recs[20:], ref[20:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), a["step"]
    from densetrain.model.init import build_model

    model = build_model(cfg.model, 0)
    from densetrain.checkpoint import load_checkpoint

    load_checkpoint(final, model, None)
    assert all(torch.isfinite(p).all() for p in model.parameters())


_NAN_WORKER = textwrap.dedent("""
    import copy, json, os, sys, torch
    root, overrides, out = sys.argv[1], sys.argv[2], sys.argv[3]
    sys.path[:0] = [root, os.path.join(root, "tests")]
    from conftest import small_config
    from densetrain.schedule import lr_for, stage_at
    from densetrain.optim import set_lr
    from densetrain.train.loop import commit
    from densetrain.train.setup import setup
    from densetrain.train.step import compute_step
    from densetrain.train.watchers import decide
    ov = json.loads(overrides)
    cfg = small_config(__import__("pathlib").Path(ov.pop("tmp")), __import__("pathlib").Path(ov.pop("shards")), **ov)
    run = setup(cfg)
    verdicts, same = [], None
    for _ in range(5):
        st = stage_at(run.state.step, run.stages)
        for w in run.watchers:
            w.before_step(run)
        set_lr(run.optimizer, lr_for(run.state.step, cfg, run.stages))
        before = (copy.deepcopy(run.model.state_dict()), copy.deepcopy(run.optimizer.state_dict()))
        result = compute_step(run, st, 1e-3)
        verdict = decide(run.watchers, run, result)
        commit(run, result, verdict)
        for w in run.watchers:
            w.after_step(run, result, verdict)
        verdicts.append(verdict.name)
        if result.index == 3:
            m, o = run.model.state_dict(), run.optimizer.state_dict()
            same = all(torch.equal(m[k], before[0][k]) for k in m) and all(
                torch.equal(v, before[1]["state"][i][k]) for i, s in o["state"].items() for k, v in s.items()
                if torch.is_tensor(v))
    json.dump({"verdicts": verdicts, "unchanged": same}, open(f"{out}.{os.environ['RANK']}", "w"))
    run.log.close()
""")


def _launch(script: str, args: list[str], world: int = 2, timeout: int = 240) -> list[subprocess.CompletedProcess]:
    """``python SCRIPT ARGS`` (or ``python -m ARGS`` with ``script`` ``"-m"``) as ``world`` gloo ranks."""
    env = gloo_env(world)
    procs = [forked.Popen([sys.executable, script, *args], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                          stdout=forked.PIPE, stderr=forked.PIPE, text=True) for r in range(world)]
    out = []
    for p in procs:
        o, e = p.communicate(timeout=timeout)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, o, e))
    return out


def test_nan_gradient_on_one_rank_skips_on_every_rank_and_changes_nothing(prepared, tmp_path):
    shards, _ = prepared
    script = tmp_path / "worker.py"
    script.write_text(_NAN_WORKER)
    ov = {"tmp": str(tmp_path), "shards": str(shards), **QUIET, "train.steps": 5, "checkpoint.every": 0,
          "faults": [{"kind": "nan_grad", "step": 3, "rank": 1}]}
    results = _launch(str(script), [str(ROOT), json.dumps(ov), str(tmp_path / "out")])
    assert all(r.returncode == 0 for r in results), results[0].stderr[-2000:] + results[1].stderr[-2000:]
    got = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(2)]
    for g in got:  # rank 0's gradients were finite: it skips because rank 1's were not
        assert g["verdicts"] == ["APPLY", "APPLY", "APPLY", "SKIP", "APPLY"]
        assert g["unchanged"] is True  # parameters and optimizer moments / step counts bit-identical


def _two_rank_train(cfg, tmp_path, name: str) -> Path:
    cfg_path = tmp_path / f"{name}.toml"
    save_config(cfg, cfg_path)
    # `python -m densetrain train` on 2 gloo ranks with the environment torchrun gives them (test_distributed
    # runs torchrun itself): forked ranks, without a launcher process and three interpreter start-ups.
    res = _launch("-m", ["densetrain", "train", "--config", str(cfg_path)], timeout=300)
    assert all(r.returncode == 0 for r in res), "\n".join(r.stderr[-3000:] for r in res)
    return Path(cfg.train.run_dir)


def test_watchdog_names_the_slow_rank_and_phase(prepared, tmp_path):
    _, make = prepared
    ov = {**QUIET, "train.steps": 48, "checkpoint.every": 0, "watchdog.every": 4, "watchdog.warmup": 1,
          "watchdog.sustain": 2, "watchdog.threshold": 0.5, "model.d_model": 128, "model.d_ff": 256}
    slow = _two_rank_train(make(tmp_path / "slow", **ov, faults=[{"kind": "slow_rank", "step": 24, "rank": 1,
                                                                  "ms": 400}]), tmp_path, "slow")
    (ev,) = _events(slow, "throughput")
    assert ev["values"]["ranks"] == [1] and ev["values"]["phases"] == {"1": "forward"}
    assert ev["step"] > 24 and "rank 1" in ev["text"]
    perf = [r for r in read_metrics(slow) if r["kind"] == "perf"]
    assert {r["rank"] for r in perf} == {0, 1}
    control = _two_rank_train(make(tmp_path / "control", **ov), tmp_path, "control")
    # no slow device named (a busy host's contention, action 'busy', is not one)
    assert [e["text"] for e in _events(control, "throughput") if e["action"] != "busy"] == []


def test_probe_names_the_source_fed_duplicates_and_blame_agrees(prepared, tmp_path):
    _, make = prepared
    ov = {**QUIET, "train.steps": 40, "checkpoint.every": 10, "probe.every": 5, "guard.min_history": 8}
    faults = [{"kind": "duplicate_data", "step": 20, "source": "email"}, {"kind": "loss_spike", "step": 12}]
    train(make(tmp_path / "dup", **ov, faults=faults))
    run = tmp_path / "dup" / "run"
    (ev,) = _events(run, "data_probe")
    assert ev["values"]["source"] == "email" and ev["values"]["signal"] == "duplicates"
    assert 20 < ev["step"] <= 30  # within two checks of the fault
    first = blame(run, ev["step"])["sample_index"]
    assert ev["values"]["samples"] == [first, blame(run, ev["step"] + 1)["sample_index"]]
    # Provenance: the spike event's documents (the live batch) are those `blame` replays for its step.
    (spike,) = _events(run, "loss_spike")
    docs = [d for s in blame(run, spike["step"] + 1)["samples"] for d in s["documents"]]
    assert spike["values"]["documents"] == docs[:20] and spike["values"]["more"] == max(0, len(docs) - 20)
    train(make(tmp_path / "clean", **ov))
    assert _events(tmp_path / "clean" / "run", "data_probe") == []


def test_manual_rollback_sets_checkpoints_aside_and_blame_matches_the_batch(prepared, tmp_path):
    shards, make = prepared
    ov = {**QUIET, "train.steps": 30, "checkpoint.every": 10, "checkpoint.keep": 5}
    cfg = make(tmp_path, **ov)
    train(cfg)
    run = tmp_path / "run"
    before = {r["step"]: r for r in _train_records(run)}
    train(cfg, resume=True, rollback_to=10, skip_batches=2)
    assert sorted(p.name for p in (run / "checkpoints_set_aside").iterdir()) == ["step_00000020", "step_00000030",
                                                                               "summary.json"]  # of step 30
    assert [s for s, _ in list_complete(run)] == [10, 20, 30]  # the new trajectory saved them again
    recs = _train_records(run)
    assert [r["step"] for r in recs] == list(range(1, 31))
    assert recs[10]["sample_index"] == before[11]["sample_index"] + 2 * 8  # two batches of 8 skipped
    assert [r["loss"] for r in recs[:10]] == [before[s]["loss"] for s in range(1, 11)]
    # blame: the replayed batch of step 15 (after the skip) is exactly its documents' tokens.
    res = blame(run, 15)
    assert res["sample_index"] == recs[14]["sample_index"] and len(res["samples"]) == 8
    for smp in res["samples"]:
        stream = TokenFiles(shards / smp["source"] / "train")
        ends = stream.doc_ends()
        pieces, pos = [], smp["start"]
        for d in smp["documents"]:
            k = int(np.searchsorted(ends, pos, side="right"))
            take = min(int(ends[k]), smp["start"] + len(smp["tokens"])) - pos
            assert take == d["tokens"]
            pieces.append(stream.document(k)[pos - (int(ends[k - 1]) if k else 0):][:take])
            pos += take
        assert np.concatenate(pieces).tolist() == smp["tokens"]


def test_kill_during_checkpoint_write_resumes_from_the_previous_one(prepared, tmp_path):
    _, make = prepared
    ov = {**QUIET, "train.steps": 12, "checkpoint.every": 5}
    cfg = make(tmp_path / "killed", **ov, faults=[{"kind": "kill", "step": 9, "during_checkpoint": True}])
    cfg_path = tmp_path / "killed.toml"
    save_config(cfg, cfg_path)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = forked.run([sys.executable, "-m", "densetrain", "train", "--config", str(cfg_path)], capture_output=True,
                   text=True, env=env)
    run = Path(cfg.train.run_dir)
    assert r.returncode == -9 and [s for s, _ in list_complete(run)] == [5]
    (ev,) = _events(run, "fault")
    assert "during the checkpoint write" in ev["text"]
    r = forked.run([sys.executable, "-m", "densetrain", "train", "--resume", str(run)], capture_output=True,
                   text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    train(make(tmp_path / "clean", **ov))
    got, ref = _train_records(run), _train_records(tmp_path / "clean" / "run")
    assert [x["step"] for x in got] == list(range(1, 13))
    assert [x["loss"] for x in got] == pytest.approx([x["loss"] for x in ref], rel=1e-6)


def test_heartbeat_dumps_every_threads_stack_when_no_step_completes(tmp_path, capfd):
    import threading
    import time

    from densetrain.train.watch.watchdog import Heartbeat

    stuck = threading.Event()
    waiter = threading.Thread(target=stuck.wait, name="stuck-in-a-collective", daemon=True)
    waiter.start()
    hb = Heartbeat(0.4, tmp_path / "hang_rank0.txt")
    time.sleep(1.5)  # no beat: a hang
    dump = (tmp_path / "hang_rank0.txt").read_text()
    assert "stuck-in-a-collective" in dump or "wait" in dump  # the other thread's stack
    assert "test_heartbeat_dumps_every_threads_stack" in dump  # this (main) thread's stack
    assert "no step completed for" in capfd.readouterr().err
    hb.beat()
    (tmp_path / "hang_rank0.txt").unlink()
    time.sleep(0.2)
    assert not (tmp_path / "hang_rank0.txt").exists()  # a beat re-arms it; nothing dumped meanwhile
    hb.stop()
    stuck.set()


def test_rollback_sets_aside_the_summary_report_and_evals_of_the_abandoned_steps(prepared, tmp_path):
    """After --rollback-to STEP no file of the run dir shows numbers of steps after STEP (they stay in
    checkpoints_set_aside/); the evaluation of STEP itself stays."""
    from densetrain.cli import main

    _, make = prepared
    cfg = make(tmp_path, **{**QUIET, "train.steps": 6, "checkpoint.every": 2, "checkpoint.keep": 0})
    train(cfg)
    run, aside = tmp_path / "run", tmp_path / "run" / "checkpoints_set_aside"
    for step in (2, 4):
        assert main(["eval", str(run / "checkpoints" / f"step_{step:08d}")]) == 0
    assert main(["report", str(run)]) == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 6
    train(cfg, resume=True, rollback_to=2, stop_after=3)  # the new future stops before summary.json
    assert not any((run / n).exists() for n in ("summary.json", "report.html", "report.png"))
    assert [p.name for p in (run / "evals").iterdir()] == ["step_00000002.json"]
    assert json.loads((aside / "summary.json").read_text())["steps"] == 6
    assert json.loads((aside / "evals" / "step_00000004.json").read_text())["step"] == 4
    assert {"report.html", "report.png", "step_00000004", "step_00000006"} <= {p.name for p in aside.iterdir()}
