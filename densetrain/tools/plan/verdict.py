"""Whether the configured layouts run a config's stages: each stage on its own layout (``stages[i].parallel``
over ``[parallel]``, :func:`densetrain.parallel.stage_layout.stage_layouts`), checked as the launch checks it
(degrees, heads, seq_len split, batch split, pipeline micro-batches) and then for memory at the stage's
configured activation checkpointing. ``plan`` and ``train --dry-run`` print the verdict and exit non-zero
when a stage fails (``densetrain.tools.commands``)."""

from __future__ import annotations

from densetrain.errors import ConfigError
from densetrain.parallel.stage_layout import stage_layouts
from densetrain.tools.plan.memory import GIB, layout_memory, pipeline_fit
from densetrain.tools.plan.rank import world_words


def configured_stages(cfg, gpus: int, counts: dict, usable: float, mixed_precision: bool = True,
                      given: bool = True) -> list[dict]:
    """Each stage of ``cfg`` on its configured layout of ``gpus`` ranks (``given``: whether the number was given,
    else it is the one process of a plain dry run, said so when ``[parallel]`` needs more).

    Args:
        counts: :func:`~densetrain.tools.plan.memory.model_counts` (scaled when ``plan --params`` is given).
        usable: bytes a GPU may hold (the planner's budget: ``USABLE_FRACTION`` of the memory less
            ``RESERVED_GIB``).

    Returns:
        per stage ``{"name", "layout" (str, None when it does not resolve), "own" (the stage sets its own
        degrees), "runs", "reason" (one line naming why not, '' when it runs), "memory_gib" (the largest
        rank's total at the configured checkpointing, None when not sized)}``.
    """
    from densetrain.schedule import resolve_stages

    out = []
    for st in resolve_stages(cfg):
        own = bool(cfg.stages[st.index].parallel)
        row = {"name": st.name, "layout": None, "own": own, "runs": False, "reason": "", "memory_gib": None}
        out.append(row)
        try:
            ((par, lay),) = stage_layouts(cfg, [st], gpus)
        except ConfigError as e:  # a [parallel] error comes without the stage: say it, with the nearest world sizes
            named = own or str(e).startswith(f"stage '{st.name}'")  # the stage's check names it; [parallel]'s not
            row["reason"] = str(e) if named else (f"stage '{st.name}' ([parallel]): "
                                                  f"{world_words(cfg.parallel, gpus, given) or e}")
            continue
        row["layout"] = str(lay)
        pipe, why = pipeline_fit(lay, st.batch_size, st.micro_batch_size, par)
        if pipe is None:
            row["reason"] = f"stage '{st.name}': {lay} cannot run it: {why}"
            continue
        mem = layout_memory(counts, cfg.model, st.seq_len, st.micro_batch_size, lay, par.activation_checkpointing,
                            mixed_precision, par.sequence_parallel and lay.tp > 1, pipeline=pipe)
        row["memory_gib"] = mem["total"] / GIB
        if mem["total"] > usable:
            row["reason"] = (f"stage '{st.name}': {lay} needs {mem['total'] / GIB:.1f} GiB per GPU with "
                             f"activation checkpointing {par.activation_checkpointing}, over the "
                             f"{usable / GIB:.1f} GiB usable")
            continue
        row["runs"] = True
    return out


def format_configured(rows: list[dict]) -> list[str]:
    """Text lines of :func:`configured_stages`: one per stage, the layout and whether it runs (why not)."""
    lines = []
    for r in rows:
        where = "its own layout" if r["own"] else "[parallel]"
        if r["runs"]:
            lines.append(f"configured layout of stage '{r['name']}' ({where}, {r['layout']}): runs, "
                         f"{r['memory_gib']:.1f} GiB per GPU")
        else:
            lines.append(f"configured layout: does NOT run: {r['reason']}")
    return lines
