"""What a run's start says, once each, in its log: the plan's repeated data, an elastic restart, the layout (in
words, beside the checkpoint's on a resume), the optimizer's parameter groups, the RNG state restored, the
resume point. Called by :func:`densetrain.train.setup.setup`; every line is an event of the run's
:class:`~densetrain.metrics.MetricsLogger` (``run.log``) on rank 0.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from densetrain.config import stage_parallel
from densetrain.data.shards import TokenFiles
from densetrain.optim import describe_groups
from densetrain.parallel.mesh import Layout, resolve_layout
from densetrain.schedule import Stage, stage_at

if TYPE_CHECKING:  # the run this module speaks of (setup builds it, then calls these)
    from densetrain.train.setup import Run


MAX_EPOCHS = 4.0
"""Planned passes over a source's train tokens beyond which a run is warned: Muennighoff et al. 2023 ("Scaling
Data-Constrained Language Models") find up to ~4 epochs about as good as unique data, and quickly less after."""


def planned_epochs(stages: list[Stage], streams: dict[str, TokenFiles], steps: int) -> dict[str, float]:
    """Passes over each source's train tokens that ``steps`` optimizer steps of the stage table plan: for every
    stage, its steps x ``batch_tokens`` x the source's mix weight, over ``len(streams[source])`` tokens."""
    ends = [st.start_step for st in stages[1:]] + [steps]
    planned: dict[str, float] = {}
    for st, end in zip(stages, ends, strict=True):
        for name, weight in st.mix.items():
            planned[name] = planned.get(name, 0.0) + (end - st.start_step) * st.batch_tokens * weight
    return {name: tokens / len(streams[name]) for name, tokens in planned.items()}


def warn_repeats(run: Run, steps: int) -> None:
    """One event on a fresh run whose plan passes over some source more than :data:`MAX_EPOCHS` times: its
    validation loss then measures memorisation as much as learning (a demo-sized corpus under a long run)."""
    epochs = planned_epochs(run.stages, run.train_streams, steps)
    over = {name: e for name, e in epochs.items() if e > MAX_EPOCHS}
    if over:
        run.log.event(run.state.step, "WARNING: the plan repeats training data: "
                      + ", ".join(f"'{n}' {e:.1f} epochs ({len(run.train_streams[n]):,} train tokens)"
                                  for n, e in sorted(over.items(), key=lambda kv: -kv[1]))
                      + f"; more than {MAX_EPOCHS:g} passes gain little over fewer (Muennighoff et al. 2023) and "
                      f"val loss then reflects memorisation too: prepare more data or train fewer steps",
                      kind="data", values={"epochs": {n: round(e, 2) for n, e in epochs.items()}})


def log_restart(run: Run, logged: int | None) -> None:
    """Under torchrun's elastic agent (``TORCHELASTIC_RESTART_COUNT`` > 0): one ``restart`` event naming the
    attempt, the step resumed from and the steps redone (``logged``: the last step the previous attempt
    recorded in metrics.jsonl, read before the resume rewound it; None when unknown)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt < 1:
        return
    step = run.state.step
    redone = max(0, logged - step) if logged is not None else None
    run.log.event(step, f"restart attempt {attempt} (TORCHELASTIC_RESTART_COUNT): continuing from step {step}"
                        + (f"; {redone} step(s) redone (the previous attempt had reached step {logged})"
                           if redone is not None else ""),
                  kind="restart", values={"attempt": attempt, "step": step, "redone_steps": redone,
                                          "previous_step": logged})


def layout_words(lay) -> str:
    """How a resolved :class:`~densetrain.parallel.mesh.Layout` splits the work, in words (the wrapper
    :func:`densetrain.parallel.build_parallel_model` applies for it), e.g. ``FSDP2: fully_shard over 2
    data-parallel ranks``."""
    parts = []
    if lay.dp_shard > 1:
        parts.append(f"HSDP: FSDP2 shard groups of {lay.dp_shard} ranks, {lay.dp_replicate} replicas"
                     if lay.dp_replicate > 1 else f"FSDP2: fully_shard over {lay.dp_shard} data-parallel ranks")
    elif lay.uses_fsdp:
        parts.append(f"FSDP2 without parameter sharding ({lay.dp_size} data-parallel replica(s); it reduces the "
                     "tensor- or context-parallel gradients)")
    elif lay.dp_size > 1:
        parts.append(f"DDP: {lay.dp_size} replicas")
    if lay.tp > 1:
        parts.append(f"tensor parallel {lay.tp}")
    if lay.cp > 1:
        parts.append(f"context parallel {lay.cp}")
    if getattr(lay, "pp", 1) > 1:
        parts.append(f"pipeline parallel: {lay.pp} stages")
    return ", ".join(parts) or "one process, no parallelism"


def log_decisions(run: Run, saved: dict | None, ckpt: Path | None, keep_layout_intent: bool) -> None:
    """What this start decided, said once each: the layout (unless :func:`log_layout` said it), the
    parameters of each optimizer, and on a resume the RNG state of each rank."""
    if not (saved and keep_layout_intent and layout_moved(run, saved)):
        _log_layout_used(run, saved)
    groups, values = describe_groups(run.optimizer, run.cfg.optim.peak_lr)
    run.log.event(run.state.step, f"optimizer: {groups}", kind="optimizer", values={"groups": values})
    if saved:
        _log_rng(run, ckpt)


def _log_layout_used(run: Run, saved: dict | None) -> None:
    """The start's one line on the layout (fresh or resumed, any layout), when :func:`log_layout` said none."""
    lay, world = run.info.layout, run.info.world_size
    was_world, was = (saved.get("world_size"), saved.get("layout")) if saved else (None, None)
    note = ""
    if saved is not None and layout_moved(run, saved):  # resumed with --parallel.* flags on another layout
        note = f" (checkpoint written on {was_world} process(es)" + (
            f" as dp_replicate={was['dp_replicate']} dp_shard={was['dp_shard']} tp={was['tp']})"
            if isinstance(was, dict) else ")")
    if lay.pp == 1 and run.cfg.parallel.pp_grad_sync != "last":  # read by pipeline stages only
        note += f"; parallel.pp_grad_sync = '{run.cfg.parallel.pp_grad_sync}' ignored: no pipelining (pp 1)"
    run.log.event(run.state.step, f"layout: {world} process(es) as {lay}: {layout_words(lay)}{note}",
                  kind="parallel", values={"layout": dataclasses.asdict(lay), "world_size": world,
                                           "checkpoint_world_size": was_world, "checkpoint_layout": was})


def _log_rng(run: Run, ckpt: Path) -> None:
    """One line on the resumed RNG state: restored on the ranks whose ``rng_<rank>.json`` the checkpoint
    holds; a rank beyond the processes that wrote it (a resume on more of them) keeps the state its process
    started with (torch's default seed; nothing in the step draws from it today)."""
    saved = sorted(int(m[1]) for p in ckpt.glob("rng_*.json") if (m := re.fullmatch(r"rng_(\d+)\.json", p.name)))
    world = run.info.world_size
    fresh = [r for r in range(world) if r not in saved]
    unused = [r for r in saved if r >= world]
    text = ("RNG state restored from the checkpoint on every rank" if not fresh else
            f"RNG state restored on {world - len(fresh)} of {world} ranks; rank(s) {fresh} have none in "
            f"{ckpt.name} (written by {len(saved)} process(es)) and keep their process's initial state")
    if unused:
        text += f"; the saved states of rank(s) {unused} are not used on {world} process(es)"
    run.log.event(run.state.step, text, kind="resume",
                  values={"rng_restored": [r for r in range(world) if r in saved], "rng_fresh": fresh,
                          "rng_unused": unused})


def layout_moved(run: Run, saved: dict) -> bool:
    """The run resumes on another world size or layout than the checkpoint ``saved`` records."""
    world = run.info.world_size
    return not (saved.get("world_size", world) == world
                and saved.get("layout") in (None, dataclasses.asdict(run.info.layout)))


def log_layout(run: Run, saved: dict) -> None:
    """One line (console and events.jsonl) when a resume runs on another world size or layout than the
    checkpoint's: the layout chosen and the checkpoint's, each with what it does in words (:func:`layout_words`),
    and whether the configured degrees held or this is the layout of :func:`layout_keeping_intent` for them."""
    # The configured degrees of the stage it resumes in (its own, stages[i].parallel, or [parallel]).
    p = stage_parallel(run.cfg, stage_at(min(run.state.step, run.cfg.train.steps - 1), run.stages).index)
    lay, world = run.info.layout, run.info.world_size
    was_world = saved.get("world_size", world)
    was = saved.get("layout")
    if not layout_moved(run, saved):
        return
    try:
        as_configured = resolve_layout(p.dp_replicate, p.dp_shard, p.tp, world, cp=p.cp, pp=p.pp) == lay
    except ValueError:
        as_configured = False
    try:  # the checkpoint's own resolved degrees (validated integers >= 1), in words as this start's
        was_lay = Layout(**was) if was else None
    except TypeError:  # a checkpoint of another version's degree names: the numbers alone
        was_lay = None
    written = f"{was_world} process(es)" + (f" as {was_lay}: {layout_words(was_lay)}" if was_lay else "")
    configured = f"dp_replicate={p.dp_replicate} dp_shard={p.dp_shard} tp={p.tp}"
    run.log.event(run.state.step, f"layout on {world} process(es): {lay}: {layout_words(lay)} (checkpoint written "
                                  f"on {written}); " + (f"the configured {configured}" if as_configured else
                                                        f"the configured {configured} does not fit {world} "
                                                        "process(es): the layout closest to it that runs"),
                  kind="layout", values={"layout": dataclasses.asdict(lay), "world_size": world,
                                         "checkpoint_world_size": was_world, "checkpoint_layout": was})


def log_resume(run: Run, ckpt: Path, saved: dict) -> None:
    step = run.state.step
    run.log.event(step, f"resumed from {ckpt} (step {step}, {run.state.tokens} tokens)", kind="resume")
    changed = sorted(k for k, v in saved.get("data", {}).items() if run.data_id.get(k) != v)
    if changed:  # the sampler's positions now point into other documents: never let that pass unseen
        run.log.event(step, f"WARNING: the training shards of {changed} changed since {ckpt.name} (re-prepared?); "
                            "the run continues at the saved positions, which now index different text")
