"""The memory model of one GPU: parameters, gradients, optimizer state, FSDP2's transient gathers and the
activations autograd keeps, per layout and stage (bytes; the layout planner's arithmetic).

A layout is an object with ``dp_replicate, dp_shard, tp``, ``cp`` and ``pp`` (a
:class:`~densetrain.parallel.mesh.Layout`). Under pipeline parallelism (``pp > 1``) the numbers are those
of the pipeline rank that needs the most (:func:`pipeline_ranks`). Symbols: ``d = d_model``,
``kv = n_kv_heads * head_dim``, ``f = d_ff``, ``V = vocab_size``, ``L = n_layers``, ``a`` = bytes of an
activation (2 under bf16 autocast, 4 in fp32; norm and RoPE arithmetic is fp32 whatever the autocast).
"""

from __future__ import annotations

from densetrain.cost import bubble_share
from densetrain.errors import ConfigError
from densetrain.loss import LOGIT_CHUNK_ELEMENTS, chunk_tokens_for
from densetrain.parallel.pipeline import rank_stages, resolve_microbatches, split_stages

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


def pipeline_ranks(counts: dict, m, pp: int, virtual: int = 1, layers_per_stage: int = 0) -> list[dict]:
    """What each pipeline rank holds (:func:`densetrain.parallel.pipeline.split_stages`, rank ``r`` holding
    stages ``r, r + pp, ...``): ``{"rank", "stages", "blocks", "embedding", "head", "params", "norm"}``
    (parameter counts; ``norm``: its RMSNorm gains, whole under TP). One entry (everything) when ``pp`` is 1."""
    parts = split_stages(m.n_layers, pp * virtual, layers_per_stage) if pp > 1 else None
    emb, head = m.vocab_size * m.d_model, m.vocab_size * m.d_model + m.d_model
    if m.tie_embeddings:
        head -= m.vocab_size * m.d_model
    out = []
    for r in range(pp):
        ps = [parts[s] for s in rank_stages(r, pp, virtual)] if parts else None
        blocks = sum(len(p.layers) for p in ps) if ps else m.n_layers
        has_emb, has_head = (any(p.embedding for p in ps), any(p.head for p in ps)) if ps else (True, True)
        params = blocks * counts["block"] + has_emb * emb + has_head * head
        out.append({"rank": r, "stages": [p.index for p in ps] if ps else [0], "blocks": blocks,
                    "embedding": has_emb, "head": has_head, "params": params,
                    "norm": blocks * 2 * m.d_model + has_head * m.d_model})
    return out


IN_FLIGHT_NOTE = ("micro-batches whose activations a pipeline rank holds at once: all of them under GPipe; "
                  "pp - rank under 1F1B (Narayanan et al. 2021, sec. 2.2.1); times 1 + (pp - 1) / (pp v) under "
                  "the interleaved schedule (ibid. sec. 2.2.2)")


def in_flight(schedule: str, pp: int, rank: int, microbatches: int, virtual: int = 1) -> float:
    """Micro-batches of activations pipeline rank ``rank`` holds at its peak (:data:`IN_FLIGHT_NOTE`)."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(microbatches)
    n = float(min(microbatches, pp - rank))
    return min(n * (1 + (pp - 1) / (pp * virtual)), microbatches) if schedule == "interleaved_1f1b" else n


def p2p_bytes(m, seq_len: int, micro: int, layout, n_micro: int, virtual: int = 1, act_bytes: int = 2) -> float:
    """Point-to-point bytes a pipeline rank sends per optimizer step: each of its ``n_micro`` micro-batches'
    activations (micro, seq_len / cp, d_model) forward and their gradients back, once per stage it holds
    (the first and last stage send one way only, counted as both: an upper bound); 0 without pipelining."""
    if layout.pp == 1:
        return 0.0
    return 2.0 * virtual * n_micro * micro * seq_len / layout.cp * m.d_model * act_bytes


def layout_memory(counts: dict, m, seq_len: int, micro: int, layout, ac: str, mixed_precision: bool = True,
                  sequence_parallel: bool = False, chunked_loss: bool | None = None,
                  loss_parallel: bool = True, pipeline: dict | None = None, pp_rank: int | None = None) -> dict:
    """Estimated bytes per GPU of one layout at one stage.

    * parameters fp32, gradients fp32, AdamW's two fp32 moments: ``4 + 4 + 8`` bytes per parameter this
      rank holds: matmul weights and embeddings ``/ tp``, norms whole, all ``/ (dp_shard * cp)``
      (FSDP2 shards over the shard and context-parallel ranks);
    * transient (FSDP2 only): the all-gathered parameters of two blocks (the one running and the one
      prefetched) in bf16 (fp32 without mixed precision), one block's unsharded fp32 gradients, and the
      root group's gathered parameters; under pipeline parallelism all of the rank's blocks stay gathered
      between a micro-batch's forward and its backward (densetrain/parallel/parallelize.py does not reshard
      them, as torchtitan does not), and, under ``pipeline["grad_sync"]`` "last" (the default), all of their
      gradients stay unsharded in fp32 until the step's last backward (torch.distributed.pipelining's
      ``PipelineStage.backward_maybe_with_nosync`` sets ``set_requires_gradient_sync(False)`` and
      ``set_reshard_after_backward(False)`` on an FSDP2 stage for every backward but the last; FSDP2 keeps
      the accumulated gradient in the policy's fp32 ``reduce_dtype``, ``FSDPParam.to_accumulated_grad_if_needed``):
      ``(2 + 4)`` bytes per parameter the rank holds (``4 + 4`` without mixed precision), ``/ tp``;
      with ``pipeline["grad_sync"] == "microbatch"`` (``parallel.pp_grad_sync``,
      :func:`densetrain.parallel.pipeline.reduce_scatter_backward`) FSDP2 reduce-scatters every micro-batch,
      and the fp32 gradient bytes held unsharded at once are ``v + 1`` blocks' (the one computed, and the flat
      reduce-scatter input of the last group reduced, which FSDP2 keeps until the next reduction, one per
      stage module of the rank: ``v`` the virtual stages) plus the rank's root group's (embedding, final
      norm, head: FSDP2 reduces that group when the stage's backward ends, so the last stage's head gradient
      waits through all of its blocks): ``2`` (``4``) bytes per parameter the rank holds plus ``4 ((v + 1)
      block + root)``, ``/ tp`` (measured on gloo ranks: tests/test_pipeline_grad_sync.py);
    * activations: :func:`activation_bytes_per_token` x ``micro * seq_len / cp`` tokens, plus the chunked
      cross-entropy's live chunk (:func:`loss_chunk_bytes`); under pipeline parallelism the rank's blocks
      (and head, on the last stage) only, times the micro-batches it holds at once (:func:`in_flight`).

    ``chunked_loss`` None: chunked where the trainer chunks (:func:`densetrain.loss.chunk_tokens_for` of
    the micro-batch's local tokens and the vocabulary slice of a rank). ``loss_parallel`` (the trainer's
    default under ``tp > 1``): each rank holds logits of ``vocab_size / tp`` ids only. ``pipeline``
    (``layout.pp > 1``): ``{"schedule", "virtual", "microbatches", "layers_per_stage", "grad_sync"}`` (absent
    keys: "1f1b", 1, 1, 0, "last"); the pipeline rank with the largest total is reported (``pp_rank``, its
    ``in_flight`` micro-batches), or pipeline rank ``pp_rank`` when given.

    Returns:
        bytes: ``{"params", "grads", "optim", "transient", "activations", "total"}``, ``chunked_loss``, and
        under pipeline parallelism ``pp_rank`` and ``in_flight``.
    """
    tp, cp, shard, pp = layout.tp, getattr(layout, "cp", 1), layout.dp_shard, getattr(layout, "pp", 1)
    pipe = pipeline or {}
    virtual = pipe.get("virtual", 1) if pp > 1 else 1
    a = 2 if mixed_precision else 4
    tokens = micro * seq_len / cp
    split = tp if loss_parallel and pp == 1 else 1  # the pipelined step gathers the logits (parallel/pipeline.py)
    if chunked_loss is None:
        chunked_loss = pp == 1 and chunk_tokens_for(m.vocab_size // split, int(tokens)) > 0
    per_token = activation_bytes_per_token(m, tp, ac, a, cp, sequence_parallel, chunked_loss, split > 1)
    extra = per_token["blocks"] - m.n_layers * per_token["per_block"]  # one block recomputed at a time
    fsdp = shard * cp > 1 or ((tp > 1 or pp > 1) and layout.dp_replicate * shard > 1)
    gathered = 2 if mixed_precision else 4
    best = None
    ranks = pipeline_ranks(counts, m, pp, virtual, pipe.get("layers_per_stage", 0))
    if pp_rank is not None:
        ranks = [ranks[pp_rank]]
    elif pp > 2:  # the first (most micro-batches in flight), the last (head, logits) and the one with most blocks
        ranks = [ranks[0], ranks[-1], max(ranks, key=lambda r: r["params"])]
    for r in ranks:
        local = (r["params"] - r["norm"]) / tp + r["norm"]
        held = local / (shard * cp)
        transient = 0.0
        if fsdp and pp == 1:
            transient = (2 * gathered + 4) * counts["block"] / tp + gathered * counts["root"] / tp
        elif fsdp and pipe.get("grad_sync", "last") == "microbatch":  # gathered; v + 1 blocks' and the root's grads
            root = r["params"] - r["blocks"] * counts["block"]
            transient = gathered * local + 4 * ((virtual + 1) * counts["block"] + root) / tp
        elif fsdp:  # the rank's parameters gathered and its gradients unsharded in fp32 across micro-batches
            transient = gathered * local + 4 * local
        flight = in_flight(pipe.get("schedule", "1f1b"), pp, r["rank"], pipe.get("microbatches", 1), virtual)
        one = r["blocks"] * per_token["per_block"] + (per_token["head"] if r["head"] else 0.0)
        act = (flight * one + extra) * tokens
        if chunked_loss and r["head"]:
            act += loss_chunk_bytes(m, a, split)
        out = {"params": 4 * held, "grads": 4 * held, "optim": 8 * held, "transient": transient, "activations": act}
        out["total"] = sum(out.values())
        out["chunked_loss"] = chunked_loss
        if pp > 1:
            out.update(pp_rank=r["rank"], in_flight=flight)
        if best is None or out["total"] > best["total"]:
            best = out
    return best


def pipeline_fit(layout, batch: int, micro: int, parallel) -> tuple[dict | None, str]:
    """The pipeline settings of ``layout`` at a stage of ``batch`` sequences in micro-batches of ``micro``:
    ``({"schedule", "virtual", "microbatches", "n_micro", "layers_per_stage", "grad_sync", "bubble"}, "")``, or
    ``(None, reason)`` when a rank would have fewer micro-batches than stages. ``({}, "")`` without pipelining.
    ``parallel``: the config's ParallelConfig (schedule, virtual stages, micro-batch count, split, pp_grad_sync)."""
    if layout.pp == 1:
        return {}, ""
    virtual = parallel.pp_virtual_stages if parallel.pp_schedule == "interleaved_1f1b" else 1
    n_micro = batch // (layout.dp_size * micro)
    try:
        m = resolve_microbatches(parallel.pp_microbatches, layout.pp, virtual, n_micro)
    except ConfigError:
        return None, f"{n_micro} micro-batches per rank, fewer than pp = {layout.pp} stages"
    return {"schedule": parallel.pp_schedule, "virtual": virtual, "microbatches": m, "n_micro": n_micro,
            "layers_per_stage": parallel.pp_layers_per_stage, "grad_sync": parallel.pp_grad_sync,
            "bubble": bubble_share(layout.pp, m, virtual, parallel.pp_schedule)}, ""
