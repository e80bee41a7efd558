"""Data or hardware: replica checksums, the replay verdict and the update-norm warning, rehearsed with
injected faults (bitflip, bad_batch, lr_jump) on real training runs (gloo ranks on CPU, fp32)."""

from __future__ import annotations

import gc
import json
import sys
import textwrap
import time
from pathlib import Path

import forked
import pytest
import torch
from conftest import gloo_env

from densetrain.checkpoint import list_complete
from densetrain.metrics import read_events, read_metrics
from densetrain.report.run import read_events as report_events
from densetrain.tools.replay import replay
from densetrain.train import train
from densetrain.train.watch.faults import flip_bit
from densetrain.train.watch.replicas import checksum, odd_ranks, replica_groups

ROOT = Path(__file__).resolve().parents[1]
MAIN = [{"name": "main", "start": 0.0, "mix": {"email": 0.5, "json": 0.5}}]
QUIET = {"eval.every": 0, "logging.tensorboard": False, "stages": MAIN, "watchdog.every": 0, "probe.every": 0,
         "logging.peak_flops": 1e11, "eval.samples": 0}
TINY = {"model.d_model": 32, "model.n_layers": 1, "model.n_heads": 2, "model.n_kv_heads": 1, "model.d_ff": 64,
        "train.seq_len": 16, "train.batch_size": 6, "train.micro_batch_size": 2}
WQ = "layers.0.attention.wq.weight"


def _events(run, kind):
    return [e for e in read_events(run) if e["kind"] == kind]


def _wait_for_replay(run: Path, timeout: float = 180) -> list[dict]:
    """The replay verdicts of ``run`` once guard.replay's background process wrote one."""
    deadline = time.monotonic() + timeout
    while not (run / "events_replay.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert (run / "events_replay.jsonl").exists(), (run / "replay.log").read_text()[-2000:]
    return _events(run, "replay")


def test_checksum_is_exact_and_names_the_odd_replica():
    t = torch.randn(1000)
    before = int(checksum(t))
    assert int(checksum(t.clone())) == before
    old, new = flip_bit(t, 7, 0)  # the lowest mantissa bit: a change of one ulp
    assert old != new and int(checksum(t)) - before in (1, -1)
    flip_bit(t, 7, 0)
    assert int(checksum(t)) == before and float(checksum(t.double().to(torch.bfloat16))) != 0
    assert odd_ranks([0, 1, 2], [5, 9, 5]) == ([1], True)
    assert odd_ranks([0, 1], [5, 9]) == ([0, 1], False)  # two replicas: no majority, both named
    from densetrain.parallel import Layout

    assert replica_groups(Layout(3, 1, 1)) == [[0, 1, 2]]  # DDP
    assert replica_groups(Layout(2, 2, 1)) == [[0, 2], [1, 3]]  # HSDP: same shard, other replica
    assert replica_groups(Layout(1, 4, 1)) == [] and replica_groups(Layout(2, 1, 2)) == []  # sharded only


_WORKER = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    root, jobs = sys.argv[1], json.loads(sys.argv[2])
    sys.path[:0] = [root, os.path.join(root, "tests")]
    from conftest import small_config
    from densetrain.train import train
    for ov in jobs:  # several runs in one process group: one start-up for all
        train(small_config(Path(ov.pop("tmp")), Path(ov.pop("shards")), **ov))
    import torch.distributed as dist
    dist.destroy_process_group()
""")


def _launch(tmp_path, jobs: list[dict], world: int) -> None:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = gloo_env(world)
    procs = [forked.Popen([sys.executable, str(script), str(ROOT), json.dumps(jobs)],
                          env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=forked.DEVNULL,
                          stderr=forked.PIPE, text=True) for r in range(world)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(e[-2000:] for e in errs)


def test_replicas_bitflips_and_the_replay_verdict_on_three_ranks(prepared, tmp_path):
    """Three DDP ranks, four runs: a bit flipped in rank 1's copy of a weight (the checksum names rank 1
    and the weight at the first check after it; with action 'rollback' the run goes back to the checkpoint
    before it), an exponent bit flipped in rank 1's gradient (the step is skipped as non-finite; the
    automatic replay does not reproduce it and names rank 1), and a clean 100-step control (no replica or
    update-norm event)."""
    shards, _ = prepared
    base = {"shards": str(shards), **QUIET, **TINY, "guard.replica_every": 5, "checkpoint.every": 0}
    weight = [{"kind": "bitflip", "step": 6, "rank": 1, "param": WQ, "element": 3, "bit": 20}]
    grad = [{"kind": "bitflip", "step": 7, "rank": 1, "param": WQ, "grad": True, "bit": 30}]
    jobs = [{**base, "tmp": str(tmp_path / "weight"), "train.steps": 12, "faults": weight},
            {**base, "tmp": str(tmp_path / "grad"), "train.steps": 10, "checkpoint.every": 5, "faults": grad,
             "guard.replay": True},
            {**base, "tmp": str(tmp_path / "rollback"), "train.steps": 14, "checkpoint.every": 5, "faults": weight,
             "guard.replica_action": "rollback"},
            {**base, "tmp": str(tmp_path / "clean"), "train.steps": 100}]
    _launch(tmp_path, jobs, world=3)

    (ev,) = _events(tmp_path / "weight" / "run", "replica_mismatch")  # reported once, not at every check
    assert ev["step"] == 9 and ev["values"]["since_step"] == 10 and ev["values"]["clean_step"] == 5
    assert ev["values"]["ranks"] == [1] and ev["values"]["majority"] is True
    assert ev["values"]["tensors"] == {WQ: [1]} and ev["action"] == "report"  # one element of one weight

    rrun = tmp_path / "rollback" / "run"  # the same flip with guard.replica_action = 'rollback'
    (ev,) = _events(rrun, "replica_mismatch")
    (rb,) = _events(rrun, "rollback")
    assert ev["action"] == "rollback" and (rb["values"]["from_step"], rb["values"]["to_step"]) == (10, 5)
    assert [s for s, _ in list_complete(rrun)][-1] == 14  # finished; one mismatch event: equal after the rollback

    grun = tmp_path / "grad" / "run"
    (nf,) = _events(grun, "nonfinite")
    assert nf["step"] == 7 and [r["rank"] for r in nf["values"]["ranks"]] == [0, 1, 2]
    assert nf["text"].startswith("non-finite loss or grad_norm on 1 rank (loss ")  # the reduced two are finite
    assert nf["text"].endswith("update skipped (1 so far; metrics.jsonl step 8, densetrain replay RUN 8)")
    assert nf["values"]["ranks"][1]["grad_norm"] is None  # inf, which strict JSON writes as null
    assert nf["values"]["ranks"][0]["grad_norm"] < 1e3
    assert _events(grun, "replica_mismatch") == []  # the skipped update never reached the weights
    (auto,) = _wait_for_replay(grun)  # started by rank 0 as a process of its own, not a rank of the job
    v = auto["values"]
    assert v["checkpoint"] == "step_00000005" and v["verdict"] == "machine" and not v["reproduced"]
    assert v["suspect_ranks"] == [1] and [r["differs"] for r in v["ranks"]] == [[], ["grad_norm"], []]
    assert v["replayed"]["loss"] == pytest.approx(nf["values"]["loss"], rel=1e-5)  # the loss itself was right

    clean = tmp_path / "clean" / "run"
    assert _events(clean, "replica_mismatch") == [] and _events(clean, "update_norm") == []
    assert len([e for e in read_events(clean) if e["kind"] == "loss_spike"]) <= 1


def test_bad_batch_spike_replays_as_data_and_names_the_injected_documents(prepared, tmp_path):
    _, make = prepared
    faults = [{"kind": "bad_batch", "step": 27, "source": "json", "rows": 4}]
    ov = {**QUIET, "train.steps": 30, "checkpoint.every": 10, "guard.min_history": 8, "guard.window": 16,
          "guard.replay": True}
    train(make(tmp_path, **ov, faults=faults))
    run = tmp_path / "run"
    (spike,) = _events(run, "loss_spike")
    (fault,) = _events(run, "fault")
    assert spike["step"] == 27 and fault["values"]["samples"] == [216, 217, 218, 219]
    (auto,) = _wait_for_replay(run)
    v = auto["values"]
    assert auto["step"] == 27 and auto["action"] == "data" and v["reproduced"] and v["checkpoint"] == "step_00000020"
    assert v["replayed"]["loss"] == pytest.approx(spike["values"]["loss"], rel=1e-5)
    injected = {(d["source"], d["doc_id"]) for d in fault["values"]["documents"]}
    share = sum(d["share"] for d in v["documents"] if (d["source"], d["doc_id"]) in injected)
    assert share >= 0.8 and all(d["loss"] > spike["values"]["median"] for d in v["documents"])
    assert v["ranks"][0]["differs"] == [] and v["suspect_ranks"] == []
    assert replay(run, 28)["documents"] == v["documents"]  # the command gives the same verdict
    assert gc.isenabled()  # the replay's loop (before_step only) leaves Python's collector on
    assert [e.action for e in report_events(run) if e.kind == "replay"] == ["data"]  # the report lists the verdict


def test_update_norm_warns_before_the_loss_guard_on_an_lr_jump(prepared, tmp_path):
    _, make = prepared
    ov = {**QUIET, "train.steps": 28, "checkpoint.every": 0, "guard.min_history": 8, "guard.window": 16,
          "guard.rollback": False, "guard.update_every": 1}
    train(make(tmp_path, **ov, faults=[{"kind": "lr_jump", "step": 22, "factor": 30.0}]))
    run = tmp_path / "run"
    (warn,) = _events(run, "update_norm")  # one event for the episode, not one per step
    spikes = _events(run, "loss_spike")
    assert spikes and 22 <= warn["step"] <= spikes[0]["step"]
    assert warn["values"]["z"] > 6 and warn["action"] == "warn"
    recs = read_metrics(run)
    upd = {r["step"]: r for r in recs if r["kind"] == "update"}
    lr = {r["step"]: r["lr"] for r in recs if r["kind"] == "train"}
    assert set(upd) == set(lr) - {e["step"] + 1 for e in spikes}  # measured on applied updates only
    jump = (upd[23]["update_norm"] / lr[23]) / (upd[22]["update_norm"] / lr[22])
    assert jump > 10 and {"update/layers.0", "update_ratio/output", "update_ratio"} <= set(upd[1])

    # The same jump with guard.update_lr_factor: the warning lowers the lr at once, the loss never spikes, and a
    # step before the first checkpoint replays from the seeded initial weights.
    lower = {**ov, "guard.update_lr_factor": 1 / 30, "guard.update_lr_steps": 100}
    train(make(tmp_path / "lower", **lower, faults=[{"kind": "lr_jump", "step": 22, "factor": 30.0}]))
    lrun = tmp_path / "lower" / "run"
    (warn,) = _events(lrun, "update_norm")
    assert warn["step"] == 22 and warn["action"] == "lower_lr" and _events(lrun, "loss_spike") == []
    v = replay(lrun, 3)
    assert v["checkpoint"] == "the initial weights" and v["reproduced"]
    # an ordinary step (found by a user: replay blamed documents for a loss below the median)
    assert v["verdict"] == ("normal" if v["logged"]["loss"] <= v["median"] else "data")
    v = replay(lrun, 12)  # before the jump, the loss falling: below the window's median, no excess to blame
    assert v["reproduced"] and v["logged"]["loss"] < v["median"]
    assert v["verdict"] == "normal" and v["documents"] == [] and "not a spike" in v["text"]


@pytest.mark.slow
def test_replicas_are_checked_under_pipelining_where_stages_hold_different_tensors(prepared, tmp_path):
    """pp 2 x HSDP (dp_replicate 2 x dp_shard 2), 8 ranks: the stages hold different tensors (and counts), which
    crashed the check's all-reduce at its first step (a collective size mismatch, review of issue 41); a bit
    flipped in rank 6's copy of a weight the second stage holds is named with its replica (rank 4: two replicas,
    no majority) by the tensor's own name, which rank 0 (first stage) does not hold."""
    shards, _ = prepared
    wq1 = "layers.1.attention.wq.weight"
    job = {"shards": str(shards), **QUIET, **TINY, "model.n_layers": 2, "model.tie_embeddings": False,
           "train.batch_size": 16, "parallel.pp": 2, "parallel.dp_replicate": 2, "parallel.dp_shard": 2,
           "guard.replica_every": 2, "checkpoint.every": 0, "train.steps": 6, "tmp": str(tmp_path / "pp"),
           "eval.position_len": 0,
           "faults": [{"kind": "bitflip", "step": 3, "rank": 6, "param": wq1, "element": 1, "bit": 20}]}
    _launch(tmp_path, [job], world=8)
    (ev,) = _events(tmp_path / "pp" / "run", "replica_mismatch")
    assert ev["step"] == 3 and ev["values"]["clean_step"] == 2 and ev["values"]["majority"] is False
    assert ev["values"]["tensors"] == {wq1: [4, 6]} and ev["values"]["ranks"] == [4, 6]
