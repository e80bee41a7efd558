"""Checkpoints: one path for every parallelism, atomic, with a completion marker and retention.

Layout of ``RUN_DIR/checkpoints/step_00000050/``:

- ``*.distcp`` + ``.metadata``: model and optimizer state through ``torch.distributed.checkpoint``
  (DCP). DCP writes each rank's shards itself, so the same code saves a single-process, DDP, FSDP2 or
  tensor-parallel model, and loads into any of them (resharding).
- ``trainer_state.json``: optimizer step, stage, tokens consumed, sampler position per source,
  world size. JSON, so loading it runs no code.
- ``rng_<rank>.json``: each rank's torch (and CUDA) RNG state, base64.
- ``COMPLETE``: written last, with the size and xxh3-64 digest of every other file
  (:mod:`densetrain.dcp_read`). A directory without it is ignored (a write that was killed); a resume says
  so when it passes over one newer than the checkpoint it loads.

Contents verified: every read (resume, rollback, eval, export, replay, blame) checks the files against
the marker first; a difference, or non-finite weights, is :class:`~densetrain.dcp_read.CheckpointCorruptError`,
one line naming the file. ``--resume`` then falls back to the next older checkpoint, with that line on
the console (as for any checkpoint that does not load), and the guard's rollback passes over such a
checkpoint to an older one, in an event; ``eval`` and ``export`` refuse it. A checkpoint of an older
densetrain, without digests, is read unverified, said once.

Readers beside a writer: ``eval`` and ``export`` of a run that is still training hold a read lease on the
checkpoint they read (:func:`leased_checkpoint`; a file ``step_XXXXXXXX.reader-PID`` beside it), which
retention respects: a leased checkpoint is kept while that process lives and deleted by a later save.

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

Object storage (``checkpoint.dir``, :mod:`densetrain.checkpoint.mirror`): the directory above stays the
staging area; each complete checkpoint is then uploaded with its marker last, retention deletes there too,
and a resume, ``eval`` or ``export`` of the URL reads a fetched copy, verified as above.

:class:`Checkpointer` is what the training loop talks to: the interval, the veto after a non-finite
step, retention, the one async save in flight, and resuming from the newest checkpoint that loads.
"""

from densetrain.checkpoint.checkpointer import Checkpointer
from densetrain.checkpoint.common import (
    CheckpointError,
    checkpoint_dir,
    describe_error,
    latest_checkpoint,
    list_complete,
    passed_over,
    set_aside,
    sweep,
)
from densetrain.checkpoint.load import (
    CheckpointMismatchError,
    leased_checkpoint,
    load_checkpoint,
    read_trainer_state,
)
from densetrain.checkpoint.mirror import localize, open_store, run_checkpoints
from densetrain.checkpoint.save import (
    PendingSave,
    cpu_stager,
    finish_async_save,
    save_checkpoint,
    start_async_save,
)
from densetrain.dcp_read import CheckpointCorruptError, CheckpointReadError

__all__ = [
    "CheckpointCorruptError", "CheckpointError", "CheckpointMismatchError", "CheckpointReadError", "Checkpointer",
    "PendingSave", "checkpoint_dir", "cpu_stager", "describe_error", "finish_async_save", "latest_checkpoint",
    "leased_checkpoint", "list_complete", "load_checkpoint",
    "localize", "open_store", "run_checkpoints", "passed_over", "read_trainer_state", "save_checkpoint",
    "set_aside", "start_async_save", "sweep",
]
