"""One optimizer step's computation: draw the global batch, forward/backward over micro-batches,
reduce the numbers over ranks, the global grad norm (and clipping). Nothing is applied here: the
loop's decision point (:mod:`densetrain.train.watchers`) decides whether the update is.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from densetrain.data.mixture import MixtureSampler, Sample
from densetrain.loss import (
    IGNORE_INDEX,
    chunk_tokens_for,
    chunked_head_losses,
    token_losses,
    z_loss_sum,
    z_loss_sum_from_lse,
)
from densetrain.model.compiling import pin_inductor_cache
from densetrain.model.masks import document_ids
from densetrain.parallel import all_reduce_max, all_reduce_sum, clip_grad_norm, grad_sync, unwrap
from densetrain.parallel.context import chunk_index, shard_rows
from densetrain.parallel.dist import sum_over_group
from densetrain.parallel.loss_parallel import loss_parallel_context, loss_parallel_mesh, vocab_parallel_head
from densetrain.parallel.pipeline import PipelineModel, join_inputs
from densetrain.schedule import Stage
from densetrain.storage import ObjectChanged, StoreUnavailable


@dataclass
class StepStats:
    """Sums over one optimizer step (this rank's part until reduced): loss in nats, tokens counted."""

    loss_sum: float = 0.0
    z_loss_sum: float = 0.0
    n_tokens: int = 0
    per_source: dict[str, list[float]] = field(default_factory=dict)  # name -> [loss_sum, n_tokens]
    nonfinite_ranks: int = 0  # ranks whose local loss or gradient norm was not finite (after reduction)
    forward_s: float = 0.0  # this rank's seconds in forward passes (no collectives there under DDP/FSDP
    backward_s: float = 0.0  # prefetch aside); backward includes DDP's gradient all-reduce


@dataclass
class StepResult:
    """What one step computed, reduced over ranks (identical on every rank), before any verdict.

    Attributes:
        index: the step's index (0-based iteration; the step counter before it).
        loss: nats per target token over the whole global batch. grad_norm: L2 norm of the full
            gradient before clipping. lr: the learning rate the update would use.
        first_sample: global sample index of the batch's first sequence (provenance, resume checks).
        data_s: seconds spent drawing and copying the batch; sync_s: the step's collectives and the wait
            in them (the token-count all-reduce before the forward, clipping and reductions after it).
        rollback_before: set by a watcher that returns ROLLBACK: the step index the trouble began at.
    """

    index: int
    stage: Stage
    lr: float
    loss: float
    grad_norm: float
    stats: StepStats
    first_sample: int
    data_s: float
    sync_s: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    rollback_before: int | None = None

    @property
    def finite(self) -> bool:
        """Loss and gradients finite on every rank (one rank's NaN makes every rank skip)."""
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm) and self.stats.nonfinite_ranks == 0


def make_micro_batches(samples: list[Sample], micro: int, device: torch.device, eos_id: int | None = None,
                       reset_positions: bool = False, cp: tuple[int, int, object] | None = None):
    """Group samples into (inputs (b, T), targets (b, T), sources, model inputs) micro-batches of
    ``micro`` rows on ``device``.

    With ``eos_id`` (a stage with document masking) the model inputs are ``doc_ids`` (b, T) int64,
    the document of every input token from the EOS positions of the window, computed here on the
    host once per batch (:func:`densetrain.model.masks.document_ids`), and with ``reset_positions``
    also ``positions`` (b, T), RoPE positions restarting per document; otherwise they are empty.
    With ``cp = (cp_rank, cp_size, cp_mesh)`` (context parallelism) each row keeps this rank's
    ``T / cp_size`` tokens and the model inputs are ``positions`` and ``attend``
    (:func:`densetrain.parallel.context.shard_rows`).
    """
    out = []
    for i in range(0, len(samples), micro):
        chunk = samples[i : i + micro]
        rows = np.stack([s.tokens for s in chunk])
        if cp is not None:
            doc, pos = document_ids(rows[:, :-1], eos_id) if eos_id is not None else (None, None)
            x, y, inputs = shard_rows(rows, cp[0], cp[1], cp[2], device, doc, pos if reset_positions else None)
            out.append((x, y, [s.source for s in chunk], inputs))
            continue
        t = torch.from_numpy(rows).to(device, non_blocking=True)
        inputs = {}
        if eos_id is not None:
            doc, pos = document_ids(rows[:, :-1], eos_id)
            inputs["doc_ids"] = torch.from_numpy(doc).to(device, non_blocking=True)
            if reset_positions:
                inputs["positions"] = torch.from_numpy(pos).to(device, non_blocking=True)
        out.append((t[:, :-1], t[:, 1:], [s.source for s in chunk], inputs))
    return out


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Make glibc's malloc serve every allocation from its heap and keep freed memory there for reuse
    (``mallopt(M_MMAP_MAX, 0)``, ``mallopt(M_TRIM_THRESHOLD, 2**31 - 1)``); True if set, False where the C
    library is not glibc (nothing changed).

    By default glibc maps each block over its mmap threshold (at most 32 MiB) freshly and unmaps it when
    freed, so every new large tensor is zero-filled page by page by the kernel on first touch: at the 13.8M
    benchmark shape a bf16 step took 34k minor page faults (the (2048, 8192) logits and their gradient,
    the attention scores), ~10% of its CPU time; with the heap reused, ~200. Process-wide and permanent:
    memory freed inside the process is not returned to the OS (resident memory stays at its peak, as
    with PyTorch's CUDA caching allocator).
    """
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


_compiled_losses = None  # torch.compile(token_losses), built on first use; False after a failed compile


def training_token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """:func:`densetrain.loss.token_losses` (same values, (B, T) fp32 nats), compiled for bf16 logits on CPU.

    Eager, the bf16 -> fp32 upcast, log-softmax and its backward are separate passes over the (B, T, vocab)
    logits: ~150 ms CPU per step at B*T = 2048, vocab 8192 (16% of a bf16 step, torch.profiler); the
    compiled kernel fuses them (~28 ms; ~8 s to compile once per shape). fp32 logits (the golden
    trajectory) and CUDA stay eager. If compiling fails (no C++ compiler), eager is used, said once.
    """
    global _compiled_losses
    if logits.dtype != torch.bfloat16 or logits.device.type != "cpu" or _compiled_losses is False:
        return token_losses(logits, targets)
    if _compiled_losses is None:
        pin_inductor_cache()  # before the first compile of the process (model/compiling.py)
        _compiled_losses = torch.compile(token_losses)
    try:
        return _compiled_losses(logits, targets)
    except Exception as e:  # inductor needs a working C++ toolchain
        if int(os.environ.get("RANK", "0")) == 0:  # every rank fails alike: said once, by rank 0
            print(f"compiled cross-entropy unavailable ({type(e).__name__}); eager from now on", flush=True)
        _compiled_losses = False
        return token_losses(logits, targets)


def row_loss_sums(losses: torch.Tensor) -> torch.Tensor:
    """Per-row sums (B,) float64 of per-token losses (B, T) fp32, finite whenever every token's loss is.

    A row of large but finite losses (~1e38 nats per token: a diverging run) overflows an fp32 sum to
    inf, and the step would be skipped as non-finite. Rows whose fp32 sum is finite keep it (so a run's
    logged losses stay bitwise those recorded in tests/golden/trajectory.json); an overflowed row is
    summed again in float64, where only a non-finite token loss gives a non-finite sum. No host sync.
    """
    fp32 = losses.sum(dim=1).double()
    return torch.where(torch.isfinite(fp32), fp32, losses.double().sum(dim=1))


def local_nonfinite(stats: StepStats, grad_norm: float) -> int:
    """1 if this rank's loss sum or the gradient norm is not finite (NaN or inf), else 0; summed over ranks
    into :attr:`StepStats.nonfinite_ranks`, so every rank skips when one rank saw it."""
    return int(not (math.isfinite(grad_norm) and math.isfinite(stats.loss_sum)))


def forward_backward(
    model: torch.nn.Module,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor, list[str]]],
    n_tokens_global: int,
    grad_scale: int = 1,
    z_loss: float = 0.0,
    autocast: contextlib.AbstractContextManager | None = None,
    loss_chunk_tokens: int | None = None,
) -> StepStats:
    """Accumulate gradients of one optimizer step over ``micro_batches``.

    The objective is the sum of all target-token losses of the step, over every micro-batch and every
    rank, divided by ``n_tokens_global`` (the step's total target tokens): each micro-batch's loss sum
    is divided by that global count, not averaged per micro-batch, so a micro-batch with few targets
    weighs no more per token than one with many. Data-parallel gradient reduction averages over the
    ``grad_scale`` data-parallel ranks, so each rank's objective is multiplied by it to turn that mean
    back into the global sum.

    Args:
        micro_batches: list of (inputs (b, T) int64, targets (b, T) int64, source name per row[, dict of
            further model inputs: ``doc_ids``, ``positions``, see :func:`make_micro_batches`]).
        n_tokens_global: number of targets != IGNORE_INDEX in the whole step (all ranks).
        grad_scale: the ranks gradients are averaged over, ``dp_size * cp_size`` (not the tensor-parallel
            degree: TP ranks share a batch).
        z_loss: coefficient of ``log(Z)^2`` per token (PaLM, Chowdhery et al. 2022, sec. 5).
        loss_chunk_tokens: tokens per chunk of the chunked cross-entropy
            (:func:`densetrain.loss.chunked_head_losses`; 0: the whole logits at once); None picks
            :func:`densetrain.loss.chunk_tokens_for` per micro-batch (chunked only where the logits
            exceed ``LOGIT_CHUNK_ELEMENTS``; per rank's vocabulary slice under the vocabulary-parallel
            cross-entropy of tensor parallelism, :mod:`densetrain.parallel.loss_parallel`).
    Returns:
        This rank's :class:`StepStats` (not reduced).
    """
    if isinstance(model, PipelineModel):
        return pipelined_forward_backward(model, micro_batches, n_tokens_global, grad_scale, z_loss, autocast)
    scale = grad_scale / max(n_tokens_global, 1)
    base = unwrap(model)
    lp_mesh = loss_parallel_mesh(base)  # vocabulary-parallel cross-entropy under TP, or None
    vocab = base.cfg.vocab_size // (lp_mesh.size() if lp_mesh is not None else 1)  # logits per token on a rank
    n_micro = len(micro_batches)
    # Per-row sums stay on the device until the end of the step: one host sync per step, not per
    # micro-batch (each .tolist()/float() on a GPU tensor waits for the GPU).
    row_losses, row_tokens, z_sums, row_sources = [], [], [], []
    t_forward = t_backward = 0.0
    for i, (x, y, sources, *more) in enumerate(micro_batches):
        # Gradients reduced after the last micro-batch only; torch's loss_parallel around forward and backward.
        with grad_sync(model, enabled=i == n_micro - 1), loss_parallel_context(lp_mesh):
            t0 = time.perf_counter()
            chunk = loss_chunk_tokens if loss_chunk_tokens is not None else chunk_tokens_for(vocab, y.numel())
            mask = y != IGNORE_INDEX
            head = (vocab_parallel_head(base, lp_mesh, y, chunk) if lp_mesh is not None else
                    functools.partial(chunked_head_losses, targets=y, chunk_tokens=chunk) if chunk else None)
            with autocast or contextlib.nullcontext():
                if head is not None:  # the model's forward returns (losses, log Z), never the whole logits
                    losses, lse = model(x, head=head, **(more[0] if more else {}))
                else:
                    logits = model(x, **(more[0] if more else {}))
            if head is None:
                losses = training_token_losses(logits, y)
            objective = losses.sum()
            if z_loss > 0:
                zl = z_loss_sum_from_lse(lse, mask) if head is not None else z_loss_sum(logits, mask)
                objective = objective + z_loss * zl
                z_sums.append(zl.detach())
            t1 = time.perf_counter()
            (objective * scale).backward()
            t_forward, t_backward = t_forward + t1 - t0, t_backward + time.perf_counter() - t1
        row_losses.append(row_loss_sums(losses.detach()))
        row_tokens.append(mask.sum(dim=1))
        row_sources += sources
    return _row_stats(row_losses, row_tokens, z_sums, row_sources, t_forward, t_backward)


def _row_stats(row_losses: list[torch.Tensor], row_tokens: list[torch.Tensor], z_sums: list[torch.Tensor],
               row_sources: list[str], t_forward: float, t_backward: float) -> StepStats:
    """This rank's :class:`StepStats` from per-row loss sums and target counts (one host sync)."""
    stats = StepStats(forward_s=t_forward, backward_s=t_backward)
    if not row_losses:  # a pipeline stage before the last: no loss here
        return stats
    if z_sums:
        stats.z_loss_sum = float(torch.stack(z_sums).sum())
    for src, lsum, ntok in zip(row_sources, torch.cat(row_losses).tolist(), torch.cat(row_tokens).tolist()):
        acc = stats.per_source.setdefault(src, [0.0, 0])
        acc[0] += lsum
        acc[1] += ntok
        stats.loss_sum += lsum
        stats.n_tokens += ntok
    return stats


def pipelined_forward_backward(pipe: PipelineModel, micro_batches: list, n_tokens_global: int, grad_scale: int = 1,
                               z_loss: float = 0.0,
                               autocast: contextlib.AbstractContextManager | None = None) -> StepStats:
    """:func:`forward_backward` through pipeline stages: the same objective (every target token's loss over
    the step's global token count, times ``grad_scale``), the loss computed by the schedule on the last
    stage per micro-batch. The micro-batches run as schedule calls of ``pipe.microbatches(len(micro_batches))``
    each (:mod:`densetrain.parallel.pipeline`); gradients accumulate over the calls.

    Returns:
        This rank's :class:`StepStats`: the losses on the last stage's ranks, zeros before it; the
        pipeline time is counted as forward time (forwards and backwards interleave in the schedule).
    """
    scale = grad_scale / max(n_tokens_global, 1)
    row_losses, row_tokens, z_sums, row_sources = [], [], [], []

    def loss_fn(logits: torch.Tensor, y: torch.Tensor, record: bool = True) -> torch.Tensor:
        # logits (b, T, vocab), y (b, T) -> this micro-batch's share of the step's objective
        losses, mask = training_token_losses(logits, y), y != IGNORE_INDEX
        objective = losses.sum()
        if z_loss > 0:
            zl = z_loss_sum(logits, mask)
            objective = objective + z_loss * zl
        if record:
            z_sums.extend([zl.detach()] if z_loss > 0 else [])
            row_losses.append(row_loss_sums(losses.detach()))
            row_tokens.append(mask.sum(dim=1))
        return objective * scale

    m = pipe.microbatches(len(micro_batches))
    t0 = time.perf_counter()
    for g in range(0, len(micro_batches), m):
        group = micro_batches[g : g + m]
        x, y = torch.cat([mb[0] for mb in group]), torch.cat([mb[1] for mb in group])
        # Per-row inputs (doc_ids, positions, context parallelism's document ids) are split again by the schedule.
        kwargs = join_inputs([mb[3] if len(mb) > 3 else {} for mb in group])
        with autocast or contextlib.nullcontext():
            pipe.step(x, y, m, loss_fn, **kwargs)
        if pipe.is_last:
            row_sources += [src for mb in group for src in mb[2]]
    return _row_stats(row_losses, row_tokens, z_sums, row_sources, time.perf_counter() - t0, 0.0)


def reduce_stats(stats: StepStats, sources: list[str], device: torch.device, stage_group=None) -> StepStats:
    """Sum :class:`StepStats` over ranks (identity in a single process); the phase times stay local.
    ``stage_group``: the pipeline group, over which the last stage's sums are first handed to every stage."""
    vec = [stats.loss_sum, stats.z_loss_sum, float(stats.n_tokens), float(stats.nonfinite_ranks)]
    for s in sources:
        vec += stats.per_source.get(s, [0.0, 0])
    t = torch.tensor(vec, dtype=torch.float64, device=device)
    if stage_group is not None:  # nonfinite_ranks summed over stages too: then over data-parallel ranks
        sum_over_group(t, stage_group)
    t = all_reduce_sum(t).tolist()
    per = {s: [t[4 + 2 * i], int(t[5 + 2 * i])] for i, s in enumerate(sources) if t[5 + 2 * i] > 0}
    return StepStats(t[0], t[1], int(t[2]), per, int(t[3]), stats.forward_s, stats.backward_s)


def draw_samples(sampler: MixtureSampler, stage: Stage, keep: range | None = None) -> list[Sample]:
    """The next global batch of ``stage`` (its mix, seq_len and shuffle order); only the rows in
    ``keep`` are read (``range(0)``: advance past the batch without reading it). The one way a batch
    is drawn: training, skipping data and ``densetrain blame`` must agree."""
    return sampler.next_samples(stage.batch_size, stage.name, stage.mix, stage.seq_len, keep,
                                shuffle_seed=stage.shuffle_seed)


class ReadOutage(StoreUnavailable):
    """A rank could not read its share of the batch: the object store holding the shards did not answer within the
    retry budget (:class:`densetrain.storage.StoreUnavailable`). Raised on every rank alike by :func:`fetch_batch`,
    before the step's first collective, the sampler left where it was; the loop stops the run there (exit 75),
    other callers (``replay``) say it as the store's one line. The message is one line: the failing rank and its
    error."""


def fetch_batch(run, stage: Stage, keep: range) -> list[Sample]:
    """:func:`draw_samples` for a training step, agreed on by every rank when some shard is read from object
    storage: one MAX all-reduce of "my read failed" (rank + 1), so that a rank whose read met an outage stops
    every rank at this step boundary instead of leaving the others waiting in the step's collectives (gloo's
    timeout, ``parallel.timeout_s``, must exceed the store's retry budget). On local files (memory-mapped; a
    failure there is a bad file, not an outage) nothing is added to the step.

    Raises:
        ReadOutage: some rank's read failed with StoreUnavailable; the sampler state is restored on every rank
            (ranks whose read succeeded drew the batch too), so the checkpoint of this step and the resumed run
            draw this batch again: nothing half-read is trained on.
    """
    sampler = run.sampler
    if not any(getattr(s, "prefetches", False) for s in sampler.streams.values()):
        return draw_samples(sampler, stage, keep)
    before, error, world = copy.deepcopy(sampler.state), None, run.info.world_size
    try:
        samples = draw_samples(sampler, stage, keep)
    except (StoreUnavailable, ObjectChanged) as e:
        samples, error = [], e
    # rank + 1 for an outage, world + rank + 1 for a shard changed in the store (which wins: it is no outage)
    mine = (run.info.rank + 1 + (world if isinstance(error, ObjectChanged) else 0)) if error else 0
    failed = int(all_reduce_max(torch.tensor([mine], device=run.info.device)).item())
    if failed:
        sampler.state = before
        sampler.events.clear()
        if failed > world:
            raise error if isinstance(error, ObjectChanged) else ObjectChanged(
                f"rank {failed - world - 1}: a shard changed in the object store during the run (its own line says "
                f"which); nothing of it was trained on")
        raise ReadOutage(f"rank {run.info.rank}: {error}" if error else
                         f"rank {failed - 1} could not read its part of the batch of step {run.state.step + 1}")
    return samples


def batch_rows(info, batch_size: int) -> range:
    """The rows of a global batch of ``batch_size`` sequences that this rank reads (``info``: its
    :class:`densetrain.parallel.DistInfo`): data-parallel rank ``r`` of ``n`` takes ``[r * b/n, (r + 1) * b/n)``;
    the tensor-, context- and pipeline-parallel ranks of one data-parallel rank take the same rows (context
    parallelism then keeps its own tokens of them)."""
    per_rank = batch_size // info.dp_size
    return range(info.dp_rank * per_rank, (info.dp_rank + 1) * per_rank)


def compute_step(run, stage: Stage, lr: float) -> StepResult:
    """Draw this rank's share of the stage's global batch and compute loss, gradients and the global
    grad norm (gradients clipped to ``optim.grad_clip``); the optimizer is not stepped.

    ``run`` is the :class:`densetrain.train.setup.Run`. The global batch is ``stage.batch_size``
    sequences; data-parallel rank ``r`` of ``n`` takes rows ``[r * b/n, (r + 1) * b/n)`` of it, so the
    global sample sequence is the same for any world size.
    """
    t0 = time.perf_counter()
    info, sampler = run.info, run.sampler
    keep = batch_rows(info, stage.batch_size)
    first_sample = sampler.state["samples_seen"]
    samples = fetch_batch(run, stage, keep)  # ReadOutage: every rank stops here, before the collectives
    for ev in sampler.events:
        run.log.event(run.state.step, ev, kind="epoch")
    sampler.events.clear()
    for w in run.watchers:  # fault injection may alter the batch (the data probe reads it in after_step)
        samples = w.on_batch(run, samples)
    eos_id = run.tokenizer.eos_id if stage.document_mask else None
    cp = (info.cp_rank, info.cp_size, info.cp_mesh) if info.cp_size > 1 else None
    micro_batches = make_micro_batches(samples, stage.micro_batch_size, info.device, eos_id, stage.reset_positions,
                                       cp)
    # Counted on the host copy: counting on the device would wait for the GPU once per micro-batch. Under
    # context parallelism each rank counts its own tokens (the sum over ranks counts each target once).
    mine = chunk_index(stage.seq_len, info.cp_rank, info.cp_size) if cp else slice(None)
    n_local = sum(int((smp.tokens[1:][mine] != IGNORE_INDEX).sum()) for smp in samples)
    t1 = time.perf_counter()
    data_s = t1 - t0  # not the all-reduce below: its wait for a slower rank is 'sync', not this rank's data
    n_global = int(all_reduce_sum(torch.tensor([n_local], device=info.device)).item())
    count_s = time.perf_counter() - t1

    cfg = run.cfg
    stats = forward_backward(run.dp_model, micro_batches, n_global, info.grad_scale, cfg.optim.z_loss, run.autocast)
    for note in getattr(run.dp_model, "decisions", ()):  # a pipeline's micro-batch count for a new batch shape
        run.log.event(run.state.step, note, kind="pipeline")
    if hasattr(run.dp_model, "decisions"):
        run.dp_model.decisions.clear()
    t0 = time.perf_counter()
    for w in run.watchers:  # fault injection (a NaN gradient on one rank, a loss spike)
        w.on_grads(run, stats)
    grad_norm = float(clip_grad_norm(run.model, cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf"),
                                     extra_group=info.pp_group))
    stats.nonfinite_ranks = local_nonfinite(stats, grad_norm)
    stats = reduce_stats(stats, run.source_names, info.device, info.pp_group)
    loss = stats.loss_sum / max(stats.n_tokens, 1)
    return StepResult(run.state.step, stage, lr, loss, grad_norm, stats, first_sample, data_s,
                      count_s + time.perf_counter() - t0, samples)
