"""Checkpoint contents verified: every file's xxh3-64 digest is in the completion marker, and every read
checks it. A payload damaged on disk (200 KB of random bytes over part of a ``.distcp``, or one flipped
bit) is refused by ``train --resume``, ``eval`` and ``export`` with one line naming the file; the resume
and the guard's rollback pass over a damaged checkpoint, or one holding non-finite weights, to an older
one, saying so; with none intact the guard stops without advising an lr change. Readers beside a writer:
retention keeps a checkpoint a live reader holds a lease on; a resume names the partial saves it passes
over."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from densetrain.checkpoint import (
    CheckpointCorruptError,
    Checkpointer,
    leased_checkpoint,
    list_complete,
    load_checkpoint,
    save_checkpoint,
)
from densetrain.cli import main
from densetrain.dcp_read import verify_checkpoint
from densetrain.errors import TrainError
from densetrain.metrics import read_events
from densetrain.model.init import build_model
from densetrain.optim import build_optimizer
from densetrain.report import write_report
from densetrain.train.loop import rollback
from densetrain.train.setup import setup
from densetrain.train.step import StepResult
from densetrain.train.watch.guard import Guard


def _copy(stopped_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(stopped_run[0], run)
    return run, [p for _, p in list_complete(run)]


def _random_bytes(f):
    """200 KB of random bytes over the middle of ``f`` (its size unchanged)."""
    size = f.stat().st_size
    assert size > 300_000, size
    with open(f, "r+b") as fh:
        fh.seek(size // 2 - 100_000)
        fh.write(os.urandom(200_000))


def _flip_bit(f):
    """One bit of ``f`` flipped (bit 6 of the byte at 3/4 of the file)."""
    with open(f, "r+b") as fh:
        fh.seek(f.stat().st_size * 3 // 4)
        b = fh.read(1)[0]
        fh.seek(-1, 1)
        fh.write(bytes([b ^ 0x40]))


def _one_line(capsys, argv) -> str:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("densetrain: error: "), err
    return err


@pytest.mark.parametrize("damage", [_random_bytes, _flip_bit], ids=["200KB_random", "one_bit"])
def test_damaged_payload_is_refused_by_every_reader_naming_the_file(stopped_run, tmp_path, capsys, damage):
    run, ckpts = _copy(stopped_run, tmp_path)
    shard = ckpts[-1] / "__0_0.distcp"
    damage(shard)
    # Resume: refused, in one line naming the file; the run goes on from the older one, said in that line.
    assert main(["train", "--resume", str(run)]) == 0
    said = [ln for ln in capsys.readouterr().out.splitlines() if "cannot load" in ln]
    assert len(said) == 1 and f"{shard}: contents differ from the save" in said[0], said
    assert said[0].endswith("trying an older one")
    assert [e["step"] for e in read_events(run) if e["kind"] == "resume" and e["text"].startswith("resumed")] == [2]
    aside = run / "checkpoints_set_aside" / ckpts[-1].name  # passed over: set aside, kept
    assert not ckpts[-1].exists() and aside.is_dir()
    shard = aside / shard.name
    err = _one_line(capsys, ["eval", str(aside)])
    assert f"{shard}: contents differ from the save" in err, err
    err = _one_line(capsys, ["export", str(aside), "--format", "hf", str(tmp_path / "hf")])
    assert f"{shard}: contents differ from the save" in err and not (tmp_path / "hf").exists(), err


def test_marker_records_every_file_and_an_old_marker_is_read_unverified(stopped_run, tmp_path, capfd):
    run, ckpts = _copy(stopped_run, tmp_path)
    marker = json.loads((ckpts[-1] / "COMPLETE").read_text())
    assert marker["step"] == 3 and marker["hash"] == "xxh3_64"
    assert set(marker["files"]) == {p.name for p in ckpts[-1].iterdir()} - {"COMPLETE"}
    assert {".metadata", "__0_0.distcp", "trainer_state.json", "rng_0.json"} <= set(marker["files"])
    assert marker["files"]["__0_0.distcp"]["bytes"] == (ckpts[-1] / "__0_0.distcp").stat().st_size
    (ckpts[0] / "COMPLETE").write_text(json.dumps({"step": 2}))  # as densetrain wrote it before digests
    capfd.readouterr()
    assert verify_checkpoint(ckpts[0]) is False and verify_checkpoint(ckpts[0]) is False
    err = capfd.readouterr().err
    assert err.count("records no content hashes") == 1 and str(ckpts[0]) in err, err  # said once


def _result(run, index, before):
    return StepResult(index=index, stage=run.stages[0], lr=0.0, loss=float("nan"), grad_norm=float("nan"),
                      stats=None, first_sample=run.sampler.state["samples_seen"], data_s=0.0, rollback_before=before)


def test_guard_rollback_passes_over_damaged_and_nonfinite_checkpoints(stopped_run, tmp_path):
    run_dir, ckpts = _copy(stopped_run, tmp_path)
    cfg = stopped_run[1]
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_dir=str(run_dir)))
    run = setup(cfg, resume=True)
    assert run.state.step == 3
    # Step 4 saved with a NaN weight (its digests are honest: damaged before the save, e.g. memory).
    w = dict(run.model.named_parameters())["layers.0.attention.wq.weight"]
    with torch.no_grad():
        w[0, 0] = float("nan")
    save_checkpoint(run_dir, 4, run.model, run.optimizer, {**run.state_dict(), "step": 4}, keep=0)
    _flip_bit(ckpts[-1] / "__0_0.distcp")  # step 3 damaged on disk
    rollback(run, _result(run, 4, 4))
    assert run.state.step == 2 and all(torch.isfinite(p).all() for p in run.model.parameters())
    passed = [e["text"] for e in read_events(run_dir) if e.get("action") == "pass_over"]
    assert len(passed) == 2, passed
    assert "step_00000004" in passed[0] and "non-finite weights (layers.0.attention.wq.weight)" in passed[0]
    assert "step_00000003" in passed[1] and f"{ckpts[-1]}/__0_0.distcp: contents differ" in passed[1]
    # With none intact: the checkpoint is the cause, said so; no lr advice.
    _flip_bit(list_complete(run_dir)[0][1] / "__0_0.distcp")
    with pytest.raises(CheckpointCorruptError) as e:
        rollback(run, _result(run, 3, 2))
    assert "no intact checkpoint at or before step 2" in str(e.value) and "lr" not in str(e.value)
    run.log.close()


def test_resume_names_the_partial_saves_it_passes_over(stopped_run, tmp_path, capsys):
    run, ckpts = _copy(stopped_run, tmp_path)
    partial = run / "checkpoints" / "step_00000004.tmp"
    shutil.copytree(ckpts[-1], partial)
    (partial / "COMPLETE").unlink()
    markerless = run / "checkpoints" / "step_00000005"
    shutil.copytree(partial, markerless)
    assert main(["train", "--resume", str(run)]) == 0
    said = [e["text"] for e in read_events(run) if e.get("action") == "pass_over"]
    assert len(said) == 2 and f"passed over {partial}: a partial save" in said[0], said
    assert f"passed over {markerless}: no completion marker" in said[1], said


def test_a_resume_that_passes_over_a_damaged_checkpoint_sets_it_aside_so_retention_keeps_the_good_ones(
        stopped_run, tmp_path):
    """Checkpoints 1 and 3, step 3 damaged: the resume goes on from 1 and saves 2. Retention keeps the newest by
    step, so with ``keep = 1`` it kept the damaged 3 and deleted 2, the only loadable one: the next resume found
    nothing to load. The passed-over 3 is set aside (kept there) at the resume."""
    cfg = stopped_run[1]
    run = tmp_path / "run"
    model = build_model(cfg.model, cfg.train.seed, torch.device("cpu"))
    opt = build_optimizer(model, cfg)
    state = json.loads((stopped_run[0] / "checkpoints" / "step_00000002" / "trainer_state.json").read_text())
    for step in (1, 3):
        save_checkpoint(run, step, model, opt, {**state, "step": step}, keep=0)
    _flip_bit(run / "checkpoints" / "step_00000003" / "__0_0.distcp")
    ck = Checkpointer(run, every=1, keep=1, last_step=4)
    path, loaded = ck.load_latest(model, opt)
    assert path.name == "step_00000001" and loaded["step"] == 1
    assert len(ck.notes) == 1 and ck.notes[0].startswith("set aside step_00000003 in ")
    assert (run / "checkpoints_set_aside" / "step_00000003" / "COMPLETE").is_file()
    save_checkpoint(run, 2, model, opt, {**state, "step": 2}, keep=1)
    assert [s for s, _ in list_complete(run)] == [2]  # was [3]: the damaged one, nothing loadable
    assert Checkpointer(run, every=1, keep=1, last_step=4).load_latest(model, opt)[1]["step"] == 2


def test_retention_keeps_a_checkpoint_a_live_reader_holds(stopped_run, tmp_path, capfd):
    run, ckpts = _copy(stopped_run, tmp_path)
    cfg = stopped_run[1]
    model = build_model(cfg.model, cfg.train.seed, torch.device("cpu"))
    opt = build_optimizer(model, cfg)
    dead = run / "checkpoints" / "step_00000003.reader-999999999"  # a reader that was killed
    dead.touch()
    with leased_checkpoint(ckpts[0], newest_of=run) as held:
        assert held == ckpts[0] and (run / "checkpoints" / f"step_00000002.reader-{os.getpid()}").exists()
        save_checkpoint(run, 4, model, opt, {"step": 4}, keep=1)  # retention: only the newest stays ...
        assert [s for s, _ in list_complete(run)] == [2, 4]  # ... but the one being read is kept
        assert "retention keeps step_00000002 while process" in capfd.readouterr().err
        assert load_checkpoint(held, model, None)["step"] == 2
    assert not dead.exists() and not list((run / "checkpoints").glob("*.reader-*"))
    save_checkpoint(run, 5, model, opt, {"step": 5}, keep=1)  # the lease is gone: the next save deletes it
    assert [s for s, _ in list_complete(run)] == [5]
    # A run's newest deleted before the lease was taken: the newest now is read, said out loud.
    with leased_checkpoint(ckpts[-1], newest_of=run) as held:
        assert held.name == "step_00000005"
    assert "step_00000003 was deleted by the running job's retention" in capfd.readouterr().err
    # A killed `densetrain eval` left its temp file: the next one sweeps it.
    stale = run / "evals" / ".step_00000002.json.tmp999999999"
    stale.parent.mkdir()
    stale.write_text('{"trunc')
    shutil.copytree(stopped_run[0] / "checkpoints" / "step_00000003", run / "checkpoints" / "step_00000003")
    assert main(["eval", str(run / "checkpoints" / "step_00000003")]) == 0
    assert not stale.exists() and json.loads((run / "evals" / "step_00000003.json").read_text())["step"] == 3


def test_guard_stop_with_nonfinite_weights_blames_the_weights_not_the_lr(stopped_run):
    """Non-finite steps with no rollback left, and the weights themselves not finite (a damaged load, memory):
    the line says so and advises no lr change (before: 'resume ... with a lower optim.peak_lr')."""
    cfg = stopped_run[1]
    model = build_model(cfg.model, cfg.train.seed, torch.device("cpu"))
    guard = Guard(dataclasses.replace(cfg.guard, rollback=False), max_nonfinite=1)
    result = StepResult(index=5, stage=None, lr=0.0, loss=float("nan"), grad_norm=float("nan"), stats=None,
                        first_sample=0, data_s=0.0)
    run = SimpleNamespace(model=model)
    with pytest.raises(TrainError) as e:  # finite weights: the lr may well be the cause
        guard.judge(run, result)
    assert "optim.peak_lr" in str(e.value)
    with torch.no_grad():
        model.layers[1].feed_forward.w2.weight[3, 4] = float("inf")
    with pytest.raises(TrainError) as e:
        guard.judge(run, result)
    assert "the weights themselves are not finite (layers.1.feed_forward.w2.weight)" in str(e.value)
    assert "peak_lr" not in str(e.value) and "not an lr problem" in str(e.value), str(e.value)


def test_report_sweeps_what_a_killed_report_left_and_writes_whole_files(stopped_run, tmp_path):
    run, _ = _copy(stopped_run, tmp_path)
    left = [run / ".report.html.tmp999999999", run / ".report.png.tmp999999999"]  # a report killed mid-write
    for p in left:
        p.write_text("<html><body>half a pag")
    write_report(run)
    assert not any(p.exists() for p in left)
    assert (run / "report.html").read_text().endswith("</html>\n")
    assert (run / "report.png").read_bytes().startswith(b"\x89PNG")


def test_a_file_the_marker_leaves_out_is_refused_not_read_unverified(stopped_run, tmp_path, capsys):
    """Issue 44 item 10: a COMPLETE marker whose file list omits a file the checkpoint holds (its line deleted,
    then the file damaged) let that file be read unverified: the resume used the damaged shard silently."""
    run, ckpts = _copy(stopped_run, tmp_path)
    shard = ckpts[-1] / "__0_0.distcp"
    marker = json.loads((ckpts[-1] / "COMPLETE").read_text())
    del marker["files"]["__0_0.distcp"]
    (ckpts[-1] / "COMPLETE").write_text(json.dumps(marker))
    _flip_bit(shard)
    with pytest.raises(CheckpointCorruptError, match="not among the 3 files its COMPLETE marker lists"):
        verify_checkpoint(ckpts[-1])
    # Resume: step 3 refused in one line naming the file, the run goes on from step 2.
    assert main(["train", "--resume", str(run)]) == 0
    said = [ln for ln in capsys.readouterr().out.splitlines() if "cannot load" in ln]
    assert len(said) == 1 and f"{shard}: not among the 3 files" in said[0], said
    assert [e["step"] for e in read_events(run) if e["kind"] == "resume" and e["text"].startswith("resumed")] == [2]
    aside = run / "checkpoints_set_aside" / ckpts[-1].name  # passed over: set aside, kept
    assert f"{aside / shard.name}: not among" in _one_line(capsys, ["eval", str(aside)])
    # A file read on its own (trainer_state.json) is refused the same way when the marker leaves it out.
    marker = json.loads((ckpts[0] / "COMPLETE").read_text())
    del marker["files"]["trainer_state.json"]
    (ckpts[0] / "COMPLETE").write_text(json.dumps(marker))
    with pytest.raises(CheckpointCorruptError, match="trainer_state.json: not among"):
        verify_checkpoint(ckpts[0], names=["trainer_state.json"])


def test_export_refuses_nonfinite_weights_in_one_line_as_eval_does(stopped_run, tmp_path, capsys):
    """Issue 44 item 10: export wrote NaN weights into model.safetensors with exit 0 where eval refused."""
    run_dir, _ = _copy(stopped_run, tmp_path)
    cfg = stopped_run[1]
    run = setup(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_dir=str(run_dir))), resume=True)
    with torch.no_grad():  # honest digests of dishonest weights (damaged in memory before the save)
        dict(run.model.named_parameters())["layers.1.feed_forward.w1.weight"][2, 3] = float("inf")
    ckpt = save_checkpoint(run_dir, 4, run.model, run.optimizer, {**run.state_dict(), "step": 4}, keep=0)
    run.log.close()
    out = tmp_path / "hf"
    err = _one_line(capsys, ["export", str(ckpt), "--format", "hf", str(out)])
    assert err == (f"densetrain: error: {ckpt}: holds non-finite weights (layers.1.feed_forward.w1.weight): "
                   "the checkpoint is damaged"), err
    assert not out.exists() and not list(tmp_path.glob(".hf.tmp-*"))
    assert "holds non-finite weights (layers.1.feed_forward.w1.weight)" in _one_line(capsys, ["eval", str(ckpt)])
