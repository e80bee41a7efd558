"""Context parallelism: each sequence split along time over the ``cp`` ranks of a context-parallel group,
attention over the whole sequence by all-gathering keys and values (Llama 3's method, Dubey et al. 2024,
sec. 3.3.2: K/V are small under GQA, and a gathered K/V supports any mask, document masks included).

Load balance: the sequence of ``T`` tokens is cut into ``2 cp`` chunks of ``T / (2 cp)``; rank ``i``
holds chunks ``i`` and ``2 cp - 1 - i``, so every rank has one early and one late chunk and the causal
work (a query attends to the keys before it) is the same on every rank. With document masking it is
not: a query attends only to the keys of its own document, so a rank's work depends on where the
documents of a row begin (:func:`attention_work`; a row of documents of 4 and 12 tokens at cp 2: 52
and 36 query-key pairs, not 44 and 44). The split is kept (every row, every rank: the same time
indices, which the step's token counts and the gathered keys' order rely on); the imbalance this costs
on real document lengths is measured by ``benchmarks/cp_balance.py`` and stated in docs/distributed.md.
It matters only where masked-out pairs are skipped (FlexAttention's block mask on CUDA); the CPU path's
SDPA with a boolean mask computes every ``(T / cp) x T`` pair on every rank.

Per micro-batch the step builds one :class:`ContextParallelAttention` from the rows' host arrays
(:func:`shard_rows`; a pytree whose leaves are the rows' document ids, so that a pipeline schedule
splits it per micro-batch as it splits any per-row input), and the model calls it in every layer in
place of its own attention (the model holds no distributed code: it receives the function). Every
query keeps exactly the keys it has in one process: key ``k`` is visible to query ``j`` iff ``time[k] <=
time[j]`` and, with document masking, ``doc[k] == doc[j]``; RoPE positions are the global ones (or
restart per document), passed to the model.

Reductions: context-parallel ranks hold different tokens of the same rows, so the loss sums, token
counts and per-source sums add over them as over data-parallel ranks
(:func:`densetrain.parallel.all_reduce_sum` adds every tensor-parallel-rank-0 process), and FSDP2
reduces gradients over ``dp_shard x cp`` (:func:`densetrain.parallel.mesh.dp_mesh`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree


def chunk_index(seq_len: int, rank: int, cp: int) -> np.ndarray:
    """Time indices (``seq_len / cp``,) int64 of rank ``rank``'s tokens: chunks ``rank`` and ``2 cp - 1 - rank``
    of ``2 cp`` equal chunks. Raises: ValueError when ``2 cp`` does not divide ``seq_len``."""
    if seq_len % (2 * cp):
        raise ValueError(f"context parallelism over {cp} ranks needs seq_len divisible by {2 * cp}, got {seq_len}")
    c = seq_len // (2 * cp)
    early, late = rank * c, (2 * cp - 1 - rank) * c
    return np.concatenate([np.arange(early, early + c), np.arange(late, late + c)])


def attention_work(pos: np.ndarray, rank: int, cp: int) -> np.ndarray:
    """Query-key pairs rank ``rank``'s queries attend to, per row: ``sum(pos + 1)`` over its tokens
    (:func:`chunk_index`), a query at position ``p`` of its document seeing ``p + 1`` keys.

    Args:
        pos: (B, T) int positions of the tokens in their documents
            (:func:`densetrain.model.masks.document_ids`; ``arange(T)`` per row without a document mask).
    Returns: (B,) int64.
    """
    return (np.asarray(pos)[:, chunk_index(pos.shape[1], rank, cp)] + 1).sum(axis=1, dtype=np.int64)


def gathered_index(seq_len: int, cp: int) -> np.ndarray:
    """Time index (``seq_len``,) of each position of the all-gathered keys: rank 0's tokens, then rank 1's, ..."""
    return np.concatenate([chunk_index(seq_len, r, cp) for r in range(cp)])


class ContextParallelAttention:
    """Causal (optionally document-masked) attention of this rank's queries over the keys and values of the
    whole sequence, gathered from the context-parallel group. Called by
    :class:`densetrain.model.llama.Attention` with its local, RoPE-rotated ``q`` and unrepeated ``k, v``.

    Args:
        mesh: the 1-D context-parallel ``DeviceMesh``.
        q_time: (T_local,) int64, the time index of each local token; k_time: (T,) int64, of each gathered key.
        q_doc, k_doc: (B, T_local) and (B, T) int64 document ids, or None (causal only).
        seq_len: the whole sequence's length (the RoPE table the model's positions index into).

    Shapes: ``__call__(q (B, H, T_local, hd), k, v (B, H_kv, T_local, hd), scale) -> (B, H, T_local, hd)``.
    """

    def __init__(self, mesh, q_time: torch.Tensor, k_time: torch.Tensor, q_doc: torch.Tensor | None = None,
                 k_doc: torch.Tensor | None = None, seq_len: int = 0, memo: dict | None = None):
        self.mesh, self.seq_len = mesh, seq_len
        self.q_time, self.k_time, self.q_doc, self.k_doc = q_time, k_time, q_doc, k_doc
        # The masks of the last document ids seen, shared by the copies pytree rebuilds (a pipeline's split
        # per micro-batch, FSDP's cast of a block's inputs): built once per micro-batch, not per layer.
        self._memo = {} if memo is None else memo
        # (1 or B, 1, T_local, T) bool, True where a query may attend to a key (broadcast over heads). Built here,
        # outside any compiled block; None for a pytree of chunk specs (the pipeline's split plan), not of tensors.
        real = q_doc is None or isinstance(q_doc, torch.Tensor)
        self.mask = self._memoized("mask", self._build_mask) if real else None

    def _memoized(self, name: str, build):
        memo = self._memo
        if "docs" not in memo or memo["docs"][0] is not self.q_doc or memo["docs"][1] is not self.k_doc:
            memo.clear()
            memo["docs"] = (self.q_doc, self.k_doc)
        if name not in memo:
            memo[name] = build()
        return memo[name]

    def _build_mask(self) -> torch.Tensor:
        mask = self.k_time[None, :] <= self.q_time[:, None]  # (T_local, T) causal in global time
        if self.q_doc is not None:  # (B, T_local, T) within documents
            mask = mask[None] & (self.q_doc[:, :, None] == self.k_doc[:, None, :])
        return mask.unsqueeze(-3)

    def gather(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, H_kv, T_local, hd) each -> (B, H_kv, T, hd) each: every rank's part along time, in rank order.

        One all-gather for both (so every rank runs the same collectives in the same order in the
        backward too), as a DTensor redistribution ``Shard(time) -> Replicate`` whose gradient is
        ``Partial`` (each rank's queries contribute to every key): its backward is a reduce-scatter, which
        sums each part's gradient from every rank and hands each rank its own part.
        """
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        kv = torch.stack((k, v))  # (2, B, H_kv, T_local, hd)
        full = DTensor.from_local(kv, self.mesh, [Shard(3)], run_check=False).redistribute(self.mesh, [Replicate()])
        kv = full.to_local(grad_placements=[Partial()])  # (2, B, H_kv, T, hd)
        return kv[0], kv[1]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        k, v = self.gather(k, v)  # (B, H_kv, T, hd): the whole sequence's keys and values
        if q.is_cuda:
            return self._flex(q, k, v, scale)
        # SDPA with a boolean mask; GQA inside the kernel (the gathered K/V are not copied per query head).
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, scale=scale, enable_gqa=True)

    def _flex(self, q, k, v, scale):
        """FlexAttention with a block mask from the same time and document indices (fully masked tiles
        skipped; the (T_local, T) mask is never materialised per head)."""
        from densetrain.model.masks import _flex

        flex, create_block_mask = _flex()
        qt, kt, qd, kd = self.q_time, self.k_time, self.q_doc, self.k_doc

        def visible(b, h, qi, ki):
            ok = kt[ki] <= qt[qi]
            return ok & (qd[b, qi] == kd[b, ki]) if qd is not None else ok

        B = q.shape[0] if qd is not None else None
        block = self._memoized("block", lambda: create_block_mask(visible, B, None, q.shape[2], k.shape[2],
                                                                  device=q.device))
        return flex(q, k, v, block_mask=block, scale=scale, enable_gqa=True)


def _flatten(a: ContextParallelAttention):
    return [a.q_doc, a.k_doc], (a.mesh, a.q_time, a.k_time, a.seq_len, a._memo)


def _unflatten(docs, context) -> ContextParallelAttention:
    mesh, q_time, k_time, seq_len, memo = context
    return ContextParallelAttention(mesh, q_time, k_time, *docs, seq_len=seq_len, memo=memo)


# A pytree node whose leaves are the rows' document ids (the time indices are the same for every row):
# the pipeline schedule splits the step's attention into each micro-batch's as it splits the step's
# positions (torch.distributed.pipelining chunks a keyword input's tensor leaves along rows; as an opaque
# object it was handed whole to every micro-batch, which then attended within another micro-batch's
# documents).
pytree.register_pytree_node(ContextParallelAttention, _flatten, _unflatten,
                            serialized_type_name=f"{__name__}.ContextParallelAttention")


def shard_rows(rows: np.ndarray, rank: int, cp: int, mesh, device: torch.device, doc: np.ndarray | None = None,
               pos: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """This rank's part of a micro-batch of packed rows, and the model inputs that make it compute the
    single-process attention.

    Args:
        rows: (b, T + 1) token ids (inputs are ``[:, :-1]``, targets ``[:, 1:]``).
        doc, pos: (b, T) document ids and per-document positions of the inputs
            (:func:`densetrain.model.masks.document_ids`), or None (no document mask; positions 0 .. T-1
            unless ``pos`` is given).
    Returns:
        ``(inputs (b, T/cp), targets (b, T/cp), {"positions": (b, T/cp), "attend": ContextParallelAttention})``.
    """
    T = rows.shape[1] - 1
    idx, gidx = chunk_index(T, rank, cp), gathered_index(T, cp)
    x = torch.from_numpy(np.ascontiguousarray(rows[:, :-1][:, idx])).to(device)
    y = torch.from_numpy(np.ascontiguousarray(rows[:, 1:][:, idx])).to(device)
    positions = np.broadcast_to(idx, x.shape) if pos is None else pos[:, idx]
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    attend = ContextParallelAttention(mesh, to(idx), to(gidx), None if doc is None else to(doc[:, idx]),
                                      None if doc is None else to(doc[:, gidx]), seq_len=T)
    return x, y, {"positions": to(positions), "attend": attend}
