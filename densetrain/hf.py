"""Hugging Face interop: export our Transformer as a ``LlamaForCausalLM`` checkpoint and import one back.

Files are ``config.json`` + ``model.safetensors`` (written with ``safetensors.torch.save_file``; reading
uses ``safetensors.torch.load_file`` only — never ``torch.load`` / pickle). :func:`export_hf_from_checkpoint`
exports a (sharded) training checkpoint without building the model: it reads the checkpoint through
DCP one tensor at a time (with :mod:`densetrain.dcp_read`'s reader: no code in a file runs) and writes
HF's sharded layout (``model-0000K-of-0000N.safetensors`` + ``model.safetensors.index.json``) when the
model is larger than one file.

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

import dataclasses
import json
import math
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from densetrain.config import Config, ModelConfig, validate
from densetrain.config.schema import RopeScalingConfig
from densetrain.dcp_read import PlainDataPlanner, TrustedReader, read_metadata
from densetrain.errors import DataError, disk_full_error, is_disk_full
from densetrain.fileio import exchange_paths, fsync_dir, json_text, recover_folder_swap
from densetrain.model.init import init_weights
from densetrain.model.llama import Transformer

if TYPE_CHECKING:
    from densetrain.data.tokenizer import Tokenizer

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


def tokenizer_files(tok: Tokenizer, model_max_length: int) -> dict[str, bytes]:
    """The tokenizer files of an export: ``tokenizer.json`` and ``tokenizer_config.json`` (name -> content).

    ``tokenizer.json`` gives the same ids as ``tok`` in ``PreTrainedTokenizerFast(tokenizer_file=...)``:
    a tokenizer.json is copied, a tiktoken one (``gpt2``, ``llama3``, a rank file) is converted
    (:meth:`Tokenizer.hf_json`); a converted tokenizer with a BOS (Llama 3) starts every encoding with it,
    as the shards start every document (Meta's post-processor), one without (GPT-2) adds nothing.
    ``tokenizer_config.json`` names the EOS (so HF generation stops where our documents end), the BOS where
    the tokenizer has one, and ``model_max_length``.

    Raises:
        DataError: a tiktoken encoding that cannot be converted (e.g. cl100k_base: gaps in its special ids).
    """
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.eos_token}
    if tok.bos_token is not None:
        config["bos_token"] = tok.bos_token
    config["model_max_length"] = model_max_length
    return {"tokenizer.json": tok.hf_json().encode("utf-8"),
            "tokenizer_config.json": json_text(config, indent=2).encode() + b"\n"}


def export_hf(
    model: torch.nn.Module,
    cfg: ModelConfig,
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_position_embeddings: int = 2048,
    extra_config: dict | None = None,
    extra_files: dict[str, bytes] | None = None,
) -> Path:
    """Write ``out_dir/config.json`` + ``out_dir/model.safetensors`` loadable by ``LlamaForCausalLM.from_pretrained``.

    Atomic at directory level: everything is written and fsynced in a sibling temp directory, which then
    takes the place of ``out_dir`` (readers and a kill -9 see the old or the new export, never a partial
    one; see :func:`_write_export`).
    ``cfg.rope_theta`` and ``cfg.rope_scaling`` are written as is: pass the config of the *last* stage
    (set them to the values the model was last trained with). ``dtype`` casts the stored tensors
    (default: the model's dtype).
    ``extra_files`` (name -> content, e.g. the tokenizer files) are written into the same atomic folder.

    Returns: the output directory. Raises: ValueError from :func:`to_hf_state_dict`; DataError from
    :func:`_write_export` (a target that is not an export, a full disk).
    """
    out_dir = Path(out_dir)
    sd = to_hf_state_dict(model, dtype)
    # A folded μP readout cannot stay tied to the embeddings (see module docstring).
    export_cfg = dataclasses.replace(cfg, tie_embeddings="lm_head.weight" not in sd)
    stored = str(next(iter(sd.values())).dtype).removeprefix("torch.")
    config = hf_config_dict(
        export_cfg, max_position_embeddings=max_position_embeddings, dtype=stored, extra=extra_config
    )

    return _write_export(out_dir, config, extra_files,
                         lambda tmp: save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"}))


_EXPORT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "model.safetensors.index.json")


def check_export_target(out_dir: Path) -> None:
    """Refuse an export target that is not new, empty, or a previous export (see :func:`_write_export`),
    after recovering from an export that was killed (:func:`densetrain.fileio.recover_folder_swap`).

    Raises:
        DataError: one line naming the path and what is in the way.
    """
    out_dir = Path(out_dir)
    above = next((p for p in out_dir.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise DataError(f"{out_dir}: {above} is a file, not a directory; export into a new or empty directory")
    recover_folder_swap(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"{out_dir}: exists and is not a directory; export into a new or empty directory")
    if out_dir.is_dir():
        other = sorted(p.name for p in out_dir.iterdir() if p.name not in _EXPORT_FILES
                       and not (p.is_file() and p.name.endswith(".safetensors")))
        if other:
            raise DataError(f"{out_dir}: holds {other[:3]}{' ...' if len(other) > 3 else ''}, not a previous export; "
                            "an export replaces its folder whole: choose a new or empty directory")


def _write_export(out_dir: Path, config: dict, extra_files: dict[str, bytes] | None,
                  write_weights: Callable[[Path], None]) -> Path:
    """The atomic folder of an export (see :func:`export_hf`): ``write_weights(tmp)`` writes the
    safetensors files into the temporary folder ``.NAME.tmp-PID`` next to ``out_dir``, then
    config.json and ``extra_files``, fsync; then the temp folder and ``out_dir`` swap names in one
    atomic step (:func:`densetrain.fileio.exchange_paths`), so a kill at any moment leaves the old or
    the new export at ``out_dir``; where the file system cannot swap, the old export is renamed aside
    first and a killed export is restored by the next one (:func:`densetrain.fileio.recover_folder_swap`).
    A failed write (a full disk, an unreadable checkpoint, an interrupt) removes the temp folder and
    leaves ``out_dir`` as it was.

    Raises:
        DataError: ``out_dir`` is a file, or a directory holding anything but a previous export (a run
            directory, checkpoints, notes): an export replaces its folder whole, so it never does so there;
            or the disk filled up ("no space left on ``out_dir``").
    """
    check_export_target(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        write_weights(tmp)
        (tmp / "config.json").write_text(json_text(config, indent=2) + "\n")
        for name, content in (extra_files or {}).items():
            (tmp / name).write_bytes(content)
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.iterdir():
            os.chmod(f, 0o666 & ~umask)  # safetensors writes 0600; an export is meant to be shared like any file
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(tmp)
    except BaseException as e:  # also an interrupt; SafetensorError (a full disk) is no OSError
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e):
            raise disk_full_error(out_dir, "the export") from None
        if isinstance(e, OSError) and str(tmp) in str(e.filename):  # not a read of the checkpoint
            raise DataError(f"{out_dir}: cannot write the export ({e.strerror})") from None
        raise
    if out_dir.exists() and exchange_paths(tmp, out_dir):
        fsync_dir(out_dir.parent)
        shutil.rmtree(tmp)  # now the previous export
        return out_dir
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    fsync_dir(out_dir.parent)
    if old is not None:
        shutil.rmtree(old)
    return out_dir


def checkpoint_model_tensors(ckpt_dir: str | os.PathLike) -> dict[str, TensorStorageMetadata]:
    """The model tensors of DCP checkpoint ``ckpt_dir`` (our names, without the ``model.`` prefix) with
    their full shape and dtype, from its ``.metadata`` alone (no tensor is read; nothing but DCP's metadata
    types is unpickled: :func:`densetrain.dcp_read.read_metadata`, whose one-line errors it raises)."""
    md = read_metadata(ckpt_dir)
    return {k[len("model."):]: v for k, v in md.state_dict_metadata.items()
            if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}


def read_checkpoint_tensor(ckpt_dir: str | os.PathLike, name: str, meta: TensorStorageMetadata) -> torch.Tensor:
    """The full tensor ``model.<name>`` of DCP checkpoint ``ckpt_dir`` as a plain CPU tensor, assembled
    from every rank's shards (DCP plans the reads of that key only; no process group needed)."""
    out = {f"model.{name}": torch.empty(meta.size, dtype=meta.properties.dtype)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed.*")  # single-process DCP warns
        dcp.load(out, storage_reader=TrustedReader(ckpt_dir), planner=PlainDataPlanner(ckpt_dir), no_dist=True)
    return out[f"model.{name}"]


def check_checkpoint_matches(ckpt_dir: Path, cfg: ModelConfig):
    """The model of ``cfg`` on the meta device (names, shapes, μP multipliers set by init; no memory)
    against the model tensors stored in DCP checkpoint ``ckpt_dir``.

    Returns:
        (meta model, stored tensor metadata by name, wanted shapes by name in model order).
    Raises:
        CheckpointReadError: no DCP checkpoint at ``ckpt_dir`` (``.metadata`` missing or unreadable);
            UntrustedCheckpointError: a crafted ``.metadata`` (:func:`densetrain.dcp_read.read_metadata`).
        ValueError: names or shapes differ (one line, the first differences).
    """
    with torch.device("meta"):
        core = Transformer(cfg)
        init_weights(core, cfg)
    stored = checkpoint_model_tensors(ckpt_dir)
    want = {n: tuple(t.shape) for n, t in core.state_dict().items()}  # model order; output.weight even when tied
    got = {n: tuple(m.size) for n, m in stored.items()}
    if got != want:
        diff = sorted(set(got.items()) ^ set(want.items()))[:4]
        raise ValueError(f"{ckpt_dir}: the checkpoint's model tensors do not match the config (name, shape: {diff})")
    return core, stored, want


def export_hf_from_checkpoint(
    ckpt_dir: str | os.PathLike,
    cfg: ModelConfig,
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_position_embeddings: int = 2048,
    extra_config: dict | None = None,
    extra_files: dict[str, bytes] | None = None,
    max_shard_bytes: int = 2 * 2**30,
) -> Path:
    """Export a densetrain checkpoint (DCP, saved by any number of ranks and any layout) as
    :func:`export_hf` does, reading it tensor by tensor: no model is built and the checkpoint is never
    whole in memory. Tensors go, in model order, into safetensors files of at most ``max_shard_bytes``
    (a tensor larger than that gets a file of its own): one file is ``model.safetensors``; more are
    ``model-0000K-of-0000N.safetensors`` with ``model.safetensors.index.json`` (HF's sharded layout, its
    ``weight_map`` naming each tensor's file). Peak memory is about one file's tensors plus one tensor.

    ``dtype``: stored dtype (default: the checkpoint's). Other arguments as in :func:`export_hf`.

    Returns: the output directory.
    Raises:
        ValueError: the checkpoint's model tensors do not match ``cfg`` (names or shapes).
        CheckpointReadError: no DCP checkpoint at ``ckpt_dir``, or a file that is not plain data
            (UntrustedCheckpointError), see :func:`check_checkpoint_matches`.
    """
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    core, stored, want = check_checkpoint_matches(ckpt_dir, cfg)
    logit_mult = float(getattr(core, "logit_mult", 1.0))
    attn_scale = getattr(core, "attn_scale", None)
    q_mult = 1.0 if attn_scale is None else attn_scale * math.sqrt(core.head_dim)
    # Tied embeddings are one tensor in HF too (lm_head re-tied on load), unless a μP readout is folded in.
    untied = not cfg.tie_embeddings or logit_mult != 1.0
    names = [n for n in want if untied or n != "output.weight"]
    dtypes = {n: dtype or stored[n].properties.dtype for n in names}
    shards: list[list[str]] = [[]]
    size = 0
    for n in names:
        nbytes = math.prod(want[n]) * dtypes[n].itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])

    def write_weights(tmp: Path) -> None:
        weight_map = {}
        for file, shard in zip(files, shards, strict=True):
            tensors = {}
            for n in shard:
                t = read_checkpoint_tensor(ckpt_dir, n, stored[n])
                tensors[_our_to_hf_name(n)] = _hf_tensor(n, t, logit_mult, q_mult, dtypes[n], private=True)
                del t
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, file))
            del tensors  # one file's tensors in memory at a time
        if len(files) > 1:
            total = sum(math.prod(want[n]) * dtypes[n].itemsize for n in names)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json_text(index, indent=2) + "\n")

    export_cfg = dataclasses.replace(cfg, tie_embeddings=not untied)
    config = hf_config_dict(export_cfg, max_position_embeddings=max_position_embeddings,
                            dtype=str(dtypes[names[0]]).removeprefix("torch."), extra=extra_config)
    return _write_export(out_dir, config, extra_files, write_weights)


# The config.json keys import_hf needs (LlamaConfig has defaults for them, but a checkpoint's shapes
# follow from them, so guessing one would only move the error to a tensor shape).
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _read_hf_config(conf_path: Path) -> dict:
    """``config.json`` as a dict. Raises: FileNotFoundError (absent); DataError (unreadable, not JSON,
    not an object), one line naming the file and the line/column."""
    if not conf_path.is_file():
        raise FileNotFoundError(f"{conf_path}: not found; import-hf expects a folder with config.json + *.safetensors")
    try:
        hc = json.loads(conf_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{conf_path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{conf_path}: cannot read ({e})") from None
    if not isinstance(hc, dict):
        raise DataError(f"{conf_path}: expected a JSON object (a Hugging Face config), got {type(hc).__name__}")
    return hc


def _hf_int(hc: dict, key: str, conf_path: Path, default: int | None = None) -> int:
    v = hc.get(key) or default  # null / 0 / absent means LlamaConfig's default where it has one
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise DataError(f"{conf_path}: {key} must be a positive integer, got {hc.get(key)!r}")
    return v


def _hf_float(hc: dict, key: str, conf_path: Path, default: float) -> float:
    v = hc.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise DataError(f"{conf_path}: {key} must be a number, got {v!r}")
    return float(v)


def import_hf(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a Llama checkpoint directory (config.json + *.safetensors) into ``(ModelConfig, state_dict)``.

    The state dict uses our names (see :func:`from_hf_state_dict`) and keeps the stored dtype. The
    returned config has ``init="standard"``; fields absent from ModelConfig (max_position_embeddings,
    token ids) are dropped. Every tensor's shape is checked against the config (on the meta device), so
    a mismatch is named here rather than by ``load_state_dict``.

    Raises:
        FileNotFoundError: no config.json or no *.safetensors file.
        DataError (one line naming the file and key or tensor): config.json is not JSON or lacks a key
            of :data:`_REQUIRED_KEYS`; not a plain Llama (model_type, biases, activation, a RoPE type
            other than default, linear, llama3 or yarn, odd head_dim, heads that do not divide); an
            unreadable safetensors file; tensors that do not match the config (names or shapes).
    """
    path = Path(path)
    conf_path = path / "config.json"
    hc = _read_hf_config(conf_path)
    if hc.get("model_type") != "llama":
        raise DataError(f"{conf_path}: model_type is {hc.get('model_type')!r}, expected 'llama' (LlamaForCausalLM)")
    missing = [k for k in _REQUIRED_KEYS if k not in hc]
    if missing:
        raise DataError(f"{conf_path}: missing key {missing[0]!r} "
                        f"(a Llama config.json has {', '.join(_REQUIRED_KEYS)})")
    if hc.get("attention_bias") or hc.get("mlp_bias"):
        raise DataError(f"{conf_path}: biases are not supported")
    if hc.get("hidden_act", "silu") != "silu":
        raise DataError(f"{conf_path}: hidden_act {hc['hidden_act']!r} is not supported (need silu)")
    rope = hc.get("rope_parameters") or hc.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise DataError(f"{conf_path}: rope_parameters / rope_scaling must be an object, got {rope!r}")
    try:
        scaling = rope_scaling_from_hf(rope, hc.get("max_position_embeddings"), str(conf_path))
    except (TypeError, ValueError) as e:  # an unsupported type (message names the file), or a field's type
        msg = str(e)
        raise DataError(msg if msg.startswith(str(conf_path)) else f"{conf_path}: rope_parameters: {msg}") from None
    d_model, n_heads = _hf_int(hc, "hidden_size", conf_path), _hf_int(hc, "num_attention_heads", conf_path)
    head_dim = hc.get("head_dim") or d_model // n_heads
    if head_dim * n_heads != d_model:
        raise DataError(f"{conf_path}: head_dim {head_dim} * num_attention_heads {n_heads} != hidden_size {d_model}")
    cfg = ModelConfig(
        vocab_size=_hf_int(hc, "vocab_size", conf_path),
        d_model=d_model,
        n_layers=_hf_int(hc, "num_hidden_layers", conf_path),
        n_heads=n_heads,
        n_kv_heads=_hf_int(hc, "num_key_value_heads", conf_path, default=n_heads),
        d_ff=_hf_int(hc, "intermediate_size", conf_path),
        rope_theta=_hf_float(rope, "rope_theta", conf_path, _hf_float(hc, "rope_theta", conf_path, 10000.0)),
        rope_scaling=scaling,
        norm_eps=_hf_float(hc, "rms_norm_eps", conf_path, 1e-6),  # 1e-6 is LlamaConfig's default
        tie_embeddings=bool(hc.get("tie_word_embeddings", False)),
        init_std=_hf_float(hc, "initializer_range", conf_path, 0.02),
    )
    try:
        validate(Config(model=cfg))  # heads that do not divide, an odd head_dim, ...: the key is named
    except ValueError as e:
        raise DataError(f"{conf_path}: {e}") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    with torch.device("meta"):
        want = {n: tuple(t.shape) for n, t in Transformer(cfg).state_dict().items()}
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            part = load_file(str(f))
        except Exception as e:  # SafetensorError (a bad header, a truncated file) is not an OSError
            raise DataError(f"{f}: not a readable safetensors file ({str(e).splitlines()[0][:200]})") from None
        for name, t in part.items():
            if name in sd:
                raise DataError(f"{f}: tensor {name!r} also appears in another shard")
            ours = None if name.endswith("rotary_emb.inv_freq") else _hf_to_our_name(name, where=f)
            if ours in want and tuple(t.shape) != want[ours]:
                raise DataError(f"{f}: tensor {name!r} has shape {list(t.shape)}, {conf_path.name} implies "
                                f"{list(want[ours])}")
            sd[name] = t
    try:
        return cfg, from_hf_state_dict(sd, cfg)
    except ValueError as e:  # a missing tensor, or an lm_head that differs from tied embeddings
        raise DataError(f"{path}: {e}") from None
