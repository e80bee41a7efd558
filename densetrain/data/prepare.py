"""``densetrain prepare``: raw sources -> cleaned documents -> tokenizer -> token shards + manifests.

Steps (per source, in ``data.sources`` order):

1. (``data.demo_corpus``) build the demo corpus into ``data.corpus_dir``; with no sources
   configured, the demo sources (:func:`densetrain.data.corpus.demo_sources`) are used.
2. Read documents (:func:`densetrain.data.sources.iter_documents`); bad records are skipped and
   counted. Minimal cleaning: Unicode NFC, strip surrounding whitespace, drop empty documents.
3. Tokenizer: ``data.tokenizer = 'bpe'`` trains a byte-level BPE of ``data.tokenizer_vocab_size``
   on a deterministic, source-balanced sample (:data:`BPE_SAMPLE_BYTES`) the first time, saved
   as ``shards_dir/tokenizer.json``; otherwise tiktoken or a given tokenizer.json.
4. Tokenize (batched, parallel), append EOS to every document.
5. Shuffle the documents (seeded per source), hold out ``val_fraction`` of them (at least one,
   at most ``max_val_tokens`` tokens) for validation.
6. Write datatrove-layout shards and manifests::

       shards_dir/
         tokenizer.json            (bpe only) + tokenizer.train.json (its training parameters)
         manifest.json             summary of all sources + tokenizer identity
         <source>/manifest.json    tokenizer identity, inputs, params, per-split counts, shard sha256s
         <source>/provenance.json  per document, in shard order: source file, line, doc id, tokens
         <source>/train/000000.ds  (+ .ds.index, .ds.metadata), 000001.ds, ... (<= 64 Mi tokens each)
         <source>/val/000000.ds    (+ .ds.index, .ds.metadata)

A source is skipped when its manifest matches the tokenizer hash, the input files (path, size,
mtime) and the parameters, unless ``force``. The manifest is deleted before a source is
rewritten and written last, so a crash never leaves a manifest describing other shards.

The BPE is trained once: it is retrained only when ``tokenizer.json`` is missing, when
``data.tokenizer_vocab_size`` changed, or with ``force`` — not when the corpus changes.
"""

from __future__ import annotations

import hashlib
import json
import time
import unicodedata
import zlib
from pathlib import Path

import numpy as np

from densetrain.data.corpus import build_demo_corpus, demo_sources, fair_shares
from densetrain.data.shards import token_dtype, token_size_for, write_shard
from densetrain.data.sources import DataError, SkipLog, display_path, iter_documents, resolve_paths
from densetrain.data.tokenizer import Tokenizer, load_tokenizer, train_bpe
from densetrain.io import atomic_write_bytes, atomic_write_json

PREPARE_VERSION = 1
"""Bumped when cleaning/splitting/layout changes, which invalidates existing manifests."""
SHARD_MAX_TOKENS = 1 << 26
"""Max tokens per train shard file (64 Mi); a longer single document gets a shard of its own."""
BPE_SAMPLE_BYTES = 12_000_000
"""Bytes of text the BPE is trained on, shared evenly between sources."""
TOKENIZE_CHUNK_BYTES = 4_000_000
"""Bytes of text per encode_batch call: big enough for the thread pool, small enough for progress."""


def clean_text(text: str) -> str:
    """The minimal cleaning applied to every document: Unicode NFC, then strip whitespace at both ends."""
    return unicodedata.normalize("NFC", text).strip()


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
    # gzip text compresses ~4x; only used to balance the BPE sample.
    return sum(f.stat().st_size * (4 if f.name.endswith(".gz") else 1) for f in files)


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------


def _bpe_sample(sources, inputs, corpus_dir: Path, budget: int) -> list[str]:
    """A deterministic training sample: each source gets an equal share of ``budget`` bytes
    (small sources are taken whole and leave the rest to others); documents are picked evenly
    through each source (error diffusion on bytes)."""
    est = [_estimated_bytes(inputs[s.name]) for s in sources]
    shares = fair_shares(est, budget)
    texts: list[str] = []
    for i, src in enumerate(sources):
        frac = min(1.0, shares[i] / max(1, est[i]))
        credit, used = 0.0, 0
        for doc in iter_documents(src, corpus_dir, SkipLog(print_first=0), i, inputs[src.name]):
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
    sample = _bpe_sample(sources, inputs, corpus_dir, BPE_SAMPLE_BYTES)
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


def _tokenize(tok: Tokenizer, texts: list[str], dtype: np.dtype, name: str) -> tuple[list[np.ndarray], float]:
    """Token arrays (EOS appended) of ``texts`` and the seconds spent."""
    out: list[np.ndarray] = []
    total = sum(len(t) for t in texts)  # characters: a cheap stand-in for bytes in the progress bar
    t0 = time.time()
    with _progress(total, f"tokenize {name}") as bar:
        i = 0
        while i < len(texts):
            j, size = i, 0
            while j < len(texts) and (size < TOKENIZE_CHUNK_BYTES or j == i):
                size += len(texts[j])
                j += 1
            for ids in tok.encode_batch(texts[i:j]):
                a = np.empty(len(ids) + 1, dtype=dtype)
                a[:-1] = ids
                a[-1] = tok.eos_id
                out.append(a)
            bar.update(size)
            i = j
    return out, time.time() - t0


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


def _prepare_source(i, src, files, cfg, tok: Tokenizer, token_size: int, corpus_dir: Path, shards_dir: Path, force: bool) -> dict:
    data = cfg.data
    src_dir = shards_dir / src.name
    manifest_path = src_dir / "manifest.json"
    inputs = _fingerprint(files, corpus_dir)
    params = {
        "prepare_version": PREPARE_VERSION,
        "format": src.format,
        "text_field": src.text_field,
        "val_fraction": data.val_fraction,
        "max_val_tokens": data.max_val_tokens,
        "seed": data.seed,
        "shard_max_tokens": SHARD_MAX_TOKENS,
        "token_size": token_size,
    }
    if manifest_path.is_file() and not force:
        try:
            prev = json.loads(manifest_path.read_text())
        except (OSError, json.JSONDecodeError):
            prev = {}
        if (
            prev.get("tokenizer", {}).get("sha256") == tok.sha256
            and prev.get("inputs") == inputs
            and prev.get("params") == params
            and _shards_intact(src_dir, prev)
        ):
            _log(f"{src.name}: up to date ({prev['splits']['train']['tokens']:,} train tokens)")
            return {"status": "up-to-date" if prev["stats"]["documents_kept"] else "empty", "manifest": prev}

    t0 = time.time()
    if manifest_path.exists():
        manifest_path.unlink()  # from here on the old shards are no longer described
    skips = SkipLog()
    docs, texts = [], []
    n_read = n_empty = n_bytes = 0
    for doc in iter_documents(src, corpus_dir, skips, i, files):
        n_read += 1
        text = clean_text(doc.text)
        if not text:
            n_empty += 1
            continue
        docs.append(doc)
        texts.append(text)
        n_bytes += len(text.encode("utf-8"))
    t_read = time.time() - t0
    dtype = token_dtype(token_size)
    arrays, t_tok = _tokenize(tok, texts, dtype, src.name)
    del texts
    lens = np.array([a.size for a in arrays], dtype=np.int64)
    train, val, over = _split(lens, src.name, data.seed, data.val_fraction, data.max_val_tokens)

    splits, provenance = {}, {}
    for split, order in (("train", train), ("val", val)):
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
        splits[split] = {
            "dir": split,
            "tokens": int(lens[order].sum()) if order else 0,
            "documents": len(order),
            "shards": shards,
        }
        table: dict[str, int] = {}
        provenance[split] = {
            "source_file": [table.setdefault(docs[k].source_file, len(table)) for k in order],
            "line": [docs[k].line for k in order],
            "doc_id": [docs[k].doc_id for k in order],
            "tokens": [int(lens[k]) for k in order],
        }
        provenance[split]["files"] = list(table)
    prov_bytes = json.dumps({"format": "parallel lists in shard order; source_file indexes files", **provenance},
                            ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    atomic_write_bytes(src_dir / "provenance.json", prov_bytes)
    manifest = {
        "format_version": 1,
        "source": {"name": src.name, "kind": src.kind, "long_docs": src.long_docs, "paths": list(src.paths),
                   "format": src.format, "text_field": src.text_field},
        "tokenizer": tok.identity(),
        "token_size": token_size,
        "dtype": "uint16" if token_size == 2 else "uint32",
        "layout": "datatrove: <split>/NNNNNN.ds = flat little-endian token ids; .ds.index = uint64 LE "
                  "cumulative document end offsets (tokens) within the file; EOS ends every document",
        "params": params,
        "inputs": inputs,
        "splits": splits,
        "provenance": {"path": "provenance.json", "sha256": hashlib.sha256(prov_bytes).hexdigest()},
        "stats": {
            "documents_read": n_read,
            "documents_kept": len(docs),
            "empty_after_cleaning": n_empty,
            "text_bytes": n_bytes,
            "skipped": skips.summary(),
            "val_over_token_cap": over,
        },
    }
    atomic_write_json(manifest_path, manifest)
    dt = time.time() - t0
    mbps = n_bytes / 1e6 / t_tok if t_tok > 0 else float("inf")
    if not docs:
        _log(f"{src.name}: WARNING no documents ({n_read} read, {skips.total} skipped, {n_empty} empty); no tokens written")
    else:
        _log(f"{src.name}: {len(docs):,} docs, {n_bytes / 1e6:.1f} MB -> {splits['train']['tokens']:,} train / "
             f"{splits['val']['tokens']:,} val tokens ({len(splits['train']['shards'])} train shards); "
             f"tokenized at {mbps:.1f} MB/s; {skips.total} skipped, {n_empty} empty [{dt:.1f}s]")
    return {"status": "prepared" if docs else "empty", "manifest": manifest,
            "timings": {"read_s": round(t_read, 2), "tokenize_s": round(t_tok, 2), "total_s": round(dt, 2), "tokenize_MBps": round(mbps, 2)}}


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
    tok = _get_tokenizer(cfg, sources, inputs, corpus_dir, shards_dir, force, timings)
    _check_model_vocab(cfg, tok.vocab_size, f"data.tokenizer='{data.tokenizer}'")
    token_size = token_size_for(tok.vocab_size)

    results = {}
    tok_bytes = tok_s = 0.0
    for i, src in enumerate(sources):
        r = _prepare_source(i, src, inputs[src.name], cfg, tok, token_size, corpus_dir, shards_dir, force)
        results[src.name] = r
        if "timings" in r:
            tok_s += r["timings"]["tokenize_s"]
            tok_bytes += r["manifest"]["stats"]["text_bytes"]

    top_sources = {}
    for src in sources:
        m = results[src.name]["manifest"]
        top_sources[src.name] = {
            "kind": src.kind,
            "long_docs": src.long_docs,
            "manifest": f"{src.name}/manifest.json",
            **{split: {"dir": f"{src.name}/{split}", "tokens": m["splits"][split]["tokens"],
                       "documents": m["splits"][split]["documents"]} for split in ("train", "val")},
        }
    top = {
        "format_version": 1,
        "tokenizer": {"spec": data.tokenizer, **tok.identity()},
        "token_size": token_size,
        "dtype": "uint16" if token_size == 2 else "uint32",
        "sources": top_sources,
        "totals": {
            "train_tokens": sum(s["train"]["tokens"] for s in top_sources.values()),
            "val_tokens": sum(s["val"]["tokens"] for s in top_sources.values()),
        },
    }
    atomic_write_json(shards_dir / "manifest.json", top)
    timings["tokenize_s"] = round(tok_s, 2)
    if tok_s > 0:
        timings["tokenize_MBps"] = round(tok_bytes / 1e6 / tok_s, 2)
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
