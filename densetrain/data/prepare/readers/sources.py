"""Reading raw documents of one configured source (``data.sources[i]``): the one entry point,
:func:`iter_documents`, over the per-format readers.

Which files: :mod:`densetrain.data.prepare.readers.paths` (files, directories walked recursively and sorted, globs,
``save_to_disk`` folders). Each file is read in one of six formats:

* ``jsonl``: one JSON object per line; the document is ``obj[text_field]`` (a string). A non-empty
  string ``id`` field becomes the document id; every other field is kept in ``Document.meta``.
* ``text``: the whole file is one document.
* ``paragraphs``: documents are separated by one or more blank (whitespace-only) lines.
* ``parquet``: one document per row, read a batch of rows at a time
  (:mod:`densetrain.data.prepare.readers.columnar`). FineWeb's schema (``text``, ``id``, ``url``, ``dump``,
  ``date``, ``language``, ``language_score``, ``token_count``, ...) works as is.
* ``arrow``: one document per row of an Arrow IPC file, stream format as written by Hugging Face
  ``datasets`` (``save_to_disk``, its cache files) or file format (Feather v2).
* ``auto``: by extension: ``.jsonl``/``.json.gz``/``.jsonl.gz``/``.json.zst``/``.jsonl.zst`` are
  jsonl, ``.parquet`` is parquet, ``.arrow`` is arrow, everything else is text.

Gzip and zstd compressed files (``jsonl``, ``text``, ``paragraphs``) are decompressed as a stream,
detected by their magic bytes (:mod:`densetrain.data.prepare.readers.text`). A UTF-8 byte-order mark at the start
of a file is not text (dropped in every format); CRLF line ends are read as line ends.

Bad input is never fatal and never silently dropped: it is recorded in a
:class:`~densetrain.data.prepare.readers.documents.SkipLog` (``file:line: reason``, the line being the row for
parquet/arrow) and the reader moves on:

* a malformed JSON line, a record that is not an object, a missing, null or non-string text field;
* invalid UTF-8: the JSONL record or parquet/arrow row is skipped; in ``text`` and ``paragraphs``
  files only the line holding the bad byte is dropped, the rest of the document is kept (why:
  :mod:`densetrain.data.prepare.readers.text`);
* a document over ``max_document_bytes`` (``data.max_document_bytes``): the size is measured on the
  input, i.e. the JSONL line (which bounds the memory a line may take), the text file, the
  paragraph, or the UTF-8 text value of a parquet/arrow row;
* a truncated or corrupt gzip/zstd stream (``truncated gzip`` at the first line not read
  completely): the documents before the cut are kept, the rest of that file is lost;
* an unreadable or truncated Parquet/Arrow file (``unreadable Parquet`` with pyarrow's message):
  the rows of the batches read before the failure are kept;
* a file that cannot be opened or read (``unreadable file``).

Fatal (:class:`DataError`, raised before anything is read): a configured path that does not exist,
a ``save_to_disk`` folder whose ``state.json`` is unreadable or lists a missing file, an unknown
format.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from densetrain.config import DataConfig, SourceConfig
from densetrain.data.prepare.readers.columnar import iter_arrow, iter_parquet
from densetrain.data.prepare.readers.documents import Document, SkipLog, first_line
from densetrain.data.prepare.readers.paths import display_path, file_format, resolve_paths
from densetrain.data.prepare.readers.text import iter_jsonl, iter_paragraphs, iter_text
from densetrain.errors import DataError

DEFAULT_MAX_DOCUMENT_BYTES: int = DataConfig.max_document_bytes
"""Default of ``data.max_document_bytes`` (64 MiB). A long novel is a few MB of text and The Stack
(Kocetkov et al. 2022, sec. 3) already drops source files over 1 MB, so no real document comes near;
what does is a whole dump in one record or a binary file read as text, which would otherwise hold
the tokenizer for minutes and take gigabytes of memory for its ids and offsets."""


def iter_documents(
    src: SourceConfig,
    corpus_dir: Path,
    skips: SkipLog | None = None,
    source_index: int | None = None,
    files: list[Path] | None = None,
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES,
) -> Iterator[Document]:
    """Yield the raw documents of one source, file by file in :func:`resolve_paths` order.

    Args:
        src: the source config (paths, format, text_field).
        corpus_dir: base of relative paths.
        skips: where skipped records are logged (a fresh log is used, and lost, when None:
            pass one to see what was skipped).
        source_index: index of the source in ``data.sources`` (only for error messages).
        files: already-resolved input files (from :func:`resolve_paths`); resolved here if None.
        max_document_bytes: larger documents are skipped and logged (``data.max_document_bytes``;
            how size is measured per format: see the module docstring).

    Raises:
        DataError: a configured path does not exist or a ``save_to_disk`` folder is broken
            (raised before anything is yielded), or the format is unknown.
    """
    skips = skips if skips is not None else SkipLog()
    if files is None:
        files = resolve_paths(src, corpus_dir, source_index)
    cap = int(max_document_bytes)
    for path in files:
        name = display_path(path, corpus_dir)
        fmt = file_format(path, src.format)
        if fmt == "parquet":
            yield from iter_parquet(path, name, src.text_field, cap, skips)
            continue
        if fmt == "arrow":
            yield from iter_arrow(path, name, src.text_field, cap, skips)
            continue
        if fmt not in ("jsonl", "paragraphs", "text"):
            raise DataError(f"data.sources: unknown format '{fmt}' for source '{src.name}'")
        try:
            if fmt == "jsonl":
                yield from iter_jsonl(path, name, src.text_field, cap, skips)
            elif fmt == "paragraphs":
                yield from iter_paragraphs(path, name, cap, skips)
            else:
                yield from iter_text(path, name, cap, skips)
        except OSError as e:  # opening failed (permissions, vanished file); reading errors are handled inside
            skips.add(name, None, "unreadable file", first_line(e))
