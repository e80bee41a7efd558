"""The time of one optimizer step on one rank, in parts: compute per op class, communication per mesh dimension,
what of it hides behind compute, the pipeline bubble; then tokens/s per GPU and MFU.

The mesh is densetrain's (:data:`densetrain.parallel.mesh.DIMS`: ``pp, dp_replicate, dp_shard, cp, tp``, tp
innermost), so a group's ranks sit ``stride`` apart, ``stride`` the product of the inner degrees; ranks fill
nodes of ``gpus_per_node`` in order. A group lies within a node when ``stride * degree <= gpus_per_node``
(NVLink), else it crosses nodes with ``k = max(1, gpus_per_node / stride)`` members per node, and its bus
bandwidth is ``min(nvlink, k * net)`` (NCCL's rings use every GPU's NIC).

Collectives over ``n`` ranks of a tensor of ``S`` bytes (whole, unsharded), NCCL's bus-bandwidth factors
(nccl-tests, ``doc/PERFORMANCE.md``): all-reduce ``2 (n-1)/n S``, all-gather and reduce-scatter ``(n-1)/n S``
bytes through each rank's link, plus ``(n-1)`` (all-reduce ``2 (n-1)``) ring steps of the link's latency.

What hides (torchtitan's and Megatron's behaviour): FSDP2's all-gathers (prefetched) and reduce-scatters, and
the replicas' all-reduce, run beside the blocks' compute (taking :data:`CONTENTION` of it while they run);
under pipelining as torch 2.13's runtime runs them (:func:`pipelined_dp`): each stage gathered
:func:`stage_gathers` times a schedule call (the first exposed, the others prefetched), its reduction exposed
once a call (``pp_grad_sync`` ``last``: the compute stream waits for it) or run beside the next micro-batches
(``microbatch``), :data:`PP_GRAD_SYNC`. Tensor-parallel collectives are exposed (each feeds or
drains the next op; torch.compile does not move them: Inductor's ``reorder_for_compute_comm_overlap`` is off by
default) unless AsyncTP runs them beside their GEMMs (``Parallel.async_tp``, :func:`async_tp_exposed`); context
parallelism's key/value exchange
(:data:`CP_EXCHANGE`) and the pipeline's sends on the fill and drain path are exposed. The bubble of
1F1B and of the interleaved schedule is ``(pp - 1) / (v m)`` of the pipeline's busy time (``m`` micro-batches
per schedule call, ``v`` stages per rank; Narayanan et al. 2021 sec. 2.2), counted once: the compute and
exposed communication of the micro-batches are its busy time, and MFU is computed from the step time, not
assumed.

The three efficiency constants (:data:`GEMM_EFFICIENCY`, :data:`ATTENTION_EFFICIENCY`,
:data:`NETWORK_EFFICIENCY`) were fitted on three published runs and checked on the others
(``benchmarks/planner_check.py``, docs/planner.md).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from densetrain.cost.flops import (
    BASE_OPS,
    attention_flops,
    block_matmul_params,
    block_ops,
    flops_per_token,
    gemm_shapes,
    optimizer_ops,
    shape_of,
)
from densetrain.cost.host import host_time

GEMM_EFFICIENCY = 0.58
"""Fraction of the dense peak a large bf16/fp8 GEMM reaches (fitted: benchmarks/planner_check.py ``--fit``)."""
ATTENTION_EFFICIENCY = 0.26
"""Fraction of the dense bf16 peak the flash-attention kernels reach, forward and backward (fitted)."""
NETWORK_EFFICIENCY = 0.7
"""Fraction of a link's datasheet bandwidth NCCL's bus bandwidth reaches for large messages (fitted)."""
CHECKED_ERROR = 0.059
"""Mean relative error of the predicted step over the published runs no constant was fitted on (the ``check``
rows of ``benchmarks/planner_check.py``; tests/test_plan_cost.py recomputes it). Two layouts whose predicted
steps differ by less are not told apart by the model: ``densetrain plan`` says which (GPU profiles; a measured
CPU profile's error is the machine benchmark's)."""
NVLINK_EFFICIENCY = 0.8
"""Fraction of NVLink's datasheet bandwidth per direction NCCL's bus bandwidth reaches within an 8-GPU H100 node
(not fitted). Source: NCCL's maintainer (S. Jeaugey, NVIDIA/nccl-tests issue 212, 2024): "450GB/s is the line
rate. With the protocol overhead (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s", seen as the bus
bandwidth of the non-all-reduce collectives (0.82; the model keeps 0.8). NVLink SHARP (NVLS) does not raise the
all-gather / reduce-scatter rate (it is slower than the ring there: NVIDIA/nccl issue 1083); it lifts the
all-reduce's bus bandwidth to ~480 GB/s on 8 GPUs (same comment), which the model does not take: an all-reduce
within a node (densetrain's tensor parallelism without SP, a replica group inside a node) is charged at the
ring's rate, ~25% over what NVLS takes."""
HBM_EFFICIENCY = 0.8
"""Fraction of the HBM datasheet bandwidth elementwise kernels reach (STREAM-like copies on H100 reach ~0.8-0.9;
an assumption, not fitted)."""
CONTENTION = 0.12
"""Compute lost per second of communication hidden behind it: NCCL's kernels hold ~16 of an H100's 132 SMs while
they run (its default channel count on InfiniBand; an assumption from the hardware, not fitted)."""
KERNEL_LAUNCH_S = 4e-6
"""Fixed cost of one kernel (launch and tail), s: what makes tiny GEMMs slow whatever their FLOPs."""

CP_EXCHANGE = ("kv", "expanded")
"""What a context-parallel rank exchanges per layer. ``kv``: densetrain's (``parallel/context.py``) and Llama 3's
(Dubey et al. 2024 sec. 3.3.2): an all-gather of the ``n_kv_heads`` keys and values forward (again in a full
recomputation), its gradients' reduce-scatter backward. ``expanded``: torch's ring attention
(``torch.distributed.tensor.experimental.context_parallel``, rotate method ``allgather``) as torchtitan 9dec370
called it: its attention repeats the key/value heads to ``n_heads`` *before* ``F.scaled_dot_product_attention``
(``torchtitan/models/llama/model.py``, ``repeat_kv``), so the exchanged K/V are ``n_heads / n_kv_heads`` times
larger (4x for Llama 3 8B, 8x for 70B and 405B), and its backward rotates the K/V again beside their gradients
(three exchanges a layer, four under full recomputation).

What a CP rank computes is the work it has without CP (its queries against the keys before them, the
load-balanced split leaving every rank the same), at the rate of the kernel that runs it (:data:`ATTENTION_KERNELS`).
torch's ring attention (``expanded``) merges each ring step's partial output in fp32 (``_SDPAMerger``,
``convert_to_f32``): a few % of a step by its bytes, not charged."""

ATTENTION_KERNELS = ("auto", "sdpa", "flex")
"""The attention kernel of a run (``Parallel.attention``). ``sdpa``: the fused causal kernel whatever the layout
(Llama 3's; torchtitan's, whose ring attention calls SDPA's flash kernel per ring step). ``flex``: FlexAttention
with a block mask (densetrain's document-masked stages, CP or not). ``auto``: densetrain's choice for an unmasked
stage: FlexAttention under context parallelism (``parallel/context.py``: the gathered K/V with the rank's two
load-balanced chunks in one block mask), ``F.scaled_dot_product_attention(is_causal=True)`` without it. A
profile's ``flex_forward_rate`` / ``flex_backward_rate`` give FlexAttention's speed relative to SDPA's kernel on
that GPU (e.g. 0.85 / 0.76 on an H100 whose SDPA runs cuDNN's kernel; 0: the same)."""

AC_RECOMPUTE = ("none", "selective", "op", "full")
"""Activation checkpointing: ``none``; ``selective`` (densetrain's: pointwise ops recomputed, matmul outputs
kept); ``op`` (torchtitan's op-level selective: every second matmul recomputed); ``full`` (each block's forward
runs again in its backward)."""

PP_GRAD_SYNC = ("last", "microbatch")
"""When a pipelined FSDP2 stage reduces its gradients (``Parallel.pp_grad_sync``, the trainer's
``parallel.pp_grad_sync``). What torch 2.13's pipelining runtime does, read from its code:

- ``last`` (torch's own): ``PipelineStage.backward_maybe_with_nosync`` turns FSDP2's gradient sync and resharding
  off for *every* backward; the schedule's ``REDUCE_GRAD`` action (``schedules._add_reduce_grad``: right after a
  stage's last backward of the schedule call; ``Schedule1F1B`` calls ``perform_reduce_grad`` after the call's last
  backward) runs ``post_backward`` of every group of the stage, which issues all the stage's reduce-scatters (and
  HSDP's all-reduce) at once, then FSDP2's ``_root_post_backward_final_callback`` with ``is_last_backward`` makes
  the compute stream wait for them (``current_stream().wait_event`` on each reduce-scatter, ``finalize_backward``
  on the last post-reduce event). So each virtual stage's reduction is exposed, even where later backwards of the
  rank's other stages follow it (interleaved: stage ``k`` of ``v`` has ``k m`` backwards after its
  ``REDUCE_GRAD``): the compute waits, it does not run beside it. Once per schedule call.
- ``microbatch`` (densetrain's ``parallel/pipeline.py`` ``reduce_scatter_backward``): FSDP2's sync on for every
  backward, ``is_last_backward`` off: each group's reduce-scatter is issued by its post-backward hook during the
  micro-batch's backward and only the next group's post-backward waits for it (``post_backward_rs_wait``:
  ``reduce_scatter_max_input_buffers`` = 1 in flight), so it runs beside the next group's backward; the call's
  ``REDUCE_GRAD`` finds nothing left and its final callback waits for the last one. ``n_micro`` times the
  reduce-scatter bytes; the replicas' all-reduce (HSDP) still once a call.
"""

PP_GATHER_WINDOW = 3
"""Stages a pipeline rank keeps gathered under an interleaved schedule: torch's ``_add_unshard_reshard`` (used by
``_PipelineScheduleRuntime``, which ``ScheduleInterleaved1F1B`` is) issues an ``UNSHARD`` (an async all-gather of
every FSDP2 group of the stage) for each of the next ``max_active_stages = 3`` distinct stages the rank's actions
touch and a ``RESHARD`` (parameters freed) for a gathered stage that leaves that window, whatever
``reshard_after_forward`` says."""


@functools.lru_cache(maxsize=4096)
def stage_gathers(pp: int, virtual: int, microbatches: int, rank: int = 0) -> int:
    """All-gathers of a whole stage's parameters pipeline rank ``rank`` runs in one schedule call of
    ``microbatches`` micro-batches over ``pp`` ranks with ``virtual`` stages each.

    ``virtual`` 1 (densetrain runs ``Schedule1F1B`` / ``ScheduleGPipe``, which have no ``UNSHARD`` actions): 1, FSDP2's
    own hooks gather each group in the first forward and nothing reshards before the call's ``REDUCE_GRAD``
    (densetrain's ``reshard_after_forward=False`` under pipelining). Else the interleaved 1F1B schedule (Narayanan
    et al. 2021 sec. 2.2, as torch 2.13 orders it: ``rounds = max(1, m // pp)``, ``m / rounds`` micro-batches per
    round; ``(v - 1) m / rounds + 2 (pp - 1 - rank)`` warm-up forwards, stage by stage a round each; then a forward
    and a backward alternating, backwards from the rank's last stage down; then the remaining backwards), and a
    stage is gathered each time it enters the window of the next :data:`PP_GATHER_WINDOW` distinct stages of that
    sequence. Equal to the ``UNSHARD`` actions torch lowers the schedule to (``tests/test_plan_ppgrads.py``): 1 a
    stage for v <= 3; pp 16 v 8 m 16: 13 for 8 stages; pp 8 v 16 m 32: 111 for 16.
    """
    if pp <= 1 or virtual <= 1:
        return 1
    v, m = virtual, microbatches
    per_round = m // max(1, m // pp)
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
    fwd = lambda op: (op // per_round) % v  # noqa: E731  (local stage of the op-th forward)
    bwd = lambda op: v - 1 - ((op - warmup) // per_round) % v  # noqa: E731
    seq = [fwd(op) for op in range(warmup)]
    for op in range(warmup, m * v):
        seq += [fwd(op), bwd(op)]
    seq += [bwd(op) for op in range(m * v, m * v + warmup)]
    active: set[int] = set()
    count = 0
    for i in range(len(seq)):
        window: list[int] = []
        for st in seq[i:]:
            if st not in window:
                window.append(st)
                if len(window) == PP_GATHER_WINDOW:
                    break
        count += sum(st not in active for st in window)
        active = set(window)
    return count


@dataclass(frozen=True)
class Parallel:
    """A layout and its schedule: degrees, pipeline ``schedule`` (``1f1b``, ``interleaved_1f1b``, ``gpipe``),
    ``virtual`` stages per rank, ``microbatches`` per schedule call (0: all a rank runs in a step),
    ``sequence_parallel`` (norm regions split by tp; the same bytes on the wire as plain TP), ``async_tp``
    (torch's AsyncTP, with sequence parallelism: each TP all-gather / reduce-scatter split in ``tp`` pieces
    that run beside the GEMM it feeds or drains), ``cp_exchange``, a property of the context-parallel
    implementation (:data:`CP_EXCHANGE`), ``attention``, the attention kernel (:data:`ATTENTION_KERNELS`), and
    ``pp_grad_sync`` (:data:`PP_GRAD_SYNC`: when a pipelined FSDP2 stage reduce-scatters its gradients; the
    trainer's ``parallel.pp_grad_sync``)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    virtual: int = 1
    microbatches: int = 0
    sequence_parallel: bool = False
    async_tp: bool = False
    cp_exchange: str = "kv"
    attention: str = "auto"
    pp_grad_sync: str = "last"

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.cp * self.pp


def parallel_of(layout, schedule: str = "1f1b", virtual: int = 1, microbatches: int = 0,
                sequence_parallel: bool = False, attention: str = "auto", pp_grad_sync: str = "last") -> Parallel:
    """:class:`Parallel` of a :class:`~densetrain.parallel.mesh.Layout` (or anything with its degrees)."""
    return Parallel(layout.dp_replicate, layout.dp_shard, layout.tp, getattr(layout, "cp", 1),
                    getattr(layout, "pp", 1), schedule, virtual if getattr(layout, "pp", 1) > 1 else 1, microbatches,
                    sequence_parallel, attention=attention, pp_grad_sync=pp_grad_sync)


def bubble_share(pp: int, microbatches: int, virtual: int = 1, schedule: str = "1f1b") -> float:
    """Share of a pipeline rank's step time that is bubble: ``(pp - 1) / (v m + pp - 1)`` for 1F1B (``v`` = 1)
    and the interleaved schedule, ``(pp - 1) / (m + pp - 1)`` for GPipe (Narayanan et al. 2021 sec. 2.2: the
    bubble is ``(pp - 1) / (v m)`` of the busy time). 0 without pipelining."""
    if pp <= 1:
        return 0.0
    v = 1 if schedule == "gpipe" else virtual
    return (pp - 1) / (v * microbatches + pp - 1)


def pipeline_pace(n_layers: int, pp: int, virtual: int, head: float) -> tuple[int, int]:
    """``(blocks, heads)`` of the pipeline rank that sets a schedule's pace, ``heads`` 1 when it also runs the
    output head and loss (which cost ``head`` blocks' time). Without pipelining: every block and the head.

    A schedule runs at the pace of its slowest stage. The ``pp v`` stages take whole blocks; the best split
    gives the head's stage ``head`` blocks fewer (Llama 3 took one block off the first and the last stage,
    Dubey et al. 2024 sec. 3.3.2): the smallest stage time ``S`` (in blocks) such that ``pp v - 1`` stages of
    ``floor(S)`` blocks and the head's stage of ``floor(S - head)`` hold ``n_layers``. 405B (126 blocks, head
    ~0.6 of a block): 8 a rank at pp 16 v 8, 16 at pp 8; 70B (80 blocks) at pp 4: the head's rank runs 20
    blocks and the head, the split having no whole-block way to spare it.
    """
    if pp <= 1:
        return n_layers, 1
    n = pp * virtual
    best = None
    for k in range(1, n_layers + 1):
        for stage in (k, k + head):  # a stage time of k blocks (the head's stage holds fewer), or k + the head
            if (n - 1) * math.floor(stage) + math.floor(stage - head + 1e-9) >= n_layers and stage >= head:
                if best is None or stage < best:
                    best = stage
        if best is not None:
            break
    k_full = math.floor(best + 1e-9)
    head_rank = (virtual - 1) * k_full + math.floor(best - head + 1e-9)  # blocks beside the head
    if head_rank + head > virtual * k_full:
        return head_rank, 1
    return virtual * k_full, 0


def link(hw, stride: int, degree: int) -> tuple[float, float, str]:
    """``(bytes/s, latency s per ring step, 'nvlink' | 'network')`` of a group of ``degree`` ranks ``stride``
    apart (module docstring)."""
    g, eff = hw.gpus_per_node, hw.network_efficiency or NETWORK_EFFICIENCY
    if stride * degree <= g:
        return hw.nvlink_bytes_per_s * (hw.network_efficiency or NVLINK_EFFICIENCY), hw.latency_intra_s, "nvlink"
    per_node = max(1, g // stride)
    return min(hw.nvlink_bytes_per_s, per_node * hw.net_bytes_per_s) * eff, hw.latency_inter_s, "network"


def allreduce_bw(hw, stride: int, degree: int, bw: float) -> float:
    """Bus bandwidth (B/s) of an all-reduce over a group of ``degree`` ranks ``stride`` apart whose ring runs at
    ``bw`` (:func:`link`): the profile's NVLink SHARP figure (``Hardware.nvls_bus_bytes_per_s``) where the group is
    a whole node (NCCL's NVLS all-reduce reaches ~480 GB/s on 8 H100s, the ring's rate on 2-4: NVIDIA/nccl issue
    1455), else ``bw``. Only the all-reduce gains: NVLS does not speed all-gather or reduce-scatter."""
    whole_node = stride == 1 and degree == hw.gpus_per_node and degree > 1
    return hw.nvls_bus_bytes_per_s if whole_node and hw.nvls_bus_bytes_per_s else bw


def collective_s(kind: str, nbytes: float, n: int, bw: float, latency: float) -> float:
    """Seconds of one collective of ``nbytes`` (whole tensor) over ``n`` ranks: ``kind`` ``all_reduce``,
    ``all_gather`` or ``reduce_scatter`` (module docstring)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    factor, steps = (2.0, 2) if kind == "all_reduce" else (1.0, 1)
    return factor * (n - 1) / n * nbytes / bw + steps * (n - 1) * latency


def bus_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes one rank sends in a ring collective of ``nbytes`` over ``n`` ranks (the bus-bandwidth factor)."""
    return 0.0 if n <= 1 else (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n * nbytes


def gemm_s(M: int, K: int, N: int, peak: float, hw) -> float:
    """One GEMM (``M x K`` by ``K x N``, 2-byte operands): the slower of its FLOPs at ``peak`` times
    :data:`GEMM_EFFICIENCY` times, on a GPU (a profile with ``sms``), the tile occupancy (dimensions rounded up
    to 128 x 128 x 64 tiles: small and odd shapes waste the rest) and the wave occupancy (the last wave of
    output tiles part-full), and its bytes at the memory bandwidth; plus a kernel's fixed cost
    (:data:`KERNEL_LAUNCH_S`, or the profile's measured ``op_overhead_s`` per operator counted per block)."""
    up = lambda x, t: math.ceil(x / t) * t
    tile = 1.0
    if hw.sms:  # a GPU's tensor-core tiles: dimensions rounded up to 128 x 128 x 64 (small and odd shapes waste
        # the rest), and wave quantization: the output tiles run in waves of one tile an SM, the last wave
        # part-full (CUTLASS/cuBLAS schedule one output tile per CTA; the H100 whitepaper's SM count)
        tile = (M * N * K) / (up(M, 128) * up(N, 128) * up(K, 64))
        tiles = math.ceil(M / 128) * math.ceil(N / 128)
        tile *= tiles / (hw.sms * math.ceil(tiles / hw.sms))
    flops = 2.0 * M * K * N
    return max(flops / (peak * (hw.gemm_efficiency or GEMM_EFFICIENCY) * tile),
               2.0 * (M * K + K * N + M * N) / (hw.hbm_bytes_per_s * (hw.hbm_efficiency or HBM_EFFICIENCY))) \
        + (0.0 if hw.op_overhead_s else KERNEL_LAUNCH_S)


def async_tp_exposed(blk_g: list[float], half_fwd: float, half: float, tp: int, fwd_passes: int,
                     fp8: bool) -> float:
    """Seconds of one block's tensor-parallel collectives (sequence parallel) that AsyncTP leaves exposed.

    ``blk_g``: the forward GEMMs' seconds ``[qkv, wo, w1w3, w2]``; ``half_fwd`` / ``half``: one all-gather or
    reduce-scatter of the block's activation in a forward pass / in the backward; ``fwd_passes``: 1, or 2 under
    full recomputation; ``fp8``: torchao's Float8 linears.

    AsyncTP is torch's micro-pipeline pass (``torch/_inductor/fx_passes/micro_pipeline_tp.py``, late 2024): it
    fuses an all-gather into the matmuls that take the gathered tensor as their left operand
    (``fused_all_gather_matmul``) and a reduce-scatter into the one matmul whose output alone feeds it
    (``fused_matmul_reduce_scatter``: "the matmul result ... used by multiple users" or a non-matmul input is left
    alone). A fused collective runs in ``tp`` pieces beside the GEMM on the piece before: its first piece and
    what the GEMM cannot cover stay exposed. What it fuses in a block:

    - forward (and the recomputed forward): all four, the all-gathers before q/k/v and w1/w3, the reduce-scatters
      after wo and w2;
    - backward: the reduce-scatter of the input gradient of q/k/v (w1/w3) follows the *sum* of the three (two)
      linears' input gradients, not a matmul: not fused, exposed whole; the all-gather of the output gradient
      before wo's (w2's) data-gradient GEMM is fused in bf16; under Float8 that GEMM's left operand is the
      gradient's fp8 cast, not the gathered tensor: not fused either.

    The PyTorch team's own measurement agrees that the backward gains little: "up to ~20% forward pass speedup
    and ~8% E2E speedup in Llama3 70B" (Async Tensor Parallelism in PyTorch, discuss.pytorch.org, 2024).
    """
    exposed = lambda c, g: c / tp + max(0.0, c * (tp - 1) / tp - g)  # noqa: E731
    qkv, wo, w1w3, w2 = blk_g
    fwd = fwd_passes * sum(exposed(half_fwd, g) for g in blk_g)
    bwd = 2 * half + sum(half if fp8 else exposed(half, g) for g in (wo, w2))
    return fwd + bwd


def elementwise_bytes(m, tokens: float, tp: int, sp: bool) -> float:
    """Bytes one block's forward reads and writes outside the matmuls for ``tokens`` rows: two RMSNorms (fp32
    in, bf16 out: ``6 d`` each), two fp32 residual adds (``10 d`` each), RoPE on q and k (``4 (q + kv)``),
    SwiGLU (``6 f``); the norm and residual regions are whole on every tensor-parallel rank unless sequence
    parallelism splits them."""
    s = shape_of(m)
    q, kv = s.n_heads * s.head_dim / tp, max(s.n_kv_heads / tp, 1) * s.head_dim
    return tokens * ((12 + 20) * s.d_model / (tp if sp else 1) + 4 * (q + kv) + 6 * s.d_ff / tp)


def pipelined_dp(par: Parallel, n_micro: int, params: float, layers: float, n_sh: int, wbytes: int,
                 shard_link: tuple[float, float], replica_link: tuple[float, float], busy: float,
                 one_bwd: float) -> tuple[float, float, float, float]:
    """FSDP2 under pipelining, one rank and step: ``(exposed s, bytes gathered, fp32 bytes reduce-scattered,
    bytes sent)``, per torch 2.13's pipelining runtime (:data:`PP_GRAD_SYNC`, :func:`stage_gathers`).

    ``params``: the rank's parameters (all its ``v`` stages, ``1 / tp`` of each); ``layers``: its blocks;
    ``n_sh``: dp_shard x cp; ``wbytes``: bytes of a gathered weight; ``shard_link`` / ``replica_link``: ``(B/s,
    latency s)`` of the shard group and of the replicas' all-reduce; ``busy``: the step's compute and
    recomputation (s); ``one_bwd``: one micro-batch's backward of all the rank's blocks (s).

    A step runs ``n_micro / m`` schedule calls (``m``: ``Parallel.microbatches``, 0 all), each alike: every
    stage gathered :func:`stage_gathers` times in all, the first (before the call's first forward: the first
    action waits for it) exposed, the others prefetched beside the compute; the gradients reduced per
    :data:`PP_GRAD_SYNC`: ``last`` each stage's reduce-scatter and all-reduce once a call, exposed (the compute
    stream waits for them); ``microbatch`` each group's reduce-scatter (a stage has ``layers / v + 1``: its
    blocks and the root) every micro-batch beside the next group's backward (``one_bwd / layers``), what that
    cannot cover exposed (FSDP2 keeps one reduce-scatter in flight), and at the call's end each stage's last
    group's and the all-reduce exposed. What hides still costs :data:`CONTENTION` of its time, and what the
    whole step's compute cannot cover is exposed.
    """
    v, p = par.virtual, par.pp
    m = par.microbatches or n_micro
    calls = max(1, n_micro // m)
    stage = params / v  # one virtual stage's parameters
    groups = layers / v + 1  # FSDP2 groups of a stage: its blocks and the root
    bw_sh, lat_sh = shard_link
    bw_ar, lat_ar = replica_link
    r = par.dp_replicate
    ar_stage = collective_s("all_reduce", 4 * stage / n_sh, r, bw_ar, lat_ar)
    if n_sh == 1:
        gathered, ag_first, ag_s = 0.0, 0.0, 0.0
        rs_stage, n_rs = 0.0, 0
    else:
        gathers = calls * stage_gathers(p, v, m)
        gathered = gathers * stage * wbytes
        one = bus_bytes("all_gather", stage * wbytes, n_sh) / bw_sh + groups * (n_sh - 1) * lat_sh
        ag_s = gathers * one
        # Schedule1F1B (v = 1) gathers group by group in the first forward, FSDP2 prefetching the next: one group's
        # exposed; the interleaved runtime's first action waits for its stage's whole UNSHARD
        ag_first = calls * (one / groups if v == 1 else one)
        rs_stage = collective_s("reduce_scatter", 4 * stage, n_sh, bw_sh, lat_sh)
        n_rs = n_micro if par.pp_grad_sync == "microbatch" else calls
    rs_s = n_rs * v * rs_stage
    ar_s = calls * v * ar_stage
    if par.pp_grad_sync == "microbatch" and n_sh > 1:
        # FSDP2 keeps one reduce-scatter in flight (reduce_scatter_max_input_buffers = 1: a group's post-backward
        # makes the compute wait for the previous one), so each group's hides behind the next group's backward
        # only; the call's last backward leaves a stage's last group's (and the all-reduce) to REDUCE_GRAD's wait
        rs_group, bwd_group = rs_stage / groups, one_bwd / max(layers, 1)
        per_micro = groups * max(0.0, rs_group - bwd_group)
        exposed = ag_first + n_micro * v * per_micro + calls * v * (rs_group + ar_stage)
    else:
        exposed = ag_first + calls * v * (rs_stage + ar_stage)
    hidden = ag_s + rs_s + ar_s - exposed
    dp_s = exposed + max(0.0, hidden - busy)
    dp_s += CONTENTION * max(0.0, ag_s + rs_s + ar_s - dp_s)
    dp_bytes = (bus_bytes("all_gather", gathered, n_sh) + n_rs * bus_bytes("reduce_scatter", 4 * params, n_sh)
                + calls * bus_bytes("all_reduce", 4 * params / n_sh, r))
    return dp_s, gathered, n_rs * 4 * params, dp_bytes


def step_time(m, par: Parallel, hw, seq_len: int, batch: int, micro: int = 1, ac: str = "none",
              precision: str = "bf16", fp8_all_gather: bool = False) -> dict:
    """Seconds of one optimizer step of ``batch`` sequences of ``seq_len`` tokens on layout ``par`` (every rank
    alike; under pipelining the slowest rank's ``v ceil(n_layers / (pp v))`` blocks set the pace).

    ``micro``: sequences per micro-batch; ``ac``: :data:`AC_RECOMPUTE`; ``precision``: ``bf16``, ``fp8``
    (the blocks' linear layers at the fp8 peak plus the casts' bytes, torchtitan's Float8 recipe with dynamic
    tensorwise scaling; attention and the head stay bf16) or ``fp32`` (4-byte activations and gathered weights;
    the profile's bf16 peak stands for the rate, as a measured profile measures the run's dtype);
    ``fp8_all_gather``: FSDP2 gathers fp8 weights.

    Returns:
        ``{"step_s", "parts": {name: s}, "tokens_per_sec", "tokens_per_sec_per_gpu", "mfu", "model_flops",
        "bytes": {dimension: bytes one rank sends per step}, "links": {dimension: 'nvlink' | 'network'},
        "microbatches", "bubble"}``; the parts add up to ``step_s``.
    Raises:
        ValueError: the batch does not split into the data-parallel ranks' micro-batches, an unknown ``ac``,
            ``cp_exchange`` or ``attention``.
    """
    if ac not in AC_RECOMPUTE:
        raise ValueError(f"ac must be one of {AC_RECOMPUTE}, got {ac!r}")
    s = shape_of(m)
    r, sh, t, c, p = par.dp_replicate, par.dp_shard, par.tp, par.cp, par.pp
    dp = r * sh
    if batch % (dp * micro):
        raise ValueError(f"{batch} sequences do not split into {dp} data-parallel ranks x micro-batch {micro}")
    n_micro = batch // (dp * micro)  # micro-batches a rank runs per step
    tok = micro * seq_len / c  # rows of one micro-batch on one rank
    sp = par.sequence_parallel and t > 1
    peak, peak_mm = hw.peak_bf16_flops, hw.peak_fp8_flops if precision == "fp8" else hw.peak_bf16_flops
    a = 4 if precision == "fp32" else 2  # bytes of an activation and of a gathered weight
    hbm = hw.hbm_bytes_per_s * (hw.hbm_efficiency or HBM_EFFICIENCY)
    # compute of one micro-batch on this rank, forward; backward is 2x (attention 2.5x: flash-attention's five
    # matmuls to the forward's two)
    gemms = gemm_shapes(s, int(tok), t)
    blk_g = [gemm_s(M, K, N, peak_mm, hw) for name, M, K, N in gemms if name != "head"]  # qkv, wo, w1w3, w2
    block_mm = sum(blk_g)
    head_mm = next(gemm_s(M, K, N, peak, hw) for name, M, K, N in gemms if name == "head")
    attn = attention_flops(s, tok, seq_len, t) / (peak * (hw.attention_efficiency or ATTENTION_EFFICIENCY))
    if par.attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention must be one of {ATTENTION_KERNELS}, got {par.attention!r}")
    flex = par.attention == "flex" or (par.attention == "auto" and c > 1)
    attn_f, attn_b = (attn / (hw.flex_forward_rate or 1.0), attn / (hw.flex_backward_rate or 1.0)) if flex \
        else (attn, attn)
    elem = elementwise_bytes(s, tok, t, sp) / hbm
    if precision == "fp8":  # tensorwise dynamic scaling (torchao Float8Linear): each activation operand, forward
        # (each linear's input) and backward (its output gradient), needs its amax, then a cast; torch.compile
        # fuses the amax into the kernel that produces the operand, leaving the cast (read 2, write 1). Weights:
        # gathered in fp8 by FSDP2 (fp8_all_gather) they need only the backward's transposed copy (read 1,
        # write 1), else an amax and a cast each pass (5 bytes a weight, twice)
        q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
        ins, outs = 2 * s.d_model + (q + s.d_ff) / t, (q + 2 * kv + 2 * s.d_ff) / t + 2 * s.d_model
        elem += (3 * tok * (ins + outs) + (2 if fp8_all_gather else 10) * block_matmul_params(s) / t) / hbm
    # the loss: the logits' bytes (bf16 logits, fp32 log-softmax, its gradient) forward and backward, or the
    # profile's measured cross-entropy rate (on a CPU the exponentials bound it)
    loss = (tok * s.vocab_size / t / hw.loss_elements_per_s / 2 if hw.loss_elements_per_s
            else tok * (2 + 4 + 4) * s.vocab_size / t / hbm)
    # a measured per-operator cost (eager PyTorch's dispatch on a CPU; the GEMMs' launch cost is then in it)
    f_ops, b_ops = block_ops(s)
    op_s = hw.op_overhead_s
    fwd_block = block_mm + attn_f + elem + f_ops * op_s
    bwd_block = 2 * block_mm + 2.5 * attn_b + 2 * elem + b_ops * op_s
    recompute = {"none": 0.0, "selective": elem, "op": block_mm / 2 + elem, "full": fwd_block}[ac]
    # forward and backward of the output head and the loss, on the last stage
    head = 3 * head_mm + 2 * loss + sum(BASE_OPS) * op_s
    layers, heads = pipeline_pace(s.n_layers, p, par.virtual if p > 1 else 1,
                                  head / (fwd_block + bwd_block + recompute))
    compute = n_micro * (layers * (fwd_block + bwd_block) + heads * head)
    recompute_s = n_micro * layers * recompute

    # tensor parallel. With SP (torchtitan's; densetrain's parallel.sequence_parallel) per block an all-gather
    # before each column-parallel group (q/k/v; w1/w3) and a reduce-scatter after each row-parallel GEMM (wo, w2),
    # forward; the same pair backward (the groups' input gradients summed before the one reduce-scatter); again in
    # a full recomputation. Without SP (densetrain's default) the forward all-reduces the row-parallel outputs
    # (2 a block) and the backward each column-parallel linear's input gradient on its own (wq, wk, wv, w1, w3:
    # 5 a block), as counted on a real 2-rank gloo step (tests/test_plan_cost.py); plus, once a micro-batch, the
    # embedding's output (forward), the head's input gradient (backward) and the vocabulary-parallel loss's two
    # fp32 per-token reductions. AsyncTP (with SP) splits each collective in tp pieces, each moving beside the
    # GEMM on the piece before it: the first piece and what the GEMM cannot cover stay exposed.
    # Float8 with SP (torchao's PrepareFloat8ModuleInput / Float8ColwiseParallel, as torchtitan uses them): the
    # forward's all-gathers carry the activation already cast to fp8, 1 byte; reduce-scatters stay bf16.
    act = tok * s.d_model * a
    bw_tp, lat_tp, where_tp = link(hw, 1, t)
    ar_tp = allreduce_bw(hw, 1, t, bw_tp)
    half = collective_s("all_gather", act, t, bw_tp, lat_tp)  # one all-gather or reduce-scatter of act
    ar = collective_s("all_reduce", act, t, ar_tp, lat_tp)
    if precision == "fp8" and sp:  # the forward passes' two all-gathers at half the bytes: 3/4 of 4 halves
        half_fwd = (half + collective_s("all_gather", act / a, t, bw_tp, lat_tp)) / 2
    else:
        half_fwd = half
    fwd_passes = 1 + (1 if ac == "full" else 0)  # forward, recomputed forward; the backward has 2x the GEMMs
    wire = fwd_passes * 4 * half_fwd + 4 * half if sp else (2 * fwd_passes + 5) * ar
    if par.async_tp and sp and t > 1:
        per_block = async_tp_exposed(blk_g, half_fwd, half, t, fwd_passes, precision == "fp8")
        per_block += CONTENTION * (wire - per_block)
    else:
        per_block = wire
    ends = (2 if p == 1 else 1) if t > 1 else 0  # embedding and head collectives: the pace rank's share
    tp_s = n_micro * (layers * per_block + ends * ar
                      + (2 * collective_s("all_reduce", 4 * tok, t, ar_tp, lat_tp) if heads and t > 1 else 0.0))
    fwd_bytes = bus_bytes("all_reduce", act, t) * ((1 + 1 / a) / 2 if precision == "fp8" and sp else 1)
    block_bytes = (2 * (fwd_passes * fwd_bytes + bus_bytes("all_reduce", act, t)) if sp
                   else (2 * fwd_passes + 5) * bus_bytes("all_reduce", act, t))
    tp_bytes = n_micro * (layers * block_bytes + ends * bus_bytes("all_reduce", act, t)
                          + (2 * bus_bytes("all_reduce", 4 * tok, t) if heads else 0.0))

    # context parallel (CP_EXCHANGE): the keys and values of this rank's rows, gathered from the cp ranks
    if par.cp_exchange not in CP_EXCHANGE:
        raise ValueError(f"cp_exchange must be one of {CP_EXCHANGE}, got {par.cp_exchange!r}")
    kv_heads = s.n_heads if par.cp_exchange == "expanded" else s.n_kv_heads
    kv_local = tok * 2 * max(kv_heads // t, 1) * s.head_dim * a
    bw_cp, lat_cp, where_cp = link(hw, t, c)
    cp_calls = (3 if par.cp_exchange == "expanded" else 2) + (1 if ac == "full" else 0)
    cp_s = n_micro * layers * cp_calls * collective_s("all_gather", c * kv_local, c, bw_cp, lat_cp)
    cp_bytes = n_micro * layers * cp_calls * bus_bytes("all_gather", c * kv_local, c)

    # data parallel: FSDP2 over dp_shard x cp (a group per block, the root group holding the embedding, final
    # norm and head), the replicas' all-reduce; gradients reduced in fp32. Per micro-batch the forward gathers
    # every group and the backward the blocks again but the last (densetrain reshards every block but the last
    # after its forward; FSDP2 keeps the root's); under pipelining see pipelined_dp.
    blk = block_matmul_params(s) / t
    params = (s.n_layers * block_matmul_params(s) + s.d_model * s.vocab_size * (1 if s.tie_embeddings else 2)) / (p * t)
    n_sh = sh * c
    bw_sh, lat_sh, where_sh = link(hw, t, n_sh)
    bw_rep, lat_rep, where_rep = link(hw, t * n_sh, r)
    ar_bw = allreduce_bw(hw, t * n_sh, r, bw_rep)
    if par.pp_grad_sync not in PP_GRAD_SYNC:
        raise ValueError(f"pp_grad_sync must be one of {PP_GRAD_SYNC}, got {par.pp_grad_sync!r}")
    if p > 1:
        dp_s, gathered, reduced, dp_bytes = pipelined_dp(
            par, n_micro, params, layers, n_sh, 1 if fp8_all_gather else a, (bw_sh, lat_sh), (ar_bw, lat_rep),
            compute + recompute_s, layers * (bwd_block + recompute))
    else:
        if n_sh == 1:
            gathered, calls = 0.0, 0
        else:
            gathered, calls = n_micro * (params + max(layers - 1, 0) * blk), n_micro * 2 * int(layers)
        gathered *= 1 if fp8_all_gather else a
        ag_s = bus_bytes("all_gather", gathered, n_sh) / bw_sh + calls * (n_sh - 1) * lat_sh
        # the gradients' reduce-scatter every micro-batch (densetrain.parallel.wrap.grad_sync accumulates FSDP2's
        # shards, not unsharded gradients), the replicas' all-reduce once
        n_rs = 1 if n_sh == 1 else n_micro
        rs_s = n_rs * collective_s("reduce_scatter", 4 * params, n_sh, bw_sh, lat_sh)
        ar_s = collective_s("all_reduce", 4 * params / n_sh, r, ar_bw, lat_rep)
        dp_bytes = bus_bytes("all_gather", gathered, n_sh) + n_rs * bus_bytes("reduce_scatter", 4 * params, n_sh) \
            + bus_bytes("all_reduce", 4 * params / n_sh, r)
        reduced = 4 * params
        # prefetched beside the blocks; the first block's gather and the last reduction stay exposed
        first = ag_s / max(calls, 1)
        dp_s = max(first, ag_s + rs_s + ar_s - (compute + recompute_s)) if (ag_s + rs_s + ar_s) else 0.0
        dp_s += CONTENTION * max(0.0, ag_s + rs_s + ar_s - dp_s)  # what hides still takes SMs from the compute

    # pipeline: sends of the activations (their gradients back) on the fill and drain path, the bubble
    v = par.virtual if p > 1 else 1
    pp_act = act / (t if sp else 1)
    bw_pp, lat_pp, where_pp = link(hw, t * n_sh * r, p)  # n_sh = dp_shard x cp: the inner degrees, cp once
    send = pp_act / bw_pp + lat_pp if p > 1 else 0.0
    pp_s = 2 * (p - 1) * send
    pp_bytes = 2 * v * n_micro * pp_act if p > 1 else 0.0
    m_call = par.microbatches or n_micro
    busy = compute + recompute_s + tp_s + cp_s
    share = bubble_share(p, m_call, v, par.schedule)
    bubble_s = share / (1 - share) * busy  # (pp - 1) / (v m) of the busy time

    # optimizer: AdamW over the rank's fp32 shard. Fused (densetrain's choice for bf16 runs, densetrain/optim.py):
    # parameter, gradient and two moments read, three written, 28 bytes a parameter. foreach (its choice for fp32
    # runs): eight passes (weight decay, lerp, mul + addcmul, sqrt, div, add eps, addcdiv), 84 bytes
    optim_s = (84 if precision == "fp32" else 28) * params / max(n_sh, 1) / hbm + optimizer_ops(s, layers) * op_s
    parts = {"compute": compute, "recompute": recompute_s, "tp": tp_s, "cp": cp_s, "dp": dp_s, "pp": pp_s,
             "bubble": bubble_s, "optimizer": optim_s}
    # the host's share: DTensor and FSDP2 Python work, collectives on the compute's cores (cost/host.py)
    parts["host"] = host_time(par, hw, n_micro, layers, heads, gathered, reduced, dp_s, tok * s.vocab_size / t)
    step = sum(parts.values())
    tokens = batch * seq_len
    per_gpu = tokens / step / par.world
    return {"step_s": step, "parts": parts, "tokens_per_sec": tokens / step, "tokens_per_sec_per_gpu": per_gpu,
            "mfu": flops_per_token(s, seq_len) * per_gpu / hw.peak_bf16_flops,
            "model_flops": flops_per_token(s, seq_len) * tokens,
            "bytes": {"tp": tp_bytes, "cp": cp_bytes, "dp": dp_bytes, "pp": pp_bytes},
            "links": {"tp": where_tp, "cp": where_cp, "dp_shard": where_sh, "dp_replicate": where_rep,
                      "pp": where_pp},
            "microbatches": n_micro, "bubble": bubble_s / step}
