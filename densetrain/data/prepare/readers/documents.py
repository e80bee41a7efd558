"""What the source readers produce: :class:`Document` (one raw document with its provenance) and
:class:`SkipLog` (the input records skipped, with ``file:line: reason``), plus the few helpers every
format reader shares to build one or to log why one was skipped."""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field


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
    told_rest: bool = False

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
        elif not self.told_rest:  # say once where the skips no longer printed are
            self.told_rest = True
            print(f"[data] skipped more records ({file} and others): each is counted, the first {self.keep} "
                  "named, in the source's manifest.json (stats.skipped)", file=sys.stderr)

    def merge(self, other: "SkipLog") -> None:
        """Add another log's counts and examples to this one."""
        self.counts.update(other.counts)
        self.examples.extend(other.examples[: max(0, self.keep - len(self.examples))])

    def summary(self) -> dict:
        """JSON-able summary: ``{'total': int, 'counts': {reason: n}, 'examples': [...]}``."""
        return {"total": self.total, "counts": dict(sorted(self.counts.items())), "examples": list(self.examples)}


def record_document(text: str, name: str, line: int, meta: dict) -> Document:
    """A record's Document: its non-empty string ``id`` (taken out of ``meta``) or ``name:line``."""
    doc_id = meta.get("id")
    if isinstance(doc_id, str) and doc_id:
        del meta["id"]
    else:
        doc_id = f"{name}:{line}"
    return Document(text=text, source_file=name, line=line, doc_id=doc_id, meta=meta)


def log_too_large(skips: SkipLog, name: str, line: int | None, size: int, cap: int, what: str = "document") -> None:
    """Record a document over ``data.max_document_bytes`` (``what``: the unit measured, e.g. ``'record'``)."""
    skips.add(name, line, "document too large", f"{what} of {size:,} bytes > data.max_document_bytes ({cap:,})")


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (pyarrow's run over several), else its type name."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
