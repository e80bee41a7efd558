"""The decision point: watchers look at each step's reduced results and return a verdict.

A watcher is a small object with four optional methods (no registry, no framework):

- ``before_step(run)``: before the batch is drawn (e.g. fault injection, a heartbeat).
- ``judge(run, result) -> Verdict``: look at a :class:`~densetrain.train.step.StepResult`, whose
  numbers are reduced over ranks, so every rank returns the same verdict without another collective.
- ``after_step(run, result, verdict)``: after the verdict was carried out (counters, events, errors).
- ``state_dict()`` / ``load_state_dict(d)``: what it must remember across a resume (saved in the
  checkpoint under its ``name``).

The most severe verdict of all watchers wins (``APPLY < SKIP < ROLLBACK``). A new feature plugs in
by adding a watcher to :func:`default_watchers`; the loop does not change.
"""

from __future__ import annotations

from enum import IntEnum

from densetrain.errors import TrainError


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

    def judge(self, run, result) -> Verdict:
        return Verdict.APPLY

    def after_step(self, run, result, verdict: Verdict) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, d: dict) -> None:
        pass


class NonFiniteGuard(Watcher):
    """Never apply a non-finite update: skip it, count it, and stop after ``max_streak`` in a row.

    Args:
        max_streak: ``train.max_nonfinite_steps``; that many consecutive non-finite steps mean the
            weights or the lr are broken, and training stops with a one-line error.
    """

    name = "nonfinite"

    def __init__(self, max_streak: int):
        self.max_streak = max_streak
        self.streak = 0

    def judge(self, run, result) -> Verdict:
        return Verdict.APPLY if result.finite else Verdict.SKIP

    def after_step(self, run, result, verdict: Verdict) -> None:
        if result.finite:
            self.streak = 0
            return
        self.streak += 1
        run.log.event(result.index, f"non-finite loss {result.loss} / grad_norm {result.grad_norm}: update skipped "
                                    f"({run.state.skipped_steps} so far)")
        if self.streak >= self.max_streak:
            run.log.close()
            raise TrainError(
                f"{self.streak} consecutive steps with non-finite loss/gradients (last at step {result.index}): the "
                f"weights or the lr are broken; resume from an earlier checkpoint with a lower optim.peak_lr")


def default_watchers(cfg) -> list[Watcher]:
    """The watchers of a run configured by ``cfg``."""
    return [NonFiniteGuard(cfg.train.max_nonfinite_steps)]


def decide(watchers: list[Watcher], run, result) -> Verdict:
    """The one decision point: the most severe verdict of ``watchers`` on ``result``."""
    return max((w.judge(run, result) for w in watchers), default=Verdict.APPLY)
