"""One optimizer step's computation: draw the global batch, forward/backward over micro-batches,
reduce the numbers over ranks, the global grad norm (and clipping). Nothing is applied here: the
loop's decision point (:mod:`densetrain.train.watchers`) decides whether the update is.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from densetrain.data.mixture import Sample
from densetrain.loss import IGNORE_INDEX, token_losses, z_loss_sum
from densetrain.parallel import all_reduce_sum, clip_grad_norm, grad_sync
from densetrain.schedule import Stage


@dataclass
class StepStats:
    """Sums over one optimizer step (this rank's part until reduced): loss in nats, tokens counted."""

    loss_sum: float = 0.0
    z_loss_sum: float = 0.0
    n_tokens: int = 0
    per_source: dict[str, list[float]] = field(default_factory=dict)  # name -> [loss_sum, n_tokens]


@dataclass
class StepResult:
    """What one step computed, reduced over ranks (identical on every rank), before any verdict.

    Attributes:
        index: the update's index (0-based; the step counter before it).
        loss: nats per target token over the whole global batch. grad_norm: L2 norm of the full
            gradient before clipping. lr: the learning rate the update would use.
        first_sample: global sample index of the batch's first sequence (provenance, resume checks).
        data_s: seconds spent drawing and copying the batch.
    """

    index: int
    stage: Stage
    lr: float
    loss: float
    grad_norm: float
    stats: StepStats
    first_sample: int
    data_s: float

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


def make_micro_batches(samples: list[Sample], micro: int, device: torch.device):
    """Group samples into (inputs (b, T), targets (b, T), sources) micro-batches of ``micro`` rows on ``device``."""
    out = []
    for i in range(0, len(samples), micro):
        chunk = samples[i : i + micro]
        t = torch.from_numpy(np.stack([s.tokens for s in chunk])).to(device, non_blocking=True)
        out.append((t[:, :-1], t[:, 1:], [s.source for s in chunk]))
    return out


def forward_backward(
    model: torch.nn.Module,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor, list[str]]],
    n_tokens_global: int,
    grad_scale: int = 1,
    z_loss: float = 0.0,
    autocast: contextlib.AbstractContextManager | None = None,
) -> StepStats:
    """Accumulate gradients of one optimizer step over ``micro_batches``.

    The objective is the sum of all target-token losses of the step, over every micro-batch and every
    rank, divided by ``n_tokens_global`` (the step's total target tokens): each micro-batch's loss sum
    is divided by that global count, not averaged per micro-batch, so a micro-batch with few targets
    weighs no more per token than one with many. Data-parallel gradient reduction averages over the
    ``grad_scale`` data-parallel ranks, so each rank's objective is multiplied by it to turn that mean
    back into the global sum.

    Args:
        micro_batches: list of (inputs (b, T) int64, targets (b, T) int64, source name per row).
        n_tokens_global: number of targets != IGNORE_INDEX in the whole step (all ranks).
        grad_scale: the data-parallel degree (not the tensor-parallel one: TP ranks share a batch).
        z_loss: coefficient of ``log(Z)^2`` per token (PaLM, Chowdhery et al. 2022, sec. 5).
    Returns:
        This rank's :class:`StepStats` (not reduced).
    """
    scale = grad_scale / max(n_tokens_global, 1)
    n_micro = len(micro_batches)
    # Per-row sums stay on the device until the end of the step: one host sync per step, not per
    # micro-batch (each .tolist()/float() on a GPU tensor waits for the GPU).
    row_losses, row_tokens, z_sums, row_sources = [], [], [], []
    for i, (x, y, sources) in enumerate(micro_batches):
        with grad_sync(model, enabled=i == n_micro - 1):  # reduce gradients after the last micro-batch only
            with autocast or contextlib.nullcontext():
                logits = model(x)
            losses = token_losses(logits, y)
            mask = y != IGNORE_INDEX
            objective = losses.sum()
            if z_loss > 0:
                zl = z_loss_sum(logits, mask)
                objective = objective + z_loss * zl
                z_sums.append(zl.detach())
            (objective * scale).backward()
        row_losses.append(losses.detach().sum(dim=1).double())
        row_tokens.append(mask.sum(dim=1))
        row_sources += sources
    stats = StepStats()
    if z_sums:
        stats.z_loss_sum = float(torch.stack(z_sums).sum())
    for src, lsum, ntok in zip(row_sources, torch.cat(row_losses).tolist(), torch.cat(row_tokens).tolist()):
        acc = stats.per_source.setdefault(src, [0.0, 0])
        acc[0] += lsum
        acc[1] += ntok
        stats.loss_sum += lsum
        stats.n_tokens += ntok
    return stats


def reduce_stats(stats: StepStats, sources: list[str], device: torch.device) -> StepStats:
    """Sum :class:`StepStats` over ranks (identity in a single process)."""
    vec = [stats.loss_sum, stats.z_loss_sum, float(stats.n_tokens)]
    for s in sources:
        vec += stats.per_source.get(s, [0.0, 0])
    t = all_reduce_sum(torch.tensor(vec, dtype=torch.float64, device=device)).tolist()
    per = {s: [t[3 + 2 * i], int(t[4 + 2 * i])] for i, s in enumerate(sources) if t[4 + 2 * i] > 0}
    return StepStats(t[0], t[1], int(t[2]), per)


def compute_step(run, stage: Stage, lr: float) -> StepResult:
    """Draw this rank's share of the stage's global batch and compute loss, gradients and the global
    grad norm (gradients clipped to ``optim.grad_clip``); the optimizer is not stepped.

    ``run`` is the :class:`densetrain.train.setup.Run`. The global batch is ``stage.batch_size``
    sequences; data-parallel rank ``r`` of ``n`` takes rows ``[r * b/n, (r + 1) * b/n)`` of it, so the
    global sample sequence is the same for any world size.
    """
    t0 = time.perf_counter()
    info, sampler = run.info, run.sampler
    per_rank = stage.batch_size // info.dp_size
    keep = range(info.dp_rank * per_rank, (info.dp_rank + 1) * per_rank)
    first_sample = sampler.state["samples_seen"]
    samples = sampler.next_samples(stage.batch_size, stage.name, stage.mix, stage.seq_len, keep)
    for ev in sampler.events:
        run.log.event(run.state.step, ev)
    sampler.events.clear()
    micro_batches = make_micro_batches(samples, stage.micro_batch_size, info.device)
    # Counted on the host copy: counting on the device would wait for the GPU once per micro-batch.
    n_local = sum(int((smp.tokens[1:] != IGNORE_INDEX).sum()) for smp in samples)
    n_global = int(all_reduce_sum(torch.tensor([n_local], device=info.device)).item())
    data_s = time.perf_counter() - t0

    cfg = run.cfg
    stats = forward_backward(run.dp_model, micro_batches, n_global, info.dp_size, cfg.optim.z_loss, run.autocast)
    grad_norm = float(clip_grad_norm(run.model, cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")))
    stats = reduce_stats(stats, run.source_names, info.device)
    loss = stats.loss_sum / max(stats.n_tokens, 1)
    return StepResult(run.state.step, stage, lr, loss, grad_norm, stats, first_sample, data_s)
