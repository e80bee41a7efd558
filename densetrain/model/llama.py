"""A Llama-style dense decoder in one file: RMSNorm, RoPE, grouped-query attention, SwiGLU, pre-norm blocks.

Architecture (Touvron et al. 2023, "LLaMA"; Dubey et al. 2024, "The Llama 3 Herd of Models"):

    h   = tok_embeddings[tokens]                                   # (B, T, d_model)
    for each layer:
        h = h + attention(attention_norm(h))                       # pre-norm, residual
        h = h + feed_forward(ffn_norm(h))
    logits = softcap(output(norm(h)) * logit_mult)                 # (B, T, vocab_size), Transformer.project

No biases anywhere. Parameter names follow torchtitan (``tok_embeddings``, ``layers.{i}.attention.wq``,
...), so that DCP checkpoints and the Hugging Face mapping in :mod:`densetrain.hf` stay simple.

RoPE convention (Su et al. 2021, "RoFormer"), the *half-split* pairing used by Hugging Face Llama:
within each head of size ``head_dim``, dimension ``i`` is rotated together with dimension
``i + head_dim/2`` (``rotate_half``), by the angle ``pos * inv_freq[i]`` with
``inv_freq[i] = 1 / theta^(2i / head_dim)`` for ``i = 0 .. head_dim/2 - 1``. Meta's original Llama code
pairs *adjacent* dimensions (2i, 2i+1) instead; the two differ only by a fixed permutation of the rows of
wq/wk. Because we use the HF convention, weights map to HF without any q/k permutation.

Distributed wrapping (FSDP, compile, activation checkpointing) lives elsewhere; this file is plain PyTorch.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from densetrain.config import ModelConfig
from densetrain.config.schema import RopeScalingConfig
from densetrain.model.masks import DocumentMask
from densetrain.model.rope import attention_factor, plain_inv_freq, rope_frequencies


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * weight``.

    The statistic is computed in fp32 (bf16 has too few mantissa bits for a mean of squares), then cast
    back to the input dtype before the gain, as in HF ``LlamaRMSNorm``.

    Shapes: input (..., dim) -> output (..., dim), same dtype as the input (or promoted by ``weight``).
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * xf.type_as(x)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


# --------------------------------------------------------------------------------------------------
# Rotary position embedding helpers (half-split convention, see module docstring)
# --------------------------------------------------------------------------------------------------


rope_inv_freq = plain_inv_freq  # (head_dim // 2,) float32 ``1 / theta^(2i/head_dim)`` (RoFormer eq. 15)


def rope_cos_sin(
    head_dim: int, theta: float, seq_len: int, device: torch.device | str | None = None,
    scaling: RopeScalingConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles ``pos * inv_freq`` for positions 0 .. seq_len-1.

    ``inv_freq`` is scaled by ``scaling`` (linear / llama3 / yarn, densetrain/model/rope.py); YaRN's
    attention factor multiplies both tables. Each frequency is repeated for both halves of the head
    (half-split pairing), so the result can be multiplied elementwise with q/k.
    Returns: (cos, sin), each (seq_len, head_dim) float32.
    """
    inv_freq = rope_frequencies(head_dim, theta, scaling, device)
    pos = torch.arange(seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(pos, inv_freq)  # (T, head_dim/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, head_dim): dim i and i + head_dim/2 share an angle
    mult = attention_factor(scaling)
    if mult != 1.0:
        return angles.cos() * mult, angles.sin() * mult
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the last dimension split in halves: the 90-degree turn of each pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (i, i + head_dim/2) pair of ``x`` by its position's angle.

    Args:
        x: (B, H, T, head_dim), any float dtype.
        cos, sin: (T, head_dim) float32 from :func:`rope_cos_sin` (broadcast over B and H), or
            (B, 1, T, head_dim) with per-row positions (incremental decoding, :class:`KVCache`).
    Returns: (B, H, T, head_dim) in the dtype of ``x``. The rotation itself is done in fp32 because
    bf16 angles at large positions lose the small phase differences that encode relative position.
    """
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).type_as(x)


MATMUL_ATTENTION_MAX_LEN = 512
"""Longest sequence for which bf16 CPU attention uses :func:`causal_attention`'s matmul path (its (T, T)
scores are kept for backward: 2 bytes x B x n_heads x T^2 per layer)."""


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal softmax attention ``softmax(q k^T * scale + causal mask) v``; scale None is 1/sqrt(head_dim).

    Shapes: q, k, v (B, H, T, head_dim) -> (B, H, T, head_dim), dtype of q.

    bf16 on CPU with T <= :data:`MATMUL_ATTENTION_MAX_LEN`: two bf16 batched matmuls with the softmax in
    fp32 between them (the "eager" attention of Hugging Face Llama). PyTorch's fused CPU kernel
    (``_scaled_dot_product_flash_attention_for_cpu``) was ~2x slower there, forward + backward, at
    B 8, H 6, T 256, head_dim 64 on 2 Zen 4 cores, and its backward held ~15% of a bf16 training step
    (torch.profiler). Everything else (fp32, which the golden trajectory covers, CUDA, long sequences)
    goes to ``F.scaled_dot_product_attention``.
    """
    T = q.shape[-2]
    if q.device.type != "cpu" or q.dtype != torch.bfloat16 or T > MATMUL_ATTENTION_MAX_LEN:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    # Scale q (T x head_dim), not the scores (T x T); an additive mask has a free backward (masked_fill's is not).
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)  # (B, H, T, head_dim)
    future = torch.full((T, T), float("-inf"), dtype=q.dtype, device=q.device).triu_(1)  # (T, T) -inf above diagonal
    return _Bf16Softmax.apply(q @ k.transpose(-2, -1) + future) @ v  # (B, H, T, head_dim)


class _Bf16Softmax(torch.autograd.Function):
    """softmax(scores) over the last dimension, computed in fp32 and returned in bf16 (the fp32 softmax
    rounded once to bf16), whose backward uses that bf16 output:
    ``dS = P * (dP - rowsum(P * dP))`` in fp32 arithmetic from bf16 P and dP, returned in bf16.

    Why: the bf16 probabilities are kept for ``P @ v``'s backward anyway, so the fp32 ones (twice the bytes of
    a (B, H, T, T) tensor) need not be kept, cast or, under ``parallel.compile_blocks``, recomputed (inductor
    re-ran the exponentials in the backward). The cost is P's bf16 rounding (relative 2^-9) in the softmax
    gradient, as FlashAttention's backward rounds P for dV. Eager, the forward is ATen's bf16 CPU softmax,
    which computes each row in fp32 and rounds once (the fp32 softmax cast to bf16, bitwise but for rare
    one-ulp differences, ~1 in 10^7 values with AVX-512 kernels; one pass instead of softmax-then-cast:
    attention block forward + backward -1.7% at the 13.8M benchmark shape, 2 Zen 4 cores). Compiled,
    inductor's own fused kernel computes the same in fp32.
    Shapes: scores (..., T) bf16 -> (..., T) bf16.
    """

    @staticmethod
    def forward(ctx, scores: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # inductor fuses the upcast, the softmax and the cast into one kernel
            p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
        else:
            p = torch.softmax(scores, dim=-1)  # bf16 in and out; fp32 inside (CPU); scores' device is the CPU
        ctx.save_for_backward(p)
        return p

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (p,) = ctx.saved_tensors
        return torch._softmax_backward_data(grad, p, -1, p.dtype)


# --------------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Causal multi-head attention with grouped-query KV heads (Ainslie et al. 2023, "GQA").

    ``n_kv_heads`` must divide ``n_heads``; query head ``h`` attends with KV head ``h // (n_heads // n_kv_heads)``
    (consecutive query heads share a KV head, as in HF ``repeat_kv``). ``n_kv_heads == n_heads`` is MHA.

    ``attn_scale`` is the softmax temperature: None means the usual 1/sqrt(head_dim) (Vaswani et al. 2017);
    μP sets 1/head_dim (Yang et al. 2022). :class:`Transformer` propagates its own ``attn_scale`` here.

    Shapes: forward(x (B, T, d_model), cos (T, head_dim), sin (T, head_dim)) -> (B, T, d_model).
    With ``doc_mask`` (a :class:`DocumentMask`) each query attends only within its document, and
    cos/sin may be (B, 1, T, head_dim) (positions restarting per document).
    With ``cache`` (a :class:`KVCache`), ``x`` holds only the new positions, their keys/values are
    appended to layer ``layer`` of the cache, and cos/sin are (B, 1, T, head_dim).
    With ``attend``, a function ``attend(q, k, v, attn_scale) -> (B, n_heads, T, head_dim)`` of the rotated
    queries (B, n_heads, T, head_dim) and the unrepeated keys/values (B, n_kv_heads, T, head_dim), the
    attention itself is that function's (context parallelism: :mod:`densetrain.parallel.context`).
    Raises: ValueError on indivisible head counts.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, qk_norm: bool = False):
        super().__init__()
        self.qk_norm = qk_norm
        if d_model % n_heads or n_heads % n_kv_heads:
            raise ValueError(
                f"need d_model % n_heads == 0 and n_heads % n_kv_heads == 0, got {d_model}, {n_heads}, {n_kv_heads}"
            )
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = d_model // n_heads
        self.attn_scale: float | None = None
        self.wq = nn.Linear(d_model, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: "KVCache | None" = None,
                layer: int = 0, doc_mask: DocumentMask | None = None, attend=None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, n_heads, T, head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, n_kv_heads, T, head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, n_kv_heads, T, head_dim)
        q = apply_rope(q, cos, sin)  # (B, n_heads, T, head_dim)
        k = apply_rope(k, cos, sin)  # (B, n_kv_heads, T, head_dim)
        if self.qk_norm:  # model.qk_norm: unit-RMS queries and keys per head, no gain (as nanochat)
            q, k = F.rms_norm(q, (self.head_dim,)), F.rms_norm(k, (self.head_dim,))
        if attend is not None:  # e.g. context parallelism: the keys of other ranks' tokens, its own mask
            y = attend(q, k, v, self.attn_scale)  # (B, n_heads, T, head_dim); k, v unrepeated (GQA in the kernel)
            return self.wo(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))  # (B, T, d_model)
        mask = None
        if cache is not None:
            k, v = cache.append(layer, k, v)  # (B, n_kv_heads, S, head_dim): every position so far
            mask = cache.mask  # (B, 1, T, S)
        n_rep = self.n_heads // self.n_kv_heads
        if n_rep > 1:
            # Copy each KV head to its n_rep query heads: index h -> h // n_rep. (SDPA's enable_gqa would
            # avoid the copy, but not every fused backend accepts it; the copy is one activation's worth.)
            k = k.repeat_interleave(n_rep, dim=1)  # (B, n_heads, T, head_dim)
            v = v.repeat_interleave(n_rep, dim=1)  # (B, n_heads, T, head_dim)
        if doc_mask is not None:
            y = doc_mask.attend(q, k, v, self.attn_scale)  # (B, n_heads, T, head_dim), within documents
        elif mask is None:
            y = causal_attention(q, k, v, self.attn_scale)  # (B, n_heads, T, head_dim)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.attn_scale)  # (B, n_heads, T, hd)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, d_model)
        return self.wo(y)  # (B, T, d_model)


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020, "GLU Variants Improve Transformer"): ``w2(silu(w1 x) * w3 x)``.

    w1 is the gate, w3 the up projection, w2 the down projection (HF: gate_proj, up_proj, down_proj).
    Shapes: (..., d_model) -> (..., d_model), hidden width d_ff.
    """

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm transformer block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``.

    Shapes: forward(x (B, T, d_model), cos, sin (T, head_dim)) -> (B, T, d_model).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = Attention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.qk_norm)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.feed_forward = MLP(cfg.d_model, cfg.d_ff)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: "KVCache | None" = None,
                layer: int = 0, doc_mask: DocumentMask | None = None, attend=None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, cache, layer, doc_mask, attend)
        return h + self.feed_forward(self.ffn_norm(h))


class KVCache:
    """Keys and values of the positions seen so far, for incremental (autoregressive) decoding.

    Use: ``cache = KVCache(model, pad, max_len)``; ``model(prompt_ids, cache)`` (prefill, in one call or in
    chunks), then ``model(next_ids (B, 1), cache)`` per new token; each call returns logits of the new
    positions only. The result equals a full forward pass over the whole sequence up to float
    rounding (``tests/test_generative.py``).

    Rows of different lengths are *left*-padded to a common length: row ``b``'s first ``pad[b]``
    slots are padding. Padding keys are masked out of every query of real tokens, and real tokens get
    RoPE positions ``slot - pad[b]`` (0, 1, ...), so a padded row computes what it would alone. (A
    padding query attends to itself only, so that no softmax row is empty and no NaN reaches the
    cache.) Memory: ``2 * n_layers * B * n_kv_heads * max_len * head_dim`` values, allocated per
    layer on first use, in the dtype of the keys.

    Attributes:
        pad: (B,) int64, padding slots at the left of each row.
        length: number of slots filled so far (the same for every row, padding included).
        mask: (B, 1, T, length + T) bool for the current call (True = may attend), set by :meth:`begin`.
    """

    def __init__(self, model: "Transformer", pad: torch.Tensor, max_len: int):
        self.pad = pad.to(device=model.tok_embeddings.weight.device, dtype=torch.long)
        self.max_len = int(max_len)
        self.length = 0
        self.k: list[torch.Tensor | None] = [None] * len(model.layers)
        self.v: list[torch.Tensor | None] = [None] * len(model.layers)
        self.mask: torch.Tensor | None = None

    def begin(self, T: int) -> torch.Tensor:
        """Prepare a call with T new slots: set :attr:`mask`; return their RoPE positions (B, T) int64.

        Raises: ValueError when the cache would exceed ``max_len`` slots.
        """
        if self.length + T > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; cannot add {T} to {self.length}")
        dev = self.pad.device
        q = torch.arange(self.length, self.length + T, device=dev)  # (T,) slots of the new queries
        k = torch.arange(self.length + T, device=dev)  # (S,) slots of all keys
        real = k[None, :] >= self.pad[:, None]  # (B, S) key is not padding
        causal = k[None, :] <= q[:, None]  # (T, S)
        self.mask = (causal[None] & (real[:, None, :] | (k[None, :] == q[:, None])[None])).unsqueeze(1)
        return (q[None, :] - self.pad[:, None]).clamp(min=0)  # (B, T)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new keys/values (B, n_kv_heads, T, head_dim) of ``layer``; return all of them so far,
        (B, n_kv_heads, length + T, head_dim) views into the preallocated buffers."""
        if self.k[layer] is None:
            B, H, _, D = k.shape
            self.k[layer] = k.new_empty(B, H, self.max_len, D)
            self.v[layer] = v.new_empty(B, H, self.max_len, D)
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class Transformer(nn.Module):
    """The decoder LM. ``forward(tokens (B, T) int64) -> logits (B, T, vocab_size)``.

    Logits are float32 when the parameters are fp32 and no autocast is active (under bf16 autocast they
    are bf16; upcast in the loss if needed).

    Construction allocates parameters on the current default device; to build without allocating, do
    ``with torch.device("meta"): m = Transformer(cfg)``, then ``m.to_empty(device=d)`` and
    :func:`densetrain.model.init.init_weights` (which also re-ties tied embeddings, see there).

    Attributes set by the μP init (defaults = standard parameterisation):
        attn_scale: float | None — softmax scale passed to SDPA; None means 1/sqrt(head_dim).
        logit_mult: float — multiplier on the output logits (1.0).
        rope_theta: float — current RoPE base; change it with :meth:`set_rope_theta` or :meth:`set_rope`.
        rope_scaling: RopeScalingConfig — current frequency scaling (type 'none': plain RoPE).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.head_dim = cfg.head_dim
        self.rope_theta = float(cfg.rope_theta)
        self.rope_scaling = dataclasses.replace(cfg.rope_scaling)
        self.logit_mult = 1.0
        self._attn_scale: float | None = None
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.tie_weights()
        # RoPE cache: empty until the first forward, grown to the longest sequence seen. Non-persistent
        # (derived from rope_theta, never checkpointed); zero rows also means to_empty() leaves no garbage.
        self.register_buffer("rope_cos", torch.empty(0, self.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0, self.head_dim), persistent=False)

    # ---- μP hooks ----------------------------------------------------------------------------------

    @property
    def attn_scale(self) -> float | None:
        return self._attn_scale

    @attn_scale.setter
    def attn_scale(self, value: float | None) -> None:
        self._attn_scale = None if value is None else float(value)
        for layer in self.layers:
            layer.attention.attn_scale = self._attn_scale

    def tie_weights(self) -> None:
        """Make ``output.weight`` the same Parameter as ``tok_embeddings.weight`` (both (vocab, d_model)).

        Needed again after ``to_empty`` / device moves that replace Parameters one module at a time.
        """
        self.output.weight = self.tok_embeddings.weight

    # ---- RoPE --------------------------------------------------------------------------------------

    def set_rope_theta(self, theta: float) -> None:
        """Change the RoPE base (e.g. for long-context extension, Xiong et al. 2023) and drop the cos/sin cache.

        Raises: ValueError if theta <= 0.
        """
        if theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {theta}")
        self.rope_theta = float(theta)
        self.reset_rope_cache()

    def set_rope(self, theta: float, scaling: RopeScalingConfig) -> None:
        """Switch to RoPE base ``theta`` with frequency ``scaling`` (a stage's); a no-op (the cos/sin
        cache kept) when both are the current ones. Raises: ValueError if theta <= 0."""
        if float(theta) != self.rope_theta or scaling != self.rope_scaling:
            self.set_rope_theta(theta)
            self.rope_scaling = dataclasses.replace(scaling)

    def reset_rope_cache(self) -> None:
        """Empty the cos/sin cache; the next forward recomputes it on the embedding's device."""
        device = self.rope_cos.device
        self.rope_cos = torch.empty(0, self.head_dim, device=device)
        self.rope_sin = torch.empty(0, self.head_dim, device=device)

    def rope_inv_freq(self) -> torch.Tensor:
        """Current inverse frequencies, (head_dim // 2,) float32, scaled by :attr:`rope_scaling`."""
        return rope_frequencies(self.head_dim, self.rope_theta, self.rope_scaling, self.rope_cos.device)

    def rope_cache(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions 0 .. seq_len-1, each (seq_len, head_dim) float32; grows the cache if needed.

        Inside a compiled forward the tables are computed in the graph instead: assigning the buffers there
        is a side effect whose changed shape fails the next call's guards (a second compile per shape).
        """
        # A pipeline stage may hold no embedding: its tables' device then. Not the buffer otherwise: a compiled
        # forward reading it is guarded on it, and an eager call that grows the tables would recompile it.
        device = (self.tok_embeddings.weight if self.tok_embeddings is not None else self.rope_cos).device
        if torch.compiler.is_compiling():
            return rope_cos_sin(self.head_dim, self.rope_theta, seq_len, device, self.rope_scaling)
        stale = (
            self.rope_cos.shape[0] < seq_len
            or self.rope_cos.device != device
            or self.rope_cos.dtype != torch.float32  # e.g. after model.to(torch.bfloat16)
        )
        if stale:
            self.rope_cos, self.rope_sin = rope_cos_sin(self.head_dim, self.rope_theta, seq_len, device,
                                                        self.rope_scaling)
        return self.rope_cos[:seq_len], self.rope_sin[:seq_len]

    # ---- forward -----------------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, cache: "KVCache | None" = None, doc_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, head=None, attend=None):
        """tokens: (B, T) int64 -> logits (B, T, vocab_size).

        With ``head``, a function ``head(project, h)`` of the model's logits ``project`` (:meth:`project`:
        ``h (n, d_model) -> logits (n, vocab_size)``, logit multiplier and soft-cap included) and the final
        norm's output ``h`` (B, T, d_model), the forward returns what ``head`` returns instead of the logits: the
        chunked cross-entropy (:func:`densetrain.loss.chunked_head_losses`) never builds the whole
        logits. It runs inside the forward, where FSDP2 has the head's parameters gathered.

        With ``attend`` (context parallelism, :class:`densetrain.parallel.context.ContextParallelAttention`)
        every layer's attention is that function's; ``tokens`` are this rank's part of longer sequences,
        ``positions`` (B, T) their RoPE positions, each < ``attend.seq_len``, and ``doc_ids`` is not used
        (``attend`` holds the document mask).

        With ``cache``, ``tokens`` are the next T positions after those already in the cache
        (incremental decoding, see :class:`KVCache`); the cache is extended by T.
        Packed documents (training and validation windows, densetrain/model/masks.py): ``doc_ids``
        (B, T) int64 makes every token attend only within its document; ``positions`` (B, T) int64,
        each < T, are the RoPE positions (restarting per document) instead of 0 .. T-1.
        """
        T = tokens.shape[1]
        doc_mask = None if doc_ids is None or attend is not None else DocumentMask.build(doc_ids)
        if cache is None:
            # positions index a table as long as they are (a pipeline stage under sequence parallelism gets
            # T / tp tokens of hidden states, but whole rows of positions)
            n = attend.seq_len if attend is not None else positions.shape[1] if positions is not None else T
            cos, sin = self.rope_cache(n)  # (n, head_dim) each, float32
            if positions is not None:
                cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # (B, 1, T, head_dim) each
        else:
            pos = cache.begin(T)  # (B, T) RoPE position of each new token
            cos, sin = self.rope_cache(cache.max_len)  # the whole budget at once: one table per generation
            cos, sin = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)  # (B, 1, T, head_dim) each
        # A module without some parts (a pipeline stage, densetrain/parallel/pipeline.py) runs the rest: without
        # the embedding ``tokens`` are hidden states (B, T, d_model); without the head it returns them.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # (B, T, d_model)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, cache, i, doc_mask, attend)  # (B, T, d_model)
        if cache is not None:
            cache.length += T
        if self.output is None:
            return h
        if head is not None:
            return head(self.project, self.norm(h))
        return self.project(self.norm(h))  # (B, T, vocab_size)

    def project(self, h: torch.Tensor, matmul=None) -> torch.Tensor:
        """The model's logits, the one definition every path uses (the training step, plain, chunked or
        vocabulary-parallel; validation, task scoring, generation; the HF export folds the same
        multiplier into ``lm_head``): ``cap * tanh(output(h) * logit_mult / cap)``, the soft-cap only
        when ``model.logit_softcap > 0``, the μP multiplier only when not 1.

        Args:
            h: (..., d_model), the final norm's output.
            matmul: ``h -> h @ output.weight^T`` computed another way (None: ``self.output``, the module
                call, whose tensor-parallel hooks gather the logits). The vocabulary-parallel
                cross-entropy (:mod:`densetrain.parallel.loss_parallel`) passes its own, whose logits
                stay split over the vocabulary (a ``Shard(-1)`` DTensor: the elementwise steps below
                apply to each slice). A tied head is the same matrix either way (``output.weight`` is
                ``tok_embeddings.weight``).
        Returns: logits (..., vocab_size), the dtype of the matmul's result.
        """
        logits = self.output(h) if matmul is None else matmul(h)
        if self.logit_mult != 1.0:
            logits = logits * self.logit_mult
        if self.cfg.logit_softcap > 0:  # model.logit_softcap: cap * tanh(logits / cap), Gemma 2's soft-capping
            logits = self.cfg.logit_softcap * torch.tanh(logits / self.cfg.logit_softcap)
        return logits

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters (shared tensors counted once).

        exclude_embeddings: leave out the input embedding table, which is a lookup without matmul FLOPs
        (so ``6 * num_params(True)`` approximates training FLOPs per token, Kaplan et al. 2020). The output
        projection is a matmul and stays counted — also when it is tied to the embedding table, in which
        case nothing is subtracted.
        """
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings and self.output.weight is not self.tok_embeddings.weight:
            n -= self.tok_embeddings.weight.numel()
        return n
