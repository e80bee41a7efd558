"""train/watch/watchdog.py on real 2-rank gloo runs: phase times per rank (the collective's wait is 'sync', not
'data'), a rank slow from step 1 named against the other ranks, per-rank perf records under tensor
parallelism, strict JSON in metrics.jsonl, and the slow_rank fault's delay per step."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import forked
import numpy as np
import pytest
from conftest import gloo_env

from densetrain.config.recovery import WatchdogConfig
from densetrain.metrics import read_events, read_metrics
from densetrain.train.watch.watchdog import COLUMNS, GOT, LOAD, PHASES, STEP, WAIT, Watchdog

ROOT = Path(__file__).resolve().parents[1]
QUIET = {"eval.every": 0, "logging.tensorboard": False, "probe.every": 0, "checkpoint.every": 0,
         "stages": [{"name": "main", "start": 0.0, "mix": {"email": 0.5, "json": 0.5}}],
         "watchdog.every": 2, "watchdog.warmup": 0, "watchdog.sustain": 2, "watchdog.threshold": 0.5}

_WORKER = r"""
import json, os, sys, time
from pathlib import Path
root, shards, run_dir, overrides, slow_data_ms = sys.argv[1:]
sys.path[:0] = [root, os.path.join(root, "tests")]
import torch.distributed as dist
from conftest import small_config
from densetrain.data.mixture import MixtureSampler
from densetrain.train import train
if os.environ["RANK"] == "1" and float(slow_data_ms):
    draw = MixtureSampler.next_samples
    def slow_draw(self, *args, **kwargs):  # a slow disk on rank 1: each of its batches takes longer to read
        time.sleep(float(slow_data_ms) / 1000)
        return draw(self, *args, **kwargs)
    MixtureSampler.next_samples = slow_draw
train(small_config(Path(run_dir), Path(shards), **json.loads(overrides)))
dist.destroy_process_group()
sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
"""


def _two_ranks(tmp_path: Path, shards: Path, overrides: dict, slow_data_ms: float = 0) -> Path:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = gloo_env(2)
    argv = [sys.executable, str(script), str(ROOT), str(shards), str(tmp_path), json.dumps(overrides),
            str(slow_data_ms)]
    procs = [forked.Popen(argv, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stderr=forked.PIPE,
                          text=True) for r in range(2)]
    errs = [p.communicate(timeout=240)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(e[-3000:] for e in errs)
    return tmp_path / "run"


def _strict_lines(path: Path) -> list[dict]:
    def refuse(name):
        raise ValueError(f"{path.name}: {name} is not JSON")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_a_rank_slow_from_step_1_is_named_and_the_waiting_rank_is_not(prepared, tmp_path):
    shards, _ = prepared
    # rank 1 reads each batch 150 ms slower and sleeps 300 ms per step in its forward passes, from step 0
    # (threshold 0.2: the 0.3 s forward excess is then far above 0.2 x the ~0.5 s step, however loaded the machine)
    ov = {**QUIET, "train.steps": 4, "watchdog.threshold": 0.2,
          "faults": [{"kind": "slow_rank", "step": 0, "rank": 1, "ms": 300}]}
    run = _two_ranks(tmp_path, shards, ov, slow_data_ms=150)
    perf = [r for r in read_metrics(run) if r["kind"] == "perf"]
    by_rank = {r: [p for p in perf if p["rank"] == r] for r in (0, 1)}
    assert len(by_rank[0]) == len(by_rank[1]) == 2
    for p0, p1 in zip(by_rank[0], by_rank[1]):
        # the slow-data rank's own draw, not rank 0's wait for it in the token-count all-reduce (before: both
        # ~0.15 s of 'data'). Bounds from the injected delays only (a loaded machine lengthens both ranks' own
        # work alike): rank 0's data lacks rank 1's 150 ms, which rank 0 waits in 'sync'.
        assert p1["time/data_s"] >= 0.15 and p0["time/data_s"] < p1["time/data_s"] - 0.1
        assert p0["time/data_s"] + p0["time/sync_s"] >= 0.1
        # 300 ms per step in its forward passes (before: 150 ms, 300 ms over the 4 micro-batches of both ranks)
        assert p1["time/forward_s"] >= 0.3 and p0["time/forward_s"] < p1["time/forward_s"] - 0.2
    # slow from step 1, so no baseline of its own is faster: named against the other rank (before: never)
    (ev,) = [e for e in read_events(run) if e["kind"] == "throughput"]
    assert ev["values"]["ranks"] == [1] and ev["values"]["phases"] == {"1": "forward"} and ev["step"] == 4
    assert "rank 1" in ev["text"] and "other ranks" in ev["text"]


def test_tensor_parallel_ranks_log_their_own_times_in_strict_json(prepared, tmp_path):
    shards, _ = prepared
    ov = {**QUIET, "train.steps": 2, "schedule.warmup_steps": 1, "parallel.dp_replicate": 1,
          "parallel.tp": 2}
    run = _two_ranks(tmp_path, shards, ov)
    recs = _strict_lines(run / "metrics.jsonl")  # before: rank 1's tokens_per_sec and mfu were Infinity
    _strict_lines(run / "events.jsonl")
    perf = [r for r in recs if r["kind"] == "perf"]
    assert sorted(r["rank"] for r in perf) == [0, 1]
    tokens_per_step = 8 * 32  # batch 8 of 32 targets, shared by both TP ranks (one data-parallel rank)
    for r in perf:
        assert r["step_s"] > 0.0  # before: 0 on rank 1 (its row zeroed by the batch-sum reduction)
        assert r["tokens_per_sec"] == pytest.approx(tokens_per_step / r["step_s"])  # before: halved on rank 0
        assert 0 < r["mfu"] < 1


def _table(rows: list[dict]) -> np.ndarray:
    """A window table (world, COLUMNS) from per-rank dicts of phase seconds per step, 'wait' (run-queue wait per
    step) and 'got' (CPU share): the step time is the sum of the phases."""
    t = np.zeros((len(rows), COLUMNS))
    for r, row in enumerate(rows):
        for p, v in row.items():
            if p in PHASES:
                t[r, PHASES.index(p)] = v
        t[r, STEP] = sum(v for p, v in row.items() if p in PHASES)
        t[r, WAIT], t[r, GOT], t[r, LOAD] = row.get("wait", 0.0), row.get("got", 1.0), row.get("load", 0.0)
    return t


QUIET_STEP = {"data": 0.01, "forward": 0.03, "backward": 0.03, "sync": 0.01, "optimizer": 0.02}  # 100 ms


def _feed(dog: Watchdog, windows: list[np.ndarray]) -> list[dict]:
    return [dog.decide(t) for t in windows]


def test_contention_on_every_rank_names_only_the_rank_slowed_on_its_own():
    # 2 ranks of one host at load ~5: both ranks' optimizer phase grows 60 ms (+0.6 s waiting for a core), rank 1
    # also sleeps 300 ms in its forward (a slow_rank fault); rank 0 waits for it in the backward's all-reduce.
    cfg = WatchdogConfig(threshold=0.3, sustain=2, hang_seconds=0)
    dog = Watchdog(cfg, rank=0, world_size=2, run_dir=Path("."))
    quiet = _table([QUIET_STEP, QUIET_STEP])
    loaded = {**QUIET_STEP, "optimizer": 0.08, "wait": 0.06, "got": 0.5}
    busy = _table([{**loaded, "backward": 0.33}, {**loaded, "forward": 0.33}])
    named = _feed(dog, [quiet] * 3 + [busy] * 2)
    # before: both ranks named ('optimizer' for rank 0): its growth was not compared with the other rank's
    assert named[:4] == [{}] * 4 and list(named[4]) == [1]
    phase, text, cause = named[4][1]
    assert (phase, cause) == ("forward", "device") and "phase 'forward' +300 ms" in text
    assert dog.decide(busy) == {}  # named once, not again while it stays slow


def test_a_slowdown_the_run_queue_explains_is_contention():
    cfg = WatchdogConfig(threshold=0.3, sustain=2, hang_seconds=0)
    one = Watchdog(cfg, rank=0, world_size=1, run_dir=Path("."))
    # one process whose forward took 80 ms more while it waited 70 ms per step for a core (got 40% of the CPU it
    # asked for): contention; a 300 ms sleep with no wait: its device
    waited = _table([{**QUIET_STEP, "forward": 0.11, "wait": 0.07, "got": 0.4, "load": 5.2}])
    (res,) = [n for n in _feed(one, [_table([QUIET_STEP])] * 3 + [waited] * 2) if n]
    phase, text, cause = res[0]
    assert (phase, cause) == ("forward", "contention")
    assert "waited 70 ms/step for a core, it got 40% of the CPU time it asked for, load average 5.2" in text
    two = Watchdog(cfg, rank=0, world_size=1, run_dir=Path("."))
    slept = _table([{**QUIET_STEP, "forward": 0.33}])
    (res,) = [n for n in _feed(two, [_table([QUIET_STEP])] * 3 + [slept] * 2) if n]
    assert res[0][0] == "forward" and res[0][2] == "device"
    # against the other ranks: rank 1's optimizer 100 ms over rank 0's, 90 ms of it waiting for a core
    peers = Watchdog(cfg, rank=0, world_size=2, run_dir=Path("."))
    lag = _table([QUIET_STEP, {**QUIET_STEP, "optimizer": 0.12, "wait": 0.09, "got": 0.45}])
    (res,) = [n for n in _feed(peers, [lag] * 2) if n]
    assert list(res) == [1] and res[1][0] == "optimizer" and res[1][2] == "contention"
