"""Quality-filter thresholds (``data.filters.*``) and their validation: Gopher (Rae et al. 2021),
C4 (Raffel et al. 2020), FineWeb (Penedo et al. 2024). Applied by :mod:`densetrain.data.prepare.filters.chain`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from densetrain.errors import check_config


@dataclass
class GopherQualityConfig:
    """Gopher quality rules (Rae et al. 2021, Gopher, App. A); defaults are the paper's."""

    min_words: int = 50
    """Drop documents with fewer words (word tokens holding a non-punctuation character); Gopher: 50."""
    max_words: int = 100_000
    """Drop documents with more words; Gopher: 100,000."""
    min_mean_word_length: float = 3.0
    """Drop documents whose mean word length (characters, punctuation stripped) is below this; Gopher: 3."""
    max_mean_word_length: float = 10.0
    """Drop documents whose mean word length is above this; Gopher: 10."""
    max_hash_ratio: float = 0.1
    """Drop documents with more '#' characters per token; Gopher symbol-to-word ratio: 0.1."""
    max_ellipsis_ratio: float = 0.1
    """Drop documents with more ellipses ('...' or '…') per token; Gopher symbol-to-word ratio: 0.1."""
    max_bullet_lines: float = 0.9
    """Drop documents where a larger fraction of lines starts with '•' or '-'; Gopher: 0.9."""
    max_ellipsis_lines: float = 0.3
    """Drop documents where a larger fraction of lines ends with an ellipsis; Gopher: 0.3."""
    min_alpha_words: float = 0.8
    """Drop documents where a smaller fraction of word tokens contains an alphabetic character; Gopher: 0.8."""
    min_stop_words: int = 2
    """Drop documents with fewer distinct stop words among the tokens (exact case, as datatrove); Gopher: 2."""
    stop_words: list[str] = field(default_factory=lambda: ["the", "be", "to", "of", "and", "that", "have", "with"])
    """The stop words; Gopher's eight English ones (lowercase)."""


@dataclass
class GopherRepetitionConfig:
    """Gopher repetition rules (Rae et al. 2021, Gopher, App. A); defaults are Table A1's. 1.0 disables a rule.
    Fractions are of the document's characters, as datatrove (FineWeb) computes them."""

    max_dup_line_frac: float = 0.30
    """Max fraction of lines that repeat an earlier line; Table A1: 0.30."""
    max_dup_para_frac: float = 0.30
    """Max fraction of paragraphs (blank-line separated) that repeat an earlier one; Table A1: 0.30."""
    max_dup_line_char_frac: float = 0.20
    """Max fraction of the document's characters in repeated lines; Table A1: 0.20."""
    max_dup_para_char_frac: float = 0.20
    """Max fraction of the document's characters in repeated paragraphs; Table A1: 0.20."""
    max_top_2gram_char_frac: float = 0.20
    """Max fraction of characters covered by the most frequent word 2-gram (count x length); Table A1: 0.20."""
    max_top_3gram_char_frac: float = 0.18
    """Same for the most frequent 3-gram; Table A1: 0.18."""
    max_top_4gram_char_frac: float = 0.16
    """Same for the most frequent 4-gram; Table A1: 0.16."""
    max_dup_5gram_char_frac: float = 0.15
    """Max fraction of characters in word 5-grams repeating an earlier one (overlaps once); Table A1: 0.15."""
    max_dup_6gram_char_frac: float = 0.14
    """Same for 6-grams; Table A1: 0.14."""
    max_dup_7gram_char_frac: float = 0.13
    """Same for 7-grams; Table A1: 0.13."""
    max_dup_8gram_char_frac: float = 0.12
    """Same for 8-grams; Table A1: 0.12."""
    max_dup_9gram_char_frac: float = 0.11
    """Same for 9-grams; Table A1: 0.11."""
    max_dup_10gram_char_frac: float = 0.10
    """Same for 10-grams; Table A1: 0.10."""


@dataclass
class C4Config:
    """C4 page cleaning (Raffel et al. 2020, T5, §2.2, and its reference code, TFDS c4_utils.clean_page).
    ``data.filters.c4`` holds C4's own settings, ``data.filters.c4_fineweb`` FineWeb's (Penedo et al. 2024,
    datatrove C4QualityFilter(filter_no_terminal_punct=False): 3 words per line, 5 sentences)."""

    remove_no_terminal_punct: bool = True
    """Remove lines that do not end in '.', '?', '!' or a closing quote, or that end in '...' (C4); FineWeb: off."""
    min_words_per_line: int = 5
    """Remove lines with fewer words; C4: 5 (datatrove's default is 3)."""
    min_sentences: int = 3
    """Drop pages left with fewer sentences; C4: 3 (datatrove's default is 5)."""
    max_word_length: int = 1000
    """Remove lines holding a longer word (characters); 0 disables; C4 code: 1000."""
    remove_javascript_lines: bool = True
    """Remove lines that mention 'javascript' (C4)."""
    remove_policy_lines: bool = True
    """Remove lines with 'terms of use', 'privacy policy', cookie notices (C4 code)."""
    remove_citations: bool = True
    """Delete Wikipedia citation marks '[1]', '[edit]', '[citation needed]' from lines (C4 code)."""
    drop_lorem_ipsum: bool = True
    """Drop pages containing 'lorem ipsum' (C4)."""
    drop_curly_brace: bool = True
    """Drop pages containing '{' (C4: likely code); turn off for text that quotes code."""
    keep_blank_lines: bool = True
    """Keep one blank line where blank lines separated kept lines; C4's code and datatrove drop them."""


@dataclass
class FineWebConfig:
    """FineWeb's custom filters (Penedo et al. 2024, arXiv:2406.17557); defaults are its code's (datatrove 0.10)."""

    min_line_punct_ratio: float = 0.12
    """Drop documents where a smaller fraction of non-blank lines ends in terminal punctuation; FineWeb: 0.12."""
    max_short_line_ratio: float = 0.67
    """Drop documents where a larger fraction of non-blank lines is short (<= short_line_length); FineWeb: 0.67."""
    short_line_length: int = 30
    """Characters at or below which a line is short; FineWeb: 30."""
    max_dup_line_char_ratio: float = 0.01
    """Drop documents where repeated lines hold a larger fraction of the characters (newlines excluded);
    FineWeb's code: 0.01 (its paper says 0.1)."""
    max_newline_ratio: float = 0.3
    """Drop documents with more newlines per word token (list-like pages); FineWeb's code (new_line_ratio): 0.3."""


@dataclass
class FiltersConfig:
    """Thresholds of the document quality filters (``densetrain.data.prepare.filters.chain``); sources pick
    filters by name."""

    gopher_quality: GopherQualityConfig = field(default_factory=GopherQualityConfig)
    """Gopher quality rules (Rae et al. 2021, App. A)."""
    gopher_repetition: GopherRepetitionConfig = field(default_factory=GopherRepetitionConfig)
    """Gopher repetition rules (Rae et al. 2021, Table A1)."""
    c4: C4Config = field(default_factory=C4Config)
    """C4 line and page rules (Raffel et al. 2020, §2.2), filter 'c4'."""
    c4_fineweb: C4Config = field(default_factory=lambda: C4Config(
        remove_no_terminal_punct=False, min_words_per_line=3, min_sentences=5, keep_blank_lines=False))
    """C4's rules as FineWeb ran them (Penedo et al. 2024; datatrove C4QualityFilter without the
    terminal-punctuation rule), filter 'c4_fineweb'."""
    fineweb: FineWebConfig = field(default_factory=FineWebConfig)
    """FineWeb line rules (Penedo et al. 2024, arXiv:2406.17557)."""


def validate_filters(filters: FiltersConfig) -> None:
    """Check the thresholds of ``data.filters`` (each source's filter names: config/validate.py).

    Raises:
        ConfigError: naming the first key out of range.
    """
    g = filters.gopher_quality
    check_config(0 <= g.min_words <= g.max_words,
           f"data.filters.gopher_quality: need 0 <= min_words <= max_words, got {g.min_words} and {g.max_words}")
    check_config(0 <= g.min_mean_word_length <= g.max_mean_word_length,
           "data.filters.gopher_quality: need 0 <= min_mean_word_length <= max_mean_word_length, "
           f"got {g.min_mean_word_length} and {g.max_mean_word_length}")
    for k in ("max_hash_ratio", "max_ellipsis_ratio"):
        check_config(getattr(g, k) >= 0, f"data.filters.gopher_quality.{k} must be >= 0, got {getattr(g, k)}")
    for k in ("max_bullet_lines", "max_ellipsis_lines", "min_alpha_words"):
        check_config(0 <= getattr(g, k) <= 1, f"data.filters.gopher_quality.{k} must be in [0, 1], got {getattr(g, k)}")
    n_stop = len({w.lower() for w in g.stop_words})
    check_config(0 <= g.min_stop_words <= n_stop,
           f"data.filters.gopher_quality.min_stop_words must be in [0, {n_stop}] (distinct stop_words), "
           f"got {g.min_stop_words}")
    r = filters.gopher_repetition
    for f in dataclasses.fields(r):
        v = getattr(r, f.name)
        check_config(0 <= v <= 1, f"data.filters.gopher_repetition.{f.name} must be in [0, 1] (1 disables), got {v}")
    for name in ("c4", "c4_fineweb"):
        c = getattr(filters, name)
        for k in ("min_words_per_line", "min_sentences", "max_word_length"):
            check_config(getattr(c, k) >= 0, f"data.filters.{name}.{k} must be >= 0, got {getattr(c, k)}")
    fw = filters.fineweb
    for k in ("min_line_punct_ratio", "max_short_line_ratio", "max_dup_line_char_ratio"):
        check_config(0 <= getattr(fw, k) <= 1, f"data.filters.fineweb.{k} must be in [0, 1], got {getattr(fw, k)}")
    for k in ("max_newline_ratio", "short_line_length"):
        check_config(getattr(fw, k) >= 0, f"data.filters.fineweb.{k} must be >= 0, got {getattr(fw, k)}")
