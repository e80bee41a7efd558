"""The memory model of one GPU: parameters, gradients, optimizer state, FSDP2's transient gathers and the
activations autograd keeps, per layout and stage (bytes; the layout planner's arithmetic).

A layout is an object with ``dp_replicate, dp_shard, tp`` and ``cp`` (a
:class:`~densetrain.parallel.mesh.Layout`). Symbols: ``d = d_model``, ``kv = n_kv_heads * head_dim``,
``f = d_ff``, ``V = vocab_size``, ``L = n_layers``, ``a`` = bytes of an activation (2 under bf16 autocast,
4 in fp32; norm and RoPE arithmetic is fp32 whatever the autocast).
"""

from __future__ import annotations

from densetrain.loss import LOGIT_CHUNK_ELEMENTS, chunk_tokens_for

GIB = 1024**3

USABLE_FRACTION, RESERVED_GIB = 0.92, 1.0
"""A layout fits when its estimate is at most ``USABLE_FRACTION * memory - RESERVED_GIB`` per GPU: the CUDA
context, NCCL buffers and allocator fragmentation take the rest (a rule of thumb, not a measurement)."""

AC_MODES = ("none", "selective", "full")


def activation_bytes_per_token(m, tp: int = 1, ac: str = "none", act_bytes: int = 2, cp: int = 1,
                               sequence_parallel: bool = False, chunked_loss: bool = False,
                               loss_parallel: bool = False) -> dict:
    """Bytes held for the backward per token this rank computes, by part, for densetrain's Llama
    (:mod:`densetrain.model.llama`; eager PyTorch, SDPA without the (T, T) matrix, fp32 residual stream).

    Counted from the tensors autograd saves:

    * per block, ``ac='none'``: two RMSNorms ``(4 + 2a) d`` each (fp32 input, cast normalised input,
      matmul input; replicated under TP unless ``sequence_parallel``, then split by ``tp``); attention
      ``4 a d / tp`` (q, repeated k and v, SDPA output; RoPE saves only its cos/sin tables); SwiGLU
      ``4 a f / tp``;
    * context parallel (``cp > 1``, :mod:`densetrain.parallel.context`): q and the output stay local,
      ``2 a d / tp``; the keys and values of the *whole* sequence are gathered from the cp ranks and
      kept unrepeated (GQA inside the kernel), ``2 a kv cp / tp`` per local token;
    * ``'full'``: the block input ``4 d`` per block (``/ tp`` with sequence parallelism), plus one
      block's ``'none'`` activations (recomputed in its backward);
    * ``'selective'``: the block input, the matmul, attention and all-gather outputs ``a (d + 2 kv + d
      + 2 f) / tp + 2 a d`` (wo and w2 outputs, replicated after their all-reduce, or ``/ tp``
      reduce-scattered under sequence parallelism), plus one block's recomputed rest;
    * head (never checkpointed): final norm ``(4 + 2a) d`` (gathered before it under sequence
      parallelism); the logits and cross-entropy's fp32 log-softmax ``(a + 4) V`` (gathered, so not
      divided by ``tp``, unless ``loss_parallel``: ``V / tp``), or with ``chunked_loss`` only the
      per-token loss and ``log Z``, 8 bytes (the chunk's logits are in :func:`loss_chunk_bytes`).

    Returns:
        ``{"per_block", "blocks", "head", "total"}`` in bytes per token; ``blocks`` is all layers.
    Raises:
        ValueError: unknown ``ac``.
    """
    if ac not in AC_MODES:
        raise ValueError(f"activation checkpointing must be one of {AC_MODES}, got '{ac}'")
    d, kv, f, V, L, a = m.d_model, m.n_kv_heads * m.head_dim, m.d_ff, m.vocab_size, m.n_layers, act_bytes
    sp = tp if sequence_parallel else 1
    norms = 2 * (4 + 2 * a) * d / sp
    attention = 4 * a * d if cp == 1 else 2 * a * d + 2 * a * kv * cp
    full_block = norms + (attention + 4 * a * f) / tp
    block_input = 4 * d / sp
    if ac == "none":
        per_block, blocks = full_block, L * full_block
    elif ac == "full":
        per_block, blocks = block_input, L * block_input + full_block
    else:
        gathered = 2 * a * kv * (cp - 1) if cp > 1 else 0  # all-gather outputs are saved, like matmul outputs
        kept = block_input + (a * (2 * d + 2 * kv + 2 * f) + gathered) / tp + 2 * a * d / sp
        per_block, blocks = kept, L * kept + (full_block - kept)
    head = (4 + 2 * a) * d + (8 if chunked_loss else (a + 4) * V / (tp if loss_parallel else 1))
    return {"per_block": per_block, "blocks": blocks, "head": head, "total": blocks + head}


def loss_chunk_bytes(m, act_bytes: int = 2, vocab_split: int = 1) -> float:
    """Bytes of the chunked cross-entropy's one live chunk (:data:`densetrain.loss.LOGIT_CHUNK_ELEMENTS`
    logits of the ``vocab_size / vocab_split`` this rank computes): the projection's output (``a``), its
    fp32 copy and the fp32 gradient of the logits."""
    vocab = m.vocab_size // vocab_split
    return max(1, LOGIT_CHUNK_ELEMENTS // vocab) * vocab * (act_bytes + 8)


def model_counts(m) -> dict:
    """Parameter counts of ``m`` (a ModelConfig) from the real model built on the meta device: ``params``
    (shared once), ``norm`` (RMSNorm gains: replicated under TP), ``block`` (one block), ``root``
    (embedding, final norm and head: FSDP2's root group)."""
    import torch

    from densetrain.model.llama import Transformer

    with torch.device("meta"):
        model = Transformer(m)
    total = model.num_params()
    norm = sum(p.numel() for n, p in model.named_parameters() if n.endswith("norm.weight"))
    block = sum(p.numel() for p in model.layers[0].parameters())
    return {"params": total, "norm": norm, "block": block, "root": total - m.n_layers * block}


def layout_memory(counts: dict, m, seq_len: int, micro: int, layout, ac: str, mixed_precision: bool = True,
                  sequence_parallel: bool = False, chunked_loss: bool | None = None,
                  loss_parallel: bool = True) -> dict:
    """Estimated bytes per GPU of one layout at one stage.

    * parameters fp32, gradients fp32, AdamW's two fp32 moments: ``4 + 4 + 8`` bytes per parameter this
      rank holds: matmul weights and embeddings ``/ tp``, norms whole, all ``/ (dp_shard * cp)``
      (FSDP2 shards over the shard and context-parallel ranks);
    * transient (FSDP2 only): the all-gathered parameters of two blocks (the one running and the one
      prefetched) in bf16 (fp32 without mixed precision), one block's unsharded fp32 gradients, and the
      root group's gathered parameters;
    * activations: :func:`activation_bytes_per_token` x ``micro * seq_len / cp`` tokens, plus the chunked
      cross-entropy's live chunk (:func:`loss_chunk_bytes`).

    ``chunked_loss`` None: chunked where the trainer chunks (:func:`densetrain.loss.chunk_tokens_for` of
    the micro-batch's local tokens and the vocabulary slice of a rank). ``loss_parallel`` (the trainer's
    default under ``tp > 1``): each rank holds logits of ``vocab_size / tp`` ids only.

    Returns:
        bytes: ``{"params", "grads", "optim", "transient", "activations", "total"}`` and ``chunked_loss``.
    """
    tp, cp, shard = layout.tp, getattr(layout, "cp", 1), layout.dp_shard
    local = (counts["params"] - counts["norm"]) / tp + counts["norm"]
    held = local / (shard * cp)
    transient = 0.0
    if shard * cp > 1 or (tp > 1 and layout.dp_replicate * shard > 1):
        gathered = 2 if mixed_precision else 4
        transient = (2 * gathered + 4) * counts["block"] / tp + gathered * counts["root"] / tp
    a = 2 if mixed_precision else 4
    tokens = micro * seq_len / cp
    split = tp if loss_parallel else 1
    if chunked_loss is None:
        chunked_loss = chunk_tokens_for(m.vocab_size // split, int(tokens)) > 0
    act = activation_bytes_per_token(m, tp, ac, a, cp, sequence_parallel, chunked_loss,
                                     loss_parallel)["total"] * tokens
    if chunked_loss:
        act += loss_chunk_bytes(m, a, split)
    out = {"params": 4 * held, "grads": 4 * held, "optim": 8 * held, "transient": transient, "activations": act}
    out["total"] = sum(out.values())
    out["chunked_loss"] = chunked_loss
    return out
