"""Applying parallelism to a built model, and the operations whose meaning depends on it: gradient
sync during accumulation, the global grad norm and clipping, unwrapping for evaluation, precision."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from densetrain.model.precision import resolve_dtype
from densetrain.parallel.dist import DistInfo
from densetrain.parallel.norms import FullNorms, local_part, summed


def parallelize(model: nn.Module, info: DistInfo) -> nn.Module:
    """Wrap ``model`` for data parallelism (DDP) when ``world_size > 1``; identity otherwise.

    DDP averages gradients over the data-parallel ranks; :func:`densetrain.train.step.forward_backward`
    multiplies each rank's objective by ``dp_size`` to turn that mean back into the global sum.
    """
    if info.world_size == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    # The only buffers are the RoPE cos/sin cache, computed identically on every rank: no need to
    # broadcast them before each forward (DDP's default).
    return DDP(model, device_ids=[info.local_rank] if info.device.type == "cuda" else None, broadcast_buffers=False)


def grad_sync(model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Context for one micro-batch's backward: gradients are reduced over ranks only when ``enabled``
    (the last micro-batch of a step); earlier ones accumulate locally. DDP: ``no_sync`` (its gradients are
    whole on every rank anyway). FSDP2 reduce-scatters every micro-batch and accumulates the *sharded*
    gradients; under HSDP only the replicas' all-reduce waits for the last (``set_requires_all_reduce``).
    Why not FSDP2's ``set_requires_gradient_sync(False)``: it keeps every parameter's gradient unsharded in
    fp32 until the last backward, 4 bytes a parameter on every rank (32 GB for an 8B model), which the memory
    plan does not allow for; torchtitan likewise reduce-scatters each micro-batch. Tensor-parallel collectives
    are part of the math and always run."""
    if enabled:
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):
        return model.no_sync()
    if hasattr(model, "set_requires_all_reduce"):  # an FSDPModule: only HSDP has an all-reduce to defer
        return _fsdp_defer_all_reduce(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_defer_all_reduce(model):
    model.set_requires_all_reduce(False)
    try:
        yield
    finally:
        model.set_requires_all_reduce(True)


def clip_grad_norm(model: nn.Module, max_norm: float, extra_group=None) -> torch.Tensor:
    """Clip the gradients of ``model`` to total L2 norm ``max_norm`` (``inf``: measure only); return the
    norm of the *full* gradient before clipping as a 0-d tensor, identical on every rank.

    Plain tensors (single process; DDP after its all-reduce, every rank holding the whole gradient) go
    through ``torch.nn.utils.clip_grad_norm_`` (the golden trajectory's arithmetic). With DTensor
    gradients (FSDP2 / HSDP shards, tensor-parallel slices), or with ``extra_group`` (the pipeline
    stages, each holding other parameters: :class:`densetrain.parallel.norms.FullNorms`), the local sums
    of squares are reduced with one all-reduce, each shard counted once, then clipped as torch does:
    coefficient ``min(1, max_norm / (norm + 1e-6))``.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    if extra_group is None and not any(hasattr(p.grad, "to_local") for p in params):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    # The gradients' own placements, not the parameters': under tensor parallelism the row-wise
    # embedding's gradient is Replicate (every rank holds all of it) while its weight is Shard(0).
    grads = [summed(p.grad) for p in params]
    total = FullNorms(grads, extra_group=extra_group).norms([local_part(g) for g in grads])[0, 0].float()
    if max_norm != float("inf"):
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(coef.to(p.grad.dtype))  # DTensor times a plain 0-d tensor: scales each shard
    return total


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DDP / torch.compile wrappers (their forward may sync or recompile)."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def reshard(model: nn.Module) -> int:
    """Free the gathered parameters FSDP2 keeps after a forward without a backward (an evaluation under
    ``torch.no_grad``): the root group (embedding, final norm, head) and the last block are not resharded after
    their forward (the training backward needs them next), and under pipeline parallelism no block is, so an
    evaluation left them whole on every rank (llama3-8b in bf16: ~2.4 GiB) until the next step. Returns the
    number of FSDP2 modules; a no-op without FSDP2 or where nothing is gathered."""
    from torch.distributed.fsdp import FSDPModule

    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in mods:
        m.reshard()
    return len(mods)


def autocast_for(dtype: str, device: torch.device) -> contextlib.AbstractContextManager | None:
    """The autocast context of ``train.dtype`` on ``device`` (None for fp32). Parameters, gradients and
    optimizer state stay fp32 (master weights); autocast runs matmuls and attention in bf16.
    'auto' is :func:`resolve_dtype`'s choice.
    """
    dtype = resolve_dtype(dtype, device)
    if dtype == "fp32":
        return None
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
