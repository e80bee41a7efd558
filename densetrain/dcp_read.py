"""Reading ``torch.distributed.checkpoint`` (DCP) directories without running code that a file holds.

DCP's own ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle.load`` and its default load
planner reads every non-tensor entry with ``torch.load(weights_only=False)``: a crafted checkpoint runs any
command as it is loaded. Here (the checkpoint trust rule, README):

- ``.metadata`` goes through an unpickler that builds only DCP's metadata types and the few torch and
  standard types they hold (dtypes, ``torch.Size``, layouts, paths); any other global is refused;
- non-tensor entries (the optimizer's ``param_groups`` values) go through ``torch.load(weights_only=True)``:
  tensors, numbers, strings, lists, tuples, dicts; anything else is refused;
- tensors are read by DCP itself, which already loads them with ``weights_only=True``.

A refusal is :class:`UntrustedCheckpointError`, one line naming the file and what it tried to build. A
missing or unreadable ``.metadata`` is :class:`CheckpointReadError`, raised before DCP sees the file (DCP
would log two tracebacks while it looks for a per-rank copy).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from densetrain.errors import TrainError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# What DCP's .metadata pickles (torch 2.4-2.13): its dataclasses, the storage info of the filesystem writer,
# and the torch/standard types inside them. Checked against a real file in tests/test_checkpoint_trust.py.
_ALLOWED = {
    *((_DCP_METADATA, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                   "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by its name
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class CheckpointReadError(TrainError):
    """A checkpoint file could not be read (missing, truncated, not DCP's): one line naming the file."""


class UntrustedCheckpointError(CheckpointReadError):
    """A checkpoint file would build objects other than plain data (code could run): refused, one line."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it would build {module}.{name}, which is not a DCP metadata type")


def read_metadata(ckpt_dir: str | Path, rank: int | None = None) -> Metadata:
    """DCP's ``Metadata`` of checkpoint directory ``ckpt_dir`` (``.metadata``; ``__<rank>.metadata`` with
    ``rank``), unpickled with only the DCP metadata types allowed.

    Raises:
        CheckpointReadError: the file is missing or not DCP metadata.
        UntrustedCheckpointError: it names any other type or function (one line; nothing is run).
    """
    path = Path(ckpt_dir) / (".metadata" if rank is None else f"__{rank}.metadata")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointReadError(f"{path}: missing (not a DCP checkpoint, or its write was cut short)") from None
    except OSError as e:
        raise CheckpointReadError(f"{path}: cannot read ([Errno {e.errno}] {e.strerror})") from None
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        if str(e).startswith("it would build"):
            raise UntrustedCheckpointError(f"{path}: refused: {e} (checkpoints are read without running code "
                                           "they hold; see the checkpoint trust rule in README)") from None
        raise CheckpointReadError(f"{path}: not DCP metadata (UnpicklingError: {e})") from None
    except Exception as e:  # truncated or random bytes: EOFError, ValueError, TypeError, ...
        raise CheckpointReadError(f"{path}: not DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(md, Metadata):
        raise CheckpointReadError(f"{path}: not DCP metadata (holds a {type(md).__name__})")
    return md


class TrustedReader(FileSystemReader):
    """DCP's filesystem reader with :func:`read_metadata` in place of ``pickle.load``. Pass it with
    :class:`PlainDataPlanner` to ``dcp.load``; call :meth:`read_metadata` first to get one-line errors."""

    def __init__(self, path: str | Path):
        super().__init__(str(path))
        self._dir = Path(path)
        self._cache: dict[int | None, Metadata] = {}

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        if rank not in self._cache:
            self._cache[rank] = read_metadata(self._dir, rank)
        md = self._cache[rank]
        if getattr(md, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class PlainDataPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor entries are loaded with ``weights_only=True``.

    Raises (from ``dcp.load``, wrapped in DCP's ``CheckpointException``):
        UntrustedCheckpointError: an entry that is not plain data, naming its ``.distcp`` file and key.
    """

    def __init__(self, ckpt_dir: str | Path):
        super().__init__()
        self._dir = Path(ckpt_dir)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:
            info = self.metadata.storage_data.get(read_item.storage_index) if self.metadata else None
            where = self._dir / info.relative_path if info is not None else self._dir
            lines = str(e).splitlines()
            why = next((ln.strip() for ln in lines if "GLOBAL" in ln or "Unsupported" in ln), lines[0] if lines else "")
            if isinstance(e, pickle.UnpicklingError):  # what weights_only refuses
                raise UntrustedCheckpointError(f"{where}: refused entry {fqn}: not plain data ({why[:200]}); "
                                               "checkpoints are read without running code they hold") from None
            raise CheckpointReadError(f"{where}: cannot read entry {fqn} ({type(e).__name__}: {why[:200]})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
