"""The training loop's :class:`Checkpointer` (:mod:`densetrain.checkpoint`)."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Callable

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from densetrain.checkpoint.common import (
    CheckpointError,
    _agree,
    _rank,
    describe_error,
    list_complete,
    passed_over,
    set_aside,
)
from densetrain.checkpoint.load import CheckpointMismatchError, load_checkpoint
from densetrain.checkpoint.mirror import note_set_aside, sync_up
from densetrain.checkpoint.save import PendingSave, cpu_stager, finish_async_save, save_checkpoint, start_async_save
from densetrain.dcp_read import CheckpointReadError, UntrustedCheckpointError
from densetrain.errors import Preempted, TrainError
from densetrain.parallel import collective_timeout
from densetrain.storage import StoreUnavailable, counters


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
        remote: ``checkpoint.dir`` ('' none): each completed checkpoint is uploaded there (:meth:`publish`).
    """

    def __init__(self, run_dir: Path, every: int, keep: int, last_step: int, async_save: bool = False,
                 remote: str = ""):
        self.run_dir, self.every, self.keep, self.last_step = Path(run_dir), every, keep, last_step
        self.async_save, self.remote = async_save, remote
        self.on_written: Callable[[], None] | None = None  # see save_checkpoint (fault injection)
        self.seconds = 0.0  # time spent blocked in saves (the watchdog's 'checkpoint' phase)
        self.pending: PendingSave | None = None
        self._group = None  # the gloo group of DCP's background collectives, made at the first async save
        self._stager = cpu_stager() if async_save else None  # its CPU copies are reused by every save
        self._upload: tuple | None = None  # (rank 0's upload thread or None, its result): see publish
        self.notes: list[str] = []  # what a resume passed over (:meth:`load_latest`), for the run's events

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
        self.publish(step, log)
        return path

    def poll(self, log) -> Path | None:
        """Before a step: complete the save in flight when its write has finished on every rank (all
        ranks must call it; one small collective while a save is pending, so all of them decide alike).

        Returns:
            The completed checkpoint directory, or None (nothing pending, or still writing).
        Raises:
            CheckpointError: the background write failed (see :func:`finish_async_save`).
        """
        if self._upload is not None and _agree(self._upload[0] is None or not self._upload[0].is_alive()):
            self._finish_upload(self._upload[1]["step"], log)
        p = self.pending
        if p is None:
            return None
        if not _agree(p.future is None or p.future.done()):
            p.steps_during_write += 1
            return None
        return self.finish_pending(log)

    def finish_pending(self, log) -> Path | None:
        """Wait for the save in flight, if any, and complete it (all ranks must call it): at the end of
        training, before a new save, before a rollback. Without a save in flight, waits for the upload in
        flight (:meth:`publish`), if any.

        Raises:
            CheckpointError: its write failed (see :func:`finish_async_save`).
        """
        p, self.pending = self.pending, None
        if p is None:
            if self._upload is not None:  # the end of training: the last upload done before the run ends
                self._finish_upload(self._upload[1]["step"], log)
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
        self.publish(p.step, log)
        return path

    def publish(self, step: int, log, wait: bool = False) -> None:
        """Upload the checkpoints completed since the last upload to ``checkpoint.dir`` (rank 0; all ranks call
        it), with remote retention (:func:`densetrain.checkpoint.mirror.sync_up`); nothing without one. With
        ``async_save`` the upload runs in a background thread while training goes on (:meth:`poll` completes
        it), except at ``last_step`` or with ``wait``; a new upload first waits for the previous one.

        Raises:
            Preempted: the store did not answer within the retry budget: the run stops here (exit status 75)
                with its checkpoint on local disk only, said in the one line; the same command continues it
                (and uploads it) once the store is back.
            CheckpointError: the upload failed otherwise (refused, a local file gone): one line.
        """
        if not self.remote:
            return
        self._finish_upload(step, log)
        result: dict = {"step": step, "t0": time.perf_counter(), "uploaded": [], "error": None}

        def upload() -> None:
            try:
                result["uploaded"] = sync_up(self.run_dir, self.remote, self.keep)
            except Exception as e:  # noqa: BLE001 - every rank learns of it in _finish_upload
                result["error"] = e

        thread = None
        if _rank() == 0:
            thread = threading.Thread(target=upload, name="densetrain-upload", daemon=True)
            thread.start()
        self._upload = (thread, result)
        if wait or not self.async_save or step == self.last_step:
            self._finish_upload(step, log)

    def _finish_upload(self, step: int, log) -> None:
        """Wait for the upload in flight, if any, and say how it ended (all ranks; one collective)."""
        if self._upload is None:
            return
        (thread, result), self._upload = self._upload, None
        if thread is not None:
            thread.join()
        error = result["error"]
        if not _agree(error is None):
            newest = list_complete(self.run_dir)
            name = newest[-1][1].name if newest else ""
            if error is not None:
                log.event(step, f"checkpoint upload failed: {error}", kind="checkpoint", action="store_down")
            if error is None or isinstance(error, StoreUnavailable):  # (another rank's view: rank 0's error)
                raise Preempted(f"an outage of {self.remote}", step, name, self.run_dir,
                                " to local disk only, not uploaded")
            raise CheckpointError(f"{self.remote}: upload of {name} failed ({describe_error(error)})")
        if result["uploaded"]:
            dt = time.perf_counter() - result["t0"]
            log.event(result["step"], f"checkpoint {', '.join(result['uploaded'])} uploaded to {self.remote} "
                                      f"({dt:.2f}s)", kind="checkpoint", action="uploaded",
                      values={"upload_seconds": dt, **counters})

    def abandon_pending(self, log=None) -> None:
        """Leaving on an error with a save in flight (a full disk under the run's other files, a peer rank
        killed): wait up to 60 s for its background write to end, then delete its ``.tmp`` (rank 0), so no
        half-written ``step_N.tmp`` stays behind; the write's own outcome no longer matters. Said once, in an
        event of ``log`` (a metrics logger) when given, as a resume says the partial saves it passes over."""
        p, self.pending = self.pending, None
        if p is None:
            return
        if log is not None and _rank() == 0:
            try:
                log.event(p.step, f"abandoned the checkpoint save of step {p.step} in flight (the run ends on an "
                                  f"error): deleting its partial {p.tmp}", kind="checkpoint", action="pass_over")
            except OSError:  # the full disk that ended the run: the deletion below still happens
                pass
        if p.future is not None:
            try:
                p.future.result(timeout=60)
            except BaseException:  # noqa: BLE001 - a failed or unfinished write: it is deleted either way
                pass
        if _rank() == 0:
            shutil.rmtree(p.tmp, ignore_errors=True)

    def load_latest(self, model, optimizer) -> tuple[Path | None, dict | None]:
        """Load the newest complete checkpoint that loads cleanly; fall back to older ones, saying why (one line
        per checkpoint passed over, naming the file: unreadable, of another model shape, damaged — its files
        differ from their digests — or holding non-finite weights).

        The newer ones passed over are then set aside (``RUN_DIR/checkpoints_set_aside/``, kept, as a rollback's
        are; one note in :attr:`notes`): the run goes on from the one loaded, and retention, which keeps the
        newest ``keep`` by step, kept them and deleted the checkpoints of the resumed run instead (with
        ``keep = 1`` its only loadable one), leaving nothing to resume from after the next stop.

        Returns:
            (path, trainer_state), or (None, None) when the run has no complete checkpoint.
        Raises:
            TrainError: checkpoints exist but none loads (corrupt, or made for another model shape).
            UntrustedCheckpointError: the newest one holds a crafted file (no fallback then).
        """
        done = list_complete(self.run_dir)
        self._say_passed_over(done[-1][0] if done else -1)
        errors, mismatch = [], False
        for step, path in reversed(done):
            try:
                state = load_checkpoint(path, model, optimizer)
                if "sampler" not in state:
                    raise CheckpointReadError(f"{path}/trainer_state.json: sampler: missing (a resume needs the "
                                              "sampler's position)")
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
                continue
            if errors:  # every rank passed over the same ones (load_checkpoint agrees on a failure)
                if self.remote and _rank() == 0:  # their copies in the store too, before any fetch or upload
                    note_set_aside(self.run_dir, step)
                set_aside(self.run_dir, step)
                newer = ", ".join(p.name for s, p in done if s > step)
                self.notes.append(f"set aside {newer} in {self.run_dir / 'checkpoints_set_aside'} (could not be "
                                  f"loaded): the run goes on from {path.name}, and retention counts from there")
            return path, state
        if done:
            # The hint only where it is the cause: for a corrupt file it would send the user the wrong way.
            hint = "; model.* settings cannot change on --resume" if mismatch else ""
            raise TrainError(f"{self.run_dir}: no checkpoint could be loaded ({'; '.join(errors)}){hint}")
        return None, None

    def _say_passed_over(self, newest: int) -> None:
        """Before a resume: one line in :attr:`notes` (setup logs them as events, console included) per checkpoint
        directory newer than the one loaded that is passed over (:func:`passed_over`)."""
        self.notes.extend(passed_over(self.run_dir, newest))
