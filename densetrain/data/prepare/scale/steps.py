"""The pipeline steps of the datatrove scale-out (:mod:`densetrain.data.prepare.scale.pipeline`): our reader,
per-document map, word splitting for MinHash, document writer and reader between stages, tokenizer step and the
validation hold-out, as datatrove ``PipelineStep`` s. Importing this module needs datatrove (the
``test`` extra: ``pip install 'datatrove>=0.10,<0.11'``).
"""

from __future__ import annotations

import json
import zlib
from contextlib import nullcontext
from functools import cached_property
from pathlib import Path

import pyarrow as pa
from datatrove.data import Document as DTDocument
from datatrove.data import DocumentsPipeline
from datatrove.io import get_datafolder
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.dedup.minhash import MinhashConfig
from datatrove.pipeline.readers import ParquetReader
from datatrove.pipeline.tokens import DocumentTokenizer
from datatrove.pipeline.writers import ParquetWriter
from datatrove.utils.hashing import HashConfig
from datatrove.utils.text import TextNormConfig
from datatrove.utils.typeshelper import StatHints
from datatrove.utils.word_tokenizers import WordTokenizer

from densetrain.data.prepare import dedup as dd
from densetrain.data.prepare.filters.chain import FilterStats
from densetrain.data.prepare.process import CHUNK_BYTES, DocumentProcessor, ProcessSpec, chunked
from densetrain.data.prepare.readers.documents import SkipLog
from densetrain.data.prepare.readers.paths import resolve_paths
from densetrain.data.prepare.readers.sources import iter_documents
from densetrain.data.prepare.scale.folder import IDENTITY_FILE
from densetrain.errors import ConfigError

VAL_TASKS = 8
"""Tasks of the tokenize stage that hold out validation documents (see :class:`HoldOut`)."""

HASH_CONFIG = HashConfig(precision=64, hash_fc="sha1")
"""Hash of shingles and exact-dedup texts. datatrove's default xxhash fails with xxhash >= 4 (it
passes str, which xxhash 4 rejects: huggingface/datatrove#508, pinned ``xxhash<4`` only in its
``processing`` extra); sha1 works with every version."""


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
    """datatrove word tokenizer that splits words exactly as :func:`densetrain.data.prepare.dedup.words`
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
    the input of :func:`densetrain.data.prepare.dedup.exact_key`."""
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


def document_template(tok):
    """The tokenize stage's post-processor for ``tok`` (a :class:`densetrain.data.tokenizer.Tokenizer`):
    ``<BOS> $A <EOS>`` where the tokenizer has a BOS (Llama 3), as ``prepare``'s shard writer places
    them; None (datatrove's default ``$A <EOS>``) for one without (GPT-2)."""
    if tok.bos_id is None:
        return None
    from tokenizers.processors import TemplateProcessing

    return TemplateProcessing(single=f"{tok.bos_token} $A {tok.eos_token}", pair=None,
                              special_tokens=[(tok.bos_token, tok.bos_id), (tok.eos_token, tok.eos_id)])


class TokenizeStep(DocumentTokenizer):
    """datatrove's ``DocumentTokenizer`` with our tokenizer rules and a tokenizer identity file.

    * Text that looks like a special token (``<|endoftext|>`` in a web page) is encoded as plain
      text, as :class:`densetrain.data.tokenizer.Tokenizer` does; only the appended EOS is special.
    * A file's saved truncation and padding are ignored (documents are encoded whole), as there too.
    * Task 0 writes ``identity`` (:meth:`Tokenizer.identity`) as ``IDENTITY_FILE`` into
      ``identity_folder``, so the output is checked by content hash
      (:func:`~densetrain.data.prepare.scale.folder.check_datatrove_folder`).
    """

    def __init__(self, *args, identity: dict | None = None, identity_folder=None, post_processor=None, **kwargs):
        super().__init__(*args, **kwargs)
        # DocumentTokenizer does not pass it on; its tokenizer property reads it (None: "$A <EOS>")
        self.post_processor = post_processor
        self.identity = identity
        self.identity_folder = get_datafolder(identity_folder) if identity_folder else None

    @cached_property
    def tokenizer(self):
        tok = DocumentTokenizer.tokenizer.func(self)
        tok.encode_special_tokens = True
        # A tokenizer.json saved after enable_truncation/enable_padding carries them, and datatrove encodes
        # with the file as it is: every document would be cut to max_length (as Tokenizer does, ignore them).
        tok.no_truncation()
        tok.no_padding()
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
