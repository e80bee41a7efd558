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
network (a shared 2-core test machine moved its all-gather 2x between checks). Each outlier carries the seed's
advice.

Used by ``densetrain doctor`` (:func:`doctor`) and the training watcher :mod:`densetrain.train.watch.health`.
The ``slow_memory`` rehearsal fault (:mod:`densetrain.train.watch.faults`) calls :func:`throttle_memory`, after
which this process's copy benchmark reads ``1/factor`` of the real bandwidth.
"""

from __future__ import annotations

import math
import socket
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from densetrain.config.recovery import HealthConfig

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
ADVICE = {  # the seed's 7.2: find the device, then exclude the node and replace (or down-clock) it
    "memory": "degraded device memory (the seed's 7.2: HBM bandwidth dropped, bit flips followed): exclude the "
              "node (e.g. sbatch --exclude=HOST), replace the device, or down-clock it until it is replaced",
    "matmul": "the device computes slowly (clocks, thermal throttling, power cap): check nvidia-smi -q -d "
              "CLOCK,PERFORMANCE; exclude the node, replace or down-clock the device",
    "h2d": "slow host-to-device link (PCIe width/generation, NUMA placement): check the node; exclude it",
    "link": "a slow link in this process group (NIC, cable, switch port): exclude the node and check its network",
}


def throttle_memory(factor: float) -> None:
    """Rehearsal only (the ``slow_memory`` fault): from now on :func:`memory_bandwidth` in this process reports
    ``1/factor`` of the bandwidth it measured, as a device whose memory is ``factor`` times slower would read.
    Scaled, not slowed by more copies: ranks that share one host's memory (a CPU test) would lose bandwidth
    too, and a wait would make the check ``factor`` times longer."""
    _THROTTLE["memory"] = max(1.0, float(factor))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_rate(fn, work: float, device: torch.device, seconds: float, trials: int) -> float:
    """``work`` units per second of ``fn()``: the best of ``trials`` trials, each ~``seconds`` long (a warm-up
    call first). Only for work local to this process: the number of calls differs between ranks."""
    fn()
    _sync(device)
    best = 0.0
    for _ in range(trials):
        calls, t0 = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            _sync(device)
            dt = time.perf_counter() - t0
            if dt >= seconds:
                break
        best = max(best, work * calls / dt)
    return best


def matmul_rate(device: torch.device, dtype: torch.dtype, seconds: float = 0.02, trials: int = 3) -> float:
    """FLOP/s of ``n x n`` matmuls in ``dtype`` on ``device`` (n from :data:`MATMUL_N`)."""
    n = MATMUL_N.get(dtype, 512)
    # Constant operands: drawing random ones would advance the training's global RNG.
    a, b = torch.full((n, n), 0.01, device=device, dtype=dtype), torch.full((n, n), 0.02, device=device, dtype=dtype)
    return _best_rate(lambda: a @ b, 2.0 * n**3, device, seconds, trials)


def memory_bandwidth(device: torch.device, mib: int = 64, seconds: float = 0.02, trials: int = 3) -> float:
    """Bytes/s of copying a ``mib`` MiB buffer on ``device`` (read + write counted, as STREAM's copy)."""
    src = torch.ones(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    rate = _best_rate(lambda: dst.copy_(src), 2.0 * src.numel() * 4, device, seconds, trials)
    return rate / _THROTTLE["memory"]


def h2d_bandwidth(device: torch.device, mib: int = 64, seconds: float = 0.02, trials: int = 3) -> float:
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


def measure(device: torch.device, dtype: torch.dtype, mesh, cfg: HealthConfig) -> dict[str, float]:
    """This rank's figures (module docstring). Every rank of the mesh must call it at the same point."""
    out = {"matmul": matmul_rate(device, dtype, cfg.seconds, cfg.trials),
           "memory": memory_bandwidth(device, cfg.copy_mib, cfg.seconds, cfg.trials)}
    if device.type == "cuda":
        out["h2d"] = h2d_bandwidth(device, cfg.copy_mib, cfg.seconds, cfg.trials)
    for name, group in mesh_groups(mesh):
        out.update(collective_figures(group, name, device, cfg.trials))
    return out


@dataclass
class Row:
    """One rank's figures: ``rank``, ``host`` and ``figures`` (name -> value; units in :data:`UNITS`)."""

    rank: int
    host: str
    figures: dict[str, float]


def gather(figures: dict[str, float]) -> list[Row]:
    """Every rank's :class:`Row`, on every rank (one ``all_gather_object``; just this one without a group)."""
    row = {"rank": dist.get_rank() if dist.is_initialized() else 0, "host": socket.gethostname(), "figures": figures}
    if not dist.is_initialized():
        return [Row(**row)]
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)  # pickled between this job's own processes, never read from a file
    return [Row(**r) for r in rows]


def _kind(figure: str) -> str:
    return figure.split("/")[-1]


def _advice(figure: str) -> str:
    return ADVICE.get(_kind(figure), ADVICE["link"])


def judge(rows: list[Row], first: list[Row] | None, cfg: HealthConfig) -> list[dict]:
    """Outliers among ``rows`` (module docstring): dicts with rank, host, figure, value, median, ratio (value
    over the median, or over the rank's first value with ``vs = 'first'``), z, vs, text."""
    out = []
    figures = sorted({k for r in rows for k in r.figures})
    for fig in figures:
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
                out.append(_outlier(r, fig, v, med, ratio, z, "median"))
                continue
            base = next((b for b in first or [] if b.rank == r.rank and b.host == r.host), None)
            if base is not None and "/" not in fig and base.figures.get(fig, 0) > 0:
                own = v / base.figures[fig]
                if (own > 1 / cfg.min_ratio) if lower_better else (own < cfg.min_ratio):
                    out.append(_outlier(r, fig, v, base.figures[fig], own, z, "first"))
    return out


def _outlier(r: Row, fig: str, value: float, ref: float, ratio: float, z: float, vs: str) -> dict:
    unit, scale = UNITS[_kind(fig)]
    group = f" ({fig.split('/')[0]} group)" if "/" in fig else ""
    against = "the median of the ranks" if vs == "median" else "its own first measurement"
    text = (f"rank {r.rank} on {r.host}: {LABELS[_kind(fig)]}{group} {value / scale:.3g} {unit}, {ratio:.2f}x "
            f"{against} ({ref / scale:.3g} {unit}): {_advice(fig)}")
    return {"rank": r.rank, "host": r.host, "figure": fig, "value": value, "median" if vs == "median" else "first": ref,
            "ratio": ratio, "z": z, "vs": vs, "text": text}


def format_table(rows: list[Row], outliers: list[dict]) -> str:
    """One line per rank: rank, host and each figure in its unit; an outlier figure is marked ``*``."""
    figs = sorted({k for r in rows for k in r.figures}, key=lambda f: (f.count("/"), f))
    flagged = {(o["rank"], o["figure"]) for o in outliers}
    heads = ["rank", "host"] + [f"{f} ({UNITS[_kind(f)][0]})" for f in figs]
    lines = [[str(r.rank), r.host] + [f"{r.figures[f] / UNITS[_kind(f)][1]:.3g}" + ("*" if (r.rank, f) in flagged
                                                                                       else "")
                                       if f in r.figures else "-" for f in figs] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(heads, *lines, strict=True)]
    return "\n".join("  ".join(x.rjust(w) for x, w in zip(line, widths, strict=True)) for line in [heads, *lines])


def check(device: torch.device, dtype: torch.dtype, mesh, cfg: HealthConfig,
          first: list[Row] | None = None) -> tuple[list[Row], list[dict]]:
    """Measure on every rank, gather and judge: (rows, outliers), the same on every rank."""
    rows = gather(measure(device, dtype, mesh, cfg))
    return rows, judge(rows, first, cfg)
