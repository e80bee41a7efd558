"""Compute-optimal planning after Chinchilla (Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models").

The rule used here is the paper's Approach-1 result in its simplest form:

* training compute ``C ≈ 6 · N · D`` FLOPs for ``N`` parameters and ``D`` training tokens (the paper's
  §3.3 constraint ``FLOPs(N, D) ≈ 6ND``, after Kaplan et al. 2020);
* compute-optimal models scale ``N`` and ``D`` equally (Table 2, Approach 1: ``a = b = 0.50``), at about
  ``D ≈ 20 · N`` tokens per parameter (the ratio of every row of Table 3: 8.0B / 400M = 20,
  20.2B / 1B = 20.2, 205.1B / 10B = 20.5, ...).

Hence ``N = sqrt(C / (6 · 20))`` and ``D = 20 · N``. ``N`` counts *all* parameters including the
embedding tables, as Chinchilla does (Kaplan et al. 2020 counted non-embedding parameters; the difference
explains much of their disagreement, Pearce & Song 2024, "Reconciling Kaplan and Chinchilla Scaling Laws").

:data:`CHINCHILLA_TABLE3` reproduces Table 3 of the paper (Approach 1 projections); the values were checked
against the paper's text (arXiv:2203.15556v1, §3.4). The ``D = 20 N`` rule reproduces every row within 8 %
(the 67B row's 1.5T tokens is rounded in the paper: 5.76e23 / (6 · 67e9) = 1.43T).

Wall time needs a throughput: either a measured/declared ``tokens_per_sec`` (tokens/s of the whole job), or
a peak ``peak_flops`` (FLOP/s of the whole job, all accelerators together) times a model-FLOPs utilisation
``mfu``. Units throughout: FLOPs (floating-point operations, not per second), tokens, parameters, seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

CHINCHILLA_TOKENS_PER_PARAM = 20.0
"""Compute-optimal training tokens per parameter (Hoffmann et al. 2022, Table 3, rounded)."""

FLOPS_PER_PARAM_TOKEN = 6.0
"""Training FLOPs per parameter per token: 2 (forward) + 4 (backward) (Kaplan et al. 2020, §2.1)."""


@dataclass(frozen=True)
class Table3Row:
    """One row of Hoffmann et al. 2022, Table 3: params, training FLOPs, training tokens (as printed)."""

    label: str
    params: float
    flops: float
    tokens: float


CHINCHILLA_TABLE3: tuple[Table3Row, ...] = (
    Table3Row("400 Million", 400e6, 1.92e19, 8.0e9),
    Table3Row("1 Billion", 1e9, 1.21e20, 20.2e9),
    Table3Row("10 Billion", 10e9, 1.23e22, 205.1e9),
    Table3Row("67 Billion", 67e9, 5.76e23, 1.5e12),
    Table3Row("175 Billion", 175e9, 3.85e24, 3.7e12),
    Table3Row("280 Billion", 280e9, 9.90e24, 5.9e12),
    Table3Row("520 Billion", 520e9, 3.43e25, 11.0e12),
    Table3Row("1 Trillion", 1e12, 1.27e26, 21.2e12),
    Table3Row("10 Trillion", 10e12, 1.30e28, 216.2e12),
)
"""Hoffmann et al. 2022, Table 3 ("Estimated optimal training FLOPs and training tokens for various model
sizes", Approach 1). The "FLOPs in Gopher units" column is omitted (Gopher = 5.76e23)."""


# --------------------------------------------------------------------------------------------------
# Core rule
# --------------------------------------------------------------------------------------------------


def optimal_from_flops(flops: float, tokens_per_param: float = CHINCHILLA_TOKENS_PER_PARAM) -> tuple[float, float]:
    """Compute-optimal (params, tokens) for a training budget of ``flops`` FLOPs.

    ``N = sqrt(C / (6 r))``, ``D = r N`` with ``r = tokens_per_param``, so that ``6 N D = C``.
    Raises: ValueError for a non-positive or non-finite budget.
    """
    _positive("flops", flops)
    n = math.sqrt(flops / (FLOPS_PER_PARAM_TOKEN * tokens_per_param))
    return n, tokens_per_param * n


def _positive(name: str, value: float | None) -> None:
    if value is None or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


# --------------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------------


def preset_shapes() -> list[dict]:
    """Every preset in ``densetrain/presets`` with its parameter counts and FLOPs per token.

    Counts come from the real :class:`~densetrain.model.llama.Transformer` built on the ``meta`` device
    (nothing is allocated, so the 8B preset is cheap): ``params`` = all parameters (shared tensors once,
    the Chinchilla count), ``non_embedding_params`` = without the input embedding table
    (``num_params(exclude_embeddings=True)``). ``flops_per_token`` is :func:`densetrain.metrics.flops_per_token`
    at the preset's ``train.seq_len`` (6 x matmul params + attention; the MFU numerator of the training loop).

    Returns: list of ``{"name", "params", "non_embedding_params", "flops_per_token", "seq_len", "d_model",
    "n_layers"}``, sorted by params.
    """
    import torch

    from densetrain.config import list_presets, load_config
    from densetrain.metrics import flops_per_token
    from densetrain.model.llama import Transformer

    out = []
    for name in list_presets():
        cfg = load_config(preset=name)
        with torch.device("meta"):
            model = Transformer(cfg.model)
        out.append({
            "name": name,
            "params": model.num_params(),
            "non_embedding_params": model.num_params(exclude_embeddings=True),
            "flops_per_token": flops_per_token(cfg.model, cfg.train.seq_len),
            "seq_len": cfg.train.seq_len,
            "d_model": cfg.model.d_model,
            "n_layers": cfg.model.n_layers,
        })
    return sorted(out, key=lambda p: p["params"])


def nearest_preset(params: float, presets: list[dict] | None = None) -> dict:
    """The preset whose total parameter count is closest to ``params`` in log space (ratio closest to 1).

    Raises: ValueError if there are no presets or ``params`` is not positive.
    """
    _positive("params", params)
    presets = preset_shapes() if presets is None else presets
    if not presets:
        raise ValueError("no presets found")
    return min(presets, key=lambda p: abs(math.log(p["params"] / params)))


def nearest_table3_row(flops: float) -> Table3Row:
    """The row of :data:`CHINCHILLA_TABLE3` whose budget is closest to ``flops`` in log space."""
    _positive("flops", flops)
    return min(CHINCHILLA_TABLE3, key=lambda r: abs(math.log(r.flops / flops)))


# --------------------------------------------------------------------------------------------------
# The planner
# --------------------------------------------------------------------------------------------------


def plan(
    flops: float | None = None,
    params: float | None = None,
    tokens: float | None = None,
    hours: float | None = None,
    tokens_per_sec: float | None = None,
    peak_flops: float | None = None,
    mfu: float = 0.4,
    tokens_per_param: float = CHINCHILLA_TOKENS_PER_PARAM,
    presets: list[dict] | None = None,
) -> dict:
    """Chinchilla-optimal model size, token count, budget and wall time from one given quantity.

    Give exactly one of:

    * ``flops``: training budget C (FLOPs) -> ``N = sqrt(C / 120)``, ``D = 20 N``;
    * ``params``: N (all parameters) -> ``D = 20 N``, ``C = 6 N D``;
    * ``tokens``: D (training tokens) -> ``N = D / 20``, ``C = 6 N D``;
    * ``hours``: wall-clock hours, with a throughput: ``tokens_per_sec`` gives ``D = tokens_per_sec * 3600 *
      hours`` (the throughput is taken to be that of the planned model), otherwise ``peak_flops * mfu``
      gives ``C = peak_flops * mfu * 3600 * hours``.

    Throughput (optional unless ``hours``): ``tokens_per_sec`` (tokens/s, whole job) wins over
    ``peak_flops`` (FLOP/s, whole job) x ``mfu`` (fraction of peak reached, 0 < mfu <= 1). The effective
    training FLOP/s is ``6 N tokens_per_sec`` or ``peak_flops mfu``; wall time is ``C`` divided by it. When
    both are given the implied MFU ``6 N tokens_per_sec / peak_flops`` is reported.

    The nearest preset (log-distance in total params) is reported with its own Chinchilla-optimal tokens
    ``20 P``, the tokens ``C / (6 P)`` that the given budget buys for it, and a wall time for ``20 P`` tokens
    at the same effective FLOP/s using the preset's exact FLOPs per token (incl. attention).

    Returns:
        dict with ``given`` (the input quantity's name), ``flops``, ``params``, ``tokens``,
        ``tokens_per_param``, ``throughput`` (``{"tokens_per_sec", "flops_per_sec", "mfu", "implied_mfu",
        "source"}`` or None), ``seconds`` / ``hours`` / ``days`` (None without a throughput),
        ``preset`` (dict) and ``table3`` (the nearest :class:`Table3Row` as a dict plus ratios).

    Raises:
        ValueError: not exactly one of flops/params/tokens/hours; a non-positive or non-finite value;
        ``hours`` without a throughput; ``mfu`` outside (0, 1].
    """
    given = {k: v for k, v in (("flops", flops), ("params", params), ("tokens", tokens), ("hours", hours))
             if v is not None}
    if len(given) != 1:
        raise ValueError(
            f"give exactly one of flops, params, tokens, hours; got {', '.join(given) if given else 'none'}"
        )
    (name, value), = given.items()
    _positive(name, value)
    _positive("tokens_per_param", tokens_per_param)
    if tokens_per_sec is not None:
        _positive("tokens_per_sec", tokens_per_sec)
    if peak_flops is not None:
        _positive("peak_flops", peak_flops)
    if not (isinstance(mfu, (int, float)) and 0 < mfu <= 1):
        raise ValueError(f"mfu must be in (0, 1], got {mfu!r}")

    r = tokens_per_param
    if name == "flops":
        n, d = optimal_from_flops(value, r)
    elif name == "params":
        n, d = value, r * value
    elif name == "tokens":
        n, d = value / r, value
    else:  # hours
        if tokens_per_sec is not None:
            d = tokens_per_sec * 3600.0 * value
            n = d / r
        elif peak_flops is not None:
            n, d = optimal_from_flops(peak_flops * mfu * 3600.0 * value, r)
        else:
            raise ValueError("hours needs a throughput: tokens_per_sec, or peak_flops (with mfu)")
    c = FLOPS_PER_PARAM_TOKEN * n * d

    throughput = None
    if tokens_per_sec is not None:
        fps = FLOPS_PER_PARAM_TOKEN * n * tokens_per_sec
        throughput = {
            "tokens_per_sec": tokens_per_sec, "flops_per_sec": fps, "mfu": None,
            "implied_mfu": fps / peak_flops if peak_flops else None, "source": "tokens_per_sec",
        }
    elif peak_flops is not None:
        fps = peak_flops * mfu
        throughput = {
            "tokens_per_sec": fps / (FLOPS_PER_PARAM_TOKEN * n), "flops_per_sec": fps, "mfu": mfu,
            "implied_mfu": None, "source": "peak_flops x mfu",
        }
    seconds = c / throughput["flops_per_sec"] if throughput else None
    if name == "hours":
        seconds = value * 3600.0

    p = dict(nearest_preset(n, presets))
    p["ratio_to_plan"] = p["params"] / n
    p["optimal_tokens"] = r * p["params"]
    p["optimal_flops"] = FLOPS_PER_PARAM_TOKEN * p["params"] * p["optimal_tokens"]
    p["tokens_at_budget"] = c / (FLOPS_PER_PARAM_TOKEN * p["params"])
    p["seconds"] = (
        p["flops_per_token"] * p["optimal_tokens"] / throughput["flops_per_sec"] if throughput else None
    )

    row = nearest_table3_row(c)
    table3 = {
        "label": row.label, "params": row.params, "flops": row.flops, "tokens": row.tokens,
        "params_ratio": n / row.params, "flops_ratio": c / row.flops,
    }
    return {
        "given": name, "value": value, "flops": c, "params": n, "tokens": d, "tokens_per_param": r,
        "throughput": throughput, "seconds": seconds,
        "hours": seconds / 3600.0 if seconds is not None else None,
        "days": seconds / 86400.0 if seconds is not None else None,
        "preset": p, "table3": table3,
    }


# --------------------------------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------------------------------


def human(x: float) -> str:
    """Count with a K/M/B/T suffix: ``1.21e9 -> '1.21B'``."""
    for div, suf in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suf}"
    return f"{x:.3g}"


def human_time(seconds: float) -> str:
    """``'3.2 h (0.13 days)'`` style duration; seconds or minutes when short."""
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    days = seconds / 86400
    return f"{seconds / 3600:.3g} h ({days:.3g} day{'' if days == 1 else 's'})"


def format_plan(result: dict) -> str:
    """Readable multi-line summary of a :func:`plan` result."""
    r = result
    lines = [
        f"Chinchilla-optimal plan (Hoffmann et al. 2022: C = 6 N D, D = {r['tokens_per_param']:g} N), "
        f"from {r['given']}",
        f"  compute   {r['flops']:.3e} FLOPs",
        f"  params    {r['params']:.3e}  ({human(r['params'])}, all parameters incl. embeddings)",
        f"  tokens    {r['tokens']:.3e}  ({human(r['tokens'])})",
    ]
    t = r["throughput"]
    if t:
        src = (
            f"{t['tokens_per_sec']:.4g} tokens/s declared" if t["source"] == "tokens_per_sec"
            else f"peak {t['flops_per_sec'] / t['mfu']:.3g} FLOP/s x mfu {t['mfu']:g}"
        )
        extra = f", implied mfu {t['implied_mfu']:.3f}" if t.get("implied_mfu") else ""
        lines.append(f"  wall time {human_time(r['seconds'])}  at {t['flops_per_sec']:.3g} FLOP/s ({src}{extra})")
    else:
        lines.append("  wall time (give --tokens-per-sec or --peak-flops for an estimate)")
    p = r["preset"]
    lines.append(f"  nearest preset: {p['name']}, {human(p['params'])} params ({p['ratio_to_plan']:.2g}x the plan)")
    lines.append(
        f"            its optimum {human(p['optimal_tokens'])} tokens / {p['optimal_flops']:.2e} FLOPs"
        + (f" ({human_time(p['seconds'])})" if p["seconds"] is not None else "")
        + f"; this budget buys it {human(p['tokens_at_budget'])} tokens"
    )
    tb = r["table3"]
    lines.append(
        f"  paper Table 3 nearest row: {tb['label']} params, {tb['flops']:.3g} FLOPs, {human(tb['tokens'])} tokens "
        f"(plan/row: params {tb['params_ratio']:.3f}, FLOPs {tb['flops_ratio']:.3g})"
    )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Memory and layout planner
# --------------------------------------------------------------------------------------------------

GIB = 1024**3
H100_BF16_DENSE_FLOPS = 989e12
"""Peak dense bf16 FLOP/s of one H100 SXM (NVIDIA datasheet, without sparsity): the default denominator."""

USABLE_FRACTION, RESERVED_GIB = 0.92, 1.0
"""A layout fits when its estimate is at most ``USABLE_FRACTION * memory - RESERVED_GIB`` per GPU: the CUDA
context, NCCL buffers and allocator fragmentation take the rest (a rule of thumb, not a measurement)."""

AC_MODES = ("none", "selective", "full")


def activation_bytes_per_token(m, tp: int = 1, ac: str = "none", act_bytes: int = 2) -> dict:
    """Bytes held for the backward per token of one micro-batch, by part, for densetrain's Llama
    (:mod:`densetrain.model.llama`; eager PyTorch, SDPA without the (T, T) matrix, fp32 residual stream).

    Counted from the tensors autograd saves (``act_bytes`` = 2 under bf16 autocast, 4 in fp32; norm and
    RoPE arithmetic is fp32 whatever the autocast), with ``d = d_model``, ``kv = n_kv_heads * head_dim``,
    ``f = d_ff``, ``V = vocab_size``, ``a = act_bytes``:

    * per block, ``ac='none'``: two RMSNorms ``(4 + 2a) d`` each (fp32 input, cast normalised input,
      matmul input; replicated under TP); attention ``4 a d`` (q, repeated k and v, SDPA output; the
      fused kernels return it in (B, T, H, D) order, so the reshape before ``wo`` is a view; RoPE saves
      only its cos/sin tables, which do not require grad); SwiGLU ``4 a f``; all but the norms divided
      by ``tp``;
    * ``'full'``: the block input ``4 d`` per block, plus one block's ``'none'`` activations (recomputed
      in its backward);
    * ``'selective'``: the block input, the matmul and attention outputs ``a (d + 2 kv + d + 2 f) / tp +
      2 a d`` (wo and w2 outputs are replicated after their all-reduce), plus one block's recomputed rest;
    * head (never checkpointed): final norm ``(4 + 2a) d`` and logits ``(a + 4) V`` (the logits and
      cross-entropy's fp32 log-softmax; gathered, so not divided by ``tp``).

    Returns:
        ``{"per_block", "blocks", "head", "total"}`` in bytes per token; ``blocks`` is all layers.
    Raises:
        ValueError: unknown ``ac``.
    """
    if ac not in AC_MODES:
        raise ValueError(f"activation checkpointing must be one of {AC_MODES}, got '{ac}'")
    d, kv, f, V, L, a = m.d_model, m.n_kv_heads * m.head_dim, m.d_ff, m.vocab_size, m.n_layers, act_bytes
    norms = 2 * (4 + 2 * a) * d
    split = (4 * a * d + 4 * a * f) / tp
    full_block = norms + split
    if ac == "none":
        per_block, blocks = full_block, L * full_block
    elif ac == "full":
        per_block, blocks = 4 * d, L * 4 * d + full_block
    else:
        kept = 4 * d + a * (2 * d + 2 * kv + 2 * f) / tp + 2 * a * d
        per_block, blocks = kept, L * kept + (full_block - kept)
    head = (4 + 2 * a) * d + (a + 4) * V
    return {"per_block": per_block, "blocks": blocks, "head": head, "total": blocks + head}


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


def layout_memory(counts: dict, m, seq_len: int, micro: int, layout, ac: str, mixed_precision: bool = True) -> dict:
    """Estimated bytes per GPU of one layout (an object with ``dp_replicate, dp_shard, tp``) at one stage.

    * parameters fp32, gradients fp32, AdamW's two fp32 moments: ``4 + 4 + 8`` bytes per parameter this
      rank holds: matmul weights and embeddings ``/ tp``, norms whole, all ``/ dp_shard`` (FSDP2);
    * transient (FSDP2 only): the all-gathered parameters of two blocks (the one running and the one
      prefetched) in bf16 (fp32 without mixed precision), one block's unsharded fp32 gradients, and the
      root group's gathered parameters;
    * activations: :func:`activation_bytes_per_token` x ``micro * seq_len`` tokens.

    Returns:
        bytes: ``{"params", "grads", "optim", "transient", "activations", "total"}``.
    """
    tp, shard = layout.tp, layout.dp_shard
    local = (counts["params"] - counts["norm"]) / tp + counts["norm"]
    held = local / shard
    transient = 0.0
    if shard > 1 or (tp > 1 and layout.dp_replicate * shard > 1):
        gathered = 2 if mixed_precision else 4
        transient = (2 * gathered + 4) * counts["block"] / tp + gathered * counts["root"] / tp
    act = activation_bytes_per_token(m, tp, ac, 2 if mixed_precision else 4)["total"] * micro * seq_len
    out = {"params": 4 * held, "grads": 4 * held, "optim": 8 * held, "transient": transient, "activations": act}
    out["total"] = sum(out.values())
    return out


def candidate_layouts(gpus: int, m, gpus_per_node: int = 8) -> list:
    """Layouts of ``gpus`` ranks worth comparing: tensor parallel within a node (a power of two dividing
    ``n_kv_heads``, ``d_ff`` and the vocabulary), then every split of the data-parallel ranks into
    replicas x shards (powers of two and the whole)."""
    from densetrain.parallel.mesh import Layout

    out = []
    tp = 1
    while tp <= min(gpus, gpus_per_node):
        if gpus % tp == 0 and m.n_kv_heads % tp == 0 and m.d_ff % tp == 0 and m.vocab_size % tp == 0:
            dp = gpus // tp
            shards = sorted({s for s in [2**i for i in range(dp.bit_length())] + [dp] if dp % s == 0})
            out += [Layout(dp // s, s, tp) for s in shards]
        tp *= 2
    return out


def layout_plan(cfg, gpus: int, gpu_memory_gib: float, gpu_peak_flops: float = H100_BF16_DENSE_FLOPS,
                mfu: float = 0.4, tokens: float | None = None, params: float | None = None,
                gpus_per_node: int = 8, mixed_precision: bool = True) -> dict:
    """Which layouts of ``gpus`` GPUs of ``gpu_memory_gib`` GiB run every stage of ``cfg``, the suggested
    one, and step time and total days at ``mfu`` of ``gpu_peak_flops`` (FLOP/s per GPU).

    A layout runs a stage when its data-parallel degree divides the stage's batch of sequences into
    whole micro-batches and some activation-checkpointing mode fits the memory (the cheapest that fits
    is chosen: none, then selective, then full). Suggested: the layout that runs every stage with the
    smallest tensor-parallel degree, then the least recomputation, then the fewest shards (less
    communication). Time per step: ``flops_per_token(seq_len) * batch_tokens / (gpus * peak * mfu)``.

    ``tokens`` replaces the run's length (the stages keep their fractions); ``params`` replaces the
    parameter count for the static memory and ``6 N D`` compute (the shape, for activations, stays
    that of ``cfg.model``).

    Returns:
        dict: ``model`` (counts), ``stages`` (name, seq_len, batch, micro, steps, step_s), ``layouts``
        (per layout: per stage ``{"ac", "bytes", "fits", "reason"}``, ``runs_all``), ``suggested``,
        ``configured`` (cfg.parallel resolved, or None), ``days``, ``usable_bytes``, inputs.
    Raises:
        ValueError: non-positive gpus, memory, peak or mfu outside (0, 1].
    """
    from densetrain.metrics import flops_per_token
    from densetrain.parallel.mesh import resolve_layout
    from densetrain.schedule import resolve_stages

    _positive("gpus", gpus)
    _positive("gpu_memory_gib", gpu_memory_gib)
    _positive("gpu_peak_flops", gpu_peak_flops)
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu!r}")
    m = cfg.model
    counts = model_counts(m)
    if params is not None:
        _positive("params", params)
        scale = params / counts["params"]
        counts = {k: v * scale for k, v in counts.items()}
    stages = resolve_stages(cfg)
    total_steps = cfg.train.steps
    run_tokens = sum(st.batch_tokens * (_end(stages, i, total_steps) - st.start_step) for i, st in enumerate(stages))
    step_scale = tokens / run_tokens if tokens else 1.0
    flops_job = gpus * gpu_peak_flops * mfu
    rows = []
    for i, st in enumerate(stages):
        steps = (_end(stages, i, total_steps) - st.start_step) * step_scale
        fpt = 6.0 * params if params is not None else flops_per_token(m, st.seq_len)
        step_s = fpt * st.batch_tokens / flops_job
        rows.append({"name": st.name, "seq_len": st.seq_len, "batch": st.batch_size, "micro": st.micro_batch_size,
                     "batch_tokens": st.batch_tokens, "steps": steps, "step_s": step_s})
    usable = USABLE_FRACTION * gpu_memory_gib * GIB - RESERVED_GIB * GIB
    layouts = []
    for lay in candidate_layouts(gpus, m, gpus_per_node):
        per_stage = []
        for st in rows:
            if st["batch"] % (lay.dp_size * st["micro"]):
                per_stage.append({"ac": None, "bytes": None, "fits": False,
                                  "reason": f"{st['batch']} sequences do not split into {lay.dp_size} data-parallel "
                                            f"ranks x micro-batch {st['micro']}"})
                continue
            best = None
            for ac in AC_MODES:
                b = layout_memory(counts, m, st["seq_len"], st["micro"], lay, ac, mixed_precision)
                best = {"ac": ac, "bytes": b, "fits": b["total"] <= usable, "reason": ""}
                if best["fits"]:
                    break
            if not best["fits"]:
                best["reason"] = f"needs {best['bytes']['total'] / GIB:.1f} GiB even with full recomputation"
            per_stage.append(best)
        layouts.append({"layout": lay, "stages": per_stage, "runs_all": all(s["fits"] for s in per_stage)})
    ok = [x for x in layouts if x["runs_all"]]
    rank = lambda x: (x["layout"].tp, sum(AC_MODES.index(s["ac"]) for s in x["stages"]), x["layout"].dp_shard)
    suggested = min(ok, key=rank) if ok else None
    try:
        p = cfg.parallel
        configured = resolve_layout(p.dp_replicate, p.dp_shard, p.tp, gpus)
    except ValueError:
        configured = None
    seconds = sum(r["steps"] * r["step_s"] for r in rows)
    return {"gpus": gpus, "gpu_memory_gib": gpu_memory_gib, "gpu_peak_flops": gpu_peak_flops, "mfu": mfu,
            "usable_bytes": usable, "model": counts, "stages": rows, "layouts": layouts, "suggested": suggested,
            "configured": configured, "seconds": seconds, "days": seconds / 86400,
            "logit_bytes_per_token": ((2 if mixed_precision else 4) + 4) * m.vocab_size}


def _end(stages, i: int, total_steps: int) -> int:
    return stages[i + 1].start_step if i + 1 < len(stages) else total_steps


def format_layout_plan(r: dict, show: int = 12) -> str:
    """Readable table of a :func:`layout_plan` result: the model, the stages, the suggested layout's
    memory per stage, then every layout with the checkpointing mode per stage (or why it cannot run)."""
    g = lambda b: f"{b / GIB:.1f}"
    c = r["model"]
    lines = [f"model: {human(c['params'])} parameters ({human(c['block'])} per block, {human(c['root'])} embedding"
             f"+head); {r['gpus']} GPUs x {r['gpu_memory_gib']:g} GiB (usable {g(r['usable_bytes'])} GiB each); "
             f"time at mfu {r['mfu']:g} of {r['gpu_peak_flops'] / 1e12:g} TFLOP/s per GPU",
             "stages:"]
    for s in r["stages"]:
        lines.append(f"  {s['name']:<13} seq_len {s['seq_len']:>7}  batch {s['batch']:>5} seqs  micro {s['micro']}  "
                     f"{human(s['steps'])} steps x {s['step_s']:.2f} s = {s['steps'] * s['step_s'] / 86400:.2f} days")
    lines.append(f"total: {r['days']:.1f} days")
    sug = r["suggested"]
    if sug is None:
        lines.append("no layout runs every stage (see the reasons below)")
    else:
        lines.append(f"suggested: {sug['layout']}  (parallel.dp_replicate={sug['layout'].dp_replicate} "
                     f"parallel.dp_shard={sug['layout'].dp_shard} parallel.tp={sug['layout'].tp})")
        lines.append("  stage           ac         params  grads  optim  transient  activations  total GiB/GPU")
        for s, x in zip(r["stages"], sug["stages"]):
            b = x["bytes"]
            lines.append(f"  {s['name']:<15} {x['ac']:<10} {g(b['params']):>6} {g(b['grads']):>6} {g(b['optim']):>6} "
                         f"{g(b['transient']):>10} {g(b['activations']):>12} {g(b['total']):>9}")
    if r["configured"] is not None:
        conf = next((x for x in r["layouts"] if x["layout"] == r["configured"]), None)
        verdict = "not among the candidates" if conf is None else ("runs every stage" if conf["runs_all"] else
                                                                   "does NOT run every stage")
        lines.append(f"configured layout ({r['configured']}): {verdict}")
    lines.append("layouts (activation checkpointing per stage, or why not):")
    for x in r["layouts"][:show] if show else r["layouts"]:
        cells = [f"{s['ac']} {g(s['bytes']['total'])}G" if s["fits"] else f"no: {s['reason']}" for s in x["stages"]]
        lines.append(f"  {'*' if x['runs_all'] else ' '} {str(x['layout']):<40} " + " | ".join(cells))
    if show and len(r["layouts"]) > show:
        lines.append(f"  ... {len(r['layouts']) - show} more (--all-layouts)")
    for i, s in enumerate(r["stages"]):
        tried = [x["stages"][i] for x in r["layouts"] if x["stages"][i]["bytes"] is not None]
        if tried and not any(t["fits"] for t in tried):
            low = min(tried, key=lambda t: t["bytes"]["total"])["bytes"]
            logits = r["logit_bytes_per_token"] * s["seq_len"] * s["micro"]
            lines.append(f"stage '{s['name']}' fits no layout: the least memory is {g(low['total'])} GiB per GPU, of "
                         f"which the logits and their fp32 log-softmax are {g(logits)} GiB (gathered on every "
                         f"tensor-parallel rank, so no layout splits them); it needs a chunked or loss-parallel "
                         f"cross-entropy (not implemented), more memory per GPU, or a shorter seq_len")
    return "\n".join(lines)
