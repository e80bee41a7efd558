"""A layout per stage: each row of the stage table may set its own parallel degrees (``stages[i].parallel``,
the keys of ``[parallel]``; unset keys take ``[parallel]``'s). :func:`stage_layouts` resolves every stage's
layout at the launch's world size and refuses, before any compute, a layout that cannot run its stage; the
switch itself (checkpoint, new mesh, wrappers and optimizer, resharded reload) is
:func:`densetrain.train.setup.switch_layout`, beside the code that builds them the first time.

Stages are read duck-typed (``index``, ``name``, ``seq_len``, ``batch_size``, ``micro_batch_size`` of
:class:`densetrain.schedule.Stage`): the schedule sits on this package's floor.
"""

from __future__ import annotations

import dataclasses

from densetrain.config import Config, ParallelConfig, stage_parallel
from densetrain.errors import ConfigError
from densetrain.parallel.mesh import Layout, keep_intent, resolve_layout
from densetrain.parallel.parallelize import seq_len_divisor
from densetrain.parallel.pipeline import resolve_microbatches


def stage_layouts(cfg: Config, stages: list, world: int, base: ParallelConfig | None = None,
                  skip_unfit_base: bool = False, adapt: list[str] | None = None
                  ) -> list[tuple[ParallelConfig, Layout | None]]:
    """Each stage's parallel config (``[parallel]``, or ``base`` in its place, with the stage's own
    ``stages[i].parallel`` keys over it) and its layout of ``world`` ranks, checked to run that stage before
    any compute: the degrees multiply to ``world``, the tensor-parallel degree divides the heads, every
    sequence splits as context (and sequence) parallelism splits it, pipeline stages get layers, the batch
    splits over the data-parallel ranks and gives each pipeline rank enough micro-batches.

    ``skip_unfit_base``: a ``[parallel]`` that does not resolve at ``world`` gives its stages the layout None
    instead of the error (the dry run reports it in its own words).

    ``adapt`` (a plain ``--resume``, as ``base`` is then :func:`densetrain.train.setup.layout_keeping_intent`'s):
    a stage's own degrees that cannot run it at ``world`` are replaced by the layout closest to them that does
    (:func:`densetrain.parallel.mesh.keep_intent`, as ``[parallel]`` adapts on a resume at another world size);
    one line per stage adapted is appended to the list, for the caller to log.

    Raises:
        ConfigError: one line; for a stage with a layout of its own it starts ``stage '<name>'
            (stages[i].parallel)``, for ``[parallel]`` it is the message of the launch's own check.
    """
    base = base or cfg.parallel
    out = []
    for st in stages:
        own = cfg.stages[st.index].parallel
        par = base
        where = f"stage '{st.name}' " + (f"(stages[{st.index}].parallel)" if own else "([parallel])")
        if own:  # the stage's own keys (type-checked by stage_parallel) over base
            merged = stage_parallel(cfg, st.index)
            par = dataclasses.replace(base, **{k: getattr(merged, k) for k in own})
            if adapt is not None:
                par = _adapted(cfg, st, par, world, where, adapt)
        try:
            lay = resolve_layout(par.dp_replicate, par.dp_shard, par.tp, world, par.cp, par.pp)
        except ConfigError as e:
            if not own and skip_unfit_base:
                out.append((par, None))
                continue
            if not own:
                raise  # [parallel]'s own message, as the launch has always said it
            raise ConfigError(f"{where}: {e}") from None
        problem = stage_layout_problem(cfg, st, par, lay)
        if problem:
            raise ConfigError(f"{where}: {lay} cannot run it: {problem}")
        out.append((par, lay))
    return out


def _fits(cfg: Config, st, par: ParallelConfig, world: int) -> bool:
    try:
        lay = resolve_layout(par.dp_replicate, par.dp_shard, par.tp, world, par.cp, par.pp)
    except ConfigError:
        return False
    return _problem(cfg.model, st, par, lay) is None


def _adapted(cfg: Config, st, par: ParallelConfig, world: int, where: str, notes: list[str]) -> ParallelConfig:
    """``par`` when it runs stage ``st`` on ``world`` ranks, else the closest layout that does (module
    :func:`stage_layouts`, ``adapt``), with the line saying so appended to ``notes``.

    Raises:
        ConfigError: no layout of ``world`` ranks runs the stage; names the stage and the key to set."""
    if _fits(cfg, st, par, world):
        return par

    def as_par(lay: Layout) -> ParallelConfig:
        return dataclasses.replace(par, dp_replicate=lay.dp_replicate, dp_shard=lay.dp_shard, tp=lay.tp, cp=lay.cp,
                                   pp=lay.pp)

    try:
        lay = keep_intent(par.dp_replicate, par.dp_shard, par.tp, world, lambda x: _fits(cfg, st, as_par(x), world),
                          cp=par.cp, pp=par.pp)
    except ConfigError:
        raise ConfigError(f"{where}: no layout of {world} process(es) close to pp={par.pp} dp_replicate="
                          f"{par.dp_replicate} dp_shard={par.dp_shard} cp={par.cp} tp={par.tp} runs it; set the "
                          f"stage's degrees with --stages.{st.index}.parallel.<key>=N (e.g. "
                          f"--stages.{st.index}.parallel.cp=1)") from None
    notes.append(f"{where}: the configured pp={par.pp} dp_replicate={par.dp_replicate} dp_shard={par.dp_shard} "
                 f"cp={par.cp} tp={par.tp} does not fit {world} process(es): the layout closest to it that runs "
                 f"is {lay} (config.toml keeps the configured degrees)")
    return as_par(lay)


def stage_layout_problem(cfg: Config, st, par: ParallelConfig, lay: Layout) -> str | None:
    """Why layout ``lay`` (of config ``par``) cannot run stage ``st``, in words, or None; a batch that does not
    split names the layouts that would run it (:func:`layouts_that_fit`)."""
    problem = _problem(cfg.model, st, par, lay)
    if problem and problem.startswith("its batch of"):
        prefix = f"--stages.{st.index}.parallel." if cfg.stages[st.index].parallel else "--parallel."
        problem += "; " + layouts_that_fit(lay.world, st, cfg.model, par, prefix)
    return problem


def _problem(m, st, par: ParallelConfig, lay: Layout) -> str | None:
    """:func:`stage_layout_problem` for model config ``m``, without advice."""
    for k in ("n_heads", "n_kv_heads", "d_ff", "vocab_size"):
        if getattr(m, k) % lay.tp:
            return f"tp {lay.tp} does not divide model.{k} ({getattr(m, k)})"
    need = seq_len_divisor(lay, par.sequence_parallel)
    if st.seq_len % need:
        return f"seq_len {st.seq_len} does not split into {need} equal parts (cp {lay.cp}, tp {lay.tp})"
    rows = lay.dp_size * st.micro_batch_size
    if st.batch_size % rows:
        return (f"its batch of {st.batch_size} sequences does not split into {lay.dp_size} data-parallel ranks x "
                f"micro_batch_size {st.micro_batch_size}")
    if lay.pp > 1 and m.tie_embeddings:  # as config.validate refuses it: never advise a layout it refuses
        return "pipeline stages cannot share the tied embedding and head (model.tie_embeddings)"
    if lay.pp > 1:
        try:
            resolve_microbatches(par.pp_microbatches, lay.pp, par.pp_virtual_stages, st.batch_size // rows,
                                 f" at stage '{st.name}'")
        except ConfigError as e:
            return str(e)
        n_stages = lay.pp * par.pp_virtual_stages
        if m.n_layers + 2 < n_stages:
            return f"{n_stages} pipeline stages need as many layers; model.n_layers + 2 is {m.n_layers + 2}"
    return None


def layouts_that_fit(world: int, st, model, par: ParallelConfig | None = None, prefix: str = "--parallel.") -> str:
    """Advice for stage ``st`` whose batch does not split over its data-parallel ranks
    (:func:`stage_layout_problem`, :func:`densetrain.train.setup.check_stages`): up to three layouts of
    ``world`` ranks that run it (every split into pipeline, context and tensor parallelism, the rest
    data-parallel, checked as :func:`stage_layout_problem` checks a layout, with ``par``'s other settings),
    the most data-parallel first, as the flags (``prefix``: ``--parallel.`` or ``--stages.N.parallel.``)
    that set them; or that none does."""
    par = par or ParallelConfig()
    divisors = lambda n: [x for x in range(1, n + 1) if n % x == 0]  # noqa: E731
    fits = [Layout(1, world // (pp * cp * tp), tp, cp, pp) for pp in divisors(world) for cp in divisors(world // pp)
            for tp in divisors(world // (pp * cp))]
    fits = sorted((x for x in fits if _problem(model, st, par, x) is None),
                  key=lambda x: (x.tp * x.cp * x.pp, x.pp, x.cp))
    if not fits:
        return f"no layout of {world} ranks runs it: change the stage's batch_tokens or the number of ranks"
    return "layouts that run it: " + " | ".join(
        f"{prefix}dp_replicate=1 {prefix}dp_shard={x.dp_shard} {prefix}tp={x.tp} {prefix}cp={x.cp} {prefix}pp={x.pp}"
        for x in fits[:3])
