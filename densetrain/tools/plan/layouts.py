"""Which parallel layouts of a number of GPUs run each stage of a config, ranked by the cost model's predicted step
time (:mod:`densetrain.cost`), and how long the run takes."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

from densetrain.cost import Hardware, flops_per_token, load_hardware, parallel_of, step_time
from densetrain.cost.flops import block_matmul_params
from densetrain.cost.step import PP_GRAD_SYNC
from densetrain.errors import ConfigError
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
from densetrain.tools.plan.verdict import configured_stages

LOW_MFU = 0.10
"""A stage whose best layout is predicted below this MFU gets a warning."""

MAX_CP = 32
"""Largest context-parallel degree the planner tries (Llama 3 ran 128K tokens at cp 16, Dubey et al. 2024,
sec. 3.3.2)."""

PUBLISHED = {
    # Llama 3 report (Dubey et al. 2024) sec. 3.3.2, Table 4: 405B on 16,384 H100s, TP 8, PP 16, DP 128
    # (CP 1) at 8K; for the 128K stage CP 16 and DP 8.
    ("llama3-405b", 16384): ("Meta's published layout (Llama 3 report, Table 4)",
                             lambda seq_len: (8, 16, 16, 8) if seq_len >= 131072 else (8, 16, 1, 128)),
}
"""Published layouts to print beside the planner's: ``(preset, gpus) -> (source, seq_len -> (tp, pp, cp, dp))``."""


def divisors(n: int) -> list[int]:
    """The divisors of ``n >= 1``, ascending."""
    low = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(low + [n // d for d in low]))


def candidate_layouts(gpus: int, m, gpus_per_node: int = 8, seq_lens: tuple[int, ...] = (),
                      max_pp: int = 1) -> list:
    """Layouts of ``gpus`` ranks worth comparing: pipeline stages (every divisor of ``gpus`` up to ``max_pp``
    and ``n_layers + 2``, none with tied embeddings: densetrain splits the layers unevenly), tensor
    parallel within a node (a power of two dividing ``n_kv_heads``, ``d_ff`` and the vocabulary), context
    parallel (a power of two up to :data:`MAX_CP` with every stage's seq_len a multiple of ``2 cp``: the
    load-balanced chunks), then every split of the data-parallel ranks into replicas x shards (each divisor)."""
    from densetrain.parallel.mesh import Layout

    out = []
    # tied embeddings keep the embedding and the head on one stage: no pipelining (config/validate.py refuses it)
    max_pp = 1 if getattr(m, "tie_embeddings", False) else max_pp
    for pp in (d for d in divisors(gpus) if d <= min(max_pp, m.n_layers + 2)):
        per_stage = gpus // pp
        tp = 1
        while tp <= min(per_stage, gpus_per_node):
            if per_stage % tp == 0 and m.n_kv_heads % tp == 0 and m.d_ff % tp == 0 and m.vocab_size % tp == 0:
                cp = 1
                while cp <= min(MAX_CP, per_stage // tp):
                    if (per_stage // tp) % cp == 0 and (cp == 1 or all(t % (2 * cp) == 0 for t in seq_lens)):
                        dp = per_stage // (tp * cp)
                        out += [Layout(dp // s, s, tp, cp, pp) for s in divisors(dp)]
                    cp *= 2
            tp *= 2
    return out


SHAPE_KEYS = ("seq_len", "batch", "micro", "document_mask")
"""What makes two stage rows alike for the layouts that run them (main and anneal differ only in data)."""

NEAREST_TRIES = 64
"""GPU counts :func:`nearest_gpus` tries each way: 1 to 8, then whole nodes."""


def nearest_gpus(cfg, row: dict, counts: dict, gpus: int, usable: float, hw: Hardware, seq_lens: tuple[int, ...],
                 mixed_precision: bool = True, sequence_parallel: bool = False, max_pp: int = 64
                 ) -> tuple[int | None, int | None]:
    """The nearest GPU counts below and above ``gpus`` with a layout that runs stage ``row`` (batch split, pipeline
    micro-batches and memory, as :func:`stage_fit` decides; none timed): counts of 1 to 8 GPUs and whole nodes of
    ``hw.gpus_per_node``, :data:`NEAREST_TRIES` each way; None where none is found."""
    def runs(g: int) -> bool:
        if 16 * counts["params"] / g > usable:  # fp32 weights, gradients and AdamW moments sharded over all g
            return False
        for lay in candidate_layouts(g, cfg.model, hw.gpus_per_node, seq_lens, max_pp):
            for sched, v in schedules(lay, cfg.parallel, cfg.model.n_layers):
                par = dataclasses.replace(cfg.parallel, pp_schedule=sched, pp_virtual_stages=v)
                if stage_fit(counts, cfg.model, row, lay, par, usable, mixed_precision,  # full: the least memory
                             sequence_parallel and lay.tp > 1, modes=("full",),
                             grad_sync=grad_syncs(lay)[-1])["fits"]:  # microbatch: sharded gradients
                    return True
        return False

    n = hw.gpus_per_node
    below = [g for g in range(gpus - 1, 0, -1) if g <= n or g % n == 0][:NEAREST_TRIES]
    above = [g for g in range(gpus + 1, gpus + n * NEAREST_TRIES + 1) if g <= n or g % n == 0][:NEAREST_TRIES]
    return next((g for g in below if runs(g)), None), next((g for g in above if runs(g)), None)


def schedules(lay, parallel, n_layers: int) -> list[tuple[str, int]]:
    """Pipeline schedules worth timing for ``lay``: ``[(schedule, virtual stages)]``: the configured one, 1F1B,
    and the interleaved schedule with 2, 4, ... stages per rank while ``pp * v`` stages have a layer each
    (``n_layers + 2`` layers: the blocks, the embedding and the head). ``[(configured, 1)]`` without pipelining."""
    if lay.pp == 1:
        return [(parallel.pp_schedule, 1)]
    conf = (parallel.pp_schedule, parallel.pp_virtual_stages if parallel.pp_schedule == "interleaved_1f1b" else 1)
    out = [conf, ("1f1b", 1)]
    v = 2
    while lay.pp * v <= n_layers + 2:
        out.append(("interleaved_1f1b", v))
        v *= 2
    return list(dict.fromkeys(out))


def layout_plan(cfg, gpus: int, gpu_memory_gib: float | None = None, hardware: Hardware | str = "h100-sxm",
                tokens: float | None = None, params: float | None = None, mixed_precision: bool = True,
                sequence_parallel: bool = False, max_pp: int = 64, preset: str | None = None,
                given: bool = True) -> dict:
    """Which layouts of ``gpus`` GPUs run each stage of ``cfg``, ranked by the predicted step time
    (:func:`densetrain.cost.step_time` on ``hardware``, a :class:`~densetrain.cost.Hardware` or a profile name /
    file); memory decides what fits (``gpu_memory_gib``, default the profile's).

    A layout runs a stage when its data-parallel degree divides the stage's batch of sequences into whole micro-
    batches (under pipeline parallelism, at least ``pp`` of them per rank: :func:`~densetrain.tools.plan.memory.
    pipeline_fit`) and some activation-checkpointing mode fits the memory (the cheapest that fits: none, then
    selective, then full). Each pipelined layout is timed under each schedule of :func:`schedules`. Per stage,
    the layouts that run it are ranked by step time (``ranked``; ``best`` the first); the run's time is the sum
    of each stage's best (a stage's layout is chosen per stage); ``suggested`` is the one layout that runs every
    stage in the least total time, for a run that keeps one layout. The cross-entropy is chunked where the
    trainer chunks it and vocabulary-parallel under ``tp > 1``; ``sequence_parallel`` splits the norm regions
    of layouts with ``tp > 1``.

    ``tokens`` replaces the run's length (the stages keep their fractions); ``params`` replaces the parameter
    count for the static memory and scales the step time by the FLOPs per token (the shape's ``6 N`` times
    ``params`` over the shape's total: ``params`` counts every parameter, ``N`` not the input embedding, so the
    shape's own total changes nothing; the shape, for activations and attention, stays that of ``cfg.model``).
    ``preset``: for a published layout of it to evaluate beside (:data:`PUBLISHED`). ``given``: whether ``gpus``
    was given (else it is the one process of a plain dry run, as the configured layouts' verdict says).

    Returns:
        dict: ``model`` (counts), ``hardware``, ``stages`` (name, seq_len, batch, micro, steps, tokens, and from
        the best layout: ``best``, ``step_s``, ``days``, ``time`` (step_time's result), ``ranked`` (candidates
        that run it, fastest first), ``rejected`` (count by reason)), ``layouts`` (per candidate: ``layout``,
        ``schedule``, ``virtual``, per stage ``{"ac", "bytes", "fits", "reason", "kind", "time"}``,
        ``runs_all``, ``days``), ``suggested``, ``running``, ``days``, ``seconds``, ``tokens``, ``warnings``,
        ``configured`` ([parallel]'s layout, None when it does not resolve), ``configured_stages`` (each stage on
        its own configured layout: :func:`~densetrain.tools.plan.verdict.configured_stages`), ``published``,
        ``usable_bytes``.
    Raises:
        ValueError: non-positive gpus or memory, a non-positive or non-finite ``tokens`` / ``params``. ConfigError:
        an unreadable hardware profile, a memory that leaves nothing usable, a step time that is not finite.
    """
    from densetrain.parallel.mesh import resolve_layout
    from densetrain.schedule import resolve_stages

    hw = hardware if isinstance(hardware, Hardware) else load_hardware(hardware)
    given_memory = gpu_memory_gib is not None
    gpu_memory_gib = hw.memory_gib if gpu_memory_gib is None else gpu_memory_gib
    _positive("gpus", gpus)
    _positive("gpu_memory_gib", gpu_memory_gib)
    m = cfg.model
    counts = model_counts(m)
    if params is not None:
        _positive("params", params)
        scale = params / counts["params"]
        counts = {k: v * scale for k, v in counts.items()}
    stages = resolve_stages(cfg)
    total_steps = cfg.train.steps
    run_tokens = sum(st.batch_tokens * (_end(stages, i, total_steps) - st.start_step) for i, st in enumerate(stages))
    if tokens is not None:  # 0, negative or nan would print zero or negative steps
        _positive("tokens", tokens)
    step_scale = tokens / run_tokens if tokens is not None else 1.0
    rows = []
    for i, st in enumerate(stages):
        steps = (_end(stages, i, total_steps) - st.start_step) * step_scale
        fpt = flops_per_token(m, st.seq_len)
        # like with like: the 6 N of the FLOPs counts the blocks' matmuls and the head, not the input embedding or
        # the norms, so the given total (all parameters) scales that N by its ratio to the shape's own total
        six_n = 6 * model_counts_flops(m)
        scale = (fpt + six_n * (params / model_counts(m)["params"] - 1)) / fpt if params is not None else 1.0
        rows.append({"name": st.name, "index": st.index, "own": bool(cfg.stages and cfg.stages[st.index].parallel),
                     "seq_len": st.seq_len, "batch": st.batch_size, "micro": st.micro_batch_size,
                     "batch_tokens": st.batch_tokens, "steps": steps, "tokens": steps * st.batch_tokens,
                     "scale": scale, "document_mask": st.document_mask})
    usable = USABLE_FRACTION * gpu_memory_gib * GIB - RESERVED_GIB * GIB
    if usable <= 0:
        where = "--gpu-memory-gib" if given_memory else f"hardware {hw.name}: memory_gib"
        least = RESERVED_GIB / USABLE_FRACTION
        raise ConfigError(f"{where} {gpu_memory_gib:g}: leaves no usable memory ({USABLE_FRACTION:g} of it less "
                          f"{RESERVED_GIB:g} GiB reserved); expected more than {least:.2f} GiB")
    layouts = []
    for lay in candidate_layouts(gpus, m, hw.gpus_per_node, tuple(r["seq_len"] for r in rows), max_pp):
        sp = sequence_parallel and lay.tp > 1
        for sched, v in schedules(lay, cfg.parallel, m.n_layers):
            par = dataclasses.replace(cfg.parallel, pp_schedule=sched, pp_virtual_stages=v)
            per_stage = [timed_fit(counts, m, st, lay, par, usable, hw, mixed_precision, sp, st["scale"])
                         for st in rows]
            layouts.append({"layout": lay, "schedule": sched, "virtual": v, "stages": per_stage,
                            "runs_all": all(s["fits"] for s in per_stage), "days": layout_days(rows, per_stage)})
    warnings = []
    for i, row in enumerate(rows):
        ranked = sorted((x for x in layouts if x["stages"][i]["fits"]), key=lambda x: x["stages"][i]["time"]["step_s"])
        row["ranked"] = ranked
        row["rejected"] = Counter(x["stages"][i]["kind"] for x in layouts if not x["stages"][i]["fits"])
        best = ranked[0] if ranked else None
        row["best"] = best["layout"] if best else None
        row["time"] = best["stages"][i]["time"] if best else None
        row["step_s"] = row["time"]["step_s"] if best else None
        row["days"] = row["steps"] * row["step_s"] / 86400 if best else None
        same = next((r for r in rows[:i] if not r["best"] and all(r[k] == row[k] for k in SHAPE_KEYS)), None)
        row["nearest_gpus"] = None if best else same["nearest_gpus"] if same else nearest_gpus(
            cfg, row, counts, gpus, usable, hw, tuple(r["seq_len"] for r in rows), mixed_precision,
            sequence_parallel, max_pp)
        if best and row["time"]["mfu"] < LOW_MFU:
            warnings.append(f"stage '{row['name']}': predicted MFU {row['time']['mfu']:.1%} is below "
                            f"{LOW_MFU:.0%}: the GPUs mostly wait (communication, bubble): fewer GPUs or a larger "
                            "batch use them better")
    ok = sorted((x for x in layouts if x["runs_all"]), key=lambda x: x["days"])
    try:
        p = cfg.parallel
        configured = resolve_layout(p.dp_replicate, p.dp_shard, p.tp, gpus, p.cp, p.pp)
    except ValueError:
        configured = None
    days = sum(r["days"] for r in rows) if all(r["best"] for r in rows) else None
    if days is not None and days > 365:
        warnings.append(f"the run takes {days:,.0f} days ({days / 365:.1f} years) on {gpus} GPUs: more GPUs, a "
                        "smaller model or fewer tokens")
    return {"gpus": gpus, "gpu_memory_gib": gpu_memory_gib, "hardware": hw, "gpu_peak_flops": hw.peak_bf16_flops,
            "usable_bytes": usable, "model": counts, "stages": rows, "layouts": layouts,
            "suggested": ok[0] if ok else None, "running": ok, "configured": configured,
            "seconds": days * 86400 if days is not None else None, "days": days, "warnings": warnings,
            "tokens": sum(r["tokens"] for r in rows), "mixed_precision": mixed_precision,
            "configured_stages": configured_stages(cfg, gpus, counts, usable, mixed_precision, given),
            "published": published_layout(cfg, rows, counts, gpus, usable, hw, preset, mixed_precision),
            "logit_bytes_per_token": ((2 if mixed_precision else 4) + 4) * m.vocab_size}


def grad_syncs(lay) -> tuple[str | None, ...]:
    """When a pipelined FSDP2 stage of ``lay`` may reduce-scatter its gradients (the trainer's
    ``parallel.pp_grad_sync``, :data:`densetrain.cost.step.PP_GRAD_SYNC`): both ways for a pipeline whose stages
    shard (dp_shard x cp > 1), else ``(None,)`` (nothing to choose: without sharding the replicas' all-reduce
    waits for the call's last backward either way)."""
    if lay.pp > 1 and lay.dp_shard * lay.cp > 1:
        return PP_GRAD_SYNC
    return (None,)


def timed_fit(counts: dict, m, st: dict, lay, parallel, usable: float, hw: Hardware, mixed_precision: bool = True,
              sp: bool = False, scale: float = 1.0) -> dict:
    """:func:`stage_fit` and, when the layout runs the stage, its predicted step (``time``:
    :func:`densetrain.cost.step_time` with the chosen checkpointing, schedule and micro-batches; a document-masked
    stage runs FlexAttention whatever the layout, an unmasked one under context parallelism only); a pipelined
    FSDP2 layout under each gradient sync of :func:`grad_syncs` (memory decides which fit, each with its
    cheapest checkpointing), the faster kept (``grad_sync``; ``last`` on a tie). ``scale`` (``--params`` on
    another preset's shape): every part of the step times the ratio of the FLOPs per token (MFU unchanged)."""
    best = None
    for sync in grad_syncs(lay):
        fit = _timed_fit(counts, m, st, lay, parallel, usable, hw, mixed_precision, sp, scale, sync)
        if best is None or (fit["fits"] and (not best["fits"] or fit["time"]["step_s"] < best["time"]["step_s"])):
            best = fit
    return best


def _timed_fit(counts: dict, m, st: dict, lay, parallel, usable: float, hw: Hardware, mixed_precision: bool,
               sp: bool, scale: float, grad_sync: str | None) -> dict:
    fit = stage_fit(counts, m, st, lay, parallel, usable, mixed_precision, sp, grad_sync=grad_sync)
    fit["time"] = None
    if fit["fits"]:
        pipe = fit.get("pipeline") or {}
        par = parallel_of(lay, pipe.get("schedule", "1f1b"), pipe.get("virtual", 1), pipe.get("microbatches", 0), sp,
                          "flex" if st.get("document_mask") else "auto", grad_sync or "last")
        t = step_time(m, par, hw, st["seq_len"], st["batch"], st["micro"], fit["ac"])
        if not math.isfinite(t["step_s"]) or t["step_s"] <= 0:  # never printed: a profile's numbers are off
            raise ConfigError(f"hardware {hw.name}: the cost model's step time of {lay} at stage '{st['name']}' is "
                              f"{t['step_s']} s: check the profile's rates (FLOP/s, B/s) and latencies (s)")
        if scale != 1.0:
            t.update(parts={k: v * scale for k, v in t["parts"].items()}, step_s=t["step_s"] * scale,
                     tokens_per_sec=t["tokens_per_sec"] / scale, model_flops=t["model_flops"] * scale,
                     tokens_per_sec_per_gpu=t["tokens_per_sec_per_gpu"] / scale)
        fit["time"] = t
    return fit


def stage_fit(counts: dict, m, st: dict, lay, parallel, usable: float, mixed_precision: bool = True,
              sp: bool = False, modes: tuple[str, ...] = AC_MODES, grad_sync: str | None = None) -> dict:
    """Whether layout ``lay`` runs stage row ``st`` (of :func:`layout_plan`): ``{"ac", "bytes", "fits",
    "reason", "grad_sync"}`` with the cheapest activation checkpointing of ``modes`` that fits, plus ``pipeline``
    (its settings and ``p2p_bytes`` per step, under pipeline parallelism; ``grad_sync``, when given, its
    ``"grad_sync"``: what the memory plan holds of the gradients, :func:`grad_syncs`)."""
    if st["batch"] % (lay.dp_size * st["micro"]):
        return {"ac": None, "bytes": None, "fits": False, "kind": "batch", "grad_sync": grad_sync,
                "reason": f"{st['batch']} sequences do not split into {lay.dp_size} data-parallel ranks x "
                          f"micro-batch {st['micro']}"}
    pipe, why = pipeline_fit(lay, st["batch"], st["micro"], parallel)
    if pipe is None:
        return {"ac": None, "bytes": None, "fits": False, "kind": "pipeline", "reason": why, "grad_sync": grad_sync}
    if pipe:
        if grad_sync:
            pipe["grad_sync"] = grad_sync
        pipe["p2p_bytes"] = p2p_bytes(m, st["seq_len"], st["micro"], lay, pipe["n_micro"], pipe["virtual"],
                                      2 if mixed_precision else 4) / (lay.tp if sp else 1)  # SP: a 1/tp slice
    best = None
    for ac in modes:
        b = layout_memory(counts, m, st["seq_len"], st["micro"], lay, ac, mixed_precision, sp, pipeline=pipe)
        best = {"ac": ac, "bytes": b, "fits": b["total"] <= usable, "reason": "", "kind": "", "pipeline": pipe,
                "grad_sync": grad_sync}
        if best["fits"]:
            break
    if not best["fits"]:
        best["kind"] = "memory"
        best["reason"] = f"needs {best['bytes']['total'] / GIB:.1f} GiB even with full recomputation"
    return best


def layout_days(rows: list[dict], per_stage: list[dict]) -> float | None:
    """Days of the whole run on one layout: each stage's steps times its predicted step time (recomputation and
    bubble inside it, counted once); None when the layout does not run every stage."""
    if not all(s["fits"] for s in per_stage):
        return None
    return sum(row["steps"] * s["time"]["step_s"] for row, s in zip(rows, per_stage)) / 86400


def published_layout(cfg, rows: list[dict], counts: dict, gpus: int, usable: float, hw: Hardware,
                     preset: str | None, mixed_precision: bool = True) -> dict | None:
    """A published layout for ``(preset, gpus)`` (:data:`PUBLISHED`) evaluated like the planner's own, per stage
    (its layout may change between stages), with sequence parallelism and its fastest schedule
    (:func:`schedules`): ``{"source", "stages": [timed_fit results, each with its "layout", "schedule",
    "virtual"], "days"}``, or None."""
    from densetrain.parallel.mesh import Layout

    entry = PUBLISHED.get((preset, gpus))
    if entry is None:
        return None
    source, at = entry
    stages = []
    for st in rows:
        tp, pp, cp, dp = at(st["seq_len"])
        lay = Layout(1, dp, tp, cp, pp)
        tried = []
        for sched, v in schedules(lay, cfg.parallel, cfg.model.n_layers):
            par = dataclasses.replace(cfg.parallel, pp_schedule=sched, pp_virtual_stages=v)
            # Megatron-style tensor parallel with sequence parallelism (the norm regions split by tp)
            fit = timed_fit(counts, cfg.model, st, lay, par, usable, hw, mixed_precision, tp > 1, st["scale"])
            tried.append({**fit, "layout": lay, "schedule": sched, "virtual": v})
        runs = [x for x in tried if x["fits"]]
        stages.append(min(runs, key=lambda x: x["time"]["step_s"]) if runs else tried[0])
    return {"source": source, "stages": stages, "days": layout_days(rows, stages)}


def model_counts_flops(m) -> float:
    """Parameters of ``m`` that :func:`densetrain.cost.flops_per_token`'s ``6 N`` counts (blocks' matmuls, head)."""
    return m.n_layers * block_matmul_params(m) + m.d_model * m.vocab_size


def _end(stages, i: int, total_steps: int) -> int:
    return stages[i + 1].start_step if i + 1 < len(stages) else total_steps


