"""Gopher's quality and repetition filters (Rae et al. 2021, "Scaling Language Models: Methods,
Analysis & Insights from Training Gopher", App. A, MassiveWeb) as datatrove implements them.
Repetition is datatrove 0.10's (FineWeb's code save a blank-line fix of 2024-04-26, equal on
FineWeb's text); quality comes in two readings: the one that produced FineWeb in 2024
(``gopher_quality``) and datatrove 0.10's (``gopher_quality_datatrove010``), each checked in
tests/test_filters_parity.py and tests/test_filters.py. Words are the tokens of
:func:`densetrain.data.prepare.filters.text.split_words` (datatrove's English word tokenizer)."""

from __future__ import annotations

import re
import string
from collections import Counter
from itertools import compress, filterfalse
from operator import itemgetter

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


_ASCII_PUNCT = string.punctuation
"""FineWeb 2024's "punctuation" test was ``word in string.punctuation``: a token that is a run of
consecutive ASCII punctuation characters of that string ('(', ',', '()')."""


class GopherQualityFilter(Filter):
    """Gopher quality rules (Rae et al. 2021, App. A), thresholds in :class:`GopherQualityConfig`,
    in one of two readings of datatrove's code (``reading``); both count word *tokens*
    (:func:`densetrain.data.prepare.filters.text.split_words`: punctuation marks are tokens too).

    ``reading="fineweb2024"`` (filter ``gopher_quality``): what produced FineWeb (datatrove before
    its commit 6daa5e8 of 2024-03-22, with NLTK's word tokenizer). The "words" are the tokens that
    are not ASCII punctuation (not a substring of ``string.punctuation``: ',' '(' '.' are not words,
    '...' '“' '1' are), and every ratio divides by their number. A double quote counts as a word
    of two characters: NLTK rewrote '"' as '``' / "''", tokens outside ``string.punctuation``.
    A document is dropped, in this order, when:

    - ``word_count``: fewer than min_words (50) or more than max_words (100,000) words;
    - ``mean_word_length``: the words' mean length is outside [3, 10] characters;
    - ``hash_ratio`` / ``ellipsis_ratio``: '#' characters, or ellipses ('...' or '…'), per word
      above 0.1;
    - ``bullet_lines``: more than 90% of lines (``str.splitlines``, blank ones included) start with
      '•' or '-' after indentation;
    - ``ellipsis_lines``: more than 30% of lines end with '...' or '…' (trailing spaces ignored);
    - ``alpha_words``: tokens holding an alphabetic character are fewer than 80% of the words;
    - ``stop_words``: fewer than 2 occurrences of stop words among the tokens (exactly as written:
      'The' at a sentence start is not 'the'; 'the the' counts 2).

    ``reading="datatrove010"`` (filter ``gopher_quality_datatrove010``): datatrove 0.10's, equal
    decision by decision (tests/test_filters_parity.py). Words are the tokens holding a character
    outside :data:`SYMBOL_CHARS` (word count, mean length), but the hash, ellipsis and alpha
    ratios divide by *all* tokens, and ``stop_words`` needs 2 *distinct* stop words. Counting
    commas and periods in the alpha denominator drops 16% of FineWeb's own documents (measured on
    1,400 sample-10BT pages; the 2024 reading drops 0.3% there), and most dialogue.

    The two bullets, the case-sensitive stop words and the counted blank lines are datatrove's
    reading of the paper in both.
    """

    BULLETS = ("•", "-")
    READINGS = ("fineweb2024", "datatrove010")

    def __init__(self, params: GopherQualityConfig, reading: str = "fineweb2024"):
        if reading not in self.READINGS:
            raise ValueError(f"GopherQualityFilter: reading must be one of {self.READINGS}, got {reading!r}")
        self.p = params
        self.reading = reading
        self.name = "gopher_quality" if reading == "fineweb2024" else "gopher_quality_datatrove010"
        self.stop_words = frozenset(params.stop_words)

    def apply(self, text: str) -> tuple[str | None, str | None]:
        p = self.p
        tokens = split_words(text)
        if self.reading == "fineweb2024":
            words = [w for w in tokens if w not in _ASCII_PUNCT or w == '"']
            n = len(words)
            chars = sum(map(len, words)) + words.count('"')  # '"' was '``' or "''"
        else:
            words = [w for w in tokens if not SYMBOL_CHARS.issuperset(w)]
            n = len(tokens)
            chars = sum(map(len, words))
        if not words or not p.min_words <= len(words) <= p.max_words:
            return self._drop("word_count")
        mean_len = chars / len(words)
        if not p.min_mean_word_length <= mean_len <= p.max_mean_word_length:
            return self._drop("mean_word_length")
        if text.count("#") / n > p.max_hash_ratio:
            return self._drop("hash_ratio")
        if (text.count("...") + text.count("…")) / n > p.max_ellipsis_ratio:
            return self._drop("ellipsis_ratio")
        lines = text.splitlines()
        if sum(1 for s in lines if s.lstrip().startswith(self.BULLETS)) / len(lines) > p.max_bullet_lines:
            return self._drop("bullet_lines")
        if sum(1 for s in lines if s.rstrip().endswith(("...", "…"))) / len(lines) > p.max_ellipsis_lines:
            return self._drop("ellipsis_lines")
        # tokens holding a letter: all-letter ones counted in C, the rest (~1 in 5) looked into
        alpha = len(tokens) - sum(1 for w in filterfalse(str.isalpha, tokens) if not any(map(str.isalpha, w)))
        if alpha / n < p.min_alpha_words:
            return self._drop("alpha_words")
        if self.reading == "fineweb2024":
            stop = sum(map(self.stop_words.__contains__, tokens))
        else:
            stop = len(self.stop_words.intersection(tokens))
        if stop < p.min_stop_words:
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
        """The first violated n-gram rule, or None.

        Only the 2-grams are counted over the whole document (in C: ``zip``, ``Counter``): an
        n-gram occurs twice only where the two (n-1)-grams it starts with and ends with do, so
        each larger n counts just those positions. n-grams are compared as token tuples (tokens
        hold no whitespace, so a tuple is the n-gram " ".join gives; datatrove's repeat scan
        compares "".join strings, which differ only where two token sequences spell one string).
        """
        tops = dict(self.top)
        dups = dict(self.dup)
        last_n = max((*tops, *dups), default=0)
        n_words = len(words)
        if n_words < 2:
            return None
        counts = Counter(zip(words, words[1:]))
        repeated = list(compress(range(n_words - 1), map((1).__lt__, map(counts.__getitem__, zip(words, words[1:])))))
        for n in range(2, last_n + 1):
            if n > 2:
                if n_words < n:
                    return None
                starts = set(repeated)
                candidates = [i for i in repeated if i + 1 in starts and i + n <= n_words]
                grams = [words[i:i + n] for i in candidates]
                counts = Counter(grams)
                repeated = [i for i, g in zip(candidates, grams) if counts[g] > 1]
            if n in tops:
                gram, count = max(counts.items(), key=itemgetter(1)) if counts else (words[:n], 1)
                if count == 1:
                    gram = words[:n]  # every n-gram once: the earliest
                if (sum(map(len, gram)) + n - 1) * count / size > tops[n]:
                    return f"top_{n}gram_char_frac"
            if n in dups and _repeated_chars(words, repeated, n) / size > dups[n]:
                return f"dup_{n}gram_char_frac"
        return None


def _repeated_chars(words: tuple[str, ...], repeated: list[int], n: int) -> int:
    """Characters (words concatenated) of the word n-grams that equal an earlier n-gram, scanning
    left to right and jumping past each repeat so that overlapping repeats count once (datatrove's
    ``find_all_duplicate``), given the positions of the n-grams that occur at least twice.

    Equal to that scan over every position: an n-gram that occurs once is never "seen" again, so
    only ``repeated`` positions change the scan's state; those a repeat jumped over are skipped.
    """
    seen: set[tuple[str, ...]] = set()
    chars = next_free = 0
    for i in repeated:
        if i < next_free:
            continue  # inside the previous repeat
        gram = words[i:i + n]
        if gram in seen:
            chars += sum(map(len, gram))
            next_free = i + n
        else:
            seen.add(gram)
    return chars
