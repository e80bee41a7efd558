"""Document masking for packed sequences: document ids and RoPE positions from EOS tokens, and
attention that stays inside each document.

A training window packs several documents, each ended by EOS. The Llama 3 report (Dubey et al.
2024, sec. 3.2) masks attention across those boundaries and finds it matters most for very long
sequences. The boundaries come from the data, computed once per batch on the host
(:func:`document_ids`): token ``j`` of a row belongs to document ``doc[j]`` = the number of EOS
tokens *before* ``j`` (an EOS belongs to the document it ends), and its position in that document
is ``j`` minus the index of the document's first token. A window that starts inside a document
counts that document from the window start, as unmasked training does. Where the tokenizer has a
BOS (Llama 3) every document starts with it, right after the previous EOS: the BOS is token 0 of its
own document, position 0, attending only to itself, as it is in evaluation, where every context
starts with it (:func:`densetrain.evals.scoring.start_token`).

Attention then lets query ``j`` see key ``k`` iff ``k <= j`` and ``doc[k] == doc[j]``. Three paths:

- **CPU (and any device without FlexAttention)**: per document. Each row's documents are
  contiguous spans, so attention within documents is one causal SDPA call per span (the spans are
  found once per forward and shared by every layer). FlexAttention has no CPU backward in torch 2.13
  (NotImplementedError). Measured against SDPA with a block-diagonal causal boolean mask
  ``(B, 1, T, T)``, on the tiny preset's long-context micro-batch (2 x 1024 tokens of books /
  technical / code windows, 1-2 documents per row; forward + backward, 1 thread, median of 10):
  unmasked causal 521 ms, per document 474 ms, dense mask 578 ms; with an EOS every 64 tokens (16
  documents per row) 511, 427 and 576 ms. The per-document path skips the cross-document blocks
  instead of computing and masking them, so it is cheaper than no mask at all.
- **CUDA**: FlexAttention (``torch.nn.attention.flex_attention``, compiled) with a block mask from
  the same document ids: fully masked 128 x 128 tiles are skipped.
- **Inside compiled code** (``train.compile`` or ``parallel.compile_blocks``, without FlexAttention):
  one SDPA call with the block-diagonal causal boolean mask ``(B, 1, T, T)`` built on the device from
  the document ids. The per-document spans are host data (a graph break at the device-to-host copy)
  whose layout changes every batch, and compiled code specialises on it (a recompile per number of
  documents, until torch's recompile limit sends the block back to eager); the dense mask keeps one
  graph per shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from densetrain.model.compiling import pin_inductor_cache


def document_ids(tokens: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Document index and position in the document of every token of packed rows.

    Args:
        tokens: (B, T) integer token ids (the model's inputs). eos_id: the end-of-document token.
    Returns:
        (doc, pos), each (B, T) int64: ``doc[b, j]`` = EOS tokens in ``tokens[b, :j]``;
        ``pos[b, j]`` = ``j`` minus the index of the first token of that document (0 at the window
        start and right after each EOS).
    """
    tokens = np.asarray(tokens)
    is_eos = (tokens == eos_id).astype(np.int64)
    doc = np.cumsum(is_eos, axis=1) - is_eos  # (B, T): EOS before j, not counting j itself
    idx = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int64), tokens.shape)
    first = np.zeros(tokens.shape, dtype=bool)  # (B, T): j starts a document
    first[:, 0] = True
    first[:, 1:] = is_eos[:, :-1] > 0
    start = np.maximum.accumulate(np.where(first, idx, 0), axis=1)  # (B, T) first index of j's document
    return doc, idx - start


def _flex():
    """FlexAttention's (compiled flex_attention, create_block_mask), or None where it cannot be used."""
    global _FLEX
    if _FLEX is None:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            pin_inductor_cache()
            _FLEX = (torch.compile(flex_attention, dynamic=False), create_block_mask)
        except (ImportError, RuntimeError):  # pragma: no cover - old torch or no compiler
            _FLEX = False
    return _FLEX or None


_FLEX = None


@dataclass
class DocumentMask:
    """Which keys each query may attend to in one forward pass, in the form the kernel needs.

    Build with :meth:`build` once per forward; every layer calls :meth:`attend`.

    Attributes:
        doc: (B, T) int64 document ids on the model's device.
        spans: per row, the ``(start, end)`` token ranges of its documents (per-document path), or None.
        block: a FlexAttention ``BlockMask`` (CUDA path), or None.
    """

    doc: torch.Tensor
    spans: list[list[tuple[int, int]]] | None = None
    block: object | None = None

    @classmethod
    def build(cls, doc: torch.Tensor, use_flex: bool | None = None) -> DocumentMask:
        """``doc`` (B, T) int64 document ids on the model's device -> the mask for its kernel.

        ``use_flex`` None picks FlexAttention on CUDA when it is available, per-document SDPA elsewhere.
        """
        B, T = doc.shape
        flex = _flex() if (doc.is_cuda if use_flex is None else use_flex) else None
        if flex is not None:
            def same_doc_causal(b, h, q, k):
                return (doc[b, q] == doc[b, k]) & (q >= k)

            # _compile: build the block mask tile by tile, never materialising the (T, T) boolean mask
            return cls(doc, block=flex[1](same_doc_causal, B, None, T, T, device=doc.device, _compile=True))
        if torch.compiler.is_compiling():
            return cls(doc)  # attend builds the dense mask in the graph
        host = doc.cpu().numpy()  # (B, T); ids are non-decreasing along a row, so each document is a span
        spans = []
        for row in host:
            cuts = [0, *(np.flatnonzero(np.diff(row)) + 1).tolist(), T]
            spans.append(list(zip(cuts[:-1], cuts[1:])))
        return cls(doc, spans=spans)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        """Masked attention: q, k, v (B, H, T, head_dim), KV heads already repeated -> (B, H, T, head_dim).

        ``scale`` is the softmax temperature (None: 1/sqrt(head_dim)). Every query sees at least
        itself, so no softmax row is empty.
        """
        if self.block is not None:
            return _flex()[0](q, k, v, block_mask=self.block, scale=scale)
        if torch.compiler.is_compiling() or self.spans is None:
            T = self.doc.shape[1]
            causal = torch.ones(T, T, dtype=torch.bool, device=self.doc.device).tril()
            same_doc = self.doc[:, None, :, None] == self.doc[:, None, None, :]  # (B, 1, T, T)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=same_doc & causal, scale=scale)
        rows = []
        for b, spans in enumerate(self.spans):
            if len(spans) == 1:  # one document: the whole row is plain causal attention
                rows.append(F.scaled_dot_product_attention(q[b : b + 1], k[b : b + 1], v[b : b + 1],
                                                           is_causal=True, scale=scale))
                continue
            rows.append(torch.cat([F.scaled_dot_product_attention(q[b : b + 1, :, s:e], k[b : b + 1, :, s:e],
                                                                  v[b : b + 1, :, s:e], is_causal=True, scale=scale)
                                   for s, e in spans], dim=2))  # (1, H, T, head_dim)
        return torch.cat(rows, dim=0)  # (B, H, T, head_dim)
