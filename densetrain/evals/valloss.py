"""Token-weighted validation loss and bits per byte per source on the held-out split.

The held-out stream of each source is cut into consecutive windows of ``seq_len + 1`` tokens
(overlapping by one, like training), always starting at offset 0, so every evaluation of a run
scores the same tokens and curves are comparable across steps. The loss of a source is the sum of
its token losses divided by its token count (not a mean of per-batch means). Windows are dealt to
the data-parallel ranks by :func:`densetrain.parallel.even_split` (a rank one window short scores
window 0 in its place and drops its losses, so every rank runs the same forward calls, as sharded
parameters need) and the sums are added over ranks, so the value does not depend on the number of
processes.

Bits per byte (bpb) make losses comparable across tokenizers: the same total negative
log-likelihood, in bits, divided by the UTF-8 bytes of the text that was scored instead of by the
token count (Gao et al. 2020, "The Pile: An 800GB Dataset of Diverse Text"; OLMo's ``bpb``)::

    bpb = (sum of token losses in nats / ln 2) / bytes = loss * tokens / (ln 2 * bytes)

The scored tokens of the windows are one contiguous span of the stream (window ``k`` predicts
tokens ``k * win + 1 .. (k + 1) * win``), so ``bytes`` is the length of that span's text, decoded
with the run's tokenizer, one document at a time (documents end with EOS, which is no text and
counts 0 bytes; the EOS predictions still count in the loss, as they do in ``loss``). Only a
character split by the span's two ends (a byte-level token that is part of a UTF-8 sequence) can
be miscounted, by at most a few bytes. The count is computed once per source and span, then cached.
"""

from __future__ import annotations

import contextlib
import math
from functools import partial

import numpy as np
import torch

from densetrain.data.shards import TokenFiles
from densetrain.evals.scoring import eval_mode
from densetrain.evals.stop import StopCheck, read_then_stop_point
from densetrain.loss import token_losses
from densetrain.model.masks import document_ids
from densetrain.parallel import all_reduce_sum, dp_rank_size, even_split

_LN2 = math.log(2.0)
_BYTES_CACHE: dict[tuple, int] = {}


def text_bytes(tokenizer, ids: np.ndarray) -> int:
    """UTF-8 bytes of the text that token ``ids`` encode, EOS and BOS tokens counting 0.

    Decoded one document (the tokens between EOS tokens) at a time, so that no decode call
    splits a character that the tokens encode whole.

    Args:
        tokenizer: a :class:`densetrain.data.tokenizer.Tokenizer` (``decode``, ``eos_id``).
        ids: (N,) integer token ids.
    """
    ids = np.asarray(ids)
    bos = getattr(tokenizer, "bos_id", None)
    if bos is not None:  # each document starts with BOS (Llama 3): markup, not text
        ids = ids[ids != bos]
    ends = [*np.flatnonzero(ids == tokenizer.eos_id).tolist(), len(ids)]
    total, start = 0, 0
    for end in ends:
        if end > start:
            total += len(tokenizer.decode(ids[start:end]).encode("utf-8"))
        start = end + 1
    return total


def scored_span(stream: TokenFiles, seq_len: int, micro_batch_size: int, max_batches: int) -> tuple[int, int, int]:
    """(window length ``win``, number of windows, end of the scored span) of :func:`evaluate_val` on
    ``stream``: tokens ``[1, end)`` are scored, ``end = n_windows * win + 1``."""
    win = min(seq_len, len(stream) - 1)
    n_windows = min(max_batches * micro_batch_size, (len(stream) - 1) // win)
    return win, n_windows, n_windows * win + 1


def _span_bytes(stream: TokenFiles, end: int, tokenizer) -> int:
    key = (tuple(str(f) for f in stream.files), len(stream), end, getattr(tokenizer, "sha256", id(tokenizer)))
    if key not in _BYTES_CACHE:
        _BYTES_CACHE[key] = text_bytes(tokenizer, stream.read(1, end - 1))
    return _BYTES_CACHE[key]


def _read_batch(stream: TokenFiles, part: list, win: int, bytes_end: int, tokenizer) -> tuple[np.ndarray, int | None]:
    """The windows ``part`` of ``stream`` as rows (B, win + 1) (None: window 0 stands in, the same forward as the
    other ranks; its losses are dropped), and with ``bytes_end`` the UTF-8 bytes of the scored span (read with the
    first batch, so that its read meets the same stop check as the windows')."""
    rows = np.stack([stream.read((0 if k is None else k) * win, win + 1) for k in part])
    return rows, (_span_bytes(stream, bytes_end, tokenizer) if bytes_end else None)


@torch.no_grad()
def evaluate_val(
    model: torch.nn.Module,
    streams: dict[str, TokenFiles],
    seq_len: int,
    micro_batch_size: int,
    max_batches: int,
    device: torch.device,
    autocast: contextlib.AbstractContextManager | None = None,
    tokenizer=None,
    eos_id: int | None = None,
    reset_positions: bool = False,
    should_stop: StopCheck = None,
) -> dict[str, dict]:
    """Validation loss of every source: ``{source: {'loss': nats per token, 'tokens': scored tokens}}``,
    plus ``'bytes'`` (UTF-8 bytes of the scored text) and ``'bpb'`` (bits per byte, module
    docstring) when the run's ``tokenizer`` is given.

    Uses at most ``max_batches * micro_batch_size`` windows per source (fewer when the held-out
    stream is shorter; a stream shorter than one window is scored as one shorter window). All
    data-parallel ranks must call this together; each runs the same number of forward calls
    (module docstring) and returns the same numbers. The model's wrappers are removed and eval mode
    is set for the call (:func:`densetrain.evals.scoring.eval_mode`). With ``eos_id`` (a stage with
    document masking) windows are scored as training sees them: attention within documents, and with
    ``reset_positions`` RoPE positions restarting per document (:func:`densetrain.model.masks.document_ids`).

    Raises:
        EvalStopped: ``should_stop()`` (asked before each forward batch, on every rank at the same batches)
            said True (:mod:`densetrain.evals.stop`).
    """
    rank, size = dp_rank_size()
    out = {}
    with eval_mode(model) as model:
        for name in sorted(streams):
            stream = streams[name]
            win, n_windows, end = scored_span(stream, seq_len, micro_batch_size, max_batches)
            mine = even_split(n_windows, rank, size)
            loss_sum = torch.zeros(2, dtype=torch.float64, device=device)
            nbytes = None
            for i in range(0, len(mine), micro_batch_size):
                part = mine[i : i + micro_batch_size]
                span = end if tokenizer is not None and i == 0 else 0
                rows, got = read_then_stop_point(should_stop, partial(_read_batch, stream, part, win, span, tokenizer))
                nbytes = got if i == 0 else nbytes
                t = torch.from_numpy(rows).to(device)
                inputs = {}
                if eos_id is not None:
                    doc, pos = document_ids(rows[:, :-1], eos_id)  # on the host, as in training
                    inputs["doc_ids"] = torch.from_numpy(doc).to(device)
                    if reset_positions:
                        inputs["positions"] = torch.from_numpy(pos).to(device)
                with autocast or contextlib.nullcontext():
                    logits = model(t[:, :-1], **inputs)
                losses = token_losses(logits, t[:, 1:])  # (B, win)
                real = [j for j, k in enumerate(part) if k is not None]
                if len(real) < len(part):
                    losses = losses[real]
                loss_sum[0] += losses.double().sum()  # in float64: large finite losses must not overflow to inf
                loss_sum[1] += losses.numel()
            all_reduce_sum(loss_sum)
            n = int(loss_sum[1])
            out[name] = {"loss": float(loss_sum[0] / n) if n else float("nan"), "tokens": n}
            if tokenizer is not None:
                out[name]["bytes"] = nbytes
                out[name]["bpb"] = float(loss_sum[0]) / _LN2 / nbytes if nbytes else float("nan")
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
    the token-weighted loss over every source against the entropy of all held-out text together,
    and (when the sources have ``bytes``) the byte-weighted bits per byte over every source."""
    table = {s: {**v, "unigram_entropy": unigram_entropy([streams[s]])} for s, v in val.items()}
    table["all"] = {**val_overall(val), "unigram_entropy": unigram_entropy([streams[s] for s in val])}
    return table


def val_overall(val: dict[str, dict]) -> dict:
    """The ``'all'`` row of :func:`evaluate_val`'s result: ``{'loss', 'tokens'}`` over every source
    (token-weighted), plus ``'bytes'`` and ``'bpb'`` (total bits / total bytes) when every source has
    bytes."""
    n = sum(v["tokens"] for v in val.values())
    nats = sum(v["loss"] * v["tokens"] for v in val.values())
    row = {"loss": nats / n if n else float("nan"), "tokens": n}
    if val and all("bytes" in v for v in val.values()):
        nbytes = sum(v["bytes"] for v in val.values())
        row["bytes"] = nbytes
        row["bpb"] = nats / _LN2 / nbytes if nbytes else float("nan")
    return row
