"""Norms of the full tensors from the parts each rank holds, whatever the layout: the one place that knows
how many ranks hold the same data (DDP replicas, FSDP2 / HSDP shards, tensor-parallel slices, context-
parallel ranks of an FSDP2 group). The grad norm (:func:`densetrain.parallel.wrap.clip_grad_norm`) and
the update and parameter norms of the update watcher (:mod:`densetrain.train.updates`) go through it, so
every norm densetrain logs or judges is the norm of the full tensor on one process, and identical on every
rank (the result of one all-reduce).

Rule: a rank's local part of a tensor is held by ``copies`` ranks of the reduction group (the world by
default): a plain tensor (one process, a DDP replica) by all of them, a DTensor by ``size / (product of
the mesh sizes of its sharding placements)`` (its Replicate dimensions and the mesh dimensions it is not
on). Each rank adds its local sum of squares divided by ``copies``, and one all-reduce of the sums per
group gives each full tensor's squares counted once. The sums are float64 (a layer group's squares of
fp32 values lose nothing; ``1 / copies`` is exact for the power-of-two degrees of real layouts).

Pipeline stages: each stage holds different parameters, so the sums of one stage's group are added
over the stages afterwards: pass the group that joins the ranks with the same coordinates in every other
dimension (the pipeline dimension of the mesh) as ``extra_group``, and the stage's own ranks as
``group``. Group indices must then mean the same group on every stage (e.g. indices into the whole
model's list of layer groups, zero where a stage has none of a group).
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


def copies(t: torch.Tensor, group=None) -> int:
    """How many ranks of ``group`` (None: the world; 1 without a process group) hold the same local data
    as this rank for ``t`` (a parameter, plain or DTensor).

    Every placement but ``Replicate`` splits the tensor: ``Shard`` and FSDP2's ``_StridedShard`` under
    tensor parallelism (which is not a ``Shard`` subclass in torch 2.13).
    Raises: ValueError for a ``Partial`` placement (its local parts are summands, not pieces: :func:`summed`).
    """
    if not _distributed():
        return 1
    size = dist.get_world_size(group)
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
            gradient).
        groups: the group index (0 .. n_groups - 1) of each tensor; None: one group.
        group: the process group whose ranks together hold one copy of the tensors (None: the world).
        extra_group: ranks holding *different* tensors whose sums add up (pipeline stages; module
            docstring), or None.

    :meth:`reduce` is a collective over ``group`` (and ``extra_group``): every rank calls it.
    """

    def __init__(self, tensors: list[torch.Tensor], groups: list[int] | None = None, group=None, extra_group=None):
        device = local_part(tensors[0]).device
        index = torch.tensor(groups if groups is not None else [0] * len(tensors), dtype=torch.long)
        n_groups = int(index.max()) + 1 if len(index) else 1
        self.onehot = torch.nn.functional.one_hot(index, n_groups).double().to(device)  # (tensors, groups)
        self.weight = torch.tensor([1.0 / copies(t, group) for t in tensors], dtype=torch.float64, device=device)
        self.group, self.extra_group = group, extra_group

    def reduce(self, local_sq: torch.Tensor) -> torch.Tensor:
        """(k, tensors) sums of squares of the local parts -> (k, groups) float64 squared full norms per
        group, identical on every rank."""
        sums = (local_sq.double() * self.weight) @ self.onehot
        if _distributed():
            dist.all_reduce(sums, group=self.group)
            if self.extra_group is not None:
                dist.all_reduce(sums, group=self.extra_group)
        return sums

    def norms(self, *tensor_lists: list[torch.Tensor]) -> torch.Tensor:
        """L2 norms (k, groups) float64 of the full tensors, one row per list of local parts (each list in
        the order of the constructor's ``tensors``): one all-reduce for all of them."""
        sq = torch.stack([torch.stack(torch._foreach_norm(ts, ord=2)).double() ** 2 for ts in tensor_lists])
        return self.reduce(sq).sqrt()
