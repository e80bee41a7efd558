"""Text forms of the planner's results: the compute-optimal plan and the layout table."""

from __future__ import annotations

import dataclasses

from densetrain.cost import CHECKED_ERROR
from densetrain.tools.plan.memory import GIB
from densetrain.tools.plan.verdict import format_configured


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


def format_cost(cost: dict) -> str:
    """``'1.23K GPU-hours x $2.50 = $3,075'`` (or a hint at ``--gpu-hour-price`` without a price)."""
    hours = f"{human(cost['gpu_hours'])} GPU-hours"
    if cost["usd"] is None:
        return f"{hours} (--gpu-hour-price USD gives the cost)"
    return f"{hours} x ${cost['gpu_hour_price']:,.2f} = ${cost['usd']:,.0f}"


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
    if r.get("cost"):
        lines.append(f"  cost      {format_cost(r['cost'])} (at mfu {r['cost']['mfu']:.3g} of "
                     f"{r['cost']['gpu_peak_flops'] / 1e12:g} TFLOP/s per GPU)")
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



def _layout_flags(x: dict, i: int, prefix: str = "parallel") -> str:
    """The flags that make a config run candidate ``x``'s layout at stage ``i`` of the plan: its degrees (all of
    them, pp too: unset keys would keep the config's), its pipeline schedule and virtual stages under pipelining,
    the gradient sync of a pipelined FSDP2 stage (``pp_grad_sync``) and the activation checkpointing the plan
    sized it with, each ``--<prefix>.<key>=<value>`` (``prefix``
    ``parallel``, or ``stages.N.parallel`` for a stage's own layout)."""
    lay = x["layout"]
    keys = [("pp", lay.pp)]
    if lay.pp > 1:  # without pipelining the schedule is the config's (any is valid there)
        keys += [("pp_schedule", x["schedule"]), ("pp_virtual_stages", x["virtual"])]
        if x["stages"][i].get("grad_sync"):  # a pipelined FSDP2 stage: when its gradients are reduce-scattered
            keys.append(("pp_grad_sync", x["stages"][i]["grad_sync"]))
    keys += [("dp_replicate", lay.dp_replicate), ("dp_shard", lay.dp_shard), ("cp", lay.cp), ("tp", lay.tp),
             ("activation_checkpointing", x["stages"][i]["ac"])]
    return " ".join(f"--{prefix}.{k}={v}" for k, v in keys)


def _prefixes(r: dict, pick) -> tuple[int, list[str]]:
    """The stage whose layout ``--parallel.*`` carries (the first without a layout of its own in the config, else
    the first: ``[parallel]`` must resolve too) and each stage's flag prefix when stage ``i`` runs candidate
    ``pick(i)``: ``stages.N.parallel`` for a stage with its own layout or one that differs from that stage's,
    else ``parallel``."""
    rows = r["stages"]
    base = next((i for i, s in enumerate(rows) if not s.get("own")), 0)
    same = lambda i: _layout_flags(pick(i), i) == _layout_flags(pick(base), base)  # noqa: E731
    return base, ["parallel" if not s.get("own") and same(i) else f"stages.{s.get('index', i)}.parallel"
                  for i, s in enumerate(rows)]


def run_flags(r: dict, pick) -> str:
    """The ``train`` flags that run every stage of plan ``r`` on candidate ``pick(i)`` (stage ``i``'s):
    ``--parallel.*`` of :func:`_prefixes`' base stage, then ``--stages.N.parallel.*`` for each stage that has a
    layout of its own or differs from it, so the command runs what was planned whatever the config's degrees."""
    base, prefixes = _prefixes(r, pick)
    return " ".join([_layout_flags(pick(base), base)]
                    + [_layout_flags(pick(i), i, pre) for i, pre in enumerate(prefixes) if pre != "parallel"])


def _stage_prefix(r: dict, i: int) -> str:
    """Stage ``i``'s flag prefix in the command that runs every stage on its best layout (:func:`_prefixes`)."""
    ranked = [s["ranked"] for s in r["stages"]]
    return _prefixes(r, lambda j: ranked[j][0] if ranked[j] else ranked[i][0])[1][i]


def _name(x: dict) -> str:
    """A candidate's layout with its pipeline schedule: ``pp=16 ... tp=8 (interleaved v=8)``."""
    lay = x["layout"]
    if lay.pp == 1:
        return str(lay)
    return f"{lay} ({'interleaved v=' + str(x['virtual']) if x['schedule'] == 'interleaved_1f1b' else x['schedule']})"


PART_WORDS = {"compute": "compute", "recompute": "recomputation", "tp": "exposed tensor-parallel collectives",
              "cp": "context-parallel K/V gathers", "dp": "exposed FSDP/replica communication",
              "pp": "pipeline sends", "bubble": "pipeline bubble", "optimizer": "optimizer"}


def _days(d: float) -> str:
    """``'60.4'``, ``'2,377'``: days to three figures, whole days from 100."""
    return f"{d:,.0f}" if d >= 100 else f"{d:.3g}"


def _parts(t: dict) -> str:
    """``compute 5.47 + tp 0.61 + bubble 0.72 s``: a step's parts over 5 ms."""
    return " + ".join(f"{k} {v:.3g}" for k, v in t["parts"].items() if v >= 0.005 or k == "compute") + " s"


def _why_slower(t: dict, best: dict) -> str:
    """Why a step ``t`` loses to ``best``: its time over the best's and the parts that grew most."""
    diff = sorted(((t["parts"][k] - best["parts"][k], k) for k in t["parts"]), reverse=True)
    grew = [f"{PART_WORDS[k]} +{d:.3g} s" for d, k in diff[:2] if d >= 0.0005 * best["step_s"]]
    return f"+{t['step_s'] / best['step_s'] - 1:.1%}" + (f": {', '.join(grew)}" if grew else "")


def tied(t: dict, best: dict) -> bool:
    """Whether step ``t`` is within the model's checked error (:data:`densetrain.cost.CHECKED_ERROR`) of
    ``best``: the model does not tell the two layouts apart."""
    return t["step_s"] <= best["step_s"] * (1 + CHECKED_ERROR)


def ties(s: dict, i: int) -> tuple[int, int]:
    """``(layouts of other shapes (pp, cp, tp) that run stage row s, those of them within the model's error of
    the pick)``: the pick's own HSDP splits aside."""
    x, t = s["ranked"][0], s["time"]
    shape = lambda y: (y["layout"].pp, y["layout"].cp, y["layout"].tp)  # noqa: E731
    other = [y for y in s["ranked"][1:] if shape(y) != shape(x)]
    return len(other), sum(tied(y["stages"][i]["time"], t) for y in other)


def _stage_block(r: dict, i: int, others: int) -> list[str]:
    """One stage: its best layout with the step's parts, MFU, memory and days, the next ``others`` of other
    shapes (pp, cp, tp) with why they lose, and the rejected counted by reason."""
    s = r["stages"][i]
    head = (f"stage '{s['name']}': seq_len {s['seq_len']}, {s['batch']} sequences x micro {s['micro']}, "
            f"{human(s['steps'])} steps, {human(s['tokens'])} tokens")
    if not s["ranked"]:
        return [head, "  no layout runs it (reasons below)"]
    x, t = s["ranked"][0], s["time"]
    st = x["stages"][i]
    lines = [head,
             f"  layout {_name(x)}, activation checkpointing {st['ac']}"
             + (", gradients reduce-scattered every micro-batch" if st.get("grad_sync") == "microbatch" else "")
             + f": {t['step_s']:.3g} s a step = {_parts(t)}",
             f"    MFU {t['mfu']:.1%}, {t['tokens_per_sec_per_gpu']:,.0f} tokens/s per GPU, "
             f"{st['bytes']['total'] / GIB:.1f} GiB per GPU, {_days(s['days'])} days",
             f"    its flags: {_layout_flags(x, i, _stage_prefix(r, i))}"]
    seen = {(x["layout"].pp, x["layout"].cp, x["layout"].tp)}
    distinct = []  # the next layouts of another shape (HSDP splits of the same shape differ by little)
    for y in s["ranked"][1:]:
        if len(distinct) < others and (key := (y["layout"].pp, y["layout"].cp, y["layout"].tp)) not in seen:
            seen.add(key)
            distinct.append(y)
    for y in distinct:
        yt = y["stages"][i]["time"]
        lines.append(f"  {_name(y):<58} {yt['step_s']:.3g} s  {_why_slower(yt, t)}")
    other, close = ties(s, i)
    if r["hardware"].sms and close:
        shown = sum(tied(y["stages"][i]["time"], t) for y in distinct)
        lines.append(f"  the model does not tell the pick from {close} of the {other} layouts of other shapes "
                     f"that run the stage ({shown} listed above): within its error, {CHECKED_ERROR:.1%} (its mean "
                     "over the published runs it was not fitted on; larger on context-parallel runs: docs/planner.md)")
    rej = s["rejected"]
    if rej:
        words = {"memory": "do not fit in memory", "batch": "do not split the batch",
                 "pipeline": "give a rank fewer micro-batches than pipeline stages"}
        lines.append(f"  rejected {sum(rej.values())}: " + ", ".join(f"{n} {words.get(k, k)}" for k, n in
                                                                     rej.most_common()))
    return lines


def _shortfall(r: dict, i: int) -> str | None:
    """Why stage ``i`` fits no layout: the least-memory option's largest part, or None when some layout fits."""
    tried = [x["stages"][i] for x in r["layouts"] if x["stages"][i]["bytes"] is not None]
    if not tried or any(t["fits"] for t in tried):
        return None
    best = min(tried, key=lambda t: t["bytes"]["total"])
    b, g = best["bytes"], lambda v: f"{v / GIB:.1f}"
    state = b["params"] + b["grads"] + b["optim"]
    s = r["stages"][i]
    head = (f"stage '{s['name']}' fits no layout: the least memory is {g(b['total'])} GiB per GPU "
            f"(usable {g(r['usable_bytes'])}): state {g(state)}, transient {g(b['transient'])}, activations "
            f"{g(b['activations'])} GiB")
    if state >= b["activations"] and state >= b["transient"]:
        return (head + "; most of it is the fp32 parameters, gradients and AdamW moments (16 bytes per parameter "
                "held): shard them over more GPUs (parallel.dp_shard) or use GPUs with more memory")
    what = "" if b["chunked_loss"] else (f", of which the gathered logits and their fp32 log-softmax are "
                                          f"{g(r['logit_bytes_per_token'] * s['seq_len'] * s['micro'])} GiB")
    return (head + what + "; most of it is activations: more context parallelism (parallel.cp) or tensor "
            "parallelism, full activation checkpointing, a smaller micro-batch or a shorter seq_len")


def format_layout_plan(r: dict, others: int = 4) -> str:
    """Readable form of a :func:`layout_plan` result: the model and hardware; per stage its fastest layout with
    the step's parts, MFU, memory and days, the next ``others`` with why they lose, the rejected counted by
    reason; the total; the one layout that runs every stage; a published layout beside; the configured
    layout's verdict; warnings (a run over a year, MFU under 10%) and what is short for a stage no layout fits."""
    c, hw = r["model"], r["hardware"]
    lines = [f"model: {human(c['params'])} parameters ({human(c['block'])} per block, {human(c['root'])} embedding"
             f"+head); {r['gpus']} GPUs x {hw.name} ({r['gpu_memory_gib']:g} GiB, usable "
             f"{r['usable_bytes'] / GIB:.1f} GiB; {hw.peak_bf16_flops / 1e12:g} TFLOP/s bf16, {hw.gpus_per_node} a "
             "node); times from the cost model (docs/planner.md)"]
    if (note := mfu_note(hw)) is not None:
        lines.append(f"note: {note}")
    for i in range(len(r["stages"])):
        lines += _stage_block(r, i, others)
    if r["days"] is not None:
        lines.append(f"total: {_days(r['days'])} days, {human(r['tokens'])} tokens, each stage on its layout"
                     + (f"; {format_cost(r['cost'])}" if r.get("cost") else ""))
        lines.append(f"  densetrain train ... {run_flags(r, lambda i: r['stages'][i]['ranked'][0])}")
    sug = r["suggested"]
    if sug is not None:
        extra = f" (+{sug['days'] / r['days'] - 1:.1%})" if r["days"] and sug["days"] > r["days"] * 1.0005 else ""
        lines.append(f"one layout for every stage: {_name(sug)}, {_days(sug['days'])} days{extra}: densetrain "
                     f"train ... {run_flags(r, lambda i: sug)}")
    elif r["days"] is not None:
        lines.append("no single layout runs every stage: change it at the stage boundaries")
    pub = r.get("published")
    if pub is not None:
        lines.append(f"{pub['source']}: " + ("; ".join(
            f"{s['name']} {_name(x)}, {x['ac']} checkpointing"
            + (", pp_grad_sync microbatch" if x.get("grad_sync") == "microbatch" else "")
            + f" {x['time']['step_s']:.3g} s ({_why_slower(x['time'], s['time'])}"
            + ("; within the model's error" if hw.sms and tied(x["time"], s["time"]) else "") + ")"
            if x["fits"] and s["time"] else f"{s['name']} does NOT run: {x['reason']}"
            for s, x in zip(r["stages"], pub["stages"])))
            + (f"; {_days(pub['days'])} days" if pub["days"] else ""))
    lines += format_configured(r["configured_stages"])
    lines += [f"warning: {w}" for w in r["warnings"]]
    lines += [why for i in range(len(r["stages"])) if (why := _no_layout(r, i))]
    return "\n".join(lines)


def mfu_note(hw) -> str | None:
    """What the MFU means on a profile whose GEMM efficiency is 1 (``doctor --profile``'s: its peak is the matmul
    rate this machine reached, not a datasheet's), else None. There the model runs every GEMM at the peak, so the
    MFU is near 100% by construction; MFU's numerator counts causal attention whole (torchtitan's and Llama 3's
    convention, docs/planner.md) while the kernel runs half of it, so where attention weighs, it passes 100%."""
    if hw.gemm_efficiency != 1.0:
        return None
    return (f"MFU here is against {hw.name}'s measured matmul rate ({hw.peak_bf16_flops / 1e9:.3g} GFLOP/s), not "
            "a datasheet peak: near 100% by construction, and over it where causal attention weighs (MFU counts "
            "it whole, the kernel runs half); compare step times, not MFU, on such a profile")


def _no_layout(r: dict, i: int) -> str | None:
    """Why no layout of the plan runs stage ``i``: what is short in memory (:func:`_shortfall`), else the rejected
    candidates counted by reason; None when some layout runs it."""
    s = r["stages"][i]
    if s["ranked"]:
        return None
    counts = ", ".join(f"{n} {k}" for k, n in s["rejected"].most_common())
    near = [str(g) for g in s.get("nearest_gpus") or () if g]
    hint = f"; the nearest GPU counts that run it: {' or '.join(near)}" if near else ""
    return (_shortfall(r, i) or f"stage '{s['name']}': no layout of {r['gpus']} GPUs runs it (rejected: {counts})"
            ) + hint


def refusals(r: dict) -> list[str]:
    """Why the plan cannot run as configured, one line each: a stage no layout of the GPUs runs, and a stage its
    configured layout (its own or ``[parallel]``) does not run; empty when every stage runs on its layout. The
    commands print the plan, then these, and exit non-zero when there are any."""
    out = [why for i in range(len(r["stages"])) if (why := _no_layout(r, i))]
    return out + [c["reason"] for c in r["configured_stages"] if not c["runs"]]


def layout_plan_json(r: dict) -> dict:
    """The part of a :func:`layout_plan` result a script needs: per stage ``name, seq_len, layout`` (degrees,
    schedule, virtual stages), ``ac``, ``pp_grad_sync`` (a pipelined FSDP2 stage's, else None), ``step_s, parts,
    mfu, tokens_per_sec_per_gpu, memory_gib, days`` (None where no layout runs it), ``within_error`` (layouts of
    other shapes within the model's error of the pick, :func:`ties`; None on a measured CPU profile),
    ``reason`` (why no layout runs it, else None), ``configured`` (its configured layout: ``layout, own, runs,
    reason, memory_gib``), and the run's ``days``, ``gpus``, ``hardware``, ``warnings``, ``mfu_note``
    (:func:`mfu_note`), ``suggested`` (one layout for every stage, with its ``train_flags`` and ``pp_grad_sync``
    per stage), ``train_flags`` (:func:`run_flags`: every stage on its best layout; None when a stage has none),
    ``refusals`` (:func:`refusals`: non-empty, the command exits non-zero)."""
    def lay(x):
        return {**dataclasses.asdict(x["layout"]), "schedule": x["schedule"], "virtual": x["virtual"]}

    stages = []
    for i, s in enumerate(r["stages"]):
        out = {"name": s["name"], "seq_len": s["seq_len"], "batch": s["batch"], "steps": s["steps"],
               "layout": None, "ac": None, "pp_grad_sync": None, "step_s": None, "parts": None, "mfu": None,
               "tokens_per_sec_per_gpu": None, "memory_gib": None, "days": None, "within_error": None,
               "reason": _no_layout(r, i),
               "configured": r["configured_stages"][i]}
        if s["ranked"]:
            x, t = s["ranked"][0], s["time"]
            out.update(layout=lay(x), ac=x["stages"][i]["ac"], pp_grad_sync=x["stages"][i].get("grad_sync"),
                       step_s=t["step_s"], parts=t["parts"], mfu=t["mfu"],
                       tokens_per_sec_per_gpu=t["tokens_per_sec_per_gpu"],
                       memory_gib=x["stages"][i]["bytes"]["total"] / GIB, days=s["days"],
                       within_error=ties(s, i)[1] if r["hardware"].sms else None)
        stages.append(out)
    sug = r["suggested"]
    return {"gpus": r["gpus"], "hardware": dataclasses.asdict(r["hardware"]), "stages": stages, "days": r["days"],
            "tokens": r["tokens"], "warnings": r["warnings"], "refusals": refusals(r),
            "mfu_note": mfu_note(r["hardware"]),
            "suggested": {"layout": lay(sug), "days": sug["days"], "train_flags": run_flags(r, lambda i: sug),
                          "pp_grad_sync": [st.get("grad_sync") for st in sug["stages"]]}
            if sug else None, "cost": r.get("cost"),
            "train_flags": run_flags(r, lambda i: r["stages"][i]["ranked"][0]) if r["days"] is not None else None}
