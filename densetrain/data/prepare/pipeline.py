"""``densetrain prepare``: raw sources -> cleaned documents -> tokenizer -> token shards + manifests.

Steps (per source, in ``data.sources`` order):

1. (``data.demo_corpus``) build the demo corpus into ``data.corpus_dir``; with no sources
   configured, the demo sources (:func:`densetrain.data.corpus.build.demo_sources`) are used.
2. Tokenizer: ``data.tokenizer = 'bpe'`` trains a byte-level BPE of ``data.tokenizer_vocab_size``
   on a deterministic, source-balanced sample (:data:`BPE_SAMPLE_BYTES`) of cleaned documents the
   first time, saved as ``shards_dir/tokenizer.json``; otherwise tiktoken or a given tokenizer.json.
3. Decontamination index (``data.decontam``): the ``ngram``-word n-grams of the evaluation sets,
   built once and cached in ``shards_dir/.decontam`` (:mod:`densetrain.data.prepare.decontam.build`).
4. Per document, in ``data.workers`` processes (:mod:`densetrain.data.prepare.process`): read
   (:func:`densetrain.data.prepare.readers.sources.iter_documents`; bad records are skipped and counted), clean
   (ftfy, NFC, strip; empty documents dropped), quality filters (``SourceConfig.filters``,
   :mod:`densetrain.data.prepare.filters.chain`), decontamination, dedup key + MinHash signature, tokenize +
   EOS (after a BOS where the tokenizer has one: Llama 3).
5. Deduplicate the survivors of each source (exact, then MinHash LSH; ``data.dedup``, per source
   ``SourceConfig.dedup``), keeping the first document of every cluster.
6. Shuffle the documents (seeded per source), hold out ``val_fraction`` of them (at least one,
   at most ``max_val_tokens`` tokens) for validation.
7. Write datatrove-layout shards and manifests::

       shards_dir/
         tokenizer.json            (bpe only) + tokenizer.train.json (its training parameters)
         manifest.json             summary of all sources + tokenizer identity
         <source>/manifest.json    tokenizer identity, inputs, params, per-split counts, shard sha256s
                                   and mtimes (checked on reuse and before training: data/shards.py)
         <source>/provenance.json  per document, in shard order: source file, line, doc id, tokens
         <source>/removed.json     per removed document: source file, line, doc id, reason
         <source>/train/000000.ds  (+ .ds.index, .ds.metadata), 000001.ds, ... (<= 64 Mi tokens each)
         <source>/val/000000.ds    (+ .ds.index, .ds.metadata)

Steps 4-7 of one source are :mod:`densetrain.data.prepare.source`; a ``format = "datatrove"`` source
(already tokenized) is checked and registered instead (:mod:`densetrain.data.prepare.scale.folder`).

A source is skipped when its manifest matches the tokenizer hash, the input files (path, size,
mtime) and the parameters, unless ``force``. The manifest is deleted before a source is
rewritten and written last, so a crash never leaves a manifest describing other shards.

The BPE is trained once: it is retrained only when ``tokenizer.json`` is missing, when
``data.tokenizer_vocab_size`` changed, or with ``force`` — not when the corpus changes.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from densetrain.data.corpus.build import build_demo_corpus, demo_sources
from densetrain.data.corpus.ladder import build_ladder_corpus, ladder_sources, tokens_without_repeat
from densetrain.data.prepare.decontam.build import build_index
from densetrain.data.prepare.filters.chain import clean_text
from densetrain.data.prepare.manifest import log
from densetrain.data.prepare.process import worker_pool
from densetrain.data.prepare.readers.documents import SkipLog
from densetrain.data.prepare.readers.paths import estimated_text_bytes, resolve_paths
from densetrain.data.prepare.readers.sources import iter_documents
from densetrain.data.prepare.scale.folder import register_datatrove_source
from densetrain.data.prepare.source import discard_unfinished, prepare_source
from densetrain.data.sampling import fair_shares
from densetrain.data.shards import SHARD_SUFFIXES, token_dtype, token_size_for
from densetrain.data.tokenizer import Tokenizer, load_tokenizer, train_bpe, usable_cpus
from densetrain.errors import DataError, disk_full_error, is_disk_full
from densetrain.fileio import atomic_write_json, mark_kind, other_kind, read_json, sweep_stale_temps
from densetrain.storage import publish, staging_dir

BPE_SAMPLE_BYTES = 12_000_000
"""Bytes of text the BPE is trained on, shared evenly between sources."""


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------


def _bpe_sample(cfg, sources, inputs, corpus_dir: Path, budget: int) -> list[str]:
    """A deterministic training sample: each source gets an equal share of ``budget`` bytes
    (small sources are taken whole and leave the rest to others); documents are picked evenly
    through each source (error diffusion on bytes)."""
    est = [estimated_text_bytes(inputs[s.name]) for s in sources]
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
            prev = read_json(sidecar)  # a regular file of <= 16 MiB, nesting the parser follows (fileio)
        except (OSError, ValueError):
            prev = None
        prev = prev if isinstance(prev, dict) else None
        if prev is None or prev.get("params") == params:
            log(f"tokenizer: using the trained BPE {path}")
            return load_tokenizer("bpe", shards_dir)
        log(f"tokenizer: data.tokenizer_vocab_size changed ({prev.get('params')} -> {params}); retraining")
    t0 = time.time()
    sample = _bpe_sample(cfg, sources, inputs, corpus_dir, BPE_SAMPLE_BYTES)
    nbytes = sum(len(t.encode("utf-8")) for t in sample)
    log(f"tokenizer: training byte-level BPE, vocab {data.tokenizer_vocab_size}, on {len(sample)} docs / "
        f"{nbytes / 1e6:.1f} MB")
    t1 = time.time()
    tok = train_bpe(sample, data.tokenizer_vocab_size, path, length=len(sample))
    timings["bpe_sample_s"] = round(t1 - t0, 2)
    timings["bpe_train_s"] = round(time.time() - t1, 2)
    atomic_write_json(sidecar, {"params": params, "sample_documents": len(sample), "sample_bytes": nbytes,
                                "sources": [s.name for s in sources], "sha256": tok.sha256})
    log(f"tokenizer: trained in {time.time() - t1:.1f}s, vocab {tok.vocab_size}, saved {path}")
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
    t0 = time.time()
    index = build_index(dc.tasks, dc.ngram, cache_dir=shards_dir / ".decontam")
    timings["decontam_index_s"] = round(time.time() - t0, 2)
    return {"index": str(index.path), "tasks": list(dc.tasks), "ngram": dc.ngram, "sha256": index.sha256}


def _check_model_vocab(cfg, vocab: int, what: str) -> None:
    if cfg.model.vocab_size < vocab:
        raise DataError(f"model.vocab_size ({cfg.model.vocab_size}) must be >= the tokenizer vocabulary "
                        f"({vocab}, {what})")


@contextlib.contextmanager
def _on_full_disk(path: Path, what: str, cleanup=None):
    """Turn a full disk inside the block into one line "no space left on ``path``" (a DataError), after
    ``cleanup()`` removed what the block had half-written."""
    try:
        yield
    except BaseException as e:
        if isinstance(e, DataError) or not is_disk_full(e):
            raise
        if cleanup is not None:
            cleanup()
        raise disk_full_error(path, what) from None


def _workers(data) -> int:
    """``data.workers``, where 0 means every CPU this process may use."""
    return data.workers if data.workers > 0 else usable_cpus()


# --------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------


def prepare(cfg, force: bool = False, verify: bool = False) -> dict:
    """Prepare every configured source into token shards (see the module docstring for the layout).

    Args:
        cfg: a :class:`densetrain.config.Config` (reads ``cfg.data`` and ``cfg.model.vocab_size``).
        force: redo everything (BPE training included) even when manifests match.
        verify: hash every shard of an up-to-date source against its manifest (a full read) instead of
            only those whose mtime changed (:func:`densetrain.data.shards.check_shard_hashes`).

    Returns:
        The summary: ``{'shards_dir', 'tokenizer': identity, 'token_size', 'sources': {name:
        {'status': 'prepared'|'up-to-date'|'empty', 'kind', 'long_docs', 'train': {'tokens',
        'documents', 'dir'}, 'val': {...}, 'manifest': path}}, 'timings': {...}}``; the same
        (without status/timings) is written to ``shards_dir/manifest.json``.

    Workers are spawned processes (``data.workers``): a script that calls this function must do so
    under ``if __name__ == "__main__":``, as for any ``multiprocessing`` spawn.

    Temporary files of killed runs (``.NAME.tmpPID`` of a dead PID) are deleted first.

    Raises:
        DataError: no sources, a missing input path, a tokenizer problem, ``model.vocab_size``
            smaller than the tokenizer's vocabulary, or a full disk ("no space left on <dir>", after
            removing the unfinished source's shards; its finished chunks stay for the re-run).
    """
    t0 = time.time()
    data = cfg.data
    corpus_dir, shards_dir = Path(data.corpus_dir), staging_dir(data.shards_dir)  # a URL: staged, published last
    timings: dict[str, float] = {}
    if data.demo_corpus:
        build_demo_corpus(corpus_dir)
        timings["corpus_s"] = round(time.time() - t0, 2)
    if data.ladder_corpus:
        build_ladder_corpus(corpus_dir)
        timings["corpus_s"] = round(time.time() - t0, 2)
    sources = list(data.sources) or (demo_sources() if data.demo_corpus else
                                     ladder_sources() if data.ladder_corpus else [])
    if not sources:
        raise DataError("data.sources is empty: configure at least one source (or set data.demo_corpus = true)")
    # Resolve every input before any heavy work, so a typo fails in a second.
    inputs = {src.name: resolve_paths(src, corpus_dir, i) for i, src in enumerate(sources)}
    if data.tokenizer == "bpe":
        _check_model_vocab(cfg, data.tokenizer_vocab_size, "data.tokenizer_vocab_size")
    if why := other_kind(shards_dir, "shards", "data.shards_dir"):  # e.g. a run directory: never written into
        raise DataError(why)
    shards_dir.mkdir(parents=True, exist_ok=True)
    mark_kind(shards_dir, "shards")
    stale = sweep_stale_temps(shards_dir)  # a killed run's half-written files (a .ds can be 128 MB)
    if stale:
        log(f"removed {len(stale)} temporary files of killed runs (e.g. {stale[0]})")
    to_tokenize = [s for s in sources if s.format != "datatrove"]
    with _on_full_disk(shards_dir, "the tokenizer"):
        tok = _get_tokenizer(cfg, to_tokenize, inputs, corpus_dir, shards_dir, force, timings)
    _check_model_vocab(cfg, tok.vocab_size, f"data.tokenizer='{data.tokenizer}'")
    token_size = token_size_for(tok.vocab_size)

    with _on_full_disk(shards_dir, "the decontamination index"):
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
            src_dir = shards_dir / src.name
            with _on_full_disk(src_dir, f"source '{src.name}'", cleanup=lambda d=src_dir: discard_unfinished(d)):
                if src.format == "datatrove":  # already tokenized: checked and registered, not re-tokenized
                    r = register_datatrove_source(i, src, cfg, tok, corpus_dir, shards_dir, force)
                else:
                    r = prepare_source(i, src, inputs[src.name], cfg, tok, token_size, corpus_dir, shards_dir,
                                       force, decontam, get_pool, verify=verify)
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
    with _on_full_disk(shards_dir, "manifest.json"):
        atomic_write_json(shards_dir / "manifest.json", top)
    timings["process_s"] = round(proc_s, 2)
    if proc_s > 0:
        timings["process_MBps"] = round(proc_bytes / 1e6 / proc_s, 2)
    timings["total_s"] = round(time.time() - t0, 2)
    empty = [n for n, r in results.items() if r["status"] == "empty"]
    if empty:
        log(f"WARNING sources without documents: {empty} (no shards; leave them out of stage mixes)")
    log(f"done in {timings['total_s']:.1f}s: {top['totals']['train_tokens']:,} train tokens, "
        f"{top['totals']['val_tokens']:,} val tokens in {shards_dir}")
    if data.ladder_corpus and cfg.stages:  # what the ladder needs to know: how long a run may be
        train_tokens = {n: s["train"]["tokens"] for n, s in top_sources.items()}
        most = tokens_without_repeat(cfg.stages[0].mix, train_tokens)
        log(f"ladder corpus: {top['totals']['train_tokens']:,} train tokens ("
            + ", ".join(f"{n} {t:,}" for n, t in train_tokens.items()) + f"); a run with the first stage's mix "
            f"trains at most {most:,} tokens without repeating one")
    summary = dict(top)
    summary["shards_dir"] = str(shards_dir)
    summary["sources"] = {n: {"status": results[n]["status"], **s,
                              **({"timings": results[n]["timings"]} if "timings" in results[n] else {})}
                          for n, s in top_sources.items()}
    summary["timings"] = timings
    # The top manifest last: readers wait for it. Shard files of an earlier, larger prepare into the same URL go
    # (as _clear_split_dir deletes them locally): a stale 000003.ds would be listed and read.
    publish(shards_dir, data.shards_dir, last=("manifest.json",), prune=SHARD_SUFFIXES)
    summary["shards_dir"] = str(data.shards_dir)
    return summary
