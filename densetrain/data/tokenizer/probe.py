"""A tokenizer is tried before it is trusted: :func:`probe_encoder` encodes a fixed set of ordinary texts
under a time limit when a ``tokenizer.json`` is loaded (``Tokenizer.from_file``: prepare, train, eval,
export) or adopted (``densetrain import-hf``), and :func:`raise_if_panic` turns a panic of the Rust
``tokenizers`` library met later, on a text the probe did not try, into one line naming the tokenizer.

Why: a ``tokenizer.json`` is code in all but name. A ``Split`` pre-tokenizer with a backtracking regex
(e.g. ``(\\w+\\s?)*$``) exhausts Oniguruma's retry limit on an ordinary sentence, and ``tokenizers``
then panics (``pyo3_runtime.PanicException``, a ``BaseException`` that no ``except Exception`` catches:
a traceback from ``prepare`` or ``eval --tasks``); a slower pattern can stall every worker instead. The
probe meets both at load time, in a second, with a message that says which file to fix.

The probe runs in a daemon thread (the Rust code releases the GIL): past ``timeout_s`` the caller gets
its error while the thread is abandoned (it cannot be interrupted; the process is about to stop with the
error anyway). While it runs, file descriptor 2 goes to a temporary file, so a panic's Rust backtrace
does not reach the console ahead of the one line; its first line is quoted in the error.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from typing import Callable

from densetrain.errors import DataError

PROBE_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light.",
    "Mr. O'Neil's 3rd-quarter revenue rose 12.5% (to $4,200,000) -- see https://example.com/q3?x=1&y=2.",
    "def mean(xs):\n    return sum(xs) / len(xs)  # empty lists raise\n\n\tif a != b: pass\n",
    '{"id": 17, "text": "a JSON line", "tags": ["x", "y"], "score": -0.25, "ok": null}',
    "Ünïcödé naïve café, 東京都は日本の首都です。Москва — столица России. مرحبا بالعالم. 🙂👍🏽",
    "   leading and trailing spaces, \t tabs,\n\n\nblank lines and     runs of spaces   ",
    "a" * 2000,
    " ".join(["word"] * 400),
)
"""Ordinary texts of the kinds a corpus holds (prose, numbers and URLs, code, JSON, several scripts and
emoji, whitespace runs, a long word and a long sentence): each encodes in well under a millisecond with
any sound tokenizer."""

PROBE_TIMEOUT_S = 20.0
"""Wall-time limit of the probe. A sound tokenizer encodes :data:`PROBE_TEXTS` in < 10 ms (one core);
20 s leaves room for a loaded machine (the library's own thread pool starting, 8 busy cores) and still
stops a pattern that would take hours over a corpus."""


def is_panic(e: BaseException) -> bool:
    """Whether ``e`` is a Rust panic surfaced by PyO3 (``pyo3_runtime.PanicException``: its module is
    created at run time, so the class is known by name only)."""
    return type(e).__name__ == "PanicException"


def panic_error(name: str, e: BaseException) -> DataError:
    """The one line for a panic ``e`` of tokenizer ``name`` (a path or a name)."""
    first = (str(e).strip().splitlines() or ["no message"])[0][:200]
    return DataError(f"{name}: the tokenizer library panicked while encoding ({first}); a pre-tokenizer regex "
                     "that backtracks is the usual cause: fix or replace this tokenizer (data.tokenizer)")


def raise_if_panic(e: BaseException, name: str) -> None:
    """Raise :func:`panic_error` (from None) when ``e`` is a library panic; otherwise return (the caller
    re-raises ``e``)."""
    if is_panic(e):
        raise panic_error(name, e) from None


@contextlib.contextmanager
def _stderr_aside():
    """File descriptor 2 redirected to a temporary file while the block runs (restored after it)."""
    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def probe_encoder(encode_batch: Callable[[list[str]], list[list[int]]], name: str,
                  timeout_s: float = PROBE_TIMEOUT_S) -> float:
    """Encode :data:`PROBE_TEXTS` with ``encode_batch`` (texts -> token ids) in a thread, at most ``timeout_s``.

    Args:
        encode_batch: the tokenizer's batch encoder (for HF ``tokenizers``: the library call itself).
        name: what names the tokenizer in an error (its file, or a name).
        timeout_s: wall-time limit in seconds.

    Returns: the seconds the probe took.

    Raises:
        DataError: one line naming ``name``: the library panicked, raised, returned a wrong number of
            encodings, or took longer than ``timeout_s``.
    """
    out: dict = {}

    def work() -> None:
        try:
            out["ids"] = encode_batch(list(PROBE_TEXTS))
        except BaseException as e:  # a PanicException is a BaseException
            out["error"] = e

    t0 = time.perf_counter()
    with _stderr_aside():
        thread = threading.Thread(target=work, name="tokenizer-probe", daemon=True)
        thread.start()
        thread.join(timeout_s)
    took = time.perf_counter() - t0
    if thread.is_alive():
        raise DataError(f"{name}: the tokenizer did not encode {len(PROBE_TEXTS)} short ordinary texts within "
                        f"{timeout_s:g} s (a pre-tokenizer regex that backtracks?); fix or replace this tokenizer "
                        "(data.tokenizer)")
    if "error" in out:
        e = out["error"]
        raise_if_panic(e, name)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise DataError(f"{name}: the tokenizer failed on an ordinary text ({type(e).__name__}: {first}) "
                        "(data.tokenizer)") from None
    if len(out["ids"]) != len(PROBE_TEXTS):  # what ids a vocabulary gives is its own business (a small
        raise DataError(f"{name}: the tokenizer returned {len(out['ids'])} encodings for "  # one may give none)
                        f"{len(PROBE_TEXTS)} texts (data.tokenizer)")
    return took
