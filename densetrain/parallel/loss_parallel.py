"""Vocabulary-parallel (loss-parallel) cross-entropy under tensor parallelism: each tensor-parallel rank
computes the logits of its slice of the vocabulary and no rank gathers them.

The output head is column-wise over the vocabulary (:func:`densetrain.parallel.parallelize.apply_tensor_parallel`),
so its weight is a ``Shard(0)`` DTensor on the tp mesh. For the training step the head's matmul is done here,
not through the module's hooks (which gather the logits for evaluation): ``h`` as a ``Replicate``
DTensor times the weight gives ``Shard(-1)`` logits, to which the model's own
:meth:`~densetrain.model.llama.Transformer.project` applies the μP multiplier and the soft-cap (elementwise,
per slice), and inside torch's
``torch.distributed.tensor.parallel.loss_parallel`` context ``F.cross_entropy`` on them reduces the
log-sum-exp and the target logit over the tp ranks (Megatron-LM's vocab-parallel cross-entropy,
Shoeybi et al. 2019, as torch implements it). ``log Z`` for the z-loss is reduced the same way: a
max and a sum of exponentials over the vocabulary slices. Chunking (:func:`densetrain.loss.chunk_tokens_for`
of the per-rank vocabulary) bounds the per-rank ``(chunk, vocab / tp)`` block as without TP.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from densetrain.loss import IGNORE_INDEX


def loss_parallel_mesh(model) -> object | None:
    """The tp mesh the step's cross-entropy is vocabulary-parallel over (set on the model by
    :func:`~densetrain.parallel.parallelize.apply_tensor_parallel` with ``loss_parallel``), or None."""
    return getattr(model, "loss_parallel_mesh", None)


def loss_parallel_context(mesh) -> contextlib.AbstractContextManager:
    """torch's ``loss_parallel()`` when ``mesh`` is set (forward and backward must both run in it)."""
    if mesh is None:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def _vocab_parallel_chunk(project, weight, mesh, h: torch.Tensor,
                          targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Losses and ``log Z`` (n,) fp32 of ``h`` (n, d_model) with the logits split over the vocabulary.

    The logits are the model's own (``project``, :meth:`densetrain.model.llama.Transformer.project`:
    μP multiplier and soft-cap), with only the matmul done here, so that they stay ``Shard(-1)``."""
    from torch.distributed.tensor import DTensor, Replicate

    hd = DTensor.from_local(h, mesh, [Replicate()], run_check=False)
    logits = project(hd, matmul=lambda x: x @ weight.T)  # (n, V) as Shard(-1): (n, V / tp) on each rank
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    losses = F.cross_entropy(logits, targets, reduction="none", ignore_index=IGNORE_INDEX)  # (n,) Replicate
    # log Z = m + log sum exp(logits - m), m the row maximum (a constant for the gradient: log Z does not
    # depend on it), each reduced over the vocabulary slices.
    m = logits.detach().amax(-1, keepdim=True).redistribute(mesh, [Replicate()])
    lse = torch.log(torch.exp(logits - m).sum(-1).redistribute(mesh, [Replicate()])) + m.squeeze(-1)
    return losses.to_local(), lse.to_local()


def vocab_parallel_head(model, mesh, targets: torch.Tensor, chunk_tokens: int):
    """A ``head(project, h)`` for :meth:`densetrain.model.llama.Transformer.forward` that returns
    ``(losses, lse)``, each (B, T) fp32, computed vocabulary-parallel over ``mesh``, in chunks of
    ``chunk_tokens`` tokens (0: all at once) each under ``torch.utils.checkpoint``. The logits are
    ``project``'s (the model's one definition) with its matmul replaced by ``h @ model.output.weight^T`` on
    the ``Shard(0)`` weight, which leaves them split over the vocabulary (the module call would gather
    them). Call the forward and the backward inside :func:`loss_parallel_context`."""
    from torch.utils.checkpoint import checkpoint

    def head(project, h):
        B, T, D = h.shape
        flat_h, flat_y = h.reshape(B * T, D), targets.reshape(B * T)
        step = chunk_tokens or B * T
        losses, lses = [], []
        for s in range(0, B * T, step):
            args = (project, model.output.weight, mesh, flat_h[s : s + step], flat_y[s : s + step])
            loss, lse = (checkpoint(_vocab_parallel_chunk, *args, use_reentrant=False) if chunk_tokens
                         else _vocab_parallel_chunk(*args))
            losses.append(loss)
            lses.append(lse)
        return torch.cat(losses).reshape(B, T), torch.cat(lses).reshape(B, T)

    return head
