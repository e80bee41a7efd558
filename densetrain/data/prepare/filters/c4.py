"""C4's page cleaning, in two readings: C4's own (``c4``: Raffel et al. 2020 and its reference
code) and the one FineWeb ran (``c4_fineweb``: datatrove 0.10's ``C4QualityFilter`` with
``filter_no_terminal_punct=False``, ``examples/fineweb.py``)."""

from __future__ import annotations

import re

from densetrain.config import C4Config
from densetrain.data.prepare.filters.base import Filter
from densetrain.data.prepare.filters.text import count_sentences

POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")
"""Cookie/terms-of-use phrases whose lines C4's reference code removes (TFDS ``c4_utils``)."""


def _judge_line(p: C4Config, line: str, n_words: int, end_marks: tuple[str, ...]) -> str | None:
    """The line rules both readings share, in their common order (after the long-word and citation steps):
    ``'remove'`` (the line goes: no terminal mark with ``remove_no_terminal_punct``, fewer than
    ``min_words_per_line`` words (``n_words``: counted where each reading counts them), 'javascript', a
    cookie/terms phrase), a page-drop reason (``lorem_ipsum``, ``curly_brace``), or None (kept)."""
    if p.remove_no_terminal_punct and (not line.endswith(end_marks) or line.endswith("...")):
        return "remove"
    if n_words < p.min_words_per_line:
        return "remove"
    low = line.lower()
    if p.drop_lorem_ipsum and "lorem ipsum" in low:
        return "lorem_ipsum"
    if p.remove_javascript_lines and "javascript" in low:
        return "remove"
    if p.drop_curly_brace and "{" in line:
        return "curly_brace"
    if p.remove_policy_lines and any(s in low for s in POLICY):
        return "remove"
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
    C4 used NLTK's punkt). The kept lines are joined with ``\\n``; with ``keep_blank_lines``
    (default), where blank lines separated kept lines, one blank line stays (the reference code
    drops them all: paragraph breaks are not what C4 meant to judge).

    The paper states 3 sentences and 5 words per line, as does the reference code; datatrove's
    ``C4QualityFilter`` defaults to 5 sentences and 3 words (FineWeb's setting: ``c4_fineweb``).
    """

    name = "c4"
    END_MARKS = (".", "?", "!", '"', "'", "”", "’")
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
                blank = bool(kept) and p.keep_blank_lines
                continue
            if p.max_word_length and len(line) > p.max_word_length and any(
                    len(w) > p.max_word_length for w in line.split()):
                continue
            if p.remove_citations and "[" in line:
                line = self._CITATION.sub("", line).strip()
                if not line:
                    continue
            verdict = _judge_line(p, line, len(line.split()), self.END_MARKS)
            if verdict == "remove":
                continue
            if verdict:
                return self._drop(verdict)
            sentences += max(1, len(self._SENTENCE_END.findall(line + " ")))
            if blank:
                kept.append("")
                blank = False
            kept.append(line)
        if sentences < p.min_sentences or not kept:
            return self._drop("too_few_sentences")
        return "\n".join(kept), None


class C4FineWebFilter(Filter):
    """C4's rules as FineWeb ran them (Penedo et al. 2024, §3.3: "C4 quality filter" without the
    terminal-punctuation line rule; datatrove 0.10 ``C4QualityFilter(filter_no_terminal_punct=False)``,
    ``examples/fineweb.py``), thresholds in ``data.filters.c4_fineweb`` (a :class:`C4Config`).

    Per line of ``str.splitlines`` (stripped), in datatrove's order: a line holding a word over
    1000 characters is removed; citation marks ('[1]', '[edit]', '[citation needed]', exact case)
    are deleted; with ``remove_no_terminal_punct`` (off here) a line without a final '.', '?', '!',
    '"' or "'" goes; a line with fewer than 3 whitespace words (counted before the citation
    marks were deleted; blank lines have none) goes; 'lorem ipsum' drops the page
    (``lorem_ipsum``); a line mentioning 'javascript' goes; a '{' drops the page
    (``curly_brace``); a cookie/terms line goes. The page is dropped when its kept lines hold fewer
    than 5 sentences (``too_few_sentences``; spaCy-sentencizer sentences,
    :func:`densetrain.data.prepare.filters.text.count_sentences`). Kept lines are joined with ``\\n``
    (blank lines go, as in datatrove and C4's code).
    """

    name = "c4_fineweb"
    END_MARKS = (".", "?", "!", '"', "'")
    _CITATION = re.compile(r"\[\d*\]|\[edit\]|\[citation needed\]")

    def __init__(self, params: C4Config):
        self.p = params

    def apply(self, text: str) -> tuple[str | None, str | None]:
        p = self.p
        kept: list[str] = []
        sentences = 0
        blank = False
        for line in text.splitlines():
            line = line.strip()
            n_words = len(line.split())
            if not n_words:
                blank = bool(kept) and p.keep_blank_lines
                if p.min_words_per_line > 0:
                    continue
            if p.max_word_length and len(line) > p.max_word_length and any(
                    len(w) > p.max_word_length for w in line.split()):
                continue
            if p.remove_citations and "[" in line:
                line = self._CITATION.sub("", line)
            verdict = _judge_line(p, line, n_words, self.END_MARKS)
            if verdict == "remove":
                continue
            if verdict:
                return self._drop(verdict)
            if sentences < p.min_sentences:  # enough already: the exact count does not matter
                sentences += count_sentences(line)
            if blank:
                kept.append("")
                blank = False
            kept.append(line)
        if sentences < p.min_sentences:
            return self._drop("too_few_sentences")
        return "\n".join(kept).strip(), None
