"""Export: a model, or a (sharded) training checkpoint, as a Hugging Face ``LlamaForCausalLM`` folder.

Files are ``config.json`` + ``model.safetensors`` (written with ``safetensors.torch.save_file``), plus the
tokenizer files. :func:`export_hf_from_checkpoint` exports a training checkpoint without building the
model: it reads the checkpoint through DCP one tensor at a time (with :mod:`densetrain.dcp_read`'s reader:
no code in a file runs) and writes HF's sharded layout (``model-0000K-of-0000N.safetensors`` +
``model.safetensors.index.json``) when the model is larger than one file. Every export is one atomic
folder swap (:func:`_write_export`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from densetrain.config import ModelConfig
from densetrain.dcp_read import PlainDataPlanner, TrustedReader, first_nonfinite, nonfinite_error, read_metadata
from densetrain.errors import DataError, disk_full_error, is_disk_full
from densetrain.fileio import exchange_paths, fsync_dir, json_text, recover_folder_swap
from densetrain.hf.mapping import _hf_tensor, _our_to_hf_name, hf_config_dict, to_hf_state_dict
from densetrain.model.init import init_weights
from densetrain.model.llama import Transformer

if TYPE_CHECKING:
    from densetrain.data.tokenizer import Tokenizer


def special_token_ids(tok: Tokenizer) -> dict[str, int | None]:
    """``bos_token_id``, ``eos_token_id``, ``pad_token_id`` of an export's ``config.json``: the ids of the
    tokens :func:`tokenizer_files` names, so transformers' config and tokenizer agree.

    PAD is the EOS, as Llama 3 and Qwen exports do: without a pad token transformers' batched
    ``tokenizer(..., padding=True)`` fails; padded positions are masked, so the id filling them does not
    matter. BOS is null for a tokenizer without one (GPT-2 style, the trained BPE): naming the EOS there
    (as exports did) left ``config.bos_token_id`` 0 against the tokenizer's None.
    """
    return {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.eos_id}


def generation_config_file(tok: Tokenizer) -> bytes:
    """``generation_config.json``: :func:`special_token_ids`, the ids ``config.json`` and the tokenizer files
    name (a BOS of 0 here against none there misled readers). Without a BOS, ``model.generate()`` needs a
    prompt; the document separator the model was trained on starts one: ``generate(torch.tensor([[eos_id]]))``."""
    return json_text(special_token_ids(tok), indent=2).encode() + b"\n"


def tokenizer_files(tok: Tokenizer, model_max_length: int) -> dict[str, bytes]:
    """The tokenizer files of an export: ``tokenizer.json`` and ``tokenizer_config.json`` (name -> content).

    ``tokenizer.json`` gives the same ids as ``tok`` in ``PreTrainedTokenizerFast(tokenizer_file=...)``:
    a tokenizer.json is copied, a tiktoken one (``gpt2``, ``llama3``, a rank file) is converted
    (:meth:`Tokenizer.hf_json`); a converted tokenizer with a BOS (Llama 3) starts every encoding with it,
    as the shards start every document (Meta's post-processor), one without (GPT-2) adds nothing.
    ``tokenizer_config.json`` names the EOS (so HF generation stops where our documents end), the BOS where
    the tokenizer has one, the EOS again as PAD (:func:`special_token_ids` says why), left padding (for
    batched generation), ``model_max_length`` and ``split_special_tokens`` (a special token's text in the input
    is text, as our encode reads it).

    Raises:
        DataError: a tiktoken encoding that cannot be converted (e.g. cl100k_base: gaps in its special ids).
    """
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.eos_token}
    if tok.bos_token is not None:
        config["bos_token"] = tok.bos_token
    config["pad_token"] = tok.eos_token
    # A decoder continues from the last position of each row: batched generate() needs the padding on the
    # left (right padding puts PAD tokens between a short prompt and its continuation).
    config["padding_side"] = "left"
    config["model_max_length"] = model_max_length
    # Our encode never recognises special tokens in text (the shards hold a literal "<|endoftext|>" as text);
    # transformers matches them by default, so a document quoting one got the EOS id there (lm-eval's contexts
    # too): split_special_tokens makes transformers encode such text as we do.
    config["split_special_tokens"] = True
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
            (UntrustedCheckpointError), see :func:`check_checkpoint_matches`; CheckpointCorruptError: a file
            differs from the save, or a tensor holds a NaN or inf (nothing is written then).
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
                if first_nonfinite({n: t}):  # eval and resume refuse it too: never written out as weights
                    raise nonfinite_error(ckpt_dir, n)
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
