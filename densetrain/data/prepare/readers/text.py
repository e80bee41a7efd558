"""Readers of the line-oriented and whole-file formats (``jsonl``, ``paragraphs``, ``text``), with
transparent gzip/zstd decompression.

Compressed files are decompressed as a stream, detected by their magic bytes (``1f 8b``,
``28 b5 2f fd``) so the extension does not matter. Every reader yields
:class:`~densetrain.data.prepare.readers.documents.Document` s and records what it skips in a
:class:`~densetrain.data.prepare.readers.documents.SkipLog` (rules: :mod:`densetrain.data.prepare.readers.sources`).

Invalid UTF-8. A JSONL record with an invalid byte is dropped whole: its line IS the record, and a
record whose bytes are damaged cannot be trusted to hold the text it was meant to. In ``text`` and
``paragraphs`` files only the LINE holding the bad byte is dropped (logged as ``file:line``) and the
rest of the document is kept: the file or paragraph is the document, one stray byte (a Latin-1
``\xe9`` pasted into a UTF-8 page) should not lose the thousands of good lines around it, and the
line is the smallest unit the log can name. UTF-8 never uses byte 0x0a inside a multi-byte
character, so splitting at ``\n`` cannot cut a valid character.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import zlib
from pathlib import Path
from typing import IO, Iterator

import zstandard

from densetrain.data.prepare.readers.documents import Document, SkipLog, first_line, log_too_large, record_document
from densetrain.fileio import open_regular

_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_READ_CHUNK = 1 << 20
_BOM = b"\xef\xbb\xbf"
"""A UTF-8 byte-order mark (Windows editors write one at the start of a file): not part of any document. ftfy
removes it, but a source with ``fix_text = false`` kept it as the first character of its first document."""


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
    with open_regular(path) as f:  # a regular file: a FIFO or a link to /dev/zero is refused (fileio)
        magic = f.read(4)
    if magic[:2] == _GZIP_MAGIC:
        return gzip.open(path, "rb"), "gzip"
    if magic == _ZSTD_MAGIC:
        return io.BufferedReader(_ZstdReader(open_regular(path)), buffer_size=_READ_CHUNK), "zstd"
    return open_regular(path), None


_STREAM_ERRORS = (EOFError, OSError, zlib.error, zstandard.ZstdError)
"""What reading a (decompressed) stream raises on a cut, corrupt or unreadable file."""


def _log_stream_error(skips: SkipLog, name: str, line: int | None, compression: str | None, e: BaseException) -> None:
    """Record why reading ``name`` stopped at ``line`` (the first line not read completely)."""
    if isinstance(e, EOFError):
        skips.add(name, line, f"truncated {compression or 'file'}",
                  "the stream ends before its end marker; the rest of the file is lost")
    elif compression and not isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError)):
        # zlib.error, gzip.BadGzipFile (an OSError) and ZstdError: bad compressed data.
        skips.add(name, line, f"corrupt {compression}", f"{first_line(e)}; reading of the file stops here")
    else:
        skips.add(name, line, "unreadable file", first_line(e))


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


def _decode_lines(data: bytes, name: str, first: int, skips: SkipLog) -> str | None:
    """Strict UTF-8 decode of ``data`` (lines ``first``, ``first + 1``, ... of ``name``), dropping every
    line that holds an invalid byte; each dropped line is logged as ``name:line``.

    Returns:
        The text of the good lines joined by ``\\n``, or None when every line was dropped.
    """
    try:
        return data.decode("utf-8")  # the common case: one pass, no copy per line
    except UnicodeDecodeError:
        pass
    kept = []
    for i, raw in enumerate(data.split(b"\n")):
        try:
            kept.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            detail = f"byte 0x{raw[e.start]:02x} at column {e.start + 1}; line dropped"
            skips.add(name, first + i, "invalid UTF-8", detail)
    return "\n".join(kept) if kept else None


# A JSON \\uXXXX escape of a UTF-16 surrogate (D800-DFFF): Python's json module joins a valid pair into one
# character and keeps a lone half as an unencodable str (orjson, as datatrove reads JSONL, refuses the record).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _jsonl_record(raw: bytes, name: str, lineno: int, text_field: str, skips: SkipLog) -> Document | None:
    if lineno == 1 and raw.startswith(_BOM):
        raw = raw[len(_BOM):]
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        skips.add(name, lineno, "invalid UTF-8", f"byte 0x{raw[e.start]:02x} at column {e.start + 1}")
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        skips.add(name, lineno, "malformed JSON", f"{e.msg} (column {e.colno})")
        return None
    except RecursionError:  # deeper than json recurses (~1000 levels): no document nests like that
        skips.add(name, lineno, "malformed JSON", "nested too deeply")
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
    if _SURROGATE_ESCAPE.search(line):  # JSON can spell half a UTF-16 pair; such text has no UTF-8 bytes
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # skipped like an invalid UTF-8 line: later stages could not write it
            skips.add(name, lineno, "unpaired surrogate", f"\\u{ord(text[e.start]):04x} at character "
                      f"{e.start + 1} of {text_field!r}")
            return None
    return record_document(text, name, lineno, obj)


def iter_jsonl(path: Path, name: str, text_field: str, cap: int, skips: SkipLog) -> Iterator[Document]:
    """One document per JSON-object line of ``path`` (``obj[text_field]``); ``name`` is its display
    name, ``cap`` the byte limit of a line; skipped records go to ``skips``.

    Raises:
        OSError: the file cannot be opened (reading errors are logged instead).
    """
    stream, compression = _open_binary(path)
    with stream:
        lineno = 0
        try:
            for content, size in _lines(stream, cap):
                lineno += 1
                if content is None:
                    log_too_large(skips, name, lineno, size, cap, "record")
                elif content.strip():  # blank lines (e.g. a trailing newline) are not records
                    doc = _jsonl_record(content, name, lineno, text_field, skips)
                    if doc is not None:
                        yield doc
        except _STREAM_ERRORS as e:
            _log_stream_error(skips, name, lineno + 1, compression, e)


def iter_paragraphs(path: Path, name: str, cap: int, skips: SkipLog) -> Iterator[Document]:
    """One document per run of non-blank lines of ``path``, ``line`` = its first line; ``cap`` bounds
    the bytes of a paragraph. A line with invalid UTF-8 is dropped from its paragraph (logged).

    Raises:
        OSError: the file cannot be opened (reading errors are logged instead).
    """
    stream, compression = _open_binary(path)
    with stream:
        parts: list[bytes] = []  # lines of the current paragraph (dropped once it is over cap)
        start = size = 0  # first line (1-based, 0 = no paragraph open) and bytes of the paragraph
        lineno = 0

        def finish() -> Document | None:
            if size > cap:
                log_too_large(skips, name, start, size, cap, "paragraph")
                return None
            data = b"\n".join(parts)
            # A CRLF file's paragraph kept its inner line ends as read, but its last line's \r is half of the
            # line end that closes it (it was kept: "para one\r").
            text = _decode_lines(data[:-1] if data.endswith(b"\r") else data, name, start, skips)
            return None if text is None else Document(text=text, source_file=name, line=start, doc_id=f"{name}:{start}")

        try:
            for content, n in _lines(stream, cap):
                lineno += 1
                if lineno == 1 and content is not None and content.startswith(_BOM):
                    content, n = content[len(_BOM):], n - len(_BOM)
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


def iter_text(path: Path, name: str, cap: int, skips: SkipLog) -> Iterator[Document]:
    """The whole of ``path`` as one document (``line`` None, ``doc_id`` = ``name``) unless it is over
    ``cap`` bytes. A line with invalid UTF-8 is dropped from the document (logged as ``name:line``);
    a file of which every line is dropped gives no document.

    Raises:
        OSError: the file cannot be opened (reading errors are logged instead).
    """
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
        log_too_large(skips, name, None, size, cap, "file")
        return
    text = _decode_lines(data[len(_BOM):] if data.startswith(_BOM) else data, name, 1, skips)
    if text is not None:
        yield Document(text=text, source_file=name, line=None, doc_id=name)
