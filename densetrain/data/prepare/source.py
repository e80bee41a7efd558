"""One source of ``densetrain prepare``: read -> per-document map in workers -> dedup -> split ->
shards, provenance, removed documents and the manifest (steps 4-7 of :mod:`densetrain.data.prepare`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
import zlib
from collections import Counter
from pathlib import Path

import numpy as np

from densetrain.data.prepare.dedup import find_duplicates
from densetrain.data.prepare.filters.chain import FilterStats, filter_warnings
from densetrain.data.prepare.manifest import PREPARE_VERSION, fingerprint, log, up_to_date
from densetrain.data.prepare.process import CHUNK_BYTES, ProcessSpec, chunked, process_documents
from densetrain.data.prepare.readers.documents import SkipLog
from densetrain.data.prepare.readers.paths import estimated_text_bytes
from densetrain.data.prepare.readers.sources import iter_documents
from densetrain.data.shards import SHARD_MAX_TOKENS, SHARD_SUFFIXES, token_dtype, write_shard
from densetrain.data.tokenizer import Tokenizer
from densetrain.data.tokenizer.twin import checked_twins
from densetrain.fileio import atomic_write_bytes, atomic_write_json
from densetrain.progress import Progress
from densetrain.registry.filters import resolve_filter_names

HIGH_DUPLICATE_RATE = 0.3
"""Warn when dedup removes more than this fraction of a source (the recipe's post-mortem 7.1: a
duplicated corpus raised the loss; a high rate usually means an upstream bug, not real web text)."""
"""Warn when a filter's line rules cut more than this fraction of the characters it saw in kept documents."""


def _clear_split_dir(d: Path) -> None:
    """Remove shard files of an earlier run (a new run may write fewer shards)."""
    if d.is_dir():
        for f in d.iterdir():
            if f.is_file() and (f.name.endswith(SHARD_SUFFIXES)):
                f.unlink()


def discard_unfinished(src_dir: Path) -> None:
    """Remove the shards, provenance and removed-list of a source whose manifest is missing (a write that
    failed, e.g. on a full disk: they describe nothing and only take space). The finished chunks in
    ``.work`` stay, so the re-run resumes after them."""
    if (src_dir / "manifest.json").exists():
        return
    for split in ("train", "val"):
        _clear_split_dir(src_dir / split)
    for name in ("provenance.json", "removed.json"):
        (src_dir / name).unlink(missing_ok=True)


def _split(lens: np.ndarray, name: str, seed: int, val_fraction: float,
           max_val_tokens: int) -> tuple[list[int], list[int], bool]:
    """(train, val, over_cap): document indices in shuffled order.

    Val takes the first shuffled documents that fit in ``max_val_tokens`` until it holds
    ``round(val_fraction * n)`` documents (at least 1). When no document fits, the shortest one
    is used and ``over_cap`` is True. A single-document source has no val split.
    """
    n = len(lens)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    perm = rng.permutation(n).tolist()
    target = max(1, round(val_fraction * n)) if n >= 2 else 0
    val: list[int] = []
    used = 0
    for k in perm:
        if len(val) >= target:
            break
        if used + int(lens[k]) <= max_val_tokens:
            val.append(k)
            used += int(lens[k])
    over = False
    if target and not val:
        val = [int(np.argmin(lens))]
        over = True
    vs = set(val)
    return [k for k in perm if k not in vs], val, over


def source_params(src, cfg, token_size: int, decontam: dict | None, key: str) -> dict:
    """Everything that changes the output of a source besides its inputs and the tokenizer."""
    data = cfg.data
    return {
        "prepare_version": PREPARE_VERSION,
        "kind": src.kind,  # picks the 'auto' filters
        "format": src.format,
        "text_field": src.text_field,
        "val_fraction": data.val_fraction,
        "max_val_tokens": data.max_val_tokens,
        "seed": data.seed,
        "shard_max_tokens": SHARD_MAX_TOKENS,
        "token_size": token_size,
        "max_document_bytes": data.max_document_bytes,
        "fix_text": src.fix_text,
        "filters": list(src.filters),
        # Only the thresholds of the filters this source runs: tuning C4 must not redo the code source.
        "filter_params": {n: dataclasses.asdict(getattr(data.filters, n.removesuffix("_lines")))
                          for n in resolve_filter_names(src.filters, src.kind, f"{key}.filters")},
        "dedup": dataclasses.asdict(data.dedup) if src.dedup else None,
        "decontam": decontam,
    }


def _read_and_process(i, src, files, spec: ProcessSpec, corpus_dir: Path, pool, skips: SkipLog,
                      max_document_bytes: int, work_dir: Path):
    """Stream the source's documents through the worker map (resuming from ``work_dir``).

    Returns:
        ``(docs, results)``: every document read (for provenance) and the per-chunk
        :class:`ChunkResult` list in document order.
    """
    docs: list = []

    def texts():
        for doc in iter_documents(src, corpus_dir, skips, i, files, max_document_bytes):
            docs.append(doc)
            yield doc.text

    # Stale work of other parameters or inputs would never be used again.
    if work_dir.parent.is_dir():
        for d in work_dir.parent.iterdir():
            if d != work_dir:
                shutil.rmtree(d, ignore_errors=True)
    resumed = len(list(work_dir.glob("*.npz"))) if work_dir.is_dir() else 0
    if resumed:
        log(f"{src.name}: resuming after {resumed} finished chunks in {work_dir}")
    results = []
    # a bar on a terminal, a [prepare] line every 30 s in a log (densetrain.progress)
    n_docs = 0
    with Progress(estimated_text_bytes(files), f"{src.name}: clean/filter/dedup/tokenize", "B", log=log) as bar:
        for r in process_documents(spec, chunked(texts(), len, CHUNK_BYTES), pool, work_dir):
            results.append(r)
            n_docs += r.n_docs
            bar.update(r.bytes_in, f"{n_docs:,} documents")
    return docs, results


def _write_splits(src_dir: Path, arrays, lens: np.ndarray, order_by_split: dict, docs_kept, tok: Tokenizer,
                  token_size: int):
    """Write the train/val shards and return ``(splits, provenance)`` (see the module docstring);
    ``lens`` are the sizes of ``arrays``."""
    splits, provenance = {}, {}
    for split, order in order_by_split.items():
        d = src_dir / split
        d.mkdir(parents=True, exist_ok=True)
        _clear_split_dir(d)
        groups: list[list[int]] = []
        size = 0
        for k in order:
            if not groups or (size + lens[k] > SHARD_MAX_TOKENS and groups[-1]):
                groups.append([])
                size = 0
            groups[-1].append(k)
            size += int(lens[k])
        shards = []
        for j, g in enumerate(groups):
            info = write_shard(d / f"{j:06d}", [arrays[k] for k in g], token_size, tokenizer_name=tok.name)
            info["path"] = f"{split}/{info.pop('file')}"
            shards.append(info)
        splits[split] = {"dir": split, "tokens": int(lens[order].sum()) if order else 0,
                         "documents": len(order), "shards": shards}
        provenance[split] = _provenance([docs_kept[k] for k in order], [int(lens[k]) for k in order])
    return splits, provenance


def _provenance(docs, extra: list, extra_name: str = "tokens") -> dict:
    """Parallel lists (source_file index, line, doc_id, ``extra``) for ``docs``; ``files`` names the indices."""
    table: dict[str, int] = {}
    out = {
        "source_file": [table.setdefault(d.source_file, len(table)) for d in docs],
        "line": [d.line for d in docs],
        "doc_id": [d.doc_id for d in docs],
        extra_name: extra,
    }
    out["files"] = list(table)
    return out


def prepare_source(i, src, files, cfg, tok: Tokenizer, token_size: int, corpus_dir: Path, shards_dir: Path,
                    force: bool, decontam: dict | None, get_pool, verify: bool = False) -> dict:
    """Prepare source ``i`` (steps 4-7 of :mod:`densetrain.data.prepare`), or reuse its shards when its
    manifest is up to date (``verify``: hash every shard first; see :func:`up_to_date`)."""
    data = cfg.data
    src_dir = shards_dir / src.name
    manifest_path = src_dir / "manifest.json"
    inputs = fingerprint(files, corpus_dir)
    params = source_params(src, cfg, token_size, decontam, f"data.sources[{i}]")
    if not force and (prev := up_to_date(src_dir, tok, inputs, params, verify)) is not None:
        log(f"{src.name}: up to date ({prev['splits']['train']['tokens']:,} train tokens)")
        return {"status": "up-to-date" if prev["stats"]["documents_kept"] else "empty", "manifest": prev}

    t0 = time.time()
    if manifest_path.exists():
        manifest_path.unlink()  # from here on the old shards are no longer described
    spec = ProcessSpec(kind=src.kind, filters=list(src.filters), fix_text=src.fix_text, filter_params=data.filters,
                       dedup=data.dedup if src.dedup and (data.dedup.exact or data.dedup.near) else None,
                       decontam_path=decontam["index"] if decontam else None, tokenizer_spec=data.tokenizer,
                       shards_dir=str(shards_dir), token_dtype=token_dtype(token_size).str, key=f"data.sources[{i}]",
                       checked_twins=checked_twins() if tok.tiktoken_twin is not None else ())
    skips = SkipLog()
    key = hashlib.sha256(json.dumps([inputs, params, tok.sha256], sort_keys=True).encode()).hexdigest()[:16]
    work_dir = src_dir / ".work" / key
    docs, results = _read_and_process(i, src, files, spec, corpus_dir, get_pool(), skips,
                                      data.max_document_bytes, work_dir)
    t_map = time.time() - t0
    ids = Counter(d.doc_id for d in docs)
    repeated = [k for k, n in ids.items() if n > 1]
    if repeated:  # provenance and duplicate reasons name documents by id: say when an id is ambiguous
        log(f"{src.name}: WARNING {len(repeated):,} document ids occur more than once (e.g. {repeated[0]!r}); "
            "provenance by id is ambiguous for them (file and line still tell them apart)")

    # Gather the survivors of the map in document order.
    fstats = FilterStats()
    kept_idx, arrays, nbytes, keys, sigs, dropped, contaminated = [], [], [], [], [], [], []
    offset = bytes_in = 0
    for r in results:
        kept_idx.extend(offset + p for p in r.kept)
        arrays.extend(r.tokens)
        nbytes.extend(r.text_bytes)
        if r.keys is not None:
            keys.append(r.keys)
        if r.signatures is not None:
            sigs.append(r.signatures)
        dropped.extend((offset + p, why) for p, why in r.dropped)
        contaminated.extend((offset + p, *rest) for p, *rest in r.contaminated)
        fstats.merge(r.filter_stats)
        bytes_in += r.bytes_in
        offset += r.n_docs
    del results

    dedup_stats = None
    if spec.dedup is not None and kept_idx:
        dd = find_duplicates(np.concatenate(keys) if keys else None, np.concatenate(sigs) if sigs else None,
                             spec.dedup)
        dedup_stats = {**dd.stats, "bytes_removed": int(np.array(nbytes, dtype=np.int64)[~dd.keep].sum())}
        log(f"{src.name}: {dd.summary()}")
        if dd.stats["duplicate_rate"] > HIGH_DUPLICATE_RATE:
            log(f"{src.name}: WARNING {dd.stats['duplicate_rate']:.0%} of the documents were duplicates: check the "
                "source (repeated crawls or files?); they are removed, but the source is smaller than it looks")
        for j in np.flatnonzero(~dd.keep):
            kind = "exact" if dd.reason[j] == 1 else "near"
            dropped.append((kept_idx[j], f"duplicate:{kind}:{docs[kept_idx[int(dd.cluster[j])]].doc_id}"))
        sel = np.flatnonzero(dd.keep).tolist()
        kept_idx = [kept_idx[j] for j in sel]
        arrays = [arrays[j] for j in sel]
        nbytes = [nbytes[j] for j in sel]
    dropped.sort()
    docs_kept = [docs[k] for k in kept_idx]

    lens = np.array([a.size for a in arrays], dtype=np.int64)
    train, val, over = _split(lens, src.name, data.seed, data.val_fraction, data.max_val_tokens)
    splits, provenance = _write_splits(src_dir, arrays, lens, {"train": train, "val": val}, docs_kept, tok, token_size)
    prov_bytes = json.dumps({"format": "parallel lists in shard order; source_file indexes files", **provenance},
                            ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    atomic_write_bytes(src_dir / "provenance.json", prov_bytes)
    removed = _provenance([docs[k] for k, _ in dropped], [why for _, why in dropped], "reason")
    removed_bytes = json.dumps({"format": "parallel lists, one entry per removed document; reason is 'empty', "
                                "'<filter>:<rule>', 'contaminated:<task>' or 'duplicate:<exact|near>:<kept doc_id>'",
                                **removed}, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    atomic_write_bytes(src_dir / "removed.json", removed_bytes)
    reasons = Counter(why.split(":", 1)[0] if not why.startswith("duplicate:") else ":".join(why.split(":")[:2])
                      for _, why in dropped)
    n_bytes = int(sum(nbytes))
    manifest = {
        "format_version": 1,
        "source": {"name": src.name, "kind": src.kind, "long_docs": src.long_docs, "paths": list(src.paths),
                   "format": src.format, "text_field": src.text_field},
        "tokenizer": tok.identity(),
        "token_size": token_size,
        "dtype": token_dtype(token_size).name,
        "layout": "datatrove: <split>/NNNNNN.ds = flat little-endian token ids; .ds.index = uint64 LE "
                  "cumulative document end offsets (tokens) within the file; EOS ends every document",
        "params": params,
        "inputs": inputs,
        "splits": splits,
        "provenance": {"path": "provenance.json", "sha256": hashlib.sha256(prov_bytes).hexdigest()},
        "removed": {"path": "removed.json", "sha256": hashlib.sha256(removed_bytes).hexdigest()},
        "stats": {
            "documents_read": len(docs),
            "documents_kept": len(docs_kept),
            "bytes_read": bytes_in,
            "text_bytes": n_bytes,
            "removed": dict(sorted(reasons.items())),
            "empty_after_cleaning": reasons.get("empty", 0),
            "filters": fstats.to_dict(),
            "decontamination": _contamination_summary(contaminated, docs) if decontam else None,
            "dedup": dedup_stats,
            "skipped": skips.summary(),
            "val_over_token_cap": over,
        },
    }
    atomic_write_json(manifest_path, manifest)
    _warn_heavy_edits(src.name, fstats)
    shutil.rmtree(work_dir.parent, ignore_errors=True)  # the shards are final; the chunk results are not needed
    dt = time.time() - t0
    mbps = bytes_in / 1e6 / t_map if t_map > 0 else float("inf")
    if not docs_kept:
        log(f"{src.name}: WARNING no documents kept ({len(docs)} read, {skips.total} skipped, "
            f"removed {dict(reasons)}); no tokens written")
    else:
        log(f"{src.name}: {len(docs):,} read -> {len(docs_kept):,} kept ({_removal_line(reasons, dedup_stats)}); "
            f"{n_bytes / 1e6:.1f} MB -> {splits['train']['tokens']:,} train / {splits['val']['tokens']:,} val tokens; "
            f"{mbps:.1f} MB/s; {skips.total} skipped [{dt:.1f}s]")
    return {"status": "prepared" if docs_kept else "empty", "manifest": manifest,
            "timings": {"process_s": round(t_map, 2), "total_s": round(dt, 2), "process_MBps": round(mbps, 2)}}


def _warn_heavy_edits(name: str, fstats) -> None:
    """Filters that remove or edit more than 5% of a source (line rules shred hard-wrapped text while
    keeping the document, so nothing shows in removed.json): say it in the log, naming the top rules."""
    for line in filter_warnings(fstats, name):
        log(f"{name}: WARNING {line}")


def _removal_line(reasons: Counter, dedup_stats: dict | None) -> str:
    parts = [f"{k} {v:,}" for k, v in sorted(reasons.items())]
    if dedup_stats:
        parts.append(f"duplicate rate {dedup_stats['duplicate_rate']:.1%}")
    return ", ".join(parts) or "nothing removed"


def _contamination_summary(contaminated: list, docs: list, keep: int = 20) -> dict:
    """Counts per task and the first ``keep`` removals with the matched n-gram."""
    per_task = Counter(task for _, task, _, _ in contaminated)
    return {
        "documents_removed": len(contaminated),
        "per_task": dict(sorted(per_task.items())),
        "examples": [{"doc_id": docs[k].doc_id, "task": task, "example": int(ex), "ngram": ngram}
                     for k, task, ex, ngram in contaminated[:keep]],
    }
