"""When a prepared source is still valid: the fingerprint of its inputs and the test of its manifest
against inputs, parameters, tokenizer and shard files (``<shards_dir>/<source>/manifest.json``), shared
by :mod:`densetrain.data.prepare.source` and :mod:`densetrain.data.prepare.scale.folder`."""

from __future__ import annotations

from pathlib import Path

from densetrain.data.prepare.readers.paths import display_path
from densetrain.data.shards import check_shard_hashes
from densetrain.data.tokenizer import Tokenizer
from densetrain.errors import DataError
from densetrain.fileio import MAX_JSON_BYTES, atomic_write_json, read_json

PREPARE_VERSION = 2
"""Bumped when cleaning/splitting/layout changes, which invalidates existing manifests (2: BOS before
every Llama 3 document; `web` auto filters read as FineWeb's 2024 code)."""


def log(msg: str) -> None:
    """One ``[prepare]`` progress line."""
    print(f"[prepare] {msg}", flush=True)


def fingerprint(files: list[Path], corpus_dir: Path) -> list[dict]:
    """``[{'path', 'size', 'mtime_ns'}]`` of the input files (path as in provenance): what a manifest
    records of its inputs, compared on every run to decide whether the source is up to date."""
    out = []
    for f in files:
        st = f.stat()
        out.append({"path": display_path(f, corpus_dir), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def shards_intact(src_dir: Path, manifest: dict) -> bool:
    ts = manifest.get("token_size")
    for split in manifest.get("splits", {}).values():
        for sh in split.get("shards", []):
            ds = src_dir / sh["path"]
            idx = ds.with_name(ds.name + ".index")
            if not (ds.is_file() and idx.is_file()) or ds.stat().st_size != sh["tokens"] * ts:
                return False
            if idx.stat().st_size != sh["documents"] * 8:
                return False
    return True


def up_to_date(src_dir: Path, tok: Tokenizer, inputs: list, params: dict, verify: bool = False) -> dict | None:
    """The previous manifest of a source when it still describes these inputs, params and shards.

    The shard files are checked against the manifest's sha256s (:func:`check_shard_hashes`: only the
    files whose mtime changed, or all with ``verify``); a mismatch is logged in one line naming the
    shard and the source is redone. New mtimes of intact files are recorded in the manifest.
    """
    manifest = src_dir / "manifest.json"
    try:
        prev = read_json(manifest, MAX_JSON_BYTES)  # a regular file; a few MB for thousands of shards
    except (OSError, ValueError):
        return None
    if not isinstance(prev, dict):
        return None
    same = (prev.get("tokenizer", {}).get("sha256") == tok.sha256 and prev.get("inputs") == inputs
            and prev.get("params") == params)
    if not (same and shards_intact(src_dir, prev)):
        return None
    try:
        updated = sum(check_shard_hashes(src_dir, split.get("shards", []), manifest, full=verify, record=True)
                      for split in prev.get("splits", {}).values())
    except DataError as e:
        log(f"{e}; preparing the source again")
        return None
    if updated:
        atomic_write_json(manifest, prev)
    return prev
