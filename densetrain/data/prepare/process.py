"""The per-document work of ``densetrain prepare``, run in parallel worker processes.

Every document of a source goes through the same map, independently of all others::

    raw text -> clean (ftfy, NFC, strip) -> quality filters -> decontamination check
             -> dedup key + MinHash signature -> [BOS] + token ids + EOS

(BOS where the tokenizer has one: Llama 3 starts every document with ``<|begin_of_text|>``, GPT-2
has none and its ``<|endoftext|>`` alone separates documents.)

Only deduplication needs to see the whole source; it runs afterwards in the main process on the
keys and signatures the workers return (:mod:`densetrain.data.prepare.dedup`). This split is also how the
pipeline maps onto datatrove (``densetrain/data/prepare/scale/pipeline.py``): the map is one pipeline step that runs
per task, dedup is datatrove's own MinHash stages.

Workers are separate processes (``data.workers``, default: the CPUs this process may use), started
with ``spawn`` so that nothing of the parent (threads, a torch runtime) is inherited. A worker imports
only this module's needs (~0.3 CPU-s: numpy, ftfy, the filters, dedup, the tokenizer; not the readers,
pyarrow or torch) unless the parent's main script imports more: ``spawn`` re-runs it in every worker.
(``fork`` would save that ~0.3 CPU-s per worker, measured 5.8 vs 6.5 CPU-s on 9.9 MB of FineWeb with two
workers, but forks a parent that has OpenBLAS, jemalloc and tokenizer threads running.) Each worker
builds its filters, tokenizer and contamination index once per source (:func:`_run_chunk`) and then
handles chunks of documents; results come back in submission order, so the output does not depend on the
number of workers. With ``workers = 1`` everything runs in this process.
"""

from __future__ import annotations

import ctypes
import dataclasses
import io
import json
import multiprocessing
import os
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from densetrain.data.prepare import dedup
from densetrain.data.prepare.decontam.index import ContaminationIndex
from densetrain.data.prepare.filters.chain import FilterStats, apply_filters, build_filters, clean_text
from densetrain.data.tokenizer import load_tokenizer
from densetrain.data.tokenizer.twin import trust_twins
from densetrain.errors import DataError
from densetrain.fileio import atomic_write_bytes

CHUNK_BYTES = 1 << 21
"""Text bytes per work item (2 MiB): small enough to keep every worker busy and memory bounded,
big enough that inter-process transfer is a small fraction of the work."""


@dataclass
class ProcessSpec:
    """Everything a worker needs to process documents of one source (picklable, small).

    Attributes:
        kind: the source kind (picks the filter set for ``filters = ['auto']``).
        filters: filter names (``SourceConfig.filters``).
        fix_text: repair Unicode with ftfy (``SourceConfig.fix_text``).
        filter_params: ``data.filters`` (:class:`densetrain.config.FiltersConfig`).
        dedup: ``data.dedup`` when this source is deduplicated, else None.
        decontam_path: the contamination index cache file, or None (no decontamination).
        tokenizer_spec / shards_dir: how to load the tokenizer (:func:`load_tokenizer`).
        token_dtype: numpy dtype name of the token arrays (``'<u2'`` or ``'<u4'``).
        key: the config key of this source, for error messages (``data.sources[2]``).
        checked_twins: sha256s of tokenizer.json files whose tiktoken twin the parent has checked
            (:func:`densetrain.data.tokenizer.twin.checked_twins`), so that workers skip the probe.
    """

    kind: str
    filters: list
    fix_text: bool
    filter_params: object
    dedup: object | None
    decontam_path: str | None
    tokenizer_spec: str
    shards_dir: str
    token_dtype: str
    key: str = "data.sources"
    checked_twins: tuple = ()


@dataclass
class ChunkResult:
    """What a worker returns for one chunk of ``n`` documents.

    Attributes:
        kept: positions (in the chunk) of documents that survived cleaning, filters and
            decontamination, ascending.
        tokens: token ids of each kept document (``token_dtype`` arrays): BOS (where the tokenizer has
            one: Llama 3's ``<|begin_of_text|>``), the text's ids, EOS.
        text_bytes: UTF-8 bytes of each kept (cleaned) document.
        keys: ``(len(kept), 16)`` uint8 exact-dedup keys, or None without exact dedup.
        signatures: ``(len(kept), num_perm)`` uint32 MinHash signatures, or None without near dedup.
        dropped: ``(position, reason)`` of every removed document (``'empty'``,
            ``'<filter>:<rule>'``, ``'contaminated:<task>'``).
        contaminated: ``(position, task, example index, matched n-gram)`` per contaminated document.
        filter_stats: the chunk's :class:`densetrain.data.prepare.filters.chain.FilterStats`.
        bytes_in: UTF-8 bytes of the raw documents.
    """

    kept: list = field(default_factory=list)
    tokens: list = field(default_factory=list)
    text_bytes: list = field(default_factory=list)
    keys: np.ndarray | None = None
    signatures: np.ndarray | None = None
    dropped: list = field(default_factory=list)
    contaminated: list = field(default_factory=list)
    filter_stats: object = None
    bytes_in: int = 0

    @property
    def n_docs(self) -> int:
        """Documents in the chunk: each one is either kept or dropped."""
        return len(self.kept) + len(self.dropped)

    def save(self, path: Path) -> None:
        """Write atomically as ``.npz`` (arrays and JSON strings only: loading never unpickles)."""
        arrays = {
            "tokens": np.concatenate(self.tokens) if self.tokens else np.zeros(0, np.uint32),
            "lengths": np.array([a.size for a in self.tokens], np.int64),
            "kept": np.array(self.kept, np.int64),
            "text_bytes": np.array(self.text_bytes, np.int64),
            "meta": np.array(json.dumps({"dropped": self.dropped, "contaminated": self.contaminated,
                                         "filter_stats": self.filter_stats.to_dict(), "bytes_in": self.bytes_in})),
        }
        if self.keys is not None:
            arrays["keys"] = self.keys
        if self.signatures is not None:
            arrays["signatures"] = self.signatures
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        atomic_write_bytes(path, buf.getvalue())

    @classmethod
    def load(cls, path: Path) -> "ChunkResult":
        """Read a chunk written by :meth:`save` (raises OSError/ValueError/KeyError when damaged)."""
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            ends = np.cumsum(z["lengths"])
            tokens = z["tokens"]
            return cls(kept=z["kept"].tolist(), tokens=np.split(tokens, ends[:-1]) if ends.size else [],
                       text_bytes=z["text_bytes"].tolist(), keys=z["keys"] if "keys" in z else None,
                       signatures=z["signatures"] if "signatures" in z else None,
                       dropped=[tuple(d) for d in meta["dropped"]],
                       contaminated=[tuple(c) for c in meta["contaminated"]],
                       filter_stats=FilterStats(per_filter=meta["filter_stats"]), bytes_in=meta["bytes_in"])


class DocumentProcessor:
    """The per-document map of one source, built from a :class:`ProcessSpec`.

    Raises:
        ConfigError: an unknown filter name (naming ``spec.key``).
        DataError: the tokenizer or the contamination index cannot be loaded.
    """

    def __init__(self, spec: ProcessSpec):
        self.spec = spec
        self.filters = build_filters(spec.filters, spec.kind, spec.filter_params, key=f"{spec.key}.filters")
        self.index = ContaminationIndex.load(spec.decontam_path) if spec.decontam_path else None
        self.dtype = np.dtype(spec.token_dtype)
        self._tokenizer = None

    @property
    def tokenizer(self):
        """The tokenizer, loaded on first use (the datatrove map step never tokenizes)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.spec.tokenizer_spec, self.spec.shards_dir)
        return self._tokenizer

    def select(self, texts: list[str], stats) -> tuple[list, list, list]:
        """Clean, filter and decontaminate ``texts``: the part of the map that decides what stays.

        Args:
            texts: raw document texts.
            stats: a :class:`densetrain.data.prepare.filters.chain.FilterStats` that the filters count into.

        Returns:
            ``(kept, dropped, contaminated)``: ``(position, cleaned text)`` of the survivors,
            ``(position, reason)`` of the removed documents (both ascending), and
            ``(position, task, example index, matched n-gram)`` per contaminated document.
        """
        kept, dropped, contaminated = [], [], []
        for pos, raw in enumerate(texts):
            text = clean_text(raw, fix=self.spec.fix_text)
            if not text:
                dropped.append((pos, "empty"))
                continue
            text = apply_filters(text, self.filters, stats)
            if text is None:
                dropped.append((pos, stats.last_reason))
                continue
            kept.append((pos, text))
        if self.index is not None and kept:
            hits = self.index.contaminated([t for _, t in kept])
            for (pos, _), hit in zip(kept, hits):
                if hit is not None:
                    dropped.append((pos, f"contaminated:{hit.task}"))
                    contaminated.append((pos, hit.task, hit.example, hit.ngram))
            kept = [k for k, hit in zip(kept, hits) if hit is None]
        dropped.sort()
        return kept, dropped, contaminated

    def __call__(self, texts: list[str]) -> ChunkResult:
        """Process one chunk of raw document texts (see :class:`ChunkResult`)."""
        res = ChunkResult(filter_stats=FilterStats(), bytes_in=sum(len(t.encode("utf-8")) for t in texts))
        survivors, res.dropped, res.contaminated = self.select(texts, res.filter_stats)
        texts_kept = [t for _, t in survivors]
        res.kept = [p for p, _ in survivors]
        res.text_bytes = [len(t.encode("utf-8")) for t in texts_kept]
        if self.spec.dedup is not None:
            res.keys, res.signatures = dedup.fingerprints(texts_kept, self.spec.dedup)
        bos, eos = self.tokenizer.bos_id, self.tokenizer.eos_id
        head = 0 if bos is None else 1  # Llama 3 starts every document with <|begin_of_text|>
        for ids in self.tokenizer.encode_batch(texts_kept):
            a = np.empty(head + len(ids) + 1, dtype=self.dtype)
            if head:
                a[0] = bos
            a[head:-1] = ids
            a[-1] = eos
            res.tokens.append(a)
        return res


_PROCESSORS: dict[str, DocumentProcessor] = {}  # per worker process: one processor per source spec


def _spec_key(spec: ProcessSpec) -> str:
    return json.dumps(dataclasses.asdict(spec), sort_keys=True, default=str)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _init_worker(parent: int) -> None:
    # One process per core already: a tokenizer thread pool per worker would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    # Die with the parent: a killed `prepare` (kill -9, OOM killer) must not leave workers running
    # (Linux prctl; not available elsewhere).
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _run_chunk(spec: ProcessSpec, texts: list[str]) -> ChunkResult:
    key = _spec_key(spec)
    if key not in _PROCESSORS:
        trust_twins(spec.checked_twins)
        _PROCESSORS.clear()  # the previous source is done (sources run one after another)
        _PROCESSORS[key] = DocumentProcessor(spec)
    return _PROCESSORS[key](texts)


def worker_pool(workers: int) -> ProcessPoolExecutor | None:
    """A pool of ``workers`` spawned processes for :func:`process_documents`, shared by every
    source of a run (starting a worker costs ~0.3 CPU-s of imports); None when ``workers <= 1``."""
    if workers <= 1:
        return None
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_init_worker, initargs=(os.getpid(),))
    pool.workers = workers  # read by process_documents to bound the chunks in flight
    return pool


def chunked(items: Iterable, size_of, limit: int = CHUNK_BYTES) -> Iterator[list]:
    """Group ``items`` into consecutive lists of about ``limit`` (by ``size_of(item)``) each, never empty."""
    chunk, size = [], 0
    for it in items:
        chunk.append(it)
        size += size_of(it)
        if size >= limit:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def process_documents(spec: ProcessSpec, chunks: Iterable[list[str]], pool: ProcessPoolExecutor | None,
                      work_dir: Path | None = None) -> Iterator[ChunkResult]:
    """Run :class:`DocumentProcessor` over ``chunks`` of texts, yielding results in input order.

    Args:
        spec: the source's processing spec.
        chunks: lists of raw document texts (e.g. from :func:`chunked`); consumed lazily, at most
            ``2 * workers`` chunks in flight, so memory stays bounded on large sources.
        pool: worker processes from :func:`worker_pool`; None runs everything in this process.
        work_dir: where finished chunks are kept (``NNNNNN.npz``), so that an interrupted run
            resumes after its last finished chunk instead of redoing the source. The caller
            names the directory after everything that determines the results (inputs, params,
            tokenizer) and deletes it when the source is done. None: no resume.

    Raises:
        ConfigError / DataError: from building the processor (raised before any chunk is processed).
    """
    if work_dir is not None:
        work_dir.mkdir(parents=True, exist_ok=True)

    def cached(k: int) -> ChunkResult | None:
        if work_dir is None or not (work_dir / f"{k:06d}.npz").is_file():
            return None
        try:
            return ChunkResult.load(work_dir / f"{k:06d}.npz")
        except Exception:  # noqa: BLE001 - any damage (cut zip, bad CRC, missing array): recompute it
            return None

    def keep(k: int, res: ChunkResult) -> ChunkResult:
        if work_dir is not None:
            res.save(work_dir / f"{k:06d}.npz")
        return res

    proc = DocumentProcessor(spec)  # in the pool's case: fail here, with the real error, not in a worker
    if pool is None:
        for k, texts in enumerate(chunks):
            res = cached(k)
            yield res if res is not None else keep(k, proc(texts))
        return
    in_flight = 2 * pool.workers
    pending: list = []  # (chunk index, finished result or future), in order
    for k, texts in enumerate(chunks):
        res = cached(k)
        pending.append((k, res if res is not None else pool.submit(_run_chunk, spec, texts)))
        while pending and (isinstance(pending[0][1], ChunkResult) or len(pending) >= in_flight):
            j, item = pending.pop(0)
            yield item if isinstance(item, ChunkResult) else keep(j, _result(item))
    for j, item in pending:
        yield item if isinstance(item, ChunkResult) else keep(j, _result(item))


def _result(future) -> ChunkResult:
    try:
        return future.result()
    except BrokenProcessPool:
        raise DataError("a prepare worker process died (killed, e.g. out of memory); finished chunks are kept: "
                        "re-run, with a smaller data.workers if memory is short") from None
