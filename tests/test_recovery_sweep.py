"""Monitoring and fault-recovery bugs other frameworks shipped, checked on real runs (docs/training_bugs.md, third
table): Slurm's SIGUSR1 warning, the guard's window at a stage switch and across a resume, TensorBoard's step axis
after a rollback and a kill -9 (with a torn metrics.jsonl line) and its resume."""

from __future__ import annotations

import signal
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import forked
import pytest
import torch
from test_resume import OV, SLOW, finish, fresh, start, trajectory, wait_for_step

from densetrain.checkpoint import list_complete
from densetrain.cli import main
from densetrain.config import save_config
from densetrain.metrics import MetricsLogger, read_events, read_metrics
from densetrain.schedule import resolve_stages
from densetrain.train import train
from densetrain.train.preempt import EXIT_PREEMPTED
from densetrain.train.state import TrainState
from densetrain.train.step import StepResult, StepStats
from densetrain.train.watch.guard import Guard
from densetrain.train.watchers import Verdict

QUIET = {"eval.every": 0, "logging.tensorboard": False, "watchdog.every": 0, "probe.every": 0,
         "checkpoint.keep": 0}
MAIN = [{"name": "main", "start": 0.0, "mix": {"email": 0.5, "json": 0.5}}]


def _events(run: Path, kind: str) -> list[dict]:
    return [e for e in read_events(run) if e["kind"] == kind]


def test_sigusr1_stops_after_a_whole_step_with_a_checkpoint_exit_75_and_resumes_bitwise(prepared, tmp_path):
    """Slurm's ``--signal=USR1@120`` (Lightning's and submitit's requeue signal): before, its default action killed
    the run at once (exit -10), no checkpoint, the steps since the last one lost."""
    _, make = prepared
    ov = {**OV, "train.steps": 8, "checkpoint.every": 4}
    ref = make(tmp_path / "ref", **ov)
    train(ref)
    cfg = make(tmp_path / "stopped", **ov, faults=SLOW)
    run = Path(cfg.train.run_dir)
    procs = start(fresh(cfg, tmp_path))
    wait_for_step(run, 2, procs)
    procs[0].send_signal(signal.SIGUSR1)
    ((rc, err),) = finish(procs)
    assert rc == EXIT_PREEMPTED, err[-2000:]
    (ev,) = _events(run, "preempt")
    step = ev["step"]
    assert ev["values"]["signal"] == "SIGUSR1" and 2 <= step < 8
    assert list_complete(run)[-1][0] == step and sorted(trajectory(run)) == list(range(1, step + 1))
    assert err.strip().splitlines()[-1].startswith(f"densetrain: stopped by SIGUSR1 after step {step}")
    assert main(["train", "--resume", str(run)]) == 0
    assert trajectory(run) == trajectory(Path(ref.train.run_dir))


def _guard_run(cfg, tmp_path: Path):
    """What the guard reads of a one-process run (state, log, rank, a batch's provenance, stages) and the stage
    table, without a model: the losses are given."""
    info = SimpleNamespace(world_size=1, rank=0, dp_rank=0, device=torch.device("cpu"))
    stages = resolve_stages(cfg)
    run = SimpleNamespace(state=TrainState(), log=MetricsLogger(tmp_path, tensorboard=False), run_dir=tmp_path,
                          info=info, batch_documents=lambda result: {}, stages=stages)
    return run, stages


def _feed(guard: Guard, run, stages, losses: list[float]) -> list[Verdict]:
    """The loop's order for each loss: judge, commit (the step counter and the stage of the last step), after."""
    verdicts = []
    for loss in losses:
        i = run.state.step
        st = next(s for s in reversed(stages) if s.start_step <= i)
        stats = StepStats(loss_sum=loss * 256, n_tokens=256)
        result = StepResult(index=i, stage=st, lr=1e-3, loss=loss, grad_norm=1.0, stats=stats,
                            first_sample=0, data_s=0.0)
        guard.on_grads(run, stats)
        verdicts.append(guard.judge(run, result))
        run.state.step, run.state.stage = i + 1, st.name
        guard.after_step(run, result, verdicts[-1])
    return verdicts


def test_a_loss_level_shift_at_a_stage_switch_starts_a_new_window_instead_of_rolling_back(prepared, tmp_path):
    """A stage that moves the loss level on purpose (another mix: 3.0 -> 4.0, flat): before, its first three steps
    were spikes against the previous stage's window and the third rolled the run back to before the switch, and so
    again up to guard.max_rollbacks, then every step of the stage was skipped."""
    _, make = prepared
    cfg = make(tmp_path, **{"train.steps": 100, "stages": [{"name": "main", "start": 0.0},
                                                             {"name": "anneal", "start": 0.5, "mix": {"email": 1.0}}]})
    run, stages = _guard_run(cfg, tmp_path)
    assert stages[1].start_step == 50
    guard = Guard(cfg.guard, cfg.train.max_nonfinite_steps)
    flat = [3.0 + 0.01 * (k % 3) for k in range(50)]
    assert set(_feed(guard, run, stages, flat)) == {Verdict.APPLY}
    assert _feed(guard, run, stages, [4.0 + 0.01 * (k % 3) for k in range(30)]) == [Verdict.APPLY] * 30
    (ev,) = _events(tmp_path, "guard")
    assert (ev["step"], ev["action"], ev["values"]["stage"]) == (50, "new_window", "anneal")
    assert len(guard.history) == 30 and min(guard.history) == 4.0  # the window holds the new stage only
    # and a real spike in the new stage is still one, once the window holds min_history losses of it
    assert _feed(guard, run, stages, [6.0]) == [Verdict.SKIP]


def test_a_stage_re_warmup_is_waited_out_and_a_resume_keeps_the_window(prepared, tmp_path):
    """An lr re-warmup's loss bump is the lr's, not a spike; a guard restored from a checkpoint (a resume) judges
    with the window it saved, and starts a new one only at the next stage."""
    _, make = prepared
    cfg = make(tmp_path, **{"train.steps": 100, "stages": [
        {"name": "main", "start": 0.0}, {"name": "long", "start": 0.5, "rewarmup_steps": 30}]})
    run, stages = _guard_run(cfg, tmp_path)
    guard = Guard(cfg.guard, cfg.train.max_nonfinite_steps)
    _feed(guard, run, stages, [3.0 + 0.01 * (k % 3) for k in range(40)])
    resumed = Guard(cfg.guard, cfg.train.max_nonfinite_steps)  # a resume at step 40: the checkpoint's state
    resumed.load_state_dict(guard.state_dict())
    assert _feed(resumed, run, stages, [5.0]) == [Verdict.SKIP]  # judged against the saved window: a spike
    # stage 'long' from step 50: 30 steps of re-warmup whose losses rise past what min_history (20) would judge
    bump = [3.0 + 0.05 * k for k in range(30)] + [4.5 + 0.01 * (k % 3) for k in range(10)]
    assert set(_feed(resumed, run, stages, [3.0] * 9 + bump)) == {Verdict.APPLY}
    (ev,) = _events(tmp_path, "guard")
    assert ev["step"] == 50 and "loss spikes are judged again after 30 steps" in ev["text"]


def test_a_deterministic_spike_rolls_back_at_most_max_rollbacks_times_then_skips(prepared, tmp_path):
    """A loss that spikes again after every rollback (a level the data does not explain, within a stage): three
    spikes in the window roll back, guard.max_rollbacks (3) times; after that each spike is one
    skipped update with its event, never another rollback (no loop)."""
    _, make = prepared
    cfg = make(tmp_path, **{"train.steps": 200, "stages": MAIN})
    run, stages = _guard_run(cfg, tmp_path)
    guard = Guard(cfg.guard, cfg.train.max_nonfinite_steps)
    _feed(guard, run, stages, [3.0 + 0.01 * (k % 3) for k in range(30)])
    got = _feed(guard, run, stages, [9.0] * 15)  # the loop would restore the checkpoint here; the loss comes back
    assert got == [Verdict.SKIP, Verdict.SKIP, Verdict.ROLLBACK] * 3 + [Verdict.SKIP] * 6
    assert guard.rollbacks == cfg.guard.max_rollbacks == 3
    assert len(_events(tmp_path, "loss_spike")) == 12  # every skip said


def test_a_stage_switch_in_a_run_is_no_spike_and_a_spike_after_it_still_is(prepared, tmp_path):
    """The test corpus's mix switch with a RoPE base change (z 6.3 at the stage's third step against the previous
    stage's window on an AMD EPYC Zen 4, a skipped update before); a fault's spike 20 steps later is skipped."""
    _, make = prepared
    stages = [{"name": "a", "start": 0.0, "mix": {"email": 1.0}},
              {"name": "b", "start": 0.5, "mix": {"json": 1.0}, "rope_theta": 2.0}]
    cfg = make(tmp_path, **{**QUIET, "stages": stages, "train.steps": 60, "checkpoint.every": 20,
                            "optim.peak_lr": 1e-2, "guard.min_history": 8, "guard.window": 16},
               faults=[{"kind": "loss_spike", "step": 50, "factor": 10.0}])
    train(cfg)
    run = Path(cfg.train.run_dir)
    assert [(e["step"], e["values"]["stage"]) for e in _events(run, "guard")] == [(30, "b")]
    assert [(e["step"], e["action"]) for e in _events(run, "loss_spike")] == [(50, "skip")]
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"] == list(range(1, 61))


def test_tensorboard_after_a_rollback_and_a_kill_9_resume_holds_one_value_per_step(prepared, tmp_path):
    """A rollback (three spikes) and a kill -9 whose metrics.jsonl ends in a torn line, then a resume: TensorBoard's
    loss series is steps 1..N once each, increasing, with the values of metrics.jsonl's one trajectory. The kill
    fault fires once: before, the resume met it again (killing this test's process), its marker merged only when no
    fault was restored from the checkpoint, and the spikes fired before it were."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, make = prepared
    faults = [{"kind": "loss_spike", "step": s, "factor": 10.0} for s in (14, 15, 16)] + [{"kind": "kill", "step": 23}]
    cfg = make(tmp_path, **{**QUIET, "logging.tensorboard": True, "stages": MAIN, "train.steps": 26,
                            "checkpoint.every": 10, "guard.min_history": 8}, faults=faults)
    save_config(cfg, tmp_path / "c.toml")
    r = forked.run([sys.executable, "-m", "densetrain", "train", "--config", str(tmp_path / "c.toml")],
                   capture_output=True, text=True)
    run = Path(cfg.train.run_dir)
    assert r.returncode == -9, r.stderr[-2000:]
    assert [e["action"] for e in _events(run, "rollback")] == ["rollback"]
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 24, "lo')  # killed mid-line
    assert max(r["step"] for r in read_metrics(run)) == 23  # readers drop the torn line
    assert main(["train", "--resume", str(run)]) == 0
    recs = [r for r in read_metrics(run) if r["kind"] == "train"]
    assert [r["step"] for r in recs] == list(range(1, 27))
    acc = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    steps = [e.step for e in acc.Scalars("loss")]
    assert Counter(steps) == Counter(range(1, 27)) and steps == sorted(steps)
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx([r["loss"] for r in recs], rel=1e-6)


def test_a_resumed_tensorboard_writer_sorts_after_one_created_in_the_same_second(tmp_path):
    """TensorBoard reads event files in name order, and a name starts with the writer's creation second: a writer
    of the second not yet over (another process, a higher pid) sorted after the resumed one, whose steps its data
    then purged (seen on a rollback, a kill and a resume within one second). The file is named as such a writer's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLogger(tmp_path)
    for step in range(1, 7):
        log.log(step, {"loss": float(step)})
    log.close()
    (first,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    parts = first.name.split(".")
    parts[3] = str(int(time.time()) + 1)  # created by a writer within this second or the next one
    first.rename(first.with_name(".".join(parts)))
    log = MetricsLogger(tmp_path, resume_step=3)  # the resumed run redoes steps 4..6
    for step in range(4, 7):
        log.log(step, {"loss": 10.0 + step})
    log.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0), (5, 15.0),
                                                                 (6, 16.0)]


@pytest.mark.parametrize("rollback", [True, False])
def test_nan_streak_on_one_rank_rolls_back_or_stops_every_rank_at_the_same_step(prepared, tmp_path, rollback):
    """Rank 1's gradient is NaN at steps 5 and 6 (train.max_nonfinite_steps 2), rank 0's never: both ranks skip step
    5 and roll back at step 6 to the checkpoint of step 4, then finish; with rollbacks off both stop there with the
    same one line (exit 2, a TrainError), none waits in a collective for the other (parallel.timeout_s 60 is never
    reached)."""
    _, make = prepared
    faults = [{"kind": "nan_grad", "step": s, "rank": 1} for s in (5, 6)]
    cfg = make(tmp_path, **{**QUIET, "stages": MAIN, "train.steps": 8, "checkpoint.every": 4,
                            "train.max_nonfinite_steps": 2, "guard.rollback": rollback, "parallel.timeout_s": 60},
               faults=faults)
    save_config(cfg, tmp_path / "c.toml")
    procs = start(["--config", str(tmp_path / "c.toml")], world=2)
    results = finish(procs)
    run = Path(cfg.train.run_dir)
    assert [e["step"] for e in _events(run, "nonfinite")] == [5]
    if rollback:
        assert [rc for rc, _ in results] == [0, 0], [err[-2000:] for _, err in results]
        ((rb,)) = _events(run, "rollback")
        assert (rb["step"], rb["values"]["from_step"], rb["values"]["trouble_since"]) == (4, 6, 5)
        assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"] == list(range(1, 9))
    else:
        assert [rc for rc, _ in results] == [2, 2], [err[-2000:] for _, err in results]
        for r, (_, err) in enumerate(results):
            assert err.strip().splitlines()[-1] == (
                f"densetrain: error: [rank {r}] 2 consecutive non-finite steps (last at step 6): the weights or the "
                "lr are broken; rollbacks are off (guard.rollback = false); resume from an earlier checkpoint with a "
                "lower optim.peak_lr"), err[-2000:]
