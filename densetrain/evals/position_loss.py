"""Validation loss by position in the document: what a long-context stage buys.

Each scored document is run from its first token, alone (no packing, so no document mask is
needed and the model's own RoPE state, scaling included, applies), over its first ``length + 1``
tokens (fewer for a shorter document; the EOS that ends it is a target). The prediction made at
position ``p`` (the ``p + 1``-th token of the document is the last one seen, so ``p + 1`` tokens of
context) goes into the bucket whose range holds ``p``: with edges ``[0, 256, 1024]`` the buckets are
``0-255``, ``256-1023`` and ``1024+``. A bucket's loss is its summed token loss over its token count
(nats per token). Late buckets only fill when ``length`` exceeds their lower edge, so evaluating at
the long stage's length (or beyond, to see extrapolation) shows whether extra context is used:
a model that uses it has a lower loss in later buckets.

The documents are the ``n_docs`` longest of each long-document source's held-out split
(``data.sources[i].long_docs``; ties by position), the same at every evaluation of a run, so the
numbers before and after the long-context stage compare like for like (Xiong et al. 2023,
"Effective Long-Context Scaling of Foundation Models", evaluate long-context models the same way).
Documents are dealt to the data-parallel ranks with :func:`densetrain.parallel.even_split` and the
sums reduced, so the result does not depend on the number of processes.

The training loop evaluates before every stage longer than the first stage's sequences and at the
end (:func:`position_eval_due`), and logs :func:`position_metrics`'s keys
``val_pos/<source|all>/<bucket>/loss`` and ``.../tokens``.
"""

from __future__ import annotations

import contextlib
from functools import partial

import numpy as np
import torch

from densetrain.data.shards import TokenFiles
from densetrain.evals.scoring import eval_mode
from densetrain.evals.stop import StopCheck, read_then_stop_point
from densetrain.loss import token_losses
from densetrain.parallel import all_reduce_sum, dp_rank_size, even_split
from densetrain.schedule import Stage


def bucket_names(edges: list[int]) -> list[str]:
    """``[0, 256, 1024]`` -> ``['0-255', '256-1023', '1024+']``."""
    return [f"{lo}-{hi - 1}" for lo, hi in zip(edges, edges[1:])] + [f"{edges[-1]}+"]


def long_documents(stream: TokenFiles, n_docs: int) -> list[int]:
    """Indices of the ``n_docs`` longest documents of ``stream`` (longest first, ties by position),
    leaving out documents with nothing to predict (an EOS alone)."""
    ends = stream.doc_ends()
    lengths = np.diff(np.concatenate([[0], ends]))
    order = np.lexsort((np.arange(lengths.size), -lengths))  # by length descending, then index
    return [int(k) for k in order[:n_docs] if lengths[k] >= 2]


@torch.no_grad()
def evaluate_position_loss(
    model: torch.nn.Module,
    streams: dict[str, TokenFiles],
    length: int,
    n_docs: int,
    edges: list[int],
    device: torch.device,
    autocast: contextlib.AbstractContextManager | None = None,
    should_stop: StopCheck = None,
) -> dict[str, dict[str, dict]]:
    """Loss by position bucket on the longest held-out documents of each of ``streams``.

    Args:
        streams: source name -> held-out :class:`TokenFiles` (the long-document sources).
        length: predictions scored per document (positions ``0 .. length - 1``).
        n_docs: documents per source. edges: bucket lower edges, increasing from 0.
    Returns:
        ``{source: {bucket: {'loss': nats per token (nan when empty), 'tokens': count}}}`` plus an
        ``'all'`` entry, token-weighted over the sources. All data-parallel ranks must call this
        together (every rank runs the same number of forward calls) and get the same numbers.
    Raises:
        ValueError: ``edges`` do not start at 0 or do not increase.
        EvalStopped: ``should_stop()``, asked before each document's forward, said True.
    """
    if not edges or edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"bucket edges must increase from 0, got {edges}")
    names = bucket_names(edges)
    rank, size = dp_rank_size()
    sums: dict[str, torch.Tensor] = {}
    with eval_mode(model) as model:
        for name in sorted(streams):
            stream = streams[name]
            docs = long_documents(stream, n_docs)  # from the shards' index, read when the stream opened
            acc = torch.zeros(2, len(edges), dtype=torch.float64, device=device)  # [loss sum; tokens] per bucket
            for k in even_split(len(docs), rank, size):
                # None: a stand-in, dropped; a read that meets a store outage stops every rank here (evals.stop)
                doc = read_then_stop_point(should_stop, partial(stream.document, docs[0 if k is None else k]))
                doc = doc[: length + 1]
                t = torch.from_numpy(doc).to(device)[None]  # (1, n + 1)
                with autocast or contextlib.nullcontext():
                    logits = model(t[:, :-1])  # (1, n, vocab)
                if k is None:
                    continue
                losses = token_losses(logits, t[:, 1:])[0].double()  # (n,), position p predicts token p + 1
                bucket = torch.bucketize(torch.arange(losses.numel(), device=device),
                                         torch.tensor(edges, device=device), right=True) - 1  # (n,)
                acc[0].index_add_(0, bucket, losses)
                acc[1].index_add_(0, bucket, torch.ones_like(losses))
            sums[name] = all_reduce_sum(acc)
    out: dict[str, dict[str, dict]] = {}
    total = sum(sums.values()) if sums else torch.zeros(2, len(edges), dtype=torch.float64)
    for name, acc in [*sums.items(), ("all", total)]:
        loss, tokens = acc[0].tolist(), acc[1].tolist()
        out[name] = {b: {"loss": loss[i] / tokens[i] if tokens[i] else float("nan"), "tokens": int(tokens[i])}
                     for i, b in enumerate(names)}
    return out


def position_metrics(result: dict[str, dict[str, dict]]) -> dict[str, float]:
    """Flat metrics of :func:`evaluate_position_loss`: ``val_pos/<source>/<bucket>/loss`` and
    ``.../tokens``; empty buckets are left out."""
    return {f"val_pos/{src}/{b}/{k}": v[k] for src, bs in result.items() for b, v in bs.items() if v["tokens"]
            for k in ("loss", "tokens")}


def position_eval_due(step: int, stages: list[Stage], total_steps: int) -> str | None:
    """When the loop, having completed ``step`` updates, evaluates loss by position: ``'before
    <stage>'`` when the next update starts a stage with longer sequences than the first stage's,
    ``'final'`` after the last update, else None."""
    if step == total_steps:
        return "final"
    for st in stages[1:]:
        if st.start_step == step and st.seq_len > stages[0].seq_len:
            return f"before {st.name}"
    return None


def position_eval_length(stages: list[Stage], length: int = 0) -> int:
    """Predictions per document: ``length`` (``eval.position_len``) or, when 0, the longest stage's seq_len."""
    return length or max(st.seq_len for st in stages)


def position_eval(model: torch.nn.Module, cfg, stages: list[Stage], val_streams: dict[str, TokenFiles], step: int,
                  device: torch.device, autocast: contextlib.AbstractContextManager | None = None,
                  should_stop: StopCheck = None) -> dict | None:
    """The training loop's call after update ``step``: the metrics to log (:func:`position_metrics`
    plus ``'position_eval'``: ``'before <stage>'`` or ``'final'``), or None when not due
    (:func:`position_eval_due`), disabled (``eval.position_buckets = []``) or without long-document
    sources with held-out data. ``cfg`` is the run's :class:`densetrain.config.Config`; ``should_stop``: asked
    before each document's forward (:func:`evaluate_position_loss`)."""
    tag = position_eval_due(step, stages, cfg.train.steps) if cfg.eval.position_buckets else None
    long_docs = {s.name: val_streams[s.name] for s in cfg.data.sources if s.long_docs and s.name in val_streams}
    if tag is None or not long_docs:
        return None
    result = evaluate_position_loss(model, long_docs, position_eval_length(stages, cfg.eval.position_len),
                                    cfg.eval.position_docs, cfg.eval.position_buckets, device, autocast, should_stop)
    return {**position_metrics(result), "position_eval": tag}
