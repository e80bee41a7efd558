"""Hardware health (densetrain/health.py, train/watch/health.py): the outlier rule on known numbers; a busy host
told from a faulty device, the re-measurement and the verdict, all on injected measurements (what the code
decides, never what this machine measures); the seed's 7.2 rehearsed on 2 and on 3 real gloo ranks (a
slow_memory fault on rank 1: the watchdog fires, the health check that follows names rank 1 and its memory
bandwidth, not its matmul rate; the start-up check of the clean run before the fault has no health event); and
``densetrain doctor`` under torchrun: one verdict line, exit 0 for a verdict, no torchrun error dump."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_resume import ROOT, finish, fresh, start

from densetrain.cli import main
from densetrain.config import HealthConfig
from densetrain.health import (
    EXIT_BUSY,
    EXIT_UNHEALTHY,
    Row,
    check,
    cpu_got,
    cpu_sample,
    judge,
    memory_bandwidth,
    throttle_memory,
    verdict,
)
from densetrain.metrics import MetricsLogger, read_events, read_metrics
from densetrain.train.watch.health import HealthWatch


def test_outliers_against_the_median_and_the_rank_own_first_measurement():
    cfg = HealthConfig(min_ratio=0.75, zscore=3.5)  # (the default min_ratio is 0.6)
    # 2 ranks: |z| is always 0.67, the ratio to the median decides; a latency is bad when high.
    rows = [Row(0, "a", {"memory": 10.0, "matmul": 5.0, "dp/all_reduce_lat": 1e-4}),
            Row(1, "b", {"memory": 4.0, "matmul": 5.2, "dp/all_reduce_lat": 1e-4})]
    (o,) = judge(rows, None, cfg)
    assert (o["rank"], o["host"], o["figure"], o["vs"], o["cause"]) == (1, "b", "memory", "median", "hardware")
    assert o["median"] == 7.0 and abs(o["ratio"] - 4 / 7) < 1e-12
    assert "memory bandwidth" in o["text"] and "exclude the node" in o["text"]
    rows[1].figures["dp/all_reduce_lat"] = 5e-4  # 1.67x the median latency of 3e-4
    assert {(o["rank"], o["figure"]) for o in judge(rows, None, cfg)} == {(1, "memory"), (1, "dp/all_reduce_lat")}
    # 5 ranks: one at 0.7x the median with the others within 2% has a huge robust z: named; a spread-out
    # set whose lowest is 0.7x has |z| < 3.5: not named.
    tight = [Row(r, "h", {"matmul": v}) for r, v in enumerate([10.0, 10.1, 9.9, 10.2, 7.0])]
    assert [(o["rank"], round(o["z"], 1)) for o in judge(tight, None, cfg)] == [(4, -20.2)]
    spread = [Row(r, "h", {"matmul": v}) for r, v in enumerate([7.0, 8.5, 10.0, 11.5, 13.0])]
    assert judge(spread, None, cfg) == []
    # Against its own first measurement on the same host: a slow decline every rank shares.
    first = [Row(0, "a", {"memory": 10.0}), Row(1, "b", {"memory": 10.0})]
    now = [Row(0, "a", {"memory": 9.0}), Row(1, "b", {"memory": 7.0})]
    assert [(o["rank"], o["vs"], o["ratio"]) for o in judge(now, first, cfg)] == [(1, "first", 0.7)]
    assert judge(now, [Row(1, "c", {"memory": 10.0})], cfg) == []  # another host: no baseline
    # collective figures: across ranks only (their history moves with the rest of the network)
    assert judge([Row(0, "a", {"dp/all_gather": 1.0})], [Row(0, "a", {"dp/all_gather": 3.0})], cfg) == []


def test_slow_memory_throttles_the_copy_benchmark():
    # An injected clock that moves 1/64 s per reading: every trial times 2 copies in 1/32 s, whatever this machine
    # does, so the figure is exact (before: a measured ratio, 0.48 against a 0.45 bound at load 11).
    def clock():
        return next(ticks) / 64

    ticks = itertools.count()
    cpu = torch.device("cpu")
    before, _ = memory_bandwidth(cpu, mib=1, seconds=1 / 32, trials=2, clock=clock)
    throttle_memory(4.0)
    try:
        after, _ = memory_bandwidth(cpu, mib=1, seconds=1 / 32, trials=2, clock=clock)
    finally:
        throttle_memory(1.0)
    assert before == 2 * (2 * 2**20) * 32 and after == before / 4  # 2 copies of 1 MiB (read + write) in 1/32 s


def test_far_below_its_first_wins_over_contention_against_the_median():
    # 2 ranks on a loaded host: rank 1's matmul at 0.18x the median while it got 10% of the CPU (per CPU-second
    # level with rank 0: contention against the median), but 1e-6 of its own first measurement per CPU-second: a
    # hardware outlier. Before, the median reading was kept and the first never looked at ('~' in doctor's
    # table, the run's 1e20 first measurement notwithstanding).
    cfg = HealthConfig()
    rows = [Row(0, "h", {"matmul": 10.0}, "cpu", {"share/matmul": 1.0}),
            Row(1, "h", {"matmul": 1.0}, "cpu", {"share/matmul": 0.1})]
    first = [Row(0, "h", {"matmul": 10.0}, "cpu", {}), Row(1, "h", {"matmul": 1e6}, "cpu", {})]
    (o,) = judge(rows, first, cfg)
    assert (o["rank"], o["figure"], o["vs"], o["cause"]) == (1, "matmul", "first", "hardware")
    assert o["ratio"] == 1e-6 and o["per_cpu_ratio"] < o["bar"]
    (o,) = judge(rows, None, cfg)  # without a first measurement the median reading stands: contention
    assert (o["vs"], o["cause"]) == ("median", "contention")


def test_a_busy_host_is_not_a_faulty_device():
    cfg = HealthConfig()  # min_ratio 0.6
    cpu = {"load": 7.1, "cores": 2.0}
    # the issue's 2 ranks of one loaded host: rank 1's matmul at 0.59x the median, measured while it got 45% of
    # the CPU time it asked for (per CPU-second 1.3x): contention, no advice to replace anything
    rows = [Row(0, "h", {"matmul": 10.0, "memory": 20e9}, "cpu", {**cpu, "share/matmul": 1.0, "share/memory": 1.0}),
            Row(1, "h", {"matmul": 4.2, "memory": 20e9}, "cpu", {**cpu, "share/matmul": 0.45, "share/memory": 1.0})]
    (o,) = judge(rows, None, cfg)
    assert (o["rank"], o["figure"], o["cause"]) == (1, "matmul", "contention")
    assert round(o["ratio"], 2) == 0.59 and round(o["per_cpu_ratio"], 2) == 0.97  # 4.2 / 7.1; 9.33 / 9.67
    assert "this process got 45% of the CPU time it asked for; load average 7.1 on 2 cores" in o["text"]
    assert "not a hardware fault" in o["text"] and "nvidia-smi" not in o["text"] and "exclude" not in o["text"]
    status, line = verdict(rows, [o])
    assert status == EXIT_BUSY and line.startswith("busy: rank 1 on h: matmul rate")
    # rank 1's memory reads 1/50 while it got half its CPU: still 0.04x per CPU-second, a hardware outlier, with
    # advice for a CPU host (before: "check nvidia-smi" on a CPU)
    rows[1].figures["memory"], rows[1].context["share/memory"] = 0.4e9, 0.5
    hard = [o for o in judge(rows, None, cfg) if o["cause"] == "hardware"]
    assert [(o["rank"], o["figure"]) for o in hard] == [(1, "memory")]
    assert "slow host memory" in hard[0]["text"] and "nvidia-smi" not in hard[0]["text"]
    status, line = verdict(rows, judge(rows, None, cfg))
    assert status == EXIT_UNHEALTHY and line.startswith("unhealthy: rank 1 on h: memory bandwidth 0.4 GB/s")
    assert line.endswith("(and 1 more outlier(s): see the table)")
    # measured on this machine at load 20 on 2 cores: the first check at a 7% CPU share, a later one at 2%: 0.21x
    # raw, 0.73x per CPU-second; at such shares only a far wider gap names the device (bar 0.6 x 0.25, the least
    # trust, where 0.02 / 0.8 is less)
    first = [Row(0, "h", {"memory": 2.6e9}, "cpu", {"share/memory": 0.069})]
    now = [Row(0, "h", {"memory": 0.551e9}, "cpu", {"share/memory": 0.02})]
    (o,) = judge(now, first, cfg)
    assert o["cause"] == "contention" and round(o["ratio"], 2) == 0.21 and round(o["per_cpu_ratio"], 2) == 0.73
    assert o["bar"] == pytest.approx(0.6 * 0.25)
    now[0].figures["memory"] = 2.6e9 / 50  # 1/50 per wall-second with a 2% share: 0.069x per CPU-second
    assert [o["cause"] for o in judge(now, first, cfg)] == ["hardware"]
    # a GPU: the advice is the GPU's; another process on the device makes it contention; NVML's throttle is said
    gpu = [Row(0, "h", {"matmul": 10.0}, "cuda", {}), Row(1, "h", {"matmul": 4.0}, "cuda",
                                                          {"throttled": 1.0, "clock_ratio": 0.62})]
    (o,) = judge(gpu, None, cfg)
    assert o["cause"] == "hardware" and "nvidia-smi" in o["text"] and "clocks at 62% of their maximum" in o["text"]
    gpu[1].context["gpu_others"] = 2.0
    (o,) = judge(gpu, None, cfg)
    assert o["cause"] == "contention" and "2 other process(es) on the GPU" in o["text"]
    assert verdict(gpu[:1], []) == (0, "healthy: 1 rank(s), 1 host(s), every figure of every rank within its bounds")


def test_an_outlier_is_measured_again_before_it_is_named():
    cfg = HealthConfig()
    host = socket.gethostname()
    first = [Row(0, host, {"matmul": 10.0})]
    calls = []

    def measure_with(values):
        def measure_fn(device, dtype, mesh, cfg):
            calls.append(1)
            return {"matmul": values[len(calls) - 1]}, {"share/matmul": 1.0}
        return measure_fn

    # 3.0 once (another process for a moment), 9.0 when measured again: the better one is kept, nothing named
    rows, outliers = check(torch.device("cpu"), torch.float32, None, cfg, first, measure_with([3.0, 9.0]))
    assert len(calls) == 2 and rows[0].figures == {"matmul": 9.0} and outliers == []
    calls.clear()  # slow twice: named (before: named from the one measurement, never repeated)
    rows, outliers = check(torch.device("cpu"), torch.float32, None, cfg, first, measure_with([3.0, 3.5]))
    assert len(calls) == 2 and [(o["figure"], o["ratio"], o["cause"]) for o in outliers] == [("matmul", 0.35,
                                                                                                "hardware")]
    calls.clear()  # healthy the first time: measured once
    check(torch.device("cpu"), torch.float32, None, cfg, first, measure_with([9.5]))
    assert len(calls) == 1


def test_cpu_share_is_cpu_time_against_run_queue_wait():
    a = b = cpu_sample()
    assert a is not None  # Linux schedstat on this machine
    # Some CPU time, so that the share is defined. The kernel adds a running thread's time to schedstat at its
    # ticks and switches, not at every read: a fixed 3 ms of work once read the same figure twice (CI, under
    # load), so work until the figure moves (bounded, in case it never does).
    for _ in range(1000):
        sum(range(200_000))
        b = cpu_sample()
        if b.cpu > a.cpu:
            break
    assert b is not None and b.cpu > a.cpu
    got = cpu_got(a, b)
    assert got == (b.cpu - a.cpu) / ((b.cpu - a.cpu) + (b.wait - a.wait)) and 0 < got <= 1


def _watch_run(run_dir: Path) -> SimpleNamespace:
    """What :class:`HealthWatch` reads of a run: its directory, device and mesh, step and a real metrics logger."""
    info = SimpleNamespace(device=torch.device("cpu"), mesh=None, is_main=True)
    return SimpleNamespace(run_dir=run_dir, info=info, autocast=False, state=SimpleNamespace(step=0),
                           log=MetricsLogger(run_dir, 0, tensorboard=False))


def test_the_watcher_says_contention_once_and_a_damaged_first_measurement(tmp_path):
    host = socket.gethostname()
    (tmp_path / "health_first.json").write_text('[{"rank": 0, "host": "')  # torn by a kill
    figures = iter([{"matmul": 10.0}] + [{"matmul": 4.0}] * 6 + [{"matmul": 0.5}] * 2)
    shares = iter([1.0] + [0.3] * 6 + [1.0] * 2)
    watch = HealthWatch(HealthConfig(), measure_fn=lambda *a: (next(figures), {"share/matmul": next(shares)}))
    run = _watch_run(tmp_path)
    watch.check(run, "start-up")
    events = read_events(tmp_path)
    # before: replaced without a word
    assert [e["action"] for e in events] == ["replace"] and "health_first.json: damaged" in events[0]["text"]
    assert json.loads((tmp_path / "health_first.json").read_text())[0]["figures"] == {"matmul": 10.0}
    for step in (10, 20, 30):  # 0.4x its first, measured twice each, with 30% of the CPU it asked for
        run.state.step = step
        assert [o["cause"] for o in watch.check(run, "every 10 steps")] == ["contention"]
    run.state.step = 40  # 0.05x with the CPU to itself: a hardware alarm
    watch.check(run, "every 10 steps")
    health = [e for e in read_events(tmp_path) if e["kind"] == "health"]
    assert [(e["step"], e["action"]) for e in health] == [(0, "replace"), (10, "busy"), (40, "report")]
    assert "not a hardware fault" in health[1]["text"] and "matmul rate" in health[2]["text"]
    assert health[2]["values"]["host"] == host
    run.log.close()


def test_contention_said_once_per_figure_and_a_new_one_when_it_appears(tmp_path):
    # a busy host (30% of the CPU asked for): rank 0's matmul reads 0.4x its first from step 10, its memory from
    # step 20; each is said once, when it first appears (before: the memory outlier was never said, the host
    # having been found busy already), and a figure that recovers is said again if it falls again
    run = _watch_run(tmp_path)
    low = {0: (), 10: ("matmul",), 20: ("matmul", "memory"), 30: ("matmul", "memory"), 40: ("memory",),
           50: ("matmul", "memory")}  # the figures at 0.4x their first, by step

    def measure(*_):
        step = run.state.step
        return ({f: 4.0 if f in low[step] else 10.0 for f in ("matmul", "memory")},
                {"share/matmul": 0.3 if step else 1.0, "share/memory": 0.3 if step else 1.0})

    watch = HealthWatch(HealthConfig(), measure_fn=measure)
    watch.check(run, "start-up")
    for step in (10, 20, 30, 40, 50):
        run.state.step = step
        watch.check(run, "every 10 steps")
    busy = [e for e in read_events(tmp_path) if e["kind"] == "health" and e["action"] == "busy"]
    said = [(e["step"], [(o["rank"], o["figure"]) for o in e["values"]["outliers"]]) for e in busy]
    assert said == [(10, [(0, "matmul")]), (20, [(0, "memory")]), (50, [(0, "matmul")])], said
    assert all(o["cause"] == "contention" for e in busy for o in e["values"]["outliers"])
    run.log.close()


@pytest.mark.parametrize("world", [2, 3])
def test_slow_memory_on_rank_1_watchdog_then_health_names_rank_1_memory(prepared, tmp_path, world):
    # 3 ranks oversubscribe the 2-core test machine: the healthy ranks' figures spread (measured at start-up:
    # matmul 7.6, 15.8 and 50.7 GFLOP/s; after the fault memory 27.5 and 17.7 GB/s, rank 1 0.39), so rank 1's
    # robust z stays small (-1.2) and its own first measurement (0.06x) is what names it.
    _, make = prepared
    ov = {"train.steps": 10, "eval.every": 0, "logging.tensorboard": False, "probe.every": 0, "checkpoint.every": 0,
          "train.device": "cpu", "stages": [{"name": "main", "start": 0.0, "mix": {"email": 0.5, "json": 0.5}}],
          "watchdog.every": 2, "watchdog.warmup": 1, "watchdog.sustain": 2, "health.every": 1000,
          # A 2-core CPU shared with other jobs moved one rank's best-of-trials matmul rate to 0.24x of its own
          # first and 0.32x of its peer's (measured): a low bar here, and a rank 1 whose memory reads 1/50.
          "health.min_ratio": 0.15, "health.trials": 5, "train.batch_size": {2: 8, 3: 6}[world]}
    cfg = make(tmp_path, **ov, faults=[{"kind": "slow_memory", "step": 2, "rank": 1, "factor": 50.0}])
    res = finish(start(fresh(cfg, tmp_path), world=world))
    assert [rc for rc, _ in res] == [0] * world, [err[-3000:] for _, err in res]
    run = Path(cfg.train.run_dir)
    events = read_events(run)
    drop = [e for e in events if e["kind"] == "throughput"]
    assert drop and drop[0]["values"]["ranks"] == [1], [e["text"] for e in events]
    # What the health check named after the drop: hardware alarms (action 'report') and, on a host so busy that
    # rank 1's CPU share leaves its 1/50 within the per-CPU-second bar, the one 'busy' event (contention).
    # Which cause a share gives is judge()'s rule, tested on injected shares above; here the measurement is
    # this host's, so either cause may be right, but the figure named must be rank 1's memory.
    health = [e for e in events if e["kind"] == "health" and e["action"] in ("report", "busy")]
    # no alarm before the fault (the start-up check may find the host busy, which is no alarm)
    assert all(e["step"] >= drop[0]["step"] for e in health if e["action"] == "report"), [e["text"] for e in health]
    health = [e for e in health if e["step"] >= drop[0]["step"]]
    assert health, [e["text"] for e in events]
    found = [(e, o) for e in health for o in (e["values"]["outliers"] if e["action"] == "busy" else [e["values"]])]
    named = {(o["rank"], o["figure"]) for _, o in found}
    # Rank 1: its memory, not its matmul. Another rank's matmul may be named after the fault: sharing 2 cores,
    # a healthy rank of 3 read 0.18x its own first matmul rate (measured), near the bar.
    assert {(r, f) for r, f in named if r == 1 or f != "matmul"} == {(1, "memory")}, [e["text"] for e in health]
    (ev, o), = [(e, o) for e, o in found if o["rank"] == 1]
    assert o["ratio"] < 0.15 and "after the watchdog's throughput drop" in ev["text"]
    # the cause follows the rule: hardware exactly when the per-CPU-second ratio is beyond its bar
    assert (o["cause"] == "hardware") == (o["per_cpu_ratio"] < o["bar"]) and ev["action"] == (
        "report" if o["cause"] == "hardware" else "busy"), ev["text"]
    checks = [r for r in read_metrics(run) if r["kind"] == "health"]
    # a check at start-up (a clean run of `world` ranks: no health event) and one after the drop
    assert sorted({(r["step"], r["rank"]) for r in checks}) == [(s, r) for s in (0, drop[0]["step"])
                                                               for r in range(world)]


def _doctor(args: list[str], cwd: Path, world: int = 1) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"] if world > 1 else []
    return subprocess.run([sys.executable, *launch, "-m", "densetrain", "doctor", "--train.threads=1",
                           "--train.device=cpu", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _first_measurement(run_dir: Path, ranks: int, value: float) -> None:
    """A run's health_first.json whose figures are ``value`` on every rank of this host."""
    run_dir.mkdir()
    (run_dir / "health_first.json").write_text(json.dumps(
        [{"rank": r, "host": socket.gethostname(), "figures": {"matmul": value, "memory": value}} for r in range(2)]))


def test_doctor_under_torchrun_one_verdict_line_and_exit_0(tmp_path):
    # The run's first measurement, 1e20 on each rank: every rank's matmul and memory are far below it (even per
    # CPU-second on a loaded machine): a sure verdict, whatever this machine measures.
    _first_measurement(tmp_path / "run", 2, 1e20)
    p = _doctor([f"--train.run_dir={tmp_path / 'run'}"], tmp_path, world=2)
    # a verdict is not a failed rank: exit 0 without torchrun's error dump (before: exit 1 and ChildFailedError)
    assert p.returncode == 0 and "ChildFailedError" not in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    head, rows = lines[0].split(), [line.split() for line in lines[1:3]]
    assert head[:4] == ["rank", "host", "matmul", "(TFLOP/s)"] and "dp_replicate/all_reduce" in lines[0]
    assert [r[0] for r in rows] == ["0", "1"] and all(r[2].endswith("*") and r[3].endswith("*") for r in rows)
    assert len(lines) == 4 and lines[3].startswith("unhealthy: rank "), p.stdout
    assert "its own first measurement" in lines[3] and "nvidia-smi" not in lines[3]


def test_doctor_alone_exit_statuses_json_and_refused_flags(tmp_path, capsys):
    def doctor(*args: str) -> tuple[int, str, str]:
        code = main(["doctor", "--train.threads=1", "--train.device=cpu", *args])
        out, err = capsys.readouterr()
        return code, out, err

    _first_measurement(tmp_path / "run", 1, 1e20)
    code, out, _ = doctor("--json", f"--train.run_dir={tmp_path / 'run'}")
    got = json.loads(out)
    assert code == EXIT_UNHEALTHY and got["verdict"] == "unhealthy" and got["status"] == EXIT_UNHEALTHY
    assert {(o["rank"], o["figure"], o["vs"], o["cause"]) for o in got["outliers"]} == {
        (0, "matmul", "first", "hardware"), (0, "memory", "first", "hardware")}
    assert got["rows"][0]["context"]["cores"] >= 1
    # one rank and a damaged first measurement: nothing to compare with, said; healthy, exit 0
    (tmp_path / "run" / "health_first.json").write_text("[{")
    code, out, _ = doctor(f"--train.run_dir={tmp_path / 'run'}")
    assert code == 0, out
    note, line = out.splitlines()[-2:]
    assert note.startswith(f"note: {tmp_path / 'run' / 'health_first.json'}: damaged") and "across the ranks" in note
    assert line == "healthy: 1 rank(s), 1 host(s), every figure of every rank within its bounds"
    # flags doctor does not use are refused in one line (before: --faults accepted and ignored)
    for flag in ('--faults=[{kind="kill"}]', "--train.steps=3"):
        code, out, err = doctor(flag)
        assert code == 2 and out == "" and len(err.splitlines()) == 1, err
        assert "densetrain doctor does not use it" in err and flag.split("=")[0] in err
