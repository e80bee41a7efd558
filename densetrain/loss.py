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
    return (torch.logsumexp(logits.float(), dim=-1) ** 2 * mask).sum()
