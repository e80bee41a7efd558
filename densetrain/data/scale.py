"""Scale-out: one source's ``densetrain prepare`` as a datatrove pipeline (local, Slurm or Ray).

``densetrain prepare`` runs on one machine. Past it, the same work runs on datatrove's executors
(:func:`datatrove_pipeline`): each *stage* is a datatrove ``PipelineExecutor`` running ``tasks``
independent tasks (Slurm array jobs, Ray tasks, or local processes), and the stages depend on each
other in order. For one source ``data.sources[i]`` with exact and near dedup on::

    stage                tasks        steps (per task)
    map                  tasks        SourceReader -> DocumentMap -> ParquetWriter(work/documents)
                                      -> ExactDedupSignature
    exact_find           1            ExactFindDedups
    minhash_signatures   tasks        TaskFileReader(work/documents) -> ExactDedupFilter
                                      -> MinhashDedupSignature
    minhash_buckets      bands        MinhashDedupBuckets   (one task per LSH band)
    minhash_cluster      1            MinhashDedupCluster
    tokenize             tasks        TaskFileReader -> ExactDedupFilter -> MinhashDedupFilter
                                      -> HoldOut(val) -> DocumentTokenizer(output/train)

What stays ours: reading (:func:`densetrain.data.sources.iter_documents`: every format, bad-record
handling, document ids and provenance), cleaning, the quality filters and decontamination
(:class:`DocumentMap`), the exact-dedup normalisation and the MinHash word splitting
(:mod:`densetrain.data.dedup`), and the tokenizer file. What is datatrove's: task scheduling,
retries and completion markers (re-running skips finished tasks), statistics, the exact and MinHash
dedup stages and the tokenizer writer. Only the per-document work is ours; dedup needs a global
view and therefore runs as datatrove's multi-stage dedup, never inside a task.

Reader. :class:`SourceReader` wraps ``iter_documents`` rather than using datatrove's
JsonlReader/ParquetReader: those would bypass our bad-input rules (a malformed line or invalid
UTF-8 is counted with ``file:line`` instead of stopping the task), our ``doc_id``/provenance and the
formats datatrove has no reader for (paragraphs, ``save_to_disk`` folders, zstd JSONL). Files are
split over tasks as datatrove's readers do (``files[rank::world_size]``).

Dedup differences from ``densetrain prepare`` (documented, measured in tests/test_scale.py):

* exact dedup hashes the same normalised text (:func:`densetrain.data.dedup.normalize`), so the
  same exact duplicates go; which copy is kept can differ (datatrove keeps one by hash order,
  ``prepare`` the first read).
* near dedup uses datatrove's own MinHash (sha1-64 shingles, its permutations) with our
  ``ngram`` / ``bands`` / ``rows`` / ``seed`` and our word splitting (:class:`DedupWordTokenizer`,
  so no spaCy/NLTK is needed). datatrove does not verify LSH candidates against
  ``data.dedup.threshold`` (every pair sharing a band is a duplicate, as in FineWeb) and does not
  sign documents with fewer than ``ngram`` words (exact dedup still covers those). It therefore
  removes more: on 16 MB of stdlib source files with 14 x 8 bands it removed 54 near duplicates
  where ``prepare`` removed 18, 63% of them below an estimated Jaccard of 0.8 (lowest 0.64); on
  the prose corpus of tests/test_scale.py 15 against 12. Filtered and exact-duplicate documents
  are identical between the two paths (tested).

Output (``output_dir``), a folder densetrain trains on as a ``format = "datatrove"`` source::

    output_dir/train/NNNNN_doc_shuffled.ds (+ .ds.index, .ds.metadata)   DocumentTokenizer, per task
    output_dir/val/...                                                   the held-out documents
    output_dir/tokenizer.identity.json                                   sha256 etc. of the tokenizer

Work files (``work_dir``, default ``output_dir/../<output name>.work``): the filtered documents
(``documents/``), removed documents with their reason (``removed/map``, ``removed/exact``,
``removed/near``), dedup signatures, and datatrove's logs, stats and completion markers
(``logs/<stage>/``). On a cluster, ``output_dir``, ``work_dir``, the corpus and the tokenizer file
must be on storage every node sees (a shared file system; datatrove also takes ``s3://`` etc. for
output and work folders).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
from datatrove.data import Document as DTDocument
from datatrove.data import DocumentsPipeline
from datatrove.io import get_datafolder
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.dedup import MinhashDedupBuckets, MinhashDedupCluster, MinhashDedupFilter, MinhashDedupSignature
from datatrove.pipeline.dedup.exact_dedup import (
    ExactDedupConfig,
    ExactDedupFilter,
    ExactDedupSignature,
    ExactFindDedups,
)
from datatrove.pipeline.dedup.minhash import MinhashConfig
from datatrove.pipeline.readers import ParquetReader
from datatrove.pipeline.tokens import DocumentTokenizer
from datatrove.pipeline.writers import ParquetWriter
from datatrove.utils.hashing import HashConfig
from datatrove.utils.text import TextNormConfig
from datatrove.utils.typeshelper import StatHints
from datatrove.utils.word_tokenizers import WordTokenizer

from densetrain.data import dedup as dd
from densetrain.data.prepare import SHARD_MAX_TOKENS
from densetrain.data.process import CHUNK_BYTES, DocumentProcessor, ProcessSpec, chunked
from densetrain.data.shards import TokenFiles, sha256_file, token_dtype, token_size_for
from densetrain.data.sources import SkipLog, iter_documents, resolve_paths
from densetrain.data.tokenizer import Tokenizer, load_tokenizer
from densetrain.errors import ConfigError, DataError

IDENTITY_FILE = "tokenizer.identity.json"
"""Written next to ``train/`` by :class:`TokenizeStep`: the tokenizer's :meth:`Tokenizer.identity`,
so a folder is matched to ``data.tokenizer`` by content hash, wherever the tokenizer file was."""

EXECUTORS = ("local", "slurm", "ray")

VAL_TASKS = 8
"""Tasks of the tokenize stage that hold out validation documents (see :class:`HoldOut`)."""

HASH_CONFIG = HashConfig(precision=64, hash_fc="sha1")
"""Hash of shingles and exact-dedup texts. datatrove's default xxhash fails with xxhash >= 4 (it
passes str, which xxhash 4 rejects: huggingface/datatrove#508, pinned ``xxhash<4`` only in its
``processing`` extra); sha1 works with every version."""


# --------------------------------------------------------------------------------------------------
# Pipeline steps
# --------------------------------------------------------------------------------------------------


class SourceReader(PipelineStep):
    """Reads ``data.sources[i]`` with :func:`iter_documents`; task ``rank`` takes ``files[rank::world_size]``.

    Yields datatrove ``Document`` s with ``id`` = our ``doc_id`` and ``metadata`` = the record's
    other fields (``Document.meta``) plus ``source_file`` and ``line`` (provenance). Skipped records
    are counted in the step's stats as ``skipped_<reason>`` and their first examples logged.
    """

    name = "densetrain reader"
    type = "📖 - READER"

    def __init__(self, src, corpus_dir: str, source_index: int, max_document_bytes: int):
        super().__init__()
        self.src = src
        self.corpus_dir = str(corpus_dir)
        self.source_index = source_index
        self.max_document_bytes = max_document_bytes

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        if data:
            yield from data
        corpus = Path(self.corpus_dir)
        files = resolve_paths(self.src, corpus, self.source_index)[rank::world_size]
        skips = SkipLog()
        for doc in iter_documents(self.src, corpus, skips, self.source_index, files, self.max_document_bytes):
            with self.track_time():
                self.stat_update(StatHints.total)
                meta = dict(doc.meta or {})
                meta["source_file"] = doc.source_file
                meta["line"] = doc.line
                out = DTDocument(text=doc.text, id=doc.doc_id, metadata=meta)
                self.update_doc_stats(out)
            yield out
        for reason, n in skips.counts.items():
            self.stat_update(f"skipped_{reason}", value=n)


class DocumentMap(PipelineStep):
    """densetrain's per-document map without tokenization: clean (ftfy, NFC, strip) -> quality
    filters -> decontamination, in chunks of ~2 MB of text (the same code as ``prepare``).

    A kept document continues with its cleaned (and, for C4, line-filtered) text. A removed one is
    counted as ``dropped`` and ``dropped_<reason>`` (reasons as in ``removed.json``: ``empty``,
    ``<filter>:<rule>``, ``contaminated:<task>``) and, with an ``exclusion_writer``, written there
    with ``metadata['removed_reason']``.

    Args:
        spec: the source's :class:`ProcessSpec` (its ``dedup`` and tokenizer fields are unused).
        exclusion_writer: where removed documents go (e.g. :func:`document_writer`), or None.
    """

    name = "densetrain clean/filter/decontaminate"
    type = "🔻 - FILTER"

    def __init__(self, spec: ProcessSpec, exclusion_writer=None):
        super().__init__()
        self.spec = spec
        self.exclusion_writer = exclusion_writer

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        from contextlib import nullcontext

        from densetrain.data.filters import FilterStats

        proc = DocumentProcessor(self.spec)
        stats = FilterStats()
        with self.exclusion_writer or nullcontext() as excluded:
            for batch in chunked(data, lambda d: len(d.text), CHUNK_BYTES):
                with self.track_time(unit="batch"):
                    self.stat_update(StatHints.total, value=len(batch))
                    survivors, removed, _ = proc.select([d.text for d in batch], stats)
                    kept = []
                    for pos, text in survivors:
                        batch[pos].text = text
                        kept.append(batch[pos])
                    dropped = [(batch[pos], why) for pos, why in removed]
                    for doc, why in dropped:
                        self.stat_update(StatHints.dropped, f"dropped_{why}")
                        if excluded:
                            doc.metadata["removed_reason"] = why
                            excluded.write(doc, rank)
                for doc in kept:
                    self.stat_update(StatHints.forwarded)
                    self.update_doc_stats(doc)
                    yield doc


class DedupWordTokenizer(WordTokenizer):
    """datatrove word tokenizer that splits words exactly as :func:`densetrain.data.dedup.words`
    (lowercase, Unicode punctuation/symbols -> space, split on whitespace).

    Used by ``MinhashDedupSignature`` instead of datatrove's spaCy/NLTK tokenizers; pair it with an
    all-off ``TextNormConfig`` so the words are ours alone. Sentence splitting is not defined.
    """

    def __init__(self):
        super().__init__("densetrain")

    def word_tokenize(self, text: str) -> list[str]:
        return dd.words(text)

    def sent_tokenize(self, text: str) -> list[str]:
        raise NotImplementedError("DedupWordTokenizer splits words only (for MinHash shingles)")

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        raise NotImplementedError("DedupWordTokenizer splits words only (for MinHash shingles)")


def exact_content(doc: DTDocument) -> str:
    """What datatrove's exact dedup hashes: our normalised text (raw text when it has no words),
    the input of :func:`densetrain.data.dedup.exact_key`."""
    return dd.normalize(doc.text) or doc.text


def minhash_config(dedup_cfg) -> MinhashConfig:
    """datatrove's ``MinhashConfig`` for ``data.dedup``: ``n_grams = ngram``, ``num_buckets = bands``,
    ``hashes_per_bucket = rows``, ``seed``; shingles hashed with :data:`HASH_CONFIG`.

    Raises:
        ConfigError: ``data.dedup.seed`` is not below 2**32 (datatrove seeds numpy's RandomState).
    """
    if not 0 <= dedup_cfg.seed < 2**32:
        raise ConfigError(f"data.dedup.seed must be < 2**32 for the datatrove pipeline, got {dedup_cfg.seed}")
    off = TextNormConfig(lowercase=False, norm_whitespace=False, remove_punctuation=False,
                         norm_unicode_diacritics=False, norm_numbers=False)
    return MinhashConfig(n_grams=dedup_cfg.ngram, num_buckets=dedup_cfg.bands, hashes_per_bucket=dedup_cfg.rows,
                         seed=int(dedup_cfg.seed), norm_config=off, hash_config=HASH_CONFIG)


def _row(writer, doc: DTDocument) -> dict:
    # One fixed schema (metadata as a JSON string): fields that differ between documents (a null
    # line, extra JSONL fields) would otherwise break the schema parquet infers from the first row.
    # datatrove's readers parse a string metadata column back into a dict.
    return {"text": doc.text, "id": doc.id, "metadata": json.dumps(doc.metadata, ensure_ascii=False)}


def document_writer(folder: str) -> ParquetWriter:
    """A ParquetWriter of ``<rank:05d>.parquet`` files (zstd) for documents between stages and removed ones.

    Parquet rather than JSONL: pyarrow is already a dependency, datatrove's JSONL writer needs orjson.
    """
    import pyarrow as pa

    schema = pa.schema([("text", pa.string()), ("id", pa.string()), ("metadata", pa.string())])
    return ParquetWriter(folder, output_filename="${rank}.parquet", compression="zstd", adapter=_row, schema=schema,
                         max_file_size=-1)


class TaskFileReader(ParquetReader):
    """Reads ``<rank:05d>.parquet`` of a folder written by :func:`document_writer` in an earlier
    stage: the documents of the SAME task, in the same order.

    datatrove's dedup filters find documents by their position in the task that signed them, so a
    task must read exactly what that task wrote; ParquetReader's ``files[rank::world_size]`` would
    shift every task after one that wrote no file.
    """

    name = "densetrain task file"

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        if data:
            yield from data
        name = f"{rank:05d}.parquet"
        if not self.data_folder.exists(name):
            return  # the task wrote nothing (all its documents were removed, or it had no files)
        for doc in self.read_files_shard([name]):
            self.update_doc_stats(doc)
            yield doc


class TokenizeStep(DocumentTokenizer):
    """datatrove's ``DocumentTokenizer`` with our tokenizer rules and a tokenizer identity file.

    * Text that looks like a special token (``<|endoftext|>`` in a web page) is encoded as plain
      text, as :class:`densetrain.data.tokenizer.Tokenizer` does; only the appended EOS is special.
    * Task 0 writes ``identity`` (:meth:`Tokenizer.identity`) as ``IDENTITY_FILE`` into
      ``identity_folder``, so the output is checked by content hash (see :func:`check_datatrove_folder`).
    """

    def __init__(self, *args, identity: dict | None = None, identity_folder=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.identity = identity
        self.identity_folder = get_datafolder(identity_folder) if identity_folder else None

    @cached_property
    def tokenizer(self):
        tok = DocumentTokenizer.tokenizer.func(self)
        tok.encode_special_tokens = True
        return tok

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        if rank == 0 and self.identity_folder is not None and self.identity:
            with self.identity_folder.open(IDENTITY_FILE, "wt") as f:
                json.dump(self.identity, f, indent=1)
        return super().run(data, rank, world_size)


class HoldOut(PipelineStep):
    """Holds out a validation split in the first ``min(world_size, VAL_TASKS)`` tasks: a
    deterministic ``fraction`` of their documents (by a hash of ``seed`` and the document id), up to
    an equal share of ``max_tokens`` per task, tokenized by ``val_tokenizer`` into its own folder.
    Every other document passes on.

    Why not every task: there is no global view, so a per-task share of ``max_tokens`` over
    thousands of tasks would be smaller than one document. The first tasks read every
    ``world_size``-th input file (``files[rank::world_size]``), a spread sample of the source.
    Unlike ``prepare`` (a seeded shuffle of the whole source) the choice depends on the document id
    only, not on the order of documents.
    """

    name = "densetrain val split"
    type = "✂️ - SPLIT"

    def __init__(self, val_tokenizer: TokenizeStep, fraction: float, max_tokens: int, seed: int):
        super().__init__()
        self.val_tokenizer = val_tokenizer
        self.fraction = fraction
        self.max_tokens = max_tokens
        self.seed = seed

    def selected(self, doc_id: str) -> bool:
        """True when the document with this id is a validation candidate (before the token cap)."""
        return zlib.crc32(f"{self.seed}\0{doc_id}".encode()) < self.fraction * 2**32

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        k = min(world_size, VAL_TASKS)
        if rank >= k:
            yield from data
            return
        cap = self.max_tokens // k
        held, used = [], 0
        for doc in data:
            if self.selected(doc.id):
                n = len(self.val_tokenizer.tokenizer.encode(doc.text).ids)  # EOS included
                if used + n <= cap:
                    held.append(doc)
                    used += n
                    self.stat_update("held_out")
                    self.stat_update("held_out_tokens", value=n)
                    continue
                self.stat_update("over_val_cap")
            self.stat_update(StatHints.forwarded)
            yield doc
        if held:
            self.val_tokenizer.run(iter(held), rank, world_size)


# --------------------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------------------


@dataclass
class ScaleOutPipeline:
    """The configured stages of one source (see the module docstring).

    Attributes:
        stages: stage name -> datatrove executor, in run order; each depends on the previous one.
        output_dir: the tokenized folder (``train/``, ``val/``, identity file) to register as a
            ``format = "datatrove"`` source.
        work_dir: intermediate files, removed documents and datatrove logs (``logs/<stage>``).
    """

    stages: dict = field(default_factory=dict)
    output_dir: str = ""
    work_dir: str = ""

    def run(self):
        """Run every stage: locally in order, or submitted with dependencies (Slurm jobs, Ray).

        The last stage launches its dependencies first (datatrove's ``depends`` chain); finished
        tasks of an earlier run are skipped (completion markers in ``work_dir/logs``).
        """
        return list(self.stages.values())[-1].run()


def _executor_class(executor: str):
    if executor == "local":
        from datatrove.executor import LocalPipelineExecutor

        return LocalPipelineExecutor
    if executor == "slurm":
        from datatrove.executor import SlurmPipelineExecutor

        return SlurmPipelineExecutor
    if executor == "ray":
        from datatrove.executor import RayPipelineExecutor

        return RayPipelineExecutor
    raise ConfigError(f"executor must be one of {', '.join(EXECUTORS)}, got '{executor}'")


def datatrove_pipeline(
    cfg,
    source_index: int,
    output_dir: str,
    work_dir: str | None = None,
    tasks: int = 4,
    workers: int = -1,
    executor: str = "local",
    bucket_workers: int = 1,
    stage_kwargs: dict | None = None,
    **executor_kwargs,
) -> ScaleOutPipeline:
    """Map ``data.sources[source_index]`` of a prepare config onto datatrove executors.

    Args:
        cfg: a :class:`densetrain.config.Config`; reads ``data`` (corpus_dir, the source, filters,
            dedup, decontam, tokenizer, val_fraction, max_val_tokens, seed, max_document_bytes).
        source_index: which source.
        output_dir: where the token files go (``train/``, ``val/``); local path or fsspec URL.
        work_dir: intermediate files and logs; default ``<output_dir>.work`` next to it.
        tasks: tasks of the per-document stages (map, signatures, tokenize). Input files are split
            over tasks, so more tasks than files leaves tasks idle.
        workers: tasks run at once (local/Ray; -1 = all); on Slurm, the array's parallelism.
        executor: ``'local'`` (LocalPipelineExecutor), ``'slurm'`` (SlurmPipelineExecutor; pass
            ``time=`` and ``partition=``) or ``'ray'`` (RayPipelineExecutor; needs ``ray``).
        bucket_workers: tasks per LSH band in ``minhash_buckets`` (that stage has
            ``bands * bucket_workers`` tasks).
        stage_kwargs: per-stage overrides of executor arguments, e.g. ``{'minhash_cluster':
            {'mem_per_cpu_gb': 16}}``.
        **executor_kwargs: passed to every stage's executor (e.g. ``partition``, ``time``,
            ``cpus_per_task``, ``mem_per_cpu_gb``, ``venv_path``, ``start_method``).

    Returns:
        A :class:`ScaleOutPipeline`; nothing runs until its ``run()``.

    Raises:
        ConfigError: bad index, executor, task counts, or a tiktoken ``data.tokenizer``
            (datatrove's DocumentTokenizer runs HF tokenizer.json files only).
        DataError: the source's inputs or the tokenizer file are missing.
    """
    data = cfg.data
    if not 0 <= source_index < len(data.sources):
        raise ConfigError(f"source_index {source_index} out of range: data.sources has {len(data.sources)} entries")
    src = data.sources[source_index]
    key = f"data.sources[{source_index}]"
    if src.format == "datatrove":
        raise ConfigError(f"{key} ('{src.name}') is already tokenized (format 'datatrove'); nothing to run")
    if tasks < 1 or bucket_workers < 1:
        raise ConfigError(f"tasks and bucket_workers must be >= 1, got {tasks} and {bucket_workers}")
    cls = _executor_class(executor)
    missing = [k for k in ("time", "partition") if executor == "slurm" and k not in executor_kwargs]
    if missing:
        raise ConfigError(f"executor 'slurm' needs {' and '.join(missing)}= (e.g. time='4:00:00', partition='cpu')")
    tok = load_tokenizer(data.tokenizer, data.shards_dir)
    if tok.kind != "hf":
        raise ConfigError(f"data.tokenizer='{data.tokenizer}': the datatrove pipeline tokenizes with DocumentTokenizer, "
                          "which needs a tokenizer.json ('bpe' after a first prepare, or a path)")
    resolve_paths(src, Path(data.corpus_dir), source_index)  # missing inputs fail here, not in a task

    # Plain "/"-joined strings: local paths (made absolute: tasks may start in another directory)
    # and fsspec URLs (s3://...) alike.
    out = _absolute(output_dir)
    wd = _absolute(work_dir) if work_dir is not None else f"{out}.work"
    w = lambda sub: f"{wd}/{sub}"  # noqa: E731

    decontam = None
    if data.decontam.enabled:
        from densetrain.data.decontam import build_index

        # Built once here; tasks load the cache file, so work_dir must be visible to every node.
        decontam = str(build_index(data.decontam.tasks, data.decontam.ngram, cache_dir=w("decontam")).path)
    spec = ProcessSpec(kind=src.kind, filters=list(src.filters), fix_text=src.fix_text, filter_params=data.filters,
                       dedup=None, decontam_path=decontam, tokenizer_spec=data.tokenizer, shards_dir=str(data.shards_dir),
                       token_dtype=token_dtype(token_size_for(tok.vocab_size)).str, key=key)

    dcfg = data.dedup
    exact = src.dedup and dcfg.exact
    near = src.dedup and dcfg.near
    mh = minhash_config(dcfg) if near else None
    ex = ExactDedupConfig(content_getter=exact_content, hash_config=HASH_CONFIG) if exact else None
    words = DedupWordTokenizer()
    tok_path = str(Path(tok.name).resolve())  # tasks may run in another working directory

    documents = lambda: TaskFileReader(w("documents"))  # noqa: E731
    removed = lambda sub: document_writer(w(f"removed/{sub}"))  # noqa: E731
    map_steps = [
        SourceReader(src, _absolute(str(data.corpus_dir)), source_index, data.max_document_bytes),
        DocumentMap(spec, exclusion_writer=removed("map")),
        document_writer(w("documents")),
    ]
    plan: list[tuple[str, list, int]] = []
    if exact:
        map_steps.append(ExactDedupSignature(w("exact/signatures"), config=ex))
        plan += [("map", map_steps, tasks), ("exact_find", [ExactFindDedups(w("exact/signatures"), w("exact/duplicates"), config=ex)], 1)]
        if near:
            plan.append(("minhash_signatures", [documents(), ExactDedupFilter(w("exact/duplicates"), config=ex),
                                                MinhashDedupSignature(w("minhash/signatures"), config=mh, language=words)], tasks))
    elif near:
        map_steps.append(MinhashDedupSignature(w("minhash/signatures"), config=mh, language=words))
        plan.append(("map", map_steps, tasks))
    else:
        plan.append(("map", map_steps, tasks))
    if near:
        plan += [("minhash_buckets", [MinhashDedupBuckets(w("minhash/signatures"), w("minhash/buckets"), config=mh)],
                  mh.num_buckets * bucket_workers),
                 ("minhash_cluster", [MinhashDedupCluster(w("minhash/buckets"), w("minhash/remove"), config=mh)], 1)]

    def tokenizer(sub: str, identity: bool) -> TokenizeStep:
        return TokenizeStep(f"{out}/{sub}", tokenizer_name_or_path=tok_path, eos_token=tok.eos_token, seed=data.seed,
                            max_tokens_per_file=SHARD_MAX_TOKENS, identity=tok.identity() if identity else None,
                            identity_folder=out if identity else None)

    final = [documents()]
    if exact:
        final.append(ExactDedupFilter(w("exact/duplicates"), config=ex, exclusion_writer=removed("exact")))
    if near:
        final.append(MinhashDedupFilter(w("minhash/remove"), exclusion_writer=removed("near")))
    final += [HoldOut(tokenizer("val", False), data.val_fraction, data.max_val_tokens, data.seed), tokenizer("train", True)]
    plan.append(("tokenize", final, tasks))

    stage_kwargs = stage_kwargs or {}
    unknown = set(stage_kwargs) - {name for name, _, _ in plan}
    if unknown:
        raise ConfigError(f"stage_kwargs: unknown stage(s) {sorted(unknown)}; stages are {[n for n, _, _ in plan]}")
    stages, prev = {}, None
    for name, steps, n in plan:
        kw = {"logging_dir": w(f"logs/{name}"), "depends": prev, **executor_kwargs, **stage_kwargs.get(name, {})}
        if executor == "slurm":
            kw.setdefault("job_name", f"{src.name}-{name}")
        kw.setdefault("workers", min(workers, n) if workers > 0 else -1)
        prev = stages[name] = cls(steps, tasks=n, **kw)
    return ScaleOutPipeline(stages=stages, output_dir=out, work_dir=wd)


def _absolute(path: str) -> str:
    """A local path made absolute; a URL (``s3://...``) as is; no trailing slash."""
    return path.rstrip("/") if "://" in path else str(Path(path).expanduser().resolve())


# --------------------------------------------------------------------------------------------------
# Checking a datatrove-tokenized folder (format = "datatrove")
# --------------------------------------------------------------------------------------------------


def datatrove_split_dirs(folder: Path) -> dict[str, Path | None]:
    """``{'train': dir, 'val': dir or None}`` of a tokenized folder.

    With a ``train/`` subfolder (what :func:`datatrove_pipeline` writes): ``train/`` and, when it
    holds ``.ds`` files, ``val/``. Otherwise the folder itself is the train split (plain
    ``DocumentTokenizer`` output) and there is no validation split.
    """
    if (folder / "train").is_dir():
        val = folder / "val"
        return {"train": folder / "train", "val": val if val.is_dir() and any(val.glob("*.ds")) else None}
    return {"train": folder, "val": None}


def _same_tokenizer(name: str, tok: Tokenizer, spec: str) -> bool:
    """Whether a ``.ds.metadata`` tokenizer name denotes ``tok``: the same name or spec, the same
    resolved path, or a readable file with the same sha256."""
    if name in (tok.name, spec):
        return True
    p = Path(name).expanduser()
    try:
        return p.is_file() and (p.resolve() == Path(tok.name).resolve() or sha256_file(p) == tok.sha256)
    except OSError:
        return False


def _check_files(d: Path, tok: Tokenizer, spec: str, vocab_size: int, identity_ok: bool) -> dict:
    files = sorted(f for f in d.glob("*.ds") if f.is_file() and not f.name.startswith("."))
    if not files:
        raise DataError(f"{d}: no .ds token files (format 'datatrove')")
    for f in files:
        meta, idx = f.with_name(f.name + ".metadata"), f.with_name(f.name + ".index")
        if not meta.is_file():
            raise DataError(f"{meta}: missing; without it the tokenizer cannot be checked (datatrove writes it)")
        if not idx.is_file():
            raise DataError(f"{idx}: missing; the document boundaries are needed (DocumentTokenizer save_index=True)")
        lines = meta.read_text(errors="replace").splitlines()
        name, _, size = (lines[0] if lines else "").rpartition("|")
        if size.strip() not in ("2", "4"):
            raise DataError(f"{meta}:1: expected '<tokenizer>|<2 or 4>', got '{lines[0] if lines else ''}'")
        if not identity_ok and not _same_tokenizer(name, tok, spec):
            raise DataError(f"{meta}:1: tokenized with '{name}' but data.tokenizer is '{spec}' ({tok.name}); "
                            "set data.tokenizer to the tokenizer that made these files")
        n = f.stat().st_size // int(size)
        if len(lines) > 1 and lines[1].strip().isdigit() and int(lines[1]) != n:
            raise DataError(f"{meta}:2: token count {int(lines[1])} but {f.name} holds {n} tokens (truncated?)")
    stream = TokenFiles(files)  # token sizes agree, index ends increase up to each file's size
    stream.check_vocab(vocab_size)
    shards = []
    # The document ends and token maps TokenFiles has already read and checked, file by file.
    for f, ends, tokens in zip(files, stream._ends, stream._maps):
        idx = f.with_name(f.name + ".index")
        if ends.size:
            # Every document must end with our EOS (DocumentTokenizer eos_token=...): without it the
            # model would never see where one document ends. The first 65536 per file are read.
            last = tokens[ends[: 1 << 16] - 1]
            bad = np.flatnonzero(last != tok.eos_id)
            if bad.size:
                raise DataError(f"{f}: document {int(bad[0])} does not end with EOS id {tok.eos_id} ({tok.eos_token}); "
                                "tokenize with DocumentTokenizer(eos_token=...)")
        shards.append({"path": str(f), "tokens": int(ends[-1]) if ends.size else 0, "documents": int(ends.size),
                       "index_sha256": sha256_file(idx)})
    return {"tokens": len(stream), "documents": stream.n_docs, "token_size": stream.token_size, "shards": shards}


def check_datatrove_folder(folder: str | Path, tok: Tokenizer, spec: str, vocab_size: int, key: str = "data.sources") -> dict:
    """Check a datatrove-tokenized folder before training on it.

    Checks, per split (:func:`datatrove_split_dirs`): every ``.ds`` has a ``.ds.metadata`` (token
    size 2 or 4, token count = file size) and a ``.ds.index`` consistent with it; the tokenizer is
    ``tok`` (``IDENTITY_FILE`` sha256 when present, else the metadata's tokenizer name: the same
    name/path or a file with the same sha256); every id < ``vocab_size``
    (:meth:`TokenFiles.check_vocab`); documents end with ``tok.eos_id`` (the first 65536).

    Args:
        folder: the tokenized folder.
        tok: the tokenizer of ``data.tokenizer``; spec: ``data.tokenizer`` as written.
        vocab_size: ``model.vocab_size``.
        key: config key for messages.

    Returns:
        ``{'train': {'dir', 'tokens', 'documents', 'token_size', 'shards'}, 'val': {...} or None}``.

    Raises:
        DataError: one line naming the file (and line of a metadata file) and what is wrong.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{folder}: no such folder of datatrove token files ({key}.paths)")
    identity_ok = False
    ident = folder / IDENTITY_FILE
    if ident.is_file():
        try:
            sha = json.loads(ident.read_text()).get("sha256")
        except (OSError, json.JSONDecodeError, AttributeError) as e:
            raise DataError(f"{ident}: unreadable ({type(e).__name__})") from None
        if sha != tok.sha256:
            raise DataError(f"{ident}: tokenized with tokenizer sha256 {str(sha)[:12]} but data.tokenizer='{spec}' "
                            f"has {tok.sha256[:12]}")
        identity_ok = True
    out = {}
    for split, d in datatrove_split_dirs(folder).items():
        out[split] = None if d is None else {"dir": str(d.resolve()), **_check_files(d, tok, spec, vocab_size, identity_ok)}
    return out


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """``python -m densetrain.data.scale --config FILE --source NAME --output DIR [options] [overrides]``.

    Overrides: ``--section.key=value`` config overrides as for every densetrain command;
    ``--executor.KEY=VALUE`` executor arguments for every stage (``--executor.partition=cpu
    --executor.time=4:00:00``); ``--stage.NAME.KEY=VALUE`` for one stage
    (``--stage.minhash_cluster.mem_per_cpu_gb=16``). Values are TOML, else strings.
    """
    import argparse

    from densetrain.config import load_config, parse_overrides

    p = argparse.ArgumentParser(prog="python -m densetrain.data.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", help="preset under the config file (default tiny)")
    p.add_argument("--config", help="TOML config file (applied over the preset)")
    p.add_argument("--source", required=True, help="name of the data.sources entry to process")
    p.add_argument("--output", required=True, help="tokenized output folder (then a format='datatrove' source)")
    p.add_argument("--work", default=None, help="intermediate files and logs (default OUTPUT.work)")
    p.add_argument("--executor", default="local", choices=EXECUTORS)
    p.add_argument("--tasks", type=int, default=4)
    p.add_argument("--workers", type=int, default=-1)
    p.add_argument("--bucket-workers", type=int, default=1)
    a, rest = p.parse_known_args(argv)
    try:
        pairs = parse_overrides(rest)
        kw = {k.split(".", 1)[1]: v for k, v in pairs if k.startswith("executor.")}
        stage_kw: dict = {}
        for k, v in pairs:
            if k.startswith("stage."):
                name, _, arg = k[len("stage."):].partition(".")
                stage_kw.setdefault(name, {})[arg] = v
        cfg = load_config(preset=a.preset, path=a.config,
                          overrides=[(k, v) for k, v in pairs if not k.startswith(("executor.", "stage."))])
        names = [s.name for s in cfg.data.sources]
        if a.source not in names:
            raise ConfigError(f"--source '{a.source}' is not among data.sources {names}")
        pipe = datatrove_pipeline(cfg, names.index(a.source), a.output, a.work, tasks=a.tasks, workers=a.workers,
                                  executor=a.executor, bucket_workers=a.bucket_workers, stage_kwargs=stage_kw, **kw)
    except (ConfigError, DataError) as e:
        raise SystemExit(f"densetrain: error: {e}") from None
    print(f"[scale] stages: {', '.join(f'{n} ({e.world_size} tasks)' for n, e in pipe.stages.items())}", flush=True)
    pipe.run()
    print(f"[scale] output: {pipe.output_dir}  (a source with format = \"datatrove\" and paths = [that folder])")


if __name__ == "__main__":
    # Run the copy imported under the package name: pipeline steps are pickled into datatrove's
    # worker processes by reference to their module, and classes of `__main__` (pickled by value)
    # hung the tokenize stage under the local executor's forkserver.
    from densetrain.data import scale

    scale.main()
