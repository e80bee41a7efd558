"""The contamination index: sorted distinct n-gram hashes of the evaluation sets, each naming the first
example that holds it, and the check of training documents against it (:class:`ContaminationIndex`,
:class:`Hit`); saved and loaded as ``.npz`` (no pickle). How it is built and what the views and rules
are: :mod:`densetrain.data.prepare.decontam.build`.
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from densetrain.data.prepare.decontam.ngram import Words, bitmap_filter, hash_words, iter_kgrams, lookup
from densetrain.errors import DataError
from densetrain.fileio import atomic_write_bytes

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
VIEW_NAMES = tuple(VIEWS)
GAP_ARRAYS = ("gap_lengths", "gap_prefix", "gap_keys", "gap_source", "gap_example", "gap_gold", "gap_offsets",
               "gap_choice", "gap_choice_words")  # the ContaminationIndex arrays of the nearby rule
_CHUNK_CHARS = 2 << 20  # contaminated() works on about this many characters at a time: its arrays stay
# small enough (~16 MB) for malloc to reuse them instead of mapping fresh pages per chunk.


@dataclass(frozen=True)
class Hit:
    """Why a document is contaminated: the evaluation example it shares the most n-grams with (ties:
    the one matched first), and the first of those n-grams in the document.

    Each indexed n-gram names the first example holding it, so when examples share text (MMLU
    boilerplate such as "This question refers to the following information", consecutive HellaSwag
    clips of one video) the counting is over those first holders.

    Attributes:
        task: the task name (as in :mod:`densetrain.registry.tasks`), e.g. ``'hellaswag'``.
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
    # (bitmap_filter(keys), bitmap_filter(short_prefix), bitmap_filter(gap_prefix)): built on first use, never
    # saved or pickled
    _filters: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if not self.sha256:
            h = hashlib.sha256(f"ngram={self.ngram};".encode())
            for a in (self.keys, self.entry_source, self.entry_example, self.entry_view, self.short_lengths,
                      self.short_prefix, *(getattr(self, n) for n in GAP_ARRAYS)):
                h.update(np.ascontiguousarray(a).tobytes())
            h.update(json.dumps([self.source_task.tolist(), self.source_split.tolist()]).encode())
            self.sha256 = h.hexdigest()

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays (what a worker receives)."""
        return int(self.keys.nbytes + self.entry_source.nbytes + self.entry_example.nbytes + self.entry_view.nbytes
                   + self.short_prefix.nbytes + sum(getattr(self, n).nbytes for n in GAP_ARRAYS))

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
            self._filters = (bitmap_filter(self.keys), bitmap_filter(self.short_prefix), bitmap_filter(self.gap_prefix))
        words = hash_words(texts)
        short = set(self.short_lengths.tolist())
        gap = set(self.gap_lengths.tolist())
        p = min(SHORT_MIN_WORDS, self.ngram)
        lengths = [self.ngram] + ([*short, p] if short else []) + ([*gap, GAP_MIN_WORDS] if gap else [])
        found = []  # (word positions, k, entries) of confirmed matches
        near = []  # (word positions, k, first and end gap entry) of whole short questions, to verify
        cand = gap_cand = np.empty(0, dtype=np.int64)
        for k, h in iter_kgrams(words.hashes, lengths):
            inside = words.room[: len(h)] >= k  # the k-gram lies inside one document
            if k == GAP_MIN_WORDS and gap:
                # Short questions are found through their first GAP_MIN_WORDS words, like short examples.
                gap_cand, _ = lookup(h, self.gap_prefix, self._filters[2], inside)
            if k in gap:
                at = gap_cand[words.room[gap_cand] >= k]
                lo, hi = (np.searchsorted(self.gap_keys, h[at], side) for side in ("left", "right"))
                ok = hi > lo
                near.append((at[ok], k, lo[ok], hi[ok]))
            if k == self.ngram:
                at, e = lookup(h, self.keys, self._filters[0], inside)
            else:
                if k == p:
                    # Short examples are found through their first p words: one pass over a small set.
                    cand, _ = lookup(h, self.short_prefix, self._filters[1], inside)
                if k not in short:
                    continue
                at = cand[words.room[cand] >= k]
                sub, e = lookup(h[at], self.keys, self._filters[0])
                at = at[sub]
            found.append((at, np.full(len(at), k), e))
        if found:  # empty when the chunk holds fewer words than any length looked for
            at, ks, es = (np.concatenate(x) for x in zip(*found))
            if len(at):
                self._report_ngram_hits(words, at, ks, es, hits)
        self._report_nearby_hits(words, near, hits)
        return hits

    def _report_ngram_hits(self, words: "Words", at: np.ndarray, ks: np.ndarray, es: np.ndarray, hits: list) -> None:
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
                                     words.text(int(at[j]), int(ks[j])), VIEW_NAMES[self.entry_view[es[j]]])

    def _report_nearby_hits(self, words: "Words", near: list, hits: list) -> None:
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
                segments = (words.hashes[max(start, i - GAP_WINDOW) : i],
                            words.hashes[i + k : min(end, i + k + GAP_WINDOW)])
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
                seen[n] = {x for seg in segments for _, kg in iter_kgrams(seg, [n]) for x in kg.tolist()}
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
        buf = io.BytesIO()
        meta = {"ngram": self.ngram, "stats": self.stats, "key": self.key, "sha256": self.sha256}
        np.savez(buf, keys=self.keys, entry_source=self.entry_source, entry_example=self.entry_example,
                 entry_view=self.entry_view, short_lengths=self.short_lengths, short_prefix=self.short_prefix,
                 source_task=self.source_task, source_split=self.source_split,
                 **{n: getattr(self, n) for n in GAP_ARRAYS}, meta=np.array(json.dumps(meta)))
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
                                            "short_prefix", "source_task", "source_split", *GAP_ARRAYS)}
            return cls(ngram=int(meta["ngram"]), **arrays, stats=meta["stats"], path=path, sha256=meta["sha256"],
                       key=meta["key"])
        except FileNotFoundError:
            raise DataError(f"{path}: contamination index not found") from None
        except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as e:
            raise DataError(f"{path}: unreadable contamination index ({type(e).__name__}: {e})") from None
