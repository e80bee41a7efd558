"""Reading raw documents of one configured source (``data.sources[i]``).

A source names files, directories (walked recursively, sorted) or globs, relative to
``data.corpus_dir``. Each file is read in one of four formats:

* ``jsonl``: one JSON object per line; the document is ``obj[text_field]`` (a string). A string
  ``id`` field, when present, becomes the document id; other fields are ignored for now.
* ``text``: the whole file is one document.
* ``paragraphs``: documents are separated by one or more blank (whitespace-only) lines.
* ``auto``: ``.jsonl``, ``.jsonl.gz`` and ``.json.gz`` are jsonl, everything else is text.

Gzip-compressed files are decompressed transparently (detected by their magic bytes, so the
extension does not matter). Hidden files and directories (names starting with ``.``) and
``__pycache__`` directories are skipped when walking a directory: they are caches, temporaries
of atomic writes and markers.

Bad input is never fatal and never silently dropped: a malformed JSON line, a missing or
non-string text field, or invalid UTF-8 is recorded in a :class:`SkipLog` (``file:line: reason``)
and the reader moves on. A path that does not exist is fatal: :class:`DataError`.
"""

from __future__ import annotations

import glob as _glob
import gzip
import json
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator

from densetrain.config import SourceConfig


class DataError(ValueError):
    """A data problem (missing input, bad shard, tokenizer mismatch) with a one-line message."""


@dataclass(frozen=True)
class Document:
    """One raw document.

    Attributes:
        text: the document text, exactly as read (no cleaning).
        source_file: the input file, relative to ``corpus_dir`` when inside it, else absolute.
        line: 1-based line of the document start (jsonl row, first line of a paragraph);
            ``None`` for whole-file documents.
        doc_id: a stable id: the jsonl ``id`` field when present, else ``source_file`` or
            ``source_file:line``.
    """

    text: str
    source_file: str
    line: int | None
    doc_id: str


@dataclass
class SkipLog:
    """Accumulates input records that were skipped, with the reason and location.

    ``counts`` maps a short reason class (``'malformed JSON'``, ``'invalid UTF-8'``, ...) to a
    count; ``examples`` keeps the first ``keep`` entries as ``'file:line: reason'`` strings.
    The first ``print_first`` entries are also printed to stderr as they happen, so that a
    user notices bad input without digging into the manifest.
    """

    keep: int = 20
    print_first: int = 5
    counts: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        """Number of skipped records."""
        return sum(self.counts.values())

    def add(self, file: str, line: int | None, kind: str, detail: str = "") -> None:
        """Record one skipped record: ``kind`` is the reason class, ``detail`` free text."""
        self.counts[kind] += 1
        where = f"{file}:{line}" if line is not None else file
        msg = f"{where}: {kind}{': ' + detail if detail else ''}"
        if len(self.examples) < self.keep:
            self.examples.append(msg)
        if self.total <= self.print_first:
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


def _walk(directory: Path) -> list[Path]:
    """All regular files under ``directory``, recursively, sorted, skipping hidden names and __pycache__."""
    out = []
    for root, dirs, files in os.walk(directory, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        for f in sorted(files):
            if not f.startswith("."):
                out.append(Path(root) / f)
    return sorted(out)


def resolve_paths(src: SourceConfig, corpus_dir: Path, source_index: int | None = None) -> list[Path]:
    """Expand ``src.paths`` into the sorted, de-duplicated list of input files.

    Relative paths are resolved against ``corpus_dir``; ``~`` is expanded. Directories are walked
    recursively (sorted; hidden names and ``__pycache__`` skipped); globs support ``**``.

    Raises:
        DataError: a path (or glob) matches nothing, or ``src.paths`` is empty.
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
    """``path`` relative to ``corpus_dir`` when inside it (stable provenance), else absolute."""
    try:
        return str(Path(path).resolve().relative_to(Path(corpus_dir).resolve()))
    except ValueError:
        return str(Path(path).resolve())


def file_format(path: Path, fmt: str) -> str:
    """The effective format of one file: ``fmt`` unless it is ``'auto'`` (then by extension)."""
    if fmt != "auto":
        return fmt
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".json.gz")):
        return "jsonl"
    return "text"


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------


def _open_binary(path: Path) -> IO[bytes]:
    """Open for binary reading, decompressing gzip when the file starts with the gzip magic."""
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rb")
    return open(path, "rb")


def _read_all(path: Path) -> bytes:
    with _open_binary(path) as f:
        return f.read()


def _decode(data: bytes, name: str, first_line: int | None, skips: SkipLog) -> str | None:
    """Strict UTF-8 decode; on failure record the line of the first bad byte and return None."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = None if first_line is None else first_line + data.count(b"\n", 0, e.start)
        skips.add(name, line, "invalid UTF-8", f"byte 0x{data[e.start]:02x} at offset {e.start}")
        return None


def _iter_jsonl(path: Path, name: str, text_field: str, skips: SkipLog) -> Iterator[Document]:
    with _open_binary(path) as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue  # blank lines (e.g. a trailing newline) are not records
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                skips.add(name, lineno, "invalid UTF-8", f"byte 0x{raw[e.start]:02x} at column {e.start + 1}")
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                skips.add(name, lineno, "malformed JSON", e.msg)
                continue
            if not isinstance(obj, dict):
                skips.add(name, lineno, "not a JSON object", type(obj).__name__)
                continue
            if text_field not in obj:
                skips.add(name, lineno, "missing text field", repr(text_field))
                continue
            text = obj[text_field]
            if not isinstance(text, str):
                skips.add(name, lineno, "text field not a string", f"{text_field!r} is {type(text).__name__}")
                continue
            doc_id = obj.get("id")
            if not isinstance(doc_id, str) or not doc_id:
                doc_id = f"{name}:{lineno}"
            yield Document(text=text, source_file=name, line=lineno, doc_id=doc_id)


def _iter_paragraphs(path: Path, name: str, skips: SkipLog) -> Iterator[Document]:
    data = _read_all(path)
    lines = data.split(b"\n")
    start = None  # index of the first line of the current paragraph
    for i in range(len(lines) + 1):
        blank = i == len(lines) or not lines[i].strip()
        if not blank and start is None:
            start = i
        elif blank and start is not None:
            text = _decode(b"\n".join(lines[start:i]), name, start + 1, skips)
            if text is not None:
                yield Document(text=text, source_file=name, line=start + 1, doc_id=f"{name}:{start + 1}")
            start = None


def iter_documents(
    src: SourceConfig,
    corpus_dir: Path,
    skips: SkipLog | None = None,
    source_index: int | None = None,
    files: list[Path] | None = None,
) -> Iterator[Document]:
    """Yield the raw documents of one source, file by file in sorted order.

    Args:
        src: the source config (paths, format, text_field).
        corpus_dir: base of relative paths.
        skips: where skipped records are logged (a fresh log is used, and lost, when None:
            pass one to see what was skipped).
        source_index: index of the source in ``data.sources`` (only for error messages).
        files: already-resolved input files (from :func:`resolve_paths`); resolved here if None.

    Raises:
        DataError: a configured path does not exist (raised before anything is yielded).
    """
    skips = skips if skips is not None else SkipLog()
    if files is None:
        files = resolve_paths(src, corpus_dir, source_index)
    for path in files:
        name = display_path(path, corpus_dir)
        fmt = file_format(path, src.format)
        if fmt == "jsonl":
            yield from _iter_jsonl(path, name, src.text_field, skips)
        elif fmt == "paragraphs":
            yield from _iter_paragraphs(path, name, skips)
        elif fmt == "text":
            text = _decode(_read_all(path), name, 1, skips)
            if text is not None:
                yield Document(text=text, source_file=name, line=None, doc_id=name)
        else:
            raise DataError(f"data.sources: unknown format '{fmt}' for source '{src.name}'")
