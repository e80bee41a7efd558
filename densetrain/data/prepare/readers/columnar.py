"""Readers of the columnar formats: Parquet (``pyarrow.parquet.ParquetFile.iter_batches``, a batch of
rows at a time; only the text, ``id`` and scalar columns are read) and Arrow IPC files (stream format
as written by Hugging Face ``datasets``, or file format / Feather v2).

One document per row: the text column is ``text_field``; a string ``id`` column becomes the document
id; the other scalar columns go to ``Document.meta`` (booleans, numbers and strings as they are,
dates, times and decimals as strings; nested and binary columns are not read). Skips (rules:
:mod:`densetrain.data.prepare.readers.sources`) are logged with the row as the line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from densetrain.data.prepare.readers.documents import Document, SkipLog, first_line, log_too_large, record_document

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
    if pa.types.is_dictionary(t):
        t = t.value_type
    is_view = getattr(pa.types, "is_string_view", None)  # pyarrow >= 16
    return pa.types.is_string(t) or pa.types.is_large_string(t) or bool(is_view and is_view(t))


def _meta_conversion(t) -> str | None:
    """How a column goes into ``Document.meta``: 'as_is', 'str' (cast to string) or None (left out)."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    if _is_text_type(t) or any(f(t) for f in (pa.types.is_integer, pa.types.is_floating, pa.types.is_boolean,
                                              pa.types.is_null)):
        return "as_is"
    if pa.types.is_temporal(t) or pa.types.is_decimal(t):
        return "str"  # datetime/Decimal objects are not JSON values
    return None


def _pylist(arr, how: str) -> list:
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


def _iter_rows(batches: Iterable, schema, name: str, text_field: str, cap: int, skips: SkipLog,
               what: str) -> Iterator[Document]:
    """Documents from the record batches of one Parquet/Arrow file (``what`` names the format)."""
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
            skips.add(name, row0 + 1, f"unreadable {what}", f"{first_line(e)}; rows from here on are lost")
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
                log_too_large(skips, name, row, int(sizes[j]), cap, "text")
                continue
            if null[j]:
                skips.add(name, row, "text field not a string", f"{text_field!r} is null")
                continue
            if text is None:
                continue  # invalid UTF-8, already logged
            yield record_document(text, name, row, {k: v[j] for k, v in cols.items()})
        row0 += n


def _missing_column(skips: SkipLog, name: str, text_field: str, columns: list[str], n_rows: int) -> None:
    skips.add(name, None, "missing text field",
              f"no column {text_field!r} (columns: {', '.join(columns)}); {n_rows} rows", n=max(1, n_rows))


def iter_parquet(path: Path, name: str, text_field: str, cap: int, skips: SkipLog) -> Iterator[Document]:
    """One document per row of a Parquet file (``name``: display name; ``cap``: bytes of a text value).

    Never raises for bad input: an unreadable file or batch is logged and reading of it stops.
    """
    try:
        pf = pq.ParquetFile(path)  # reads the footer: a cut file fails here
    except (pa.ArrowException, OSError) as e:
        skips.add(name, None, "unreadable Parquet", first_line(e))
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


def iter_arrow(path: Path, name: str, text_field: str, cap: int, skips: SkipLog) -> Iterator[Document]:
    """One document per row of an Arrow IPC file (:func:`iter_arrow_batches`), as :func:`iter_parquet`."""
    batches = iter_arrow_batches(path)
    try:
        try:
            first = next(batches, None)  # opening happens on the first step
        except (pa.ArrowException, OSError) as e:
            skips.add(name, None, "unreadable Arrow", first_line(e))
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
