"""Stopping and resuming real runs started like the CLI (one process, and two gloo ranks as torchrun starts them).

- Preemption: SIGTERM at a random step stops after a whole step with its checkpoint and exit status 75,
  and the resumed run's losses and grad norms equal the uninterrupted run's bit for bit (fp32, same
  machine), no step lost or repeated; only one rank needs the signal; a second signal exits at once.
- Ends of runs: a run stopped between its final checkpoint and summary.json gets its summary on
  --resume; --resume of a run that never saved its config says to start it again; under torchrun only
  rank 0 prints the summary.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import forked
import pytest
from conftest import gloo_env

from densetrain.checkpoint import list_complete
from densetrain.cli import main
from densetrain.config import save_config
from densetrain.metrics import read_events, read_metrics
from densetrain.train import train
from densetrain.train.preempt import EXIT_PREEMPTED

ROOT = Path(__file__).resolve().parents[1]
# Three stages (a seq_len switch included); a fault that only sleeps makes each step long enough to be hit.
# On the CPU (bitwise repeatable; CUDA's atomics in the embedding backward are not).
OV = {"train.steps": 16, "checkpoint.every": 5, "checkpoint.keep": 0, "eval.every": 0, "logging.tensorboard": False,
      "watchdog.every": 0, "probe.every": 0, "train.device": "cpu"}
SLOW = [{"kind": "slow_rank", "step": 0, "rank": 0, "ms": 250}]  # >= 0.75 s left after the signal, even under load


def start(argv: list[str], world: int = 1) -> list[subprocess.Popen]:
    """``python -m densetrain train ARGV`` as ``world`` processes (gloo ranks, as torchrun starts them, when > 1)."""
    env = {**(gloo_env(world) if world > 1 else os.environ), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return [forked.Popen([sys.executable, "-m", "densetrain", "train", *argv], cwd=ROOT,
                         env={**env, "RANK": str(r), "LOCAL_RANK": str(r)} if world > 1 else env, text=True,
                         stdout=forked.PIPE, stderr=forked.PIPE) for r in range(world)]


def fresh(cfg, tmp: Path) -> list[str]:
    """The arguments of a fresh run of ``cfg``: ``--config FILE``."""
    path = tmp / f"{Path(cfg.train.run_dir).parent.name}.toml"
    save_config(cfg, path)
    return ["--config", str(path)]


def wait_for_step(run: Path, step: int, procs, timeout: float = 120) -> None:
    """Until rank 0 has logged ``step`` (the run is then at that step's stop check, or inside a later step)."""
    t0 = time.monotonic()
    while not any(r["kind"] == "train" and r["step"] >= step for r in read_metrics(run)):
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        assert time.monotonic() - t0 < timeout
        time.sleep(0.02)


def finish(procs) -> list[tuple[int, str]]:
    """(exit status, stderr) of each process; stdout kept in ``p.out``."""
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (o, _) in zip(procs, outs):
        p.out = o
    return [(p.returncode, e) for p, (_, e) in zip(procs, outs)]


def trajectory(run: Path) -> dict[int, tuple]:
    recs = [r for r in read_metrics(run) if r["kind"] == "train"]
    assert sorted(r["step"] for r in recs) == [r["step"] for r in recs]  # one record per step, in order
    return {r["step"]: (r["loss"], r["grad_norm"], r["sample_index"], r["lr"]) for r in recs}


def check_stopped(run: Path, procs, results, at_least: int) -> int:
    """Every rank exited 75 after one whole step with its checkpoint and the event; returns that step."""
    assert [rc for rc, _ in results] == [EXIT_PREEMPTED] * len(results), [err[-3000:] for _, err in results]
    (ev,) = [e for e in read_events(run) if e["kind"] == "preempt"]
    step = ev["step"]
    assert step >= at_least and ev["values"]["signal"] == "SIGTERM"
    assert ev["values"]["checkpoint"] == f"step_{step:08d}" and list_complete(run)[-1][0] == step
    assert sorted(trajectory(run)) == list(range(1, step + 1))  # every step taken is logged and checkpointed
    last = results[0][1].strip().splitlines()[-1]
    assert last == f"densetrain: stopped by SIGTERM after step {step} (checkpoint step_{step:08d} written); " \
                   f"continue with: densetrain train --resume {run}", results[0][1][-2000:]
    # That line once in all the output (stdout and stderr of every rank): rank 0's stderr.
    said = [(p.out + err).count("continue with: densetrain train --resume") for p, (_, err) in zip(procs, results)]
    assert said == [1] + [0] * (len(procs) - 1), said
    return step


def test_sigterm_at_a_random_step_resumes_bitwise(prepared, tmp_path):
    _, make = prepared
    ref = make(tmp_path / "ref", **OV)
    train(ref)
    want = trajectory(Path(ref.train.run_dir))

    # With an async save possibly in flight when the signal comes (the stop waits for it).
    cfg = make(tmp_path / "stopped", **{**OV, "checkpoint.async_save": True}, faults=SLOW)
    run = Path(cfg.train.run_dir)
    k = random.Random().randint(2, 13)
    procs = start(fresh(cfg, tmp_path))
    wait_for_step(run, k, procs)
    procs[0].send_signal(signal.SIGTERM)
    step = check_stopped(run, procs, finish(procs), k)
    assert main(["train", "--resume", str(run)]) == 0  # the plain command
    assert trajectory(run) == want, f"signal after step {k}, stopped at {step}"


@pytest.fixture(scope="module")
def fsdp_run(prepared, tmp_path_factory):
    """(config overrides, run dir) of an uninterrupted 2-rank FSDP2 run, a checkpoint every 2 of its 8 steps."""
    _, make = prepared
    tmp = tmp_path_factory.mktemp("fsdp")
    ov = {**OV, "train.steps": 8, "checkpoint.every": 2, "parallel.dp_replicate": 1, "parallel.dp_shard": 2}
    cfg = make(tmp, **ov)
    res = finish(start(fresh(cfg, tmp), world=2))
    assert [rc for rc, _ in res] == [0, 0], [err[-3000:] for _, err in res]
    return ov, Path(cfg.train.run_dir)


def test_sigterm_on_one_of_two_ranks_stops_both_and_resumes_bitwise(prepared, fsdp_run, tmp_path):
    _, make = prepared
    ov, ref = fsdp_run
    want = trajectory(ref)
    cfg = make(tmp_path / "stopped", **ov, faults=SLOW)
    run = Path(cfg.train.run_dir)
    k = random.Random().randint(2, 5)
    procs = start(fresh(cfg, tmp_path), world=2)
    wait_for_step(run, k, procs)
    procs[1].send_signal(signal.SIGTERM)  # only rank 1 is told: the step-boundary all-reduce tells rank 0
    step = check_stopped(run, procs, finish(procs), k)
    procs = start(["--resume", str(run)], world=2)
    resumed = finish(procs)
    assert [rc for rc, _ in resumed] == [0, 0], [err[-3000:] for _, err in resumed]
    assert trajectory(run) == want, f"signal after step {k}, stopped at {step}"
    # The summary is printed once, by rank 0.
    assert f"done: {ov['train.steps']} steps" in procs[0].out, procs[0].out[-2000:]
    assert "done: " not in procs[1].out, procs[1].out[-2000:]


def test_second_signal_exits_at_once(prepared, tmp_path):
    _, make = prepared
    # Steps of ~3 s: the graceful path would need the rest of the step and a checkpoint.
    cfg = make(tmp_path / "twice", **OV, faults=[{"kind": "slow_rank", "step": 0, "rank": 0, "ms": 3000}])
    run = Path(cfg.train.run_dir)
    procs = start(fresh(cfg, tmp_path))
    wait_for_step(run, 1, procs)
    # Step 1's record is written before the loop's stop check for step 1: a signal in that window stops the run
    # gracefully after step 1 (a fresh-clone CI run hit it). 0.5 s later the run is inside step 2's sleep.
    time.sleep(0.5)
    procs[0].send_signal(signal.SIGINT)
    time.sleep(0.3)
    procs[0].send_signal(signal.SIGINT)
    rc, err = finish(procs)[0]
    # killed by it (status 130 in a shell), not the graceful exit 75 after the step (and no time bound: how fast
    # a process dies is the machine's load)
    assert rc == -signal.SIGINT, err[-2000:]
    assert "SIGINT received: finishing the current step" in err
    assert not [e for e in read_events(run) if e["kind"] == "preempt"]
    assert [s for s, _ in list_complete(run)] == []  # nothing was saved after the second signal


def test_resume_of_a_run_stopped_before_its_first_checkpoint_says_it_starts_over(prepared, tmp_path):
    """A run killed before its first checkpoint (e.g. by a second signal) has a config.toml and no checkpoint:
    --resume starts it from step 0, and says so (console and events.jsonl) instead of silently."""
    _, make = prepared
    cfg = make(tmp_path / "early", **{**OV, "train.steps": 4})
    run = Path(cfg.train.run_dir)
    run.mkdir(parents=True)
    save_config(cfg, run / "config.toml")
    assert train(cfg, resume=True)["steps"] == 4
    said = [e for e in read_events(run) if e["kind"] == "resume"]
    assert [(e["step"], e["text"]) for e in said] == [(0, f"{run}: no checkpoint yet, so --resume starts the run "
                                                          "from step 0")]


def test_resume_after_a_stop_between_final_checkpoint_and_summary_writes_the_summary(prepared, tmp_path, capsys):
    _, make = prepared
    cfg = make(tmp_path / "done", **{**OV, "train.steps": 8, "eval.every": 4})
    want = train(cfg)
    run = Path(cfg.train.run_dir)
    # What a kill during the final evaluation leaves: the final checkpoint, no summary.json.
    (run / "summary.json").unlink()
    assert list_complete(run)[-1][0] == 8
    assert main(["train", "--resume", str(run)]) == 0
    got = json.loads((run / "summary.json").read_text())
    assert set(got) == set(want) and "val" in got
    assert {k: v for k, v in got.items() if k != "wall_s"} == {k: v for k, v in want.items() if k != "wall_s"}
    assert main(["train", "--resume", str(run)]) == 0  # now complete with its summary: nothing to do
    assert "run already complete (8 steps); nothing to do" in capsys.readouterr().out


def test_resume_of_a_run_without_config_says_to_start_it_again(tmp_path, capsys):
    for run in (tmp_path / "never_started", tmp_path / "killed_in_start_up"):
        if run.name.startswith("killed"):
            run.mkdir()  # the run directory is made just before its config.toml is written
        assert main(["train", "--resume", str(run)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"densetrain: error: {run}: no "), err
        assert err[0].endswith(f"start it again with the command that started it, e.g. densetrain train "
                               f"--preset NAME --train.run_dir {run}")


def copy_until(src: Path, dst: Path, step: int) -> Path:
    """A copy of run dir ``src`` as it was after the checkpoint of ``step`` (later checkpoints removed)."""
    shutil.copytree(src, dst)
    for s, path in list_complete(dst):
        if s > step:
            shutil.rmtree(path)
    (dst / "summary.json").unlink(missing_ok=True)
    return dst


def assert_close(got: dict, want: dict, steps) -> None:
    """Losses and grad norms across world sizes: equal to fp32 reduction-order noise."""
    for s in steps:
        assert got[s][0] == pytest.approx(want[s][0], rel=1e-5), (s, got[s], want[s])
        assert got[s][1] == pytest.approx(want[s][1], rel=1e-4), (s, got[s], want[s])
        assert got[s][2:] == want[s][2:]  # the same samples at the same lr


def layout_events(run: Path) -> list[dict]:
    return [e for e in read_events(run) if e["kind"] == "layout"]


def test_plain_resume_at_another_world_size_keeps_the_layout_intent(fsdp_run, tmp_path, capsys):
    _, ref = fsdp_run
    want = trajectory(ref)
    # 2 FSDP2 ranks -> 1 process: dp_shard=2 cannot hold on 1, the one layout of 1 process is chosen and said.
    one = copy_until(ref, tmp_path / "one", 2)
    assert main(["train", "--resume", str(one)]) == 0
    line = ("layout on 1 process(es): dp_replicate=1 dp_shard=1 tp=1: one process, no parallelism (checkpoint "
            "written on 2 process(es) as dp_replicate=1 dp_shard=2 tp=1: FSDP2: fully_shard over 2 data-parallel "
            "ranks); the configured dp_replicate=1 dp_shard=2 tp=1 does not fit 1 process(es): the layout closest "
            "to it that runs")
    assert [e["text"] for e in layout_events(one)] == [line]
    assert f"[step 2] {line}" in capsys.readouterr().out
    assert_close(trajectory(one), want, range(3, 9))
    # ... and that run's 1-process checkpoint -> 2 ranks: config.toml still says dp_shard=2, so FSDP2 again.
    two = copy_until(one, tmp_path / "two", 6)
    procs = start(["--resume", str(two)], world=2)
    res = finish(procs)
    assert [rc for rc, _ in res] == [0, 0], [err[-3000:] for _, err in res]
    line = ("layout on 2 process(es): dp_replicate=1 dp_shard=2 tp=1: FSDP2: fully_shard over 2 data-parallel "
            "ranks (checkpoint written on 1 process(es) as dp_replicate=1 dp_shard=1 tp=1: one process, no "
            "parallelism); the configured dp_replicate=1 dp_shard=2 tp=1")
    assert [e["text"] for e in layout_events(two)][-1] == line
    assert f"[step 6] {line}" in procs[0].out
    assert_close(trajectory(two), want, range(7, 9))


def test_under_torchrun_the_lines_said_once_come_from_rank_0_only(fsdp_run, tmp_path, monkeypatch):
    """A 2-rank resume whose newest checkpoint is torn (a truncated shard), in bf16 where inductor has no
    compiler (CXX names none): the warning that falls back to the older checkpoint and the one that falls
    back to eager cross-entropy are each printed once in all the output, by rank 0 (before: by each rank)."""
    _, ref = fsdp_run
    run = copy_until(ref, tmp_path / "run", 8)
    shard = next((run / "checkpoints" / "step_00000008").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # no kernel compiled elsewhere
    procs = start(["--resume", str(run), "--train.dtype=bf16"], world=2)
    res = finish(procs)
    assert [rc for rc, _ in res] == [0, 0], [err[-3000:] for _, err in res]
    assert [e["step"] for e in read_events(run) if e["kind"] == "resume"][-1] == 6  # the fallback happened
    for line in ("densetrain: warning: cannot load", "compiled cross-entropy unavailable"):
        said = [(p.out + err).count(line) for p, (_, err) in zip(procs, res)]
        assert said == [1, 0], (line, said, procs[1].out[-2000:])


def test_resume_where_no_layout_keeps_the_intent_names_the_flags_that_would(prepared, tmp_path, monkeypatch, capsys):
    _, make = prepared
    # A batch of 2 sequences in micro-batches of 2 does not split over 2 data-parallel ranks; tensor parallel 2 runs it.
    cfg = make(tmp_path, **{**OV, "train.batch_size": 2, "stages": [{"name": "main", "start": 0.0}]})
    run = Path(cfg.train.run_dir)
    run.mkdir()
    save_config(cfg, run / "config.toml")
    monkeypatch.setenv("WORLD_SIZE", "2")  # the error comes before any process group is made
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["densetrain: error: [rank 0] parallel: no layout of 2 processes keeps the run's intent (DDP: "
                   "data-parallel ranks hold replicas; configured dp_replicate=-1 dp_shard=1 tp=1) and runs every "
                   "stage; add to --resume one of: --parallel.dp_replicate=1 --parallel.dp_shard=1 --parallel.tp=2 "
                   "(see densetrain train --help)"]


@pytest.mark.parametrize("given,world,want", [
    ((1, 2, 1), 1, (1, 1, 1)), ((1, 2, 1), 4, (1, 4, 1)), ((-1, 1, 1), 3, (3, 1, 1)), ((1, 1, 1), 2, (2, 1, 1)),
    ((-1, 8, 1), 32, (4, 8, 1)), ((8, 8, 1), 16, (2, 8, 1)), ((8, 8, 1), 4, (1, 4, 1)), ((4, -1, 1), 8, (4, 2, 1)),
    ((1, 2, 2), 2, (1, 1, 2)), ((1, 1, 4), 2, (1, 1, 2)), ((2, 1, 2), 6, (3, 1, 2)),
])
def test_layouts_that_keep_the_intent(given, world, want):
    from densetrain.parallel.mesh import Layout, keep_intent

    assert keep_intent(*given, world, lambda lay: True) == Layout(*want)


@pytest.mark.parametrize("given,cp,world,want", [
    ((1, -1, 1), 2, 4, (1, 2, 1, 2)),   # the context-parallel degree is kept: it is what fits the long stage
    ((1, 2, 1), 2, 2, (1, 1, 1, 2)),    # fewer ranks: sharding gives way before cp does
    ((1, 2, 1), 2, 1, (1, 1, 1, 1)),    # one process: no cp left
    ((1, 1, 2), 2, 6, (3, 1, 1, 2)),    # tp 2 x cp 2 cannot divide 6: cp is kept, tp gives way
])
def test_layouts_that_keep_the_context_parallel_intent(given, cp, world, want):
    from densetrain.parallel.mesh import Layout, keep_intent

    assert keep_intent(*given, world, lambda lay: True, cp=cp) == Layout(*want)


def test_plan_and_dry_run_take_parallel_overrides(capsys, monkeypatch):
    assert main(["plan", "--preset", "tiny", "--gpus", "4", "--gpu-memory-gib", "80", "--parallel.dp_replicate=1",
                 "--parallel.dp_shard=2", "--parallel.tp=2"]) == 0
    out = capsys.readouterr().out  # each stage judged on its configured layout (tools/plan/verdict.py)
    assert "configured layout of stage 'long_context' ([parallel], dp_replicate=1 dp_shard=2 tp=2): runs" in out
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", "--dry-run", "--parallel.dp_replicate=1", "--parallel.tp=2"]) == 2  # one process: refused
    assert ("\nconfigured layout: does NOT run: stage 'long_context' ([parallel]): parallel: tp 2 = 2 processes per "
            "model replica does not divide 1 process") in capsys.readouterr().out
    assert main(["plan", "--flops", "1e20", "--parallel.tp=2"]) == 2  # the Chinchilla plan has no layout


def test_a_second_trainer_on_a_running_run_is_refused_and_a_signal_in_the_last_step_still_exits_75(
        prepared, tmp_path, capsys):
    """Found by a new user: a second `--resume` of a run that is still training interleaved its steps with
    the first's (metrics.jsonl lost steps 13-40); and a SIGTERM during the final step printed the promise
    of exit 75 but ran the final evaluations and exited 0."""
    _, make = prepared
    # The last of 4 steps takes >= 3 s: the signal comes inside it.
    cfg = make(tmp_path / "busy", **{**OV, "train.steps": 4, "checkpoint.every": 2},
               faults=[{"kind": "slow_rank", "step": 3, "rank": 0, "ms": 3000}])
    run = Path(cfg.train.run_dir)
    procs = start(fresh(cfg, tmp_path))
    wait_for_step(run, 3, procs)
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"densetrain: error: {run} is being trained by another process (pid {procs[0].pid}); wait for "
                   "it to end or stop it before resuming"]
    procs[0].send_signal(signal.SIGTERM)
    ((rc, stderr),) = finish(procs)
    assert rc == EXIT_PREEMPTED, stderr[-2000:]
    assert list_complete(run)[-1][0] == 4 and not (run / "summary.json").exists()  # the final evals not run
    assert main(["train", "--resume", str(run)]) == 0  # the lock went with the process; --resume completes it
    assert (run / "summary.json").exists()


def test_resume_with_another_train_steps_says_the_schedule_is_recomputed(prepared, tmp_path):
    """A finished 4-step run resumed with train.steps=6: the cosine curve is recomputed over 6 steps, so step 5's
    lr rises above the min_lr step 4 ended at. That used to happen without a word; now an event says it."""
    _, make = prepared
    cfg = make(tmp_path / "r", **{**OV, "train.steps": 4, "checkpoint.every": 4})
    train(cfg)
    run = Path(cfg.train.run_dir)
    longer = make(tmp_path / "r", **{**OV, "train.steps": 6, "checkpoint.every": 4})
    train(longer, resume=True)
    lrs = {r["step"]: r["lr"] for r in read_metrics(run) if r["kind"] == "train"}
    assert lrs[5] > lrs[4]
    said = [e["text"] for e in read_events(run) if "train.steps changed" in e["text"]]
    assert said == ["WARNING: train.steps changed from 4 to 6 on resume: the lr schedule and the stage starts are "
                    "recomputed over 6 steps from step 4"]


def test_resume_with_dtype_auto_keeps_the_dtype_the_run_was_trained_in(prepared, tmp_path):
    """train.dtype = 'auto' is measured per process; a resume on a CPU near the bf16 threshold, or on another
    CPU, must not switch the run's precision mid-way. A run trained for 3 steps in the dtype 'auto' does NOT
    pick on this CPU (fp32 where auto is bf16, as on CI's Zen 4; bf16 where auto is fp32), resumed with 'auto',
    continues in it: its 6 steps equal an uninterrupted run's in that dtype bit for bit, an event says why, the
    saved config.toml keeps 'auto', and the offline eval of its checkpoint with 'auto' is the one in that dtype."""
    import torch

    from densetrain.checkpoint import read_trainer_state
    from densetrain.config import load_config
    from densetrain.model.precision import resolve_dtype
    from densetrain.tools.offline_eval import evaluate_checkpoint
    from densetrain.train.rundir import keep_started_dtype

    other = resolve_dtype("auto", torch.device("cpu"))
    started = "fp32" if other == "bf16" else "bf16"
    _, make = prepared
    ov = {**OV, "train.steps": 6, "checkpoint.every": 3, "train.dtype": started, "stages": [
        {"name": "main", "start": 0.0, "mix": {"email": 0.5, "json": 0.5}}]}
    ref = make(tmp_path / "ref", **ov)
    train(ref)
    cfg = make(tmp_path / "r", **ov)
    train(cfg, stop_after=3)
    run = Path(cfg.train.run_dir)
    assert read_trainer_state(list_complete(run)[-1][1])["dtype"] == started
    train(make(tmp_path / "r", **{**ov, "train.dtype": "auto"}), resume=True)
    assert trajectory(run) == trajectory(Path(ref.train.run_dir))
    assert read_trainer_state(list_complete(run)[-1][1])["dtype"] == started
    said = [e["text"] for e in read_events(run) if e["text"].startswith("train.dtype=auto")]
    assert said == [f"train.dtype=auto: {started}, the dtype of checkpoint step_00000003 (a resumed run keeps its "
                    "precision; set train.dtype to change it)"]
    assert load_config(path=run / "config.toml").train.dtype == "auto"
    # The offline eval of a checkpoint follows it too: 'auto' evaluates in the dtype the run trained in.
    auto = evaluate_checkpoint(make(tmp_path / "r", **{**ov, "train.dtype": "auto"}), run)["val"]
    assert auto == evaluate_checkpoint(make(tmp_path / "r", **ov), run)["val"]
    assert auto != evaluate_checkpoint(make(tmp_path / "r", **{**ov, "train.dtype": other}), run)["val"]
    # An unreadable newest trainer_state.json (the resume falls back past it) does not stop the choice either.
    (list_complete(run)[-1][1] / "trainer_state.json").write_text("{not json")
    kept, said = keep_started_dtype(make(tmp_path / "r", **{**ov, "train.dtype": "auto"}), run)
    assert kept.train.dtype == started and "step_00000003" in said


def test_two_ranks_resumed_with_dtype_auto_agree_on_the_dtype_of_the_checkpoint(fsdp_run, tmp_path):
    """Under torchrun every rank reads the checkpoint's dtype and the ranks check they agree (one all-reduce
    that every rank reaches): the fp32 FSDP2 run resumed at step 4 with --train.dtype auto goes on bitwise."""
    _, ref = fsdp_run
    run = copy_until(ref, tmp_path / "auto", 4)
    res = finish(start(["--resume", str(run), "--train.dtype", "auto"], world=2))
    assert [rc for rc, _ in res] == [0, 0], [err[-3000:] for _, err in res]
    assert trajectory(run) == trajectory(ref)
    assert [e["text"] for e in read_events(run) if e["text"].startswith("train.dtype=auto")] == [
        "train.dtype=auto: fp32, the dtype of checkpoint step_00000004 (a resumed run keeps its precision; set "
        "train.dtype to change it)"]
