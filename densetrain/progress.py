"""Progress of long work (``densetrain prepare``'s sources, ``densetrain eval``'s tasks), shown where it is
read: a tqdm bar on a terminal, and where the output goes to a file or a pipe (a cluster job's log,
``nohup``, CI) a plain line every :data:`EVERY_S` seconds with what is done of the total, the rate and
the time left, and one when the work ends::

    [eval] downstream: 2,048/8,192 rows (25%), 3 of 7 tasks | 41.3 rows/s | ETA 2m29s

Nothing is printed for work that ends within the first interval (an in-loop evaluation of a few
seconds stays quiet). The interval is ``DENSETRAIN_PROGRESS_S`` (seconds) where that is set, else 30.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Callable

from tqdm import tqdm

EVERY_S = 30.0
"""Seconds between progress lines when the output is not a terminal (``DENSETRAIN_PROGRESS_S`` overrides)."""


def _scaled(x: float, unit: str) -> str:
    """``x`` with three significant digits and a k/M/G prefix for bytes (``"12.3 MB"``), with
    thousands separators otherwise (``"2,048 rows"``)."""
    if unit == "B":
        for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
            if abs(x) >= scale:
                return f"{x / scale:.3g} {prefix}B"
        return f"{x:.0f} B"
    return f"{x:,.0f} {unit}" if abs(x) >= 100 or x == int(x) else f"{x:.3g} {unit}"


def _duration(seconds: float) -> str:
    """``"45s"``, ``"2m29s"``, ``"3h05m"``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """Counts work done against ``total`` and shows it (module docstring); a context manager.

    Args:
        total: units of work in all (> 0; 0 or less shows counts without a percentage or ETA).
        desc: what is being done, e.g. ``"[eval] downstream"``.
        unit: the unit of ``total`` (``"B"`` is shown with k/M/G prefixes).
        log: where the lines go when the output is not a terminal (default: a line on stderr).
        enabled: False shows nothing (e.g. on every rank but rank 0).
        tty: draw a tqdm bar (default: whether stderr is a terminal).
        every_s: seconds between lines (default: ``DENSETRAIN_PROGRESS_S`` or :data:`EVERY_S`).
    """

    def __init__(self, total: float, desc: str, unit: str = "it", log: Callable[[str], None] | None = None,
                 enabled: bool = True, tty: bool | None = None, every_s: float | None = None):
        self.total, self.desc, self.unit, self.enabled = total, desc, unit, enabled
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.every_s = float(os.environ.get("DENSETRAIN_PROGRESS_S", EVERY_S)) if every_s is None else every_s
        self.done, self.note, self.lines, self.shown = 0.0, "", 0, None
        self.t0 = self.last = time.monotonic()
        tty = sys.stderr.isatty() if tty is None else tty
        self.bar = (tqdm(total=total if total > 0 else None, desc=desc, unit=unit, unit_scale=unit == "B",
                         leave=False, file=sys.stderr) if enabled and tty else None)

    def update(self, n: float = 1, note: str | None = None) -> None:
        """Count ``n`` more units done; ``note`` (e.g. ``"3 of 7 tasks"``) is shown beside the count from now on."""
        self.done += n
        if note is not None:
            self.note = note
        if self.bar is not None:
            if note is not None:
                self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(n)
        elif self.enabled and time.monotonic() - self.last >= self.every_s:
            self._line()

    def line(self) -> str:
        """The progress line as it stands: done/total (percent), note, rate, time left (or taken, at the end)."""
        elapsed = time.monotonic() - self.t0
        if self.total <= 0:
            count = _scaled(self.done, self.unit)
        elif self.unit == "B":
            count = f"{_scaled(self.done, 'B')}/{_scaled(self.total, 'B')} ({100 * self.done / self.total:.0f}%)"
        else:
            count = f"{self.done:,.0f}/{self.total:,.0f} {self.unit} ({100 * self.done / self.total:.0f}%)"
        parts = [f"{self.desc}: {count}" + (f", {self.note}" if self.note else "")]
        rate = self.done / elapsed if elapsed > 0 else math.inf
        if math.isfinite(rate):
            parts.append(f"{_scaled(rate, self.unit)}/s")
        if self.done >= self.total > 0:
            parts.append(f"done in {_duration(elapsed)}")
        elif self.total > 0 and self.done > 0:
            parts.append(f"ETA {_duration((self.total - self.done) / rate)}")
        return " | ".join(parts)

    def _line(self) -> None:
        self.log(self.line())
        self.lines += 1
        self.last, self.shown = time.monotonic(), (self.done, self.note)

    def close(self) -> None:
        """End the bar, or print the last line where earlier lines were printed (and it says something new)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.enabled and self.lines and self.shown != (self.done, self.note):
            self._line()
        self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
