"""End-to-end training on real text: stage switches, resume in a fresh process, metrics sinks."""

import json
import os
import re
import sys

import forked
import pytest

from densetrain.checkpoint import list_complete
from densetrain.metrics import read_metrics
from densetrain.train import train


def _train_records(run_dir):
    return [r for r in read_metrics(run_dir) if r["kind"] == "train"]


def test_stages_switch_exactly_at_configured_steps(prepared, tmp_path):
    _, make = prepared
    cfg = make(tmp_path)
    train(cfg)
    recs = _train_records(tmp_path / "run")
    assert [r["step"] for r in recs] == list(range(1, 11))
    # steps are 1-based in records: record k is optimizer update k-1. Stages start at 0, 5, 8.
    assert [r["stage"] for r in recs] == ["main"] * 5 + ["anneal"] * 3 + ["long_context"] * 2
    assert [r["seq_len"] for r in recs] == [32] * 8 + [64] * 2
    assert [r["rope_theta"] for r in recs] == [10000.0] * 8 + [100000.0] * 2
    # Mix: main draws from both sources, anneal only from 'email'; long_context inherits anneal's mix.
    assert all("train/json/loss" in r and "train/email/loss" in r for r in recs[:5])
    assert all("train/json/loss" not in r for r in recs[5:])
    # Tokens per step constant across the seq_len change: 8 x 32 = 4 x 64 targets.
    assert {r["tokens"] - p["tokens"] for p, r in zip(recs, recs[1:])} == {256}
    assert recs[0]["lr"] > 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    for _name, v in summary["val"].items():
        assert v["loss"] > 0 and v["unigram_entropy"] > 0
    assert [s for s, _ in list_complete(tmp_path / "run")] == [5, 10]


def test_resume_in_fresh_process_matches_uninterrupted(prepared, tmp_path):
    _, make = prepared
    full = make(tmp_path / "full")
    train(full)
    part = make(tmp_path / "part")
    train(part, stop_after=5)
    assert [s for s, _ in list_complete(tmp_path / "part" / "run")] == [5]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = forked.run([sys.executable, "-m", "densetrain", "train", "--resume", str(tmp_path / "part" / "run")],
                   capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    a = _train_records(tmp_path / "full" / "run")
    b = _train_records(tmp_path / "part" / "run")
    assert [x["step"] for x in b] == list(range(1, 11))
    # micro-batch 2 x accumulation 4 = 8 samples per step: the resumed step 6 starts at global sample 40.
    assert b[5]["sample_index"] == 40
    for x, y in zip(a, b):
        assert x["sample_index"] == y["sample_index"]
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-6), x["step"]
        assert x["lr"] == y["lr"]
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5)


def test_tensorboard_events_read_back(prepared, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, make = prepared
    cfg = make(tmp_path, **{"train.steps": 4, "stages": [{"name": "main", "start": 0.0}]})
    train(cfg)
    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "grad_norm", "lr", "tokens_per_sec", "mfu", "val/email/loss"} <= tags
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3, 4]
    jl = _train_records(tmp_path / "run")
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx([r["loss"] for r in jl], rel=1e-6)
    assert all(0 < e.value < 1 for e in acc.Scalars("mfu"))


_PER_STEP = ("loss", "lr", "seq_len", "rope_theta", "sample_index", "stage", "batch_tokens", "tokens")


def _assert_same_run(a, b):
    assert [x["step"] for x in b] == [x["step"] for x in a]
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-6), x["step"]
        for k in _PER_STEP[1:]:
            assert x[k] == y[k], (x["step"], k)


def test_resume_around_stage_switch_matches_uninterrupted(prepared, tmp_path):
    # Stages start at updates 0, 5, 8 of 10: stop after 4, 5 and 6 updates (just before, exactly at,
    # just after the switch to 'anneal') and resume in-process.
    _, make = prepared
    quiet = {"eval.every": 0, "logging.tensorboard": False}
    train(make(tmp_path / "full", **quiet))
    full = _train_records(tmp_path / "full" / "run")
    assert [r["stage"] for r in full] == ["main"] * 5 + ["anneal"] * 3 + ["long_context"] * 2
    assert [r["batch_tokens"] for r in full] == [256] * 10
    for stop in (4, 5, 6):
        cfg = make(tmp_path / f"stop{stop}", **quiet)
        train(cfg, stop_after=stop)
        assert len(_train_records(tmp_path / f"stop{stop}" / "run")) == stop
        train(cfg, resume=True)
        _assert_same_run(full, _train_records(tmp_path / f"stop{stop}" / "run"))


def test_token_unit_batch_ramp_and_rewarmup_end_to_end(prepared, tmp_path):
    # 'anneal' doubles the batch to 512 tokens (16 x 32) and re-warms over 2 steps; long_context
    # inherits 512 tokens as 8 x 64. In tokens, shares 0.5 / 0.3 / 0.2 at 256 / 512 / 512 tokens per
    # step give starts round(10 * 0.5/0.75) = 7 and round(10 * 0.65/0.75) = 9 (step mode: 5 and 8).
    from densetrain.schedule import lr_for, resolve_stages

    _, make = prepared
    ov = {
        "eval.every": 0, "logging.tensorboard": False, "schedule.unit": "tokens",
        "stages": [
            {"name": "main", "start": 0.0, "mix": {"email": 0.5, "json": 0.5}},
            {"name": "anneal", "start": 0.5, "mix": {"email": 1.0}, "batch_tokens": 512, "rewarmup_steps": 2},
            {"name": "long_context", "start": 0.8, "seq_len": 64, "rope_theta": 100000.0},
        ],
    }
    cfg = make(tmp_path / "full", **ov)
    train(cfg)
    recs = _train_records(tmp_path / "full" / "run")
    assert [r["stage"] for r in recs] == ["main"] * 7 + ["anneal"] * 2 + ["long_context"]
    assert [r["batch_tokens"] for r in recs] == [256] * 7 + [512] * 3
    assert [r["seq_len"] for r in recs] == [32] * 9 + [64]
    assert [r["tokens"] for r in recs] == [256 * k for k in range(1, 8)] + [1792 + 512 * k for k in range(1, 4)]
    # Sequences drawn: 8 per step, then 16 (anneal), then 8 at seq_len 64.
    assert [r["sample_index"] for r in recs] == [8 * k for k in range(8)] + [72, 88]
    stages = resolve_stages(cfg)
    assert [r["lr"] for r in recs] == [lr_for(k, cfg, stages) for k in range(10)]
    # Re-warmup: anneal's two updates use 1/2 and 2/2 of the scheduled lr.
    plain = make(tmp_path / "plain", **{**ov, "stages": [{**s, "rewarmup_steps": 0} for s in ov["stages"]]})
    sched = [lr_for(k, plain, resolve_stages(plain)) for k in (7, 8)]
    assert recs[7]["lr"] == sched[0] * 1 / 2 and recs[8]["lr"] == sched[1] * 2 / 2
    # Resumed inside the re-warmup (after update 8 of 10): identical to the uninterrupted run.
    part = make(tmp_path / "part", **ov)
    train(part, stop_after=8)
    train(part, resume=True)
    _assert_same_run(recs, _train_records(tmp_path / "part" / "run"))


def test_corrupt_latest_checkpoint_falls_back_and_existing_run_is_protected(prepared, tmp_path):
    from densetrain.errors import TrainError

    _, make = prepared
    cfg = make(tmp_path, **{"train.steps": 6, "checkpoint.every": 2, "checkpoint.keep": 3, "eval.every": 0,
                            "stages": [{"name": "main", "start": 0.0}]})
    train(cfg, stop_after=4)
    # Starting afresh on top of an existing run would mix two runs' metrics: refused.
    with pytest.raises(TrainError, match="already holds a run; continue it with --resume"):
        train(cfg)
    # A truncated shard file in the newest checkpoint: resume falls back to step 2 and says why.
    latest = tmp_path / "run" / "checkpoints" / "step_00000004"
    shard = next(latest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    train(cfg, resume=True)
    recs = _train_records(tmp_path / "run")
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert any("resumed from" in r.get("text", "") and "step_00000002" in r["text"]
               for r in read_metrics(tmp_path / "run"))


def test_model_change_on_resume_is_a_one_line_error_and_only_it_blames_the_model_settings(prepared, tmp_path):
    from densetrain.errors import TrainError

    _, make = prepared
    cfg = make(tmp_path, **{"train.steps": 4, "eval.every": 0, "stages": [{"name": "main", "start": 0.0}]})
    train(cfg, stop_after=2)
    saved = (tmp_path / "run" / "config.toml").read_bytes()
    # Refused before any checkpoint is tried, whether or not the tensors' shapes would tell: another qk_norm
    # trained on silently as another model (and was written into config.toml; found by review 49).
    for key, value in (("model.d_model", 128), ("model.qk_norm", True), ("model.norm_eps", 1e-3)):
        other = make(tmp_path, **{"train.steps": 4, "eval.every": 0, key: value,
                                  "stages": [{"name": "main", "start": 0.0}]})
        with pytest.raises(TrainError, match=rf"^--resume .*run: {re.escape(key)}: .* in its config.toml, "
                                             rf"{re.escape(repr(value))} asked; model.. settings cannot change on "
                                             rf"--resume .*start a new run"):
            train(other, resume=True)
        assert (tmp_path / "run" / "config.toml").read_bytes() == saved
        assert [s for s, _ in list_complete(tmp_path / "run")] == [2]
    # Without the run's config.toml, the checkpoint's tensors are what tells: the first mismatch named.
    (tmp_path / "run" / "config.toml").unlink()
    wider = make(tmp_path, **{"train.steps": 4, "eval.every": 0, "model.d_model": 128,
                              "stages": [{"name": "main", "start": 0.0}]})
    with pytest.raises(TrainError, match=r"no checkpoint could be loaded .*do not match the model "
                                         r"\(layers.0.attention.wk.weight: \[32, 64\] saved, \[64, 128\] in the model.*"
                                         r"; model.. settings cannot change on --resume$"):
        train(wider, resume=True)
    (tmp_path / "run" / "config.toml").write_bytes(saved)
    # A corrupt checkpoint of the same model: the error names the damage, not model.* settings.
    shard = next((tmp_path / "run" / "checkpoints" / "step_00000002").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(TrainError, match="no checkpoint could be loaded") as e:
        train(cfg, resume=True)
    assert "model.*" not in str(e.value) and "step_00000002" in str(e.value), e.value


def test_resume_without_any_checkpoint_starts_over(prepared, tmp_path):
    # A run killed before its first checkpoint left only metrics: --resume (what `make demo` does) restarts it.
    _, make = prepared
    cfg = make(tmp_path, **{"train.steps": 3, "eval.every": 0, "stages": [{"name": "main", "start": 0.0}]})
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 9.9}\n{"kind": "tra')
    train(cfg, resume=True)
    recs = _train_records(tmp_path / "run")
    assert [r["step"] for r in recs] == [1, 2, 3] and recs[0]["loss"] != 9.9


def test_resume_warns_when_training_shards_changed(tmp_path):
    """Shards rewritten between a checkpoint and its resume (a re-prepare) move the text under the
    sampler's saved positions: the resume must say so."""
    import os

    from conftest import small_config

    from densetrain.data.prepare import prepare

    cfg = small_config(tmp_path, tmp_path / "shards", **{"checkpoint.every": 2})
    prepare(cfg)
    train(cfg, stop_after=2)
    train(cfg, resume=True, stop_after=3)  # same shards: no warning
    shard = next((tmp_path / "shards" / "json" / "train").glob("*.ds"))
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    train(cfg, resume=True, stop_after=4)
    warnings = [r["text"] for r in read_metrics(tmp_path / "run") if "shards of" in r.get("text", "")]
    assert len(warnings) == 1 and "['json']" in warnings[0]


def test_final_greedy_samples_start_from_each_sources_first_held_out_document(prepared, tmp_path):
    from densetrain.data.shards import TokenFiles
    from densetrain.data.tokenizer import Tokenizer

    shards, make = prepared
    summary = train(make(tmp_path, **{"train.steps": 4, "eval.samples": 6, "eval.every": 0,
                                      "stages": [{"name": "main", "start": 0.0}]}))
    tok = Tokenizer.from_file(shards / "tokenizer.json")
    assert sorted(summary["samples"]) == ["email", "json"]
    for src, smp in summary["samples"].items():
        doc = TokenFiles(shards / src / "val").document(0)
        assert smp["prompt"] == tok.decode(doc[:24].tolist())
        assert 0 < len(tok.encode(smp["continuation"])) <= 6 + 2  # 6 new tokens (re-encoding may split)
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["samples"] == summary["samples"]


def test_a_batch_that_does_not_split_over_ranks_names_the_layouts_that_would(prepared, tmp_path):
    import torch

    from densetrain.data.streams import open_streams
    from densetrain.errors import TrainError
    from densetrain.parallel import DistInfo
    from densetrain.schedule import resolve_stages
    from densetrain.train.setup import check_stages

    _, make = prepared
    cfg = make(tmp_path, **{"train.micro_batch_size": 1})  # 8 sequences per step; 4 heads, 2 KV heads
    streams = open_streams(cfg, "train")
    stages = resolve_stages(cfg, available=set(streams))
    on = lambda world, dp: DistInfo(0, world, 0, torch.device("cpu"), dp_rank=0, dp_size=dp)  # noqa: E731
    check_stages(stages, streams, on(4, 4), cfg.model)  # main 8, long_context 4 sequences over 4 ranks: fine
    with pytest.raises(TrainError, match=r"does not split into 16 data-parallel ranks .* layouts that run it: "
                                         r"--parallel.dp_replicate=1 --parallel.dp_shard=8 --parallel.tp=2 "
                                         r"--parallel.cp=1 --parallel.pp=1 \| --parallel.dp_replicate=1 "
                                         r"--parallel.dp_shard=8 --parallel.tp=1 --parallel.cp=2 "):
        check_stages(stages, streams, on(16, 16), cfg.model)
    with pytest.raises(TrainError, match=r"48 data-parallel ranks .* layouts that run it: --parallel.dp_replicate=1 "
                                         r"--parallel.dp_shard=2 --parallel.tp=2 --parallel.cp=4 --parallel.pp=3 \| "):
        check_stages(stages, streams, on(48, 48), cfg.model)  # cp and pp count too (the advice once tried tp only)
    with pytest.raises(TrainError, match="no layout of 47 ranks runs it"):
        check_stages(stages, streams, on(47, 47), cfg.model)
    # A stage with its own layout (stages[0].parallel) is advised by its own keys, not [parallel]'s flags.
    with pytest.raises(TrainError, match=r"stage 'main'.* layouts that run it: --stages.0.parallel.dp_replicate=1 "
                                         r"--stages.0.parallel.dp_shard=8 --stages.0.parallel.tp=2 "):
        check_stages(stages, streams, on(16, 16), cfg.model, own=frozenset({0}))


def test_mfu_above_one_measures_the_peak_again_once_or_says_a_declared_one_is_low(prepared, tmp_path):
    """A start-up probe that read low (a busy machine then) would give mfu > 100%: the first such step measures
    the peak again and keeps the larger; a declared logging.peak_flops is kept and said once to be too low."""
    from densetrain.metrics import read_events
    from densetrain.train.loop import _train
    from densetrain.train.rundir import unlock_run_dir
    from densetrain.train.setup import setup

    _, make = prepared
    settings = {"train.steps": 6, "train.threads": 1, "eval.every": 0, "checkpoint.every": 0,
                "logging.tensorboard": False, "logging.mfu_every": 1}
    run = setup(make(tmp_path / "measured", **settings, **{"logging.peak_flops": 0.0}))  # 0: measured
    run.peak_flops = 1.0  # as if the start-up probe had read (almost) nothing
    try:
        _train(run)
    finally:
        unlock_run_dir(run.run_dir)
    assert run.peak_flops > 1e8  # measured again: a real matmul rate
    mfu = [r["mfu"] for r in read_metrics(tmp_path / "measured" / "run") if r["kind"] == "train"]
    assert len(mfu) == 6 and all(0 < m < 1 for m in mfu), mfu
    said = [e for e in read_events(tmp_path / "measured" / "run") if e["kind"] == "mfu"]
    assert len(said) == 1 and "measured again" in said[0]["text"] and said[0]["step"] == 1
    train(make(tmp_path / "declared", **settings, **{"logging.peak_flops": 1.0}))
    mfu = [r["mfu"] for r in read_metrics(tmp_path / "declared" / "run") if r["kind"] == "train"]
    assert all(m > 1e6 for m in mfu), mfu  # the user's number stays the denominator
    said = [e for e in read_events(tmp_path / "declared" / "run") if e["kind"] == "mfu"]
    assert len(said) == 1 and "logging.peak_flops = 1" in said[0]["text"], said


def test_a_plan_that_repeats_a_source_more_than_four_times_is_warned_with_the_epochs_the_sampler_makes(
        prepared, tmp_path):
    """planned_epochs is what the sampler really does: drawing every batch of the plan (all three stages, their
    mixes and batch sizes) completes floor(planned) passes of each source (give or take the one a batch crossing
    an epoch boundary starts early). A fresh run planned beyond MAX_EPOCHS says so once at set-up; one within
    it does not."""
    from densetrain.metrics import read_events
    from densetrain.schedule import stage_at
    from densetrain.train.rundir import unlock_run_dir
    from densetrain.train.setup import setup
    from densetrain.train.startlog import MAX_EPOCHS, planned_epochs
    from densetrain.train.step import draw_samples

    _, make = prepared
    run = setup(make(tmp_path / "few", **{"train.steps": 10}))
    unlock_run_dir(run.run_dir)
    assert not [e for e in read_events(tmp_path / "few" / "run") if e["kind"] == "data"]  # 10 steps: no warning
    sizes = {n: len(s) for n, s in run.train_streams.items()}
    steps = int(6 * max(sizes.values()) / run.stages[0].batch_tokens)  # ~6 passes over the larger source
    run = setup(make(tmp_path / "many", **{"train.steps": steps}))  # the stage table of `steps` steps
    unlock_run_dir(run.run_dir)
    epochs = planned_epochs(run.stages, run.train_streams, steps)
    assert set(epochs) == {n for st in run.stages for n in st.mix} and max(epochs.values()) > MAX_EPOCHS
    said = [e for e in read_events(tmp_path / "many" / "run") if e["kind"] == "data"]
    assert len(said) == 1 and "repeats training data" in said[0]["text"], said
    for step in range(steps):
        draw_samples(run.sampler, stage_at(step, run.stages), range(0))
    done = run.sampler.state["epoch"]
    for name, e in epochs.items():
        assert int(e) - 1 <= done[name] <= int(e) + 1, (name, e, done[name])
    assert said[0]["values"]["epochs"] == {n: round(e, 2) for n, e in epochs.items()}
