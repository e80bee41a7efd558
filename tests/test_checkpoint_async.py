"""Asynchronous checkpoints (``checkpoint.async_save``): DCP's async_save writes in the background while
training goes on, the saved tensors are the saved step's, the marker comes only after the write, a
failed background write is one CheckpointError line, a kill -9 during the write resumes from the
previous checkpoint, and a 2-rank FSDP2 run with async saves resumes on the uninterrupted trajectory."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import forked
import pytest
import torch

from densetrain.checkpoint import Checkpointer, CheckpointError, list_complete, load_checkpoint, save_checkpoint
from densetrain.config import load_config, save_config
from densetrain.metrics import MetricsLogger, read_events, read_metrics
from densetrain.model.init import build_model
from densetrain.optim import build_optimizer
from densetrain.train import train

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_parallel_train import assert_same_losses, launch, losses, resume_copy  # noqa: E402

MAIN = [{"name": "main", "start": 0.0, "mix": {"email": 0.5, "json": 0.5}}]
QUIET = {"eval.every": 0, "logging.tensorboard": False, "stages": MAIN, "watchdog.every": 0, "probe.every": 0}


def _model(d_model: int = 256, n_layers: int = 4, vocab: int = 8192):
    """A model of ~7.3M parameters (88 MB of weights and Adam moments): its write takes far longer than
    one of its steps on a CPU, so steps visibly run while the write does."""
    cfg = load_config("tiny", overrides=[("model.vocab_size", vocab), ("model.d_model", d_model),
                                         ("model.n_layers", n_layers), ("model.n_heads", 4), ("model.n_kv_heads", 2),
                                         ("model.d_ff", 3 * d_model)])
    model = build_model(cfg.model, cfg.train.seed)
    opt = build_optimizer(model, cfg)
    for g in opt.param_groups:
        g["lr"] = 1e-2
    return cfg, model, opt


def _step(model, opt, seed: int) -> None:
    x = torch.randint(0, model.tok_embeddings.num_embeddings, (2, 16), generator=torch.Generator().manual_seed(seed))
    model(x).logsumexp(-1).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _events(run: Path, kind: str = "checkpoint") -> list[dict]:
    return [e for e in read_events(run) if e["kind"] == kind]


def test_training_continues_during_the_write_and_the_checkpoint_holds_the_step_weights(tmp_path):
    cfg, model, opt = _model()
    log = MetricsLogger(tmp_path, tensorboard=False)
    ck = Checkpointer(tmp_path, every=2, keep=0, last_step=100, async_save=True)
    captured = None
    step = 0
    while step < 40 and (captured is None or ck.pending is not None):
        ck.poll(log)  # where the loop polls: before each step
        _step(model, opt, step)
        step += 1
        if ck.due(step) and captured is None:
            captured = {k: v.clone() for k, v in model.state_dict().items()}
            captured_opt = {k: {n: t.clone() for n, t in s.items()} for k, s in opt.state_dict()["state"].items()}
            ck.save_if_due(step, model, opt, {"step": step}, True, log)
            saved_at = step
            assert not (tmp_path / "checkpoints" / f"step_{step:08d}").exists()  # no marker, no rename yet
    log.close()
    (written,) = [e for e in _events(tmp_path) if e["action"] == "written"]
    # Steps ran (and changed the weights) while the write was in flight, and before the checkpoint existed.
    assert written["values"]["steps_during_write"] >= 1 and step > saved_at, written
    assert [s for s, _ in list_complete(tmp_path)] == [saved_at]
    assert any(not torch.equal(captured[k], v) for k, v in model.state_dict().items())
    _, fresh, fresh_opt = _model()
    state = load_checkpoint(list_complete(tmp_path)[0][1], fresh, fresh_opt)
    assert state == {"step": saved_at}
    for k, v in captured.items():  # the weights of the saved step, not of a later one
        assert torch.equal(fresh.state_dict()[k], v), k
    got = fresh_opt.state_dict()["state"]
    for k, s in captured_opt.items():
        for n, t in s.items():
            assert torch.equal(got[k][n], t), (k, n)


def test_at_most_one_save_in_flight(tmp_path):
    _, model, opt = _model(d_model=64, n_layers=2, vocab=512)
    log = MetricsLogger(tmp_path, tensorboard=False)
    ck = Checkpointer(tmp_path, every=1, keep=2, last_step=3, async_save=True)
    for step in (1, 2, 3):
        _step(model, opt, step)
        ck.save_if_due(step, model, opt, {"step": step}, True, log)  # waits for the previous save first
        assert ck.pending.step == step
        assert [s for s, _ in list_complete(tmp_path)] == list(range(max(1, step - 2), step))
    ck.finish_pending(log)
    log.close()
    assert [s for s, _ in list_complete(tmp_path)] == [2, 3]  # retention ran after each write
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002", "step_00000003"]


def test_failed_background_write_is_one_line_and_keeps_the_previous_checkpoint(tmpfs, tmp_path):
    _, model, opt = _model(d_model=32, n_layers=2, vocab=300)  # ~0.6 MB of shards: more than is left
    save_checkpoint(tmpfs, 1, model, opt, {"step": 1}, keep=3)
    with open(tmpfs / "filler", "wb") as f:  # fill the file system ...
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass
    os.truncate(tmpfs / "filler", os.path.getsize(tmpfs / "filler") - 100_000)  # ... but for what the start needs
    log = MetricsLogger(tmp_path, tensorboard=False)
    ck = Checkpointer(tmpfs, every=1, keep=3, last_step=2, async_save=True)
    _step(model, opt, 2)
    ck.save_if_due(2, model, opt, {"step": 2}, True, log)
    assert ck.pending.error == "" and (tmpfs / "checkpoints" / "step_00000002.tmp").is_dir()  # the start worked
    with pytest.raises(CheckpointError) as e:
        ck.finish_pending(log)  # the background write ran out of space
    msg = str(e.value)
    assert "\n" not in msg and "step_00000002.tmp" in msg and "No space left on device" in msg, msg
    assert [s for s, _ in list_complete(tmpfs)] == [1] and ck.pending is None
    assert sorted(p.name for p in (tmpfs / "checkpoints").iterdir()) == ["step_00000001"]
    _, fresh, fresh_opt = _model(d_model=32, n_layers=2, vocab=300)
    assert load_checkpoint(list_complete(tmpfs)[0][1], fresh, fresh_opt) == {"step": 1}


def test_async_run_equals_the_synchronous_run(prepared, tmp_path):
    _, make = prepared
    ov = {**QUIET, "train.steps": 8, "checkpoint.every": 4, "checkpoint.keep": 0}
    sync_cfg = make(tmp_path / "sync", **ov)
    async_cfg = make(tmp_path / "async", **ov, **{"checkpoint.async_save": True})
    train(sync_cfg)
    train(async_cfg)
    a, b = Path(sync_cfg.train.run_dir), Path(async_cfg.train.run_dir)
    assert losses(b) == losses(a)  # bitwise: saving in the background changes nothing in the math
    assert [s for s, _ in list_complete(b)] == [4, 8]
    assert [e["action"] for e in _events(b)] == ["staged", "written"] * 2
    for step in (4, 8):  # the same tensors, trainer state and RNG as the synchronous checkpoint of that step
        pa, pb = a / "checkpoints" / f"step_{step:08d}", b / "checkpoints" / f"step_{step:08d}"
        for name in ("trainer_state.json", "rng_0.json"):
            assert json.loads((pa / name).read_text()) == json.loads((pb / name).read_text()), (step, name)
        ma, mb = build_model(sync_cfg.model, 1), build_model(sync_cfg.model, 2)
        load_checkpoint(pa, ma, None)
        load_checkpoint(pb, mb, None)
        for (n, x), y in zip(ma.state_dict().items(), mb.state_dict().values(), strict=True):
            assert torch.equal(x, y), (step, n)


def test_kill_during_async_write_resumes_from_the_previous_checkpoint(prepared, tmp_path):
    _, make = prepared
    ov = {**QUIET, "train.steps": 12, "checkpoint.every": 5, "checkpoint.async_save": True}
    # Killed at update 9, while the background thread writes the step-10 checkpoint.
    cfg = make(tmp_path / "killed", **ov, faults=[{"kind": "kill", "step": 9, "during_checkpoint": True}])
    cfg_path = tmp_path / "killed.toml"
    save_config(cfg, cfg_path)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = forked.run([sys.executable, "-m", "densetrain", "train", "--config", str(cfg_path)], capture_output=True,
                   text=True, env=env)
    run = Path(cfg.train.run_dir)
    assert r.returncode == -9, r.stderr[-2000:]
    assert [s for s, _ in list_complete(run)] == [5]
    assert (run / "checkpoints" / "step_00000010.tmp").is_dir()  # the write was cut off: no marker, no rename
    assert [e["action"] for e in _events(run)] == ["staged", "written"]  # step 5's; step 10's never finished
    (fault,) = _events(run, "fault")
    assert "during the checkpoint write" in fault["text"]
    r = forked.run([sys.executable, "-m", "densetrain", "train", "--resume", str(run)], capture_output=True,
                   text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from" in r.stdout + r.stderr and "step_00000005" in r.stdout + r.stderr
    train(make(tmp_path / "clean", **ov))
    got, ref = losses(run), losses(tmp_path / "clean" / "run")
    assert sorted(got) == list(range(1, 13))
    assert [got[s][0] for s in sorted(got)] == pytest.approx([ref[s][0] for s in sorted(ref)], rel=1e-6)
    assert [s for s, _ in list_complete(run)] == [10, 12] and not (run / "checkpoints" / "step_00000010.tmp").exists()


def test_two_rank_fsdp2_async_run_resumes_on_the_uninterrupted_trajectory(prepared, tmp_path):
    _, make = prepared
    ov = {**QUIET, "train.steps": 8, "checkpoint.every": 4, "checkpoint.keep": 0, "model.tie_embeddings": True}
    single = make(tmp_path / "single", **ov)
    train(single)
    want = losses(single.train.run_dir)
    par = make(tmp_path / "par", **ov, **{"parallel.dp_replicate": 1, "parallel.dp_shard": 2,
                                          "checkpoint.async_save": True})

    def run_ranks(cfg, name: str, resume: bool = False) -> None:
        path = tmp_path / f"{name}.toml"
        save_config(cfg, path)
        # --resume reads the run's own config.toml (async_save and dp_shard 2 included); --config with it is refused
        res = launch(["train", "--resume", cfg.train.run_dir] if resume else ["train", "--config", str(path)])
        assert all(r.returncode == 0 for r in res), "\n".join(r.stderr[-3000:] for r in res)

    run_ranks(par, "par")
    run_dir = Path(par.train.run_dir)
    assert_same_losses(losses(run_dir), want, range(1, 9))
    assert [s for s, _ in list_complete(run_dir)] == [4, 8]
    assert [e["action"] for e in _events(run_dir)] == ["staged", "written"] * 2
    # Resume the async step-4 checkpoint on 2 ranks (async again): the losses of the uninterrupted run.
    resumed = resume_copy(run_dir, tmp_path / "resumed")
    rcfg = make(tmp_path / "rcfg", **ov, **{"train.run_dir": str(resumed), "parallel.dp_replicate": 1,
                                            "parallel.dp_shard": 2, "checkpoint.async_save": True})
    run_ranks(rcfg, "resumed", resume=True)
    assert_same_losses(losses(resumed), want, range(5, 9))
    assert [r["step"] for r in read_metrics(resumed) if r["kind"] == "train"] == list(range(1, 9))


def test_a_save_abandoned_by_an_error_is_said_once(tmp_path):
    # A peer rank killed while a save is in flight: the run leaves on the error and deletes the save's partial
    # step_N.tmp; said in one event, as a resume says the partial saves it passes over (before: without a word)
    _, model, opt = _model(d_model=64, n_layers=2, vocab=512)
    log = MetricsLogger(tmp_path, tensorboard=False)
    ck = Checkpointer(tmp_path, every=1, keep=0, last_step=3, async_save=True)
    _step(model, opt, 1)
    ck.save_if_due(1, model, opt, {"step": 1}, True, log)
    tmp = ck.pending.tmp
    ck.abandon_pending(log)
    ck.abandon_pending(log)  # nothing in flight any more: nothing more to say
    log.close()
    assert not tmp.exists() and list_complete(tmp_path) == []
    (ev,) = [e for e in _events(tmp_path) if e["action"] == "pass_over"]
    assert ev["step"] == 1 and f"deleting its partial {tmp}" in ev["text"]
