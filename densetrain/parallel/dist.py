"""Process group and ranks: where this process sits, reductions, and even splits of work."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits.

    Attributes:
        rank, world_size: global rank and number of processes.
        local_rank: rank on this node (the CUDA device index).
        device: the device it computes on.
        dp_rank, dp_size: data-parallel rank and degree (module docstring of :mod:`densetrain.parallel`).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    dp_rank: int = 0
    dp_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str = "auto") -> DistInfo:
    """Initialise torch.distributed when launched by torchrun; pick the device.

    Args:
        device: 'auto' (cuda when available), 'cpu' or 'cuda'.
    Raises:
        RuntimeError: 'cuda' requested but not available.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA device is available")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")
    # Every rank is a data-parallel rank until tensor parallelism exists (it would divide dp_size).
    return DistInfo(rank, world, local_rank, dev, dp_rank=rank, dp_size=world)


def dp_rank_size() -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) of this process: (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """In-place sum over ranks (no-op without a process group); returns ``t``."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """In-place maximum over ranks (no-op without a process group); returns ``t``."""
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
