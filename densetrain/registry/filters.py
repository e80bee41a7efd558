"""Filter names and what ``filters = ['auto']`` means per source kind: a leaf registry that the config
schema validates against without importing the filters themselves (:mod:`densetrain.data.prepare.filters.chain`)."""

from __future__ import annotations

import difflib

from densetrain.errors import ConfigError

FILTER_NAMES = ("gopher_repetition", "gopher_repetition_lines", "gopher_quality", "gopher_quality_datatrove010",
                "c4", "c4_fineweb", "fineweb", "fineweb_datatrove010")
"""The filter names; 'auto' sets list them in the order FineWeb's pipeline runs them. ``gopher_quality``
and ``fineweb`` are the readings of datatrove's code that produced FineWeb in 2024; the
``_datatrove010`` names are datatrove 0.10's reading of the same rules (filters/gopher.py, fineweb.py)."""

AUTO_FILTERS: dict[str, tuple[str, ...]] = {
    # FineWeb's pipeline as published (Penedo et al. 2024; datatrove examples/fineweb.py): Gopher
    # repetition and quality, C4's rules without the terminal-punctuation line rule (FineWeb found it
    # removes too much text), FineWeb's own line rules. C4's line rule would cut ~19% of the characters
    # of documents that already passed FineWeb, and turn the stripped pages into false duplicates.
    # Re-filtering FineWeb itself removes 0.5% of its documents (1,400 sample-10BT pages).
    "web": ("gopher_repetition", "gopher_quality", "c4_fineweb", "fineweb"),
    # The same pipeline as datatrove 0.10 runs it today: its Gopher alpha-word ratio counts
    # punctuation tokens and its line-punctuation rule ignores closing quotes, so it drops 16% of
    # FineWeb's own documents (tests/test_filters_parity.py checks it decision by decision).
    "web_datatrove010": ("gopher_repetition", "gopher_quality_datatrove010", "c4_fineweb", "fineweb_datatrove010"),
    # C4's own cleaning (Raffel et al. 2020, §2.2): only lines ending in terminal punctuation, >= 5
    # words per line, >= 3 sentences per page; for reproducing C4-style data.
    "c4": ("c4",),
    # Dictionaries and encyclopedias: headwords, lists and tables are short lines without
    # punctuation by design (C4 would delete them, FineWeb's line ratios would drop the page),
    # but the text is word-based prose (Gopher: 1% of the demo's dictionary chunks dropped).
    "reference": ("gopher_repetition", "gopher_quality"),
    # Hard-wrapped lines (Gutenberg) rarely end in punctuation: C4 would delete most lines and
    # FineWeb's line ratios would drop poetry and dialogue; a novel exceeds Gopher's 100k words
    # (Gopher applied its quality rules to MassiveWeb only). Long documents accumulate repeated
    # 5-grams: 11% of the KJV's books exceed Table A1's 0.15, so only line/paragraph rules.
    "books": ("gopher_repetition_lines",),
    # Documentation: code blocks hold '{' and symbols, headings and lists are short lines, API
    # references are formulaic ("Return a new ...": 14% of Python doc pages exceed the 5-gram rule).
    "technical": ("gopher_repetition_lines",),
    # LaTeX: '{' everywhere, formulas are non-alphabetic "words", proofs repeat expressions.
    "math": ("gopher_repetition_lines",),
    # Closing braces, 'else:', 'end' lines repeat by design; prose rules do not apply.
    "code": (),
    # No spaces between words: word counts and n-grams are meaningless, lines are not.
    "zh": ("gopher_repetition_lines",),
}
"""What ``filters = ['auto']`` means per ``SourceConfig.kind``."""


def resolve_filter_names(names: list[str], kind: str, key: str = "filters") -> list[str]:
    """Expand ``['auto']`` by ``kind`` and ``['none']`` to ``[]``; check the other names.

    Raises:
        ConfigError: empty list, unknown or repeated name, 'auto'/'none' mixed with others, or
            'auto' on a kind without a rule in :data:`AUTO_FILTERS` (message names ``key``).
    """
    if not names:
        raise ConfigError(f"{key}: empty; use ['none'] to disable filtering or ['auto']")
    valid = (*FILTER_NAMES, "auto", "none")
    for n in names:
        if n not in valid:
            close = difflib.get_close_matches(n, valid, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"{key}: unknown filter '{n}' (valid: {', '.join(valid)}){hint}")
    if len(set(names)) != len(names):
        raise ConfigError(f"{key}: a filter is listed twice in {names}")
    if ("auto" in names or "none" in names) and len(names) > 1:
        raise ConfigError(f"{key}: 'auto' and 'none' must stand alone, got {names}")
    if names == ["none"]:
        return []
    if names == ["auto"]:
        if kind not in AUTO_FILTERS:
            raise ConfigError(f"{key}: 'auto' has no filter set for kind '{kind}' (known kinds: "
                              f"{', '.join(AUTO_FILTERS)}); list the filters, e.g. ['gopher_repetition'], or ['none']")
        return list(AUTO_FILTERS[kind])
    return list(names)
