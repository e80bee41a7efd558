"""Norms of the full tensors from the parts each rank holds, whatever the layout: the one place that knows
how many ranks hold the same data (DDP replicas, FSDP2 / HSDP shards, tensor-parallel slices, context-
parallel ranks of an FSDP2 group). The grad norm (:func:`densetrain.parallel.wrap.clip_grad_norm`) and
the update and parameter norms of the update watcher (:mod:`densetrain.train.watch.updates`) go through it, so
every norm densetrain logs or judges is the norm of the full tensor on one process, and identical on every
rank (the result of one all-reduce).

Rule: a rank's local part of a tensor is held by ``copies`` ranks: a plain tensor (one process, a DDP
replica) by every rank of its pipeline stage (the whole world without pipeline stages), a DTensor by
``stage size / (product of the mesh sizes of its sharding placements)`` (its Replicate dimensions and
the mesh dimensions it is not on). Each rank adds its local sum of squares divided by ``copies``, and
one all-reduce over the world of the sums per group gives each full tensor's squares counted once.
The sums are float64 (a layer group's squares of fp32 values lose nothing; ``1 / copies`` is exact for
the power-of-two degrees of real layouts).

Pipeline stages: each stage holds different tensors, so the norm of the model is the sum over the
stages. Pass the pipeline group (the ranks with this rank's coordinates in every other mesh dimension)
as ``extra_group``: its size is the number of stages, the world holds ``world / stages`` ranks per
stage, and the one all-reduce over the world adds the stages' sums. Group indices must then mean the
same group on every stage (e.g. indices into the whole model's list of layer groups; a stage without a
group's tensors adds zero to it), and every rank must call the reduction, also a stage without tensors
of its own.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor, else ``t`` itself (no copy)."""
    return t.to_local() if hasattr(t, "to_local") else t


def summed(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its ``Partial`` mesh dimensions reduced (now ``Replicate``: a collective over them), so
    that its local part is a piece of the full tensor; any other tensor as it is. (Under sequence
    parallelism the norms' gains have Partial gradients.)"""
    if not hasattr(t, "placements") or not any(pl.is_partial() for pl in t.placements):
        return t
    from torch.distributed.tensor import Replicate

    return t.redistribute(t.device_mesh, [Replicate() if pl.is_partial() else pl for pl in t.placements])


def copies(t: torch.Tensor, stages: int = 1) -> int:
    """How many ranks hold the same local data as this rank for ``t`` (a parameter or gradient, plain or
    DTensor), with ``stages`` pipeline stages sharing the world (1 without a process group).

    Every placement but ``Replicate`` splits the tensor: ``Shard`` and FSDP2's ``_StridedShard`` under
    tensor parallelism (which is not a ``Shard`` subclass in torch 2.13).
    Raises: ValueError for a ``Partial`` placement (its local parts are summands, not pieces: :func:`summed`).
    """
    if not _distributed():
        return 1
    size = dist.get_world_size() // stages
    if not hasattr(t, "placements"):
        return size
    if any(pl.is_partial() for pl in t.placements):
        raise ValueError(f"a norm of a Partial DTensor ({t.placements}) cannot be summed from its local parts")
    sharded = math.prod(t.device_mesh.size(i) for i, pl in enumerate(t.placements) if not pl.is_replicate())
    return size // sharded


class FullNorms:
    """Squared norms of full tensors, summed per group, from the local parts of ``tensors``.

    Args:
        tensors: tensors (plain or DTensor) with the layout of the measured ones: the parameters for
            the parameters and their updates, the gradients for the gradients (a gradient's placements
            may differ from its parameter's: tensor parallelism's row-wise embedding has a Replicate
            gradient). At least one.
        groups: the group index (0 .. n_groups - 1) of each tensor; None: one group.
        n_groups: the number of groups (default: the largest index + 1); give it under pipeline stages, whose
            ranks hold different groups but must reduce vectors of one width.
        extra_group: the pipeline-stage process group whose sums are added too (module docstring), or None.

    :meth:`reduce` is a collective over the world: every rank calls it.
    """

    def __init__(self, tensors: list[torch.Tensor], groups: list[int] | None = None, extra_group=None,
                 n_groups: int | None = None):
        device = local_part(tensors[0]).device
        index = torch.tensor(groups if groups is not None else [0] * len(tensors), dtype=torch.long)
        # n_groups: the same width on every rank, also where a pipeline stage holds none of the last groups
        width = n_groups if n_groups is not None else int(index.max()) + 1
        self.onehot = torch.nn.functional.one_hot(index, width).double().to(device)  # (tensors, groups)
        stages = dist.get_world_size(extra_group) if extra_group is not None and _distributed() else 1
        self.weight = torch.tensor([1.0 / copies(t, stages) for t in tensors], dtype=torch.float64, device=device)

    def reduce(self, local_sq: torch.Tensor) -> torch.Tensor:
        """(k, tensors) sums of squares of the local parts -> (k, groups) float64 squared full norms per
        group, identical on every rank (one all-reduce)."""
        sums = (local_sq.double() * self.weight) @ self.onehot
        if _distributed():
            dist.all_reduce(sums)
        return sums

    def norms(self, *tensor_lists: list[torch.Tensor]) -> torch.Tensor:
        """L2 norms (k, groups) float64 of the full tensors, one row per list of local parts (each list in
        the order of the constructor's ``tensors``): one all-reduce for all of them."""
        sq = torch.stack([torch.stack(torch._foreach_norm(ts, ord=2)).double() ** 2 for ts in tensor_lists])
        return self.reduce(sq).sqrt()
