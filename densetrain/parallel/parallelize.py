"""Parallelism applied to the model from outside, in torchtitan's order:

    build on meta -> pipeline split -> tensor parallel -> activation checkpointing -> compile per block
    -> FSDP2 fully_shard per block and at the root -> materialise (to_empty) -> initialise -> (optimizer:
    caller)

The model file knows nothing of this. Tensor parallel needs one fact from it: attention reshapes by
``n_heads`` / ``n_kv_heads``, which this step sets to the per-rank (local) head counts.

Initialisation gives the weights of a single process with the same seed: the full model is
initialised on the CPU with :func:`densetrain.model.init.build_model` and each rank takes its shards
(``set_model_state_dict`` with a full state dict, which calls ``distribute_tensor`` per parameter).
That costs one full fp32 copy in host memory per rank while it lasts (32 GB for 8B parameters).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from densetrain.errors import ConfigError
from densetrain.model.compiling import pin_inductor_cache
from densetrain.model.init import build_model, set_init_scalars
from densetrain.model.llama import Transformer
from densetrain.parallel.dist import DistInfo
from densetrain.parallel.mesh import dp_mesh
from densetrain.parallel.pipeline import (
    PipelineModel,
    describe_split,
    keep_parts,
    part_view,
    rank_stages,
    split_stages,
)
from densetrain.parallel.wrap import parallelize


def build_parallel_model(cfg, info: DistInfo, meta: bool = False, seq_lens: dict[str, int] | None = None,
                         init: bool = True) -> tuple[Transformer, nn.Module]:
    """The model of ``cfg`` laid out as ``cfg.parallel`` says on the mesh of ``info``.

    Args:
        cfg: the :class:`~densetrain.config.Config` (reads ``model``, ``parallel``, ``train``).
        meta: stop before materialising: parameters stay on the meta device with this rank's shard shapes
            (the dry run of one rank of a large job, :mod:`densetrain.tools.plan.rank`).
        seq_lens: the sequence lengths (by config key) that will run on this layout, checked against its split;
            None: ``train.seq_len`` and those of the stages without a layout of their own (``stages[i].parallel``).
        init: give the weights the single-process initial values; False (sharded layouts only) leaves them
            uninitialised for a checkpoint to be loaded over (a layout switch: no full copy of the model on the
            CPU per rank, :func:`load_reference_weights`).
    Returns:
        ``(model, step_model)``: ``model`` is the module checkpoints and the optimizer use (under
        FSDP2/TP the same object, its parameters DTensors; under pipeline parallelism this rank's stages
        only, with global parameter names); ``step_model`` is what the step and the evaluations run (DDP,
        whole-model compile wrapper, a :class:`~densetrain.parallel.pipeline.PipelineModel`, else ``model``).
    """
    par, layout = cfg.parallel, info.layout
    _check_seq_lens(cfg, layout, seq_lens)
    if not meta and layout.pp == 1 and layout.tp == 1 and not layout.uses_fsdp:
        # Single process or DDP: the real model straight away (this path is the golden trajectory's).
        model = build_model(cfg.model, cfg.train.seed, info.device)
        apply_activation_checkpointing(model, par.activation_checkpointing)
        if par.compile_blocks:
            compile_blocks(model)
        step_model = parallelize(model, info)
        if cfg.train.compile:
            pin_inductor_cache()
        return model, torch.compile(step_model) if cfg.train.compile else step_model

    with torch.device("meta"):
        model = Transformer(cfg.model)
    virtual = par.pp_virtual_stages if layout.pp > 1 else 1
    split = split_stages(cfg.model.n_layers, layout.pp * virtual, par.pp_layers_per_stage if layout.pp > 1 else 0)
    parts = [split[s] for s in rank_stages(info.pp_rank, layout.pp, virtual)]
    if layout.pp > 1:
        keep_parts(model, parts)
    if layout.tp > 1:
        apply_tensor_parallel(model, info.mesh["tp"], par.sequence_parallel, par.loss_parallel)
    apply_activation_checkpointing(model, par.activation_checkpointing)
    if par.compile_blocks or cfg.train.compile:
        compile_blocks(model)
        if layout.tp > 1 and model.tok_embeddings is not None:
            model.tok_embeddings.register_forward_hook(_fresh_output)
    # An interleaved schedule runs each of the rank's stages as its own module (sharing the blocks).
    chunks = [model] if len(parts) == 1 else [part_view(model, p) for p in parts]
    if layout.uses_fsdp:
        bf16 = info.device.type == "cuda" and cfg.train.dtype in ("auto", "bf16")
        for chunk in chunks:  # pipelined: no reshard between micro-batches (torchtitan's choice for PP)
            apply_fsdp(chunk, dp_mesh(info.mesh, layout), bf16, reshard_last=layout.pp > 1)
    if meta:
        return model, model
    model.to_empty(device=info.device)
    if init:
        load_reference_weights(model, cfg, info.device)
    else:
        set_init_scalars(model, cfg.model)
    if layout.pp == 1:
        return model, model
    for chunk in chunks:
        chunk.logit_mult = model.logit_mult
        chunk.reset_rope_cache()
    n_stages, sp = layout.pp * virtual, par.sequence_parallel and layout.tp > 1
    pipe = PipelineModel(chunks, [p.index for p in parts], n_stages, par.pp_schedule, info.pp_group, info.device,
                         cfg.model.vocab_size, par.pp_microbatches, sp, par.pp_grad_sync)
    pipe.decisions.append(describe_split(split, layout.pp, par.pp_schedule))  # logged by the first step
    return model, pipe


def seq_len_divisor(layout, sequence_parallel: bool) -> int:
    """What every sequence length on ``layout`` must be a multiple of: ``2 cp`` load-balanced chunks
    (:mod:`densetrain.parallel.context`), and ``cp * tp`` parts under sequence parallelism."""
    need = 2 * layout.cp if layout.cp > 1 else 1
    if sequence_parallel and layout.tp > 1:
        need = math.lcm(need, layout.cp * layout.tp)  # each cp rank's T / cp tokens split by tp
    return need


def _check_seq_lens(cfg, layout, lens: dict[str, int] | None = None) -> None:
    """The sequence lengths the resolved layout needs (config validation cannot check a ``-1`` degree):
    :func:`seq_len_divisor`; ``lens`` as :func:`build_parallel_model` takes them.

    Raises: ConfigError naming the stage and the divisor.
    """
    need = seq_len_divisor(layout, cfg.parallel.sequence_parallel)
    if lens is None:
        lens = {"train.seq_len": cfg.train.seq_len}
        lens.update({f"stages[{i}].seq_len": st.seq_len for i, st in enumerate(cfg.stages)
                     if st.seq_len and not st.parallel})
    for key, t in lens.items():
        if t % need:
            raise ConfigError(f"parallel: the layout ({layout}) needs every seq_len divisible by {need}; {key} is {t}")


def apply_tensor_parallel(model: Transformer, tp_mesh, sequence_parallel: bool = False,
                          loss_parallel: bool = False) -> None:
    """Megatron-style tensor parallel (Shoeybi et al. 2019) on the 1-D ``tp_mesh``, in place.

    Plan: ``wq, wk, wv, w1, w3`` column-wise (each rank computes a slice of heads / of the hidden
    width; its input is replicated), ``wo, w2`` row-wise (each rank multiplies its slice; the partial
    outputs are all-reduced), the embedding row-wise over the vocabulary (each rank looks up its rows,
    zeros elsewhere, all-reduced), the output head column-wise over the vocabulary with the logits
    gathered (replicated), so the loss is computed on full logits identically on every rank and is
    not scaled by the degree. Norm gains are replicated (``Replicate`` DTensors, local arithmetic); their
    gradients are complete on every rank because column-wise layers all-reduce the gradient of their
    replicated input.

    ``sequence_parallel`` (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", sec. 4.2.2; torch's ``SequenceParallel``): between the blocks' matmuls the
    residual stream and the two norms of each block run on ``T / tp`` tokens per rank. The embedding
    and the row-wise ``wo, w2`` reduce-scatter along time instead of all-reducing, and the attention and
    the MLP all-gather their input along time (the same bytes moved as the all-reduce, split in two).
    The final norm gathers its input first and runs replicated, so the output head and the
    cross-entropy (chunked or not) see whole rows as without sequence parallelism. Needs every
    sequence length divisible by ``tp``.

    ``loss_parallel``: the training step's cross-entropy is vocabulary-parallel (no rank gathers the
    logits; :mod:`densetrain.parallel.loss_parallel`); the model is marked with ``loss_parallel_mesh``,
    which the step reads. Evaluation still gets gathered logits from the module.

    Tied embeddings: the embedding (row-wise) and the head (column-wise) both shard the (vocab,
    d_model) matrix on dim 0, so after both are distributed the head takes the embedding's parameter
    again: one parameter.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()
    sp = sequence_parallel
    between = Shard(1) if sp else Replicate()  # the residual stream's layout between blocks
    ends = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
            "output": ColwiseParallel(output_layouts=Replicate())}
    # A pipeline stage holds the embedding, the head, both or neither.
    ends = {k: v for k, v in ends.items() if getattr(model, k) is not None}
    if ends:
        parallelize_module(model, tp_mesh, ends)
    if model.cfg.tie_embeddings:
        model.tie_weights()
    model.loss_parallel_mesh = tp_mesh if loss_parallel else None
    if sp and model.norm is not None:  # gather the last block's output along time before the final norm
        parallelize_module(model.norm, tp_mesh, PrepareModuleInput(input_layouts=(Shard(1),),  # (before _replicate)
                                                                   desired_input_layouts=(Replicate(),),
                                                                   use_local_output=True))
    if model.norm is not None:
        _replicate(model.norm, tp_mesh)
    for block in model.layers:
        plan = {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=between),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=between),
        }
        if sp:
            # Attention.forward(x, cos, sin, cache, layer, doc_mask, attend): only x is gathered.
            n_args = 7
            plan.update({
                "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1),) + (None,) * (n_args - 1),
                                                desired_input_layouts=(Replicate(),) + (None,) * (n_args - 1),
                                                use_local_output=True),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                   use_local_output=True),
            })
        parallelize_module(block, tp_mesh, plan)
        if not sp:
            for norm in (block.attention_norm, block.ffn_norm):
                _replicate(norm, tp_mesh)
        attn = block.attention
        if attn.n_kv_heads % tp:
            raise ValueError(f"tensor parallel degree {tp} must divide n_kv_heads ({attn.n_kv_heads})")
        # Local heads: rank r holds query heads [r H/tp, (r+1) H/tp) and KV heads [r K/tp, (r+1) K/tp);
        # query head h uses KV head h // (H/K), which stays on the same rank, so GQA needs no exchange.
        attn.n_heads //= tp
        attn.n_kv_heads //= tp


def _replicate(module: nn.Module, mesh) -> None:
    """Make ``module`` (a norm) run on replicated DTensors over ``mesh``: its parameters become
    ``Replicate`` DTensors, its input is wrapped, its output unwrapped. The arithmetic is the local one;
    the point is that every parameter of a tensor-parallel model is a DTensor, as the optimizer's
    foreach kernels require within a parameter group."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor

    def params(name, mod, mesh):
        for pname, p in list(mod.named_parameters(recurse=False)):
            mod.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [Replicate()])))

    def wrap_input(mod, inputs, mesh):
        return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in inputs)

    distribute_module(module, mesh, partition_fn=params, input_fn=wrap_input,
                      output_fn=lambda mod, out, mesh: out.to_local())


def _selective_policy():
    """Selective activation checkpointing (Korthikanti et al. 2022, "Reducing Activation Recomputation"):
    keep what is expensive to recompute (matmuls, attention, collectives), recompute the cheap pointwise
    ops and norms, which hold most of the activation bytes per FLOP."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    save = {aten.mm.default, aten.addmm.default, aten.bmm.default,
            aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_cudnn_attention.default}
    funcol = getattr(torch.ops, "_c10d_functional", None)
    if funcol is not None:
        save |= {funcol.all_reduce.default, funcol.reduce_scatter_tensor.default, funcol.all_gather_into_tensor.default}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def apply_activation_checkpointing(model: Transformer, mode: str) -> None:
    """Recompute each block's activations in the backward (``mode`` 'full' or 'selective'; 'none' is a
    no-op). The block's ``forward`` is replaced on the instance, so parameter names (checkpoints, the
    optimizer's groups) do not change, unlike a wrapper module.

    Raises: ValueError for another mode.
    """
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing must be none, full or selective, got '{mode}'")
    from torch.utils.checkpoint import checkpoint

    # 'full' passes no context_fn at all: torch.compile of a block (parallel.compile_blocks) traces this forward,
    # and its dynamo (2.13) raised "checkpoint not implemented for LazyVariableTracker context_fn" on torch's own
    # noop_context_fn handed over explicitly; the default is that same no-op.
    policy = {"context_fn": _selective_policy()} if mode == "selective" else {}
    for block in model.layers:
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **policy, **kwargs)

        block.forward = forward


def compile_blocks(model: Transformer) -> None:
    """``torch.compile`` each block in place (``nn.Module.compile``: names unchanged); blocks have the
    same code, so one compiled graph serves them all."""
    pin_inductor_cache()
    for block in model.layers:
        block.compile()


def _fresh_output(module: nn.Module, inputs, out: torch.Tensor) -> torch.Tensor:
    """A forward hook returning a copy of ``out``: the tensor-parallel embedding's output, the local tensor of its
    ``Replicate`` (``Shard(1)`` with sequence parallelism) DTensor (``to_local()``), handed to the first compiled
    block as a tensor of its own. Given as it is, the compiled block's backward (torch 2.13, CPU / gloo) handed a
    plain tensor to the DTensor redistribution behind it ("'Tensor' object has no attribute '_local_tensor'"):
    tensor parallelism with ``parallel.compile_blocks`` never trained. One (B, T, d_model) copy per forward."""
    return out.clone()


def apply_fsdp(model: Transformer, mesh, bf16: bool, reshard_last: bool = False) -> None:
    """FSDP2 ``fully_shard`` on each block, then the root (embedding, final norm, head: one group, so a
    tied embedding is one sharded parameter). With ``bf16`` (GPU) parameters are all-gathered in bf16
    and gradients reduced in fp32 (``MixedPrecisionPolicy``); the sharded master weights stay fp32.

    Gradients are averaged over the mesh's ranks (FSDP2's default, as DDP's), which
    :func:`densetrain.train.step.forward_backward` turns back into the global sum with ``grad_scale``.
    The last block is not resharded after the forward: the backward needs it first; with
    ``reshard_last`` (pipeline stages: many micro-batches' forwards before a backward) no block is.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    n = len(model.layers)
    for i, block in enumerate(model.layers):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < n - 1 and not reshard_last)
    fully_shard(model, mesh=mesh, mp_policy=mp)


@torch.no_grad()
def load_reference_weights(model: Transformer, cfg, device: torch.device) -> None:
    """Give the materialised, distributed ``model`` the single-process initial weights of ``cfg``
    (:func:`~densetrain.model.init.build_model` on the CPU with ``train.seed``), shard by shard, plus
    the init's scalar attributes (μP attention scale, logit multiplier)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    ref = build_model(cfg.model, cfg.train.seed, torch.device("cpu"))
    held = set(model.state_dict())  # a pipeline stage holds some of the parameters, under their global names
    full = {k: v.to(device) for k, v in ref.state_dict().items() if k in held}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=True))
    if cfg.model.tie_embeddings and model.output.weight is not model.tok_embeddings.weight:
        raise RuntimeError("tied embeddings became two parameters while parallelising")
    model.attn_scale = ref.attn_scale
    model.logit_mult = ref.logit_mult
    model.reset_rope_cache()
