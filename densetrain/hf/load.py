"""Import: a local Hugging Face Llama folder (``config.json`` + ``*.safetensors``) as our config and
state dict, every key and tensor shape checked (one line naming the file). Reading uses
``safetensors.torch.load_file`` only — never ``torch.load`` / pickle.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from densetrain.config import Config, ModelConfig, validate
from densetrain.errors import DataError
from densetrain.fileio import ReadRefused, open_regular, read_json
from densetrain.hf.mapping import _hf_to_our_name, from_hf_state_dict, rope_scaling_from_hf
from densetrain.model.llama import Transformer

# The config.json keys import_hf needs (LlamaConfig has defaults for them, but a checkpoint's shapes
# follow from them, so guessing one would only move the error to a tensor shape).
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _check_safetensors_files(files: list[Path], n_params: int, conf_path: Path) -> None:
    """Before ``load_file`` maps and copies them: each of ``files`` a regular file (a FIFO or a link to /dev/zero
    would block or never end), all together at most 8 bytes for each of the ``n_params`` parameters
    ``conf_path`` implies (fp64, 4x the usual bf16: room for a separate lm_head and extra buffers) + 1 GiB of
    headers, so a crafted file cannot make the import allocate far beyond the model it describes.

    Raises: ReadRefused (an OSError: one line naming the file); DataError (too large, naming the folder)."""
    total = 0
    for f in files:
        with open_regular(f) as fh:
            total += os.fstat(fh.fileno()).st_size
    limit = 8 * n_params + (1 << 30)
    if total > limit:
        raise DataError(f"{files[0].parent}: the *.safetensors files hold {total} bytes, more than the {limit} "
                        f"bytes {n_params} parameters ({conf_path.name}) can take at 8 bytes each plus 1 GiB")


def _read_hf_config(conf_path: Path) -> dict:
    """``config.json`` as a dict. Raises: FileNotFoundError (absent); DataError (unreadable, not JSON,
    not an object), one line naming the file and the line/column."""
    if not conf_path.exists() and not conf_path.is_symlink():  # not a regular file: read_json says what it is
        raise FileNotFoundError(f"{conf_path}: not found; import-hf expects a folder with config.json + *.safetensors")
    try:
        hc = read_json(conf_path)  # a regular file of at most 16 MiB, nesting Python's parser can follow
    except json.JSONDecodeError as e:
        raise DataError(f"{conf_path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except ReadRefused as e:
        raise DataError(str(e)) from None
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
    _check_safetensors_files(files, sum(math.prod(s) for s in want.values()), conf_path)
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
