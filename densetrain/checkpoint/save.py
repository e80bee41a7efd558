"""Writing a checkpoint, synchronously or in the background: temp dir, shards, digests + fsync, marker,
rename, retention (the protocol of :mod:`densetrain.checkpoint`)."""

from __future__ import annotations

import base64
import errno
import os
import shutil
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
)

from densetrain.checkpoint.common import (
    CheckpointError,
    _agree,
    _barrier,
    _causes,
    _rank,
    _retire,
    checkpoint_dir,
    describe_error,
    list_complete,
    state_dict_options,
    sweep,
)
from densetrain.dcp_read import (
    HASH,
    hash_file,
)
from densetrain.fileio import atomic_write_json, fsync_dir


def _hash_and_fsync(path: Path) -> tuple[dict, str]:
    """Every rank fsyncs and hashes its share of the files of ``path`` (DCP writes them flat), in one
    pass. Returns, on every rank, ``({name: {"bytes", "xxh3_64"}}`` of all of them (for the marker), the
    first rank's error or '')``. All ranks must call it."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    try:
        names = sorted(p.name for p in path.iterdir() if p.is_file() and p.name != "COMPLETE")
        mine, error = {n: hash_file(path / n, fsync=True) for n in names[rank::world]}, ""
    except OSError as e:
        mine, error = {}, describe_error(e)
    if world == 1:
        return mine, error
    shares: list = [None] * world
    dist.all_gather_object(shares, (mine, error))  # small dicts of our own processes
    return {k: v for share, _ in shares for k, v in share.items()}, next((e for _, e in shares if e), "")


def _rng_state() -> dict:
    state = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return state


def _start(run_dir: Path, step: int, trainer_state: dict) -> tuple[Path, Path, str]:
    """Rank 0 makes ``step_XXXXXXXX.tmp/`` (after sweeping leftovers) and writes ``trainer_state.json``
    into it now, so that it is the state of the step being saved even when the shards follow later.
    Every rank learns whether that worked. Returns (tmp, final, error text or '')."""
    root = checkpoint_dir(run_dir)
    final, tmp = root / f"step_{step:08d}", root / f"step_{step:08d}.tmp"

    def start() -> None:
        sweep(run_dir)  # what an interrupted save or retention left
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        atomic_write_json(tmp / "trainer_state.json", trainer_state)

    error = _attempt(start, root) if _rank() == 0 else ""
    return tmp, final, "" if _agree(not error) else (error or "failed on another rank")


_FULL_BYTES = 1 << 20  # less free than this after a failed write: the disk is what is full


def _attempt(fn: Callable[[], object], where: Path) -> str:
    """Run ``fn``, which writes under directory ``where``; '' when it worked, else the one-line reason
    (:func:`describe_error`), which on a full file system is ``no space left on <where>``: torch's zip
    writer reports a short write as ``[enforce fail at inline_container.cc] unexpected pos``, without the
    errno, so a file system with under 1 MiB free right after the failure counts as full too."""
    try:
        fn()
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        text = describe_error(e)
        if any(isinstance(x, OSError) and x.errno == errno.ENOSPC for x in _causes(e)):
            return f"no space left on {where}: {text}"
        try:
            st = os.statvfs(where)
        except OSError:
            return text
        if st.f_bavail * st.f_frsize < _FULL_BYTES:
            return f"no space left on {where}: {st.f_bavail * st.f_frsize} bytes free after the write failed"
        return text
    return ""


def _conclude(run_dir: Path, step: int, tmp: Path, final: Path, error: str, keep: int) -> Path:
    """After the shards of every rank are written (or failed, ``error`` non-empty on some rank): every rank
    hashes and fsyncs its share of the files, rank 0 writes the marker with their digests, renames ``tmp``
    to ``final`` and applies retention; or, on failure, removes ``tmp`` and every rank raises
    :class:`CheckpointError`."""
    root = checkpoint_dir(run_dir)
    files: dict = {}
    if _agree(not error):
        files, error = _hash_and_fsync(tmp)

    def finish() -> None:
        atomic_write_json(tmp / "COMPLETE", {"step": step, "hash": HASH, "files": files})
        if final.exists():  # re-saving the same step (e.g. after a rollback): replace it
            _retire(final)
        os.replace(tmp, final)
        fsync_dir(root)

    ok = _agree(not error)
    if ok and _rank() == 0:
        error = _attempt(finish, root)
    if not _agree(not error):
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{tmp}: checkpoint of step {step} not written ({error or 'failed on another rank'}); "
                              "the earlier checkpoints are intact")
    if _rank() == 0 and keep > 0:
        for _, old in list_complete(run_dir)[:-keep]:
            _retire(old, spare_read=True)
    _barrier()
    return final


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict, keep: int = 3, on_written: Callable[[], None] | None = None) -> Path:
    """Save a complete checkpoint for optimizer step ``step``; all ranks must call it.

    Protocol (module docstring): write into ``step_XXXXXXXX.tmp/``, fsync, marker, rename. Replacing
    an existing checkpoint of the same step and retention go through :func:`_retire`, so at no instant
    is a directory that is being deleted or replaced listed as complete.

    Args:
        trainer_state: JSON-serialisable dict (step, stage, sampler state, ...), written by rank 0.
        keep: retention; older complete checkpoints beyond the newest ``keep`` are deleted (0 keeps all).
        on_written: called on every rank after the shards are written, before the marker (fault
            injection: a kill there must leave the previous checkpoint as the newest complete one).
    Returns:
        The final checkpoint directory.
    Raises:
        CheckpointError: the write failed on some rank (every rank raises; the temporary directory is
            removed, earlier checkpoints are untouched).
    """
    tmp, final, error = _start(run_dir, step, trainer_state)

    def write_shards() -> None:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=state_dict_options(model))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed.*")  # single-process DCP warns
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        atomic_write_json(tmp / f"rng_{_rank()}.json", _rng_state())

    if not error:
        error = _attempt(write_shards, tmp.parent)  # DCP itself runs collectives: every rank enters it
        if on_written is not None:
            on_written()
    return _conclude(run_dir, step, tmp, final, error, keep)


def cpu_stager() -> DefaultStager:
    """A DCP stager for :func:`start_async_save` that copies synchronously (the save returns once the copy
    is complete, so later optimizer steps cannot reach it) into CPU buffers cached across saves: after the
    first save, staging reuses the same memory (no page faults; one copy of the state stays allocated).
    Pinned memory when CUDA is available, for faster device-to-host copies."""
    return DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=False))


@dataclass
class PendingSave:
    """An asynchronous save in flight (:func:`start_async_save`): the shards are being written by DCP's
    background thread into ``tmp``; ``final`` does not exist until :func:`finish_async_save`."""

    step: int
    tmp: Path
    final: Path
    future: Future | None  # DCP's upload future (None when the start already failed)
    error: str = ""  # why the start failed on this rank ('' when it did not)
    started: float = field(default_factory=time.perf_counter)
    written_at: float | None = None  # perf_counter when the background write finished (set by its thread)
    steps_during_write: int = 0  # training steps begun while the write was running (Checkpointer.poll)


def start_async_save(run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     trainer_state: dict, process_group=None, on_written: Callable[[], None] | None = None,
                     stager: DefaultStager | None = None) -> PendingSave:
    """Begin an asynchronous save of step ``step`` with ``torch.distributed.checkpoint.async_save``; all
    ranks must call it. Returns once the state is staged: model and optimizer tensors copied to CPU memory
    (DCP's default stager copies even CPU tensors, so later optimizer steps cannot reach the copy),
    ``trainer_state.json`` and this rank's RNG state written into the temporary directory. DCP's thread
    then writes the shards while training goes on; :func:`finish_async_save` adds the marker.

    Args:
        process_group: a gloo group of all ranks for DCP's collectives, separate from the group training
            uses (both run at once, from two threads); None in a single process.
        on_written: called on every rank once the background write has begun, before any marker (fault
            injection: a kill there dies while the shards are being written).
        stager: a DCP stager kept across saves (:func:`cpu_stager`), whose CPU copies are reused; the
            caller must not start the next save before this one finished. None: DCP's own, per save.
    Returns:
        The :class:`PendingSave` (with ``error`` set if the start failed; finishing it raises then).
    """
    tmp, final, error = _start(run_dir, step, trainer_state)
    pending = PendingSave(step, tmp, final, None, error)

    def stage_and_launch() -> None:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=state_dict_options(model))
        atomic_write_json(tmp / f"rng_{_rank()}.json", _rng_state())
        if process_group is None:
            # DCP warns that a single process is assumed, from its writer thread, outside any catch_warnings.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        pending.future = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp),
                                        process_group=process_group, no_dist=process_group is None,
                                        async_stager=stager)

        def written(_) -> None:
            pending.written_at = time.perf_counter()

        pending.future.add_done_callback(written)

    if not error:
        pending.error = _attempt(stage_and_launch, tmp.parent)
        if on_written is not None:
            on_written()
    return pending


def finish_async_save(pending: PendingSave, run_dir: Path, keep: int) -> Path:
    """Wait for ``pending``'s background write, then (rank 0) fsync, marker, rename and retention, exactly
    as :func:`save_checkpoint` ends; all ranks must call it.

    Raises:
        CheckpointError: the start or the write failed on some rank (every rank raises; the temporary
            directory is removed, earlier checkpoints are untouched).
    """
    error = pending.error
    if not error and pending.future is not None:
        error = _attempt(pending.future.result, pending.tmp.parent)
    return _conclude(run_dir, pending.step, pending.tmp, pending.final, error, keep)
