"""Where checkpoints live and how they leave: listing the complete ones, retention (with read leases),
sweeping what killed saves left, setting checkpoints aside after a rollback, and the one-line errors."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions

from densetrain.errors import TrainError
from densetrain.fileio import fsync_dir, leases_of

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_complete(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run as ``[(step, path), ...]`` sorted by step."""
    root = checkpoint_dir(run_dir)
    out = []
    if root.is_dir():
        for p in root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and (p / "COMPLETE").exists():
                out.append((int(m.group(1)), p))
    return sorted(out)


def passed_over(run_dir: Path, newest: int, doing: str = "resuming from") -> list[str]:
    """One line per checkpoint directory of ``run_dir`` newer than step ``newest`` (the one used; -1: none) that
    is passed over: a ``step_N.tmp`` of a save that was killed (the next save sweeps it) or a ``step_N``
    without its completion marker. ``doing``: what is done instead (``resuming from``, ``evaluating``)."""
    root, out = checkpoint_dir(run_dir), []
    for p in sorted(root.iterdir()) if root.is_dir() else ():
        m = _STEP_DIR.match(p.name[:-len(".tmp")] if p.name.endswith(".tmp") else p.name)
        if not m or int(m.group(1)) <= newest or not p.is_dir() or (p / "COMPLETE").exists():
            continue
        what = "a partial save (killed before its completion marker)" if p.suffix == ".tmp" else \
            "no completion marker (a save that did not finish, or a damaged checkpoint)"
        out.append(f"passed over {p}: {what}; {doing} " + (f"step_{newest:08d}" if newest >= 0 else "no checkpoint"))
    return out


def latest_checkpoint(run_dir: Path) -> Path | None:
    """Path of the newest complete checkpoint, or None."""
    done = list_complete(run_dir)
    return done[-1][1] if done else None


class CheckpointError(TrainError):
    """A checkpoint could not be written (disk full, permission denied, I/O error) or read (truncated,
    another model shape): one line, naming the directory and the error. After a failed write the
    previous checkpoints are intact and no temporary directory is left behind."""


def _agree(ok: bool) -> bool:
    """True on every rank iff ``ok`` on every rank (one collective; a single process just returns ok)."""
    if not dist.is_initialized():
        return ok
    # An NCCL default group reduces device tensors only (the gloo group of async saves is DCP's alone).
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([int(ok)], device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _retire(path: Path, spare_read: bool = False) -> bool:
    """Remove a checkpoint directory so that it is never seen half-deleted: it is first renamed out of
    the ``step_XXXXXXXX`` namespace (one atomic rename, made durable), then deleted. A kill -9 in
    between leaves a ``.retired`` directory that :func:`sweep` removes later; no lister can choose it.

    ``spare_read`` (retention): when a live process holds a read lease on it (:func:`leased_checkpoint`),
    it is renamed back and kept. The leases are looked at after the rename, and a reader looks for the
    checkpoint after taking its lease, so either the reader sees it gone (and reads another) or
    retention sees the lease. Returns whether it was removed."""
    gone = path.with_name(f"{path.name}.retired")
    shutil.rmtree(gone, ignore_errors=True)
    os.replace(path, gone)
    fsync_dir(path.parent)
    readers = leases_of(path) if spare_read else []
    if readers:
        os.replace(gone, path)
        fsync_dir(path.parent)
        print(f"densetrain: note: retention keeps {path.name} while process {readers[0]} reads it (a later save "
              "deletes it)", file=sys.stderr, flush=True)
        return False
    shutil.rmtree(gone, ignore_errors=True)
    return True


def sweep(run_dir: Path) -> None:
    """Delete what interrupted saves and retentions left (``*.tmp``, ``*.retired``), and the read leases of
    readers no longer running; rank 0 only."""
    root = checkpoint_dir(run_dir)
    if _rank() == 0 and root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and p.suffix in (".tmp", ".retired") and _STEP_DIR.match(p.stem):
                shutil.rmtree(p, ignore_errors=True)
            elif _STEP_DIR.match(p.name):
                leases_of(p)  # sweeps the dead ones


def describe_error(e: BaseException) -> str:
    """One line for a failed checkpoint read or write: the OS error when there is one, else the first
    line of the innermost error (DCP wraps each rank's failure in a CheckpointException)."""
    causes = list(_causes(e))
    errno_text = next((f"[Errno {x.errno}] {x.strerror}" for x in causes if isinstance(x, OSError) and x.errno), "")
    inner = next((x for x in causes if not isinstance(x, CheckpointException)), e)
    first = (str(inner).strip().splitlines() or [type(inner).__name__])[0]
    return errno_text or f"{type(inner).__name__}: {first[:200]}"


def _causes(e: BaseException):
    seen = 0
    while e is not None and seen < 10:
        yield e
        if isinstance(e, CheckpointException):
            for failure in getattr(e, "failures", {}).values():  # rank -> (exception, traceback)
                yield failure[0] if isinstance(failure, tuple) else failure
        e = e.__cause__ or e.__context__
        seen += 1


def set_aside(run_dir: Path, after_step: int) -> list[Path]:
    """Move the complete checkpoints later than ``after_step`` out of the checkpoint directory into
    ``RUN_DIR/checkpoints_set_aside/`` (kept, never listed, never deleted by retention); rank 0 moves,
    every rank waits. Used by rollbacks: those checkpoints hold the trouble rolled back from.

    Returns:
        The new paths.
    """
    moved = []
    if _rank() == 0:
        aside = Path(run_dir) / "checkpoints_set_aside"
        aside.mkdir(parents=True, exist_ok=True)
        for step, path in list_complete(run_dir):
            if step > after_step:
                dest = aside / path.name
                k = 1
                while dest.exists():  # a second rollback past the same step
                    dest, k = aside / f"{path.name}.{k}", k + 1
                os.replace(path, dest)
                moved.append(dest)
        fsync_dir(checkpoint_dir(run_dir))
    _barrier()
    return moved


def state_dict_options(model, saved: dict | None = None) -> StateDictOptions:
    """The optimizer state's form: flattened (``param_groups.<name>.<key>``, ``state.<name>.<key>``) for a
    pipeline stage's model (``full_state_names``, densetrain/parallel/pipeline.py), whose indexed param
    groups would overwrite another stage's in the checkpoint (DCP keeps one copy of a key); else torch's
    nested default. Loading follows the checkpoint's form (``saved``: its metadata), so either loads at any
    pipeline degree."""
    if saved is None:
        flat = hasattr(model, "full_state_names")
    else:
        flat = any(k.startswith("optim.param_groups.") and not k.split(".")[2].isdigit() for k in saved)
    return StateDictOptions(flatten_optimizer_state_dict=flat)
