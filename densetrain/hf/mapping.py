"""The mapping both directions share: tensor names, RoPE fields, ``config.json``, μP folding.

Name mapping (ours, torchtitan style  <->  HF Llama):

    tok_embeddings.weight                     model.embed_tokens.weight
    layers.{i}.attention_norm.weight          model.layers.{i}.input_layernorm.weight
    layers.{i}.attention.w{q,k,v,o}.weight    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    layers.{i}.ffn_norm.weight                model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.feed_forward.w1.weight         model.layers.{i}.mlp.gate_proj.weight
    layers.{i}.feed_forward.w2.weight         model.layers.{i}.mlp.down_proj.weight
    layers.{i}.feed_forward.w3.weight         model.layers.{i}.mlp.up_proj.weight
    norm.weight                               model.norm.weight
    output.weight                             lm_head.weight   (absent when tie_word_embeddings)

RoPE scaling (``model.rope_scaling``: linear, llama3, yarn; densetrain/model/rope.py) is written as
HF's ``rope_parameters`` / ``rope_scaling`` with the same field names and read back from them, so a
Llama-3.1-style checkpoint imports with its scaled frequencies.

No q/k row permutation is needed: our RoPE uses the same half-split pairing as HF ``rotate_half``
(dimension i with i + head_dim/2; see densetrain/model/llama.py). Converting *Meta's* original Llama
checkpoints (adjacent pairing) would need that permutation; this module does not read those.

μP models (densetrain/model/init.py) are exported as plain Llama by folding their two forward multipliers
into the weights, which is exact because both act linearly:

* ``logit_mult`` is folded into ``lm_head.weight`` (logits = (W x) * c = (c W) x). If the embeddings are
  tied, the folded head can no longer share the embedding matrix, so such a model is exported *untied*
  (``tie_word_embeddings: false``, separate ``lm_head.weight``).
* ``attn_scale`` s (HF always uses 1/sqrt(head_dim)) is folded into ``q_proj``: scaling wq by
  ``s * sqrt(head_dim)`` scales the rotated queries, hence every score q·k, by the same factor (RoPE is a
  rotation, linear in q).

Importing such an export gives a standard-parameterisation model with identical logits.
"""

from __future__ import annotations

import math
import os
import re

import torch

from densetrain.config import ModelConfig
from densetrain.config.schema import RopeScalingConfig
from densetrain.errors import DataError

# Per-layer weights: our name suffix after "layers.{i}." -> HF suffix after "model.layers.{i}.".
_LAYER_MAP = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
_LAYER_MAP_INV = {v: k for k, v in _LAYER_MAP.items()}
_GLOBAL_MAP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GLOBAL_MAP_INV = {v: k for k, v in _GLOBAL_MAP.items()}
# Prefixes that torch.compile / DDP / FSDP / activation-checkpoint wrappers insert into parameter names.
_WRAPPER_PREFIX = re.compile(r"(_orig_mod\.|module\.|_fsdp_wrapped_module\.|_checkpoint_wrapped_module\.)")


def _our_to_hf_name(name: str) -> str:
    if name in _GLOBAL_MAP:
        return _GLOBAL_MAP[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in _LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
    raise ValueError(f"no Hugging Face name for parameter '{name}'")


def _hf_to_our_name(name: str, where: str | os.PathLike = "") -> str:
    """Our name of HF tensor ``name``. Raises: DataError (naming ``where``, the file) for a name that is
    not a Llama weight (the name is shown with ``repr``, so odd characters stay visible)."""
    if name in _GLOBAL_MAP_INV:
        return _GLOBAL_MAP_INV[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in _LAYER_MAP_INV:
        return f"layers.{m.group(1)}.{_LAYER_MAP_INV[m.group(2)]}"
    prefix = f"{where}: " if where else ""
    raise DataError(f"{prefix}unexpected tensor {name!r} in a Llama checkpoint (expected model.embed_tokens.weight, "
                    "model.layers.N.*, model.norm.weight, lm_head.weight)")


def _expected_names(cfg: ModelConfig) -> set[str]:
    names = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    names |= {f"layers.{i}.{k}" for i in range(cfg.n_layers) for k in _LAYER_MAP}
    return names


# Fields of each scaled RoPE type, named as in RopeScalingConfig and in HF's rope_parameters.
_ROPE_FIELDS = {
    "linear": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor"),
}


def rope_parameters(cfg: ModelConfig) -> dict:
    """HF ``rope_parameters`` of ``cfg``: ``rope_type``, ``rope_theta`` and the scaling fields of the
    type (``attention_factor`` only when set, else HF derives YaRN's default as we do)."""
    rs = cfg.rope_scaling
    kind = "default" if rs.type in ("", "none") else rs.type
    d: dict = {"rope_type": kind, "rope_theta": float(cfg.rope_theta)}
    for k in _ROPE_FIELDS.get(kind, ()):
        v = getattr(rs, k)
        if k != "attention_factor" or v > 0:
            d[k] = int(v) if k == "original_max_position_embeddings" else float(v)
    return d


def rope_scaling_from_hf(rope: dict, max_position_embeddings: int | None, where: str) -> RopeScalingConfig:
    """Our :class:`RopeScalingConfig` from HF ``rope_parameters`` / ``rope_scaling`` (``rope_type`` or
    legacy ``type``).

    Raises: ValueError for a type other than default, linear, llama3 and yarn, or YaRN variants we do
    not compute (``mscale``/``mscale_all_dim``, ``truncate = false``), or partial rotary dimensions.
    """
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", *_ROPE_FIELDS):
        raise ValueError(f"{where}: RoPE type {kind!r} is not supported (default, linear, llama3, yarn)")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor {rope['partial_rotary_factor']} is not supported")
    if kind == "default":
        return RopeScalingConfig()
    if kind == "yarn" and (rope.get("mscale") or rope.get("mscale_all_dim") or rope.get("truncate") is False):
        raise ValueError(f"{where}: YaRN with mscale, mscale_all_dim or truncate = false is not supported")
    fields = {k: rope[k] for k in _ROPE_FIELDS[kind] if rope.get(k) is not None}
    if "factor" not in fields and kind == "yarn" and max_position_embeddings:  # HF: context / original context
        fields["factor"] = max_position_embeddings / rope["original_max_position_embeddings"]
    for k in ("beta_fast", "beta_slow"):
        if k in fields and not fields[k]:
            del fields[k]  # HF reads 0 / null as the paper's default
    return RopeScalingConfig(type=kind, **{k: (int(v) if k == "original_max_position_embeddings" else float(v))
                                           for k, v in fields.items()})


def hf_config_dict(
    cfg: ModelConfig,
    *,
    max_position_embeddings: int = 2048,
    dtype: str = "float32",
    extra: dict | None = None,
) -> dict:
    """The ``config.json`` of a ``LlamaForCausalLM`` with the shape of ``cfg``.

    Args:
        max_position_embeddings: longest context the model was trained for (tokens); informational
            for plain RoPE, so pass the longest stage's ``seq_len``.
        dtype: name of the stored tensor dtype ("float32", "bfloat16", ...).
        extra: keys merged last (e.g. ``bos_token_id``, ``eos_token_id`` of the tokenizer).

    RoPE is written both as ``rope_parameters`` (what transformers >= 5 reads) and as top-level
    ``rope_theta`` plus, when scaled, ``rope_scaling`` (what transformers 4.x reads); v5 gives
    ``rope_parameters`` priority, so they agree.
    Likewise ``dtype`` (v5) and ``torch_dtype`` (v4). ``head_dim`` is written explicitly.

    Raises: ValueError for a model LlamaForCausalLM cannot express (model.qk_norm, model.logit_softcap).
    """
    if cfg.qk_norm or cfg.logit_softcap:
        raise ValueError("model.qk_norm and model.logit_softcap have no LlamaForCausalLM equivalent; "
                         "a model trained with them cannot be exported as Llama")
    d = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": rope_parameters(cfg),
        "rope_theta": float(cfg.rope_theta),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if d["rope_parameters"]["rope_type"] != "default":
        d["rope_scaling"] = {k: v for k, v in d["rope_parameters"].items() if k != "rope_theta"}
    d.update(extra or {})
    return d


def _plain_tensor(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "full_tensor"):  # a DTensor (FSDP2 shard): gather it (collective on all ranks)
        t = t.full_tensor()
    return t.detach()


def to_hf_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """HF-named tensors of ``model`` (a Transformer, possibly compiled/DDP-wrapped), on CPU.

    μP multipliers are folded in (see module docstring). Tied embeddings give no ``lm_head.weight``
    unless ``logit_mult != 1`` forces an untied export. Each tensor is a fresh contiguous CPU copy (no
    shared storage, as safetensors requires), cast to ``dtype`` if given. Folding is done in fp32 before
    any cast.

    Raises: ValueError for a parameter with no HF counterpart.
    """
    core = getattr(model, "_orig_mod", model)
    core = getattr(core, "module", core)
    logit_mult = float(getattr(core, "logit_mult", 1.0))
    attn_scale = getattr(core, "attn_scale", None)
    head_dim = core.head_dim
    q_mult = 1.0 if attn_scale is None else attn_scale * math.sqrt(head_dim)
    tied = core.output.weight is core.tok_embeddings.weight
    param_dtype = core.tok_embeddings.weight.dtype

    out: dict[str, torch.Tensor] = {}
    for name, t in core.state_dict().items():
        name = _WRAPPER_PREFIX.sub("", name)
        if name in ("rope_cos", "rope_sin"):  # non-persistent, not in state_dict; defensive
            continue
        if name == "output.weight" and tied and logit_mult == 1.0:
            continue  # HF re-ties lm_head to embed_tokens
        out[_our_to_hf_name(name)] = _hf_tensor(name, _plain_tensor(t), logit_mult, q_mult, dtype or param_dtype)
    return out


def _hf_tensor(name: str, t: torch.Tensor, logit_mult: float, q_mult: float, dtype: torch.dtype,
               private: bool = False) -> torch.Tensor:
    """Our tensor ``name`` as stored in the export: μP multipliers folded in fp32, then cast to ``dtype``;
    a contiguous CPU tensor of its own (safetensors refuses shared storage): copied unless ``private``
    (``t`` already is one, e.g. just read from a checkpoint)."""
    t = t.to("cpu", torch.float32)
    if name == "output.weight" and logit_mult != 1.0:
        t = t * logit_mult
    elif name.endswith("attention.wq.weight") and q_mult != 1.0:
        t = t * q_mult
    t = t.to(dtype).contiguous()
    return t if private else t.clone()


def from_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename HF Llama tensors to ours, ready for ``Transformer(cfg).load_state_dict(..., strict=True)``.

    With ``cfg.tie_embeddings`` both ``tok_embeddings.weight`` and ``output.weight`` are returned and are
    the same tensor (what our tied model's ``state_dict()`` holds). Legacy ``rotary_emb.inv_freq``
    buffers are ignored. No q/k permutation (same RoPE convention).

    Raises:
        ValueError: an unknown tensor name, a missing tensor, or a ``lm_head.weight`` that differs from
            the embeddings although ``cfg.tie_embeddings``.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        out[_hf_to_our_name(name)] = t
    if cfg.tie_embeddings:
        emb = out["tok_embeddings.weight"] if "tok_embeddings.weight" in out else None
        head = out.get("output.weight")
        if emb is not None and head is not None and not torch.equal(emb, head):
            raise ValueError("config ties embeddings but lm_head.weight differs from embed_tokens.weight")
        if emb is not None:
            out["output.weight"] = emb
    expected = _expected_names(cfg)
    missing = sorted(expected - out.keys())
    unexpected = sorted(out.keys() - expected)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return out
