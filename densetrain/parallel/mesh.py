"""The parallel layout: degrees ``pp x dp_replicate x dp_shard x cp x tp`` resolved against the world
size, and the one ``DeviceMesh`` built from them.

The mesh is row-major with ``pp`` (pipeline stages) outermost: its point-to-point activations are the
lightest traffic, so its groups may cross nodes the most. ``tp`` is innermost, so the ranks of one
tensor-parallel group are consecutive (on one node, over the fastest link: NVLink), then the
context-parallel group (its K/V all-gather is the next heaviest traffic), then the FSDP shard group,
then replicas (HSDP's all-reduce crosses nodes the least often, after pipeline stages). Global rank
``r`` of ``W`` sits at pipeline stage ``r // (W / pp)``, and within its stage's ``W / pp`` ranks at
``(i // (dp_shard * cp * tp), (i // (cp * tp)) % dp_shard, (i // tp) % cp, i % tp)`` with ``i = r % (W / pp)``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterator

from densetrain.errors import ConfigError

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Layout:
    """Resolved degrees (each >= 1); their product is the world size. ``cp`` (context parallel) and ``pp``
    (pipeline stages) come last so that three-degree layouts ``Layout(dp_replicate, dp_shard, tp)`` keep
    meaning what they did."""

    dp_replicate: int
    dp_shard: int
    tp: int
    cp: int = 1
    pp: int = 1

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: processes that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def uses_fsdp(self) -> bool:
        """FSDP2 (``fully_shard``) applies: parameters are sharded, or tensor parallel needs its DTensor
        parameters reduced over data-parallel ranks (DDP does not take DTensors), or context-parallel
        ranks (which see different tokens of the same rows) need their gradients summed, or a pipeline
        stage has data-parallel peers (one gradient reduction for all the stage's micro-batches)."""
        return self.dp_shard > 1 or self.cp > 1 or ((self.tp > 1 or self.pp > 1) and self.dp_size > 1)

    def __str__(self) -> str:
        pp = f"pp={self.pp} " if self.pp > 1 else ""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        return f"{pp}dp_replicate={self.dp_replicate} dp_shard={self.dp_shard}{cp} tp={self.tp}"


def divisor_layouts(world: int, max_tp: int = 8) -> list[Layout]:
    """Every layout of ``world`` ranks without replication beyond FSDP: ``(1, world / tp, tp)`` for the
    tensor-parallel degrees ``tp`` (powers of two up to ``max_tp``) that divide ``world``."""
    out, tp = [], 1
    while tp <= min(max_tp, world):
        if world % tp == 0:
            out.append(Layout(1, world // tp, tp))
        tp *= 2
    return out


def resolve_layout(dp_replicate: int, dp_shard: int, tp: int, world: int, cp: int = 1, pp: int = 1, *,
                   of_world: int | None = None) -> Layout:
    """Fill the one ``-1`` degree (if any) and check that the product is ``world``. The pipeline degree
    ``pp`` is never filled: it must divide ``world``, and the other degrees lay out ``world / pp`` ranks
    (``of_world``: the whole world those ``world`` ranks are one pipeline stage of, for the messages).

    Raises:
        ConfigError: more than one -1, a degree that does not divide, or a product other than ``world``;
            the message names layouts that fit.
    """
    if pp > 1:
        if world % pp:
            raise ConfigError(f"parallel.pp ({pp}) must divide the world size {world}")
        return dataclasses.replace(resolve_layout(dp_replicate, dp_shard, tp, world // pp, cp, of_world=world), pp=pp)
    # under pipelining the degrees lay out one stage's ranks: say so, not "the world size is" a number never given
    stage = "" if of_world is None else f"the world size {of_world} / pp {of_world // world}"
    size = f"the world size {world}" if of_world is None else f"{stage} = {world} ranks of a pipeline stage"
    size_is = f"the world size is {world}" if of_world is None else f"{stage} leaves {world} ranks a pipeline stage"
    given = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp, "cp": cp}
    fill = [k for k, v in given.items() if v == -1]
    fits = ", ".join(f"({lay})" for lay in divisor_layouts(world))
    if len(fill) > 1:
        raise ConfigError(f"parallel: {' and '.join(fill)} are all -1: at most one degree may be -1 (it fills the "
                          f"world size)")
    known = 1
    for k, v in given.items():
        if k not in fill:
            known *= v
    if fill:
        if world % known:
            fixed = " * ".join(f"{k} {v}" for k, v in given.items() if k not in fill)
            raise ConfigError(f"parallel: the fixed degrees {fixed} = {known} do not divide {size} "
                              f"({fill[0]} = -1 fills what they leave); layouts that fit: {fits}")
        given[fill[0]] = world // known
    layout = Layout(**given)
    if layout.world != world:
        raise ConfigError(f"parallel: dp_replicate * dp_shard * cp * tp = {layout.dp_replicate} * {layout.dp_shard} * "
                          f"{layout.cp} * {layout.tp} = {layout.world}, but {size_is}; layouts that "
                          f"fit: {fits}")
    return layout


def intent(dp_replicate: int, dp_shard: int, tp: int) -> str:
    """What configured degrees ask for, in words: how the data-parallel ranks share the state and the
    tensor-parallel degree (a ``-1`` fills the world size)."""
    deg = lambda v: "all" if v == -1 else str(v)
    if dp_shard == -1 or dp_shard > 1:
        dp = (f"HSDP: shard groups of {deg(dp_shard)}, replicas {deg(dp_replicate)}" if dp_replicate != 1
              else "FSDP2: parameters sharded over the data-parallel ranks")
    else:
        dp = "DDP: data-parallel ranks hold replicas"
    return dp + ("" if tp == 1 else f", tensor parallel {deg(tp)}")


def intent_layouts(dp_replicate: int, dp_shard: int, tp: int, world: int, cp: int = 1,
                   pp: int = 1) -> Iterator[Layout]:
    """Layouts of ``world`` ranks that keep the intent of the configured degrees (what a run asked for,
    resumed on another number of processes), most faithful first:

    1. the degrees themselves when they resolve at ``world`` (:func:`resolve_layout`: a ``-1`` fills);
    2. then, for the tensor-parallel degree ``tp`` or, where it does not divide ``world``, the largest of
       its divisors that does (``-1``: the divisors of ``world``), the data-parallel ranks ``d = world / tp``
       laid out as the run laid them: DDP replicas ``(d, 1)`` when it did not shard; when it sharded,
       HSDP keeping its shard-group size (replicas fill) or its replica count (shards fill), then FSDP2
       over all of them ``(1, d)``, the layout that needs the least memory per rank.

    The context-parallel degree ``cp`` is kept the same way (it, or its largest divisor that divides
    ``world``, before a smaller tensor-parallel degree is tried): it is what lets a long stage fit. The
    pipeline degree ``pp`` is kept first of all (it, then its divisors that divide ``world``): it is what
    lets the model's layers fit; the other degrees lay out the ``world / pp`` ranks of each stage.
    """
    if pp > 1:
        for p in sorted((x for x in range(1, pp + 1) if pp % x == 0 and world % x == 0), reverse=True):
            for lay in intent_layouts(dp_replicate, dp_shard, tp, world // p, cp):
                yield dataclasses.replace(lay, pp=p)
        return
    try:
        yield resolve_layout(dp_replicate, dp_shard, tp, world, cp=cp)
    except ConfigError:
        pass
    divisors = lambda n, of: sorted((x for x in range(1, n + 1) if n % x == 0 and of % x == 0), reverse=True)
    sharded = dp_shard == -1 or dp_shard > 1
    for c in divisors(cp if cp > 0 else world, world):
        top = tp if tp > 0 else world // c
        for t in divisors(top, world // c):
            d = world // (t * c)
            if not sharded:
                yield Layout(d, 1, t, c)
                continue
            if dp_replicate != 1 and dp_shard > 1 and d % dp_shard == 0:
                yield Layout(d // dp_shard, dp_shard, t, c)
            if dp_replicate > 1 and dp_shard == -1 and d % dp_replicate == 0:
                yield Layout(dp_replicate, d // dp_replicate, t, c)
            yield Layout(1, d, t, c)


def keep_intent(dp_replicate: int, dp_shard: int, tp: int, world: int, runs: Callable[[Layout], bool],
                cp: int = 1, pp: int = 1) -> Layout:
    """The first of :func:`intent_layouts` that ``runs`` accepts (e.g. every stage's batch splits over its
    data-parallel ranks, the tensor-parallel degree divides the model's heads).

    Raises:
        ConfigError: none does; one line naming the exact ``--parallel.*`` flags of layouts of ``world``
            ranks that run (any split, up to three), or saying that no layout of ``world`` ranks does.
    """
    for lay in intent_layouts(dp_replicate, dp_shard, tp, world, cp, pp):
        if runs(lay):
            return lay
    any_fit = [lay for t in range(1, world + 1) if world % t == 0
               for lay in (Layout(1, world // t, t), Layout(world // t, 1, t)) if runs(lay)]
    flags = [f"--parallel.dp_replicate={x.dp_replicate} --parallel.dp_shard={x.dp_shard} --parallel.tp={x.tp}"
             + (" --parallel.cp=1" if cp != 1 else "") for x in dict.fromkeys(any_fit)][:3]
    head = (f"parallel: no layout of {world} processes keeps the run's intent ({intent(dp_replicate, dp_shard, tp)}; "
            f"configured dp_replicate={dp_replicate} dp_shard={dp_shard} tp={tp}) and runs every stage")
    if not flags:
        raise ConfigError(f"{head}, nor does any other layout of {world} processes: resume on a number of "
                          f"processes whose data-parallel ranks divide every stage's batch of sequences")
    raise ConfigError(f"{head}; add to --resume one of: " + " | ".join(flags))


def build_mesh(layout: Layout, device_type: str):
    """The job's ``DeviceMesh`` with dims ``("pp", "dp_replicate", "dp_shard", "cp", "tp")`` (size-1 dims
    included, so every rank can name every dim), plus the flattened ``dp_shard_cp`` dim FSDP2 shards
    over when ``cp > 1``; the process group must exist."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (layout.pp, layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp),
                            mesh_dim_names=DIMS)
    if layout.cp > 1:
        shard_cp_mesh(mesh)  # torchtitan's way: FSDP2 over shards x cp ranks
    return mesh


def shard_cp_mesh(mesh):
    """The 1-D ``dp_shard_cp`` mesh (``dp_shard * cp`` ranks), flattened on first use.

    Why not ``mesh["dp_shard_cp"]``: slicing a flattened dim from the root mesh warns on every rank
    (``device_mesh.py``: "Slicing a flattened dim from root mesh will be deprecated in PT 2.11. Users need
    to bookkeep the flattened mesh directly"); ``_flatten`` is idempotent and returns the flattened mesh
    the root mesh keeps, so asking it again is the bookkeeping torch asks for."""
    return mesh["dp_shard", "cp"]._flatten("dp_shard_cp")


def dp_mesh(mesh, layout: Layout):
    """The sub-mesh FSDP2 reduces gradients over: 2-D ``(dp_replicate, dp_shard)`` for HSDP (replicate
    across, shard within), else the 1-D shard dim (or the replicate dim when only it is > 1). With
    context parallelism the shard dim is ``dp_shard_cp`` (``dp_shard * cp`` ranks): context-parallel
    ranks hold different tokens of the same rows, so their gradients are reduced like data-parallel
    ones, and they shard the parameters too (as in torchtitan)."""
    from torch.distributed.device_mesh import DeviceMesh

    shard = shard_cp_mesh(mesh) if layout.cp > 1 else mesh["dp_shard"]
    if layout.dp_replicate > 1 and (layout.dp_shard > 1 or layout.cp > 1):
        # The 2-D (dp_replicate, dp_shard_cp) mesh from the two 1-D meshes, reusing their process groups:
        # what slicing ``mesh["dp_replicate", "dp_shard_cp"]`` builds, without its deprecation warning.
        return DeviceMesh._concatenate([mesh["dp_replicate"], shard]) if layout.cp > 1 else \
            mesh["dp_replicate", "dp_shard"]
    return mesh["dp_replicate"] if layout.dp_replicate > 1 else shard
