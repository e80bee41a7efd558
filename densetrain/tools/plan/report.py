"""Text forms of the planner's results: the compute-optimal plan and the layout table."""

from __future__ import annotations

from densetrain.tools.plan.memory import GIB


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



def _layout_flags(lay) -> str:
    return ((f"--parallel.pp={lay.pp} " if lay.pp > 1 else "")
            + f"--parallel.dp_replicate={lay.dp_replicate} --parallel.dp_shard={lay.dp_shard} "
            f"--parallel.cp={lay.cp} --parallel.tp={lay.tp}")


def _stage_table(rows: list[dict], fits: list[dict], layouts: list | None = None) -> list[str]:
    """Per stage: checkpointing, bytes per GPU by part, cross-entropy, and under pipeline parallelism the
    pipeline rank counted, its micro-batches in flight, the bubble and the point-to-point bytes per step."""
    g = lambda b: f"{b / GIB:.1f}"
    out = []
    for i, (s, x) in enumerate(zip(rows, fits)):
        lay = f" {layouts[i]}" if layouts else ""
        if not x["fits"] and x["bytes"] is None:
            out.append(f"  {s['name']:<15}{lay} does not run: {x['reason']}")
            continue
        b, pipe = x["bytes"], x.get("pipeline") or {}
        line = (f"  {s['name']:<15} {x['ac']:<10} {g(b['params']):>6} {g(b['grads']):>6} {g(b['optim']):>6} "
                f"{g(b['transient']):>10} {g(b['activations']):>12} {g(b['total']):>9}      "
                f"{'chunked' if b['chunked_loss'] else 'whole logits'}{lay}")
        if pipe:
            line += (f"; pp rank {b['pp_rank']}: {b['in_flight']:.3g} of {pipe['microbatches']} micro-batches in "
                     f"flight, bubble {pipe['bubble']:.1%}, p2p {g(pipe['p2p_bytes'])} GiB/step")
        if not x["fits"]:
            line += f"  (does NOT fit: {x['reason']})"
        out.append(line)
    return out


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


def format_layout_plan(r: dict, show: int = 12) -> str:
    """Readable table of a :func:`layout_plan` result: the model, the stages (steps, tokens, days), the
    suggested layout's memory per stage by part, the other layouts that run every stage, the cheapest
    layout per stage and how to run a per-stage layout, then every layout with the checkpointing mode
    per stage (or why it cannot run), and what is short for a stage that fits no layout."""
    g = lambda b: f"{b / GIB:.1f}"
    c = r["model"]
    lines = [f"model: {human(c['params'])} parameters ({human(c['block'])} per block, {human(c['root'])} embedding"
             f"+head); {r['gpus']} GPUs x {r['gpu_memory_gib']:g} GiB (usable {g(r['usable_bytes'])} GiB each); "
             f"time at mfu {r['mfu']:g} of {r['gpu_peak_flops'] / 1e12:g} TFLOP/s per GPU",
             "stages:"]
    for s in r["stages"]:
        lines.append(f"  {s['name']:<13} seq_len {s['seq_len']:>7}  batch {s['batch']:>5} seqs  micro {s['micro']}  "
                     f"{human(s['steps'])} steps x {s['step_s']:.2f} s = {s['days']:.2f} days, {human(s['tokens'])} "
                     f"tokens")
    lines.append(f"total: {r['days']:.1f} days, {human(r['tokens'])} tokens"
                 + (f"; {format_cost(r['cost'])}" if r.get("cost") else ""))
    sug = r["suggested"]
    if sug is None:
        lines.append("no layout runs every stage (see the reasons below)")
    else:
        lay = sug["layout"]
        lines.append(f"suggested: {lay}, one layout for every stage: densetrain train ... {_layout_flags(lay)}")
        lines.append(f"  {sug['days']:.1f} days with its recomputation and pipeline bubble")
        lines.append("  stage           ac         params  grads  optim  transient  activations  total GiB/GPU  "
                     "cross-entropy")
        lines += _stage_table(r["stages"], sug["stages"])
        others = r["running"][1:6]
        if others:
            lines.append(f"other layouts that run every stage ({len(r['running']) - 1}; GiB per GPU per stage, "
                         f"{r['days']:.1f} days each):")
            for x in others:
                lines.append(f"  {str(x['layout']):<44} " + " | ".join(
                    f"{st['ac']} {g(st['bytes']['total'])}" for st in x["stages"]))
    pub = r.get("published")
    if pub is not None:
        days = f"{pub['days']:.1f} days with its recomputation and pipeline bubble" if pub["days"] else \
            "does NOT run every stage here"
        lines.append(f"{pub['source']}, per stage: {days}")
        lines += _stage_table(r["stages"], pub["stages"], [x["layout"] for x in pub["stages"]])
    if r["configured"] is not None:
        conf = next((x for x in r["layouts"] if x["layout"] == r["configured"]), None)
        verdict = "not among the candidates" if conf is None else ("runs every stage" if conf["runs_all"] else
                                                                   "does NOT run every stage")
        lines.append(f"configured layout ({r['configured']}): {verdict}")
    best = [(s["name"], s["best"]) for s in r["stages"]]
    if len({b for _, b in best}) > 1:
        lines.append("cheapest layout per stage: " + "; ".join(f"{n}: {b or 'none'}" for n, b in best))
        lines.append("  densetrain keeps one layout for a run (the suggested one runs every stage). To change it at a "
                     "stage, stop the run after a checkpoint at or past the stage's first step and relaunch with "
                     "--resume and the stage's --parallel.* flags: checkpoints reshard across dp_shard, tp and cp.")
    lines.append("layouts (activation checkpointing per stage, or why not):")
    for x in r["layouts"][:show] if show else r["layouts"]:
        cells = [f"{s['ac']} {g(s['bytes']['total'])}G" if s["fits"] else f"no: {s['reason']}" for s in x["stages"]]
        lines.append(f"  {'*' if x['runs_all'] else ' '} {str(x['layout']):<44} " + " | ".join(cells))
    if show and len(r["layouts"]) > show:
        lines.append(f"  ... {len(r['layouts']) - show} more (--all-layouts)")
    lines += [why for i in range(len(r["stages"])) if (why := _shortfall(r, i))]
    return "\n".join(lines)
