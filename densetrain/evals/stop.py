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

A read of the held-out shards that meets an object-store outage (:class:`densetrain.storage.StoreUnavailable`)
goes through the same check: :func:`read_then_stop_point` reads the batch first and hands its failure to
``should_stop(failed)``, whose all-reduced answer stops every rank at that batch (before: the failing rank left
with an error and the others waited in the evaluation's next collective until ``parallel.timeout_s``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from densetrain.storage import ObjectChanged, StoreUnavailable

StopCheck = Callable[..., bool] | None
"""``should_stop(failed=None)``: True when the caller wants the evaluation abandoned, or ``failed`` (this rank's
read error, an outage) makes it stop (the same answer on every rank when the evaluation runs on several);
None: never asked."""

T = TypeVar("T")


class EvalStopped(Exception):
    """An evaluation abandoned before its end because its ``should_stop()`` said so; nothing of it is
    returned (a partial sum over some batches is no value of the metric)."""


def stop_point(should_stop: StopCheck, failed: StoreUnavailable | ObjectChanged | None = None) -> None:
    """Ask ``should_stop`` (when given) before the next forward batch, with this rank's read failure if any.

    Raises:
        EvalStopped: it answered True (chained to ``failed``).
        StoreUnavailable: ``failed``, when there is no ``should_stop`` to agree a stop with (one process, or a
            caller that takes no stop: the error is the caller's to say).
    """
    if should_stop is None:
        if failed is not None:
            raise failed
        return
    if should_stop(failed) if failed is not None else should_stop():
        raise EvalStopped from failed
    if failed is not None:  # a check that ignored the failure: never train or score on a batch not read
        raise failed


def read_then_stop_point(should_stop: StopCheck, read: Callable[[], T]) -> T:
    """``read()`` (the next batch's reads from the held-out shards), then :func:`stop_point` with its outage, so
    that every rank answers the same check whether its own read met the outage or not.

    Raises:
        EvalStopped, StoreUnavailable: as :func:`stop_point`.
    """
    try:
        value, failed = read(), None
    except (StoreUnavailable, ObjectChanged) as e:  # a shard changed in the store stops every rank here too
        value, failed = None, e
    stop_point(should_stop, failed)
    return value
