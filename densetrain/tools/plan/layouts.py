"""Which parallel layouts of a number of GPUs run every stage of a config, and how long the run takes."""

from __future__ import annotations

from densetrain.tools.plan.chinchilla import _positive
from densetrain.tools.plan.memory import (
    AC_MODES,
    GIB,
    RESERVED_GIB,
    USABLE_FRACTION,
    layout_memory,
    model_counts,
    p2p_bytes,
    pipeline_fit,
)

H100_BF16_DENSE_FLOPS = 989e12
"""Peak dense bf16 FLOP/s of one H100 SXM (NVIDIA datasheet, without sparsity): the default denominator."""

MAX_CP = 32
"""Largest context-parallel degree the planner tries (Llama 3 ran 128K tokens at cp 16, Dubey et al. 2024,
sec. 3.3.2)."""

RECOMPUTE_FACTOR = {"none": 1.0, "selective": 1.0, "full": 4.0 / 3.0}
"""Compute per step relative to no recomputation: full checkpointing runs each block's forward twice (8 of 6
units of ``6 N`` FLOPs per token, Korthikanti et al. 2022 sec. 5); selective recomputes pointwise ops only
(counted as free)."""

PUBLISHED = {
    # Llama 3 report (Dubey et al. 2024) sec. 3.3.2, Table 4: 405B on 16,384 H100s, TP 8, PP 16, DP 128
    # (CP 1) at 8K; for the 128K stage CP 16 and DP 8.
    ("llama3-405b", 16384): ("Meta's published layout (Llama 3 report, Table 4)",
                             lambda seq_len: (8, 16, 16, 8) if seq_len >= 131072 else (8, 16, 1, 128)),
}
"""Published layouts to print beside the planner's: ``(preset, gpus) -> (source, seq_len -> (tp, pp, cp, dp))``."""


def candidate_layouts(gpus: int, m, gpus_per_node: int = 8, seq_lens: tuple[int, ...] = (),
                      max_pp: int = 1) -> list:
    """Layouts of ``gpus`` ranks worth comparing: pipeline stages (a power of two up to ``max_pp`` and
    ``n_layers + 2``), tensor parallel within a node (a power of two dividing ``n_kv_heads``, ``d_ff`` and the
    vocabulary), context parallel (a power of two up to :data:`MAX_CP` with every stage's seq_len a multiple
    of ``2 cp``: the load-balanced chunks), then every split of the data-parallel ranks into replicas x
    shards (powers of two and the whole)."""
    from densetrain.parallel.mesh import Layout

    out = []
    pp = 1
    while pp <= min(max_pp, m.n_layers + 2, gpus):
        per_stage = gpus // pp
        tp = 1
        while gpus % pp == 0 and tp <= min(per_stage, gpus_per_node):
            if per_stage % tp == 0 and m.n_kv_heads % tp == 0 and m.d_ff % tp == 0 and m.vocab_size % tp == 0:
                cp = 1
                while cp <= min(MAX_CP, per_stage // tp):
                    if (per_stage // tp) % cp == 0 and (cp == 1 or all(t % (2 * cp) == 0 for t in seq_lens)):
                        dp = per_stage // (tp * cp)
                        shards = sorted({s for s in [2**i for i in range(dp.bit_length())] + [dp] if dp % s == 0})
                        out += [Layout(dp // s, s, tp, cp, pp) for s in shards]
                    cp *= 2
            tp *= 2
        pp *= 2
    return out


def layout_plan(cfg, gpus: int, gpu_memory_gib: float, gpu_peak_flops: float = H100_BF16_DENSE_FLOPS,
                mfu: float = 0.4, tokens: float | None = None, params: float | None = None,
                gpus_per_node: int = 8, mixed_precision: bool = True, sequence_parallel: bool = False,
                max_pp: int = 64, preset: str | None = None) -> dict:
    """Which layouts of ``gpus`` GPUs of ``gpu_memory_gib`` GiB run every stage of ``cfg``, the suggested
    one, and step time and total days at ``mfu`` of ``gpu_peak_flops`` (FLOP/s per GPU).

    A layout runs a stage when its data-parallel degree divides the stage's batch of sequences into whole micro-
    batches (under pipeline parallelism, at least ``pp`` of them per rank: :func:`~densetrain.tools.plan.memory.
    pipeline_fit`, with the config's ``parallel.pp_schedule``, virtual stages and micro-batch count) and some
    activation-checkpointing mode fits the memory (the cheapest that fits is chosen: none, then
    selective, then full). The cross-entropy is chunked where the trainer chunks it
    (:func:`densetrain.loss.chunk_tokens_for`) and vocabulary-parallel under ``tp > 1`` (the trainer's
    ``parallel.loss_parallel`` default); ``sequence_parallel`` (off, the trainer's default) splits the norm
    regions of layouts with ``tp > 1`` by ``tp``. Suggested: the layout that runs every stage with the smallest
    model-parallel degree ``tp * cp * pp``, then the least recomputation, then the fewest pipeline stages (a
    bubble), then the smallest ``cp`` (its K/V all-
    gather grows with the sequence; Llama 3 used it only for the long stage), then the fewest shards (less
    communication). Per stage, ``best`` is the layout the same rule picks for that stage alone. Time per step:
    ``flops_per_token(seq_len) * batch_tokens / (gpus * peak * mfu)`` (the stage rows); each layout's ``days``
    also counts its recomputation (:data:`RECOMPUTE_FACTOR`) and its pipeline bubble (time / (1 - bubble)).

    ``preset``: the preset's name, for a published layout of it to print beside (:data:`PUBLISHED`).

    ``tokens`` replaces the run's length (the stages keep their fractions); ``params`` replaces the
    parameter count for the static memory and ``6 N D`` compute (the shape, for activations, stays
    that of ``cfg.model``).

    Returns:
        dict: ``model`` (counts), ``stages`` (name, seq_len, batch, micro, steps, step_s, tokens, days,
        best), ``layouts`` (per layout: per stage ``{"ac", "bytes", "fits", "reason"}``, ``runs_all``),
        ``suggested``, ``tokens`` (the run's total),
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
                     "batch_tokens": st.batch_tokens, "steps": steps, "step_s": step_s,
                     "tokens": steps * st.batch_tokens, "days": steps * step_s / 86400})
    usable = USABLE_FRACTION * gpu_memory_gib * GIB - RESERVED_GIB * GIB
    layouts = []
    for lay in candidate_layouts(gpus, m, gpus_per_node, tuple(r["seq_len"] for r in rows), max_pp):
        sp = sequence_parallel and lay.tp > 1
        per_stage = [stage_fit(counts, m, st, lay, cfg.parallel, usable, mixed_precision, sp) for st in rows]
        layouts.append({"layout": lay, "stages": per_stage, "runs_all": all(s["fits"] for s in per_stage),
                        "days": layout_days(rows, per_stage)})
    def rank(x, stages):
        lay = x["layout"]
        return (lay.tp * lay.cp * lay.pp, sum(AC_MODES.index(x["stages"][i]["ac"]) for i in stages), lay.pp, lay.cp,
                lay.dp_shard)

    every = range(len(rows))
    ok = sorted((x for x in layouts if x["runs_all"]), key=lambda x: rank(x, every))
    suggested = ok[0] if ok else None
    for i, row in enumerate(rows):
        fits = [x for x in layouts if x["stages"][i]["fits"]]
        row["best"] = min(fits, key=lambda x: rank(x, [i]))["layout"] if fits else None
    try:
        p = cfg.parallel
        configured = resolve_layout(p.dp_replicate, p.dp_shard, p.tp, gpus, p.cp, p.pp)
    except ValueError:
        configured = None
    seconds = sum(r["steps"] * r["step_s"] for r in rows)
    return {"gpus": gpus, "gpu_memory_gib": gpu_memory_gib, "gpu_peak_flops": gpu_peak_flops, "mfu": mfu,
            "usable_bytes": usable, "model": counts, "stages": rows, "layouts": layouts, "suggested": suggested,
            "running": ok, "configured": configured, "seconds": seconds, "days": seconds / 86400,
            "tokens": sum(r["tokens"] for r in rows), "mixed_precision": mixed_precision,
            "published": published_layout(cfg, rows, counts, gpus, usable, preset, mixed_precision),
            "logit_bytes_per_token": ((2 if mixed_precision else 4) + 4) * m.vocab_size}


def stage_fit(counts: dict, m, st: dict, lay, parallel, usable: float, mixed_precision: bool = True,
              sp: bool = False) -> dict:
    """Whether layout ``lay`` runs stage row ``st`` (of :func:`layout_plan`): ``{"ac", "bytes", "fits",
    "reason"}`` with the cheapest activation checkpointing that fits, plus ``pipeline`` (its settings and
    ``p2p_bytes`` per step, under pipeline parallelism)."""
    if st["batch"] % (lay.dp_size * st["micro"]):
        return {"ac": None, "bytes": None, "fits": False,
                "reason": f"{st['batch']} sequences do not split into {lay.dp_size} data-parallel ranks x "
                          f"micro-batch {st['micro']}"}
    pipe, why = pipeline_fit(lay, st["batch"], st["micro"], parallel)
    if pipe is None:
        return {"ac": None, "bytes": None, "fits": False, "reason": why}
    if pipe:
        pipe["p2p_bytes"] = p2p_bytes(m, st["seq_len"], st["micro"], lay, pipe["n_micro"], pipe["virtual"],
                                      2 if mixed_precision else 4) / (lay.tp if sp else 1)  # SP: a 1/tp slice
    best = None
    for ac in AC_MODES:
        b = layout_memory(counts, m, st["seq_len"], st["micro"], lay, ac, mixed_precision, sp, pipeline=pipe)
        best = {"ac": ac, "bytes": b, "fits": b["total"] <= usable, "reason": "", "pipeline": pipe}
        if best["fits"]:
            break
    if not best["fits"]:
        best["reason"] = f"needs {best['bytes']['total'] / GIB:.1f} GiB even with full recomputation"
    return best


def layout_days(rows: list[dict], per_stage: list[dict]) -> float | None:
    """Days of the whole run on one layout: each stage's time times its recomputation factor, over one minus
    its pipeline bubble; None when the layout does not run every stage."""
    if not all(s["fits"] for s in per_stage):
        return None
    total = 0.0
    for row, s in zip(rows, per_stage):
        bubble = s["pipeline"].get("bubble", 0.0) if s.get("pipeline") else 0.0
        total += row["days"] * RECOMPUTE_FACTOR[s["ac"]] / (1 - bubble)
    return total


def published_layout(cfg, rows: list[dict], counts: dict, gpus: int, usable: float, preset: str | None,
                     mixed_precision: bool = True) -> dict | None:
    """A published layout for ``(preset, gpus)`` (:data:`PUBLISHED`) evaluated like the planner's own, per stage
    (its layout may change between stages), with sequence parallelism: ``{"source", "stages": [stage_fit
    results, each with its "layout"], "days"}``, or None."""
    from densetrain.parallel.mesh import Layout

    entry = PUBLISHED.get((preset, gpus))
    if entry is None:
        return None
    source, at = entry
    stages = []
    for st in rows:
        tp, pp, cp, dp = at(st["seq_len"])
        lay = Layout(1, dp, tp, cp, pp)
        # Megatron-style tensor parallel with sequence parallelism (the norm regions split by tp)
        stages.append({**stage_fit(counts, cfg.model, st, lay, cfg.parallel, usable, mixed_precision, tp > 1),
                       "layout": lay})
    return {"source": source, "stages": stages, "days": layout_days(rows, stages)}


def _end(stages, i: int, total_steps: int) -> int:
    return stages[i + 1].start_step if i + 1 < len(stages) else total_steps


