"""Document cleaning and heuristic quality filters (Gopher, C4, FineWeb).

Every document is first cleaned (:func:`clean_text`: ftfy repair, Unicode NFC, strip), then goes
through the filters of its source (``SourceConfig.filters``, resolved by :func:`build_filters`)
in order. A filter either keeps the document, possibly with lines removed (C4), or drops it with a
reason ``'<filter>:<rule>'``; :func:`apply_filters` stops at the first drop and counts documents
and characters (Unicode code points) removed per filter and rule in a :class:`FilterStats`;
:func:`filter_warnings` turns a source's counts into log lines when the filters changed much.

=======================  ===================================================================
name                     rules (thresholds in ``data.filters.<name>``, published defaults)
=======================  ===================================================================
gopher_repetition        duplicate lines/paragraphs and repeated word n-grams (Rae et al.
                         2021, Gopher, App. A, Table A1): :mod:`.gopher`
gopher_repetition_lines  the line/paragraph rules of gopher_repetition only
gopher_quality           word count, mean word length, '#' and ellipsis per word, bullet and
                         ellipsis lines, alphabetic words, stop words (Gopher, App. A), as
                         FineWeb computed them in 2024 (ratios over non-punctuation words)
gopher_quality_          the same rules as datatrove 0.10 computes them (punctuation tokens in
  datatrove010           the ratios' denominators, distinct stop words)
c4                       C4's own cleaning: lines ending in terminal punctuation with >= 5
                         words, no javascript / policy lines; pages without 'lorem ipsum' or
                         '{' and with >= 3 sentences (Raffel et al. 2020, §2.2): :mod:`.c4`
c4_fineweb               C4's rules as FineWeb ran them: no terminal-punctuation rule, >= 3
                         words per line, >= 5 sentences (Penedo et al. 2024)
fineweb                  line punctuation, short lines, duplicated-line characters, newlines
                         per word (Penedo et al. 2024, arXiv:2406.17557): :mod:`.fineweb`, as
                         FineWeb's 2024 code (ASCII stops and quotes, blank lines counted)
fineweb_datatrove010     the same rules as datatrove 0.10 (Unicode stops, no quotes, blank
                         lines left out)
=======================  ===================================================================

``filters = ['auto']`` picks a set by ``SourceConfig.kind`` (``AUTO_FILTERS``); for ``web`` it is
FineWeb's pipeline as it ran in 2024 (re-filtering FineWeb's own pages removes 0.5% of them,
tests/test_filters.py), for ``web_datatrove010`` the same pipeline as datatrove 0.10 runs it
(16% of FineWeb's pages dropped; its keep/drop decisions equal datatrove 0.10's document by
document, tests/test_filters_parity.py); words are datatrove's English word tokens (:mod:`.text`).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field

import ftfy

from densetrain.config import FiltersConfig
from densetrain.data.prepare.filters.base import Filter
from densetrain.data.prepare.filters.c4 import C4Filter, C4FineWebFilter
from densetrain.data.prepare.filters.fineweb import FineWebFilter
from densetrain.data.prepare.filters.gopher import GopherQualityFilter, GopherRepetitionFilter
from densetrain.data.prepare.filters.text import TERMINAL_PUNCTUATION, split_words
from densetrain.registry.filters import resolve_filter_names

__all__ = ["FTFY_CONFIG", "TERMINAL_PUNCTUATION", "C4FineWebFilter", "C4Filter", "Filter", "FilterStats",
           "FineWebFilter", "GopherQualityFilter", "GopherRepetitionFilter", "apply_filters", "build_filters",
           "clean_text", "filter_warnings", "split_words"]

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


_NEEDS_FTFY = re.compile(r"[^\t\n\x20-\x7e\u2018\u2019\u201c\u201d\u2013\u2014\u2026]")
"""Characters ftfy may act on: anything but printable ASCII, tab, newline and the typographic quotes,
dashes and ellipsis (‘ ’ “ ” – — …). Those seven are UTF-8 continuation bytes in the Windows code
pages (0x85, 0x91-0x97) and lead bytes in MacRoman (0xC9-0xD5), never both, so a line of ASCII and
them holds no byte sequence that any of ftfy's encodings decodes as mojibake, and ftfy leaves it as
it is (checked on FineWeb's pages and random strings, tests/test_filters.py); they are most of the
non-ASCII characters of English web text (85% fewer lines go to ftfy on FineWeb's sample)."""


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
        if n in ("gopher_quality", "gopher_quality_datatrove010"):
            out.append(GopherQualityFilter(params.gopher_quality, reading=_reading(n)))
        elif n in ("gopher_repetition", "gopher_repetition_lines"):
            out.append(GopherRepetitionFilter(params.gopher_repetition, words=n == "gopher_repetition"))
        elif n == "c4":
            out.append(C4Filter(params.c4))
        elif n == "c4_fineweb":
            out.append(C4FineWebFilter(params.c4_fineweb))
        else:
            out.append(FineWebFilter(params.fineweb, reading=_reading(n)))
    return out


def _reading(name: str) -> str:
    """Which reading of datatrove's code a filter name asks for (see :data:`FILTER_NAMES`)."""
    return "datatrove010" if name.endswith("_datatrove010") else "fineweb2024"


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


def filter_warnings(stats: FilterStats | dict, source: str, threshold: float = 0.05, top: int = 3) -> list[str]:
    """Log lines for a source whose filters removed or edited more than ``threshold`` of its
    documents or characters; ``[]`` otherwise.

    Args:
        stats: the source's :class:`FilterStats` (or its ``to_dict()``, as in manifest.json).
        source: the source's name, for the message.
        threshold: fraction of the documents / characters that reached the first filter (0.05:
            on documents that already passed FineWeb's pipeline, FineWeb's filters change < 5%).
        top: how many rules to name, largest share of characters first.

    Returns:
        One line, e.g. ``"source 'web': filters removed 2.1% and edited 85.0% of 1000 documents,
        cutting 19.3% of 5.1M characters; top rules: c4:lines removed (18.0% chars, 850 docs),
        ..."``; a line edit counts as the rule ``<filter>:lines removed``.
    """
    d = stats.to_dict() if isinstance(stats, FilterStats) else stats
    if not d:
        return []
    first = next(iter(d.values()))
    docs_in, chars_in = first["documents_in"], first["chars_in"]
    if not docs_in or not chars_in:
        return []
    removed = sum(c["documents_removed"] for c in d.values())
    edited = sum(c["documents_modified"] for c in d.values())  # a document may be edited by two filters
    chars = sum(c["chars_removed"] for c in d.values())
    if max(removed + edited, 0) / docs_in <= threshold and chars / chars_in <= threshold:
        return []
    rules = []  # (chars, documents, name)
    for name, c in d.items():
        for rule, r in c["reasons"].items():
            rules.append((r["chars"], r["documents"], f"{name}:{rule}"))
        line_chars = c["chars_removed"] - sum(r["chars"] for r in c["reasons"].values())
        if c["documents_modified"]:
            rules.append((line_chars, c["documents_modified"], f"{name}:lines removed"))
    rules.sort(key=lambda x: (-x[0], -x[1], x[2]))
    named = ", ".join(f"{n} ({ch / chars_in:.1%} chars, {k} docs)" for ch, k, n in rules[:top])
    return [f"source '{source}': filters removed {removed / docs_in:.1%} and edited {edited / docs_in:.1%} of "
            f"{docs_in} documents, cutting {chars / chars_in:.1%} of {chars_in:,} characters; top rules: {named}"]
