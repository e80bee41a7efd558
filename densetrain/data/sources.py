"""Reading raw documents of one configured source (``data.sources[i]``).

A source names files, directories (walked recursively, sorted) or globs, relative to
``data.corpus_dir``. Each file is read in one of six formats:

* ``jsonl``: one JSON object per line; the document is ``obj[text_field]`` (a string). A non-empty
  string ``id`` field becomes the document id; every other field is kept in ``Document.meta``.
* ``text``: the whole file is one document.
* ``paragraphs``: documents are separated by one or more blank (whitespace-only) lines.
* ``parquet``: one document per row, read a batch of rows at a time with
  ``pyarrow.parquet.ParquetFile.iter_batches`` (only the text, ``id`` and scalar columns are
  read). FineWeb's schema (``text``, ``id``, ``url``, ``dump``, ``date``, ``language``,
  ``language_score``, ``token_count``, ...) works as is.
* ``arrow``: one document per row of an Arrow IPC file, stream format as written by Hugging Face
  ``datasets`` (``save_to_disk``, its cache files) or file format (Feather v2).
* ``auto``: by extension: ``.jsonl``/``.json.gz``/``.jsonl.gz``/``.json.zst``/``.jsonl.zst`` are
  jsonl, ``.parquet`` is parquet, ``.arrow`` is arrow, everything else is text.

For parquet and arrow the text column is ``text_field``; a string ``id`` column becomes the document
id; the other scalar columns go to ``Document.meta`` (booleans, numbers and strings as they are,
dates, times and decimals as strings; nested and binary columns are not read).

A Hugging Face ``save_to_disk`` folder (``state.json`` listing ``_data_files``, or
``dataset_info.json`` next to ``*.arrow`` files) is ONE dataset: naming it (or a directory above
it) gives its Arrow files in ``state.json`` order, never its JSON files or stale ``cache-*.arrow``
files. A ``DatasetDict`` folder is walked into its split folders (sorted by split name).

Gzip and zstd compressed files (``jsonl``, ``text``, ``paragraphs``) are decompressed as a stream,
detected by their magic bytes (``1f 8b``, ``28 b5 2f fd``) so the extension does not matter.
Hidden files and directories (names starting with ``.``) and ``__pycache__`` directories are
skipped when walking a directory: they are caches, temporaries of atomic writes and markers.

Bad input is never fatal and never silently dropped: it is recorded in a :class:`SkipLog`
(``file:line: reason``, the line being the row for parquet/arrow) and the reader moves on:

* a malformed JSON line, a record that is not an object, a missing, null or non-string text field,
  invalid UTF-8;
* a document over ``max_document_bytes`` (``data.max_document_bytes``): the size is measured on the
  input, i.e. the JSONL line (which bounds the memory a line may take), the text file, the
  paragraph, or the UTF-8 text value of a parquet/arrow row;
* a truncated or corrupt gzip/zstd stream (``truncated gzip`` at the first line not read
  completely): the documents before the cut are kept, the rest of that file is lost;
* an unreadable or truncated Parquet/Arrow file (``unreadable Parquet`` with pyarrow's message):
  the rows of the batches read before the failure are kept;
* a file that cannot be opened or read (``unreadable file``).

Fatal (:class:`DataError`, raised before anything is read): a configured path that does not exist,
a ``save_to_disk`` folder whose ``state.json`` is unreadable or lists a missing file.
"""

from __future__ import annotations

import glob as _glob
import gzip
import io
import json
import os
import sys
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterable, Iterator

import zstandard

from densetrain.config import DataConfig, SourceConfig
from densetrain.errors import DataError

DEFAULT_MAX_DOCUMENT_BYTES: int = DataConfig.max_document_bytes
"""Default of ``data.max_document_bytes`` (64 MiB). A long novel is a few MB of text and The Stack
(Kocetkov et al. 2022, sec. 3) already drops source files over 1 MB, so no real document comes near;
what does is a whole dump in one record or a binary file read as text, which would otherwise hold
the tokenizer for minutes and take gigabytes of memory for its ids and offsets."""


@dataclass(frozen=True)
class Document:
    """One raw document.

    Attributes:
        text: the document text, exactly as read (no cleaning).
        source_file: the input file, relative to ``corpus_dir`` when inside it, else absolute.
        line: 1-based location in ``source_file``: the line for jsonl (the record) and paragraphs
            (its first line), the row for parquet and arrow files; ``None`` for whole-file documents.
        doc_id: a stable id: the record's non-empty string ``id`` when present, else
            ``source_file:line``, or ``source_file`` for whole-file documents.
        meta: the record's other fields (jsonl) or scalar columns (parquet/arrow), JSON values;
            ``id`` is among them only when it did not become ``doc_id``. ``None`` for text and
            paragraphs. Not part of the hash.
    """

    text: str
    source_file: str
    line: int | None
    doc_id: str
    meta: dict | None = field(default=None, hash=False)


@dataclass
class SkipLog:
    """Accumulates input records that were skipped, with the reason and location.

    ``counts`` maps a short reason class (``'malformed JSON'``, ``'invalid UTF-8'``,
    ``'truncated gzip'``, ...) to the number of records (or, for a file cut short, events);
    ``examples`` keeps the first ``keep`` entries as ``'file:line: reason'`` strings. The first
    ``print_first`` entries are also printed to stderr as they happen, so that a user notices bad
    input without digging into the manifest.
    """

    keep: int = 20
    print_first: int = 5
    counts: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        """Number of skipped records."""
        return sum(self.counts.values())

    def add(self, file: str, line: int | None, kind: str, detail: str = "", n: int = 1) -> None:
        """Record ``n`` skipped records (one entry): ``kind`` is the reason class, ``detail`` free text."""
        printed = self.total < self.print_first
        self.counts[kind] += n
        where = f"{file}:{line}" if line is not None else file
        msg = f"{where}: {kind}{': ' + detail if detail else ''}"
        if len(self.examples) < self.keep:
            self.examples.append(msg)
        if printed:
            print(f"[data] skipped {msg}", file=sys.stderr)

    def merge(self, other: "SkipLog") -> None:
        """Add another log's counts and examples to this one."""
        self.counts.update(other.counts)
        self.examples.extend(other.examples[: max(0, self.keep - len(self.examples))])

    def summary(self) -> dict:
        """JSON-able summary: ``{'total': int, 'counts': {reason: n}, 'examples': [...]}``."""
        return {"total": self.total, "counts": dict(sorted(self.counts.items())), "examples": list(self.examples)}


# --------------------------------------------------------------------------------------------------
# Paths
# --------------------------------------------------------------------------------------------------

_GLOB_CHARS = set("*?[")


def save_to_disk_files(folder: Path) -> list[Path] | None:
    """The Arrow files of a Hugging Face ``save_to_disk`` folder in dataset order; None if it is not one.

    A folder is one when its ``state.json`` lists ``_data_files`` (their order is the row order),
    or, without that, when it holds ``dataset_info.json`` and ``*.arrow`` files (then the sorted
    ``data-*.arrow`` files, else all ``*.arrow``).

    Raises:
        DataError: ``state.json`` is unreadable next to a ``dataset_info.json``, its
            ``_data_files`` is malformed, or it lists a file that does not exist.
    """
    folder = Path(folder)
    state, has_info = folder / "state.json", (folder / "dataset_info.json").is_file()
    if state.is_file():
        try:
            obj = json.loads(state.read_bytes())
        except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            if has_info:
                raise DataError(f"{state}: unreadable datasets state.json ({e})") from None
            return None  # somebody else's state.json: an ordinary directory
        entries = obj.get("_data_files") if isinstance(obj, dict) else None
        if entries is not None:
            names_ok = isinstance(entries, list) and all(isinstance(e, dict) and isinstance(e.get("filename"), str) for e in entries)
            if not names_ok:
                raise DataError(f"{state}: _data_files must be a list of {{'filename': str}}")
            files = [folder / e["filename"] for e in entries]
            for f in files:
                if not f.is_file():
                    raise DataError(f"{f}: listed in {state} but missing")
            return files
    if has_info:
        arrows = sorted(folder.glob("data-*.arrow")) or sorted(folder.glob("*.arrow"))
        if arrows:
            return arrows
    return None


def _walk(directory: Path) -> list[Path]:
    """All input files under ``directory``, recursively, sorted, skipping hidden names and __pycache__.

    A ``save_to_disk`` folder contributes its Arrow files in dataset order at its place in the
    sorted order, and is not walked into; a ``DatasetDict`` folder (``dataset_dict.json``) only
    its split folders.
    """
    groups: list[tuple[Path, list[Path]]] = []  # (sort key, files in their order)
    seen_dirs: set[str] = set()
    for root, dirs, files in os.walk(directory, followlinks=True):
        # Symlinked directories are followed once: a link back up the tree would walk forever.
        real = os.path.realpath(root)
        if real in seen_dirs:
            print(f"[data] skipped {root}: symlink loop (already read as {real})", file=sys.stderr)
            dirs[:] = []
            continue
        seen_dirs.add(real)
        ds_files = save_to_disk_files(Path(root))
        if ds_files is not None:
            groups.append((Path(root), ds_files))
            dirs[:] = []
            continue
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        if "dataset_dict.json" in files:  # a DatasetDict: its split folders only, not the JSON file
            continue
        for f in files:
            path = Path(root) / f
            if f.startswith("."):
                continue
            if not path.exists():  # a dangling symlink: nothing to read, and not worth stopping for
                print(f"[data] skipped {path}: broken symlink", file=sys.stderr)
                continue
            groups.append((path, [path]))
    return [f for _, fs in sorted(groups, key=lambda g: g[0]) for f in fs]


def resolve_paths(src: SourceConfig, corpus_dir: Path, source_index: int | None = None) -> list[Path]:
    """Expand ``src.paths`` into the de-duplicated list of input files, in reading order.

    Relative paths are resolved against ``corpus_dir``; ``~`` is expanded. Directories are walked
    recursively (sorted; hidden names and ``__pycache__`` skipped); globs support ``**``. A
    ``save_to_disk`` folder gives its Arrow files in ``state.json`` order (:func:`save_to_disk_files`).

    Raises:
        DataError: a path (or glob) matches nothing, ``src.paths`` is empty, or a ``save_to_disk``
            folder is broken (see :func:`save_to_disk_files`).
    """
    key = f"data.sources[{source_index}]" if source_index is not None else f"data.sources[name={src.name!r}]"
    if not src.paths:
        raise DataError(f"{key}.paths is empty for source '{src.name}'")
    corpus_dir = Path(corpus_dir)
    seen: set[Path] = set()
    files: list[Path] = []
    for raw in src.paths:
        p = Path(os.path.expanduser(raw))
        if not p.is_absolute():
            p = corpus_dir / p
        if _GLOB_CHARS & set(str(raw)):
            matches = [Path(m) for m in sorted(_glob.glob(str(p), recursive=True))]
            found: list[Path] = []
            for m in matches:
                found.extend(_walk(m) if m.is_dir() else [m] if m.is_file() else [])
            if not found:
                raise DataError(f"{p}: no such file (glob matched nothing) ({key}.paths)")
        elif p.is_dir():
            found = _walk(p)
        elif p.is_file():
            found = [p]
        else:
            raise DataError(f"{p}: no such file ({key}.paths)")
        for f in found:
            if f not in seen:
                seen.add(f)
                files.append(f)
    return files


def display_path(path: Path, corpus_dir: Path) -> str:
    """``path`` relative to ``corpus_dir`` when inside it (stable provenance), else absolute.

    Symlinks are not resolved: two names of one file (``GPL`` -> ``GPL-3``) are two inputs with
    two document ids (and exact duplicates of each other, which dedup then reports).
    """
    absolute = Path(os.path.abspath(path))
    try:
        return str(absolute.relative_to(os.path.abspath(corpus_dir)))
    except ValueError:
        return str(absolute)


_AUTO_SUFFIXES = (
    ((".jsonl", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst", ".jsonl.zstd", ".json.zstd"), "jsonl"),
    ((".parquet",), "parquet"),
    ((".arrow",), "arrow"),
)


def file_format(path: Path, fmt: str) -> str:
    """The effective format of one file: ``fmt`` unless it is ``'auto'`` (then by extension, see the module doc)."""
    if fmt != "auto":
        return fmt
    name = path.name.lower()
    for suffixes, f in _AUTO_SUFFIXES:
        if name.endswith(suffixes):
            return f
    return "text"


# --------------------------------------------------------------------------------------------------
# Compressed streams
# --------------------------------------------------------------------------------------------------

_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_READ_CHUNK = 1 << 20


class _ZstdReader(io.RawIOBase):
    """Streaming zstd decompression of a binary file, one compressed chunk at a time.

    Unlike ``zstandard``'s ``stream_reader``, which ends quietly at a cut, a stream that stops
    inside a frame raises ``EOFError`` (as ``gzip`` does), so a truncated file is reported.
    Concatenated frames (``pzstd`` output, appended files) are read one after the other.
    """

    def __init__(self, raw: IO[bytes]):
        self._raw = raw
        self._dctx = zstandard.ZstdDecompressor()
        self._obj = self._dctx.decompressobj()
        self._in_frame = False
        self._buf = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self._buf:
            chunk = self._raw.read(_READ_CHUNK)
            if not chunk:
                if self._in_frame:
                    raise EOFError("zstd stream ended inside a frame")
                return 0
            out = []
            while chunk:
                self._in_frame = True
                out.append(self._obj.decompress(chunk))
                chunk = b""
                if self._obj.eof:  # frame complete; what follows is the next frame
                    chunk = self._obj.unused_data
                    self._obj = self._dctx.decompressobj()
                    self._in_frame = False
            self._buf = memoryview(b"".join(out))
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


def _open_binary(path: Path) -> tuple[IO[bytes], str | None]:
    """Open for binary reading, decompressing by magic bytes: ``(stream, 'gzip' | 'zstd' | None)``.

    Raises:
        OSError: the file cannot be opened.
    """
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic[:2] == _GZIP_MAGIC:
        return gzip.open(path, "rb"), "gzip"
    if magic == _ZSTD_MAGIC:
        return io.BufferedReader(_ZstdReader(open(path, "rb")), buffer_size=_READ_CHUNK), "zstd"
    return open(path, "rb"), None


_STREAM_ERRORS = (EOFError, OSError, zlib.error, zstandard.ZstdError)
"""What reading a (decompressed) stream raises on a cut, corrupt or unreadable file."""


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _log_stream_error(skips: SkipLog, name: str, line: int | None, compression: str | None, e: BaseException) -> None:
    """Record why reading ``name`` stopped at ``line`` (the first line not read completely)."""
    if isinstance(e, EOFError):
        skips.add(name, line, f"truncated {compression or 'file'}",
                  "the stream ends before its end marker; the rest of the file is lost")
    elif compression and not isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError)):
        # zlib.error, gzip.BadGzipFile (an OSError) and ZstdError: bad compressed data.
        skips.add(name, line, f"corrupt {compression}", f"{_first_line(e)}; reading of the file stops here")
    else:
        skips.add(name, line, "unreadable file", _first_line(e))


def _lines(f: IO[bytes], cap: int) -> Iterator[tuple[bytes | None, int]]:
    """``(content, size)`` per line of ``f``, the ``\\n`` removed; content is None when the line
    is longer than ``cap`` bytes (it is read through in chunks, never held whole)."""
    while True:
        line = f.readline(cap + 1)
        if not line:
            return
        if line.endswith(b"\n"):
            yield line[:-1], len(line) - 1
        elif len(line) <= cap:
            yield line, len(line)  # the last line, without a newline
        else:
            size = len(line)
            while line and not line.endswith(b"\n"):
                line = f.readline(_READ_CHUNK)
                size += len(line)
            yield None, size - (1 if line.endswith(b"\n") else 0)


def _too_large(skips: SkipLog, name: str, line: int | None, size: int, cap: int, what: str = "document") -> None:
    skips.add(name, line, "document too large", f"{what} of {size:,} bytes > data.max_document_bytes ({cap:,})")


# --------------------------------------------------------------------------------------------------
# Line-oriented and whole-file formats
# --------------------------------------------------------------------------------------------------


def _decode(data: bytes, name: str, first_line: int | None, skips: SkipLog) -> str | None:
    """Strict UTF-8 decode; on failure record the line of the first bad byte and return None."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = None if first_line is None else first_line + data.count(b"\n", 0, e.start)
        skips.add(name, line, "invalid UTF-8", f"byte 0x{data[e.start]:02x} at offset {e.start}")
        return None


def _record_document(text: str, name: str, line: int, meta: dict) -> Document:
    """A record's Document: its non-empty string ``id`` (taken out of ``meta``) or ``name:line``."""
    doc_id = meta.get("id")
    if isinstance(doc_id, str) and doc_id:
        del meta["id"]
    else:
        doc_id = f"{name}:{line}"
    return Document(text=text, source_file=name, line=line, doc_id=doc_id, meta=meta)


def _jsonl_record(raw: bytes, name: str, lineno: int, text_field: str, skips: SkipLog) -> Document | None:
    if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]  # a UTF-8 byte-order mark (Windows editors write one): not part of the record
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        skips.add(name, lineno, "invalid UTF-8", f"byte 0x{raw[e.start]:02x} at column {e.start + 1}")
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        skips.add(name, lineno, "malformed JSON", e.msg)
        return None
    if not isinstance(obj, dict):
        skips.add(name, lineno, "not a JSON object", type(obj).__name__)
        return None
    if text_field not in obj:
        skips.add(name, lineno, "missing text field", repr(text_field))
        return None
    text = obj.pop(text_field)
    if not isinstance(text, str):
        skips.add(name, lineno, "text field not a string", f"{text_field!r} is {type(text).__name__}")
        return None
    return _record_document(text, name, lineno, obj)


def _iter_jsonl(path: Path, name: str, text_field: str, cap: int, skips: SkipLog) -> Iterator[Document]:
    stream, compression = _open_binary(path)
    with stream:
        lineno = 0
        try:
            for content, size in _lines(stream, cap):
                lineno += 1
                if content is None:
                    _too_large(skips, name, lineno, size, cap, "record")
                elif content.strip():  # blank lines (e.g. a trailing newline) are not records
                    doc = _jsonl_record(content, name, lineno, text_field, skips)
                    if doc is not None:
                        yield doc
        except _STREAM_ERRORS as e:
            _log_stream_error(skips, name, lineno + 1, compression, e)


def _iter_paragraphs(path: Path, name: str, cap: int, skips: SkipLog) -> Iterator[Document]:
    stream, compression = _open_binary(path)
    with stream:
        parts: list[bytes] = []  # lines of the current paragraph (dropped once it is over cap)
        start = size = 0  # first line (1-based, 0 = no paragraph open) and bytes of the paragraph
        lineno = 0

        def finish() -> Document | None:
            if size > cap:
                _too_large(skips, name, start, size, cap, "paragraph")
                return None
            text = _decode(b"\n".join(parts), name, start, skips)
            return None if text is None else Document(text=text, source_file=name, line=start, doc_id=f"{name}:{start}")

        try:
            for content, n in _lines(stream, cap):
                lineno += 1
                if content is not None and not content.strip():  # blank line: ends a paragraph
                    if start and (doc := finish()) is not None:
                        yield doc
                    parts, start, size = [], 0, 0
                    continue
                if not start:
                    start = lineno
                size += n + (1 if lineno > start else 0)
                if content is not None and size <= cap:
                    parts.append(content)
                else:
                    parts = []
        except _STREAM_ERRORS as e:
            _log_stream_error(skips, name, lineno + 1, compression, e)  # the open paragraph is lost
            return
        if start and (doc := finish()) is not None:
            yield doc


def _read_limited(f: IO[bytes], cap: int) -> tuple[bytes | None, int]:
    """``(data, size)`` of the rest of ``f``; data is None when it is over ``cap`` bytes (counted, not kept)."""
    chunks, size = [], 0
    while chunk := f.read(_READ_CHUNK):
        size += len(chunk)
        if size <= cap:
            chunks.append(chunk)
        else:
            chunks = []
    return (b"".join(chunks) if size <= cap else None), size


def _iter_text(path: Path, name: str, cap: int, skips: SkipLog) -> Iterator[Document]:
    stream, compression = _open_binary(path)
    with stream:
        try:
            if compression is None and (size := os.fstat(stream.fileno()).st_size) > cap:
                data = None  # no need to read it
            else:
                data, size = _read_limited(stream, cap)
        except _STREAM_ERRORS as e:
            _log_stream_error(skips, name, None, compression, e)  # a partial file is not the document
            return
    if data is None:
        _too_large(skips, name, None, size, cap, "file")
        return
    text = _decode(data, name, 1, skips)
    if text is not None:
        yield Document(text=text, source_file=name, line=None, doc_id=name)


# --------------------------------------------------------------------------------------------------
# Columnar formats: Parquet and Arrow
# --------------------------------------------------------------------------------------------------

_BATCH_ROWS = 1024
"""Rows per record batch read from Parquet: a few MB of web text, so memory stays bounded."""


def iter_arrow_batches(path: str | os.PathLike) -> Iterator:
    """The record batches of an Arrow IPC file (memory-mapped), stream or file format.

    Hugging Face ``datasets`` (``save_to_disk``, cache files) writes the stream format; the file
    format (Feather v2) starts with ``ARROW1``. Batches are valid while the iteration runs.

    Raises:
        OSError, pyarrow.ArrowInvalid: the file cannot be mapped or is not (or no longer) valid Arrow
            (raised when the bad part is reached; earlier batches have been yielded).
    """
    import pyarrow as pa

    with pa.memory_map(str(path)) as src:
        if src.read(6) == b"ARROW1":
            src.seek(0)
            reader = pa.ipc.open_file(src)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)
        else:
            src.seek(0)
            yield from pa.ipc.open_stream(src)


def _is_text_type(t) -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    is_view = getattr(pa.types, "is_string_view", None)  # pyarrow >= 16
    return pa.types.is_string(t) or pa.types.is_large_string(t) or bool(is_view and is_view(t))


def _meta_conversion(t) -> str | None:
    """How a column goes into ``Document.meta``: 'as_is', 'str' (cast to string) or None (left out)."""
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    if _is_text_type(t) or pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_null(t):
        return "as_is"
    if pa.types.is_temporal(t) or pa.types.is_decimal(t):
        return "str"  # datetime/Decimal objects are not JSON values
    return None


def _pylist(arr, how: str) -> list:
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    if how == "str":
        arr = pc.cast(arr, pa.string())
    return arr.to_pylist()


def _texts(arr, name: str, row0: int, skips: SkipLog) -> list:
    """Python strings of a text column; a value with invalid UTF-8 is logged and becomes None."""
    try:
        return arr.to_pylist()
    except UnicodeDecodeError:  # Parquet and Arrow readers do not validate UTF-8
        out = []
        for j in range(len(arr)):
            try:
                out.append(arr[j].as_py())
            except UnicodeDecodeError as e:
                skips.add(name, row0 + j + 1, "invalid UTF-8", f"byte 0x{e.object[e.start]:02x} at offset {e.start}")
                out.append(None)
        return out


def _table_columns(schema, text_field: str) -> list[str]:
    """Columns to read: the text column (whatever its type, to report it), ``id`` and the metadata ones."""
    return [f.name for f in schema if f.name == text_field or f.name == "id" or _meta_conversion(f.type)]


def _iter_rows(batches: Iterable, schema, name: str, text_field: str, cap: int, skips: SkipLog, what: str) -> Iterator[Document]:
    """Documents from the record batches of one Parquet/Arrow file (``what`` names the format)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    text_type = schema.field(text_field).type
    meta_how = {f.name: _meta_conversion(f.type) for f in schema if f.name != text_field and _meta_conversion(f.type)}
    row0 = 0
    it = iter(batches)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as e:
            skips.add(name, row0 + 1, f"unreadable {what}", f"{_first_line(e)}; rows from here on are lost")
            return
        n = batch.num_rows
        if not n:
            continue
        if not _is_text_type(text_type):
            skips.add(name, row0 + 1, "text field not a string",
                      f"column {text_field!r} is {text_type}; rows {row0 + 1}-{row0 + n}", n=n)
            row0 += n
            continue
        arr = batch.column(text_field)
        if pa.types.is_dictionary(arr.type):
            arr = arr.dictionary_decode()
        sizes = pc.binary_length(arr).to_numpy(zero_copy_only=False)  # UTF-8 bytes, NaN for nulls
        big = sizes > cap
        null = arr.is_null().to_numpy(zero_copy_only=False)
        if big.any():  # drop them before they are copied into Python strings
            arr = pc.if_else(pa.array(big), pa.nulls(n, arr.type), arr)
        texts = _texts(arr, name, row0, skips)
        cols = {k: _pylist(batch.column(k), how) for k, how in meta_how.items()}
        for j in range(n):
            row = row0 + j + 1
            text = texts[j]
            if big[j]:
                _too_large(skips, name, row, int(sizes[j]), cap, "text")
                continue
            if null[j]:
                skips.add(name, row, "text field not a string", f"{text_field!r} is null")
                continue
            if text is None:
                continue  # invalid UTF-8, already logged
            yield _record_document(text, name, row, {k: v[j] for k, v in cols.items()})
        row0 += n


def _missing_column(skips: SkipLog, name: str, text_field: str, columns: list[str], n_rows: int) -> None:
    skips.add(name, None, "missing text field", f"no column {text_field!r} (columns: {', '.join(columns)}); {n_rows} rows",
              n=max(1, n_rows))


def _iter_parquet(path: Path, name: str, text_field: str, cap: int, skips: SkipLog) -> Iterator[Document]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)  # reads the footer: a cut file fails here
    except (pa.ArrowException, OSError) as e:
        skips.add(name, None, "unreadable Parquet", _first_line(e))
        return
    try:
        schema = pf.schema_arrow
        if text_field not in schema.names:
            _missing_column(skips, name, text_field, schema.names, pf.metadata.num_rows)
            return
        batches = pf.iter_batches(batch_size=_BATCH_ROWS, columns=_table_columns(schema, text_field))
        yield from _iter_rows(batches, schema, name, text_field, cap, skips, "Parquet")
    finally:
        pf.close()


def _iter_arrow(path: Path, name: str, text_field: str, cap: int, skips: SkipLog) -> Iterator[Document]:
    import pyarrow as pa

    batches = iter_arrow_batches(path)
    try:
        try:
            first = next(batches, None)  # opening happens on the first step
        except (pa.ArrowException, OSError) as e:
            skips.add(name, None, "unreadable Arrow", _first_line(e))
            return
        if first is None:
            return
        if text_field not in first.schema.names:
            n = first.num_rows
            try:
                for b in batches:
                    n += b.num_rows
            except (pa.ArrowException, OSError):
                pass  # the count is then a lower bound; the reason is the missing column
            _missing_column(skips, name, text_field, first.schema.names, n)
            return
        yield from _iter_rows(_chain(first, batches), first.schema, name, text_field, cap, skips, "Arrow")
    finally:
        batches.close()  # unmaps the file now rather than at garbage collection


def _chain(first, rest: Iterator) -> Iterator:
    yield first
    yield from rest


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


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
            yield from _iter_parquet(path, name, src.text_field, cap, skips)
            continue
        if fmt == "arrow":
            yield from _iter_arrow(path, name, src.text_field, cap, skips)
            continue
        if fmt not in ("jsonl", "paragraphs", "text"):
            raise DataError(f"data.sources: unknown format '{fmt}' for source '{src.name}'")
        try:
            if fmt == "jsonl":
                yield from _iter_jsonl(path, name, src.text_field, cap, skips)
            elif fmt == "paragraphs":
                yield from _iter_paragraphs(path, name, cap, skips)
            else:
                yield from _iter_text(path, name, cap, skips)
        except OSError as e:  # opening failed (permissions, vanished file); reading errors are handled inside
            skips.add(name, None, "unreadable file", _first_line(e))
