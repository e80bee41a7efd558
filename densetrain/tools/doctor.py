"""``densetrain doctor``: the hardware health check of every rank (:mod:`densetrain.health`) as a command:
the table, the verdict line, ``--json``, the comparison with a run's first measurement and the exit statuses.
Its flags are declared in :func:`densetrain.cli.build_parser` (``if name == "doctor"``), one line each."""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

from densetrain.config import Config, ModelConfig, parse_overrides
from densetrain.cost import measured_hardware, write_hardware
from densetrain.errors import ConfigError
from densetrain.fileio import json_text
from densetrain.health import check, format_table, read_first, rows_json, verdict
from densetrain.loss import token_losses
from densetrain.model.init import build_model
from densetrain.parallel import init_distributed
from densetrain.parallel.loss_parallel import loss_parallel_context, vocab_parallel_head
from densetrain.parallel.parallelize import apply_fsdp, apply_tensor_parallel


def doctor(cfg: Config, args: argparse.Namespace) -> int:
    """Hardware health of every rank (:mod:`densetrain.health`), alone or under torchrun: one table row per
    rank, then one verdict line (``healthy``, ``unhealthy: <rank, figure, why>`` or ``busy: ...`` when only
    contention from other processes was found), or with ``--json`` one JSON object (verdict, status, line, note,
    rows, outliers). With ``--train.run_dir RUN_DIR`` each rank is also compared with that run's first
    measurement (``RUN_DIR/health_first.json``). The matmul dtype: bf16 with ``train.dtype = 'bf16'`` (or 'auto'
    on a GPU), else fp32. Exit status (``densetrain doctor --help``): 0 healthy, 1 unhealthy, 3 busy, 2 bad input;
    under torchrun 0 after any verdict."""
    if getattr(args, "profile", None):
        check_profile_path(args.profile)  # before minutes of measuring, not after
    info = init_distributed(cfg.train.device, cfg.parallel)
    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    first, note = None, ""
    if any(k == "train.run_dir" for k, _ in parse_overrides(args.rest)):  # given: compare with that run's first
        path = Path(cfg.train.run_dir) / "health_first.json"
        first, note = read_first(path)
        note = note or ("" if first else f"{path}: no such file (that run has no first check yet)")
        note = note and f"{note}: compared across the ranks only"
    bf16 = cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and info.device.type == "cuda")
    rows, outliers = check(info.device, torch.bfloat16 if bf16 else torch.float32, info.mesh, cfg.health, first)
    status, line = verdict(rows, outliers)
    # the host's share (cost/host.py), measured on every rank: its collectives need all of them
    host = host_figures(info) if getattr(args, "profile", None) else None
    if int(os.environ.get("RANK", "0")) == 0:  # one verdict, not one per rank
        if args.json:
            print(json_text({"verdict": line.split(":")[0], "status": status, "line": line, "note": note,
                             "rows": rows_json(rows), "outliers": outliers}, indent=1))
        else:
            print(format_table(rows, outliers))
            if note:
                print(f"note: {note}")
            print(line)
        if getattr(args, "profile", None):
            print(f"wrote this machine's hardware profile to {write_profile(rows, info, args.profile, host)} "
                  "(densetrain plan --hardware FILE)")
            if not any(k.endswith("/all_reduce") for k in rows[0].figures):
                print("note: one rank measured no collective, so the profile's nvlink and net bandwidth are its "
                      "memory bandwidth; run doctor under torchrun --nproc-per-node N to measure them")
    # torchrun reports any other status of a rank as a failed child, with its whole error dump: a verdict is
    # a result, not a failure, so under torchrun it is read from the line (or --json)
    return 0 if int(os.environ.get("WORLD_SIZE", "1")) > 1 else status


def check_profile_path(path: str) -> None:
    """``--profile FILE`` names a file doctor can write: not a directory (nor another non-file), in an
    existing directory.

    Raises:
        ConfigError: one line naming ``--profile`` and what was expected."""
    p = Path(path)
    if p.exists() and not p.is_file():
        raise ConfigError(f"--profile {path}: is {'a directory' if p.is_dir() else 'not a regular file'}; expected "
                          "the hardware profile file to write (.toml or .json)")
    if not p.parent.is_dir():
        raise ConfigError(f"--profile {path}: {p.parent} is not a directory; expected the hardware profile file "
                          "to write (.toml or .json) in an existing directory")


class _OpCount(TorchDispatchMode):
    """Counts the operators (aten calls) run under it, ``n``, and those with a DTensor argument, ``dtensor``
    (one DTensor dispatch each: the mode sees them before DTensor runs their local operators)."""

    def __init__(self):
        super().__init__()
        self.n = self.dtensor = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        self.dtensor += any(isinstance(a, DTensor) for a in args)
        return func(*args, **(kwargs or {}))


def op_overhead(device: torch.device, seconds: float = 0.05, trials: int = 3, clock=time.perf_counter) -> float:
    """Fixed seconds one operator costs beside its work (eager PyTorch's dispatch, autograd bookkeeping,
    allocation, a thread-pool wake-up; a kernel launch on a GPU): a chain of 16 small autograd steps
    (``silu(x) * 0.5 + x``), forward and backward, timed at two sizes (1 Ki and 16 Ki fp32 elements); the
    per-operator time at zero elements by the line through the two (the fastest of ``trials`` tries each,
    ~``seconds`` per try by ``clock``: wall seconds; ``time.process_time`` gives CPU seconds). Read by the cost
    model as ``Hardware.op_overhead_s``."""
    def chain(n: int):
        x = torch.ones(n, device=device, requires_grad=True)

        def run():
            y = x
            for _ in range(16):
                y = F.silu(y) * 0.5 + y
            y.sum().backward()
        return run

    per_op = {}
    for n in (1024, 16384):
        run = chain(n)
        count = _OpCount()
        with count:
            run()
        per_op[n] = _fastest(run, device, seconds, trials, clock) / count.n
    slope = (per_op[16384] - per_op[1024]) / (16384 - 1024)
    return max(per_op[1024] - slope * 1024, 0.0)


def training_gemm_rate(device: torch.device, seconds: float = 0.05, trials: int = 3, clock=time.perf_counter,
                       n: int = 512) -> float:
    """FLOP/s of a linear layer's training GEMMs: ``F.linear`` of ``n x n`` by ``n x n`` forward and its two
    backward GEMMs (input and weight gradients, transposed operands), fp32, ``6 n^3`` FLOPs a call; the
    fastest of ``trials`` tries of ~``seconds`` by ``clock``: the rate a training step's GEMMs run at, transposed
    operands included (on this CPU, fp32, one thread: 57 GFLOP/s at n = 128, 86 at 256 and 512, 91 at 768)."""
    x = torch.full((n, n), 0.01, device=device, requires_grad=True)
    w = torch.full((n, n), 0.02, device=device, requires_grad=True)

    def run():
        F.linear(x, w).sum().backward()
    return 6.0 * n**3 / _fastest(run, device, seconds, trials, clock)


def loss_rate(device: torch.device, seconds: float = 0.05, trials: int = 3, clock=time.perf_counter,
              vocab: int = 8192, rows: int = 256) -> float:
    """Logits a second through the cross-entropy's forward and backward (``rows x vocab`` fp32), the fastest
    of ``trials`` tries by ``clock``: on a CPU the exponentials bound it, which the logits' bytes understate."""
    logits = torch.zeros(rows, vocab, device=device, requires_grad=True)
    y = torch.zeros(rows, dtype=torch.long, device=device)

    def run():
        F.cross_entropy(logits, y).backward()
    return rows * vocab / _fastest(run, device, seconds, trials, clock)


def attention_rate(device: torch.device, seconds: float = 0.05, trials: int = 3, clock=time.perf_counter,
                   seq_len: int = 512, heads: int = 4, head_dim: int = 64) -> float:
    """FLOP/s of causal ``F.scaled_dot_product_attention`` forward and backward (fp32, one sequence of
    ``seq_len``), counting the executed FLOPs as the cost model does (``QK^T`` and ``AV`` over half the keys,
    the backward 2.5x the forward); the fastest of ``trials`` tries by ``clock``."""
    q, k, v = (torch.full((1, heads, seq_len, head_dim), 0.01, device=device, requires_grad=True) for _ in range(3))

    def run():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    return 3.5 * 4.0 * seq_len * (seq_len / 2) * heads * head_dim / _fastest(run, device, seconds, trials, clock)


GEMM_CALL_SHAPES = ((256, 128, 64), (512, 512, 512))
"""``(M, K, N)`` of the small and the large GEMM of :func:`gemm_call_cost`: the small one 4 MFLOP, as a small
model's smallest linears (tiny's ``wk``, ``wv`` on 2 x 128 tokens), the large one 268 MFLOP."""
ATTENTION_CALL_SHAPES = ((1, 4, 128, 32), (1, 4, 512, 64))
"""``(batch, heads, seq_len, head_dim)`` of the small and the large attention call of :func:`attention_call_cost`
(the large one is :func:`attention_rate`'s)."""


def gemm_call_cost(device: torch.device, seconds: float = 0.05, trials: int = 3, clock=time.perf_counter) -> float:
    """Seconds one GEMM call costs beside its FLOPs at the rate of a large one, with this process's threads: a
    linear layer's three GEMMs (``x w^T``, ``g w``, ``g^T x``, fp32, no autograd) timed at the two sizes of
    :data:`GEMM_CALL_SHAPES` (the fastest of ``trials`` tries of ~``seconds`` by ``clock``), the small one's time
    a call less its FLOPs at the large one's rate. With two threads on this machine's 2 vCPUs a small GEMM's
    CPU seconds grow by ~20 µs a call (the second thread woken, the work split, the join; issue 41 item 6,
    session 18), which the matmul rate measured on 512 x 512 leaves out. Read by the cost model as
    ``Hardware.gemm_call_s`` (:mod:`densetrain.cost.host`, which charges the part beyond ``op_overhead_s``)."""
    def trio(M: int, K: int, N: int):
        x, w = torch.full((M, K), 0.01, device=device), torch.full((N, K), 0.02, device=device)
        g = torch.full((M, N), 0.03, device=device)
        return lambda: (torch.mm(x, w.t()), torch.mm(g, w), torch.mm(g.t(), x))

    flops = [2.0 * M * K * N for M, K, N in GEMM_CALL_SHAPES]
    t_small, t_large = (_fastest(trio(*s), device, seconds, trials, clock) / 3 for s in GEMM_CALL_SHAPES)
    return max(0.0, t_small - flops[0] * t_large / flops[1])


def attention_call_cost(device: torch.device, seconds: float = 0.05, trials: int = 3,
                        clock=time.perf_counter) -> float:
    """Seconds one causal ``F.scaled_dot_product_attention`` call, forward and backward, costs beside its FLOPs at
    the rate of a large one, with this process's threads: fp32, timed at the two sizes of
    :data:`ATTENTION_CALL_SHAPES` (the fastest of ``trials`` tries of ~``seconds`` by ``clock``; FLOPs counted as
    :func:`attention_rate` counts them), the small one's time less its FLOPs at the large one's rate. On this
    machine 0.11-0.24 ms a call with one thread (the call's set-up: its buffers), 0.25-0.42 with two (also the split
    of a few heads over the threads and the join; issue 41 item 6, session 18). Read by the cost model as
    ``Hardware.attention_call_s`` (:mod:`densetrain.cost.host`)."""
    def call(b: int, h: int, t: int, d: int):
        q, k, v = (torch.full((b, h, t, d), 0.01, device=device, requires_grad=True) for _ in range(3))
        g = torch.full((b, h, t, d), 0.02, device=device)
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)

    flops = [3.5 * 4.0 * t * (t / 2) * h * d * b for b, h, t, d in ATTENTION_CALL_SHAPES]
    t_small, t_large = (_fastest(call(*s), device, seconds, trials, clock) for s in ATTENTION_CALL_SHAPES)
    return max(0.0, t_small - flops[0] * t_large / flops[1])


def _fastest(run, device: torch.device, seconds: float, trials: int, clock) -> float:
    """Seconds of one ``run()``: the fastest of ``trials`` tries of ~``seconds`` each by ``clock``."""
    run()
    best = float("inf")
    for _ in range(trials):
        calls, t0 = 0, clock()
        while clock() - t0 < seconds:
            run()
            calls += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (clock() - t0) / calls)
    return best


@contextlib.contextmanager
def probe_mesh():
    """A 1-D CPU (gloo) :class:`DeviceMesh` for the host probes: pairs of ranks when torch.distributed runs an
    even world (as two ranks split a model; every rank must enter it the first time), this rank alone in an odd
    one, and a private 1-rank group, destroyed on exit, when torch.distributed is not initialised (one
    process). The subgroups are made once and kept: DTensor caches its redistributions by mesh, so a destroyed
    group's name would outlive it."""
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DeviceMesh.from_group(dist.group.WORLD if own else _probe_group(), "cpu")
    finally:
        if own:
            dist.destroy_process_group()


@functools.cache
def _probe_group():
    """This rank's subgroup for :func:`probe_mesh` (made once per process; every rank must call it)."""
    return dist.new_subgroups(group_size=2 if dist.get_world_size() % 2 == 0 else 1, backend="gloo")[0]


PROBE_MODEL = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128)
"""The densetrain model the host probes run (:func:`dtensor_op_cost`, :func:`fsdp_group_cost`): small enough
that its operators' work is negligible beside their fixed costs, every kind of block operator present (GQA)."""


def _probe_step(wrap=None, rows: int = 16):
    """One forward and backward of :data:`PROBE_MODEL` on a row of ``rows`` tokens, ``wrap(model)`` applied
    first (tensor parallelism, FSDP2), as a callable."""
    model = build_model(PROBE_MODEL, 0)
    if wrap is not None:
        wrap(model)
    x = torch.arange(rows + 1).remainder(PROBE_MODEL.vocab_size).unsqueeze(0)
    return lambda: token_losses(model(x[:, :-1]), x[:, 1:]).mean().backward()


def dtensor_op_cost(mesh, trials: int = 3, clock=time.perf_counter, calls: int = 8) -> float:
    """Seconds one DTensor dispatch adds to its local operator: densetrain's tensor parallelism
    (:func:`densetrain.parallel.parallelize.apply_tensor_parallel`) on :data:`PROBE_MODEL` over ``mesh``
    (sharding propagation, redistribution bookkeeping, wrapping) against the plain model, forward and backward,
    less the fixed cost of the probe's own collectives (counted with torch's ``CommDebugMode``, each at
    :func:`collective_call_cost`: the step model charges every tensor-parallel collective that fixed cost, as
    its latency, so a dispatch must not carry it too), over the counted DTensor dispatches. Each timing is the
    fastest of ``trials`` tries of ``calls`` runs by ``clock`` (a fixed count: every rank of ``mesh`` must call
    it). On a shared machine the figure depends on the tries' length: at load 8 on 2 vCPUs, 3 tries of 8 runs
    gave 127 µs a dispatch in CPU seconds, 24 tries of 1 run 94 (benchmarks/RESULTS.md, issue 41 item 6,
    session 17)."""
    tp = _probe_step(lambda m: apply_tensor_parallel(m, mesh))
    count, comms = _OpCount(), CommDebugMode()
    with comms, count:
        tp()
    extra = _fixed(tp, calls, trials, clock) - _fixed(_probe_step(), calls, trials, clock)
    extra -= comms.get_total_counts() * collective_call_cost(mesh, trials, clock)
    return max(extra, 0.0) / max(count.dtensor, 1)


def collective_call_cost(mesh, trials: int = 3, clock=time.perf_counter, calls: int = 32) -> float:
    """Seconds of one one-element ``all_reduce`` over ``mesh``'s group by ``clock`` (the fastest of ``trials``
    tries of ``calls``; 0 on a 1-rank mesh, where DTensor runs no collective): the fixed cost a collective call
    has whatever its bytes, the same figure the profile's ``latency_intra_s`` holds (half of it a ring step on
    2 ranks). Every rank of ``mesh`` must call it."""
    if mesh.size() == 1:
        return 0.0
    one = torch.ones(1)
    return _fixed(lambda: dist.all_reduce(one, group=mesh.get_group()), calls, trials, clock)


def loss_parallel_cost(mesh, dtensor_s: float, call_s: float, trials: int = 3, clock=time.perf_counter,
                       calls: int = 8, rows: int = 256, vocab: int = 8192, dim: int = 16) -> float:
    """Seconds a logit the vocabulary-parallel cross-entropy of densetrain's tensor-parallel training step adds
    to the fused cross-entropy the step model charges (``Hardware.loss_elements_per_s``): torch's
    ``loss_parallel`` splits the log-softmax into its steps (a max, a subtraction, the exponentials and their
    sum, a log, each over the rank's logits) and densetrain's step also takes ``log Z`` (another max,
    subtraction, exponentials and sum; :mod:`densetrain.parallel.loss_parallel`), where the fused kernel makes
    one pass. Measured as the step runs it (:func:`densetrain.parallel.loss_parallel.vocab_parallel_head` over
    ``mesh``, ``rows`` tokens, a ``vocab x dim`` head, forward and backward) against the fused cross-entropy on
    this rank's ``rows x vocab / n`` logits and the same head GEMM, less its counted DTensor dispatches at
    ``dtensor_s`` and collectives at ``call_s`` (:func:`dtensor_op_cost`, :func:`collective_call_cost`: the
    cost model charges those as such), over the rank's logits. Fastest of ``trials`` tries of ``calls`` by
    ``clock`` (a fixed count: every rank of ``mesh`` must call it)."""
    n, rank = mesh.size(), mesh.get_local_rank()
    w = torch.full((vocab, dim), 0.01)
    # every rank holds the same w: its slice as a Shard(0) DTensor, no scatter
    weight = DTensor.from_local(w.chunk(n)[rank].clone(), mesh, [Shard(0)], run_check=False).requires_grad_()
    local = w.chunk(n)[rank].clone().requires_grad_()
    h = torch.full((1, rows, dim), 0.02, requires_grad=True)
    y = torch.arange(rows).mul(31).remainder(vocab).unsqueeze(0)
    head = vocab_parallel_head(SimpleNamespace(output=SimpleNamespace(weight=weight)), mesh, y, 0)

    def split():
        with loss_parallel_context(mesh):
            head(lambda x, matmul: matmul(x), h)[0].sum().backward()

    def fused():
        F.cross_entropy(F.linear(h[0], local), y[0] % (vocab // n), reduction="none").sum().backward()
    count, comms = _OpCount(), CommDebugMode()
    with comms, count:
        split()
    extra = _fixed(split, calls, trials, clock) - _fixed(fused, calls, trials, clock)
    extra -= count.dtensor * dtensor_s + comms.get_total_counts() * call_s
    return max(extra, 0.0) / (rows * vocab / n)


def fsdp_group_cost(mesh, trials: int = 3, clock=time.perf_counter, calls: int = 8) -> float:
    """Seconds one FSDP2 group adds to a micro-batch's forward and backward: densetrain's FSDP2
    (:func:`densetrain.parallel.parallelize.apply_fsdp`: a group a block and the root) on :data:`PROBE_MODEL`
    over ``mesh`` against the plain model, over its groups: the hooks, the unshard/reshard bookkeeping, the
    copies in and out of the flat buffers and, on several ranks, each group's all-gathers and reduce-scatter
    (whose bytes are negligible here: the cost model charges bytes at the measured rates). The fastest of
    ``trials`` tries of ``calls`` by ``clock`` (a fixed count: every rank of ``mesh`` must call it)."""
    sharded = _probe_step(lambda m: apply_fsdp(m, mesh, bf16=False))
    extra = _fixed(sharded, calls, trials, clock) - _fixed(_probe_step(), calls, trials, clock)
    return max(extra, 0.0) / (PROBE_MODEL.n_layers + 1)


def _fixed(run, calls: int, trials: int, clock) -> float:
    """Seconds of one ``run()``: the fastest of ``trials`` tries of ``calls`` runs each by ``clock``, the ranks
    lined up by a barrier before each try when torch.distributed is initialised (a fixed count: runs that hold
    collectives match on every rank)."""
    run()
    best = float("inf")
    for _ in range(trials):
        if dist.is_initialized():
            dist.barrier()
        t0 = clock()
        for _ in range(calls):
            run()
        best = min(best, (clock() - t0) / calls)
    return best


def gather_scatter_rates(device: torch.device, trials: int = 3, clock=time.perf_counter,
                         mib: int = 4) -> tuple[float, float]:
    """Bus bytes a second of ``all_gather_single`` and ``reduce_scatter_single`` (FSDP2's collectives) over
    the world, ``mib`` MiB a rank gathered, ``mib`` MiB reduced: ``(n - 1) / n`` of the whole tensor a call
    (NCCL's factors, densetrain.cost.step.bus_bytes), the fastest of ``trials`` tries of 4 calls by ``clock``
    (every rank runs the same count). Every rank must call it."""
    n = dist.get_world_size()
    numel = mib * 2**20 // 4
    shard, whole = torch.ones(numel, device=device), torch.empty(n * numel, device=device)
    out = torch.empty(numel // n, device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    ag = _fixed(lambda: (dist.all_gather_single(whole, shard), sync()), 4, trials, clock)
    rs = _fixed(lambda: (dist.reduce_scatter_single(out, shard), sync()), 4, trials, clock)
    return (n - 1) / n * n * numel * 4 / ag, (n - 1) / n * numel * 4 / rs


def host_figures(info, clock=time.perf_counter) -> dict[str, float]:
    """The host's share of a step (:data:`densetrain.cost.hardware.HOST_FIELDS`, read by cost/host.py) on
    this machine: on a CPU, :func:`dtensor_op_cost`, :func:`fsdp_group_cost` and :func:`loss_parallel_cost` on
    :func:`probe_mesh` (pairs of ranks; one process alone), :func:`gemm_call_cost` and
    :func:`attention_call_cost` (this process alone, with its threads), with more than one rank
    :func:`gather_scatter_rates`, and
    ``collectives_on_cores`` 1 (gloo runs on the compute's cores). Over a pair, a DTensor dispatch carries the
    functional collectives' wrapping and waiting around gloo's calls, not the calls' fixed cost, which the step
    model's TP term charges as their latency (:func:`dtensor_op_cost`). On a GPU
    none (its host work runs ahead of the kernels: the cost model leaves it out). Every rank must call it."""
    if info.device.type != "cpu":
        return {}
    with probe_mesh() as mesh:
        out = {"dtensor_op_s": dtensor_op_cost(mesh, clock=clock), "fsdp_group_s": fsdp_group_cost(mesh, clock=clock),
               "collectives_on_cores": 1.0, "gemm_call_s": gemm_call_cost(info.device, 0.1, 3, clock),
               "attention_call_s": attention_call_cost(info.device, 0.1, 3, clock)}
        out["loss_parallel_logit_s"] = loss_parallel_cost(mesh, out["dtensor_op_s"],
                                                          collective_call_cost(mesh, clock=clock), clock=clock)
    if dist.is_initialized() and dist.get_world_size() > 1:
        out["all_gather_bytes_per_s"], out["reduce_scatter_bytes_per_s"] = gather_scatter_rates(info.device,
                                                                                               clock=clock)
    return out


def write_profile(rows, info, path: str, host: dict[str, float] | None = None) -> str:
    """``doctor --profile FILE``: a :class:`densetrain.cost.Hardware` profile of this machine from the ranks'
    median matmul rate and memory bandwidth, the slowest group's all-reduce bus bandwidth and one-element
    latency (half of it a ring step on 2 ranks, ``1 / (2 (n - 1))`` on ``n``), and this rank's
    :func:`op_overhead`, and the host's share ``host`` (:func:`host_figures`); returns the path."""
    def med(k):
        return statistics.median(r.figures[k] for r in rows)

    links = [med(k) for k in rows[0].figures if k.endswith("/all_reduce")]
    world = len(rows)
    lats = [med(k) / (2 * max(world - 1, 1)) for k in rows[0].figures if k.endswith("/all_reduce_lat")]
    memory = (torch.cuda.get_device_properties(info.device).total_memory if info.device.type == "cuda"
              else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / 1024**3
    hw = measured_hardware(med("matmul"), med("memory"), min(links) if links else None,
                           int(os.environ.get("LOCAL_WORLD_SIZE", "1")), round(memory, 1),
                           f"this machine ({rows[0].host}, {info.device.type}, {len(rows)} rank(s))",
                           op_overhead(info.device), max(lats) if lats else None,
                           loss_rate(info.device) if info.device.type == "cpu" else 0.0,
                           attention_rate(info.device) if info.device.type == "cpu" else 0.0, host)
    return str(write_hardware(hw, path))
