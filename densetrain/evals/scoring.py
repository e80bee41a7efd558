"""What every evaluator shares: the eval-mode switch, the start token, log-likelihood requests and
their scoring, split evenly over the data-parallel ranks.

Requests. A request is a (context, continuation) pair as token ids; its score is the sum of the
model's log-probabilities (nats) of the continuation's tokens given everything before them. Context
tokens are never scored. Tokenization (lm-evaluation-harness' ``_encode_pair`` whitespace rule, then
separate encoding as in olmo_eval):

* whitespace at the end of the context moves to the front of the continuation
  (``"Answer: "`` + ``"A"`` is scored as ``"Answer:"`` + ``" A"``), so that a space is never a lone
  context token that the model would not see before a word in running text;
* context and continuation are encoded *separately* and concatenated, so the scored ids are the
  continuation's own tokens even when a tokenizer would merge the last context characters with the
  first continuation characters into one token (``encode("de") + encode("f")``, not the ``"def"``
  token). The harness instead encodes ``context + continuation`` jointly and scores the ids after the
  first ``len(encode(context))``, which then need not be the continuation's text. ``n_chars`` /
  ``n_bytes`` (the per-character / per-byte normalisers: OLMES ``acc_per_char``, ``acc_per_byte``)
  count the continuation string after the move (``n_chars_choice``, lm-eval-harness' ``acc_norm``
  normaliser, the same without its leading whitespace), which is exactly the text its tokens decode
  to for the lossless tokenizers used here (byte-level BPE, tiktoken);
* every request starts with one *start token*: the tokenizer's BOS when it defines one
  (``bos_id``), else its EOS -- training documents follow an EOS in the shards, so the first real
  token is conditioned as in training. The start token is context, never scored.

A request longer than ``seq_len_max + 1`` tokens loses tokens on the left *after* the start token
(context first: with shots, the first shots go first; the question and its continuation are kept as
long as they fit; an answer longer than the context loses its head, and its normalisers then count
the text of the tokens that are still scored). ``Request.n_truncated`` records the loss.

Scoring and parallelism (:func:`score_requests`). Identical requests are scored once; the distinct
ones are sorted by length (longest first) and cut into batches of ``batch_size``, right-padded
(causal attention: padding never changes the scored positions), all identically on every rank. The
batches are dealt to the data-parallel ranks by :func:`densetrain.parallel.even_split`; a rank with
one batch fewer scores a stand-in (the shortest batch) and discards it, so that every rank runs the
same number of forward calls (under FSDP / tensor parallelism each forward is a collective). The
per-request sums are then added over ranks (each value lives on exactly one rank, so the sum is
exact): every rank returns the same scores as one process would.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from densetrain.evals.stop import StopCheck, stop_point
from densetrain.parallel import all_reduce_sum, dp_rank_size, even_split, unwrap

__all__ = ["Request", "build_requests", "encode_pair", "eval_mode", "score_requests", "start_token"]


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """Yield the plain module under ``model``'s DDP / torch.compile wrappers
    (:func:`densetrain.parallel.unwrap`) in eval mode; its previous mode is restored on exit. The
    one eval-mode switch of every evaluator."""
    model = unwrap(model)
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def start_token(tokenizer) -> int:
    """The id every scored or generation context starts with: the tokenizer's BOS (``bos_id``) when it
    has one, else its EOS (module docstring)."""
    bos = getattr(tokenizer, "bos_id", None)
    return tokenizer.eos_id if bos is None else int(bos)


@dataclass(frozen=True)
class Request:
    """One (context, continuation) pair as token ids.

    Attributes:
        tokens: the start token, context ids, continuation ids (after left truncation), length >= 2.
        n_ctx: number of leading ids that are not scored (start token + context; >= 1);
            ``tokens[n_ctx:]`` are scored.
        n_chars: characters of the scored text (per-char normaliser).
        n_bytes: UTF-8 bytes of the scored text (per-byte normaliser).
        n_truncated: ids dropped after the start token to fit ``seq_len_max`` (0 when all fit).
        n_chars_choice: characters of the scored text without its leading whitespace (lm-eval-harness'
            ``acc_norm`` normaliser, ``len(choice)``; ``n_chars`` for an all-whitespace text).
    """

    tokens: tuple[int, ...]
    n_ctx: int
    n_chars: int
    n_bytes: int
    n_truncated: int = 0
    n_chars_choice: int = 0

    @property
    def n_scored(self) -> int:
        """Number of scored (continuation) tokens, >= 1."""
        return len(self.tokens) - self.n_ctx


def _move_whitespace(context: str, continuation: str) -> tuple[str, str]:
    """The context's trailing whitespace moved to the front of the continuation (module docstring)."""
    n = len(context) - len(context.rstrip())
    return (context[: len(context) - n], context[len(context) - n :] + continuation) if n else (context, continuation)


def encode_pair(tokenizer, context: str, continuation: str, seq_len_max: int = 2048) -> Request:
    """Tokenize one (context, continuation) pair (module docstring: whitespace, start token, truncation).

    Args:
        tokenizer: a :class:`densetrain.data.tokenizer.Tokenizer` (``encode_batch``, ``decode``,
            ``eos_id``, optionally ``bos_id``).
        context: the prompt; may be empty.
        continuation: the scored text, non-empty (usually with a leading space).
        seq_len_max: at most this many model inputs (``len(tokens) - 1``); >= 1.

    Raises:
        ValueError: empty continuation, one that encodes to no tokens, or seq_len_max < 1.
    """
    return build_requests(tokenizer, [(context, continuation)], seq_len_max)[0]


def build_requests(tokenizer, pairs: list[tuple[str, str]], seq_len_max: int = 2048) -> list[Request]:
    """:func:`encode_pair` for many pairs, with batched (parallel) encoding and each distinct string
    encoded once.

    Raises:
        ValueError: an empty continuation, one that encodes to no tokens, or seq_len_max < 1.
    """
    if seq_len_max < 1:
        raise ValueError(f"seq_len_max must be >= 1, got {seq_len_max}")
    if any(not cont for _, cont in pairs):
        raise ValueError("empty continuation: nothing to score")
    moved = [_move_whitespace(ctx, cont) for ctx, cont in pairs]
    contexts = list(dict.fromkeys(ctx for ctx, _ in moved))
    conts = list(dict.fromkeys(cont for _, cont in moved))
    ctx_ids = dict(zip(contexts, tokenizer.encode_batch(contexts)))
    cont_ids = dict(zip(conts, tokenizer.encode_batch(conts)))
    start = start_token(tokenizer)
    out = []
    for ctx, cont in moved:
        scored = cont_ids[cont]
        if not scored:
            raise ValueError(f"continuation {cont!r} encodes to no tokens: nothing to score")
        n_ctx = 1 + len(ctx_ids[ctx])
        tokens = [start, *ctx_ids[ctx], *scored]
        extra = max(len(tokens) - 1 - seq_len_max, 0)
        if extra:  # keep the start token; drop the earliest context (then continuation) ids after it
            tokens = [start, *tokens[1 + extra :]]
            if extra > n_ctx - 1:  # the head of the continuation went too: normalise by what is scored
                cont = tokenizer.decode(tokens[1:])
            n_ctx = max(n_ctx - extra, 1)
        out.append(Request(tuple(tokens), n_ctx, len(cont), len(cont.encode("utf-8")), extra,
                           len(cont.lstrip()) or len(cont)))
    return out


def _score_batch(model, keys, chunk, device, autocast, pad_id) -> np.ndarray:
    """Sums of continuation log-probs of the distinct requests ``keys[k]`` for ``k`` in ``chunk``:
    (len(chunk),) float64 nats, from one forward call."""
    T = max(len(keys[k][0]) for k in chunk) - 1
    inp = torch.full((len(chunk), T), pad_id, dtype=torch.long)
    tgt = torch.full((len(chunk), T), -1, dtype=torch.long)  # -1: not scored
    for row, k in enumerate(chunk):
        tokens, n_ctx = keys[k]
        ids = torch.tensor(tokens, dtype=torch.long)
        inp[row, : len(tokens) - 1] = ids[:-1]
        tgt[row, n_ctx - 1 : len(tokens) - 1] = ids[n_ctx:]  # position t predicts token t + 1
    inp, tgt = inp.to(device), tgt.to(device)
    with autocast or contextlib.nullcontext():
        logits = model(inp)  # (B, T, V)
    rows, cols = (tgt >= 0).nonzero(as_tuple=True)  # (N,) each: the scored positions
    picked = logits[rows, cols]  # (N, V)
    logp = F.log_softmax(picked.to(torch.promote_types(picked.dtype, torch.float32)), dim=-1)
    token_lp = logp.gather(1, tgt[rows, cols].unsqueeze(1)).squeeze(1).double()  # (N,)
    per_row = torch.zeros(len(chunk), dtype=torch.float64, device=token_lp.device)
    per_row.index_add_(0, rows, token_lp)
    return per_row.cpu().numpy()


@torch.no_grad()
def score_requests(
    model: torch.nn.Module,
    requests: list[Request],
    device: torch.device | str,
    batch_size: int = 32,
    autocast: contextlib.AbstractContextManager | None = None,
    pad_id: int = 0,
    should_stop: StopCheck = None,
    split: bool = True,
    progress: Callable[[int], None] | None = None,
) -> np.ndarray:
    """Sum of continuation log-probabilities of every request (module docstring: batching, split).

    Args:
        model: ``forward(tokens (B, T) int64) -> logits (B, T, V)``, causal; evaluated as given
            (the caller sets eval mode). V must exceed every token id.
        requests: from :func:`build_requests`; with ``split``, the same list on every rank.
        device: where the model lives.
        batch_size: sequences per forward; peak memory is about ``batch_size * T * V`` logits.
        autocast: optional autocast context for the forward (log-probs are computed in >= fp32).
        pad_id: id written into padding positions (never scored, never attended to by scored ones).
        should_stop: asked before each forward batch (:mod:`densetrain.evals.stop`).
        split: deal the batches over the data-parallel ranks (all ranks must call together, each
            runs ``ceil(n_batches / dp_size)`` forwards); False scores everything on this process.
        progress: called after each forward with the number of requests it stands for (this rank's
            share of the forwards times ``len(requests)``: the calls add up to ``len(requests)``).

    Returns:
        (len(requests),) float64, nats (<= 0), the same on every rank. Identical requests get
        bit-identical values.

    Raises:
        ValueError: batch_size < 1.
        EvalStopped: ``should_stop()`` said True.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    unique: dict[tuple[tuple[int, ...], int], int] = {}
    slot = np.array([unique.setdefault((r.tokens, r.n_ctx), len(unique)) for r in requests], dtype=np.int64)
    keys = list(unique)
    if not keys:
        return np.zeros(0, dtype=np.float64)
    order = sorted(range(len(keys)), key=lambda k: -len(keys[k][0]))
    batches = [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
    rank, size = dp_rank_size() if split else (0, 1)
    sums = np.zeros(len(keys), dtype=np.float64)
    mine, reported = even_split(len(batches), rank, size), 0
    for i, b in enumerate(mine):
        chunk = batches[-1 if b is None else b]  # None: the shortest batch stands in, result discarded
        stop_point(should_stop)
        ll = _score_batch(model, keys, chunk, device, autocast, pad_id)
        if b is not None:
            sums[chunk] = ll
        if progress is not None:  # every rank runs as many forwards, so its share of them is the job's
            now = len(requests) * (i + 1) // len(mine)
            progress(now - reported)
            reported = now
    if size > 1:
        sums = all_reduce_sum(torch.from_numpy(sums).to(device)).cpu().numpy()
    return sums[slot]
