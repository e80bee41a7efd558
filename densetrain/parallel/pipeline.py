"""Pipeline parallelism: the model's layers split into stages over the ``pp`` mesh dimension, run by
``torch.distributed.pipelining`` (``PipelineStage`` and its schedule classes; no schedule of our own).

The split counts the embedding and the output head (with the final norm) as one layer each, so a model
of ``n_layers`` blocks has ``n_layers + 2`` layers to share between ``pp * pp_virtual_stages`` stages;
for Llama 3 405B (126 blocks, 16 stages) that is Meta's split: 8 layers per stage, the first and the
last holding 7 blocks (Llama 3 report, sec. 3.3.2, "we reduce one Transformer layer each from the first
and the last stages"). Rank ``r`` of the pipeline holds stages ``r, r + pp, r + 2 pp, ...`` (the
interleaved schedule's loop order).

A rank keeps the model's module tree with the blocks of other stages deleted and the embedding, final
norm and head set to ``None`` where another stage holds them; the blocks stay under ``layers.<global
index>`` (a :class:`LayerDict`), so parameter names are the single-process ones and a distributed
checkpoint written at one pipeline degree loads at another. The model's forward skips what is ``None``
(a later stage takes hidden states, an earlier one returns them).

Micro-batches and the loss: a step's rows on a rank run as schedule calls of ``pp_microbatches``
micro-batches of ``micro_batch_size`` rows; the schedule calls the step's loss function on the last
stage per micro-batch (the sum of its token losses divided by the step's global token count, as
without pipelining), with ``scale_grads=False`` so that the schedule does not also divide by the
number of micro-batches.

Gradients of an FSDP2 stage (``parallel.pp_grad_sync``, :data:`GRAD_SYNC_MODES`): ``"last"`` is torch's
``PipelineStage``, which turns FSDP2's gradient sync off for every backward of a schedule call and reduces
once at its end (``perform_reduce_grad``), so every gradient of the rank's stages stays unsharded in the
policy's fp32 ``reduce_dtype`` until then (4 bytes a parameter the rank holds, ``/ tp``). ``"microbatch"``
(:func:`reduce_scatter_backward`) lets FSDP2 reduce-scatter every micro-batch's gradients and accumulate the
shards, as the non-pipelined path does (:func:`densetrain.parallel.wrap.grad_sync`): the rank holds a few
blocks' unsharded gradients at a time (:func:`densetrain.tools.plan.memory.layout_memory`), for one
reduce-scatter per micro-batch instead of one per call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.utils._pytree as pytree
from torch import nn

from densetrain.config.validate import PP_GRAD_SYNC
from densetrain.errors import ConfigError, TrainError

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved_1f1b")
BUBBLE_TARGET = 0.15  # the default micro-batch count keeps the idle fraction of a step below this
GRAD_SYNC_MODES = PP_GRAD_SYNC  # parallel.pp_grad_sync's values, validated with the config
EVAL_SCHEDULES = 8  # forward-only schedules kept (one per input shape); each holds its stages' buffers


@dataclass(frozen=True)
class StagePart:
    """What one pipeline stage holds: ``embedding`` (the token embedding), the blocks ``layers`` (global
    indices), ``head`` (the final norm and the output projection)."""

    index: int
    embedding: bool
    layers: range
    head: bool

    @property
    def n_units(self) -> int:
        """Layers counted as the split counts them (embedding and head one each)."""
        return int(self.embedding) + len(self.layers) + int(self.head)


def split_stages(n_layers: int, n_stages: int, layers_per_stage: int = 0) -> list[StagePart]:
    """The stages of a model of ``n_layers`` blocks: ``n_layers + 2`` layers (unit 0 the embedding, units
    ``1 .. n_layers`` the blocks, the last the head) in consecutive runs, as even as possible (the first
    stages one longer when it does not divide), or ``layers_per_stage`` each.

    Raises:
        ConfigError: fewer layers than stages, or ``layers_per_stage`` that does not tile the layers.
    """
    units = n_layers + 2
    if units < n_stages:
        raise ConfigError(f"parallel: {n_stages} pipeline stages need at least as many layers; the model has "
                          f"{n_layers} + 2 (embedding and head)")
    if layers_per_stage:
        if layers_per_stage * n_stages != units:
            raise ConfigError(f"parallel.pp_layers_per_stage ({layers_per_stage}) times {n_stages} stages must be "
                              f"n_layers + 2 = {units}")
        sizes = [layers_per_stage] * n_stages
    else:
        sizes = [units // n_stages + (s < units % n_stages) for s in range(n_stages)]
    parts, start = [], 0
    for s, size in enumerate(sizes):
        end = start + size
        blocks = range(max(start, 1) - 1, min(end, n_layers + 1) - 1)
        parts.append(StagePart(s, start == 0, blocks, end == units))
        start = end
    return parts


def rank_stages(pp_rank: int, pp: int, virtual: int) -> list[int]:
    """Global stage indices of pipeline rank ``pp_rank``: ``pp_rank + i * pp`` for ``i < virtual``."""
    return [pp_rank + i * pp for i in range(virtual)]


def bubble_fraction(pp: int, microbatches: int, virtual: int = 1) -> float:
    """Idle fraction of a step's pipeline time: ``(pp - 1) / (v (m + pp - 1))`` for ``m`` micro-batches and
    ``v`` stages per rank (GPipe, Huang et al. 2019; 1F1B has the same bubble, Narayanan et al. 2021 sec.
    2.2; the interleaved schedule divides it by ``v``, ibid. sec. 2.2.2)."""
    return (pp - 1) / (virtual * (microbatches + pp - 1))


def resolve_microbatches(configured: int, pp: int, virtual: int, available: int, where: str = "") -> int:
    """Micro-batches per schedule call: ``configured``, or (0) the fewest ``m >= pp`` with a bubble under
    :data:`BUBBLE_TARGET` that divide the ``available`` micro-batches a rank has in a step, else the
    largest divisor of ``available`` that is at least ``pp``.

    Raises:
        ConfigError: ``available`` is not a multiple of ``configured``, or fewer than ``pp``.
    """
    if configured:
        if available % configured:
            raise ConfigError(f"parallel.pp_microbatches ({configured}) must divide the {available} micro-batches "
                              f"a rank runs per step{where}")
        return configured
    divisors = [m for m in range(pp, available + 1) if available % m == 0]
    if not divisors:
        raise ConfigError(f"parallel.pp ({pp}) needs at least {pp} micro-batches per rank and step; a rank has "
                          f"{available}{where}: lower micro_batch_size or raise the batch")
    good = [m for m in divisors if bubble_fraction(pp, m, virtual) < BUBBLE_TARGET]
    return good[0] if good else divisors[-1]


def join_inputs(inputs: list[dict]) -> dict:
    """The model inputs of several micro-batches as one schedule call's: every tensor leaf (``doc_ids``,
    ``positions``: (b, T); a :class:`~densetrain.parallel.context.ContextParallelAttention`'s document ids)
    concatenated along rows, in order, for the schedule to split again per micro-batch; the rest (time
    indices, the mesh) taken from the first, whose pytree structure every one shares."""
    leaves, spec = pytree.tree_flatten(inputs[0])
    rest = [pytree.tree_leaves(d) for d in inputs[1:]]
    return pytree.tree_unflatten([torch.cat([a, *(r[i] for r in rest)]) if isinstance(a, torch.Tensor) else a
                                  for i, a in enumerate(leaves)], spec)


def reduce_scatter_backward(stage, backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> tuple:
    """``PipelineStage.backward_maybe_with_nosync`` of an FSDP2 stage under ``parallel.pp_grad_sync =
    "microbatch"`` (bound to the stage by :meth:`PipelineModel._schedule`): one micro-batch's backward with
    FSDP2's gradient sync on, so each parameter group's post-backward reduce-scatters the micro-batch's
    gradients and adds them to the sharded ``.grad`` (torch's ``FSDPParamGroup.post_backward`` and
    ``foreach_reduce``), dropping the unsharded ones. Under HSDP the replicas' all-reduce runs on the stage's
    last backward of the schedule call only (before it, FSDP2 sums the reduce-scattered shards in its partial
    reduce output, which that all-reduce adds in). Parameters stay gathered between micro-batches
    (reshard_after_backward off) and FSDP2's end-of-backward work waits for the call's end, both as in torch's
    method. The call's end stays torch's ``perform_reduce_grad`` (the REDUCE_GRAD action): its post-backward
    finds no unsharded gradient left, so nothing is reduced twice; it reshards and finalises.

    ``backward_type``: "full" (the only one the schedules of :data:`SCHEDULE_NAMES` run); ``bwd_kwargs``:
    ``stage_output``, ``output_grads``, ``input_values`` as torch passes them.

    Returns:
        ``(gradients of the stage inputs, None)``, as torch's method does for a full backward.
    Raises:
        TrainError: a split backward ("input" / "weight", zero-bubble schedules'), which this does not run.
    """
    from torch.distributed.pipelining._backward import stage_backward

    if backward_type != "full":
        raise TrainError(f"parallel.pp_grad_sync 'microbatch' runs full backwards only; the schedule asked for "
                         f"'{backward_type}'")
    mod = stage.submod
    mod.set_is_last_backward(False)
    mod.set_reshard_after_backward(False)
    mod.set_requires_gradient_sync(True)  # also turns HSDP's all-reduce on: the next line decides it
    mod.set_requires_all_reduce(last_backward)
    return stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"]), None


class LayerDict(nn.ModuleDict):
    """The blocks a pipeline rank holds, keyed by their global index (so ``layers.<i>`` names stay those
    of the whole model); iterates over the blocks in order, as ``nn.ModuleList`` does."""

    def __iter__(self):
        return iter(self._modules.values())


def keep_parts(model: nn.Module, parts: list[StagePart]) -> None:
    """Trim ``model`` (a :class:`~densetrain.model.llama.Transformer`, usually on meta) in place to the
    union of ``parts``: other stages' blocks dropped, the embedding / norm and head set to None where no
    part holds them. ``model.full_state_names`` keeps the whole model's state names (a checkpoint of the
    whole model is then not taken for another model's, :func:`densetrain.checkpoint.load_checkpoint`)."""
    model.full_state_names = frozenset(model.state_dict())
    keep = sorted({i for p in parts for i in p.layers})
    model.layers = LayerDict({str(i): model.layers[i] for i in keep})
    if not any(p.embedding for p in parts):
        model.tok_embeddings = None
    if not any(p.head for p in parts):
        model.norm = None
        model.output = None


def part_view(model: nn.Module, part: StagePart) -> nn.Module:
    """A module of ``model``'s class running only ``part`` (one virtual stage of an interleaved
    schedule): the same block, embedding and head objects as ``model`` (parameters shared), and the
    model's RoPE tables (:meth:`rope_cache` and the methods beside it are ``model``'s own, bound to it):
    a stage's switch of the RoPE base, ``model.set_rope``, reaches every virtual stage. (A copy of the
    base kept the first stage's: interleaved_1f1b's long-context steps ran at the old rope_theta.)"""
    view = type(model).__new__(type(model))
    nn.Module.__init__(view)
    for k in ("cfg", "head_dim", "logit_mult", "_attn_scale"):
        setattr(view, k, getattr(model, k))
    for k in ("rope_cache", "reset_rope_cache", "rope_inv_freq", "set_rope", "set_rope_theta"):
        setattr(view, k, getattr(model, k))
    view.tok_embeddings = model.tok_embeddings if part.embedding else None
    view.layers = LayerDict({str(i): model.layers[str(i)] for i in part.layers})
    view.norm = model.norm if part.head else None
    view.output = model.output if part.head else None
    if hasattr(model, "loss_parallel_mesh"):
        view.loss_parallel_mesh = model.loss_parallel_mesh
    return view


class PipelineModel(nn.Module):
    """The step's and the evaluations' entry to a pipelined model (what the non-pipelined path calls the
    ``step_model``): :meth:`step` runs a training schedule over micro-batches, :meth:`forward` a
    forward-only one whose logits every rank of the pipeline receives.

    Args:
        chunks: this rank's stage modules, in stage order (one, or ``pp_virtual_stages``).
        stages: their global stage indices. n_stages: ``pp * pp_virtual_stages``.
        schedule: one of :data:`SCHEDULE_NAMES`. group: the pipeline process group (the ``pp`` mesh dim).
        microbatches: ``parallel.pp_microbatches`` (0: automatic, :func:`resolve_microbatches`).
        sequence_parallel: tensor parallel splits the hidden states between stages along time, so every
            stage is given the rows' RoPE ``positions`` (its hidden states do not tell their length).
        grad_sync: ``parallel.pp_grad_sync``, one of :data:`GRAD_SYNC_MODES`; it acts on FSDP2 chunks only
            (without data parallelism there is nothing to reduce: "microbatch" is then noted as ignored).
    """

    def __init__(self, chunks: list[nn.Module], stages: list[int], n_stages: int, schedule: str, group,
                 device: torch.device, vocab_size: int, microbatches: int = 0, sequence_parallel: bool = False,
                 grad_sync: str = "last"):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.stages, self.n_stages, self.schedule_name = stages, n_stages, schedule
        self.group, self.device, self.vocab_size = group, device, vocab_size
        self.pp, self.virtual, self.configured_microbatches = n_stages // len(stages), len(stages), microbatches
        self.is_first, self.is_last = 0 in stages, n_stages - 1 in stages
        self.decisions: list[str] = []  # one line per new micro-batch count, for the run's log (read and cleared)
        self._microbatches: dict[int, int] = {}
        self._schedules: dict[tuple, object] = {}
        self._loss_fn: Callable | None = None
        self._inferring = False
        self.sequence_parallel = sequence_parallel
        fsdp = all(hasattr(c, "set_requires_gradient_sync") for c in chunks)  # FSDPModule, without importing FSDP
        self.reduce_every_microbatch = fsdp and grad_sync == "microbatch"
        if fsdp:
            self.decisions.append(
                "pipeline: FSDP2 reduce-scatters the gradients every micro-batch and accumulates shards "
                "(parallel.pp_grad_sync = 'microbatch')" if grad_sync == "microbatch" else
                "pipeline: gradients stay unsharded in fp32 until the last micro-batch's backward of each call, "
                "then FSDP2 reduce-scatters once (parallel.pp_grad_sync = 'last', torch's PipelineStage)")
        elif grad_sync == "microbatch":
            self.decisions.append("pipeline: parallel.pp_grad_sync = 'microbatch' ignored: no FSDP2 (no "
                                  "data-parallel ranks), no gradients to reduce-scatter")

    def _with_positions(self, tokens: torch.Tensor, kwargs: dict) -> dict:
        if self.sequence_parallel and kwargs.get("positions") is None and kwargs.get("attend") is None:
            B, T = tokens.shape
            kwargs = {**kwargs, "positions": torch.arange(T, device=tokens.device).expand(B, T)}
        return kwargs

    def microbatches(self, available: int) -> int:
        """Micro-batches per schedule call when a rank runs ``available`` of them in a step
        (:func:`resolve_microbatches`; a new count is noted in :attr:`decisions`). Raises: ConfigError."""
        if available not in self._microbatches:
            m = resolve_microbatches(self.configured_microbatches, self.pp, self.virtual, available)
            self._microbatches[available] = m
            self.decisions.append(f"pipeline: {available} micro-batches per rank and step run as {available // m} "
                                  f"{self.schedule_name} call(s) of {m} over {self.n_stages} stages (bubble "
                                  f"{bubble_fraction(self.pp, m, self.virtual):.1%})")
        return self._microbatches[available]

    def _loss(self, output, target):
        # A new stage infers its buffers' shapes by running one forward and backward on stand-in tensors
        # before the real micro-batches (torch's dynamic metadata inference), calling the loss once: that
        # call's numbers are not the step's.
        record, self._inferring = not self._inferring, False
        return self._loss_fn(output, target, record=record)

    def _schedule(self, key: tuple, n_micro: int, train: bool):
        """The schedule for inputs of ``key`` (shapes; new stages and a new schedule per shape, since a stage
        infers its send/receive buffers from the first micro-batch it sees)."""
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleLoopedBFS,
        )

        key = (*key, n_micro, train)
        if key not in self._schedules:
            evals = [k for k in self._schedules if not k[-1]]
            if not train and len(evals) >= EVAL_SCHEDULES:  # downstream batches come in many shapes: the oldest goes
                del self._schedules[evals[0]]
            self._inferring = train and self.is_last
            stages = [PipelineStage(c, s, self.n_stages, self.device, group=self.group)
                      for c, s in zip(self.chunks, self.stages)]
            if train and self.reduce_every_microbatch:
                for st in stages:  # the least invasive hook: torch's stage, its one FSDP2 backward method replaced
                    st.backward_maybe_with_nosync = functools.partial(reduce_scatter_backward, st)
            loss = self._loss if train else None
            if len(stages) > 1:
                cls = ScheduleInterleaved1F1B if train else ScheduleLoopedBFS
                sched = cls(stages, n_micro, loss_fn=loss, scale_grads=False)
            else:
                cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[self.schedule_name] if train else ScheduleGPipe
                sched = cls(stages[0], n_micro, loss_fn=loss, scale_grads=False)
            self._schedules[key] = sched
        return self._schedules[key]

    def step(self, x: torch.Tensor, y: torch.Tensor, n_micro: int, loss_fn: Callable, **kwargs) -> None:
        """Forward and backward of ``n_micro`` micro-batches: ``x, y`` (n_micro * b, T) int64 on every rank
        of the pipeline (the first stage reads ``x``, the last ``y``), ``kwargs`` the model's per-row inputs
        (``doc_ids``, ``positions``: (n_micro * b, T)), given to every stage. ``loss_fn(logits (b, T, vocab),
        targets (b, T), record) -> 0-d objective`` runs on the last stage per micro-batch (``record`` False:
        a stand-in call, its numbers are not to be counted); gradients accumulate."""
        kwargs = self._with_positions(x, kwargs)
        key = (tuple(x.shape), tuple(sorted(kwargs)))
        sched = self._schedule(key, n_micro, train=True)
        self._loss_fn = loss_fn
        try:
            sched.step(*((x,) if self.is_first else ()), target=y if self.is_last else None,
                       return_outputs=False, **kwargs)
        finally:
            self._loss_fn = None

    def _new_shape_together(self, key: tuple) -> None:
        """Before a forward-only call: when any rank meets an input shape it has no schedule for, every rank
        builds its schedule anew. A new schedule's stages infer their buffers with a stand-in forward, which under
        FSDP2 all-gathers over the data-parallel ranks; evaluation hands those ranks different inputs (documents,
        examples of other lengths), so a shape new to one rank and cached on another ran different collectives
        and hung (pp 2 x dp_shard 2: the loss by position, downstream tasks; review of issue 41). One all-reduce
        a call; every rank makes the same forward calls (:meth:`forward`)."""
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        full = (*key, 1, False)
        miss = torch.tensor([int(full not in self._schedules)], dtype=torch.int32, device=self.device)
        dist.all_reduce(miss, op=dist.ReduceOp.MAX)
        if int(miss):
            self._schedules.pop(full, None)

    def forward(self, tokens: torch.Tensor, cache=None, **kwargs) -> torch.Tensor:
        """Forward-only: ``tokens`` (B, T) int64 on every rank of the pipeline -> logits (B, T, vocab_size)
        float32 on every rank (the last stage's, broadcast over the pipeline group). Every rank of the
        pipeline must make the same calls with the same shapes (validation and downstream multiple-choice
        scoring and the loss by position do: :func:`densetrain.parallel.dp_rank_size` gives pipeline ranks one
        share of the work; the training loop hands every evaluation this module, as it hands the others the
        step's module).
        A new shape builds new stages (their buffers are inferred from it); the last
        :data:`EVAL_SCHEDULES` shapes are kept.

        Raises: TrainError with a KV ``cache`` (generation does not run through pipeline stages)."""
        import torch.distributed as dist

        if cache is not None or kwargs.get("head") is not None or kwargs.get("attend") is not None:
            raise TrainError("parallel.pp > 1: generation and chunked-head forwards do not run through pipeline "
                             "stages; set parallel.pp = 1 for them")
        kwargs = self._with_positions(tokens, {k: v for k, v in kwargs.items() if v is not None})
        key = (tuple(tokens.shape), tuple(sorted(kwargs)))
        self._new_shape_together(key)
        sched = self._schedule(key, 1, train=False)
        out = sched.eval(*((tokens,) if self.is_first else ()), **kwargs)
        B, T = tokens.shape
        logits = out.float().contiguous() if self.is_last else torch.empty(B, T, self.vocab_size, device=self.device)
        dist.broadcast(logits, group=self.group, group_src=last_stage_rank(self.n_stages, len(self.stages)))
        return logits


def last_stage_rank(n_stages: int, virtual: int) -> int:
    """Pipeline rank (within the ``pp`` group) holding the last stage: ``(n_stages - 1) % pp``."""
    return (n_stages - 1) % (n_stages // virtual)


def describe_split(parts: list[StagePart], pp: int, schedule: str) -> str:
    """One line for the run's log: what every stage holds and which pipeline rank runs it."""
    def what(p: StagePart) -> str:
        held = (["embedding"] if p.embedding else []) + (
            [f"blocks {p.layers.start}-{p.layers.stop - 1}"] if len(p.layers) else []) + (["head"] if p.head else [])
        return f"{p.index} (rank {p.index % pp}): {' + '.join(held)}"
    return f"pipeline: {len(parts)} stages over {pp} ranks, schedule {schedule}; stage " + "; ".join(map(what, parts))
