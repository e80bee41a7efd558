"""Gopher's quality and repetition filters (Rae et al. 2021, "Scaling Language Models: Methods,
Analysis & Insights from Training Gopher", App. A, MassiveWeb), decided as datatrove 0.10's
``GopherQualityFilter`` / ``GopherRepetitionFilter`` decide them (the implementation FineWeb ran;
checked document by document in tests/test_filters_parity.py). Words are the tokens of
:func:`densetrain.data.prepare.filters.text.split_words` (datatrove's English word tokenizer)."""

from __future__ import annotations

import re
from collections import Counter

from densetrain.config import GopherQualityConfig, GopherRepetitionConfig
from densetrain.data.prepare.filters.base import Filter
from densetrain.data.prepare.filters.text import SYMBOL_CHARS, split_words


def _duplicates(items: list[str]) -> tuple[int, int]:
    """(number of items that repeat an earlier one, their total characters): the first
    occurrence is not counted."""
    seen: set[str] = set()
    n = chars = 0
    for x in items:
        if x in seen:
            n += 1
            chars += len(x)
        else:
            seen.add(x)
    return n, chars


class GopherQualityFilter(Filter):
    """Gopher quality rules (Rae et al. 2021, App. A), thresholds in :class:`GopherQualityConfig`.

    On the word tokens (punctuation marks are tokens too), a document is dropped, in this order, when:

    - ``word_count``: tokens holding a character outside :data:`SYMBOL_CHARS` ("words") number
      fewer than min_words (50) or more than max_words (100,000);
    - ``mean_word_length``: the words' mean length is outside [3, 10] characters;
    - ``hash_ratio`` / ``ellipsis_ratio``: '#' characters, or ellipses ('...' or '…'), per token
      above 0.1;
    - ``bullet_lines``: more than 90% of lines (``str.splitlines``, blank ones included) start with
      '•' or '-' after indentation;
    - ``ellipsis_lines``: more than 30% of lines end with '...' or '…' (trailing spaces ignored);
    - ``alpha_words``: fewer than 80% of tokens contain an alphabetic character;
    - ``stop_words``: fewer than 2 of the stop words occur as tokens, exactly as written (lowercase:
      'The' at a sentence start is not 'the').

    The token denominators, the two bullets, the case-sensitive stop words and the counted blank
    lines are datatrove's reading of the paper, kept for parity with FineWeb.
    """

    name = "gopher_quality"
    BULLETS = ("•", "-")

    def __init__(self, params: GopherQualityConfig):
        self.p = params
        self.stop_words = frozenset(params.stop_words)

    def apply(self, text: str) -> tuple[str | None, str | None]:
        p = self.p
        tokens = split_words(text)
        words = [w for w in tokens if not SYMBOL_CHARS.issuperset(w)]
        if not words or not p.min_words <= len(words) <= p.max_words:
            return self._drop("word_count")
        mean_len = sum(map(len, words)) / len(words)
        if not p.min_mean_word_length <= mean_len <= p.max_mean_word_length:
            return self._drop("mean_word_length")
        n = len(tokens)
        if text.count("#") / n > p.max_hash_ratio:
            return self._drop("hash_ratio")
        if (text.count("...") + text.count("…")) / n > p.max_ellipsis_ratio:
            return self._drop("ellipsis_ratio")
        lines = text.splitlines()
        if sum(1 for s in lines if s.lstrip().startswith(self.BULLETS)) / len(lines) > p.max_bullet_lines:
            return self._drop("bullet_lines")
        if sum(1 for s in lines if s.rstrip().endswith(("...", "…"))) / len(lines) > p.max_ellipsis_lines:
            return self._drop("ellipsis_lines")
        alpha = sum(1 for w in tokens if w.isalpha() or any(c.isalpha() for c in w))
        if alpha / n < p.min_alpha_words:
            return self._drop("alpha_words")
        if len(self.stop_words.intersection(tokens)) < p.min_stop_words:
            return self._drop("stop_words")
        return text, None


class GopherRepetitionFilter(Filter):
    """Gopher repetition rules (Rae et al. 2021, App. A, thresholds of Table A1), in
    :class:`GopherRepetitionConfig`. Every fraction is of the document's characters (``len(text)``,
    whitespace included). A document is dropped, in this order, when:

    - ``dup_para_frac`` / ``dup_para_char_frac``: paragraphs (split on runs of two or more
      newlines) that repeat an earlier paragraph are > 30% of paragraphs, or their characters
      > 20% of the document's;
    - ``dup_line_frac`` / ``dup_line_char_frac``: the same for lines (split on runs of newlines;
      30% / 20%);
    - ``top_{n}gram_char_frac`` (n = 2, 3, 4): the most frequent word n-gram (the earliest one of
      a tie; a single occurrence counts too) times its characters (words joined by one space)
      exceeds 20% / 18% / 16%;
    - ``dup_{n}gram_char_frac`` (n = 5..10): scanning left to right, an n-gram equal to an earlier
      one adds its characters (words concatenated) and the scan jumps past it, so overlapping
      repeats count once; their total exceeds 15%, 14%, ..., 10%.

    These are datatrove's denominators and counting (what FineWeb ran); an earlier densetrain
    reading (word characters, repeats counted per covered word) removed ~6x more documents.

    With ``words=False`` only the paragraph and line rules run; the filter is then named
    ``gopher_repetition_lines``: for text without spaces between words (Chinese), and for kinds
    whose long or formulaic documents repeat n-grams legitimately (see ``AUTO_FILTERS``).
    """

    _PARAGRAPHS = re.compile(r"\n{2,}")
    _LINES = re.compile(r"\n+")

    def __init__(self, params: GopherRepetitionConfig, words: bool = True):
        self.p = params
        self.words = words
        self.name = "gopher_repetition" if words else "gopher_repetition_lines"
        self.top = [(n, getattr(params, f"max_top_{n}gram_char_frac")) for n in (2, 3, 4)]
        self.dup = [(n, getattr(params, f"max_dup_{n}gram_char_frac")) for n in range(5, 11)]

    def apply(self, text: str) -> tuple[str | None, str | None]:
        p = self.p
        if not text:
            return self._drop("empty")
        size = len(text)
        paragraphs = self._PARAGRAPHS.split(text.strip())
        n_dup, dup_chars = _duplicates(paragraphs)
        if n_dup / len(paragraphs) > p.max_dup_para_frac:
            return self._drop("dup_para_frac")
        if dup_chars / size > p.max_dup_para_char_frac:
            return self._drop("dup_para_char_frac")
        lines = self._LINES.split(text)
        n_dup, dup_chars = _duplicates(lines)
        if n_dup / len(lines) > p.max_dup_line_frac:
            return self._drop("dup_line_frac")
        if dup_chars / size > p.max_dup_line_char_frac:
            return self._drop("dup_line_char_frac")
        if self.words:
            rule = self._ngram_rule(split_words(text), size)
            if rule:
                return self._drop(rule)
        return text, None

    def _ngram_rule(self, words: tuple[str, ...], size: int) -> str | None:
        """The first violated n-gram rule, or None."""
        for n, limit in self.top:
            if len(words) < n:
                continue
            counts = Counter(" ".join(words[i:i + n]) for i in range(len(words) - n + 1))
            gram, count = max(counts.items(), key=lambda kv: kv[1])  # max keeps the earliest of a tie
            if len(gram) * count / size > limit:
                return f"top_{n}gram_char_frac"
        for n, limit in self.dup:
            seen: set[str] = set()
            repeated, i, last = 0, 0, len(words) - n
            while i <= last:
                gram = "".join(words[i:i + n])
                if gram in seen:
                    repeated += len(gram)
                    i += n  # the next n-gram starts after this repeat: overlaps count once
                else:
                    seen.add(gram)
                    i += 1
            if repeated / size > limit:
                return f"dup_{n}gram_char_frac"
        return None
