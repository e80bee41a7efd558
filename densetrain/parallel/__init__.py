"""The parallel layer: process group and device mesh, device, data-parallel rank/size, parallelising a
model (DDP, FSDP2, tensor parallel, activation checkpointing, per-block compile), context parallelism
(sequences split along time, :mod:`~densetrain.parallel.context`), pipeline stages
(:mod:`~densetrain.parallel.pipeline`, torch.distributed.pipelining's schedules), gradient sync, grad norm and
clipping, norms of full tensors in any layout (:mod:`~densetrain.parallel.norms`), even splits of
evaluation work, precision, and each stage's own layout resolved and checked at launch
(:mod:`~densetrain.parallel.stage_layout`).

The model code knows nothing of parallelism; this package applies it afterwards (torchtitan's split),
and the training loop and the evals ask it, never testing for DDP themselves. Under ``torchrun``
``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` are set and a process group is created (NCCL on GPUs, gloo on
CPUs); a plain ``python`` run is world size 1 with no process group, through the same code.

Vocabulary: the *global* rank/size count every process; the *data-parallel* rank/size count the
groups of processes that see different data (``dp_replicate * dp_shard``); the tensor-parallel ranks
of one data-parallel rank see the same batch, its context-parallel ranks different parts of the same
sequences. See docs/distributed.md.
"""

from densetrain.parallel.dist import (
    DistInfo,
    all_reduce_max,
    all_reduce_sum,
    collective_timeout,
    dp_rank_size,
    even_split,
    init_distributed,
)
from densetrain.parallel.mesh import Layout, resolve_layout
from densetrain.parallel.parallelize import build_parallel_model
from densetrain.parallel.wrap import (
    autocast_for,
    clip_grad_norm,
    grad_sync,
    parallelize,
    reshard,
    unwrap,
)

__all__ = [
    "DistInfo", "Layout", "all_reduce_max", "all_reduce_sum", "autocast_for", "build_parallel_model",
    "clip_grad_norm", "collective_timeout", "dp_rank_size", "even_split", "grad_sync", "init_distributed",
    "parallelize", "reshard", "resolve_layout", "unwrap",
]
