"""FineWeb's own quality filter (Penedo et al. 2024, "The FineWeb Datasets: Decanting the Web for
the Finest Text Data at Scale", arXiv:2406.17557, §3.3), decided as datatrove 0.10's
``FineWebQualityFilter`` (its defaults, which ``examples/fineweb.py`` ran) decides."""

from __future__ import annotations

from densetrain.config import FineWebConfig
from densetrain.data.prepare.filters.base import Filter
from densetrain.data.prepare.filters.gopher import _duplicates
from densetrain.data.prepare.filters.text import TERMINAL_MARKS, split_words


class FineWebFilter(Filter):
    """FineWeb's heuristic filters, thresholds in :class:`FineWebConfig`. On the non-blank lines
    (split on ``\\n``, not stripped), a document is dropped when:

    - ``line_punct_ratio``: fewer than 12% of lines end in terminal punctuation (the line's last
      character is in :data:`densetrain.data.prepare.filters.text.TERMINAL_PUNCTUATION`);
    - ``short_line_ratio``: more than 67% of lines have <= 30 characters;
    - ``dup_line_char_ratio``: lines repeating an earlier line hold more than 1% of the characters
      (newlines excluded); the paper's text says 0.1, the code FineWeb ran uses 0.01;
    - ``newline_ratio``: more than 0.3 newlines per word token (list-like pages), a rule of the
      code (``new_line_ratio``) that the paper does not list.
    """

    name = "fineweb"

    def __init__(self, params: FineWebConfig):
        self.p = params

    def apply(self, text: str) -> tuple[str | None, str | None]:
        p = self.p
        lines = [s for s in text.split("\n") if s.strip()]
        if not lines:
            return self._drop("empty")
        if sum(1 for s in lines if s.endswith(TERMINAL_MARKS)) / len(lines) < p.min_line_punct_ratio:
            return self._drop("line_punct_ratio")
        if sum(1 for s in lines if len(s) <= p.short_line_length) / len(lines) > p.max_short_line_ratio:
            return self._drop("short_line_ratio")
        _, dup_chars = _duplicates(lines)
        if dup_chars / max(1, len(text) - text.count("\n")) > p.max_dup_line_char_ratio:
            return self._drop("dup_line_char_ratio")
        if text.count("\n") / len(split_words(text)) > p.max_newline_ratio:
            return self._drop("newline_ratio")
        return text, None
