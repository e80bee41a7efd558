"""FineWeb's own quality filter (Penedo et al. 2024, "The FineWeb Datasets: Decanting the Web for
the Finest Text Data at Scale", arXiv:2406.17557, §3.3), decided as datatrove's
``FineWebQualityFilter`` (its defaults, which ``examples/fineweb.py`` ran) decides: in FineWeb's
2024 code (``fineweb``) or datatrove 0.10's (``fineweb_datatrove010``)."""

from __future__ import annotations

from densetrain.config import FineWebConfig
from densetrain.data.prepare.filters.base import Filter
from densetrain.data.prepare.filters.gopher import _duplicates
from densetrain.data.prepare.filters.text import TERMINAL_MARKS, count_words


class FineWebFilter(Filter):
    """FineWeb's heuristic filters, thresholds in :class:`FineWebConfig`, in one of two readings
    of datatrove's ``FineWebQualityFilter`` (``reading``). A document is dropped when:

    - ``line_punct_ratio``: at most / fewer than 12% of lines end in terminal punctuation;
    - ``short_line_ratio``: at least / more than 67% of lines have <= 30 characters;
    - ``dup_line_char_ratio``: non-blank lines repeating an earlier line hold at least / more than
      1% of the characters (newlines excluded); the paper's text says 0.1, the code FineWeb ran
      uses 0.01;
    - ``newline_ratio``: more than 0.3 newlines per word token (list-like pages), a rule of the
      code (``new_line_ratio``) that the paper does not list.

    ``reading="fineweb2024"`` (filter ``fineweb``): the code that produced FineWeb (datatrove
    v0.2.0, added 2024-04-20 with FineWeb's release): the lines are ``text.split("\\n")`` blank
    ones included, terminal punctuation is ASCII '.', '!', '?' and the quotes '"' and "'", and the
    bounds are inclusive (the first of each pair above).

    ``reading="datatrove010"`` (filter ``fineweb_datatrove010``): datatrove 0.10's: blank lines
    are left out of the line ratios, terminal punctuation is any of
    :data:`densetrain.data.prepare.filters.text.TERMINAL_PUNCTUATION` (Unicode sentence
    terminals, no quotes: a line ending in a closing quote does not count) and the bounds are
    strict. On FineWeb's own pages it drops 0.5% for ``line_punct_ratio`` (dialogue ending in
    quotes), the 2024 reading none.
    """

    STOP_CHARS_2024 = (".", "'", '"', "!", "?")
    READINGS = ("fineweb2024", "datatrove010")

    def __init__(self, params: FineWebConfig, reading: str = "fineweb2024"):
        if reading not in self.READINGS:
            raise ValueError(f"FineWebFilter: reading must be one of {self.READINGS}, got {reading!r}")
        self.p = params
        self.reading = reading
        self.name = "fineweb" if reading == "fineweb2024" else "fineweb_datatrove010"

    def apply(self, text: str) -> tuple[str | None, str | None]:
        p = self.p
        if self.reading == "fineweb2024":
            lines = text.split("\n")
            non_blank = [s for s in lines if s.strip()]
            if not non_blank:
                return self._drop("empty")
            if sum(1 for s in lines if s.endswith(self.STOP_CHARS_2024)) / len(lines) <= p.min_line_punct_ratio:
                return self._drop("line_punct_ratio")
            if sum(1 for s in lines if len(s) <= p.short_line_length) / len(lines) >= p.max_short_line_ratio:
                return self._drop("short_line_ratio")
            _, dup_chars = _duplicates(non_blank)
            if dup_chars / max(1, len(text) - text.count("\n")) >= p.max_dup_line_char_ratio:
                return self._drop("dup_line_char_ratio")
        else:
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
        newlines = text.count("\n")
        # every whitespace chunk holds at least one token: within the limit per chunk, within it per
        # token (float division is monotone in the divisor), so most documents are never tokenized here
        if (newlines / max(1, len(text.split())) > p.max_newline_ratio
                and newlines / count_words(text) > p.max_newline_ratio):
            return self._drop("newline_ratio")
        return text, None
