"""The decision point: watchers look at each step's reduced results and return a verdict.

A watcher is a small object with a few optional methods (no registry, no framework):

- ``before_step(run)``: before the batch is drawn (e.g. fault injection, a heartbeat).
- ``on_batch(run, samples) -> samples``: this rank's samples before they are batched (fault injection
  may replace them; the data probe reads them afterwards, as trained, from ``result.samples``).
- ``on_grads(run, stats)``: gradients accumulated, not yet clipped or reduced (fault injection).
- ``judge(run, result) -> Verdict``: look at a :class:`~densetrain.train.step.StepResult`, whose
  numbers are reduced over ranks, so every rank returns the same verdict without another collective.
- ``after_step(run, result, verdict)``: after the verdict was carried out (counters, events, errors).
- ``state_dict()`` / ``load_state_dict(d)``: what it must remember across a resume (saved in the
  checkpoint under its ``name``).

The most severe verdict of all watchers wins (``APPLY < SKIP < ROLLBACK``). A new feature plugs in
by adding a watcher to :func:`densetrain.train.setup.make_watchers`; the loop does not change.
"""

from __future__ import annotations

from enum import IntEnum


class Verdict(IntEnum):
    """What to do with a computed step, by increasing severity."""

    APPLY = 0
    """Step the optimizer."""
    SKIP = 1
    """Leave parameters and optimizer state untouched; the step's data is consumed."""
    ROLLBACK = 2
    """Return to an earlier checkpoint (reserved for the recovery watchers)."""


class Watcher:
    """Base class: every method is a no-op, so a watcher defines only what it needs."""

    name = "watcher"

    def before_step(self, run) -> None:
        pass

    def on_batch(self, run, samples: list) -> list:
        return samples

    def on_grads(self, run, stats) -> None:
        pass

    def judge(self, run, result) -> Verdict:
        return Verdict.APPLY

    def after_step(self, run, result, verdict: Verdict) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, d: dict) -> None:
        pass

    def close(self) -> None:
        """The run ended (or failed): stop threads, release resources."""


def decide(watchers: list[Watcher], run, result) -> Verdict:
    """The one decision point: the most severe verdict of ``watchers`` on ``result``."""
    return max((w.judge(run, result) for w in watchers), default=Verdict.APPLY)
