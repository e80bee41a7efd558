"""A torchrun job that fails the same way twice says so and stops (issue 44 item 3): under ``torchrun
--max-restarts N`` with ``train.resume = auto`` a deterministic failure ran N+1 identical attempts. Each
attempt's end is recorded in ``RUN_DIR/attempts/rank<r>.jsonl``; the attempt that fails as the one before it
did (same error, same step) says so in one line and exits 78, and the job's later restarts exit at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from densetrain.errors import EXIT_REPEATED, TrainError
from densetrain.fileio import json_text
from densetrain.train.rundir import end_attempt, stopped_job

ROOT = Path(__file__).resolve().parents[1]


def _attempts(run: Path) -> list[tuple[int, str]]:
    return [(r["attempt"], r["outcome"]) for r in map(json.loads, (run / "attempts" / "rank0.jsonl").open())]


def test_a_config_the_mesh_refuses_stops_after_the_second_identical_attempt(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    # tp 2 on one process: refused by the mesh at every start, before any data is read.
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                        "--max-restarts", "3", "--monitor-interval", "0.2", "-m", "densetrain", "train",
                        "--train.device=cpu", "--parallel.tp=2", "--parallel.dp_shard=1", "--train.resume=auto",
                        f"--train.run_dir={run}"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0  # torchrun's own status once its restarts are spent (it retries any failure)
    assert _attempts(run) == [(0, "failed"), (1, "failed"), (2, "skipped"), (3, "skipped")]
    said = [ln for ln in r.stderr.splitlines() if ln.startswith("densetrain: error: ")]
    assert len(said) == 4 and "do not divide the world size 1" in said[0], said
    assert said[1].startswith(f"densetrain: error: {run}: attempt 1 failed as attempt 0 did, before its first step "
                              "(ConfigError: parallel: the fixed degrees"), said[1]
    assert f"not retried (exit status {EXIT_REPEATED}" in said[1]
    assert all(s.startswith(f"densetrain: error: {run}: attempt {k} not started: attempt 1 of this job failed as the "
                            "one before it did") for k, s in ((2, said[2]), (3, said[3])))
    assert "exitcode  : 78" in r.stderr or "exitcode: 78" in r.stderr.replace(" ", ""), r.stderr[-2000:]
    assert not (run / "config.toml").exists()  # no attempt after the repeat did any work
    stop = json.loads((run / "attempts" / "stop.json").read_text())
    assert stop["attempt"] == 1 and stop["error"].startswith("ConfigError: parallel: the fixed degrees")


def test_only_the_same_error_at_the_same_step_of_the_same_job_is_a_repeat(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    run.mkdir()

    def attempt(k: int, step: int, text: str, job: str = "job1") -> str | None:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", job)
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(k))
        # the steps this attempt recorded (as the logger leaves metrics.jsonl) before it failed
        (run / "metrics.jsonl").write_text("".join(json_text({"kind": "train", "step": s, "loss": 1.0}) + "\n"
                                                   for s in range(1, step + 1)))
        return end_attempt(run, 0, "failed", TrainError(text))

    assert attempt(0, 7, "diverged") is None
    assert attempt(1, 5, "diverged") is None  # the same error at another step: it may not repeat
    assert attempt(2, 5, "another error") is None  # another error at the same step
    line = attempt(3, 5, "another error")
    assert line == (f"{run}: attempt 3 failed as attempt 2 did, at step 5 (TrainError: another error): a "
                    f"deterministic failure, not retried (exit status {EXIT_REPEATED}; later restarts of this job "
                    "exit at once); fix the cause, then start a new job")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "4")
    assert stopped_job(run).startswith(f"{run}: attempt 4 not started: attempt 3 of this job failed")
    # A new job (another run id: a new submission) removes the stop and tries again, said once.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert stopped_job(run) is None and not (run / "attempts" / "stop.json").exists()
    assert "of an earlier job removed" in capsys.readouterr().err
    assert attempt(1, 5, "another error", job="job2") is None  # job1's attempt 0 is not job2's
    # Outside torchrun nothing is recorded.
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    before = (run / "attempts" / "rank0.jsonl").read_text()
    assert end_attempt(run, 0, "failed", TrainError("x")) is None
    assert (run / "attempts" / "rank0.jsonl").read_text() == before
