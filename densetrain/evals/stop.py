"""Abandoning an evaluation part-way: the stop check every evaluator makes between its batches.

The training loop stops on SIGTERM / Ctrl-C at a step boundary (:mod:`densetrain.train.preempt`), and an
in-loop evaluation (validation loss, loss by position, downstream tasks) can take minutes on a real run,
past a cluster's grace period. So the evaluators take a ``should_stop`` callable from their caller and ask
it before each forward batch; when it answers True they raise :class:`EvalStopped` and the caller
abandons the evaluation. Evaluations sit below training in the layers, so they never import the signal
handling: the loop hands them ``should_stop`` (one all-reduce of the noted signal under torchrun).

Every data-parallel rank runs the same number of forward calls in every evaluator (stand-in batches:
:func:`densetrain.parallel.even_split`), so every rank asks at the same points and, with an all-reduced
answer, every rank abandons after the same batch: no rank is left waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Callable

StopCheck = Callable[[], bool] | None
"""``should_stop()``: True when the caller wants the evaluation abandoned (the same answer on every rank
when the evaluation runs on several); None: never asked."""


class EvalStopped(Exception):
    """An evaluation abandoned before its end because its ``should_stop()`` said so; nothing of it is
    returned (a partial sum over some batches is no value of the metric)."""


def stop_point(should_stop: StopCheck) -> None:
    """Ask ``should_stop`` (when given) before the next forward batch.

    Raises:
        EvalStopped: it answered True.
    """
    if should_stop is not None and should_stop():
        raise EvalStopped
