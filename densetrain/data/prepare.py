"""``densetrain prepare``: raw sources -> cleaned documents -> tokenizer -> token shards + manifests.

Steps (per source, in ``data.sources`` order):

1. (``data.demo_corpus``) build the demo corpus into ``data.corpus_dir``; with no sources
   configured, the demo sources (:func:`densetrain.data.corpus.demo_sources`) are used.
2. Tokenizer: ``data.tokenizer = 'bpe'`` trains a byte-level BPE of ``data.tokenizer_vocab_size``
   on a deterministic, source-balanced sample (:data:`BPE_SAMPLE_BYTES`) of cleaned documents the
   first time, saved as ``shards_dir/tokenizer.json``; otherwise tiktoken or a given tokenizer.json.
3. Decontamination index (``data.decontam``): the ``ngram``-word n-grams of the evaluation sets,
   built once and cached in ``shards_dir/.decontam`` (:mod:`densetrain.data.decontam`).
4. Per document, in ``data.workers`` processes (:mod:`densetrain.data.process`): read
   (:func:`densetrain.data.sources.iter_documents`; bad records are skipped and counted), clean
   (ftfy, NFC, strip; empty documents dropped), quality filters (``SourceConfig.filters``,
   :mod:`densetrain.data.filters`), decontamination, dedup key + MinHash signature, tokenize +
   EOS.
5. Deduplicate the survivors of each source (exact, then MinHash LSH; ``data.dedup``, per source
   ``SourceConfig.dedup``), keeping the first document of every cluster.
6. Shuffle the documents (seeded per source), hold out ``val_fraction`` of them (at least one,
   at most ``max_val_tokens`` tokens) for validation.
7. Write datatrove-layout shards and manifests::

       shards_dir/
         tokenizer.json            (bpe only) + tokenizer.train.json (its training parameters)
         manifest.json             summary of all sources + tokenizer identity
         <source>/manifest.json    tokenizer identity, inputs, params, per-split counts, shard sha256s
         <source>/provenance.json  per document, in shard order: source file, line, doc id, tokens
         <source>/removed.json     per removed document: source file, line, doc id, reason
         <source>/train/000000.ds  (+ .ds.index, .ds.metadata), 000001.ds, ... (<= 64 Mi tokens each)
         <source>/val/000000.ds    (+ .ds.index, .ds.metadata)

A source is skipped when its manifest matches the tokenizer hash, the input files (path, size,
mtime) and the parameters, unless ``force``. The manifest is deleted before a source is
rewritten and written last, so a crash never leaves a manifest describing other shards.

The BPE is trained once: it is retrained only when ``tokenizer.json`` is missing, when
``data.tokenizer_vocab_size`` changed, or with ``force`` — not when the corpus changes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
import zlib
from collections import Counter
from pathlib import Path

import numpy as np

from densetrain.data.corpus import build_demo_corpus, demo_sources, fair_shares
from densetrain.data.filters import FilterStats, clean_text
from densetrain.data.process import CHUNK_BYTES, ProcessSpec, chunked, process_documents, worker_pool
from densetrain.data.shards import token_dtype, token_size_for, write_shard
from densetrain.data.sources import SkipLog, display_path, iter_documents, resolve_paths
from densetrain.data.tokenizer import Tokenizer, load_tokenizer, train_bpe, usable_cpus
from densetrain.errors import DataError
from densetrain.fileio import atomic_write_bytes, atomic_write_json
from densetrain.registry.filters import resolve_filter_names

PREPARE_VERSION = 1
"""Bumped when cleaning/splitting/layout changes, which invalidates existing manifests."""
SHARD_MAX_TOKENS = 1 << 26
"""Max tokens per train shard file (64 Mi); a longer single document gets a shard of its own."""
BPE_SAMPLE_BYTES = 12_000_000
"""Bytes of text the BPE is trained on, shared evenly between sources."""

def _log(msg: str) -> None:
    print(f"[prepare] {msg}", flush=True)


def _progress(total: int, desc: str):
    from tqdm import tqdm

    # disable=None: a bar on a terminal, silence in logs (the [prepare] lines remain).
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=None, leave=False)


def _fingerprint(files: list[Path], corpus_dir: Path) -> list[dict]:
    out = []
    for f in files:
        st = f.stat()
        out.append({"path": display_path(f, corpus_dir), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def _estimated_bytes(files: list[Path]) -> int:
    # Compressed text is ~4x smaller (gzip, zstd, Parquet); only used to balance the BPE sample.
    return sum(f.stat().st_size * (4 if f.name.endswith((".gz", ".zst", ".parquet")) else 1) for f in files)


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------


def _bpe_sample(cfg, sources, inputs, corpus_dir: Path, budget: int) -> list[str]:
    """A deterministic training sample: each source gets an equal share of ``budget`` bytes
    (small sources are taken whole and leave the rest to others); documents are picked evenly
    through each source (error diffusion on bytes)."""
    est = [_estimated_bytes(inputs[s.name]) for s in sources]
    shares = fair_shares(est, budget)
    max_doc = cfg.data.max_document_bytes
    texts: list[str] = []
    for i, src in enumerate(sources):
        frac = min(1.0, shares[i] / max(1, est[i]))
        credit, used = 0.0, 0
        for doc in iter_documents(src, corpus_dir, SkipLog(print_first=0), i, inputs[src.name], max_doc):
            text = clean_text(doc.text)
            n = len(text.encode("utf-8"))
            credit += n * frac
            if text and n <= credit:
                texts.append(text)
                credit -= n
                used += n
            if used >= shares[i]:
                break
    return texts


def _get_tokenizer(cfg, sources, inputs, corpus_dir: Path, shards_dir: Path, force: bool, timings: dict) -> Tokenizer:
    data = cfg.data
    if data.tokenizer != "bpe":
        return load_tokenizer(data.tokenizer, shards_dir)
    path = shards_dir / "tokenizer.json"
    sidecar = shards_dir / "tokenizer.train.json"
    params = {"vocab_size": data.tokenizer_vocab_size}
    if path.is_file() and not force:
        try:
            prev = json.loads(sidecar.read_text())
        except (OSError, json.JSONDecodeError):
            prev = None
        if prev is None or prev.get("params") == params:
            _log(f"tokenizer: using the trained BPE {path}")
            return load_tokenizer("bpe", shards_dir)
        _log(f"tokenizer: data.tokenizer_vocab_size changed ({prev.get('params')} -> {params}); retraining")
    t0 = time.time()
    sample = _bpe_sample(cfg, sources, inputs, corpus_dir, BPE_SAMPLE_BYTES)
    nbytes = sum(len(t.encode("utf-8")) for t in sample)
    _log(f"tokenizer: training byte-level BPE, vocab {data.tokenizer_vocab_size}, on {len(sample)} docs / {nbytes / 1e6:.1f} MB")
    t1 = time.time()
    tok = train_bpe(sample, data.tokenizer_vocab_size, path, length=len(sample))
    timings["bpe_sample_s"] = round(t1 - t0, 2)
    timings["bpe_train_s"] = round(time.time() - t1, 2)
    atomic_write_json(sidecar, {"params": params, "sample_documents": len(sample), "sample_bytes": nbytes,
                                "sources": [s.name for s in sources], "sha256": tok.sha256})
    _log(f"tokenizer: trained in {time.time() - t1:.1f}s, vocab {tok.vocab_size}, saved {path}")
    return tok


def _decontam_index(cfg, shards_dir: Path, timings: dict) -> dict | None:
    """Build (or reuse from ``shards_dir/.decontam``) the n-gram index of the evaluation sets.

    Returns:
        None when ``data.decontam.enabled`` is false, else ``{'index': cache file, 'tasks',
        'ngram', 'sha256'}`` (the sha256 of the index goes into every source's params, so a
        changed index re-prepares the sources).
    """
    dc = cfg.data.decontam
    if not dc.enabled:
        return None
    from densetrain.data.decontam import build_index

    t0 = time.time()
    index = build_index(dc.tasks, dc.ngram, cache_dir=shards_dir / ".decontam")
    timings["decontam_index_s"] = round(time.time() - t0, 2)
    return {"index": str(index.path), "tasks": list(dc.tasks), "ngram": dc.ngram, "sha256": index.sha256}


def _check_model_vocab(cfg, vocab: int, what: str) -> None:
    if cfg.model.vocab_size < vocab:
        raise DataError(f"model.vocab_size ({cfg.model.vocab_size}) must be >= the tokenizer vocabulary ({vocab}, {what})")


# --------------------------------------------------------------------------------------------------
# One source
# --------------------------------------------------------------------------------------------------


def _shards_intact(src_dir: Path, manifest: dict) -> bool:
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


def _clear_split_dir(d: Path) -> None:
    """Remove shard files of an earlier run (a new run may write fewer shards)."""
    if d.is_dir():
        for f in d.iterdir():
            if f.is_file() and (f.name.endswith((".ds", ".ds.index", ".ds.metadata", ".ds.loss"))):
                f.unlink()


def _split(lens: np.ndarray, name: str, seed: int, val_fraction: float, max_val_tokens: int) -> tuple[list[int], list[int], bool]:
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


def _source_params(src, cfg, token_size: int, decontam: dict | None, key: str) -> dict:
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


def _up_to_date(src_dir: Path, tok: Tokenizer, inputs: list, params: dict) -> dict | None:
    """The previous manifest of a source when it still describes these inputs, params and shards."""
    try:
        prev = json.loads((src_dir / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    same = (prev.get("tokenizer", {}).get("sha256") == tok.sha256 and prev.get("inputs") == inputs
            and prev.get("params") == params)
    return prev if same and _shards_intact(src_dir, prev) else None


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
        _log(f"{src.name}: resuming after {resumed} finished chunks in {work_dir}")
    results = []
    with _progress(_estimated_bytes(files), f"{src.name}: clean/filter/dedup/tokenize") as bar:
        for r in process_documents(spec, chunked(texts(), len, CHUNK_BYTES), pool, work_dir):
            results.append(r)
            bar.update(r.bytes_in)
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


def _prepare_source(i, src, files, cfg, tok: Tokenizer, token_size: int, corpus_dir: Path, shards_dir: Path,
                    force: bool, decontam: dict | None, get_pool) -> dict:
    data = cfg.data
    src_dir = shards_dir / src.name
    manifest_path = src_dir / "manifest.json"
    inputs = _fingerprint(files, corpus_dir)
    params = _source_params(src, cfg, token_size, decontam, f"data.sources[{i}]")
    if not force and (prev := _up_to_date(src_dir, tok, inputs, params)) is not None:
        _log(f"{src.name}: up to date ({prev['splits']['train']['tokens']:,} train tokens)")
        return {"status": "up-to-date" if prev["stats"]["documents_kept"] else "empty", "manifest": prev}

    t0 = time.time()
    if manifest_path.exists():
        manifest_path.unlink()  # from here on the old shards are no longer described
    spec = ProcessSpec(kind=src.kind, filters=list(src.filters), fix_text=src.fix_text, filter_params=data.filters,
                       dedup=data.dedup if src.dedup and (data.dedup.exact or data.dedup.near) else None,
                       decontam_path=decontam["index"] if decontam else None, tokenizer_spec=data.tokenizer,
                       shards_dir=str(shards_dir), token_dtype=token_dtype(token_size).str, key=f"data.sources[{i}]")
    skips = SkipLog()
    key = hashlib.sha256(json.dumps([inputs, params, tok.sha256], sort_keys=True).encode()).hexdigest()[:16]
    work_dir = src_dir / ".work" / key
    docs, results = _read_and_process(i, src, files, spec, corpus_dir, get_pool(), skips,
                                      data.max_document_bytes, work_dir)
    t_map = time.time() - t0
    ids = Counter(d.doc_id for d in docs)
    repeated = [k for k, n in ids.items() if n > 1]
    if repeated:  # provenance and duplicate reasons name documents by id: say when an id is ambiguous
        _log(f"{src.name}: WARNING {len(repeated):,} document ids occur more than once (e.g. {repeated[0]!r}); "
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
        from densetrain.data.dedup import find_duplicates

        dd = find_duplicates(np.concatenate(keys) if keys else None, np.concatenate(sigs) if sigs else None,
                             spec.dedup)
        dedup_stats = {**dd.stats, "bytes_removed": int(np.array(nbytes, dtype=np.int64)[~dd.keep].sum())}
        _log(f"{src.name}: {dd.summary()}")
        if dd.stats["duplicate_rate"] > HIGH_DUPLICATE_RATE:
            _log(f"{src.name}: WARNING {dd.stats['duplicate_rate']:.0%} of the documents were duplicates: check the "
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
    removed_bytes = json.dumps({"format": "parallel lists, one entry per removed document; reason is "
                                "'empty', '<filter>:<rule>', 'contaminated:<task>' or 'duplicate:<exact|near>:<kept doc_id>'",
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
        _log(f"{src.name}: WARNING no documents kept ({len(docs)} read, {skips.total} skipped, removed {dict(reasons)}); "
             "no tokens written")
    else:
        _log(f"{src.name}: {len(docs):,} read -> {len(docs_kept):,} kept ({_removal_line(reasons, dedup_stats)}); "
             f"{n_bytes / 1e6:.1f} MB -> {splits['train']['tokens']:,} train / {splits['val']['tokens']:,} val tokens; "
             f"{mbps:.1f} MB/s; {skips.total} skipped [{dt:.1f}s]")
    return {"status": "prepared" if docs_kept else "empty", "manifest": manifest,
            "timings": {"process_s": round(t_map, 2), "total_s": round(dt, 2), "process_MBps": round(mbps, 2)}}


HIGH_DUPLICATE_RATE = 0.3
"""Warn when dedup removes more than this fraction of a source (the recipe's post-mortem 7.1: a
duplicated corpus raised the loss; a high rate usually means an upstream bug, not real web text)."""
HEAVY_EDIT_FRACTION = 0.2
"""Warn when a filter's line rules cut more than this fraction of the characters it saw in kept documents."""


def _warn_heavy_edits(name: str, fstats) -> None:
    """Line-level rules (C4's terminal punctuation) shred hard-wrapped text while keeping the
    document, so nothing shows in removed.json: say it in the log."""
    for flt, c in fstats.to_dict().items():
        dropped_chars = sum(r["chars"] for r in c["reasons"].values())
        kept_in = c["chars_in"] - dropped_chars
        cut = c["chars_removed"] - dropped_chars
        if kept_in > 0 and cut / kept_in > HEAVY_EDIT_FRACTION:
            _log(f"{name}: WARNING {flt} line rules cut {cut / kept_in:.0%} of the characters of the documents it kept "
                 f"({c['documents_modified']:,} edited; hard-wrapped text?); consider this source's filters without '{flt}'")


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


def _workers(data) -> int:
    """``data.workers``, where 0 means every CPU this process may use."""
    return data.workers if data.workers > 0 else usable_cpus()


# --------------------------------------------------------------------------------------------------
# Datatrove-tokenized sources (format = "datatrove"; densetrain/data/scale.py, docs/scale-out.md)
# --------------------------------------------------------------------------------------------------


def _register_datatrove_source(i, src, cfg, tok: Tokenizer, corpus_dir: Path, shards_dir: Path, force: bool) -> dict:
    """Check a folder of datatrove token files and describe it in ``<source>/manifest.json``.

    Nothing is copied or re-tokenized: training reads the folder in place (the split ``dir`` and
    shard ``path`` entries are absolute). The folder is ``src.paths[0]`` (relative to
    ``data.corpus_dir``). Splits: ``train/`` and ``val/`` subfolders as written by
    :func:`densetrain.data.scale.datatrove_pipeline`; otherwise the whole folder is train and the
    source has no val split (it is left out of the validation loss). Checks:
    :func:`densetrain.data.scale.check_datatrove_folder` (metadata, index, tokenizer identity,
    ids < model.vocab_size, EOS). Skipped when the files (size, mtime), the tokenizer and
    model.vocab_size are unchanged; unlike our own shards, no sha256 of the .ds files is taken
    (only of the indexes): the files are the producer's, and a full read is already spent on the
    vocabulary check.

    Raises:
        DataError: one line naming the file and the problem.
    """
    from densetrain.data.scale import IDENTITY_FILE, check_datatrove_folder, datatrove_split_dirs

    key = f"data.sources[{i}]"
    folder = Path(os.path.expanduser(src.paths[0]))
    folder = (folder if folder.is_absolute() else corpus_dir / folder).resolve()
    src_dir = shards_dir / src.name
    manifest_path = src_dir / "manifest.json"
    if not folder.is_dir():
        raise DataError(f"{folder}: not a folder of datatrove token files ({key}.paths, format 'datatrove')")
    files = [f for d in datatrove_split_dirs(folder).values() if d is not None for f in sorted(d.iterdir())
             if f.name.endswith((".ds", ".ds.index", ".ds.metadata"))]
    files += [folder / IDENTITY_FILE] if (folder / IDENTITY_FILE).is_file() else []
    inputs = _fingerprint(files, corpus_dir)
    params = {"prepare_version": PREPARE_VERSION, "format": "datatrove", "folder": str(folder),
              "model_vocab_size": cfg.model.vocab_size}
    if not force and (prev := _up_to_date(src_dir, tok, inputs, params)) is not None:
        _log(f"{src.name}: up to date (datatrove folder, {prev['splits']['train']['tokens']:,} train tokens)")
        return {"status": "up-to-date", "manifest": prev}
    if manifest_path.exists():
        manifest_path.unlink()
    checked = check_datatrove_folder(folder, tok, cfg.data.tokenizer, cfg.model.vocab_size, key)
    splits = {split: ({k: c[k] for k in ("dir", "tokens", "documents", "shards")} if c else
                      {"dir": split, "tokens": 0, "documents": 0, "shards": []})
              for split, c in checked.items()}
    token_size = checked["train"]["token_size"]
    documents = sum(sp["documents"] for sp in splits.values())
    manifest = {
        "format_version": 1,
        "source": {"name": src.name, "kind": src.kind, "long_docs": src.long_docs, "paths": list(src.paths),
                   "format": src.format},
        "tokenizer": tok.identity(),
        "token_size": token_size,
        "dtype": token_dtype(token_size).name,
        "layout": "datatrove folder registered in place: <dir>/*.ds read in sorted name order as one stream per "
                  "split; .ds.index = uint64 LE cumulative document ends; EOS ends every document",
        "params": params,
        "inputs": inputs,
        "splits": splits,
        "stats": {"documents_read": documents, "documents_kept": documents, "registered": True},
    }
    src_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(manifest_path, manifest)
    _log(f"{src.name}: registered datatrove folder {folder}: {splits['train']['tokens']:,} train / "
         f"{splits['val']['tokens']:,} val tokens, {documents:,} documents")
    return {"status": "registered", "manifest": manifest}


# --------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------


def prepare(cfg, force: bool = False) -> dict:
    """Prepare every configured source into token shards (see the module docstring for the layout).

    Args:
        cfg: a :class:`densetrain.config.Config` (reads ``cfg.data`` and ``cfg.model.vocab_size``).
        force: redo everything (BPE training included) even when manifests match.

    Returns:
        The summary: ``{'shards_dir', 'tokenizer': identity, 'token_size', 'sources': {name:
        {'status': 'prepared'|'up-to-date'|'empty', 'kind', 'long_docs', 'train': {'tokens',
        'documents', 'dir'}, 'val': {...}, 'manifest': path}}, 'timings': {...}}``; the same
        (without status/timings) is written to ``shards_dir/manifest.json``.

    Workers are spawned processes (``data.workers``): a script that calls this function must do so
    under ``if __name__ == "__main__":``, as for any ``multiprocessing`` spawn.

    Raises:
        DataError: no sources, a missing input path, a tokenizer problem, or
            ``model.vocab_size`` smaller than the tokenizer's vocabulary.
    """
    t0 = time.time()
    data = cfg.data
    corpus_dir, shards_dir = Path(data.corpus_dir), Path(data.shards_dir)
    timings: dict[str, float] = {}
    if data.demo_corpus:
        build_demo_corpus(corpus_dir)
        timings["corpus_s"] = round(time.time() - t0, 2)
    sources = list(data.sources) or (demo_sources() if data.demo_corpus else [])
    if not sources:
        raise DataError("data.sources is empty: configure at least one source (or set data.demo_corpus = true)")
    # Resolve every input before any heavy work, so a typo fails in a second.
    inputs = {src.name: resolve_paths(src, corpus_dir, i) for i, src in enumerate(sources)}
    if data.tokenizer == "bpe":
        _check_model_vocab(cfg, data.tokenizer_vocab_size, "data.tokenizer_vocab_size")
    shards_dir.mkdir(parents=True, exist_ok=True)
    tok = _get_tokenizer(cfg, [s for s in sources if s.format != "datatrove"], inputs, corpus_dir, shards_dir, force, timings)
    _check_model_vocab(cfg, tok.vocab_size, f"data.tokenizer='{data.tokenizer}'")
    token_size = token_size_for(tok.vocab_size)

    decontam = _decontam_index(cfg, shards_dir, timings)
    results = {}
    proc_bytes = proc_s = 0.0
    pool: list = []  # the worker pool, started by the first source that needs processing, shared by the rest

    def get_pool():
        if not pool:
            pool.append(worker_pool(_workers(data)))
        return pool[0]

    try:
        for i, src in enumerate(sources):
            if src.format == "datatrove":  # already tokenized: checked and registered, not re-tokenized
                r = _register_datatrove_source(i, src, cfg, tok, corpus_dir, shards_dir, force)
            else:
                r = _prepare_source(i, src, inputs[src.name], cfg, tok, token_size, corpus_dir, shards_dir, force,
                                    decontam, get_pool)
            results[src.name] = r
            if "timings" in r:
                proc_s += r["timings"]["process_s"]
                proc_bytes += r["manifest"]["stats"]["bytes_read"]
    finally:
        if pool and pool[0] is not None:
            pool[0].shutdown(cancel_futures=True)

    top_sources = {}
    for src in sources:
        m = results[src.name]["manifest"]
        top_sources[src.name] = {
            "kind": src.kind,
            "long_docs": src.long_docs,
            "manifest": f"{src.name}/manifest.json",
            # dir relative to shards_dir; an absolute dir (a registered datatrove folder) stays absolute
            **{split: {"dir": str(Path(src.name) / m["splits"][split]["dir"]), "tokens": m["splits"][split]["tokens"],
                       "documents": m["splits"][split]["documents"]} for split in ("train", "val")},
        }
    top = {
        "format_version": 1,
        "tokenizer": {"spec": data.tokenizer, **tok.identity()},
        "token_size": token_size,
        "dtype": token_dtype(token_size).name,
        "sources": top_sources,
        "totals": {
            "train_tokens": sum(s["train"]["tokens"] for s in top_sources.values()),
            "val_tokens": sum(s["val"]["tokens"] for s in top_sources.values()),
        },
    }
    atomic_write_json(shards_dir / "manifest.json", top)
    timings["process_s"] = round(proc_s, 2)
    if proc_s > 0:
        timings["process_MBps"] = round(proc_bytes / 1e6 / proc_s, 2)
    timings["total_s"] = round(time.time() - t0, 2)
    empty = [n for n, r in results.items() if r["status"] == "empty"]
    if empty:
        _log(f"WARNING sources without documents: {empty} (no shards; leave them out of stage mixes)")
    _log(f"done in {timings['total_s']:.1f}s: {top['totals']['train_tokens']:,} train tokens, "
         f"{top['totals']['val_tokens']:,} val tokens in {shards_dir}")
    summary = dict(top)
    summary["shards_dir"] = str(shards_dir)
    summary["sources"] = {n: {"status": results[n]["status"], **s, **({"timings": results[n]["timings"]} if "timings" in results[n] else {})}
                          for n, s in top_sources.items()}
    summary["timings"] = timings
    return summary
