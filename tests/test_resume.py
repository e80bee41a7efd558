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
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import gloo_env

from densetrain.checkpoint import list_complete
from densetrain.cli import main
from densetrain.config import save_config
from densetrain.metrics import read_events, read_metrics
from densetrain.train import train
from densetrain.train.preempt import EXIT_PREEMPTED

ROOT = Path(__file__).resolve().parents[1]
# Three stages (a seq_len switch included); a fault that only sleeps makes each step long enough to be hit.
OV = {"train.steps": 16, "checkpoint.every": 5, "checkpoint.keep": 0, "eval.every": 0, "logging.tensorboard": False,
      "watchdog.every": 0, "probe.every": 0}
SLOW = [{"kind": "slow_rank", "step": 0, "rank": 0, "ms": 150}]


def start(cfg, tmp: Path, argv: list[str], world: int = 1) -> list[subprocess.Popen]:
    """``python -m densetrain train --config CFG ARGV`` as ``world`` processes (gloo ranks when > 1)."""
    path = tmp / f"{Path(cfg.train.run_dir).name}.toml"
    save_config(cfg, path)
    env = {**(gloo_env(world) if world > 1 else os.environ), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return [subprocess.Popen([sys.executable, "-m", "densetrain", "train", "--config", str(path), *argv], cwd=ROOT,
                             env={**env, "RANK": str(r), "LOCAL_RANK": str(r)} if world > 1 else env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(world)]


def wait_for_step(run: Path, step: int, procs, timeout: float = 120) -> None:
    """Until rank 0 has logged ``step`` (the run is then inside a later step)."""
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


def check_stopped(run: Path, results, at_least: int) -> int:
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
    return step


def test_sigterm_at_a_random_step_resumes_bitwise(prepared, tmp_path):
    _, make = prepared
    ref = make(tmp_path / "ref", **OV)
    train(ref)
    want = trajectory(Path(ref.train.run_dir))

    cfg = make(tmp_path / "stopped", **OV, faults=SLOW)
    run = Path(cfg.train.run_dir)
    k = random.Random().randint(2, 12)
    procs = start(cfg, tmp_path, [])
    wait_for_step(run, k, procs)
    procs[0].send_signal(signal.SIGTERM)
    step = check_stopped(run, finish(procs), k)
    assert main(["train", "--resume", str(run)]) == 0  # the plain command
    assert trajectory(run) == want, f"signal after step {k}, stopped at {step}"


def test_sigterm_on_one_of_two_ranks_stops_both_and_resumes_bitwise(prepared, tmp_path):
    _, make = prepared
    ov = {**OV, "train.steps": 10, "parallel.dp_replicate": 1, "parallel.dp_shard": 2}
    ref = make(tmp_path / "ref", **ov)
    assert [rc for rc, _ in finish(start(ref, tmp_path, [], world=2))] == [0, 0]
    want = trajectory(Path(ref.train.run_dir))

    cfg = make(tmp_path / "stopped", **ov, faults=SLOW)
    run = Path(cfg.train.run_dir)
    k = random.Random().randint(2, 7)
    procs = start(cfg, tmp_path, [], world=2)
    wait_for_step(run, k, procs)
    procs[1].send_signal(signal.SIGTERM)  # only rank 1 is told: the step-boundary all-reduce tells rank 0
    step = check_stopped(run, finish(procs), k)
    procs = start(cfg, tmp_path, ["--resume", str(run)], world=2)
    resumed = finish(procs)
    assert [rc for rc, _ in resumed] == [0, 0], [err[-3000:] for _, err in resumed]
    assert trajectory(run) == want, f"signal after step {k}, stopped at {step}"
    # The summary is printed once, by rank 0.
    assert json.loads(procs[0].out[procs[0].out.index("\n{") + 1:])["steps"] == ov["train.steps"]
    assert '"steps"' not in procs[1].out, procs[1].out[-2000:]


def test_second_signal_exits_at_once(prepared, tmp_path):
    _, make = prepared
    # Steps of ~2 s: the graceful path would need the rest of the step and a checkpoint.
    cfg = make(tmp_path / "twice", **OV, faults=[{"kind": "slow_rank", "step": 0, "rank": 0, "ms": 2000}])
    run = Path(cfg.train.run_dir)
    procs = start(cfg, tmp_path, [])
    wait_for_step(run, 1, procs)
    procs[0].send_signal(signal.SIGINT)
    time.sleep(0.3)
    t0 = time.monotonic()
    procs[0].send_signal(signal.SIGINT)
    rc, err = finish(procs)[0]
    assert rc == -signal.SIGINT and time.monotonic() - t0 < 1.0, err[-2000:]  # killed by it: status 130 in a shell
    assert "SIGINT received: finishing the current step" in err
    assert not [e for e in read_events(run) if e["kind"] == "preempt"]
    assert [s for s, _ in list_complete(run)] == []  # nothing was saved after the second signal


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
