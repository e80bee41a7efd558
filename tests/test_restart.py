"""A job that restarts itself with the same command (``train.resume = 'auto'``): under ``torchrun
--max-restarts=2`` a kill -9 of rank 1 at a random step (2 or 4) while rank 0 is inside that step's in-loop
evaluation, then (in the restarted job) rank 1 killed while an async save is being written, make the elastic
agent restart both ranks twice; they continue from the newest complete checkpoint bit for bit (FSDP2, 2 gloo
ranks; train and eval records) with a ``restart`` event each time; 'auto' starts a fresh run in an empty
directory and refuses a directory that holds another run."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_resume import OV, ROOT, finish, fresh, start, trajectory, wait_for_step

from densetrain.checkpoint import list_complete
from densetrain.metrics import read_events, read_metrics

FSDP = {**OV, "train.steps": 8, "checkpoint.every": 2, "parallel.dp_replicate": 1, "parallel.dp_shard": 2,
        "train.resume": "auto", "checkpoint.async_save": True,
        # In-loop evaluations every 2 steps, long enough (~0.4 s) for the first kill to land in one.
        "eval.every": 2, "eval.max_batches": 48}


def worker_pid(agent: int, rank: int, attempt: int = 0) -> int | None:
    """The pid of torchrun's worker ``rank`` of restart ``attempt`` (a child of the agent process)."""
    try:
        children = Path(f"/proc/{agent}/task/{agent}/children").read_text().split()
    except OSError:
        return None
    for pid in children:
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
        except OSError:
            continue
        if env.get("RANK") == str(rank) and env.get("TORCHELASTIC_RESTART_COUNT") == str(attempt):
            return int(pid)
    return None


def test_torchrun_restarts_after_kill_9_and_continues_bitwise(prepared, tmp_path):
    _, make = prepared
    # The uninterrupted run: 'auto' in an empty directory starts fresh.
    ref_cfg = make(tmp_path / "ref", **FSDP)
    res = finish(start(fresh(ref_cfg, tmp_path), world=2))
    assert [rc for rc, _ in res] == [0, 0], [err[-3000:] for _, err in res]
    ref = Path(ref_cfg.train.run_dir)
    assert [e["text"] for e in read_events(ref) if e["kind"] in ("resume", "restart")] == [
        f"{ref}: a new run (nothing to resume there yet)"]

    # The same run under torchrun's elastic agent; rank 0 sleeps 200 ms per step (no change to the math) so
    # that the kill lands inside the run; rank 1 dies again while the async save of step 6 is being written.
    cfg = make(tmp_path / "elastic", **FSDP, faults=[{"kind": "slow_rank", "step": 0, "rank": 0, "ms": 200},
                                                     {"kind": "kill", "step": 5, "rank": 1, "during_checkpoint": True}])
    run = Path(cfg.train.run_dir)
    # torchrun's workers otherwise share the agent's rendezvous store, whose keys outlive a restart: a restarted
    # rank can read the killed attempt's gloo address and fail to connect (pytorch/pytorch#135712).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              "--max-restarts=2", "-m", "densetrain", "train", *fresh(cfg, tmp_path)],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Rank 1 killed while rank 0 is inside the evaluation of step k (2 or 4): its train record is logged and
        # its eval record not yet (the evaluation follows the record at once).
        k = random.Random().choice([2, 4])
        wait_for_step(run, k, [agent], timeout=150)
        pid = worker_pid(agent.pid, 1)
        assert pid is not None
        in_eval = not any(r["kind"] == "eval" and r["step"] == k for r in read_metrics(run))
        t_kill = time.time()
        os.kill(pid, signal.SIGKILL)
        out, err = agent.communicate(timeout=240)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.communicate()
    assert agent.returncode == 0, err[-4000:]
    assert in_eval, f"the kill after step {k} missed rank 0's evaluation"
    assert trajectory(run) == trajectory(ref), f"rank 1 killed after step {k}"
    # every evaluation of the restarted run equals the uninterrupted run's, the one cut short done again
    assert evals(run) == evals(ref) and sorted(evals(ref)) == [2, 4, 6, 8], (evals(run), evals(ref))
    first, second = [e for e in read_events(run) if e["kind"] == "restart"]
    ckpt = first["step"]
    # (step 0: the async save of step 2 was still being written when rank 1 died after step 2)
    assert first["values"]["attempt"] == 1 and ckpt in (0, 2, 4) and ckpt <= k + 1
    assert first["values"]["redone_steps"] == first["values"]["previous_step"] - ckpt >= 0
    assert first["values"]["previous_step"] >= k
    # The save of step 6 was cut short by the kill: no marker, so the second restart continues from step 4.
    assert second["values"]["attempt"] == 2 and second["step"] == 4
    assert second["values"]["redone_steps"] == second["values"]["previous_step"] - 4 >= 2
    assert [s for s, _ in list_complete(run)][-1] == 8
    print(f"killed after step {k}; restart from {ckpt}, {first['values']['redone_steps']} steps redone; "
          f"{first['time'] - t_kill:.1f}s from the kill to the restarted run's resume; killed during the async "
          f"save of step 6: restart from 4, {second['values']['redone_steps']} steps redone")


def evals(run: Path) -> dict[int, float]:
    """step -> the overall validation loss logged at that step (the last record of the step)."""
    return {r["step"]: r["val/all/loss"] for r in read_metrics(run) if r["kind"] == "eval" and "val/all/loss" in r}


def test_auto_refuses_a_directory_of_another_run(prepared, tmp_path):
    _, make = prepared
    first = make(tmp_path / "a", **{**OV, "train.steps": 4, "checkpoint.every": 0, "train.resume": "auto"})
    run = Path(first.train.run_dir)
    run.mkdir(parents=True)
    from densetrain.config import save_config

    save_config(first, run / "config.toml")
    other = make(tmp_path / "a", **{**OV, "train.steps": 4, "train.resume": "auto", "model.d_model": 32})
    (rc, err), = finish(start(fresh(other, tmp_path), world=1))
    assert rc == 2, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        f"densetrain: error: train.resume=auto: {run} holds another run (model.d_model: 64 there, 32 here); choose "
        f"another --train.run_dir, or continue that run with --resume {run}")
