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
would log two tracebacks while it looks for a per-rank copy). Every file ``.metadata`` points the reads at
must be a plain name inside the checkpoint directory (a crafted ``../../x`` or ``/etc/x`` is refused).

Contents verified: the ``COMPLETE`` marker of a checkpoint records the size and xxh3-64 digest of each of
its files (``{"step", "hash": "xxh3_64", "files": {name: {"bytes", "xxh3_64"}}}``, written by
:mod:`densetrain.checkpoint`); :func:`verify_checkpoint` re-hashes them before anything is read, and a
difference, or a file the marker does not list, is :class:`CheckpointCorruptError`, one line naming the file.
xxh3-64 (xxHash, Collet 2019): non-cryptographic (it finds damage — flipped bits, overwritten ranges,
truncation — not a forger, whom the trust rule above handles), ~30 GB/s per core, so a checkpoint is
hashed faster than it is read (benchmarks/ckpt_verify_cost.py). A checkpoint whose marker has no hashes
(saved before they were recorded) is read unverified, said once per checkpoint.
"""

from __future__ import annotations

import io
import json
import math
import mmap
import os
import pickle
import re
import stat
import sys
from pathlib import Path

import torch
import xxhash
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from densetrain.errors import TrainError
from densetrain.fileio import json_text, read_bytes_bounded

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


class CheckpointCorruptError(CheckpointReadError):
    """A checkpoint file's bytes differ from what was saved (its digest or size in ``COMPLETE``), or its
    weights are not finite: the checkpoint is damaged. One line naming the file."""


def first_nonfinite(tensors: dict) -> str:
    """The name of the first tensor of ``tensors`` (name -> tensor, DTensor or other value) holding a NaN or
    inf, '' when none does: the one check of the weights a reader takes (``eval`` and resume through
    :func:`densetrain.checkpoint.load_checkpoint`, ``export`` tensor by tensor). A sum is NaN or inf iff a
    value is (or the values overflow, which no trained weight does): one pass without a mask, 10-40x
    faster than ``isfinite().all()`` here."""
    return next((k for k, v in tensors.items() if isinstance(v, torch.Tensor) and v.is_floating_point()
                 and not bool(torch.isfinite((v.to_local() if hasattr(v, "to_local") else v).sum()))), "")


def nonfinite_error(ckpt_dir: str | Path, name: str) -> "CheckpointCorruptError":
    """The one line of a checkpoint whose weights :func:`first_nonfinite` found not finite (``name``: the
    tensor, or where it was found)."""
    return CheckpointCorruptError(f"{ckpt_dir}: holds non-finite weights ({name}): the checkpoint is damaged")


HASH = "xxh3_64"  # the digest the marker records (module docstring)
_WINDOW = 16 << 20  # bytes mapped at a time by hash_file (a multiple of mmap.ALLOCATIONGRANULARITY)
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # a file inside the checkpoint directory, nothing else


def hash_file(path: Path, fsync: bool = False) -> dict:
    """``{"bytes": size, "xxh3_64": hex digest}`` of regular file ``path``, hashed through read-only memory
    maps of 16 MiB at a time (4x faster than chunked reads here: no copy out of the page cache; one window
    mapped at a time, so the resident memory of a reader, e.g. an export, stays small); ``fsync``: also
    fsync it (the save hashes and fsyncs each file in one pass).

    Raises:
        OSError: unreadable, or not a regular file (a FIFO would block, a device never end).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path}: not a regular file")
        h = xxhash.xxh3_64()
        for offset in range(0, st.st_size, _WINDOW):
            with mmap.mmap(fd, min(_WINDOW, st.st_size - offset), access=mmap.ACCESS_READ, offset=offset) as m:
                h.update(m)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return {"bytes": st.st_size, HASH: h.hexdigest()}


def read_marker(ckpt_dir: str | Path) -> dict:
    """The ``COMPLETE`` marker of ``ckpt_dir``, checked: ``step`` a non-negative int and, when present,
    ``files`` a map of plain file names to ``{"bytes": int >= 0, "xxh3_64": 16 hex digits}``.

    Raises:
        CheckpointReadError: missing, not JSON, or not of that shape (one line naming the file and key).
    """
    path = Path(ckpt_dir) / "COMPLETE"
    try:
        marker = json.loads(read_bytes_bounded(path, 1 << 22))  # ~100 bytes a file; a FIFO, /dev/zero refused
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointReadError(f"{path}: cannot read the completion marker ({type(e).__name__}: {e})") from None
    if not isinstance(marker, dict) or type(marker.get("step")) is not int or marker["step"] < 0:
        raise CheckpointReadError(f"{path}: not a completion marker (expected an object with an integer step >= 0)")
    files = marker.get("files")
    if files is None:
        return marker
    if marker.get("hash") != HASH or not isinstance(files, dict):
        raise CheckpointReadError(f"{path}: 'hash' must be {HASH!r} and 'files' an object (got {marker.get('hash')!r})")
    for name, rec in files.items():
        if (not _PLAIN_NAME.fullmatch(name) and name != ".metadata") or not isinstance(rec, dict) \
                or type(rec.get("bytes")) is not int or rec["bytes"] < 0 \
                or not (isinstance(rec.get(HASH), str) and re.fullmatch(r"[0-9a-f]{16}", rec[HASH])):
            raise CheckpointReadError(f"{path}: files.{name[:80]}: expected a plain file name with "
                                      f'{{"bytes": int >= 0, "{HASH}": 16 hex digits}}')
    return marker


_UNVERIFIED: set[str] = set()  # checkpoints already said to have no hashes (once per process)
_VERIFIED: dict[str, tuple[int, int]] = {}  # checkpoint -> its marker's (inode, mtime) when wholly verified


def verify_checkpoint(ckpt_dir: str | Path, names: list[str] | None = None, part: tuple[int, int] = (0, 1),
                      once: bool = False) -> bool:
    """Check the files of checkpoint ``ckpt_dir`` against the sizes and digests of its ``COMPLETE`` marker.

    Args:
        names: only these files (e.g. ``["trainer_state.json"]``); None: every file the marker lists.
        part: ``(rank, world)``: check only every ``world``-th file from the ``rank``-th (the ranks of a
            process group share the work; each must call it).
        once: skip a checkpoint this process already verified whole, marker unchanged (an export reads it
            tensor by tensor, each through a reader of its own); never for a read that may come much later.
    Returns:
        True when verified; False when the marker records no hashes (a checkpoint of an older densetrain:
        read unverified, said once per checkpoint on stderr) or ``ckpt_dir`` has no marker (not ours).
    Raises:
        CheckpointCorruptError: a file is missing, of another size or digest, or in ``ckpt_dir`` (among
            ``names``) but not in the marker (one line naming it).
        CheckpointReadError: the marker itself is unreadable or malformed.
    """
    ckpt_dir = Path(ckpt_dir)
    try:
        st = (ckpt_dir / "COMPLETE").stat()
    except OSError:
        return False
    whole = names is None and part == (0, 1)
    key = str(ckpt_dir.resolve())
    if once and whole and _VERIFIED.get(key) == (st.st_ino, st.st_mtime_ns):  # export reads tensor by tensor: once
        return True
    files = read_marker(ckpt_dir).get("files")
    if files is None:
        if str(ckpt_dir) not in _UNVERIFIED and part[0] == 0:
            _UNVERIFIED.add(str(ckpt_dir))
            print(f"densetrain: note: {ckpt_dir} records no content hashes (saved by an older densetrain): "
                  "read without verifying its contents", file=sys.stderr, flush=True)
        return False
    _refuse_unlisted(ckpt_dir, files, names)
    todo = sorted(files) if names is None else [n for n in names if n in files]
    for name in todo[part[0]::part[1]]:
        want = files[name]
        try:
            got = hash_file(ckpt_dir / name)
        except OSError as e:
            raise CheckpointCorruptError(f"{ckpt_dir / name}: cannot verify ({e.strerror or e}): the checkpoint is "
                                         "damaged or incomplete") from None
        if got != want:
            what = (f"{got['bytes']} bytes, {want['bytes']} saved" if got["bytes"] != want["bytes"]
                    else f"{HASH} {got[HASH]}, {want[HASH]} saved")
            raise CheckpointCorruptError(f"{ckpt_dir / name}: contents differ from the save ({what}): the "
                                         "checkpoint is damaged")
    if whole:
        _VERIFIED[key] = (st.st_ino, st.st_mtime_ns)
    return True


def _refuse_unlisted(ckpt_dir: Path, files: dict, names: list[str] | None) -> None:
    """Only files the marker lists are read: a file of ``ckpt_dir`` (or one of ``names`` that exists) that
    ``files`` leaves out could hold anything, unverified (a marker's line deleted, then the file damaged).

    Raises:
        CheckpointCorruptError: one line naming the first such file.
    """
    try:
        here = [p.name for p in ckpt_dir.iterdir() if p.name != "COMPLETE"] if names is None else \
            [n for n in names if (ckpt_dir / n).exists()]
    except OSError as e:
        raise CheckpointCorruptError(f"{ckpt_dir}: cannot list the checkpoint ({e.strerror or e})") from None
    unlisted = sorted(n for n in here if n not in files)
    if unlisted:
        raise CheckpointCorruptError(f"{ckpt_dir / unlisted[0]}: not among the {len(files)} files its COMPLETE "
                                     "marker lists, so its contents cannot be verified: refused (the marker or "
                                     "the checkpoint is damaged)")


def _check_storage_paths(path: Path, md: Metadata) -> None:
    """Every storage entry of ``md`` names a plain file inside the checkpoint directory, at offset and length
    that are non-negative integers (DCP joins the name to the directory as it is: ``../`` would leave it)."""
    for info in (getattr(md, "storage_data", None) or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not _PLAIN_NAME.fullmatch(name):
            raise UntrustedCheckpointError(f"{path}: refused: a storage entry points at {str(name)[:100]!r}, not a "
                                           "file inside the checkpoint directory")
        if any(type(getattr(info, k, None)) is not int or getattr(info, k) < 0 for k in ("offset", "length")):
            raise CheckpointReadError(f"{path}: storage entry of {name}: offset and length must be integers >= 0")


class _Refused(pickle.UnpicklingError):
    """A class the metadata unpickler will not build: told apart by its type, not by its message's text."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"it would build {module}.{name}, which is not a DCP metadata type")


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
    except _Refused as e:
        raise UntrustedCheckpointError(f"{path}: refused: {e} (checkpoints are read without running code "
                                       "they hold; see the checkpoint trust rule in README)") from None
    except pickle.UnpicklingError as e:
        raise CheckpointReadError(f"{path}: not DCP metadata (UnpicklingError: {e})") from None
    except Exception as e:  # truncated or random bytes: EOFError, ValueError, TypeError, ...
        raise CheckpointReadError(f"{path}: not DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(md, Metadata):
        raise CheckpointReadError(f"{path}: not DCP metadata (holds a {type(md).__name__})")
    _check_storage_paths(path, md)
    return md


class TrustedReader(FileSystemReader):
    """DCP's filesystem reader with :func:`read_metadata` in place of ``pickle.load``. Pass it with
    :class:`PlainDataPlanner` to ``dcp.load``; call :meth:`read_metadata` first to get one-line errors.
    ``verify``: check the checkpoint's contents first (:func:`verify_checkpoint`; a caller that already
    did, e.g. split over ranks, passes False).

    Raises:
        CheckpointCorruptError: with ``verify``, a file differs from the save.
    """

    def __init__(self, path: str | Path, verify: bool = True):
        if verify:
            verify_checkpoint(path, once=True)
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


# trainer_state.json, validated like a config: key -> (type check, what is expected). The counters are bounded by
# what a run can reach (2**62 tokens, 10**12 steps), so a crafted number fails here, not deep inside a resume.
_MAX_INT = 2**62
_INT = (lambda v: type(v) is int and 0 <= v <= _MAX_INT, "an integer >= 0")
_COUNTS = (lambda v: isinstance(v, dict) and all(isinstance(k, str) and _INT[0](n) for k, n in v.items()),
           "an object of source name -> integer >= 0")
_LAYOUT_KEYS = ("dp_replicate", "dp_shard", "tp", "cp", "pp")  # parallel.mesh.Layout's degrees
_NAME = (lambda v: isinstance(v, str) and len(v) <= 256, "a string")
_TRAINER_STATE = {
    "step": ((lambda v: _INT[0](v) and v <= 10**12), "an integer 0..10^12"),
    "tokens": _INT,
    "skipped_steps": _INT,
    "stage": _NAME,
    "data": ((lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items())),
             "an object of source name -> fingerprint string"),
    "world_size": ((lambda v: type(v) is int and 1 <= v <= 2**20), "an integer 1..2^20"),
    "layout": ((lambda v: isinstance(v, dict) and set(v) <= set(_LAYOUT_KEYS)
                and all(type(x) is int and 1 <= x <= 2**20 for x in v.values())),
               f"an object of degree name ({', '.join(_LAYOUT_KEYS)}) -> integer 1..2^20"),
    "dtype": ((lambda v: v in ("fp32", "bf16")), "'fp32' or 'bf16'"),
    "watchers": ((lambda v: isinstance(v, dict) and all(isinstance(x, dict) for x in v.values())),
                 "an object of watcher name -> object"),
    "sampler": ((lambda v: isinstance(v, dict)), "an object"),
}
_REQUIRED = ("step",)  # a resume needs "sampler" too (Checkpointer.load_latest); eval and export do not
_SAMPLER = {
    "samples_seen": _INT, "cursor": _COUNTS, "epoch": _COUNTS, "window": _COUNTS, "grid": _COUNTS,
    "stage_drawn": _COUNTS, "stage_total": _INT,
    "shuffle_seed": ((lambda v: v is None or (type(v) is int and 0 <= v < 2**64)), "null or an integer 0..2^64-1"),
    "stage": ((lambda v: v is None or _NAME[0](v)), "null or a string"),
}
# Losses and update ratios (||delta theta|| / lr) are >= 0; 10^12 is far above any a run measures, and keeps the
# sums of squares of a window of them finite in float64 (no overflow warning from the z-score).
_MAX_MEASURE = 1e12
_FLOATS = (lambda v: isinstance(v, list) and len(v) <= 1 << 20 and all(
    type(x) in (int, float) and 0 <= x <= _MAX_MEASURE for x in v), "a list of numbers 0..1e12")
_STEPS = (lambda v: isinstance(v, list) and len(v) <= 1 << 20 and all(_INT[0](x) for x in v),
          "a list of step indices (integers >= 0)")
# Watchers' saved fields that are read back as numbers (train/watch/guard.py, updates.py, probe.py).
_WATCHER_LISTS = {("guard", "history"): _FLOATS, ("guard", "spikes"): _STEPS, ("updates", "history"): _FLOATS}


def check_trainer_state(state, where: str | Path, step: int | None = None) -> dict:
    """``state`` (a parsed ``trainer_state.json``) checked against its schema (``_TRAINER_STATE``: types and
    bounds of every key a resume, eval, export or blame reads; unknown keys refused: a key this version does not
    read would be lost silently on the next save);
    ``step``: the step of the checkpoint directory, which the file's ``step`` must equal.

    What needs the run's config (stage and source names, seq_len grids, watcher windows) is checked where the
    state is loaded against it (``Run.load_state_dict``).

    Returns: ``state``.
    Raises:
        CheckpointReadError: one line naming ``where``, the key and what was expected.
    """
    def bad(key: str, want: str, got=None) -> CheckpointReadError:
        return CheckpointReadError(f"{where}: {key}: expected {want}, got {json_text(got)[:80]}")

    if not isinstance(state, dict):
        raise bad("(top level)", "an object", state)
    for key in _REQUIRED:
        if key not in state:
            raise CheckpointReadError(f"{where}: {key}: missing (expected {_TRAINER_STATE[key][1]})")
    for key, (ok, want) in _TRAINER_STATE.items():
        if key in state and not ok(state[key]):
            raise bad(key, want, state[key])
    _no_unknown(state, _TRAINER_STATE, "", bad)
    layout = state.get("layout")
    if layout and "world_size" in state and math.prod(layout.values()) != state["world_size"]:
        raise bad("layout", f"degrees whose product is world_size ({state['world_size']})", layout)
    if state.get("skipped_steps", 0) > state["step"]:
        raise bad("skipped_steps", f"at most step ({state['step']})", state["skipped_steps"])
    if step is not None and state["step"] != step:
        raise bad("step", f"{step}, the step of its checkpoint directory and marker", state["step"])
    sampler = state.get("sampler", {"cursor": {}, "samples_seen": 0})
    if "cursor" not in sampler or "samples_seen" not in sampler:
        raise CheckpointReadError(f"{where}: sampler: expected samples_seen and cursor (a sampler state)")
    for key, (ok, want) in _SAMPLER.items():
        if key in sampler and not ok(sampler[key]):
            raise bad(f"sampler.{key}", want, sampler[key])
    _no_unknown(sampler, _SAMPLER, "sampler.", bad)
    sources = set(sampler["cursor"])
    for key in ("epoch", "window", "grid", "stage_drawn"):  # one count per source, the cursor's
        if key in sampler and set(sampler[key]) != sources:
            raise bad(f"sampler.{key}", f"the sources of sampler.cursor ({sorted(sources)})", sampler[key])
    if sampler.get("stage_total", 0) > sampler["samples_seen"]:
        raise bad("sampler.stage_total", f"at most samples_seen ({sampler['samples_seen']})", sampler["stage_total"])
    if "stage_drawn" in sampler and sum(sampler["stage_drawn"].values()) != sampler.get("stage_total", 0):
        raise bad("sampler.stage_drawn", f"counts summing to stage_total ({sampler.get('stage_total', 0)})",
                  sampler["stage_drawn"])
    for (name, field_), (ok, want) in _WATCHER_LISTS.items():
        value = state.get("watchers", {}).get(name, {}).get(field_)
        if value is not None and not ok(value):
            raise bad(f"watchers.{name}.{field_}", want, value)
    return state


def _no_unknown(obj: dict, schema: dict, prefix: str, bad) -> None:
    """Refuse a key of ``obj`` that ``schema`` does not name (``bad``: check_trainer_state's error)."""
    unknown = sorted(set(obj) - set(schema))
    if unknown:
        raise bad(f"{prefix}{unknown[0]}", f"no such key (known: {', '.join(schema)})", obj[unknown[0]])


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON (non-finite numbers are written as null)")


def parse_run_json(data: bytes, where: str | Path):
    """Strict JSON of a run file (RFC 8259: ``NaN`` / ``Infinity`` refused, as densetrain never writes them).

    Raises:
        CheckpointReadError: not such JSON (one line naming ``where``).
    """
    try:
        return json.loads(data, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise CheckpointReadError(f"{where}: not JSON ({type(e).__name__}: {str(e)[:200]})") from None
