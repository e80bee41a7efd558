"""FLOPs of a Llama-shaped Transformer: the one count behind MFU (the training log, the planner, the ladder) and
the per-op-class counts the step-time model times.

A model shape is any object with ``d_model, n_layers, n_heads, n_kv_heads, d_ff, vocab_size`` and optionally
``head_dim`` (else ``d_model / n_heads``) and ``tie_embeddings`` (a ``ModelConfig``, or :class:`Shape`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """The numbers of a model shape the cost model reads (a ``ModelConfig`` carries them too)."""

    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab_size: int
    head_dim: int = 0
    tie_embeddings: bool = False

    def __post_init__(self):
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)


def shape_of(m) -> Shape:
    """:class:`Shape` of a ``ModelConfig`` (or anything with its fields)."""
    return m if isinstance(m, Shape) else Shape(
        m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.d_ff, m.vocab_size,
        getattr(m, "head_dim", 0) or m.d_model // m.n_heads, bool(getattr(m, "tie_embeddings", False)))


def block_matmul_params(m) -> int:
    """Matmul weights of one block: ``wq, wk, wv, wo`` and SwiGLU's ``w1, w2, w3`` (norm gains left out)."""
    s = shape_of(m)
    q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    return s.d_model * (q + 2 * kv) + q * s.d_model + 3 * s.d_model * s.d_ff


def flops_per_token(m, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) as torchtitan and the Llama 3 report count them for MFU.

    ``6 N + 12 L H d_head T``: ``N`` the matmul parameters (every block's weights and the output head, not the
    input embedding, a lookup; norm gains are left out, under 0.01% of N), 2 FLOPs a multiply-add times 3
    (forward, and backward's two matmuls); the second term attention's ``QK^T`` and ``AV`` over ``T = seq_len``
    keys, *not* halved for the causal mask (Chowdhery et al. 2022, PaLM, App. B; torchtitan's
    ``get_num_flop_per_token``; Dubey et al. 2024 sec. 3.3.2). Norm, RoPE, softmax and activation FLOPs are
    not counted.

    Returns: FLOPs per token (float).
    """
    s = shape_of(m)
    n = s.n_layers * block_matmul_params(s) + s.d_model * s.vocab_size
    return 6.0 * n + 12.0 * s.n_layers * s.n_heads * s.head_dim * seq_len


def mfu(m, seq_len: int, tokens_per_sec_per_gpu: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: :func:`flops_per_token` x tokens/s of one GPU / its peak FLOP/s (dense bf16)."""
    return flops_per_token(m, seq_len) * tokens_per_sec_per_gpu / peak_flops


def gemm_shapes(m, tokens: int, tp: int = 1, head: bool = True) -> list[tuple[str, int, int, int]]:
    """The forward GEMMs of one block (and the output head) on ``tokens`` rows of one rank: ``(name, M, K, N)``
    with the tensor-parallel split (column-parallel ``wq/wk/wv/w1/w3`` split N, row-parallel ``wo/w2`` split
    K; key/value heads fewer than ``tp`` are replicated, one a rank). A GEMM is ``2 M K N`` FLOPs; its
    backward is two GEMMs of the same FLOPs (data and weight gradients)."""
    s = shape_of(m)
    q, kv = s.n_heads * s.head_dim // tp, max(s.n_kv_heads // tp, 1) * s.head_dim
    out = [("qkv", tokens, s.d_model, q + 2 * kv), ("wo", tokens, q, s.d_model),
           ("w1w3", tokens, s.d_model, 2 * s.d_ff // tp), ("w2", tokens, s.d_ff // tp, s.d_model)]
    return out + ([("head", tokens, s.d_model, s.vocab_size // tp)] if head else [])


def attention_flops(m, tokens: int, seq_len: int, tp: int = 1) -> float:
    """Forward FLOPs the causal attention kernel executes for ``tokens`` query rows of ``seq_len``-token
    sequences on one tensor-parallel rank: ``QK^T`` and ``AV`` against ``seq_len / 2`` keys on average (the
    mask halves the work that :func:`flops_per_token` counts whole)."""
    s = shape_of(m)
    return 2.0 * 2.0 * tokens * (seq_len / 2) * s.n_heads * s.head_dim / tp


BLOCK_OPS = (68, 133)
"""Operators (aten calls) one densetrain block runs, ``(forward, backward)``, eager, fp32, no checkpointing: counted
with a ``TorchDispatchMode`` on the gpt2-124m shape (multi-head: ``n_kv_heads == n_heads``);
``tests/test_plan_cost.py`` recounts them on the real model. Each costs ``Hardware.op_overhead_s`` beside its
work where a profile measures it (``doctor --profile``: eager PyTorch on a CPU, tens of µs)."""
GQA_OPS = (8, 7)
"""More operators a block runs when ``n_kv_heads < n_heads`` (the key/value heads repeated for attention)."""
BASE_OPS = (35, 37)
"""Operators outside the blocks, ``(forward, backward)``: the embedding, final norm, output head and the loss."""

OPTIM_OPS = (23, 2)
"""Operators of one AdamW step (torch's foreach implementation, densetrain's fp32 choice): ``23 + 2`` a
parameter tensor (counted as :data:`BLOCK_OPS`); a block holds 9 tensors, the rest 3 (2 with tied embeddings)."""


def optimizer_ops(m, n_blocks: float) -> float:
    """Operators of one AdamW step over ``n_blocks`` blocks and the embedding, final norm and head
    (:data:`OPTIM_OPS`)."""
    s = shape_of(m)
    return OPTIM_OPS[0] + OPTIM_OPS[1] * (9 * n_blocks + (2 if s.tie_embeddings else 3))


def block_ops(m) -> tuple[int, int]:
    """``(forward, backward)`` operators of one block of shape ``m`` (:data:`BLOCK_OPS`, :data:`GQA_OPS`)."""
    s = shape_of(m)
    gqa = s.n_kv_heads < s.n_heads
    return BLOCK_OPS[0] + gqa * GQA_OPS[0], BLOCK_OPS[1] + gqa * GQA_OPS[1]
