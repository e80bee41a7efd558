"""The training objective: per-token cross-entropy, and the step's normalisation convention.

A step's loss is the sum of all target-token losses over every micro-batch and every rank divided by
the step's total target tokens (not a mean of micro-batch means); see ``forward_backward`` in
:mod:`densetrain.train.step`. Validation loss uses the same per-token losses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""Target id that takes no loss (PyTorch's ``cross_entropy`` default)."""


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy in nats, computed in at least fp32 (bf16 logits are upcast).

    Args:
        logits: (B, T, V). targets: (B, T) int64, ``IGNORE_INDEX`` where no loss is taken.
    Returns:
        (B, T) losses, 0 at ignored positions.
    """
    B, T, V = logits.shape
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.reshape(B * T, V), targets.reshape(B * T), ignore_index=IGNORE_INDEX,
                           reduction="none").reshape(B, T)


def z_loss_sum(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over unmasked positions of ``log(Z)^2`` (PaLM, Chowdhery et al. 2022, sec. 5).

    Args:
        logits: (B, T, V). mask: (B, T) bool, True where a target is counted.
    Returns:
        0-d fp32 tensor.
    """
    return z_loss_sum_from_lse(torch.logsumexp(logits.float(), dim=-1), mask)


LOGIT_CHUNK_ELEMENTS = 2**26
"""Most logits one chunk of :func:`chunked_head_losses` holds: ``chunk_tokens * vocab_size <= 2**26``
(256 MiB in fp32; 523 tokens at Llama 3's vocabulary of 128256). A micro-batch with at most this many
logits takes the plain path (the golden trajectory's: the whole ``(B, T, V)`` logits at once)."""


def chunk_tokens_for(vocab_size: int, n_tokens: int, max_elements: int = LOGIT_CHUNK_ELEMENTS) -> int:
    """Tokens per chunk of the chunked cross-entropy for a micro-batch of ``n_tokens`` tokens, or 0 when
    the whole ``(n_tokens, vocab_size)`` logits fit in ``max_elements`` (no chunking: nothing to save)."""
    if n_tokens * vocab_size <= max_elements:
        return 0
    return max(1, max_elements // vocab_size)


def _chunk_losses(project, h: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy and ``log Z`` of one chunk: h (n, d_model) -> (losses (n,), lse (n,)), fp32.

    ``loss = log Z - z_target`` with ``log Z = logsumexp(logits)``: the value of ``F.cross_entropy``
    (equal within fp32 rounding, not bitwise), with ``log Z`` shared by the z-loss."""
    logits = project(h)  # (n, V)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lse = torch.logsumexp(logits, dim=-1)  # (n,)
    keep = targets != IGNORE_INDEX
    picked = logits.gather(-1, torch.where(keep, targets, 0).unsqueeze(-1)).squeeze(-1)  # (n,)
    return torch.where(keep, lse - picked, 0.0), lse


def chunked_head_losses(project, h: torch.Tensor, targets: torch.Tensor,
                        chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy and ``log Z`` of ``logits = project(h)`` without ever holding the
    logits of more than ``chunk_tokens`` tokens.

    Each chunk's projection and loss run under ``torch.utils.checkpoint`` (non-reentrant): its forward
    keeps only the chunk's input, and its backward recomputes the chunk's logits, so forward and backward
    both hold one ``(chunk_tokens, V)`` block at a time (Wijmans et al. 2024, "Cut Your Losses in
    Large-Vocabulary Language Models", make the same observation; this is the plain recompute form). The
    cost is one more output projection per step (the recompute).

    Args:
        project: ``h (n, d_model) -> logits (n, V)`` (the model's logits, :meth:`Transformer.project`; a
            module call, so tensor-parallel hooks run per chunk).
        h: (B, T, d_model), the final norm's output. targets: (B, T) int64, ``IGNORE_INDEX`` where no loss.
        chunk_tokens: tokens per chunk (>= 1), e.g. from :func:`chunk_tokens_for`.
    Returns:
        ``(losses, lse)``, each (B, T) fp32: nats per token (0 where ignored), ``log Z`` per token
        (for :func:`z_loss_sum_from_lse`).
    """
    from torch.utils.checkpoint import checkpoint

    B, T, D = h.shape
    flat_h, flat_y = h.reshape(B * T, D), targets.reshape(B * T)
    losses, lses = [], []
    for s in range(0, B * T, chunk_tokens):
        loss, lse = checkpoint(_chunk_losses, project, flat_h[s : s + chunk_tokens], flat_y[s : s + chunk_tokens],
                               use_reentrant=False)
        losses.append(loss)
        lses.append(lse)
    return torch.cat(losses).reshape(B, T), torch.cat(lses).reshape(B, T)


def z_loss_sum_from_lse(lse: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """:func:`z_loss_sum` from ``log Z`` (B, T) already computed (the chunked path): 0-d fp32.

    Masked by selection, not by multiplication: an infinite ``log Z`` at an ignored position (``inf * 0``
    is NaN) must not reach the sum."""
    return torch.where(mask, lse.float() ** 2, 0.0).sum()
