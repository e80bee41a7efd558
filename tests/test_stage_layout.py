"""A layout per stage (``stages[i].parallel``, densetrain/parallel/stage_layout.py and
``densetrain.train.setup.switch_layout``): real gloo ranks, a tiny fp32 model.

- A 2-rank run on pp 2 for its main and anneal stages that switches to cp 2 for its long-context stage (in the
  same processes: checkpoint, new mesh, wrappers and optimizer, resharded reload) equals one process within
  1e-5 at every step and in its final validation, and says the switch once.
- Killed (the ``kill`` fault, SIGKILL) just before the switch and just after it, it resumes bit for bit onto
  the layout of the stage at the resumed step.
- An impossible stage layout is refused before the first step, in one line naming the stage: by the config
  check, by ``train --dry-run`` and by ``train``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_resume import assert_close, finish, fresh, start, trajectory

from densetrain.cli import main
from densetrain.errors import ConfigError
from densetrain.metrics import read_events, read_metrics
from densetrain.train import train

# 10 steps: main 0-4 and anneal 5-7 at seq_len 32 (4 micro-batches of 2 rows per step), long_context 8-9 at 64.
OV = {"train.steps": 10, "checkpoint.every": 3, "checkpoint.keep": 0, "eval.every": 0, "eval.max_batches": 1,
      "eval.position_buckets": [], "logging.tensorboard": False, "watchdog.every": 0, "probe.every": 0,
      "train.device": "cpu", "model.n_layers": 4, "model.tie_embeddings": False, "eval.samples": 0,
      "parallel.timeout_s": 60.0}
STAGES = [{"name": "main", "start": 0.0, "mix": {"email": 0.5, "json": 0.5}},
          {"name": "anneal", "start": 0.5, "mix": {"email": 1.0}},
          {"name": "long_context", "start": 0.8, "seq_len": 64, "rope_theta": 100000.0}]
PP2 = {"parallel.pp": 2, "parallel.dp_replicate": 1}
LONG_CP2 = {"pp": 1, "cp": 2}  # the long stage's own keys; the rest ([parallel]'s dp_replicate = 1) inherited


def staged(make, tmp: Path, name: str, **ov):
    """The pp 2 -> cp 2 run of this module (``ov`` over it)."""
    stages = [*STAGES[:2], {**STAGES[2], "parallel": LONG_CP2}]
    return make(tmp / name, **{**OV, **PP2, "stages": stages, **ov})


@pytest.fixture(scope="module")
def reference(prepared, tmp_path_factory):
    """The same recipe in one process (no layout at all): the trajectory and final validation to equal."""
    _, make = prepared
    cfg = make(tmp_path_factory.mktemp("ref") / "ref", **OV, stages=STAGES)
    train(cfg)
    return Path(cfg.train.run_dir)


def switches(run: Path) -> list[dict]:
    return [e for e in read_events(run) if e.get("action") == "switch"]


def final_val(run: Path) -> list[float]:
    return [m["val/all/loss"] for m in read_metrics(run) if m["kind"] == "eval" and "val/all/loss" in m]


def test_a_run_that_switches_from_pp2_to_cp2_equals_one_process(prepared, reference, tmp_path):
    _, make = prepared
    cfg = staged(make, tmp_path, "staged")
    res = finish(start(fresh(cfg, tmp_path), world=2))
    assert [rc for rc, _ in res] == [0, 0], [err[-3000:] for _, err in res]
    run = Path(cfg.train.run_dir)
    assert_close(trajectory(run), trajectory(reference), range(1, 11))
    assert final_val(run) == pytest.approx(final_val(reference), rel=1e-5) and len(final_val(run)) == 1
    (sw,) = switches(run)  # said once, at the long stage's first step, with the time it took
    assert sw["step"] == 8 and sw["values"]["stage"] == "long_context" and sw["values"]["seconds"] > 0
    assert sw["values"]["from"]["pp"] == 2 and sw["values"]["to"]["cp"] == 2 and sw["values"]["to"]["pp"] == 1
    assert "pp=2 dp_replicate=1 dp_shard=1 tp=1 -> dp_replicate=1 dp_shard=1 cp=2 tp=1" in sw["text"]
    assert sw["values"]["checkpoint"] == "step_00000008"  # not a checkpoint step (every 3): the switch wrote it


@pytest.mark.parametrize("kill_at, resumed_on", [(7, 2), (8, 1)])
def test_a_run_killed_on_either_side_of_the_switch_resumes_bitwise_on_the_stage_layout(
        prepared, tmp_path, kill_at, resumed_on):
    """Killed at step 7's start (anneal, pp 2; last checkpoint step 6) or at step 8's (right after the switch
    wrote step 8 and moved to cp 2): the resume starts on the pp layout (and switches itself) or straight on
    cp 2, and every step after the resume point is the uninterrupted run's bit for bit."""
    _, make = prepared
    whole = staged(make, tmp_path, "whole")
    killed = staged(make, tmp_path, "killed", faults=[{"kind": "kill", "step": kill_at, "rank": 1}])
    res = finish(start(fresh(whole, tmp_path), world=2))
    assert [rc for rc, _ in res] == [0, 0], [err[-3000:] for _, err in res]
    res = finish(start(fresh(killed, tmp_path), world=2))
    assert all(rc != 0 for rc, _ in res)  # rank 1 SIGKILLed, rank 0 loses its peer
    run = Path(killed.train.run_dir)
    res = finish(start(["--resume", str(run)], world=2))
    assert [rc for rc, _ in res] == [0, 0], [err[-3000:] for _, err in res]
    want, got = trajectory(Path(whole.train.run_dir)), trajectory(run)
    resumed_from = 6 if kill_at == 7 else 8
    assert {s: got[s] for s in range(resumed_from + 1, 11)} == {s: want[s] for s in range(resumed_from + 1, 11)}
    layouts = [e["values"]["layout"] for e in read_events(run) if e["kind"] == "parallel" and "layout" in e["values"]]
    assert layouts[-1]["pp"] == resumed_on  # the resumed start's layout: the stage at step 6 or 8 decides
    assert len(switches(run)) == (2 if kill_at == 7 else 1)  # the first attempt's, and the resume's own at 7


def test_an_impossible_stage_layout_is_refused_in_one_line_naming_the_stage(prepared, tmp_path, capsys):
    _, make = prepared
    with pytest.raises(ConfigError, match=r"^stage 'long_context': stages\[2\]\.parallel\.cp \(3\) needs "
                                          r"stages\[2\]\.seq_len \(64\) divisible by 2 \* cp = 6"):
        staged(make, tmp_path, "cp3", stages=[*STAGES[:2], {**STAGES[2], "parallel": {"cp": 3}}])
    with pytest.raises(ConfigError, match=r"unknown config key 'stages\[2\]\.parallel\.cpp'; did you mean"):
        staged(make, tmp_path, "typo", stages=[*STAGES[:2], {**STAGES[2], "parallel": {"cpp": 2}}])
    with pytest.raises(ConfigError, match=r"stages\[2\]\.parallel\.cp: expected an integer, got 'two'"):
        staged(make, tmp_path, "type", stages=[*STAGES[:2], {**STAGES[2], "parallel": {"cp": "two"}}])
    # The long stage on pp 2 with 3 micro-batches per schedule call: its rank has 4 (4 sequences of 64, micro-batches
    # of 1), which 3 does not divide. The dry run of 2 ranks says so; train on 1 process (pp 2 cannot lay out 1).
    odd = make(tmp_path / "odd", **OV, stages=[*STAGES[:2], {**STAGES[2], "parallel": {"pp": 2, "pp_microbatches": 3}}])
    args = fresh(odd, tmp_path)
    assert main(["train", *args, "--dry-run", "--world-size", "2"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["densetrain: error: stage 'long_context' (stages[2].parallel): pp=2 dp_replicate=1 dp_shard=1 tp=1 "
                   "cannot run it: parallel.pp_microbatches (3) must divide the 4 micro-batches a rank runs per step "
                   "at stage 'long_context'"], err
    assert main(["train", *args]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["densetrain: error: stage 'long_context' (stages[2].parallel): parallel.pp (2) must divide the "
                   "world size 1 (see densetrain train --help)"], err
    assert not read_metrics(Path(odd.train.run_dir))  # no step ran
    # The same config's layouts run on 2 ranks in the dry run without the odd count.
    assert main(["train", *args, "--dry-run", "--world-size", "2", "--stages.2.parallel.pp_microbatches=2"]) == 0
