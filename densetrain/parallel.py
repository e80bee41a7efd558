"""Process group, device choice and wrapping the model for data parallelism.

The model code knows nothing of parallelism; this module applies it afterwards (the torchtitan
split). Under ``torchrun`` the environment variables ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` are set
and a process group is created (NCCL on GPUs, gloo on CPUs); a plain ``python`` run is world size 1
with no process group at all, through exactly the same training loop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: ``rank`` of ``world_size`` processes, ``device`` it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

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
    return DistInfo(rank, world, local_rank, dev)


def parallelize(model: nn.Module, info: DistInfo) -> nn.Module:
    """Wrap ``model`` for data parallelism (DDP) when ``world_size > 1``; identity otherwise.

    Gradients are averaged over ranks by DDP; the loss scaling in the training loop accounts for it.
    """
    if info.world_size == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    # The only buffers are the RoPE cos/sin cache, computed identically on every rank: no need to
    # broadcast them before each forward (DDP's default).
    return DDP(model, device_ids=[info.local_rank] if info.device.type == "cuda" else None, broadcast_buffers=False)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """In-place sum over ranks (no-op without a process group); returns ``t``."""
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t
