"""Document cleaning and heuristic quality filters (Gopher, C4, FineWeb).

Every document is first cleaned (:func:`clean_text`: ftfy repair, Unicode NFC, strip), then goes
through the filters of its source (``SourceConfig.filters``, resolved by :func:`build_filters`)
in order. A filter either keeps the document, possibly with lines removed (C4), or drops it with a
reason ``'<filter>:<rule>'``; :func:`apply_filters` stops at the first drop and counts documents
and characters (Unicode code points) removed per filter and rule in a :class:`FilterStats`.

=======================  ===================================================================
name                     rules (thresholds in ``data.filters.<name>``, published defaults)
=======================  ===================================================================
gopher_repetition        duplicate lines/paragraphs and repeated word n-grams (Rae et al.
                         2021, Gopher, App. A "MassiveWeb" filtering, Table A1)
gopher_repetition_lines  the line/paragraph rules of gopher_repetition only (text without
                         spaces, or long/formulaic documents)
gopher_quality           word count, mean word length, '#' and ellipsis per word, bullet and
                         ellipsis lines, alphabetic words, stop words (Gopher, App. A)
c4                       keeps lines that end in terminal punctuation and have >= 5 words,
                         drops javascript / policy lines, drops pages with 'lorem ipsum', '{'
                         or < 3 sentences (Raffel et al. 2020, T5, §2.2; TFDS ``c4_utils``)
fineweb                  line punctuation ratio, short-line ratio, duplicated-line characters
                         (Penedo et al. 2024, The FineWeb Datasets, arXiv:2406.17557)
=======================  ===================================================================

``filters = ['auto']`` picks a set by ``SourceConfig.kind`` (:data:`AUTO_FILTERS`); the reasons
are given there. All rules are plain string operations on whitespace-separated words and
``\\n``-separated lines (no word tokenizer), so they run at several MB/s per core.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import not_

import ftfy
import numpy as np

from densetrain.config import C4Config, FiltersConfig, FineWebConfig, GopherQualityConfig, GopherRepetitionConfig
from densetrain.registry.filters import resolve_filter_names

# --------------------------------------------------------------------------------------------------
# Cleaning
# --------------------------------------------------------------------------------------------------

FTFY_CONFIG = ftfy.TextFixerConfig(
    # Our inputs are extracted text, not HTML: unescaping '&amp;' would corrupt code and text about
    # HTML, and extractors (trafilatura, resiliparse) already decode entities.
    unescape_html=False,
    # Curly quotes are correct Unicode, not damage; keep the author's typography.
    uncurl_quotes=False,
    # ftfy's width fix would turn Chinese full-width punctuation ('，', '！') into ASCII.
    fix_character_width=False,
    explain=False,
)
"""ftfy settings of :func:`clean_text`: mojibake, C1 controls, terminal escapes, ligatures and line
breaks (``\\r\\n``, U+2028 -> ``\\n``) are repaired; HTML entities, quotes and widths are kept."""


_NEEDS_FTFY = re.compile(r"[^\t\n\x20-\x7e]")
"""Characters ftfy may act on: anything but printable ASCII, tab and newline."""


def _fix_text(text: str) -> str:
    """``ftfy.fix_text(text, FTFY_CONFIG)``, faster. ftfy fixes each line (with its ending
    '\\n') on its own and leaves a line of printable ASCII unchanged, so only lines holding
    another character are handed to it: ftfy costs ~0.1 ms per line, however clean the line."""
    m = _NEEDS_FTFY.search(text)
    if m is None:
        return text
    out: list[str] = []
    pos = 0  # start of the text not yet copied; always the start of a line
    while m is not None:
        start = max(pos, text.rfind("\n", pos, m.start()) + 1)
        end = text.find("\n", m.start()) + 1 or len(text)
        out.append(text[pos:start])
        out.append(ftfy.fix_text(text[start:end], FTFY_CONFIG))
        pos = end
        m = _NEEDS_FTFY.search(text, pos)
    out.append(text[pos:])
    return "".join(out)


def clean_text(text: str, fix: bool = True) -> str:
    """Repair and normalise one document: ftfy (``fix``), Unicode NFC, strip both ends.

    ``fix`` runs ``ftfy.fix_text`` with :data:`FTFY_CONFIG` (mojibake such as ``'doesnâ€™t'`` ->
    ``'doesn’t'``, ``'\\r\\n'`` -> ``'\\n'``; newlines and tabs are kept). Returns ``''`` for a
    document that is only whitespace (the caller drops it).
    """
    if fix:
        text = _fix_text(text)
    return unicodedata.normalize("NFC", text).strip()


# --------------------------------------------------------------------------------------------------
# Shared text helpers
# --------------------------------------------------------------------------------------------------

_WORD_STRIP = string.punctuation + "“”‘’«»‹›„‚…–—―·•¡¿"
"""Characters stripped from both ends of a whitespace word before measuring it."""


def _terminal_punctuation() -> tuple[str, ...]:
    """Sentence-ending marks of all scripts: Unicode 'Po' characters named FULL STOP, QUESTION
    MARK, EXCLAMATION MARK, DANDA or INTERROBANG (not the inverted, sentence-opening ones), plus
    the Myanmar and Khmer sentence marks. Planes 0-1 hold all punctuation."""
    keys = ("FULL STOP", "QUESTION MARK", "EXCLAMATION MARK", "DANDA", "INTERROBANG")
    marks = {"\u104a", "\u104b", "\u17d4", "\u17d5"}
    for cp in range(0x20000):
        ch = chr(cp)
        if unicodedata.category(ch) == "Po":
            name = unicodedata.name(ch, "")
            if "INVERTED" not in name and any(k in name for k in keys):
                marks.add(ch)
    return tuple(sorted(marks))


TERMINAL_PUNCTUATION = _terminal_punctuation()
"""Characters that end a sentence in any script ('.', '?', '!', '。', '！', '।', '؟', ...)."""
_HASH_MULT = np.uint64(0x9E3779B97F4A7C15)
"""Odd 64-bit multiplier of the n-gram hash (2^64 / golden ratio); arithmetic wraps mod 2^64."""
_CLOSERS = "\"'”’»)]》」』】 \t"
"""Closing quotes, brackets and spaces that may follow a sentence's final mark (``He left.”``)."""


def _lines(text: str) -> list[str]:
    """The non-blank lines of ``text``, stripped."""
    return [s for s in (line.strip() for line in text.split("\n")) if s]


def _duplicates(items: list[str]) -> tuple[int, int]:
    """(number of items that repeat an earlier one, their total characters)."""
    counts = Counter(items)
    n = len(items) - len(counts)
    chars = sum(len(x) * (c - 1) for x, c in counts.items() if c > 1) if n else 0
    return n, chars


# --------------------------------------------------------------------------------------------------
# Filters
# --------------------------------------------------------------------------------------------------


class Filter:
    """A document filter: ``apply(text) -> (kept_text | None, reason | None)``.

    ``kept_text`` is the document, possibly with lines removed; it is None when the document is
    dropped, and then ``reason`` is ``'<name>:<rule>'``. Subclasses are module-level and hold only
    their (dataclass) parameters and values derived from them, so they pickle to worker processes.
    """

    name = ""

    def apply(self, text: str) -> tuple[str | None, str | None]:  # pragma: no cover - interface
        raise NotImplementedError

    def _drop(self, rule: str) -> tuple[None, str]:
        return None, f"{self.name}:{rule}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({getattr(self, 'p', '')})"


class GopherQualityFilter(Filter):
    """Gopher quality rules (Rae et al. 2021, "Scaling Language Models: Methods, Analysis &
    Insights from Training Gopher", App. A, MassiveWeb quality filters), thresholds in
    :class:`GopherQualityConfig`.

    Words are whitespace-separated tokens. A document is dropped, in this order, when:

    - ``word_count``: its number of words outside [min_words, max_words] (50..100,000); words that
      are only punctuation are not counted;
    - ``mean_word_length``: mean word length (punctuation stripped from both ends) outside
      [3, 10] characters;
    - ``hash_ratio`` / ``ellipsis_ratio``: '#' characters, or ellipses ('...' or '…'), per word
      above 0.1;
    - ``bullet_lines``: more than 90% of non-blank lines start with a bullet (•, ●, ◦, ‣, -, *);
    - ``ellipsis_lines``: more than 30% of non-blank lines end with an ellipsis;
    - ``alpha_words``: fewer than 80% of words contain an alphabetic character;
    - ``stop_words``: fewer than 2 distinct stop words (the, be, to, of, and, that, have, with;
      lowercase, Capitalised or UPPER; punctuation around a word is ignored).
    """

    name = "gopher_quality"
    BULLETS = ("•", "●", "◦", "‣", "-", "*")

    def __init__(self, params: GopherQualityConfig):
        self.p = params
        # Case variants of each stop word -> the stop word, so one set intersection finds them.
        self.stop_variants = {v: w.lower() for w in params.stop_words for v in (w.lower(), w.capitalize(), w.upper())}

    def apply(self, text: str) -> tuple[str | None, str | None]:
        p = self.p
        words = text.split()
        n = len(words)
        # map/filter keep the per-word work in C (a list comprehension is ~2x slower here).
        core = list(map(str.strip, words, repeat(_WORD_STRIP)))
        content = list(filter(None, core))
        if not content or not p.min_words <= len(content) <= p.max_words:
            return self._drop("word_count")
        mean_len = sum(map(len, content)) / len(content)
        if not p.min_mean_word_length <= mean_len <= p.max_mean_word_length:
            return self._drop("mean_word_length")
        if text.count("#") / n > p.max_hash_ratio:
            return self._drop("hash_ratio")
        if (text.count("...") + text.count("…")) / n > p.max_ellipsis_ratio:
            return self._drop("ellipsis_ratio")
        lines = _lines(text)
        if sum(1 for s in lines if s.startswith(self.BULLETS)) / len(lines) > p.max_bullet_lines:
            return self._drop("bullet_lines")
        if sum(1 for s in lines if s.endswith(("...", "…"))) / len(lines) > p.max_ellipsis_lines:
            return self._drop("ellipsis_lines")
        # str.isalpha settles most words at C speed; only the rest ('1990s', "don't") are scanned.
        is_alpha = list(map(str.isalpha, core))
        alpha = sum(is_alpha) + sum(1 for w in compress(core, map(not_, is_alpha)) if any(c.isalpha() for c in w))
        if alpha / n < p.min_alpha_words:
            return self._drop("alpha_words")
        found = {self.stop_variants[w] for w in self.stop_variants.keys() & set(core)}
        if len(found) < p.min_stop_words:
            return self._drop("stop_words")
        return text, None


class GopherRepetitionFilter(Filter):
    """Gopher repetition rules (Rae et al. 2021, App. A, thresholds of Table A1), in
    :class:`GopherRepetitionConfig`. A document is dropped, in this order, when:

    - ``dup_para_frac`` / ``dup_para_char_frac``: paragraphs (split on blank lines) that repeat an
      earlier paragraph are > 30% of paragraphs, or their characters > 20% of the document's;
    - ``dup_line_frac`` / ``dup_line_char_frac``: the same for non-blank lines (30% / 20%);
    - ``top_{n}gram_char_frac`` (n = 2, 3, 4): the most frequent word n-gram, if it occurs more
      than once, covers more than 20% / 18% / 16% of the word characters (count x its characters);
    - ``dup_{n}gram_char_frac`` (n = 5..10): words inside n-grams that repeat an earlier
      occurrence (overlaps counted once) hold more than 15%, 14%, ..., 10% of the word
      characters.

    As for lines, a duplicate is a repeat of something earlier: the first occurrence is not
    counted (datatrove's reading too; counting it as well would drop 33% of the Python
    documentation pages and 24% of the KJV's books, measured). Word characters exclude
    whitespace, so indentation does not dilute the fractions.

    With ``words=False`` only the paragraph and line rules run; the filter is then named
    ``gopher_repetition_lines``: for text without spaces between words (Chinese), and for kinds
    whose long or formulaic documents repeat n-grams legitimately (see :data:`AUTO_FILTERS`).
    """

    def __init__(self, params: GopherRepetitionConfig, words: bool = True):
        self.p = params
        self.words = words
        self.name = "gopher_repetition" if words else "gopher_repetition_lines"
        # thresholds indexed by n - 2 (top n-gram rules) and n - 5 (duplicate n-gram rules)
        self.top = [getattr(params, f"max_top_{n}gram_char_frac") for n in (2, 3, 4)]
        self.dup = [getattr(params, f"max_dup_{n}gram_char_frac") for n in range(5, 11)]

    _PARAGRAPH_BREAK = re.compile(r"\n[ \t\r\f\v]*\n\s*")

    def apply(self, text: str) -> tuple[str | None, str | None]:
        p = self.p
        if not text.strip():
            return self._drop("empty")
        paragraphs = [s for s in (x.strip() for x in self._PARAGRAPH_BREAK.split(text)) if s]
        n_dup, dup_chars = _duplicates(paragraphs)
        if n_dup / len(paragraphs) > p.max_dup_para_frac:
            return self._drop("dup_para_frac")
        if dup_chars / len(text) > p.max_dup_para_char_frac:
            return self._drop("dup_para_char_frac")
        lines = _lines(text)
        n_dup, dup_chars = _duplicates(lines)
        if n_dup / len(lines) > p.max_dup_line_frac:
            return self._drop("dup_line_frac")
        if dup_chars / len(text) > p.max_dup_line_char_frac:
            return self._drop("dup_line_char_frac")
        if self.words:
            rule = self._ngram_rule(text.split())
            if rule:
                return self._drop(rule)
        return text, None

    def _ngram_rule(self, words: list[str]) -> str | None:
        """The first violated n-gram rule, or None.

        An n-gram is identified by a 64-bit polynomial hash of its words' string hashes, built
        for n = 2..10 by extending the (n-1)-gram hashes one word, so that counting is a numpy
        sort per n instead of Python tuples (a collision within one document is ~N^2 / 2^64).
        """
        n_words = len(words)
        lens = np.fromiter(map(len, words), dtype=np.int64, count=n_words)
        total = int(lens.sum())
        if n_words < 2 or total == 0:
            return None
        cum = np.concatenate(([0], np.cumsum(lens)))  # characters of words[i:j] = cum[j] - cum[i]
        word_hash = np.fromiter(map(hash, words), dtype=np.int64, count=n_words).view(np.uint64)
        keys = word_hash
        for n in range(2, 11):
            if n_words < n:
                break
            keys = keys[:-1] * _HASH_MULT + word_hash[n - 1:]  # n-grams starting at 0 .. n_words-n
            sorted_keys = np.sort(keys)
            same = sorted_keys[1:] == sorted_keys[:-1]  # True where an n-gram repeats
            n_repeats = int(same.sum())
            if n_repeats == 0:
                # No repeated n-gram, hence no repeated longer one (it would contain one): no
                # rule can fire any more (the top n-gram rules need a count above 1).
                break
            gram_chars = cum[n:] - cum[:-n]  # characters of the n-gram starting at each position
            # Cheap upper bounds settle most documents before the exact (slower) computation.
            bound_chars = int(gram_chars.max())
            if n <= 4:
                starts = np.flatnonzero(np.concatenate(([True], ~same)))
                counts = np.diff(np.append(starts, len(keys)))
                top = int(counts.max())
                if top * bound_chars / total <= self.top[n - 2]:
                    continue
                # ties: the most frequent n-gram covering most characters
                chars = int(gram_chars[np.isin(keys, sorted_keys[starts[counts == top]])].max())
                if top * chars / total > self.top[n - 2]:
                    return f"top_{n}gram_char_frac"
                continue
            if n_repeats * bound_chars / total <= self.dup[n - 5]:
                continue  # each repeat covers at most bound_chars
            order = np.argsort(keys)
            starts = np.flatnonzero(np.concatenate(([True], ~same)))
            first = np.minimum.reduceat(order, starts)  # first occurrence of each n-gram
            is_repeat = np.empty(len(keys), dtype=bool)
            is_repeat[order] = order != np.repeat(first, np.diff(np.append(starts, len(keys))))
            # A word is covered when one of the n n-grams containing it is a repeat.
            covered = np.convolve(is_repeat.astype(np.int32), np.ones(n, dtype=np.int32))[:n_words] > 0
            if int(lens[covered].sum()) / total > self.dup[n - 5]:
                return f"dup_{n}gram_char_frac"
        return None


class C4Filter(Filter):
    """C4's page cleaning (Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a
    Unified Text-to-Text Transformer", §2.2), in the order of its reference implementation
    (TensorFlow Datasets ``c4_utils.clean_page``), thresholds in :class:`C4Config`.

    Each line (stripped) is removed when it has a word longer than 1000 characters, does not end
    in terminal punctuation (a period, question or exclamation mark, or a closing quote: straight
    or curly, double or single) or ends in '...', has fewer than 5 words, mentions
    'javascript', or contains a cookie/terms-of-use phrase; Wikipedia citation marks ('[1]',
    '[edit]', '[citation needed]') are deleted first. Among the lines that survive these checks,
    'lorem ipsum' drops the page (``lorem_ipsum``) and so does a '{' (``curly_brace``; likely
    code). A page left with fewer than 3 sentences is dropped (``too_few_sentences``; sentences
    are counted by sentence-ending marks followed by whitespace, at least one per line, where
    C4 used NLTK's punkt). The kept lines are joined with ``\\n``; where blank lines separated
    kept lines, one blank line stays (the reference code drops them all: paragraph breaks are
    not what C4 meant to judge).

    The paper states 3 sentences and 5 words per line, as does the reference code; datatrove's
    ``C4QualityFilter`` defaults to 5 sentences and 3 words.
    """

    name = "c4"
    END_MARKS = (".", "?", "!", '"', "'", "”", "’")
    POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")
    _CITATION = re.compile(r"\[\d*\]|\[edit\]|\[citation needed\]", re.IGNORECASE)
    _SENTENCE_END = re.compile(r"[.!?]+[\"'”’)\]]*(?=\s)")

    def __init__(self, params: C4Config):
        self.p = params

    def apply(self, text: str) -> tuple[str | None, str | None]:
        p = self.p
        kept: list[str] = []
        sentences = 0
        blank = False  # a blank line since the last kept line: keep one as a paragraph break
        for line in text.splitlines():
            line = line.strip()
            if not line:
                blank = bool(kept)
                continue
            if p.max_word_length and len(line) > p.max_word_length and any(
                    len(w) > p.max_word_length for w in line.split()):
                continue
            if p.remove_citations and "[" in line:
                line = self._CITATION.sub("", line).strip()
                if not line:
                    continue
            if p.remove_no_terminal_punct and (not line.endswith(self.END_MARKS) or line.endswith("...")):
                continue
            if len(line.split()) < p.min_words_per_line:
                continue
            low = line.lower()
            if p.drop_lorem_ipsum and "lorem ipsum" in low:
                return self._drop("lorem_ipsum")
            if p.remove_javascript_lines and "javascript" in low:
                continue
            if p.drop_curly_brace and "{" in line:
                return self._drop("curly_brace")
            if p.remove_policy_lines and any(s in low for s in self.POLICY):
                continue
            sentences += max(1, len(self._SENTENCE_END.findall(line + " ")))
            if blank:
                kept.append("")
                blank = False
            kept.append(line)
        if sentences < p.min_sentences or not kept:
            return self._drop("too_few_sentences")
        return "\n".join(kept), None


class FineWebFilter(Filter):
    """FineWeb's own heuristic filters (Penedo et al. 2024, "The FineWeb Datasets: Decanting the
    Web for the Finest Text Data at Scale", arXiv:2406.17557), thresholds in
    :class:`FineWebConfig`. On the non-blank lines (stripped), a document is dropped when:

    - ``line_punct_ratio``: fewer than 12% of lines end in terminal punctuation (any script, see
      :data:`TERMINAL_PUNCTUATION`; closing quotes/brackets after the mark are allowed);
    - ``short_line_ratio``: more than 67% of lines have <= 30 characters;
    - ``dup_line_char_ratio``: lines repeating an earlier line hold more than 10% of the
      characters (newlines excluded). The paper's 0.1; datatrove's default is 0.01.
    """

    name = "fineweb"

    def __init__(self, params: FineWebConfig):
        self.p = params

    def apply(self, text: str) -> tuple[str | None, str | None]:
        p = self.p
        lines = _lines(text)
        if not lines:
            return self._drop("empty")
        punct = sum(1 for s in lines if s.rstrip(_CLOSERS).endswith(TERMINAL_PUNCTUATION))
        if punct / len(lines) < p.min_line_punct_ratio:
            return self._drop("line_punct_ratio")
        short = sum(1 for s in lines if len(s) <= p.short_line_length)
        if short / len(lines) > p.max_short_line_ratio:
            return self._drop("short_line_ratio")
        _, dup_chars = _duplicates(lines)
        if dup_chars / max(1, len(text) - text.count("\n")) > p.max_dup_line_char_ratio:
            return self._drop("dup_line_char_ratio")
        return text, None


# --------------------------------------------------------------------------------------------------
# Choosing filters
# --------------------------------------------------------------------------------------------------

def build_filters(names: list[str], kind: str, params: FiltersConfig, key: str = "filters") -> list[Filter]:
    """The filters of one source, in the order given (``'auto'`` resolved by ``kind``).

    Args:
        names: ``SourceConfig.filters``.
        kind: ``SourceConfig.kind``.
        params: ``DataConfig.filters`` (thresholds).
        key: config key named in errors, e.g. ``'data.sources[2].filters'``.

    Raises:
        ConfigError: see :func:`resolve_filter_names`.
    """
    out: list[Filter] = []
    for n in resolve_filter_names(names, kind, key):
        if n == "gopher_quality":
            out.append(GopherQualityFilter(params.gopher_quality))
        elif n in ("gopher_repetition", "gopher_repetition_lines"):
            out.append(GopherRepetitionFilter(params.gopher_repetition, words=n == "gopher_repetition"))
        elif n == "c4":
            out.append(C4Filter(params.c4))
        else:
            out.append(FineWebFilter(params.fineweb))
    return out


# --------------------------------------------------------------------------------------------------
# Applying them, with statistics
# --------------------------------------------------------------------------------------------------


def _new_counts() -> dict:
    return {"documents_in": 0, "chars_in": 0, "documents_removed": 0, "documents_modified": 0,
            "chars_removed": 0, "reasons": {}}


@dataclass
class FilterStats:
    """What the filters did, per filter name (characters are Unicode code points).

    ``per_filter[name]`` holds ``documents_in`` / ``chars_in`` (what reached the filter),
    ``documents_removed``, ``documents_modified`` (kept with lines removed), ``chars_removed``
    (whole dropped documents + removed lines) and ``reasons``: ``{rule: {'documents', 'chars'}}``
    for dropped documents. ``last_reason`` is the reason of the latest :func:`apply_filters`
    call that dropped its document (None when it kept it). Stats of worker processes add up with
    :meth:`merge`.
    """

    per_filter: dict[str, dict] = field(default_factory=dict)
    last_reason: str | None = None

    def record(self, name: str, before: str, after: str | None, reason: str | None) -> None:
        """Count one document passing through filter ``name``."""
        c = self.per_filter.get(name)
        if c is None:
            c = self.per_filter[name] = _new_counts()
        c["documents_in"] += 1
        c["chars_in"] += len(before)
        if after is None:
            rule = (reason or f"{name}:unknown").split(":", 1)[-1]
            c["documents_removed"] += 1
            c["chars_removed"] += len(before)
            r = c["reasons"].setdefault(rule, {"documents": 0, "chars": 0})
            r["documents"] += 1
            r["chars"] += len(before)
        elif after != before:
            c["documents_modified"] += 1
            c["chars_removed"] += len(before) - len(after)

    def merge(self, other: "FilterStats") -> "FilterStats":
        """Add ``other``'s counts into this one (in place); returns self."""
        for name, oc in other.per_filter.items():
            c = self.per_filter.setdefault(name, _new_counts())
            for k, v in oc.items():
                if k != "reasons":
                    c[k] += v
            for rule, rv in oc["reasons"].items():
                r = c["reasons"].setdefault(rule, {"documents": 0, "chars": 0})
                r["documents"] += rv["documents"]
                r["chars"] += rv["chars"]
        return self

    def to_dict(self) -> dict:
        """JSON-able copy: ``{filter: {documents_in, ..., reasons: {rule: {documents, chars}}}}``,
        rules sorted by name."""
        return {name: {**{k: v for k, v in c.items() if k != "reasons"},
                       "reasons": {r: dict(c["reasons"][r]) for r in sorted(c["reasons"])}}
                for name, c in self.per_filter.items()}


def apply_filters(text: str, filters: list[Filter], stats: FilterStats) -> str | None:
    """Run ``filters`` in order on one cleaned document; counts go into ``stats``.

    Returns:
        The kept text (lines may have been removed), or None when a filter dropped the document;
        then ``stats.last_reason`` is ``'<filter>:<rule>'``.
    """
    stats.last_reason = None
    for f in filters:
        out, reason = f.apply(text)
        if out is not None and not out:
            out, reason = None, f"{f.name}:empty"
        stats.record(f.name, text, out, reason)
        if out is None:
            stats.last_reason = reason
            return None
        text = out
    return text
