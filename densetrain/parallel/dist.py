"""Process group, device mesh and ranks: where this process sits, reductions, and even splits of work."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from densetrain.parallel.mesh import Layout, build_mesh, resolve_layout, shard_cp_mesh


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits.

    Attributes:
        rank, world_size: global rank and number of processes.
        local_rank: rank on this node (the CUDA device index).
        device: the device it computes on.
        dp_rank, dp_size: data-parallel rank and degree (``dp_replicate * dp_shard``): the processes that
            see different data. Tensor-parallel ranks of one data-parallel rank share its batch.
        tp_rank, tp_size: coordinate and degree along the tensor-parallel dimension.
        cp_rank, cp_size: coordinate and degree along the context-parallel dimension: the ranks of one
            data-parallel rank that hold different parts of the same sequences (:mod:`densetrain.parallel.context`).
        layout: the resolved :class:`~densetrain.parallel.mesh.Layout` (degrees whose product is the world).
        mesh: the ``DeviceMesh`` (dims ``pp, dp_replicate, dp_shard, cp, tp``), None in a single process.
        pp_rank, pp_size: pipeline rank (which stages this process holds) and degree; the ranks of one
            data-parallel rank at different pipeline ranks see the same batch.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    dp_rank: int = 0
    dp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    layout: Layout = Layout(1, 1, 1)
    mesh: object = None
    cp_rank: int = 0
    cp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def grad_scale(self) -> int:
        """Ranks the data-parallel gradient reduction averages over (``dp_size * cp_size``): the step
        multiplies its objective by this to turn their mean back into the global sum."""
        return self.dp_size * self.cp_size

    @property
    def cp_mesh(self):
        """The 1-D context-parallel ``DeviceMesh`` (None when ``cp_size`` is 1)."""
        return self.mesh["cp"] if self.cp_size > 1 else None

    @property
    def pp_group(self):
        """The pipeline process group (the ``pp`` mesh dim), None when ``pp_size`` is 1."""
        return self.mesh["pp"].get_group() if self.pp_size > 1 else None


# The layout of this process, set once by init_distributed: the reductions below and dp_rank_size need
# the tensor-parallel coordinate, and the evals call them without a DistInfo at hand.
_CURRENT = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "timeout_s": 600.0}


def collective_timeout() -> timedelta:
    """How long a collective of this job waits for the other ranks (``parallel.timeout_s``, set by
    :func:`init_distributed`; 600 s before it): for the process groups created outside this module (the
    checkpointer's async-save group), so that every group densetrain creates has the same limit."""
    return timedelta(seconds=_CURRENT["timeout_s"])


def set_group_timeouts(mesh, timeout: timedelta, flattened: bool = False) -> None:
    """Apply ``timeout`` to every process group of ``mesh`` (one per dim, and with ``flattened`` the
    ``dp_shard_cp`` dim :func:`~densetrain.parallel.mesh.build_mesh` flattens when cp > 1).

    Why: ``init_device_mesh`` creates its subgroups with torch's per-backend default (30 minutes for gloo, 10
    for NCCL), not the default group's timeout, so a hang in a tensor-parallel collective would outlast
    ``parallel.timeout_s``; torchtitan's ``set_pg_timeouts`` does the same with the same torch call."""
    groups = list(mesh.get_all_groups()) + ([shard_cp_mesh(mesh).get_group()] if flattened else [])
    for g in groups:
        dist.distributed_c10d._set_pg_timeout(timeout, g)


def init_distributed(device: str = "auto", parallel=None) -> DistInfo:
    """Initialise torch.distributed when launched by torchrun, pick the device, build the mesh.

    Args:
        device: 'auto' (cuda when available), 'cpu' or 'cuda'.
        parallel: a :class:`~densetrain.config.schema.ParallelConfig` (None: every rank a DDP replica).
    Raises:
        ConfigError: 'cuda' requested but not available; the layout's degrees do not multiply to the world
            size (the message lists layouts that do).

    Every process group it creates (the world and the mesh's) waits ``parallel.timeout_s`` in a collective
    before failing (:func:`set_group_timeouts`).
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        from densetrain.errors import ConfigError

        raise ConfigError("train.device is 'cuda' but torch sees no CUDA device here (torch "
                          f"{torch.__version__}); use train.device = 'auto' or 'cpu'")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if parallel is None:
        layout = resolve_layout(-1, 1, 1, world)
    else:
        layout = resolve_layout(parallel.dp_replicate, parallel.dp_shard, parallel.tp, world, parallel.cp,
                                getattr(parallel, "pp", 1))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    mesh = None
    if parallel is not None:
        _CURRENT["timeout_s"] = float(getattr(parallel, "timeout_s", 600.0))
    if world > 1:
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device == "cuda" else "gloo", timeout=collective_timeout())
        mesh = build_mesh(layout, dev.type)
        set_group_timeouts(mesh, collective_timeout(), flattened=layout.cp > 1)
    # Row-major mesh with pp outermost, tp innermost, then cp: rank = pp_rank * (world / pp) + inner,
    # inner = (dp_rank * cp + cp_rank) * tp + tp_rank (init_device_mesh's arange layout).
    stage_ranks = world // layout.pp
    pp_rank, inner = rank // stage_ranks, rank % stage_ranks
    tp_rank, cp_rank, dp_rank = inner % layout.tp, (inner // layout.tp) % layout.cp, inner // (layout.tp * layout.cp)
    _CURRENT.update(tp_rank=tp_rank, tp_size=layout.tp, pp_rank=pp_rank, pp_size=layout.pp)
    return DistInfo(rank, world, local_rank, dev, dp_rank=dp_rank, dp_size=layout.dp_size, tp_rank=tp_rank,
                    tp_size=layout.tp, layout=layout, mesh=mesh, cp_rank=cp_rank, cp_size=layout.cp,
                    pp_rank=pp_rank, pp_size=layout.pp)


def dp_rank_size() -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) of this process: (0, 1) without a process group.

    Tensor-parallel ranks of one data-parallel rank get the same answer, so they take the same share of
    evaluation work and run the same forward calls (each forward is a collective among them).
    Context-parallel ranks count as data-parallel ranks here: evaluation runs whole sequences on each
    (the model's own attention), so they take different shares.
    """
    if dist.is_available() and dist.is_initialized():
        tp, stage_ranks = _CURRENT["tp_size"], dist.get_world_size() // _CURRENT["pp_size"]
        return (dist.get_rank() % stage_ranks) // tp, stage_ranks // tp  # pipeline ranks share a dp rank
    return 0, 1


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """In-place sum over the data-parallel ranks (no-op without a process group); returns ``t``.

    ``t`` is a per-batch quantity (token counts, loss sums), the same on the tensor-parallel ranks of
    one data-parallel rank, which share a batch. So only tensor-parallel rank 0 contributes (the others
    add zeros) and one world-wide all-reduce gives every rank the data-parallel sum; summing copies
    would count each batch ``tp`` times. A flag set by global rank 0 only (tensor-parallel rank 0)
    reaches every rank, too. Pipeline ranks of one data-parallel rank share its batch as well: only
    pipeline rank 0 contributes (what only the last stage computes, the loss, is first summed over the
    pipeline group by the caller, :func:`densetrain.train.step.reduce_stats`).
    """
    if dist.is_available() and dist.is_initialized():
        if _CURRENT["tp_rank"] != 0 or _CURRENT["pp_rank"] != 0:
            t.zero_()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def sum_over_group(t: torch.Tensor, group) -> torch.Tensor:
    """In-place sum over ``group`` (e.g. the pipeline stages: what only the last stage computes, handed to
    every stage); a no-op when ``group`` is None. Returns ``t``."""
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """In-place maximum over ranks (no-op without a process group); returns ``t``. Copies held by
    tensor-parallel ranks do not change a maximum."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def even_split(n_items: int, rank: int, size: int) -> list[int | None]:
    """This rank's share of ``n_items`` items, padded so that every rank gets the same count.

    Items are dealt round-robin (item ``i`` to rank ``i % size``); ranks whose share is one short get
    ``None`` at the end, where the caller runs the same forward call on a stand-in item and discards
    the result. Under FSDP/TP every forward is a collective, so ranks that ran different numbers of
    forward calls would hang; under DDP the padding only costs the idle time it replaces.

    Returns:
        ``ceil(n_items / size)`` entries: item indices, then ``None`` padding.
    """
    per_rank = -(-n_items // size) if n_items else 0
    mine: list[int | None] = list(range(rank, n_items, size))
    return mine + [None] * (per_rank - len(mine))
