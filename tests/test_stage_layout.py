"""A layout per stage (``stages[i].parallel``, densetrain/parallel/stage_layout.py and
``densetrain.train.setup.switch_layout``): real gloo ranks, a tiny fp32 model.

- A 2-rank run on pp 2 for its main and anneal stages that switches to cp 2 for its long-context stage (in the
  same processes: checkpoint, new mesh, wrappers and optimizer, resharded reload) equals one process within
  1e-5 at every step and in its final validation, and says the switch once.
- Killed (the ``kill`` fault, SIGKILL) just after the switch, and cut back to its checkpoint just before the
  switch, it resumes bit for bit onto the layout of the stage at the resumed step.
- An impossible stage layout is refused before the first step, in one line naming the stage: by the config
  check, by ``train --dry-run`` and by ``train``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from test_resume import assert_close, copy_until, finish, fresh, start, trajectory

from densetrain.checkpoint import list_complete
from densetrain.cli import main
from densetrain.config import load_config
from densetrain.errors import ConfigError
from densetrain.metrics import read_events, read_metrics
from densetrain.parallel.mesh import Layout
from densetrain.parallel.stage_layout import layouts_that_fit, stage_layouts
from densetrain.schedule import resolve_stages
from densetrain.train import train

# 8 steps: main 0-3 and anneal 4-5 at seq_len 32 (4 micro-batches of 2 rows per step), long_context 6-7 at 64.
OV = {"train.steps": 8, "checkpoint.every": 4, "checkpoint.keep": 0, "eval.every": 0, "eval.max_batches": 1,
      "eval.position_buckets": [], "logging.tensorboard": False, "watchdog.every": 0, "probe.every": 0,
      "train.device": "cpu", "model.n_layers": 4, "model.tie_embeddings": False, "eval.samples": 0,
      "parallel.timeout_s": 60.0}
STAGES = [{"name": "main", "start": 0.0, "mix": {"email": 0.5, "json": 0.5}},
          {"name": "anneal", "start": 0.5, "mix": {"email": 1.0}},
          {"name": "long_context", "start": 0.75, "seq_len": 64, "rope_theta": 100000.0}]
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


@pytest.fixture(scope="module")
def whole(prepared, tmp_path_factory):
    """The pp 2 -> cp 2 run on 2 gloo ranks, uninterrupted."""
    _, make = prepared
    tmp = tmp_path_factory.mktemp("whole")
    cfg = staged(make, tmp, "whole")
    res = finish(start(fresh(cfg, tmp), world=2))
    assert [rc for rc, _ in res] == [0, 0], [err[-3000:] for _, err in res]
    # The switch onto cp builds the flattened dp_shard_cp mesh without torch's deprecation warning on each rank.
    assert not [err for _, err in res if "Slicing a flattened dim" in err]
    return Path(cfg.train.run_dir)


def test_a_run_that_switches_from_pp2_to_cp2_equals_one_process(whole, reference):
    assert_close(trajectory(whole), trajectory(reference), range(1, 9))
    assert final_val(whole) == pytest.approx(final_val(reference), rel=1e-5) and len(final_val(whole)) == 1
    (sw,) = switches(whole)  # said once, at the long stage's first step, with the time it took
    assert sw["step"] == 6 and sw["values"]["stage"] == "long_context" and sw["values"]["seconds"] > 0
    assert sw["values"]["from"]["pp"] == 2 and sw["values"]["to"]["cp"] == 2 and sw["values"]["to"]["pp"] == 1
    assert "pp=2 dp_replicate=1 dp_shard=1 tp=1 -> dp_replicate=1 dp_shard=1 cp=2 tp=1" in sw["text"]
    # the [parallel] keys that differ, said and recorded (a switch between equal degrees says why it ran)
    assert sw["values"]["changed"]["pp"] == [2, 1] and sw["values"]["changed"]["cp"] == [1, 2]
    assert "parallel.pp 2 -> 1" in sw["text"] and "parallel.cp 1 -> 2" in sw["text"]
    assert sw["values"]["checkpoint"] == "step_00000006"  # not a checkpoint step (every 4): the switch wrote it


def test_a_run_killed_on_either_side_of_the_switch_resumes_bitwise_on_the_stage_layout(prepared, whole, tmp_path):
    """Killed (SIGKILL on rank 1) at step 6's start, right after the switch wrote step 6 on pp 2 and moved to cp 2:
    its resume starts straight on cp 2. The same run without its step-6 checkpoint (killed just before the switch,
    its last checkpoint step 4 of the anneal stage) resumes on pp 2 and switches itself. Every step after the
    resume point is the uninterrupted run's bit for bit."""
    _, make = prepared
    killed = staged(make, tmp_path, "killed", faults=[{"kind": "kill", "step": 6, "rank": 1}])
    res = finish(start(fresh(killed, tmp_path), world=2))
    assert all(rc != 0 for rc, _ in res)  # rank 1 SIGKILLed, rank 0 loses its peer
    after = Path(killed.train.run_dir)
    assert [s for s, _ in list_complete(after)] == [4, 6] and switches(after)
    before = copy_until(after, tmp_path / "before", 4)
    want = trajectory(whole)
    for run, resumed_from, pp in ((after, 6, 1), (before, 4, 2)):
        res = finish(start(["--resume", str(run)], world=2))
        assert [rc for rc, _ in res] == [0, 0], [err[-3000:] for _, err in res]
        got = trajectory(run)
        assert {s: got[s] for s in range(resumed_from + 1, 9)} == {s: want[s] for s in range(resumed_from + 1, 9)}
        starts = [e for e in read_events(run) if e["kind"] in ("parallel", "layout") and "layout" in e["values"]]
        assert starts[-1]["step"] == resumed_from and starts[-1]["values"]["layout"]["pp"] == pp
        # after: the first attempt's switch only; before: the first attempt's and the resume's own
        assert [e["step"] for e in switches(run)] == [6] * (1 if run == after else 2)


def test_a_plain_resume_on_one_process_adapts_the_stage_layouts_like_parallel(whole, reference, tmp_path):
    """Review of issue 40: ``train --resume RUN`` on 1 process of the pp 2 -> cp 2 run refused the long stage's
    cp 2 ("but the world size is 1") though ``[parallel]``'s pp 2 adapts. The stage's layout adapts the same
    way, said once; the resumed steps equal one process."""
    run = copy_until(whole, tmp_path / "one", 4)
    assert main(["train", "--resume", str(run)]) == 0
    assert_close(trajectory(run), trajectory(reference), range(5, 9))
    (note,) = [e for e in read_events(run) if e.get("action") == "adapt"]
    assert note["step"] == 4 and note["text"].startswith(
        "stage 'long_context' (stages[2].parallel): the configured pp=1 dp_replicate=1 dp_shard=1 cp=2 tp=1 does "
        "not fit 1 process(es): the layout closest to it that runs is dp_replicate=1 dp_shard=1 tp=1"), note
    assert [e["step"] for e in switches(run)] == [6]  # the first attempt's only: cp 1 is [parallel]'s layout


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


@pytest.mark.parametrize("preset, world, main, long", [
    ("llama3-405b", 16384, Layout(1, 128, 8, 1, 16), Layout(1, 8, 8, 16, 16)),  # Table 4: TP8 PP16; +CP16, DP8
    ("llama3-70b", 512, Layout(1, 16, 8, 1, 4), Layout(1, 4, 8, 16, 1)),
    ("llama3-8b", 64, Layout(1, 64, 1), Layout(1, 8, 1, 8, 1)),
])
def test_the_llama3_presets_run_their_long_context_stage_on_a_layout_of_its_own(preset, world, main, long):
    cfg = load_config(preset=preset)
    layouts = stage_layouts(cfg, resolve_stages(cfg), world)
    assert [lay for _, lay in layouts] == [main, main, long]
    assert layouts[2][0].activation_checkpointing == ("selective" if preset == "llama3-70b" else "full")
    cfg.stages[2].parallel["cp"] = 3  # degrees that do not divide the world
    with pytest.raises(ConfigError, match=r"^stage 'long_context' \(stages\[2\]\.parallel\): parallel: the fixed "
                                          r"degrees .* do not divide the world size"):
        stage_layouts(cfg, resolve_stages(cfg), world)


def test_pipeline_with_context_parallelism_runs_document_masked_stages():
    """pp 2 x cp 2 runs through pipeline stages on document-masked stages too (the masks travel per micro-batch,
    tests/test_pipeline.py): as [parallel] and as the masked (long) stage's own layout, both accepted and laid out."""
    base = {"parallel.pp": 2, "parallel.cp": 2, "parallel.dp_replicate": 1, "model.tie_embeddings": False,
            "eval.samples": 0, "eval.tasks": "", "eval.final_tasks": "", "model.document_mask": True}
    long = {"name": "long", "start": 0.9, "seq_len": 1024}  # longer than train.seq_len: document masks on
    for own in ({}, {"dp_shard": 1}, {"pp": 1, "dp_shard": 2}):
        cfg = load_config(preset="tiny", overrides=[*base.items(), ("stages", [
            {"name": "main", "start": 0.0}, {**long, "parallel": own}])])
        stages = resolve_stages(cfg)
        assert stages[1].document_mask
        want = Layout(1, 2, 1, 2, 1) if own.get("pp") == 1 else Layout(1, 1, 1, 2, 2)
        assert [lay for _, lay in stage_layouts(cfg, stages, 4)] == [Layout(1, 1, 1, 2, 2), want]


def test_the_advice_for_a_batch_that_does_not_split_considers_cp_and_pp():
    """Review of issue 40: the advice varied tp only, so it said "no layout of 16384 ranks runs it" for
    llama3-405b's long_context stage with too many data-parallel ranks (cp 16 runs it), and never cp 2 on 2."""
    cfg = load_config(preset="llama3-405b")
    cfg.stages[2].parallel.update(dp_shard=256, cp=1, tp=4)  # 16 x 256 x 4 ranks; 128 sequences per step
    with pytest.raises(ConfigError) as e:
        stage_layouts(cfg, resolve_stages(cfg), 16384)
    first = "--stages.2.parallel.dp_replicate=1 --stages.2.parallel.dp_shard=128 --stages.2.parallel.tp=8 " \
            "--stages.2.parallel.cp=16 --stages.2.parallel.pp=1"
    assert f"does not split into 256 data-parallel ranks x micro_batch_size 1; layouts that run it: {first} | " \
        in str(e.value), str(e.value)
    # One sequence per step, one KV head: on 2 ranks neither tp 2 (heads), pp 2 (micro-batches) nor dp 2 runs it.
    tiny = load_config(preset="tiny", overrides=[("model.n_kv_heads", 1)])
    st = dataclasses.replace(resolve_stages(tiny)[0], batch_size=1, micro_batch_size=1)
    want = "--parallel.dp_replicate=1 --parallel.dp_shard=1 --parallel.tp=1 --parallel.cp=2 --parallel.pp=1"
    assert layouts_that_fit(2, st, tiny.model) == f"layouts that run it: {want}"
    assert layouts_that_fit(2, dataclasses.replace(st, seq_len=258), tiny.model).startswith("no layout of 2 ranks")
    # a tied embedding and head cannot be split over pipeline stages (config.validate refuses it): never advised
    # (before: gpt2-124m on 3 ranks was told --parallel.pp=3, which the next launch refused)
    gpt2 = load_config(preset="gpt2-124m")
    st = dataclasses.replace(resolve_stages(gpt2)[0], batch_size=4, micro_batch_size=1)
    advice = layouts_that_fit(3, st, gpt2.model)
    assert gpt2.model.tie_embeddings and advice.startswith("no layout of 3 ranks runs it"), advice
