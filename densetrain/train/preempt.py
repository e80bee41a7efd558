"""Preemption and Ctrl-C: stop at a step boundary, lose nothing.

A cluster preempts a job with SIGTERM (Slurm's ``--signal=TERM@120`` sends it 120 s before the time
limit; preemption sends it before the kill) or warns it with SIGUSR1 (``--signal=USR1@120``, the signal
PyTorch Lightning's Slurm requeue and submitit listen for), a user presses Ctrl-C (SIGINT). The first of
them is only noted by the handler (:class:`StopRequest`); the loop asks :meth:`StopRequest.requested` at each step
boundary, where under torchrun one MAX all-reduce of the noted signal number makes every rank stop after
the same step even when only some ranks received it (no rank is left waiting in a collective). Then
:func:`stop_run` waits for the asynchronous save in flight, writes a checkpoint of that step (unless it
exists), logs a ``preempt`` event and raises :class:`Preempted`; the CLI exits with
:data:`EXIT_PREEMPTED`, and ``densetrain train --resume RUN_DIR`` continues with the next step.

An in-loop evaluation (validation loss, loss by position, downstream tasks) asks the same question
between its forward batches (:meth:`StopRequest.asked`, handed down as ``should_stop``: evaluations sit
below training and never import this module; :mod:`densetrain.evals.stop`). Every rank runs as many
evaluation batches and asks before each, so every rank abandons the evaluation after the same batch; the
step it followed is checkpointed as above, and its evaluation is not logged (the event says which was
abandoned). The wait from the signal to the stop is therefore at most one training step or one
evaluation batch (one generation batch for GSM8K / HumanEval), whichever is longer, plus the checkpoint.

The handler also restores the default action of the three signals, so a second signal ends the process at
once, whatever it is doing (even inside a hung collective, where no Python code runs): exit status
128 + the signal's number as for any process killed by it (143 for SIGTERM, 130 for SIGINT, 138 for
SIGUSR1), the steps since the last checkpoint lost. SIGUSR1 was not handled before: its default action
killed the run at once, without a checkpoint, 120 s before Slurm would have.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch

from densetrain.checkpoint import save_checkpoint
from densetrain.errors import EXIT_PREEMPTED, Preempted  # noqa: F401  (re-exported: the loop and tests use them here)
from densetrain.parallel import all_reduce_max

"""Exit status after a stop on SIGTERM/SIGINT with the checkpoint written: ``EX_TEMPFAIL`` of BSD's
sysexits.h ("temporary failure; the user is invited to retry"), i.e. resume. Under torchrun the workers
exit with it and torchrun itself exits 1 (it was signalled too); the ``preempt`` event says what happened."""

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

OUTAGE = 1 << 16
""":meth:`StopRequest.requested`'s answer when an evaluation's read met an object-store outage on some rank:
above every signal number, so that the all-reduced maximum says an outage stopped the run."""


class StopRequest:
    """Notes the first SIGTERM, SIGINT or SIGUSR1 while installed (from construction to :meth:`restore`).

    Handlers can only be installed from the main thread; elsewhere (a run started from another thread)
    the signals keep their actions and :meth:`requested` stays False.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.signum = 0  # the first signal noted on this rank (0: none)
        self.noted_at: float | None = None  # time.monotonic() when this rank noted it
        self.agreed = 0  # the last answer of requested(): the same on every rank
        self.outage = ""  # this rank's evaluation read that met an object-store outage (one line), if any
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._note) for s in SIGNALS}

    def _note(self, signum: int, frame) -> None:
        self.signum, self.noted_at = signum, time.monotonic()
        for s in SIGNALS:  # a second signal: the default action (terminate), at once
            signal.signal(s, signal.SIG_DFL)
        if int(os.environ.get("RANK", "0")) == 0:  # os.write: safe wherever the main thread was interrupted
            os.write(2, f"densetrain: {signal.Signals(signum).name} received: finishing the current step (an "
                        f"evaluation is abandoned after its current batch), then a checkpoint and exit "
                        f"{EXIT_PREEMPTED}; send it again to stop at once (the steps since the last checkpoint are "
                        f"lost)\n".encode())

    def requested(self) -> int:
        """At a step boundary, on every rank: the signal number (the highest: SIGTERM 15 over SIGUSR1 10 over
        SIGINT 2) if any rank noted one, :data:`OUTAGE` if a rank's evaluation read met an object-store outage
        (:meth:`asked`), else 0. One all-reduce of one number under torchrun, the same answer on every rank."""
        mine = OUTAGE if self.outage else self.signum
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            self.agreed = mine
        else:
            self.agreed = int(all_reduce_max(torch.tensor([mine], device=self.device)).item())
        return self.agreed

    def asked(self, failed: BaseException | None = None) -> bool:
        """:meth:`requested` as the ``should_stop(failed)`` of an evaluation (:mod:`densetrain.evals.stop`): every
        rank must call it at the same points; ``failed``: this rank's read error (a store outage), which stops
        every rank there."""
        if failed is not None and not self.outage:
            self.outage = " ".join(str(failed).split())
        return bool(self.requested())

    def restore(self) -> None:
        """Put back the actions the signals had before (Python's KeyboardInterrupt for SIGINT)."""
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}


def stop_run(run, signum: int, abandoned: str = "", noted_at: float | None = None,
             outage: tuple[str, str] = ()) -> None:
    """Stop ``run`` at this step boundary (every rank calls it): finish the save in flight, save a
    checkpoint of the current step unless rank 0 has it complete already, log the ``preempt`` event,
    close the metrics sinks. ``abandoned``: the evaluation of the step left unfinished (e.g. 'validation'),
    said in the event; ``noted_at``: when this rank noted the signal (``time.monotonic()``), for the
    event's ``waited_s`` (signal to stop decision, on rank 0 when it received the signal itself). ``outage``:
    ``(what, error)`` instead of a signal: the object store holding ``what`` (the shards' URL) did not answer a
    read (``error``, one line); the stop is the same (every rank, this step boundary, exit 75).

    Raises:
        Preempted: always, once the checkpoint is on disk; when ``checkpoint.dir``'s store did not take it either,
            the one of :meth:`Checkpointer.publish` (its line says "to local disk only, not uploaded").
        CheckpointError: the checkpoint could not be written (one line; the earlier ones are intact).
    """
    name = f"an outage of {outage[0]}" if outage else signal.Signals(signum).name
    step, log = run.state.step, run.log
    waited = None if noted_at is None else time.monotonic() - noted_at
    run.checkpointer.finish_pending(log)
    path = run.run_dir / "checkpoints" / f"step_{step:08d}"
    # Rank 0's view decides (the run directory may be on its node only), so every rank saves or none does.
    have = run.info.is_main and (path / "COMPLETE").exists()
    have = bool(all_reduce_max(torch.tensor([int(have)], device=run.info.device)).item())
    t0 = time.perf_counter()
    if step and not have:
        save_checkpoint(run.run_dir, step, run.model, run.optimizer, run.state_dict(), run.checkpointer.keep)
    not_uploaded = None
    try:
        run.checkpointer.publish(step, log, wait=True)  # to checkpoint.dir, if any
    except Preempted as e:  # its store did not answer either (an event says so): the event below still goes
        not_uploaded = e
    dt = time.perf_counter() - t0
    ckpt = path.name if step else ""
    values = {"signal": name, "checkpoint": ckpt, "seconds": dt, "exit_status": EXIT_PREEMPTED}
    if outage:
        values["error"] = outage[1]
    if not_uploaded is not None:
        values["uploaded"] = False
    if abandoned:
        values["abandoned"] = abandoned
    if waited is not None:
        values["waited_s"] = waited
    # The event (echoed on the console) says what happened; the line naming the resume command is the
    # exception's, printed once by whoever catches it (the CLI: rank 0 only), not twice.
    log.event(step, f"{name}: stopped after step {step}" + (f" ({outage[1]})" if outage else "")
                    + (f" (its {abandoned} abandoned part-way, not logged)" if abandoned else "") + ", "
                    + (f"checkpoint {ckpt} written in {dt:.2f}s" if ckpt else "no step taken, nothing to save"),
              kind="preempt", action="stop", values=values)
    log.close()
    raise not_uploaded or Preempted(name, step, ckpt, run.run_dir)
