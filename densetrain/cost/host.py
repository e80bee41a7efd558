"""The host's share of a training step: the Python and bookkeeping work that PyTorch's parallel wrappers do
beside the operators, and collectives that run on the compute's own cores. On a GPU this work runs ahead of
the kernels and hides behind them (a profile leaves the unit costs 0); on a CPU it is the step (issue 41
item 6: densetrain's own steps on this machine, ``benchmarks/planner_machine.py``).

Counts x unit costs. The counts come from the model shape and layout; the unit costs from the profile
(``densetrain doctor --profile``, :mod:`densetrain.tools.doctor`, measured on this machine):

- DTensor dispatches (``Hardware.dtensor_op_s`` each, beyond the local operator that
  ``Hardware.op_overhead_s`` already charges): tensor parallelism's block and head run on DTensors
  (:data:`TP_DTENSOR_OPS`); the optimizer's foreach operators run on DTensor parameters under FSDP2 or TP
  (:data:`OPTIM_DTENSOR_OPS`).
- FSDP2 groups (``Hardware.fsdp_group_s`` a group a micro-batch): the pre/post forward and backward hooks, the
  unshard/reshard bookkeeping and the copies in and out of the flat buffers of a group (a block, and the root
  holding the embedding, final norm and head).
- The vocabulary-parallel cross-entropy under tensor parallelism (``Hardware.loss_parallel_logit_s`` a logit
  of the rank's ``tokens x vocab / tp``, once a micro-batch on the stage holding the head): torch's
  ``loss_parallel`` takes the log-softmax in separate passes and densetrain's step also takes ``log Z``
  (:mod:`densetrain.parallel.loss_parallel`), where the step model charges one fused cross-entropy
  (``Hardware.loss_elements_per_s``); on this machine the split passes cost 3-5x the fused one a logit (issue
  41 item 6, session 17: 7-16 ms of a tiny TP step on 2 ranks, in CPU seconds).
- Data-parallel collectives on the compute's cores (``Hardware.collectives_on_cores``, 1 for gloo on a CPU):
  the cost model hides FSDP2's all-gathers and reduce-scatters and the replicas' all-reduce behind the compute
  (:mod:`densetrain.cost.step`); gloo's copies, reductions and socket work run on the same cores, so the part
  the step model left hidden is charged here, each kind at its own measured rate
  (``Hardware.all_gather_bytes_per_s``, ``reduce_scatter_bytes_per_s``; gloo's reduce-scatter moves a byte
  3-4x slower than its all-reduce on this machine); FSDP2's fixed cost a call is in its group's cost, the
  replicas' all-reduce pays the profile's latency per ring step.
- Kernel calls (``Hardware.gemm_call_s`` a GEMM, ``Hardware.attention_call_s`` an attention call forward and
  backward, each beyond the ``op_overhead_s`` of its operators): the step model charges a GEMM's FLOPs at the
  rate of a 512 x 512 one and attention at the rate of a 512-token one; a small call costs more than that, with
  two threads most (the second thread woken, the work split over few rows or heads, the join): on this machine
  ~20-90 µs a GEMM and ~0.3 ms an attention call in CPU seconds with 2 threads, ~0 and ~0.15 ms with one
  (issue 41 item 6, session 18: tiny on 1 process with 2 threads, whose 87 GEMMs and 4 attention calls a step
  are all small, measured 12-15% more CPU seconds than with one thread). :data:`KERNEL_CALLS` counts them.

Pure math, like the rest of :mod:`densetrain.cost`: no torch. Read by :func:`densetrain.cost.step.step_time`.
"""

from __future__ import annotations

import math

TP_DTENSOR_OPS = (141, 52)
"""DTensor dispatches of one micro-batch's forward and backward under tensor parallelism (densetrain's, no
sequence parallelism): per block, and outside the blocks (embedding, final norm, output head, the
vocabulary-parallel loss). Counted with a ``TorchDispatchMode`` on a real 2-rank gloo step of the tiny preset,
the same with grouped-query (``n_kv_heads`` 2) and multi-head (4) attention, torch 2.13;
tests/test_plan_host.py recounts them."""
OPTIM_DTENSOR_OPS = 15
"""DTensor dispatches of one AdamW step (torch's foreach implementation: one dispatch a foreach operator over
all the DTensor parameters, whatever their number) under FSDP2 or tensor parallelism (counted as above)."""
KERNEL_CALLS = (21, 1, 3)
"""Kernel calls of one micro-batch's forward and backward: GEMMs per block (7 linears, ``wq, wk, wv, wo, w1, w2,
w3``, each a forward GEMM and two backward: the input's and the weight's gradients), attention calls per block
(one ``F.scaled_dot_product_attention``, forward and backward), GEMMs of the output head (the same three). The
same on a tensor-parallel rank (each linear's local shard). Counted with a ``TorchDispatchMode`` on a real step
of the tiny preset (``aten.mm``, the SDPA forward); tests/test_plan_host.py recounts them on 1 and 3 blocks."""
DDP_BUCKET_BYTES = 25 * 2**20
"""DDP's gradient bucket (``bucket_cap_mb`` 25, torch's default; densetrain keeps it): one all-reduce call each."""


def dtensor_ops(par, n_micro: int, layers: float, heads: int) -> float:
    """DTensor dispatches one rank runs in a step: :data:`TP_DTENSOR_OPS` per micro-batch (the blocks of the
    rank's stage, the embedding/head part once on the stage holding the head), :data:`OPTIM_DTENSOR_OPS` once
    when the parameters are DTensors (FSDP2 over ``dp_shard x cp``, or TP)."""
    tp = TP_DTENSOR_OPS[0] * layers + TP_DTENSOR_OPS[1] * heads if par.tp > 1 else 0.0
    sharded = par.tp > 1 or par.dp_shard * par.cp > 1
    return n_micro * tp + (OPTIM_DTENSOR_OPS if sharded else 0)


def fsdp_groups(par, n_micro: int, layers: float, heads: int) -> float:
    """FSDP2 groups one rank runs forward and backward in a step: every block of its stage and the root group
    (``heads``: the stage with the head; the root is counted there), once a micro-batch; 0 without FSDP2."""
    if par.dp_shard * par.cp <= 1:
        return 0.0
    return n_micro * (layers + heads)


def dp_collectives_cpu_s(hw, par, gathered: float, grad_bytes: float) -> float:
    """Seconds the data-parallel collectives take on the cores: FSDP2's all-gathers of ``gathered`` bytes
    (the whole parameters each call gathers, summed over the step) and reduce-scatter of ``grad_bytes`` (fp32
    gradients of the rank's ``1 / tp`` of the model) over ``dp_shard x cp`` ranks, the replicas' all-reduce of
    the shard's gradients over ``dp_replicate``: bytes at NCCL's ring factors (all-gather and reduce-scatter
    ``(n - 1) / n``, all-reduce ``2 (n - 1) / n`` of the whole, as densetrain.cost.step.bus_bytes) over the
    kind's measured rate (else the profile's one link: collectives on the cores means one host, a measured CPU
    profile). Fixed costs a call: FSDP2's are in ``Hardware.fsdp_group_s`` (measured with its
    collectives); the replicas' all-reduce pays ``2 (n - 1)`` ring steps of the profile's latency per DDP bucket
    (:data:`DDP_BUCKET_BYTES`)."""
    n, r = par.dp_shard * par.cp, par.dp_replicate
    link = hw.nvlink_bytes_per_s
    total = 0.0
    if n > 1:
        total += (n - 1) / n * (gathered / (hw.all_gather_bytes_per_s or link)
                                + grad_bytes / (hw.reduce_scatter_bytes_per_s or link))
    if r > 1:
        shard = grad_bytes / n
        total += 2 * (r - 1) / r * shard / link + math.ceil(shard / DDP_BUCKET_BYTES) * 2 * (r - 1) * hw.latency_intra_s
    return total


def kernel_calls(n_micro: int, layers: float, heads: int) -> tuple[float, float]:
    """``(GEMM calls, attention calls)`` one rank runs in a step: :data:`KERNEL_CALLS` per micro-batch over the
    rank's blocks, the head's GEMMs on the stage holding it."""
    gemm, attention, head = KERNEL_CALLS
    return n_micro * (gemm * layers + head * heads), n_micro * attention * layers


def loss_parallel_logits(par, n_micro: int, heads: int, logits: float) -> float:
    """Logits one rank takes through the vocabulary-parallel cross-entropy in a step: ``logits`` (the rank's
    ``tokens x vocab / tp`` of a micro-batch) once a micro-batch on the stage holding the head, under tensor
    parallelism (densetrain's TP training step always runs it: ``apply_tensor_parallel(loss_parallel=True)``);
    0 without."""
    return n_micro * heads * logits if par.tp > 1 else 0.0


def host_time(par, hw, n_micro: int, layers: float, heads: int, gathered: float, grad_bytes: float,
              exposed_dp_s: float, logits: float = 0.0) -> float:
    """Seconds of host work one rank adds to a step (module docstring): small kernel calls' fixed cost
    (:func:`kernel_calls`), DTensor dispatches, FSDP2 groups, the vocabulary-parallel cross-entropy's split
    passes over ``logits`` a micro-batch (the rank's ``tokens x vocab / tp``) and, where collectives run on the
    compute's cores, the data-parallel collectives' time beyond ``exposed_dp_s`` (what the step model already
    charged for them). 0 for a profile without these unit costs (the GPU datasheet profiles)."""
    dp_cpu = 0.0
    if hw.collectives_on_cores:
        dp_cpu = hw.collectives_on_cores * max(0.0, dp_collectives_cpu_s(hw, par, gathered, grad_bytes) - exposed_dp_s)
    gemms, attentions = kernel_calls(n_micro, layers, heads)
    # the operators' own fixed cost is charged by the step model (op_overhead_s a call: one operator a GEMM, two
    # an attention call, forward and backward)
    calls = (gemms * max(0.0, hw.gemm_call_s - hw.op_overhead_s)
             + attentions * max(0.0, hw.attention_call_s - 2 * hw.op_overhead_s))
    return (calls + dtensor_ops(par, n_micro, layers, heads) * hw.dtensor_op_s
            + fsdp_groups(par, n_micro, layers, heads) * hw.fsdp_group_s
            + loss_parallel_logits(par, n_micro, heads, logits) * hw.loss_parallel_logit_s + dp_cpu)
