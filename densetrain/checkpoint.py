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
point leaves either no checkpoint or a complete one. Deleting (retention) or replacing a checkpoint
first renames it to ``step_XXXXXXXX.retired`` (never listed), then deletes it. A failed write (disk
full, read-only, I/O error) raises :class:`CheckpointError` and removes its temporary directory.
Loading runs no code that a file holds (the checkpoint trust rule, README): ``.metadata`` is unpickled
with only DCP's metadata types allowed, non-tensor entries with ``torch.load(weights_only=True)``
(:mod:`densetrain.dcp_read`), the rest is JSON. A crafted file is refused with one line
(:class:`~densetrain.dcp_read.UntrustedCheckpointError`), also by ``--resume``, which then does not fall
back to an older checkpoint.

Asynchronous saves (``checkpoint.async_save``, :func:`start_async_save`): ``trainer_state.json`` and
the RNG states are written and the tensors copied to CPU memory when the save starts (so they are the
saved step's), then ``torch.distributed.checkpoint.async_save`` writes the shards from a background
thread, running its collectives on a gloo group of its own, while training goes on. The marker, the
rename and retention come only after that write finished on every rank (:func:`finish_async_save`), so
a kill at any point during the write leaves the previous checkpoint as the newest complete one.

:class:`Checkpointer` is what the training loop talks to: the interval, the veto after a non-finite
step, retention, the one async save in flight, and resuming from the newest checkpoint that loads.
"""

from __future__ import annotations

import base64
import errno
import json
import os
import re
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
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from densetrain.dcp_read import CheckpointReadError, PlainDataPlanner, TrustedReader, UntrustedCheckpointError
from densetrain.errors import TrainError
from densetrain.fileio import atomic_write_json, fsync_dir
from densetrain.parallel import collective_timeout

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


class CheckpointError(TrainError):
    """A checkpoint could not be written (disk full, permission denied, I/O error) or read (truncated,
    another model shape): one line, naming the directory and the error. After a failed write the
    previous checkpoints are intact and no temporary directory is left behind."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint holds another model: its model tensors' names or shapes differ from the model's
    (a ``model.*`` setting changed since it was saved)."""


def _model_mismatch(model_sd: dict, saved: dict) -> str:
    """The first tensors whose shape differs between the model's state dict (global shapes, also of
    DTensors) and the ``model.*`` tensors of checkpoint metadata ``saved``, or that only one of them
    has, as ``name: SHAPE saved, SHAPE in the model``; '' when they agree."""
    want = {k: tuple(v.shape) for k, v in model_sd.items() if isinstance(v, torch.Tensor)}
    got = {k[len("model."):]: tuple(v.size) for k, v in saved.items() if k.startswith("model.") and hasattr(v, "size")}
    # An entry saved as something else than a tensor is not a shape question: the load refuses it by name.
    other = {k[len("model."):] for k in saved if k.startswith("model.")} - set(got)
    names = sorted(n for n in set(got) | set(want) if n not in other and got.get(n) != want.get(n))
    return ", ".join(f"{n}: {list(got[n]) if n in got else 'none'} saved, "
                     f"{list(want[n]) if n in want else 'none'} in the model" for n in names[:3])


def _agree(ok: bool) -> bool:
    """True on every rank iff ``ok`` on every rank (one collective; a single process just returns ok)."""
    if not dist.is_initialized():
        return ok
    # An NCCL default group reduces device tensors only (the gloo group of async saves is DCP's alone).
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([int(ok)], device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _retire(path: Path) -> None:
    """Remove a checkpoint directory so that it is never seen half-deleted: it is first renamed out of
    the ``step_XXXXXXXX`` namespace (one atomic rename, made durable), then deleted. A kill -9 in
    between leaves a ``.retired`` directory that :func:`sweep` removes later; no lister can choose it."""
    gone = path.with_name(f"{path.name}.retired")
    shutil.rmtree(gone, ignore_errors=True)
    os.replace(path, gone)
    fsync_dir(path.parent)
    shutil.rmtree(gone, ignore_errors=True)


def sweep(run_dir: Path) -> None:
    """Delete what interrupted saves and retentions left (``*.tmp``, ``*.retired``); rank 0 only."""
    root = checkpoint_dir(run_dir)
    if _rank() == 0 and root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and p.suffix in (".tmp", ".retired") and _STEP_DIR.match(p.stem):
                shutil.rmtree(p, ignore_errors=True)


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
    """After the shards of every rank are written (or failed, ``error`` non-empty on some rank): rank 0
    fsyncs, writes the marker, renames ``tmp`` to ``final`` and applies retention; or, on failure, removes
    ``tmp`` and every rank raises :class:`CheckpointError`."""
    root = checkpoint_dir(run_dir)

    def finish() -> None:
        _fsync_tree(tmp)
        atomic_write_json(tmp / "COMPLETE", {"step": step})
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
            _retire(old)
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
        model_sd, optim_sd = get_state_dict(model, optimizer)
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
        model_sd, optim_sd = get_state_dict(model, optimizer)
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


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """Load model (and optimizer) state from checkpoint directory ``path``; return its trainer_state.

    Restores this rank's RNG state when the checkpoint has one for it.

    Raises:
        FileNotFoundError: ``path`` is not a complete checkpoint (no COMPLETE marker).
        CheckpointReadError: a file is missing or unreadable (one line naming it); UntrustedCheckpointError
            (a subclass): a file would build anything but plain data (nothing is run).
        CheckpointMismatchError: the checkpoint's model tensors have other names or shapes than ``model``'s.
        CheckpointError: anything else (a truncated shard, a torn RNG file).
    """
    path = Path(path)
    if not (path / "COMPLETE").exists():
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no COMPLETE marker)")
    trainer_state = read_trainer_state(path)
    try:
        reader = TrustedReader(path)
        saved = reader.read_metadata().state_dict_metadata  # a missing, torn or crafted file: one line, here
        if optimizer is not None:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            _keep_saved_optimizer_state(optim_sd, saved)
            state = {"model": model_sd, "optim": optim_sd}
        else:
            state = {"model": get_model_state_dict(model)}
        diff = _model_mismatch(state["model"], saved)
        if diff:
            raise CheckpointMismatchError(f"{path}: the checkpoint's model tensors do not match the model ({diff})")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed.*")
            dcp.load(state, storage_reader=reader, planner=PlainDataPlanner(path))
        set_model_state_dict(model, state["model"])  # strict: every tensor of the model was read
        if optimizer is not None:  # not strict: parameters without saved state start afresh (see above)
            set_optimizer_state_dict(model, optimizer, state["optim"], options=StateDictOptions(strict=False))
        rng = path / f"rng_{_rank()}.json"
        if rng.exists():
            _set_rng_state(json.loads(rng.read_text()))
    except CheckpointMismatchError:
        raise
    except (Exception, CheckpointException) as e:  # a truncated shard, another model shape, a torn RNG file
        ours = next((x for x in _causes(e) if isinstance(x, CheckpointReadError)), None)
        if ours is not None:  # already one line naming the file (dcp_read)
            raise ours from None
        raise CheckpointError(f"{path}: cannot load ({describe_error(e)})") from None
    return trainer_state


def _keep_saved_optimizer_state(optim_sd: dict, saved: dict) -> None:
    """Drop from ``optim_sd`` (``get_state_dict``'s optimizer half, which holds state for every parameter)
    the parameters that have no state in the checkpoint: AdamW makes none for a parameter that never had a
    gradient, and such a parameter then starts from fresh state, as it would have without the save. A
    parameter with some of its state saved keeps all of it, so a torn entry is still an error."""
    for fqn in list(optim_sd.get("state", {})):
        if not any(f"optim.state.{fqn}.{k}" in saved for k in optim_sd["state"][fqn]):
            del optim_sd["state"][fqn]


def read_trainer_state(path: Path) -> dict:
    """``trainer_state.json`` of checkpoint ``path``.

    Raises:
        CheckpointError: missing or not JSON (one line).
    """
    try:
        return json.loads((Path(path) / "trainer_state.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}/trainer_state.json: cannot read ({type(e).__name__}: {e})") from None


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


class Checkpointer:
    """The training loop's checkpoints: when to save, when not to, how many to keep, where to resume, and
    the one asynchronous save in flight.

    Args:
        run_dir: the run directory (checkpoints live in ``run_dir/checkpoints``).
        every: save after every ``every`` optimizer steps (0: only at ``last_step``).
        keep: retention, see :func:`save_checkpoint`.
        last_step: the step this invocation stops at (always saved, so a stopped run can resume).
        async_save: write in the background (:func:`start_async_save`): a save blocks only while the state
            is copied to CPU memory; the loop calls :meth:`poll` before each step, which completes the save
            (marker, rename, retention) once the write is done, and :meth:`finish_pending` at the end. A
            new save first waits for the previous one, so at most one is in flight.
    """

    def __init__(self, run_dir: Path, every: int, keep: int, last_step: int, async_save: bool = False):
        self.run_dir, self.every, self.keep, self.last_step = Path(run_dir), every, keep, last_step
        self.async_save = async_save
        self.on_written: Callable[[], None] | None = None  # see save_checkpoint (fault injection)
        self.seconds = 0.0  # time spent blocked in saves (the watchdog's 'checkpoint' phase)
        self.pending: PendingSave | None = None
        self._group = None  # the gloo group of DCP's background collectives, made at the first async save
        self._stager = cpu_stager() if async_save else None  # its CPU copies are reused by every save

    def due(self, step: int) -> bool:
        return bool(self.every and step % self.every == 0) or step == self.last_step

    def save_if_due(self, step: int, model, optimizer, state: dict, finite: bool, log) -> Path | None:
        """Save when :meth:`due`, unless the step just taken was non-finite (its weights are the
        previous step's, but a checkpoint named after it would claim otherwise; the next due step
        saves instead). ``log`` gets one event either way (an async save a second one when it completes).

        Returns:
            The checkpoint directory of a synchronous save; None when nothing was saved or the save runs
            in the background (the directory appears when :meth:`poll` completes it).
        Raises:
            CheckpointError: the write failed (see :func:`save_checkpoint`); with ``async_save``, also the
                previous save's background write, which this call waits for.
        """
        if not self.due(step):
            return None
        if not finite:
            log.event(step, "checkpoint not saved: the last step was non-finite", kind="checkpoint", action="veto")
            return None
        if self.async_save:
            self.finish_pending(log)  # at most one save in flight
            t0 = time.perf_counter()
            if self._group is None and dist.is_initialized():
                # every rank is here: a collective call is safe; parallel.timeout_s as on every group
                self._group = dist.new_group(backend="gloo", timeout=collective_timeout())
            self.pending = start_async_save(self.run_dir, step, model, optimizer, state, self._group,
                                            self.on_written, self._stager)
            dt = time.perf_counter() - t0
            self.seconds += dt
            log.event(step, f"checkpoint step_{step:08d} staged ({dt:.2f}s), writing in the background",
                      kind="checkpoint", action="staged", values={"seconds": dt})
            return None
        t0 = time.perf_counter()
        path = save_checkpoint(self.run_dir, step, model, optimizer, state, self.keep, self.on_written)
        dt = time.perf_counter() - t0
        self.seconds += dt
        log.event(step, f"checkpoint {path.name} ({dt:.2f}s)", kind="checkpoint", values={"seconds": dt})
        return path

    def poll(self, log) -> Path | None:
        """Before a step: complete the save in flight when its write has finished on every rank (all
        ranks must call it; one small collective while a save is pending, so all of them decide alike).

        Returns:
            The completed checkpoint directory, or None (nothing pending, or still writing).
        Raises:
            CheckpointError: the background write failed (see :func:`finish_async_save`).
        """
        p = self.pending
        if p is None:
            return None
        if not _agree(p.future is None or p.future.done()):
            p.steps_during_write += 1
            return None
        return self.finish_pending(log)

    def finish_pending(self, log) -> Path | None:
        """Wait for the save in flight, if any, and complete it (all ranks must call it): at the end of
        training, before a new save, before a rollback.

        Raises:
            CheckpointError: its write failed (see :func:`finish_async_save`).
        """
        p, self.pending = self.pending, None
        if p is None:
            return None
        t0 = time.perf_counter()
        path = finish_async_save(p, self.run_dir, self.keep)
        now = time.perf_counter()
        self.seconds += now - t0
        write_s = (p.written_at or now) - p.started
        log.event(p.step, f"checkpoint {path.name} written in the background ({write_s:.2f}s, "
                          f"{p.steps_during_write} steps meanwhile)", kind="checkpoint", action="written",
                  values={"write_seconds": write_s, "blocked_seconds": now - t0,
                          "steps_during_write": p.steps_during_write})
        return path

    def load_latest(self, model, optimizer) -> tuple[Path | None, dict | None]:
        """Load the newest complete checkpoint that loads cleanly; fall back to older ones, saying why.

        Returns:
            (path, trainer_state), or (None, None) when the run has no complete checkpoint.
        Raises:
            TrainError: checkpoints exist but none loads (corrupt, or made for another model shape).
            UntrustedCheckpointError: the newest one holds a crafted file (no fallback then).
        """
        done = list_complete(self.run_dir)
        errors, mismatch = [], False
        for _, path in reversed(done):
            try:
                return path, load_checkpoint(path, model, optimizer)
            except UntrustedCheckpointError:
                raise  # someone crafted a file in this run: stop, do not quietly resume from an older one
            # A corrupt file or a shape mismatch after a model.* change; DCP wraps failures in
            # CheckpointException, which derives from BaseException, hence listed explicitly.
            except (Exception, CheckpointException) as e:
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                errors.append(f"{path.name}: {type(e).__name__}: {first}")
                mismatch |= isinstance(e, CheckpointMismatchError)
                if _rank() == 0:  # every rank tries the same checkpoints: one line, not one per rank
                    print(f"densetrain: warning: cannot load {path} ({type(e).__name__}: {first}); trying an older one")
        if done:
            # The hint only where it is the cause: for a corrupt file it would send the user the wrong way.
            hint = "; model.* settings cannot change on --resume" if mismatch else ""
            raise TrainError(f"{self.run_dir}: no checkpoint could be loaded ({'; '.join(errors)}){hint}")
        return None, None
