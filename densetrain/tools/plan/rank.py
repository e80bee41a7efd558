"""The dry run of one rank of a job (``densetrain train --dry-run --world-size N --rank R``): the real mesh
on a fake process group (torch's ``FakeStore`` and ``fake`` backend: every collective returns at once), the
model built on the meta device and parallelised exactly as that rank would (pipeline stage, tensor
parallel, FSDP2), and what it then holds: its mesh coordinates, stages and blocks, the shard shape of
each parameter, its parameter, gradient and AdamW bytes beside the planner's
(:func:`~densetrain.tools.plan.memory.layout_memory`), and the planner's activation bytes per stage. No data,
no GPU; a layout that cannot be built fails here with the launch's one-line error.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager

from densetrain.errors import ConfigError
from densetrain.parallel.dist import init_distributed
from densetrain.parallel.mesh import resolve_layout
from densetrain.parallel.parallelize import build_parallel_model
from densetrain.parallel.pipeline import rank_stages
from densetrain.parallel.stage_layout import stage_layouts
from densetrain.tools.plan.memory import GIB, RESERVED_GIB, USABLE_FRACTION, layout_memory, model_counts, pipeline_fit
from densetrain.train.startlog import layout_words


def world_words(parallel, world: int, given: bool = True) -> str | None:
    """Why the ``parallel`` degrees have no layout at ``world`` processes, in words with the nearest world sizes
    that have one; None when they resolve. ``given``: whether the world size came from ``--world-size`` or
    ``WORLD_SIZE`` (else it is the one process of a plain run, said so)."""
    p = parallel
    try:
        resolve_layout(p.dp_replicate, p.dp_shard, p.tp, world, p.cp, p.pp)
        return None
    except ValueError as e:
        fixed = {k: v for k, v in (("pp", p.pp), ("dp_replicate", p.dp_replicate), ("dp_shard", p.dp_shard),
                                   ("cp", p.cp), ("tp", p.tp)) if v > 1}
        prod = 1
        for v in fixed.values():
            prod *= v
        where = f"{world} process{'es' if world != 1 else ''}" + ("" if given else " (no --world-size or WORLD_SIZE "
                                                                                     "given: a plain run)")
        if prod <= 1 or world % prod == 0:
            return f"parallel: no layout of {where}: {e}"
        lo, hi = world // prod * prod, (world // prod + 1) * prod
        sizes = f"{lo} or {hi}" if lo else f"{hi}"
        degrees = " x ".join(f"{k} {v}" for k, v in fixed.items())
        return (f"parallel: {degrees} = {prod} processes per model replica does not divide {where}; the nearest "
                f"world sizes that run it are {sizes} (or change the degrees)")


def parse_ranks(text: str, world: int) -> list[int]:
    """``'0,517,-1'`` -> ``[0, 517, world - 1]`` (negative counts from the end).

    Raises: ConfigError for a rank outside the world or not an integer."""
    out = []
    for part in text.split(","):
        try:
            r = int(part)
        except ValueError:
            raise ConfigError(f"--ranks: '{part}' is not a rank (integers, comma-separated; -1 the last)") from None
        r = r + world if r < 0 else r
        if not 0 <= r < world:
            raise ConfigError(f"--ranks: {part} is not a rank of --world-size {world}")
        out.append(r)
    return out


@contextmanager
def fake_world(world: int, rank: int):
    """A fake process group of ``world`` ranks in which this process is ``rank`` (and ``WORLD_SIZE``/``RANK``
    set as a launcher would), torn down on exit."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    saved = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK="0")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def dry_run_rank(cfg, world: int, rank: int, gpus_per_node: int = 8) -> dict:
    """Build rank ``rank`` of a ``world``-rank job of ``cfg`` on meta (module docstring) and report it.

    Bytes: ``params_bytes`` is what the rank allocates for its parameters, FSDP2's shards padded to the largest
    (dim 0 rounded up to a multiple of the shard group: the last ranks hold padding, not fewer bytes);
    ``unpadded_bytes`` the parameters' own elements; gradients and AdamW moments are counted unpadded. ``groups``:
    per mesh dimension of size > 1 the global ranks of this rank's group, ``nodes`` their node (``rank //
    gpus_per_node``). PyTorch's warnings about the fake process group (timeouts it does not support) are
    silenced: they are about the fake backend, not the job.

    Returns:
        ``{"rank", "layout", "coords", "parts", "shards": [(name, global shape, local shape)], "params_bytes",
        "unpadded_bytes", "grads_bytes", "optim_bytes", "groups", "gpus_per_node", "planned": {stage name:
        layout_memory of this pipeline rank}}``.
    Raises:
        ConfigError: the layout does not resolve at ``world`` ranks (with the nearest world sizes that do), or
        cannot be built.
    """
    from torch.distributed.tensor import DTensor

    from densetrain.schedule import resolve_stages

    p = cfg.parallel
    if (why := world_words(p, world)) is not None:
        raise ConfigError(why)
    layout = resolve_layout(p.dp_replicate, p.dp_shard, p.tp, world, p.cp, p.pp)
    with warnings.catch_warnings(), fake_world(world, rank):
        warnings.simplefilter("ignore")
        info = init_distributed("cpu", p)
        try:
            model, _ = build_parallel_model(cfg, info, meta=True)
        except ValueError as e:  # e.g. a tensor-parallel degree that does not divide the heads
            raise ConfigError(f"parallel: rank {rank} of {world} cannot be built: {e}") from None
        shards = []
        local = padded = 0
        for name, prm in model.named_parameters():
            loc = prm.to_local() if isinstance(prm, DTensor) else prm
            shards.append((name, tuple(prm.shape), tuple(loc.shape)))
            local += loc.numel()
            padded += loc.untyped_storage().nbytes()  # FSDP2's padded shard: the storage, not the view
        groups = {d: info.mesh[d].mesh.flatten().tolist() for d in info.mesh.mesh_dim_names
                  if info.mesh[d].size() > 1} if info.mesh is not None else {}
        virtual = p.pp_virtual_stages if layout.pp > 1 else 1
        stages = rank_stages(info.pp_rank, layout.pp, virtual)
    counts = model_counts(cfg.model)
    planned = {}
    stages_run = resolve_stages(cfg)
    # Each stage on the layout it runs on (its own, stages[i].parallel, or [parallel]'s), this rank's pipeline
    # coordinate on it read from the mesh's row-major order (pp outermost, densetrain.parallel.mesh.build_mesh).
    for st, (par, lay) in zip(stages_run, stage_layouts(cfg, stages_run, world, skip_unfit_base=True)):
        par, lay = (p, layout) if lay is None else (par, lay)
        pipe, why = pipeline_fit(lay, st.batch_size, st.micro_batch_size, par)
        if pipe is None:
            planned[st.name] = {"error": why}
            continue
        mem = layout_memory(counts, cfg.model, st.seq_len, st.micro_batch_size, lay,
                            par.activation_checkpointing, mixed_precision=cfg.train.dtype != "fp32",
                            sequence_parallel=par.sequence_parallel and lay.tp > 1, pipeline=pipe,
                            pp_rank=rank // (world // lay.pp))
        planned[st.name] = {**mem, "bubble": pipe.get("bubble", 0.0), "seq_len": st.seq_len,
                            "layout": None if lay == layout else str(lay)}
    coords = {"pp": info.pp_rank, "dp": info.dp_rank, "cp": info.cp_rank, "tp": info.tp_rank}
    return {"rank": rank, "world": world, "layout": layout, "coords": coords, "stages": stages,
            "blocks": [int(k) for k in model.layers.keys()] if hasattr(model.layers, "keys")
            else list(range(len(model.layers))),
            "embedding": model.tok_embeddings is not None, "head": model.output is not None,
            "shards": shards, "params_bytes": padded, "unpadded_bytes": 4 * local, "grads_bytes": 4 * local,
            "optim_bytes": 8 * local, "groups": groups, "gpus_per_node": gpus_per_node, "planned": planned}


def rank_refusals(r: dict, gpu_memory_gib: float) -> list[str]:
    """Why rank ``r`` (:func:`dry_run_rank`'s result) cannot run a stage, one line each: a stage its layout does
    not run, and a stage whose planned bytes exceed the device's usable memory (the planner's budget:
    ``USABLE_FRACTION`` of ``gpu_memory_gib`` less ``RESERVED_GIB``, :mod:`~densetrain.tools.plan.memory`)."""
    usable = USABLE_FRACTION * gpu_memory_gib - RESERVED_GIB
    out = []
    for stage, m in r["planned"].items():
        if "error" in m:
            out.append(f"rank {r['rank']}, stage '{stage}': does not run: {m['error']}")
        elif m["total"] / GIB > usable:
            out.append(f"rank {r['rank']}, stage '{stage}': needs {m['total'] / GIB:.2f} GiB, over the device's "
                       f"{gpu_memory_gib:g} GiB ({usable:.1f} GiB usable)")
    return out


def _runs(ids: list[int]) -> str:
    """``[0, 1, 2, 64, 65]`` -> ``'0-2, 64-65'``; an even stride over 3: ``[0, 8, 16, 24]`` -> ``'0, 8, ..., 24
    (stride 8)'``."""
    if len(ids) > 3 and ids[1] - ids[0] > 1 and all(b - a == ids[1] - ids[0] for a, b in zip(ids, ids[1:])):
        return f"{ids[0]}, {ids[1]}, ..., {ids[-1]} (stride {ids[1] - ids[0]})"
    out, start = [], None
    for i, k in enumerate(ids):
        start = k if start is None else start
        if i + 1 == len(ids) or ids[i + 1] != k + 1:
            out.append(f"{start}-{k}" if k > start else f"{k}")
            start = None
    return ", ".join(out)


def format_rank(r: dict, shards: int = 12) -> str:
    """The text of :func:`dry_run_rank`'s result: the rank's place, its stages and blocks, the first
    ``shards`` parameter shards, and bytes (built vs planned)."""
    g = lambda b: f"{b / GIB:.2f}" if b >= GIB / 100 else f"{b / GIB:.2e}"
    blocks = r["blocks"]
    held = ", ".join((["embedding"] if r["embedding"] else [])
                     + ([f"blocks {_runs(blocks)} ({len(blocks)})"] if blocks else [])
                     + (["final norm + head"] if r["head"] else []))
    c = r["coords"]
    pad = r["params_bytes"] - r["unpadded_bytes"]
    lines = [f"rank {r['rank']} of {r['world']} ({r['layout']}: {layout_words(r['layout'])}): pp rank {c['pp']}, "
             f"dp rank {c['dp']}, cp rank {c['cp']}, tp rank {c['tp']}, node {r['rank'] // r['gpus_per_node']} "
             f"({r['gpus_per_node']} GPUs a node)",
             f"  pipeline stage(s) {r['stages']}: {held}"]
    for dim, members in r["groups"].items():
        nodes = sorted({m // r["gpus_per_node"] for m in members})
        lines.append(f"  {dim} group: ranks {_runs(members) if members == sorted(members) else members} on node"
                     f"{'s' if len(nodes) > 1 else ''} {_runs(nodes)}")
    lines += [f"  built: parameters {r['params_bytes']:,} bytes ({g(r['params_bytes'])} GiB"
              + (f"; {pad:,} of them FSDP2's padding to the largest shard" if pad else "") + "), gradients "
              f"{r['grads_bytes']:,} bytes ({g(r['grads_bytes'])} GiB), AdamW moments {r['optim_bytes']:,} bytes "
              f"({g(r['optim_bytes'])} GiB) (fp32)"]
    for name, full, local in r["shards"][:shards]:
        lines.append(f"    {name:<40} {str(list(full)):<16} -> {list(local)}")
    if len(r["shards"]) > shards:
        lines.append(f"    ... {len(r['shards']) - shards} more parameters")
    for stage, m in r["planned"].items():
        if "error" in m:
            lines.append(f"  planned at stage '{stage}': does not run: {m['error']}")
            continue
        on = f", on its own layout {m['layout']}" if m.get("layout") else ""
        lines.append(f"  planned at stage '{stage}' (seq_len {m['seq_len']}{on}): parameters {g(m['params'])}, "
                     f"optimizer {g(m['optim'])}, transient {g(m['transient'])}, activations "
                     f"{g(m['activations'])}, total {g(m['total'])} GiB"
                     + (f"; bubble {m['bubble']:.1%}" if m["bubble"] else ""))
    return "\n".join(lines)


