"""Hardware health: per-rank measurements of the device and its links, compared across ranks and with the
rank's own first measurement (the diagnosis step of the seed's post-mortem 7.2: MFU fell from 50% to 35%
over 30 days; checking every GPU found two whose memory bandwidth had dropped).

Figures, each the best of ``trials`` timed trials (contention from another process only lowers a trial):

- ``matmul``: FLOP/s of square matmuls in the training dtype (``2 n^3`` FLOPs each).
- ``memory``: bytes/s of a STREAM-like copy of a ``copy_mib`` buffer (read + write: 2 bytes moved per byte
  copied, as STREAM counts its copy kernel; McCalpin, "STREAM", 1995).
- ``h2d``: host-to-device bytes/s from pinned memory (only where there is a CUDA device).
- per process group of the mesh (dims of size > 1), e.g. ``dp_shard/all_reduce``: all-reduce and
  all-gather bus bandwidth (NCCL-tests' busbw: ``2(n-1)/n`` x bytes / time for all-reduce, ``(n-1)/n`` x
  the gathered bytes / time for all-gather) and the latency of a one-element call (``.../all_reduce_lat``,
  seconds: lower is better). Collectives run a fixed number of iterations (every rank the same count).

:func:`judge` flags a figure as an outlier when it is below ``min_ratio`` of the ranks' median (a latency:
above its inverse) and, with 3 or more ranks, its robust z-score ``(x - median) / (1.4826 MAD)`` is beyond
``zscore`` (with 2 ranks every |z| is 0.67, so the ratio alone decides); or, for the rank's own figures
(matmul, memory, h2d), when it is below ``min_ratio`` of the same rank's first measurement on the same host.
Collective figures are compared across ranks only: their own history moves with whatever else shares the
network (a shared 2-core test machine moved its all-gather 2x between checks).

A busy machine is not a faulty one. Each figure is measured with the share of CPU time its process got of the
time its threads asked for (:func:`cpu_sample`: CPU time against run-queue wait, from Linux's schedstat), and
each row carries the host's load average and core count, and on a GPU the other processes on the device and its
clocks (NVML, where ``pynvml`` is installed). An outlier is named a **hardware** fault only when it stays an
outlier per CPU-second (the figure divided by that share), by a wider gap the less CPU it got (:func:`judge`),
and no other process shares the GPU; otherwise its cause is **contention** (other processes took the CPU or the
device), said as such, with no advice to replace anything. :func:`check` measures again before naming anything
(the better of the two measurements is kept: contention only lowers a figure), and the advice fits the device
measured (no nvidia-smi on a CPU).
:func:`verdict` turns the outliers into one line and an exit status (``densetrain doctor``).

Used by ``densetrain doctor`` (:func:`doctor`) and the training watcher :mod:`densetrain.train.watch.health`.
The ``slow_memory`` rehearsal fault (:mod:`densetrain.train.watch.faults`) calls :func:`throttle_memory`, after
which this process's copy benchmark reads ``1/factor`` of the real bandwidth.
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from densetrain.config.recovery import HealthConfig
from densetrain.fileio import read_json

try:  # NVML (nvidia-ml-py): the other processes on a GPU and its clocks; absent on CPU hosts
    import pynvml
except ImportError:  # pragma: no cover - depends on the host
    pynvml = None

_THROTTLE = {"memory": 1.0}  # the slow_memory rehearsal: copies made per copy counted (1: the real figure)
COLLECTIVE_MIB = 4  # all-reduce / all-gather payload per rank: large enough that bandwidth, not latency, dominates
MATMUL_N = {torch.float32: 512, torch.bfloat16: 1024}  # a few ms per matmul on a CPU core, ~100 us on a GPU
LATENCY_ITERS = 20
BANDWIDTH_ITERS = 3

UNITS = {"matmul": ("TFLOP/s", 1e12), "memory": ("GB/s", 1e9), "h2d": ("GB/s", 1e9), "all_reduce": ("GB/s", 1e9),
         "all_gather": ("GB/s", 1e9), "all_reduce_lat": ("us", 1e-6), "all_gather_lat": ("us", 1e-6)}
LABELS = {"matmul": "matmul rate", "memory": "memory bandwidth", "h2d": "host-to-device bandwidth",
          "all_reduce": "all-reduce bandwidth", "all_gather": "all-gather bandwidth",
          "all_reduce_lat": "all-reduce latency", "all_gather_lat": "all-gather latency"}
EXCLUDE = "exclude the node (e.g. sbatch --exclude=HOST)"
ADVICE = {  # the seed's 7.2: find the device, then exclude the node and replace (or down-clock) it
    ("memory", "cuda"): "degraded device memory (the seed's 7.2: HBM bandwidth dropped, bit flips followed): "
                        f"{EXCLUDE}, replace the device, or down-clock it until it is replaced",
    ("matmul", "cuda"): "the device computes slowly (clocks, thermal throttling, power cap): check nvidia-smi -q -d "
                        f"CLOCK,PERFORMANCE; {EXCLUDE}, replace or down-clock the device",
    ("h2d", "cuda"): f"slow host-to-device link (PCIe width/generation, NUMA placement): check the node; {EXCLUDE}",
    ("memory", "cpu"): "slow host memory (a failed or missing DIMM, fewer memory channels, remote NUMA memory): "
                       f"check dmidecode -t memory and numactl --hardware; {EXCLUDE}",
    ("matmul", "cpu"): "the CPU computes slowly (frequency scaling, thermal or power limits): check its clocks "
                       "(lscpu, /sys/devices/system/cpu/cpu*/cpufreq/scaling_cur_freq) and the BIOS power "
                       f"settings; {EXCLUDE}",
    ("link", ""): f"a slow link in this process group (NIC, cable, switch port): {EXCLUDE} and check its network",
}
BUSY_SHARE = 0.8
"""A process that got less than this share of the CPU time its threads asked for was slowed by others."""
MIN_TRUST = 0.25
"""The least trust in a figure measured with a small CPU share: its outlier bar is at least ``min_ratio`` x this."""
EXIT_UNHEALTHY, EXIT_BUSY = 1, 3
"""``densetrain doctor``'s exit statuses besides 0 (healthy) and 2 (bad input): a hardware outlier named; only
contention found (the figures cannot be judged on a busy host)."""


@dataclass
class CpuSample:
    """This process's CPU clocks at one moment (:func:`cpu_sample`): ``wall`` (s since the epoch), ``cpu`` and
    ``wait`` (CPU time and run-queue wait, s, summed over its threads) and ``waits`` (thread id -> its wait)."""

    wall: float
    cpu: float
    wait: float
    waits: dict[int, float]


def cpu_sample() -> CpuSample | None:
    """This process's CPU time and the time its threads spent runnable but waiting for a core (Linux's
    ``/proc/self/task/*/schedstat``: ``cpu_ns run_delay_ns slices``, kernel CONFIG_SCHED_INFO; a thread that
    sleeps or waits for I/O or a peer adds to neither). None where the files are missing (another OS,
    schedstat off)."""
    cpu, waits = 0.0, {}
    try:
        for task in Path("/proc/self/task").iterdir():
            try:
                fields = (task / "schedstat").read_text().split()
            except OSError:  # a thread that ended meanwhile
                continue
            cpu += int(fields[0]) / 1e9
            waits[int(task.name)] = int(fields[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None
    return CpuSample(time.time(), cpu, sum(waits.values()), waits)


def cpu_got(before: CpuSample | None, after: CpuSample | None) -> float | None:
    """Share of the CPU time this process's threads asked for between two :func:`cpu_sample` calls that they
    got: CPU / (CPU + run-queue wait), 1.0 on a quiet host; None when unknown or nothing ran."""
    if before is None or after is None:
        return None
    cpu, wait = after.cpu - before.cpu, after.wait - before.wait
    return cpu / (cpu + wait) if cpu + wait > 0 else None


def cpu_waited(before: CpuSample | None, after: CpuSample | None) -> float:
    """Seconds of wall time the process lost waiting for a core between two samples: the longest run-queue
    wait of any one thread (threads that wait side by side lose the same wall time once); 0.0 when unknown."""
    if before is None or after is None:
        return 0.0
    return max((w - before.waits.get(tid, 0.0) for tid, w in after.waits.items()), default=0.0)


def host_load() -> dict[str, float]:
    """``load`` (the 1-minute load average: runnable and uninterruptible tasks, the host's and ours) and
    ``cores`` (the cores this process may run on)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        return {"load": os.getloadavg()[0], "cores": float(cores)}
    except (AttributeError, OSError):  # no load average on this OS: unknown, left out
        return {"cores": float(cores)}


def gpu_context(device: torch.device) -> dict[str, float]:
    """On a CUDA device with NVML: ``gpu_others`` (compute processes on the device besides this one) and
    ``clock_ratio`` (SM clock over its maximum; below 1 under a thermal or power limit, or idle), ``throttled``
    (1.0 when NVML names a thermal or power slowdown). Empty elsewhere (CPU, no pynvml, NVML errors)."""
    if device.type != "cuda" or pynvml is None:
        return {}
    try:
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(device.index if device.index is not None else torch.cuda.current_device())
        others = [p for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) if p.pid != os.getpid()]
        clock = pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
        top = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM)
        reasons = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)
        hot = reasons & (pynvml.nvmlClocksThrottleReasonSwPowerCap | pynvml.nvmlClocksThrottleReasonHwSlowdown
                         | pynvml.nvmlClocksThrottleReasonSwThermalSlowdown)
        return {"gpu_others": float(len(others)), "clock_ratio": clock / top if top else math.nan,
                "throttled": float(bool(hot))}
    except Exception:  # noqa: BLE001 - NVML missing or refusing (a container without the library): unknown
        return {}


def throttle_memory(factor: float) -> None:
    """Rehearsal only (the ``slow_memory`` fault): from now on :func:`memory_bandwidth` in this process reports
    ``1/factor`` of the bandwidth it measured, as a device whose memory is ``factor`` times slower would read.
    Scaled, not slowed by more copies: ranks that share one host's memory (a CPU test) would lose bandwidth
    too, and a wait would make the check ``factor`` times longer."""
    _THROTTLE["memory"] = max(1.0, float(factor))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_rate(fn, work: float, device: torch.device, seconds: float, trials: int,
               clock=time.perf_counter) -> tuple[float, float | None]:
    """(``work`` units per second of ``fn()``, the share of the CPU time it asked for that it got in that trial
    (:func:`cpu_got`; None on a GPU, where the host thread waits for the device)): the best of ``trials``
    trials, each ~``seconds`` long by ``clock`` (seconds; tests inject one; a warm-up call first). Only for work
    local to this process: the number of calls differs between ranks."""
    fn()
    _sync(device)
    best, share = 0.0, None
    for _ in range(trials):
        calls, t0, c0 = 0, clock(), cpu_sample()
        while True:
            fn()
            calls += 1
            _sync(device)
            dt = clock() - t0
            if dt >= seconds:
                break
        if work * calls / dt > best:
            best, share = work * calls / dt, cpu_got(c0, cpu_sample()) if device.type == "cpu" else None
    return best, share


def matmul_rate(device: torch.device, dtype: torch.dtype, seconds: float = 0.02,
                trials: int = 3) -> tuple[float, float | None]:
    """(FLOP/s, CPU share as :func:`_best_rate`) of ``n x n`` matmuls in ``dtype`` on ``device`` (n from
    :data:`MATMUL_N`)."""
    n = MATMUL_N.get(dtype, 512)
    # Constant operands: drawing random ones would advance the training's global RNG.
    a, b = torch.full((n, n), 0.01, device=device, dtype=dtype), torch.full((n, n), 0.02, device=device, dtype=dtype)
    return _best_rate(lambda: a @ b, 2.0 * n**3, device, seconds, trials)


def memory_bandwidth(device: torch.device, mib: int = 64, seconds: float = 0.02, trials: int = 3,
                     clock=time.perf_counter) -> tuple[float, float | None]:
    """(bytes/s, CPU share as :func:`_best_rate`) of copying a ``mib`` MiB buffer on ``device`` (read + write
    counted, as STREAM's copy); ``1/factor`` of it after :func:`throttle_memory`."""
    src = torch.ones(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    rate, share = _best_rate(lambda: dst.copy_(src), 2.0 * src.numel() * 4, device, seconds, trials, clock)
    return rate / _THROTTLE["memory"], share


def h2d_bandwidth(device: torch.device, mib: int = 64, seconds: float = 0.02,
                  trials: int = 3) -> tuple[float, float | None]:
    """Bytes/s of copying a pinned ``mib`` MiB host buffer to ``device`` (CUDA only)."""
    src = torch.ones(mib * 2**20 // 4, pin_memory=True)
    dst = torch.empty(src.shape, device=device)
    return _best_rate(lambda: dst.copy_(src, non_blocking=True), src.numel() * 4.0, device, seconds, trials)


def _timed_collective(fn, device: torch.device, iters: int, trials: int) -> float:
    """Best mean seconds per call of the collective ``fn`` over ``trials`` trials of ``iters`` calls each:
    a fixed count, so that every rank of the group makes the same calls."""
    fn()
    _sync(device)
    best = math.inf
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def collective_figures(group, name: str, device: torch.device, trials: int = 3) -> dict[str, float]:
    """All-reduce and all-gather bus bandwidth (bytes/s) and one-element latency (s) over ``group``, keyed
    ``'{name}/all_reduce'`` etc. Every rank of ``group`` must call it at the same point."""
    n = dist.get_world_size(group)
    numel = COLLECTIVE_MIB * 2**20 // 4
    big, tiny = torch.ones(numel, device=device), torch.ones(1, device=device)
    out_big = [torch.empty_like(big) for _ in range(n)]
    out_tiny = [torch.empty_like(tiny) for _ in range(n)]
    t_ar = _timed_collective(lambda: dist.all_reduce(big, group=group), device, BANDWIDTH_ITERS, trials)
    t_ag = _timed_collective(lambda: dist.all_gather(out_big, big, group=group), device, BANDWIDTH_ITERS, trials)
    lat_ar = _timed_collective(lambda: dist.all_reduce(tiny, group=group), device, LATENCY_ITERS, trials)
    lat_ag = _timed_collective(lambda: dist.all_gather(out_tiny, tiny, group=group), device, LATENCY_ITERS, trials)
    nbytes = numel * 4.0
    return {f"{name}/all_reduce": 2 * (n - 1) / n * nbytes / t_ar, f"{name}/all_gather": (n - 1) * nbytes / t_ag,
            f"{name}/all_reduce_lat": lat_ar, f"{name}/all_gather_lat": lat_ag}


def mesh_groups(mesh) -> list[tuple[str, object]]:
    """(dim name, process group) of every dim of ``mesh`` with more than one rank (none without a mesh)."""
    if mesh is None:
        return []
    return [(name, mesh[name].get_group()) for name in mesh.mesh_dim_names if mesh[name].size() > 1]


def measure(device: torch.device, dtype: torch.dtype, mesh,
            cfg: HealthConfig) -> tuple[dict[str, float], dict[str, float]]:
    """This rank's (figures, context) (module docstring): context holds ``share/<figure>`` (the CPU share of
    the figure's best trial, CPU devices), :func:`host_load` and :func:`gpu_context`. Every rank of the mesh
    must call it at the same point."""
    figures, context = {}, {}
    for name, (value, share) in (("matmul", matmul_rate(device, dtype, cfg.seconds, cfg.trials)),
                                 ("memory", memory_bandwidth(device, cfg.copy_mib, cfg.seconds, cfg.trials))):
        figures[name] = value
        if share is not None:
            context[f"share/{name}"] = share
    if device.type == "cuda":
        figures["h2d"] = h2d_bandwidth(device, cfg.copy_mib, cfg.seconds, cfg.trials)[0]
    for name, group in mesh_groups(mesh):
        c0 = cpu_sample()
        group_figures = collective_figures(group, name, device, cfg.trials)
        share = cpu_got(c0, cpu_sample()) if device.type == "cpu" else None  # waiting for peers is not CPU time
        figures.update(group_figures)
        context.update({f"share/{k}": share for k in group_figures if share is not None})
    return figures, {**context, **host_load(), **gpu_context(device)}


@dataclass
class Row:
    """One rank's figures: ``rank``, ``host``, ``figures`` (name -> value; units in :data:`UNITS`), ``device``
    (the device type measured: 'cpu', 'cuda') and ``context`` (:func:`measure`: CPU shares, load, GPU)."""

    rank: int
    host: str
    figures: dict[str, float]
    device: str = "cpu"
    context: dict[str, float] = field(default_factory=dict)

    def share(self, fig: str) -> float:
        """The CPU share ``fig`` was measured with (1.0 when unknown), at least 0.01."""
        v = self.context.get(f"share/{fig}")
        return 1.0 if v is None or not math.isfinite(v) else max(0.01, min(1.0, v))


def gather(figures: dict[str, float], device: str = "cpu", context: dict[str, float] | None = None) -> list[Row]:
    """Every rank's :class:`Row`, on every rank (one ``all_gather_object``; just this one without a group)."""
    row = {"rank": dist.get_rank() if dist.is_initialized() else 0, "host": socket.gethostname(), "figures": figures,
           "device": device, "context": context or {}}
    if not dist.is_initialized():
        return [Row(**row)]
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)  # pickled between this job's own processes, never read from a file
    return [Row(**r) for r in rows]


def _kind(figure: str) -> str:
    return figure.split("/")[-1]


def _advice(figure: str, device: str) -> str:
    kind = _kind(figure)
    if "/" in figure:
        return ADVICE[("link", "")]
    return ADVICE.get((kind, device)) or ADVICE.get((kind, "cuda")) or ADVICE[("link", "")]


def _per_cpu(rows: list[Row]) -> list[Row]:
    """``rows`` with each figure scaled to a whole CPU: a rate divided by the share of CPU time it got, a
    latency multiplied by it (what the device delivers per CPU-second; contention does not change it)."""
    return [Row(r.rank, r.host, {f: v * r.share(f) if f.endswith("_lat") else v / r.share(f)
                                 for f, v in r.figures.items()}, r.device, r.context) for r in rows]


def _raw_outliers(rows: list[Row], first: list[Row] | None, cfg: HealthConfig) -> dict[tuple[int, str], list[dict]]:
    """(rank, figure) -> its outlier readings (without cause and text) by the rule of the module docstring: against
    the median of the ranks, against the rank's first measurement, or both."""
    out = {}
    for fig in sorted({k for r in rows for k in r.figures}):
        lower_better = fig.endswith("_lat")
        vals = [r.figures[fig] for r in rows if fig in r.figures]
        med = statistics.median(vals)
        mad = statistics.median(abs(v - med) for v in vals)
        for r in rows:
            if fig not in r.figures or med <= 0:
                continue
            v = r.figures[fig]
            ratio = v / med
            z = (v - med) / (1.4826 * mad) if mad > 0 else 0.0
            worse = ratio > 1 / cfg.min_ratio if lower_better else ratio < cfg.min_ratio
            if worse and (len(vals) < 3 or abs(z) > cfg.zscore):
                out.setdefault((r.rank, fig), []).append(
                    {"rank": r.rank, "host": r.host, "figure": fig, "value": v, "median": med, "ratio": ratio,
                     "z": z, "vs": "median"})
            base = next((b for b in first or [] if b.rank == r.rank and b.host == r.host), None)
            if base is not None and "/" not in fig and base.figures.get(fig, 0) > 0:
                own = v / base.figures[fig]
                if (own > 1 / cfg.min_ratio) if lower_better else (own < cfg.min_ratio):
                    out.setdefault((r.rank, fig), []).append(
                        {"rank": r.rank, "host": r.host, "figure": fig, "value": v, "first": base.figures[fig],
                         "ratio": own, "z": z, "vs": "first"})
    return out


def judge(rows: list[Row], first: list[Row] | None, cfg: HealthConfig) -> list[dict]:
    """Outliers among ``rows`` (module docstring): dicts with rank, host, figure, value, median (or first, with
    ``vs = 'first'``), ratio (value over the median, or over the rank's first value), z, vs, cause
    ('hardware' or 'contention'), per_cpu_ratio (the same ratio per CPU-second), bar (the per-CPU-second ratio
    a hardware outlier must pass) and text.

    The cause is 'hardware' when the per-CPU-second ratio is still beyond ``min_ratio`` x the trust in the
    measurement (the lower CPU share of the figure and of what it is compared with, over :data:`BUSY_SHARE`,
    between :data:`MIN_TRUST` and 1) and no other process shares the GPU: the less CPU time a figure got, the
    less it tells (20 ms trials at a 5% share are 1 ms of work), so the wider the gap must be. A CPU rank
    measured at a 3-7% share (load 17-20 on 2 cores) moved its per-CPU-second figures by up to 0.7x between
    checks; a gap of 1/(0.6 x 0.25) = 6.7x is no such noise, and the slow_memory rehearsal's 1/50 stays beyond
    it."""
    by_rank = {r.rank: r for r in rows}
    out = []
    for readings in _raw_outliers(rows, first, cfg).values():
        judged = []
        for o in readings:
            r = by_rank[o["rank"]]
            ratio_cpu, share = _ratio_per_cpu(rows, first, o)
            bar = cfg.min_ratio * min(1.0, max(MIN_TRUST, share / BUSY_SHARE))
            beyond = ratio_cpu > 1 / bar if o["figure"].endswith("_lat") else ratio_cpu < bar
            cause = "hardware" if beyond and not r.context.get("gpu_others", 0) > 0 else "contention"
            judged.append({**o, "cause": cause, "per_cpu_ratio": ratio_cpu, "bar": bar,
                           "text": _text(r, o, cause, ratio_cpu)})
        # A figure below its peers' median only because its rank got less CPU (contention) can still be far
        # below its own first measurement per CPU-second: that reading names the hardware, and wins.
        out.append(next((o for o in judged if o["cause"] == "hardware"), judged[0]))
    return out


def _ratio_per_cpu(rows: list[Row], first: list[Row] | None, o: dict) -> tuple[float, float]:
    """(the ratio of outlier ``o`` per CPU-second (:func:`_per_cpu`), the lower of the CPU shares of its figure
    and of the reference: the rank's first measurement, or the median share of the ranks)."""
    fig, rank = o["figure"], o["rank"]
    scaled = {r.rank: r for r in _per_cpu(rows)}
    own = next(r for r in rows if r.rank == rank).share(fig)
    if o["vs"] == "first":
        base = next(b for b in first or [] if b.rank == rank and b.host == o["host"])
        return scaled[rank].figures[fig] / _per_cpu([base])[0].figures[fig], min(own, base.share(fig))
    med = statistics.median(r.figures[fig] for r in scaled.values() if fig in r.figures)
    ref = statistics.median(r.share(fig) for r in rows if fig in r.figures)
    return (scaled[rank].figures[fig] / med if med > 0 else math.nan), min(own, ref)


def _busy_text(r: Row) -> str:
    """What made ``r``'s host busy, from its context."""
    parts = []
    shares = [v for k, v in r.context.items() if k.startswith("share/") and v is not None]
    if shares:
        parts.append(f"this process got {min(shares):.0%} of the CPU time it asked for")
    if math.isfinite(r.context.get("load", math.nan)):
        parts.append(f"load average {r.context['load']:.1f} on {r.context.get('cores', 0):.0f} cores")
    if r.context.get("gpu_others", 0) > 0:
        parts.append(f"{r.context['gpu_others']:.0f} other process(es) on the GPU")
    return "; ".join(parts) or "no figures of the host's load"


def _text(r: Row, o: dict, cause: str, per_cpu: float) -> str:
    fig = o["figure"]
    unit, scale = UNITS[_kind(fig)]
    group = f" ({fig.split('/')[0]} group)" if "/" in fig else ""
    against = "the median of the ranks" if o["vs"] == "median" else "its own first measurement"
    ref = o["median"] if o["vs"] == "median" else o["first"]
    head = (f"rank {r.rank} on {r.host}: {LABELS[_kind(fig)]}{group} {o['value'] / scale:.3g} {unit}, "
            f"{o['ratio']:.2f}x {against} ({ref / scale:.3g} {unit})")
    if cause == "contention":
        return (f"{head}, {per_cpu:.2f}x per CPU-second, while the host is busy ({_busy_text(r)}): other "
                "processes slowed it, not a hardware fault; judge the device again on a quiet host")
    clocks = ""
    if r.context.get("throttled"):
        clocks = f" (NVML: clocks at {r.context.get('clock_ratio', math.nan):.0%} of their maximum, throttled)"
    return f"{head}{clocks}: {_advice(fig, r.device)}"


def format_table(rows: list[Row], outliers: list[dict]) -> str:
    """One line per rank: rank, host and each figure in its unit; a hardware outlier is marked ``*``, one
    from contention ``~``."""
    figs = sorted({k for r in rows for k in r.figures}, key=lambda f: (f.count("/"), f))
    mark = {(o["rank"], o["figure"]): "*" if o["cause"] == "hardware" else "~" for o in outliers}
    heads = ["rank", "host"] + [f"{f} ({UNITS[_kind(f)][0]})" for f in figs]
    lines = [[str(r.rank), r.host] + [f"{r.figures[f] / UNITS[_kind(f)][1]:.3g}" + mark.get((r.rank, f), "")
                                       if f in r.figures else "-" for f in figs] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(heads, *lines, strict=True)]
    return "\n".join("  ".join(x.rjust(w) for x, w in zip(line, widths, strict=True)) for line in [heads, *lines])


def best_of(a: list[Row], b: list[Row]) -> list[Row]:
    """Per rank and figure the better of two measurements (the higher rate, the lower latency; contention only
    worsens one), with the CPU share that figure was measured with."""
    out = []
    for ra, rb in zip(a, b, strict=True):
        figures, context = dict(ra.figures), {**ra.context, **{k: v for k, v in rb.context.items()
                                                                 if not k.startswith("share/")}}
        for f, vb in rb.figures.items():
            va = figures.get(f)
            if va is None or ((vb < va) if f.endswith("_lat") else (vb > va)):
                figures[f] = vb
                if f"share/{f}" in rb.context:
                    context[f"share/{f}"] = rb.context[f"share/{f}"]
        out.append(Row(ra.rank, ra.host, figures, ra.device, context))
    return out


def check(device: torch.device, dtype: torch.dtype, mesh, cfg: HealthConfig,
          first: list[Row] | None = None, measure_fn=None) -> tuple[list[Row], list[dict]]:
    """Measure on every rank, gather and judge; when anything is an outlier, measure again and judge the better
    of the two (:func:`best_of`), so that a moment of contention names nothing: (rows, outliers), the same on
    every rank. ``measure_fn(device, dtype, mesh, cfg) -> (figures, context)``: :func:`measure` unless given
    (tests inject figures)."""
    fn = measure_fn or measure
    rows = gather(*_with_device(fn(device, dtype, mesh, cfg), device))
    outliers = judge(rows, first, cfg)
    if outliers:  # every rank sees the same outliers: every rank measures again
        rows = best_of(rows, gather(*_with_device(fn(device, dtype, mesh, cfg), device)))
        outliers = judge(rows, first, cfg)
    return rows, outliers


def _with_device(measured: tuple[dict, dict], device: torch.device) -> tuple[dict, str, dict]:
    figures, context = measured
    return figures, device.type, context


def verdict(rows: list[Row], outliers: list[dict]) -> tuple[int, str]:
    """(exit status, one line) of a check: 0 ``healthy``; :data:`EXIT_UNHEALTHY` ``unhealthy: <the worst
    hardware outlier's text>`` (and how many more); :data:`EXIT_BUSY` ``busy: ...`` when only contention was
    found (a busy host cannot tell a slow device)."""
    hard = sorted((o for o in outliers if o["cause"] == "hardware"), key=lambda o: o["per_cpu_ratio"])
    busy = [o for o in outliers if o["cause"] == "contention"]
    more = lambda n: f" (and {n} more outlier(s): see the table)" if n else ""  # noqa: E731
    if hard:
        return EXIT_UNHEALTHY, f"unhealthy: {hard[0]['text']}{more(len(outliers) - 1)}"
    if busy:
        return EXIT_BUSY, f"busy: {busy[0]['text']}{more(len(busy) - 1)}"
    return 0, (f"healthy: {len(rows)} rank(s), {len({r.host for r in rows})} host(s), every figure of every rank "
               "within its bounds")


def read_first(path: Path) -> tuple[list[Row] | None, str]:
    """A run's first check (``RUN_DIR/health_first.json``): (rows, '') or, for a missing file, (None, ''); for a
    damaged one (None, one line saying so: the caller reports it, as other damaged run files are)."""
    if not path.exists():
        return None, ""
    try:
        recs = read_json(path)
        rows = [Row(**r) for r in recs]
        if not rows or not all(isinstance(r.figures, dict) and all(isinstance(v, (int, float)) for v in
                                                                     r.figures.values()) for r in rows):
            raise ValueError("expected a list of rows with numeric figures")
    except (OSError, ValueError, TypeError) as e:
        return None, f"{path}: damaged ({str(e).splitlines()[0][:200] if str(e) else type(e).__name__}), not used"
    return rows, ""


def rows_json(rows: list[Row]) -> list[dict]:
    """``rows`` as JSON-ready dicts (what ``health_first.json`` and ``doctor --json`` hold)."""
    return [asdict(r) for r in rows]
