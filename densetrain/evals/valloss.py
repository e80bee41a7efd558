"""Token-weighted validation loss per source on the held-out split.

The held-out stream of each source is cut into consecutive windows of ``seq_len + 1`` tokens
(overlapping by one, like training), always starting at offset 0, so every evaluation of a run
scores the same tokens and curves are comparable across steps. The loss of a source is the sum of
its token losses divided by its token count (not a mean of per-batch means). Windows are split
over ranks and sums reduced, so the value does not depend on the number of processes.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from densetrain.data.shards import TokenFiles
from densetrain.parallel import all_reduce_sum


@torch.no_grad()
def evaluate_val(
    model: torch.nn.Module,
    streams: dict[str, TokenFiles],
    seq_len: int,
    micro_batch_size: int,
    max_batches: int,
    device: torch.device,
    autocast: contextlib.AbstractContextManager | None = None,
) -> dict[str, float]:
    """Validation loss of every source: ``{source: {'loss': nats per token, 'tokens': scored tokens}}``.

    Uses at most ``max_batches * micro_batch_size`` windows per source (fewer when the held-out
    stream is shorter; a stream shorter than one window is scored as one shorter window).
    """
    import torch.distributed as dist

    from densetrain.train import token_losses

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    was_training = model.training
    model.eval()
    out = {}
    for name in sorted(streams):
        stream = streams[name]
        win = min(seq_len, len(stream) - 1)
        n_windows = min(max_batches * micro_batch_size, (len(stream) - 1) // win)
        mine = list(range(rank, n_windows, world))
        loss_sum = torch.zeros(2, dtype=torch.float64, device=device)
        for i in range(0, len(mine), micro_batch_size):
            rows = [stream.read(k * win, win + 1) for k in mine[i : i + micro_batch_size]]
            t = torch.from_numpy(np.stack(rows)).to(device)
            with autocast or contextlib.nullcontext():
                logits = model(t[:, :-1])
            losses = token_losses(logits, t[:, 1:])
            loss_sum[0] += losses.sum().double()
            loss_sum[1] += losses.numel()
        all_reduce_sum(loss_sum)
        n = int(loss_sum[1])
        out[name] = {"loss": float(loss_sum[0] / n) if n else float("nan"), "tokens": n}
    model.train(was_training)
    return out


def unigram_entropy(streams: list[TokenFiles]) -> float:
    """Entropy (nats per token) of the empirical unigram distribution of the tokens of ``streams``.

    This is the loss of the best model that ignores context entirely, measured on the very text it
    is scored on, so it is a strict baseline: a trained LM's validation loss should be well below it.
    """
    arrays = [s.read(0, len(s)) for s in streams]
    size = max((int(a.max()) + 1 for a in arrays if a.size), default=1)
    counts = sum(np.bincount(a, minlength=size) for a in arrays)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def val_table(val: dict[str, dict], streams: dict[str, TokenFiles]) -> dict[str, dict]:
    """Add the unigram-entropy baseline to :func:`evaluate_val`'s result, plus an ``'all'`` row:
    the token-weighted loss over every source against the entropy of all held-out text together."""
    table = {s: {**v, "unigram_entropy": unigram_entropy([streams[s]])} for s, v in val.items()}
    n = sum(v["tokens"] for v in val.values())
    table["all"] = {
        "loss": sum(v["loss"] * v["tokens"] for v in val.values()) / n if n else float("nan"),
        "tokens": n,
        "unigram_entropy": unigram_entropy([streams[s] for s in val]),
    }
    return table
