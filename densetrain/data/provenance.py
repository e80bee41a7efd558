"""Which documents a token window came from: ``<source>/provenance.json`` (written by ``prepare``:
per document of each split, in shard order, its source file, line/row and id) against the shard
index's document boundaries. No per-step logging is needed: the deterministic sampler says which
windows a step trained on (``densetrain blame``), this module says whose text they are."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np

from densetrain.data.shards import TokenFiles
from densetrain.errors import DataError
from densetrain.fileio import MAX_JSON_BYTES
from densetrain.storage import exists, join, read_json


@lru_cache(maxsize=64)
def _table(path: str) -> dict:
    try:
        return read_json(path, MAX_JSON_BYTES)  # a regular file; too deep a nesting is a ReadRefused
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read provenance ({e}); re-run `densetrain prepare`") from None


def window_documents(shards_dir: str | Path, source: str, stream: TokenFiles, start: int, length: int,
                     split: str = "train") -> list[dict]:
    """The documents whose tokens lie in ``[start, start + length)`` of ``source``'s ``split`` stream.

    Returns:
        ``[{"source", "file", "line", "doc_id", "tokens": tokens of it inside the window}, ...]`` in
        stream order (``[]`` when the source has no provenance file, e.g. a registered datatrove folder).
    Raises:
        DataError: the provenance file is unreadable or does not match the shards.
    """
    path = join(shards_dir, source, "provenance.json")
    if not exists(path):
        return []
    table = _table(str(path)).get(split, {})
    ends = stream.doc_ends()
    if len(table.get("doc_id", [])) != len(ends):
        raise DataError(f"{path}: {len(table.get('doc_id', []))} documents but the {split} shards hold {len(ends)}; "
                        "re-run `densetrain prepare`")
    first = int(np.searchsorted(ends, start, side="right"))
    last = int(np.searchsorted(ends, start + length - 1, side="right"))
    out = []
    for k in range(first, min(last, len(ends) - 1) + 1):
        doc_start = int(ends[k - 1]) if k else 0
        inside = min(int(ends[k]), start + length) - max(doc_start, start)
        out.append({"source": source, "file": table["files"][table["source_file"][k]], "line": table["line"][k],
                    "doc_id": table["doc_id"][k], "tokens": inside})
    return out
