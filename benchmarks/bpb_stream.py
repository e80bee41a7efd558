"""Bits per byte of a language model on a token stream: the one definition both sides of
``benchmarks/speedrun.py --nanochat`` are scored with (this module needs only torch, so nanochat's own
interpreter imports it too).

The stream is ``[start] + doc_1 + [sep] + doc_2 + ...`` in the model's own tokenizer, where ``start`` is a
token of no text (nanochat: BOS before every document; densetrain: EOS after every document and once in
front). Every token after the first is a target exactly once: windows of ``window + 1`` tokens step by
``window``, so each window's first token is only context. Then::

    bpb = (sum of target losses in nats / ln 2) / UTF-8 bytes of the documents

(Gao et al. 2020, "The Pile", bits per byte), whatever the tokenizer: the denominator is the same text for
both models. Losses are computed in fp32.
"""

from __future__ import annotations

import math
from typing import Callable

import torch


def stream_nats(loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], ids: list[int], window: int,
                batch: int = 8) -> tuple[float, int]:
    """Sum of target losses (nats) over ``ids`` and the number of targets.

    ``loss_sum(x, y)``: x, y (B, T) int64 -> scalar sum of the B*T token losses (nats). Full windows go in
    batches of ``batch``; the last, shorter window alone.
    """
    t = torch.tensor(ids, dtype=torch.long)
    n_full = (len(ids) - 1) // window
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, n_full, batch):
            starts = range(i * window, min(n_full, i + batch) * window, window)
            x = torch.stack([t[s:s + window] for s in starts])
            y = torch.stack([t[s + 1:s + window + 1] for s in starts])
            total += float(loss_sum(x, y))
            count += y.numel()
        rest = len(ids) - 1 - n_full * window
        if rest:
            s = n_full * window
            total += float(loss_sum(t[None, s:s + rest], t[None, s + 1:s + rest + 1]))
            count += rest
    return total, count


def bpb(nats: float, nbytes: int) -> float:
    """Bits per byte from a loss sum in nats over text of ``nbytes`` UTF-8 bytes."""
    return nats / math.log(2) / nbytes
