"""Checkpoints: one path for every parallelism, atomic, with a completion marker and retention.

Layout of ``RUN_DIR/checkpoints/step_00000050/``:

- ``*.distcp`` + ``.metadata``: model and optimizer state through ``torch.distributed.checkpoint``
  (DCP). DCP writes each rank's shards itself, so the same code saves a single-process, DDP, FSDP2 or
  tensor-parallel model, and loads into any of them (resharding).
- ``trainer_state.json``: optimizer step, stage, tokens consumed, sampler position per source,
  world size. JSON, so loading it runs no code.
- ``rng_<rank>.json``: each rank's torch (and CUDA) RNG state, base64.
- ``COMPLETE``: written last. A directory without it is ignored (a write that was killed).

Atomicity: everything is written to ``step_XXXXXXXX.tmp/``, files are fsynced, the marker is
written, then the directory is renamed to its final name and the parent fsynced. A crash at any
point leaves either no checkpoint or a complete one. Loading uses DCP's reader (tensor payloads are
not unpickled as arbitrary objects) and ``json``; nothing from ``torch.load`` with pickle.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from densetrain.fileio import atomic_write_json, fsync_dir

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


def latest_checkpoint(run_dir: Path) -> Path | None:
    """Path of the newest complete checkpoint, or None."""
    done = list_complete(run_dir)
    return done[-1][1] if done else None


def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(root))


def _rng_state() -> dict:
    state = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return state


def _set_rng_state(state: dict) -> None:
    import numpy as np

    def dec(s: str) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(base64.b64decode(s), dtype=np.uint8).copy())

    torch.set_rng_state(dec(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([dec(s) for s in state["cuda"]])


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict, keep: int = 3) -> Path:
    """Save a complete checkpoint for optimizer step ``step``; all ranks must call it.

    Args:
        trainer_state: JSON-serialisable dict (step, stage, sampler state, ...), written by rank 0.
        keep: retention; older complete checkpoints beyond the newest ``keep`` are deleted (0 keeps all).
    Returns:
        The final checkpoint directory.
    """
    root = checkpoint_dir(run_dir)
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    rank = _rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed.*")  # single-process DCP warns
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    atomic_write_json(tmp / f"rng_{rank}.json", _rng_state())
    _barrier()
    if rank == 0:
        atomic_write_json(tmp / "trainer_state.json", trainer_state)
        _fsync_tree(tmp)
        atomic_write_json(tmp / "COMPLETE", {"step": step})
        if final.exists():  # re-saving the same step (e.g. after a rollback): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
        if keep > 0:
            for _, old in list_complete(run_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """Load model (and optimizer) state from checkpoint directory ``path``; return its trainer_state.

    Restores this rank's RNG state when the checkpoint has one for it.

    Raises:
        FileNotFoundError: ``path`` is not a complete checkpoint (no COMPLETE marker).
    """
    path = Path(path)
    if not (path / "COMPLETE").exists():
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no COMPLETE marker)")
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    else:
        state = {"model": get_model_state_dict(model)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed.*")
        dcp.load(state, checkpoint_id=str(path))
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        set_model_state_dict(model, state["model"])
    rng = path / f"rng_{_rank()}.json"
    if rng.exists():
        _set_rng_state(json.loads(rng.read_text()))
    return json.loads((path / "trainer_state.json").read_text())
