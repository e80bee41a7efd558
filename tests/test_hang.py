"""No hang lasts: a rank that stops answering (SIGSTOP from outside, or the ``hang`` fault) makes the other(s)
exit within ``parallel.timeout_s`` (plus the rest of its step and its exit) with one line naming the collective
and the rank that did not arrive (its heartbeat file, RUN_DIR/heartbeat/rank1.json, went stale; or, for a rank
whose main thread spins while its heartbeat thread lives, the file's step and phase stayed behind the waiting
ranks'), and exit status 1, which torchrun's elastic agent answers with a restart."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

from conftest import run_script_ranks
from test_resume import OV, finish, fresh, start, wait_for_step

from densetrain.metrics import read_events
from densetrain.train.watch.watchdog import (
    Heartbeat,
    attempt_id,
    behind_ranks,
    process_start,
    process_started,
    read_heartbeats,
    silent_ranks,
    writer_alive,
)

TIMEOUT_S = 6

_GROUPS = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
import torch, torch.distributed as dist
from densetrain.config.schema import ParallelConfig
from densetrain.parallel import init_distributed
info = init_distributed("cpu", ParallelConfig(dp_replicate=1, dp_shard=1, tp=2, timeout_s=7))
groups = {name: info.mesh[name].get_group() for name in info.mesh.mesh_dim_names}
with open(f"{sys.argv[2]}.{info.rank}", "w") as f:
    json.dump({name: g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
               for name, g in {**groups, "world": dist.group.WORLD}.items()}, f)
dist.destroy_process_group()
"""


def test_every_group_of_the_mesh_waits_parallel_timeout_s(tmp_path):
    # torch's init_device_mesh makes its subgroups with the backend default (gloo: 1800 s), not the world's
    out = run_script_ranks(_GROUPS, tmp_path, "groups")
    for r in range(2):
        got = json.loads(Path(f"{out}.{r}").read_text())
        assert got == {"pp": 7.0, "dp_replicate": 7.0, "dp_shard": 7.0, "cp": 7.0, "tp": 7.0, "world": 7.0}


def test_behind_ranks_are_those_with_a_fresh_heartbeat_behind_the_waiting_rank():
    now = 1000.0

    def rec(rank, step, phase, moved=990.0):
        return {"rank": rank, "host": "h", "pid": 10 + rank, "step": step, "phase": phase, "moved": moved,
                "time": now - 1, "every": 5.0}

    # rank 0 waits in the token count of step 3 ('forward'); rank 2 waits there too; rank 1 is still drawing
    # the batch, rank 3 has not finished setting up, rank 4 wrote no phase (an older heartbeat file)
    beats = {0: rec(0, 3, "forward"), 1: rec(1, 3, "data", moved=988.0), 2: rec(2, 3, "forward"),
             3: rec(3, 0, "setup"), 4: {**rec(4, 3, "data"), "phase": None}}
    got = behind_ranks(beats, 0, now=now)
    assert sorted(got) == [1, 3]
    assert got[1] == ("host h, pid 11: heartbeat fresh, but its main thread has not moved for 12 s, still in phase "
                      "'data' of step 3 (busy there; this rank waits in phase 'forward' of step 3)")
    assert "still before its first step" in got[3]
    # A step further on counts more than any phase: rank 0 at the end of step 4 is ahead of 'optimizer' of 3.
    assert sorted(behind_ranks({0: rec(0, 4, "end"), 1: rec(1, 3, "optimizer")}, 0, now=now)) == [1]
    assert behind_ranks({0: rec(0, 3, "data"), 1: rec(1, 3, "forward")}, 0, now=now) == {}
    assert behind_ranks({1: rec(1, 3, "data")}, 0, now=now) == {}  # no file of its own: nothing to compare


def test_a_stopped_rank_times_out_the_other_naming_it(prepared, tmp_path):
    _, make = prepared
    cfg = make(tmp_path, **{**OV, "train.steps": 40, "parallel.timeout_s": TIMEOUT_S},
               faults=[{"kind": "slow_rank", "step": 0, "rank": 0, "ms": 100}])
    run = Path(cfg.train.run_dir)
    procs = start(fresh(cfg, tmp_path), world=2)
    try:
        wait_for_step(run, 2, procs)
        os.kill(procs[1].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        procs[0].wait(timeout=TIMEOUT_S + 60)
        waited = time.monotonic() - t0
    finally:
        for p in procs:  # the stopped rank: SIGKILL ends it without SIGCONT; nothing is left behind
            if p.poll() is None:
                p.kill()
                os.kill(p.pid, signal.SIGCONT)
    (rc, err), _ = finish(procs)
    assert rc == 1, err[-3000:]
    assert waited >= TIMEOUT_S, waited  # not before the timeout (how much later is the machine's load)
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(
        r"densetrain: error: \[rank 0\] collective (all_reduce|broadcast|all_gather\w*|gradient reduction \(DDP/FSDP "
        rf"hooks in the backward\)) in \w+\.py:\d+ \w+\(\) timed out after {TIMEOUT_S} s \(parallel\.timeout_s\); "
        rf"rank\(s\) not arriving: 1 \(host \S+, pid {procs[1].pid}: last heartbeat \d+ s ago, at step \d+\)",
        last), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert procs[1].poll() is not None


def test_the_hang_fault_stops_its_rank_at_its_step(prepared, tmp_path):
    _, make = prepared
    cfg = make(tmp_path, **{**OV, "train.steps": 40, "parallel.timeout_s": TIMEOUT_S},
               faults=[{"kind": "hang", "step": 3, "rank": 1}])
    procs = start(fresh(cfg, tmp_path), world=2)
    try:
        procs[0].wait(timeout=TIMEOUT_S + 90)
        state = Path(f"/proc/{procs[1].pid}/stat").read_text().split()[2]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                os.kill(p.pid, signal.SIGCONT)
    (rc, err), _ = finish(procs)
    assert rc == 1 and state == "T", (state, err[-3000:])  # T: stopped
    assert "rank(s) not arriving: 1 (" in err.strip().splitlines()[-1], err[-3000:]
    (ev,) = [e for e in read_events(Path(cfg.train.run_dir)) if e["kind"] == "fault"]
    assert ev["step"] == 3 and ev["text"] == "injected fault hang: rank 1 stops answering (SIGSTOP to itself)"


def test_a_busy_rank_times_out_the_others_naming_it(prepared, tmp_path):
    # hang mode 'busy': rank 1's main thread spins while step 3's batch is drawn (an infinite loop in a data
    # worker) and its heartbeat thread lives on; ranks 0 and 2 wait for it in that step's token count.
    _, make = prepared
    cfg = make(tmp_path, **{**OV, "train.steps": 40, "train.batch_size": 6, "parallel.timeout_s": TIMEOUT_S},
               faults=[{"kind": "hang", "step": 3, "rank": 1, "mode": "busy"}])
    procs = start(fresh(cfg, tmp_path), world=3)
    try:
        wait_for_step(Path(cfg.train.run_dir), 3, procs)  # rank 0 logged step 3: rank 1 spins from here on
        t0 = time.monotonic()
        for p in (procs[0], procs[2]):
            p.wait(timeout=TIMEOUT_S + 60)
        waited = time.monotonic() - t0
        busy = procs[1].poll() is None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    res = finish(procs)
    assert [rc for rc, _ in res] == [1, -signal.SIGKILL, 1] and busy, [err[-3000:] for _, err in res]
    for r in (0, 2):  # each waiting rank names rank 1 (and not the other waiting rank): alive, stuck in 'data'
        last = res[r][1].strip().splitlines()[-1]
        assert re.fullmatch(
            rf"densetrain: error: \[rank {r}\] collective all_reduce in \w+\.py:\d+ \w+\(\) timed out after "
            rf"{TIMEOUT_S} s \(parallel\.timeout_s\); rank\(s\) not arriving: 1 \(host \S+, pid {procs[1].pid}: "
            r"heartbeat fresh, but its main thread has not moved for \d+ s, still in phase 'data' of step 3 \(busy "
            r"there; this rank waits in phase 'forward' of step 3\)\)", last), res[r][1][-3000:]
        assert "Traceback" not in res[r][1]
    print(f"ranks 0 and 2 exited {waited:.1f} s after rank 0 logged step 3 (parallel.timeout_s = {TIMEOUT_S})")


def test_a_heartbeat_belongs_to_its_attempt(tmp_path, monkeypatch):
    # torchrun's attempt 0 wrote rank 1's file; after a restart (attempt 1) that file is not this attempt's rank 1
    # (before: read as it, "pid N: the process is gone" for a rank of the previous attempt)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    beat = Heartbeat(60.0, tmp_path / "hang_rank1.txt", beat_file=tmp_path / "heartbeat" / "rank1.json", rank=1)
    beat.stop()
    rec = json.loads((tmp_path / "heartbeat" / "rank1.json").read_text())
    assert (rec["attempt"], rec["pid"], rec["start"]) == ("job7/0", os.getpid(), process_start(os.getpid()))
    assert read_heartbeats(tmp_path, attempt_id(), process_started()) == {1: rec} and writer_alive(rec) is True
    assert process_started() <= rec["time"]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert read_heartbeats(tmp_path, attempt_id()) == {}
    # without torchrun: the rendezvous address, and a file written before this process started is an earlier
    # launch's (the same address reused)
    for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_JOB_ID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert attempt_id() == "10.0.0.1:29500"
    (tmp_path / "heartbeat" / "rank1.json").write_text(json.dumps({**rec, "attempt": attempt_id()}))
    assert list(read_heartbeats(tmp_path, attempt_id(), rec["time"])) == [1]
    assert read_heartbeats(tmp_path, attempt_id(), rec["time"] + 0.001) == {}
    assert silent_ranks({}, 2) == {0: "no heartbeat of this attempt (still starting up, or never started)",
                                   1: "no heartbeat of this attempt (still starting up, or never started)"}


def test_a_killed_rank_is_dead_not_busy():
    # A rank killed with kill -9 under torchrun is a zombie until the agent reaps it, and its last heartbeat was
    # written a few steps back: it is dead, not "heartbeat fresh ... busy there" (before: pid_alive(zombie) was
    # True, and its file's step was behind the waiting rank's)
    child = subprocess.Popen(["sleep", "60"])
    try:
        now, host = time.time(), socket.gethostname()
        rec = {"rank": 1, "host": host, "pid": child.pid, "start": process_start(child.pid), "step": 3,
               "phase": "data", "moved": now - 1, "time": now - 1, "every": 5.0}
        me = {"rank": 0, "host": host, "pid": os.getpid(), "start": process_start(os.getpid()), "step": 9,
              "phase": "forward", "moved": now, "time": now, "every": 5.0}
        assert writer_alive(rec) is True and list(behind_ranks({0: me, 1: rec}, 0, now=now)) == [1]
        child.kill()
        while Path(f"/proc/{child.pid}/stat").read_text().split(") ")[1][0] != "Z":  # dead, not reaped yet
            time.sleep(0.01)
        assert writer_alive(rec) is False and behind_ranks({0: me, 1: rec}, 0, now=now) == {}
        assert silent_ranks({0: me, 1: rec}, 2, now=now) == {1: f"host {host}, pid {child.pid}: the process is dead "
                                                                 "(killed or exited), its last heartbeat 1 s ago at "
                                                                 "step 3"}
    finally:
        child.kill()
        child.wait()
    # a pid taken by another process later (another start time) is not the writer
    assert writer_alive({**me, "start": me["start"] + 1}) is False
    assert writer_alive({**me, "host": "elsewhere"}) is None  # another host: unknown from here
