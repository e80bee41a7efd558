"""The read-only commands on a run of any layout, and replay's verdicts on any input (issues 36.6, 37.7).

One real 2-rank FSDP2 run (``--parallel.dp_shard=2``, gloo) whose third step is made non-finite by a data fault
(``loss_spike`` with a finite factor whose product overflows): ``replay`` recomputes its steps in one process
(it exited 2 before, taking the run's layout), calls the non-finite step reproduced (it said "machine": the ranks'
logged parts included the fault, the replay's plain rows did not), replays a later step with that skipped step in
the guard's window (a ``TypeError`` before), refuses a bad ``--rtol`` (-1 and nan gave a wrong "machine"), and
says in one line that a checkpoint without sampler state (an older run) cannot be replayed (a
``KeyError: 'sampler'`` before). ``eval`` reads the sharded checkpoint in one process; an override a command does
not use is refused in one line (``report``, ``blame`` and ``replay`` ignored every override before).

Decisions said once at start (issue 36.4), on the same run: the layout of every start (FSDP2 too), which
parameters Muon and AdamW got, whether the RNG was restored after a layout change; and a refused ``train`` leaves
the ``.lock`` of the run it refuses untouched.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
from test_resume import OV, finish, fresh, start

from densetrain.checkpoint import list_complete
from densetrain.cli import main
from densetrain.config import load_config, save_config
from densetrain.metrics import read_events, read_metrics
from densetrain.tools.replay import replay


@pytest.fixture(scope="module")
def fsdp_run(prepared, tmp_path_factory):
    _, make = prepared
    tmp = tmp_path_factory.mktemp("readonly")
    cfg = make(tmp, **{**OV, "train.steps": 5, "checkpoint.every": 2, "parallel.dp_replicate": 1,
                       "parallel.dp_shard": 2, "guard.replay": False, "optim.name": "muon"},
               faults=[{"kind": "loss_spike", "step": 2, "factor": 1e308}])
    res = finish(start(fresh(cfg, tmp), world=2))
    assert [rc for rc, _ in res] == [0, 0], [err[-3000:] for _, err in res]
    run = Path(cfg.train.run_dir)
    assert sorted(p.name for p in (run / "checkpoints" / "step_00000002").glob("*.distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]  # sharded over both ranks
    return run


def one_error(capsys, *argv: str) -> str:
    """The one line of ``densetrain ARGV`` run in this process, which must exit 2."""
    rc = main(list(argv))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("densetrain: error: "), (rc, err)
    return err.strip()


def test_replay_of_a_two_rank_fsdp2_run_in_one_process_and_its_non_finite_step(fsdp_run):
    run = fsdp_run
    (nf,) = [e for e in read_events(run) if e["kind"] == "nonfinite"]
    assert nf["step"] == 2 and nf["values"]["loss"] is None  # the overflowed loss, null in the file
    v = replay(run, 3)  # from the 2-rank checkpoint of step 2, in this one process
    assert v["checkpoint"] == "step_00000002" and v["reproduced"] and v["verdict"] == "data", v["text"]
    assert not math.isfinite(v["replayed"]["loss"]) and len(v["ranks"]) == 2 and v["suspect_ranks"] == []
    assert "reproduced, so the data or the recipe caused it (not the machine)" in v["text"]
    # Step 5: the skipped step 3 (loss null) is in the guard's window; its median leaves it out.
    v = replay(run, 5)
    assert v["reproduced"] and v["verdict"] in ("data", "normal")
    recs = {r["step"]: r["loss"] for r in read_metrics(run) if r["kind"] == "train"}
    assert recs[3] is None and v["median"] == pytest.approx(sorted([recs[1], recs[2], recs[4]])[1])
    assert v["logged"]["loss"] == pytest.approx(v["replayed"]["loss"], rel=1e-5)


def test_bad_rtol_and_step_and_unused_overrides_are_refused_in_one_line(fsdp_run, capsys):
    run = str(fsdp_run)
    for rtol in ("-1", "nan", "inf"):
        assert one_error(capsys, "replay", run, "3", "--rtol", rtol) == (
            f"densetrain: error: --rtol {float(rtol)}: expected a finite relative tolerance >= 0 (e.g. 1e-3) "
            "(see densetrain replay --help)")
    assert "step 0: expected a step >= 1" in one_error(capsys, "replay", run, "0")
    for argv in (["replay", run, "3", "--guard.window=4"], ["blame", run, "3", "--data.shards_dir=/elsewhere"],
                 ["report", run, "--logging.tensorboard=false"], ["blame", run, "3", "--preset", "tiny"]):
        flag = argv[3] if argv[0] != "report" else argv[2]
        assert one_error(capsys, *argv) == (
            f"densetrain: error: {flag}: densetrain {argv[0]} reads the run's own config.toml and takes no --preset, "
            f"--config or --section.key=value overrides (see densetrain {argv[0]} --help)")
    assert one_error(capsys, "eval", run, "--parallel.dp_shard=2") == (
        "densetrain: error: --parallel.dp_shard: densetrain eval does not use [parallel] (it reads one checkpoint of "
        "any layout in this process); leave it out (see densetrain eval --help)")
    assert "densetrain export does not use [optim]" in one_error(capsys, "export", run, "out", "--optim.peak_lr=1")


def test_eval_and_blame_of_the_sharded_run_in_one_process(fsdp_run, capsys):
    assert main(["blame", str(fsdp_run), "3", "--json"]) == 0
    logged = next(r for r in read_metrics(fsdp_run) if r["kind"] == "train" and r["step"] == 3)
    assert json.loads(capsys.readouterr().out)["sample_index"] == logged["sample_index"]
    assert main(["eval", str(fsdp_run)]) == 0
    res = json.loads(capsys.readouterr().out)
    # The final validation the 2-rank run logged, recomputed from its sharded checkpoint in one process.
    logged = next(r for r in read_metrics(fsdp_run) if r["kind"] == "eval" and r["step"] == 5)
    assert res["step"] == 5 and res["val"]["all"]["loss"] == pytest.approx(logged["val/all/loss"], rel=1e-5)


def test_a_checkpoint_without_sampler_state_cannot_be_replayed_said_in_one_line(fsdp_run, tmp_path, capsys):
    old = shutil.copytree(fsdp_run, tmp_path / "old")
    state = old / "checkpoints" / "step_00000002" / "trainer_state.json"
    # An older densetrain wrote no sampler position.
    state.write_text(json.dumps({k: v for k, v in json.loads(state.read_text()).items() if k != "sampler"}))
    assert [s for s, _ in list_complete(old)] == [2, 4, 5]
    err = one_error(capsys, "replay", str(old), "3")  # a KeyError traceback before
    assert str(state) in err, err


def test_the_start_says_layout_optimizer_groups_and_rng_and_a_refused_train_leaves_the_lock(fsdp_run, tmp_path):
    said = {e["kind"]: e for e in read_events(fsdp_run) if e["kind"] in ("parallel", "optimizer")}
    assert said["parallel"]["text"] == "layout: 2 process(es) as dp_replicate=1 dp_shard=2 tp=1: FSDP2: fully_shard " \
                                       "over 2 data-parallel ranks"
    muon, *adamw = said["optimizer"]["values"]["groups"]
    # d_model 64, 4 heads, 2 kv heads of 16, d_ff 128, 2 layers: the hidden matrices on Muon, whole shapes
    assert muon["optimizer"] == "Muon" and muon["tensors"] == 14 and muon["shapes"] == {
        "64x64": 4, "32x64": 4, "128x64": 4, "64x128": 2}
    assert muon["peak_lr"] == pytest.approx(0.02) and muon["weight_decay"] == 0.0
    # AdamW: the embedding and the 5 norm gains undecayed, the output head decayed
    assert [(g["optimizer"], g["tensors"], g["weight_decay"] > 0) for g in adamw] == [("AdamW", 6, False),
                                                                                      ("AdamW", 1, True)]
    assert adamw[0]["names"][0] == "tok_embeddings.weight" and adamw[1]["names"] == ["output.weight"]
    assert said["optimizer"]["text"].startswith("optimizer: Muon: 14 tensors, 0.07M params (")
    # The 2-rank run resumed in one process: the layout chosen, the RNG restored from rank 0's file only.
    run = shutil.copytree(fsdp_run, tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / "step_00000005")
    (run / "summary.json").unlink()
    assert main(["train", "--resume", str(run)]) == 0
    new = [e for e in read_events(run) if e["step"] == 4 and e["kind"] in ("layout", "resume", "parallel")]
    assert [e["kind"] for e in new] == ["resume", "layout", "resume"]
    assert new[2]["text"] == "RNG state restored from the checkpoint on every rank; the saved states of rank(s) [1] " \
                             "are not used on 1 process(es)"
    # A `train` of the finished run without --resume is refused, and leaves the run's .lock as it was.
    before = (run / ".lock").read_bytes(), os.stat(run / ".lock").st_mtime_ns
    cfg_file = tmp_path / "again.toml"
    save_config(load_config(path=run / "config.toml"), cfg_file)
    assert main(["train", "--config", str(cfg_file)]) == 2
    assert ((run / ".lock").read_bytes(), os.stat(run / ".lock").st_mtime_ns) == before
