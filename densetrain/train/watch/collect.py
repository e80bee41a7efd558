"""Python's garbage collector during training: automatic collection off, one young-generation pass after
every ``train.gc_freq``-th optimizer step.

Why: the cyclic collector starts on its own after every ~700 new container objects, and each training step
creates thousands (autograd nodes, compiled-graph wrappers, the optimizer's per-parameter lists). Over 44 steps
of the 13.8M benchmark shape with ``parallel.compile_blocks`` (2 Zen 4 cores) it ran 254 times inside steps,
278 ms in all, most of it one full pass over the ~390k objects a set-up run tracks (0.26-0.27 s each): a pause
of the main thread while the other threads wait, at a step no other rank shares. Steady steps themselves change
little (708 vs 710 ms in 10-step blocks alternating in one process). Here every rank collects at the same steps,
after the optimizer step (inside that step's timed interval: its ``time/step_s``, tok/s and mfu include the pass,
~1 ms for a young one, ~0.27 s for a full one here). torchtitan does the same (``training.gc_freq``, default
50, a generation-1 collection).

Tensors are freed by reference counting as before; only objects in reference cycles wait for the next pass.
Cycles that outlive a young pass (still referenced then) reach the oldest generation, which a full pass clears
every ``FULL_EVERY`` young passes (~0.3 ms per step at the default); after the run Python's collector is back.
"""

from __future__ import annotations

import gc

from densetrain.train.watchers import Watcher

FULL_EVERY = 20
"""Young passes per full one (a full pass every 1,000 steps at ``train.gc_freq`` 50)."""


class GarbageCollection(Watcher):
    """Automatic collection off from the first step until the run ends (:meth:`close` restores the
    process's previous setting, so a library caller's GC is back after ``train()``); ``gc.collect(1)``
    after every ``every``-th optimizer step (``run.state.step`` a multiple of it), a full ``gc.collect()``
    instead after every ``every * FULL_EVERY``-th."""

    name = "gc"

    def __init__(self, every: int):
        self.every = every
        self.was_enabled: bool | None = None  # None: not started

    def before_step(self, run) -> None:
        if self.was_enabled is None:
            self.was_enabled = gc.isenabled()
            gc.collect(1)  # the set-up's garbage (compile, data loading) before the first step, once
            gc.disable()

    def after_step(self, run, result, verdict) -> None:
        if run.state.step % (self.every * FULL_EVERY) == 0:
            gc.collect()
        elif run.state.step % self.every == 0:
            gc.collect(1)

    def close(self) -> None:
        if self.was_enabled:
            gc.enable()
        self.was_enabled = None
