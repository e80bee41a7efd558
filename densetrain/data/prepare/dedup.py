"""Exact and near-duplicate document removal (``data.dedup``).

The recipe's post-mortem 7.1 is a dedup bug that fed highly duplicated data to a run (loss rose
2.3 -> 2.5 before anyone looked at the data). This stage therefore counts everything it removes,
keeps one document per cluster by a fixed rule, and checks its own output (no two kept documents
share an exact key) before returning.

Two halves, so that the expensive part runs in worker processes and the cheap global part in the
main process:

* **map** (per document, any process): :func:`fingerprints` normalises each text once and returns
  its exact key (128-bit BLAKE2b of the normalised text) and its MinHash signature (``num_perm``
  uint32 values from ``rensa``'s ``RMinHash`` over word ``ngram`` shingles). Each row depends only
  on its own text and the config, so chunking over any number of workers gives identical arrays.
* **reduce** (all documents of the dedup scope, main process): :func:`find_duplicates` groups
  equal exact keys, finds near-duplicate candidates by LSH banding of the signatures, verifies
  each candidate pair by its estimated Jaccard similarity, joins verified pairs into clusters
  (connected components) and keeps the lowest index of each cluster. Documents arrive in a
  deterministic order, so "lowest index" is a deterministic choice. Sources with
  ``SourceConfig.dedup = false`` are simply left out of the call.

Normalisation (used by both halves): case folding (``str.casefold``, Unicode default caseless
matching: upper- and lower-case Greek compare equal, which ``str.lower`` does not guarantee);
every Unicode punctuation (P*) and symbol (S*) character becomes a space; whitespace runs
collapse to one space; the ends are stripped. Words are the space-separated pieces, except that
each kana or CJK ideograph is a word of its own (:data:`_UNSPACED_SCRIPTS`). This follows
the idea of datatrove's ``simplify_text`` (the normalisation of its MinHash stage, used by
FineWeb), except that digits and diacritics are kept: two pages that differ only in their
numbers are left to the near-duplicate step rather than declared exact copies. A text with no
words is keyed by its raw text, so that two different punctuation-only documents are not called
copies; its signature is the empty-set signature (all values 2**32-1), which takes no part in
near-duplicate matching.

LSH parameters. With ``b`` bands of ``r`` rows, two documents with shingle Jaccard similarity
``s`` share at least one band, and so become a candidate pair, with probability
``P(s) = 1 - (1 - s**r)**b`` (Leskovec, Rajaraman, Ullman, *Mining of Massive Datasets*, 3rd ed.,
section 3.4). FineWeb's MinHash stage uses 5-gram shingles, 14 bands x 8 rows (112 hashes) and no
verification. Because every candidate here is verified against ``threshold`` on the full
signature, the S-curve can sit lower without hurting precision; for the same 112 hashes the
default is 16 bands x 7 rows::

    s                     0.5     0.7     0.8     0.9
    P, 14 x 8 (FineWeb)   0.053   0.565   0.924   0.9996
    P, 16 x 7 (default)   0.118   0.747   0.977   1.0000

The extra candidates at s = 0.5 cost only signature comparisons. The verification estimates
Jaccard as the fraction of equal signature values (standard error sqrt(s(1-s)/num_perm) = 0.038
at s = 0.8 with 112 hashes): a pair at s = 0.8 passes with probability 0.52, one at s = 0.9 with
0.9993, one at s = 0.5 with 3e-11 (binomial tails of 112 hashes at >= 90 agreements).

Clusters are connected components of verified pairs (and exact groups), so a chain A~B~C is one
cluster even when A and C alone are below the threshold, as in FineWeb's union-find.
"""

from __future__ import annotations

import functools
import hashlib
import unicodedata
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from rensa import RMinHash

from densetrain.config import DedupConfig
from densetrain.errors import DataError

KEY_BYTES = 16
"""Length of an exact key (bytes): a 128-bit BLAKE2b digest."""

EMPTY = np.uint32(0xFFFFFFFF)
"""Every value of the MinHash signature of an empty shingle set (rensa's initial minimum)."""

_BATCH = 512  # documents per rensa call: bounds the shingle strings held at once
_VERIFY_CHUNK = 1 << 16  # candidate pairs compared per step: 2 * 65536 * num_perm * 4 bytes
_FOLD = np.uint64(0x100000001B3)  # FNV-1a 64-bit prime; odd, so each fold step is a bijection


_UNSPACED_SCRIPTS = ((0x3040, 0x30FF), (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0x20000, 0x2FA1F))
"""Code point ranges of scripts written without spaces between words (kana, CJK ideographs): each
character counts as one word, so a 5-word shingle is 5 characters there (character shingles are
the usual unit for Chinese/Japanese near-duplicate detection; whitespace words would make a whole
sentence one "word" and near-dedup no better than exact)."""


SYMBOL_PLANES_END = 0x20000
"""Every punctuation and symbol code point (categories P*, S*) lies in Unicode planes 0-1 (below
U+20000; Unicode 14-16: planes 2-3 hold ideographs, 14 tags and selectors, 15-16 private use;
tests/test_dedup.py checks it for this Python), so :func:`_punct_table` scans only those: 0.1
CPU-s less per worker process than all of Unicode."""


@functools.cache
def _punct_table() -> dict[int, str]:
    # Built once per process (~0.03 s): str.translate with this table runs ~2x faster than a
    # Unicode regex over the text, and normalisation is the slowest part of fingerprinting.
    table = {c: " " for c in range(SYMBOL_PLANES_END) if unicodedata.category(chr(c))[0] in "PS"}
    for lo, hi in _UNSPACED_SCRIPTS:
        table.update({c: f" {chr(c)} " for c in range(lo, hi + 1) if unicodedata.category(chr(c))[0] == "L"})
    return str.maketrans(table)


def words(text: str) -> list[str]:
    """The words of ``text`` after normalisation (see the module docstring)."""
    return text.casefold().translate(_punct_table()).split()


def normalize(text: str) -> str:
    """Normalised text for exact hashing: case-folded, punctuation/symbols -> space, one space between words.

    Example: ``normalize("Hello,  World!\\n")`` is ``"hello world"``.
    """
    return " ".join(words(text))


def _key(normalized: str, text: str) -> bytes:
    # Separate BLAKE2b personalisations keep the raw-text keys of wordless documents apart
    # from the keys of normalised texts.
    if normalized:
        return hashlib.blake2b(normalized.encode("utf-8", "surrogatepass"), digest_size=KEY_BYTES,
                               person=b"norm").digest()
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=KEY_BYTES, person=b"raw").digest()


def exact_key(text: str) -> bytes:
    """The exact-duplicate key of ``text``: 16 bytes, BLAKE2b-128 of :func:`normalize` (raw text if that is empty)."""
    return _key(normalize(text), text)


def shingles(ws: Sequence[str], ngram: int) -> list[str]:
    """Word shingles: each run of ``ngram`` consecutive words joined by one space.

    A document with fewer than ``ngram`` (but at least one) words has one shingle of all its
    words; a document with no words has none.
    """
    if len(ws) < ngram:
        return [" ".join(ws)] if ws else []
    return [" ".join(g) for g in zip(*(ws[i:] for i in range(ngram)))]


def signature(text: str, cfg: DedupConfig) -> np.ndarray:
    """MinHash signature of one document: ``(cfg.num_perm,)`` uint32, rensa ``RMinHash(num_perm, seed)``.

    Shingles are :func:`shingles` of :func:`words` with ``cfg.ngram``. Equal to the matching row
    of :func:`fingerprints`.
    """
    m = RMinHash(cfg.num_perm, cfg.seed)
    m.update(shingles(words(text), cfg.ngram))
    return np.asarray(m.digest(), dtype=np.uint32)


def fingerprints(texts: Sequence[str], cfg: DedupConfig) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Exact keys and MinHash signatures of a chunk of documents (the per-worker "map" step).

    Args:
        texts: N document texts.
        cfg: the dedup config; ``exact`` / ``near`` switch the two outputs on or off.

    Returns:
        ``(keys, signatures)``: keys is ``(N, 16)`` uint8 (row i = :func:`exact_key` of text i) or
        ``None`` when ``cfg.exact`` is false; signatures is ``(N, cfg.num_perm)`` uint32 (row i =
        :func:`signature` of text i) or ``None`` when ``cfg.near`` is false. Rows of separately
        computed chunks concatenate to the result for the whole list.
    """
    n = len(texts)
    keys = np.empty((n, KEY_BYTES), np.uint8) if cfg.exact else None
    sigs = np.empty((n, cfg.num_perm), np.uint32) if cfg.near else None
    for lo in range(0, n, _BATCH):
        batch = texts[lo : lo + _BATCH]
        token_sets = []
        for j, text in enumerate(batch):
            ws = words(text)
            if keys is not None:
                keys[lo + j] = np.frombuffer(_key(" ".join(ws), text), np.uint8)
            if sigs is not None:
                token_sets.append(shingles(ws, cfg.ngram))
        if sigs is not None and batch:
            matrix = RMinHash.digest_matrix_from_token_sets(token_sets, cfg.num_perm, cfg.seed)
            sigs[lo : lo + len(batch)] = np.asarray(matrix.to_rows(), dtype=np.uint32)
    return keys, sigs


@dataclass
class DedupResult:
    """Outcome of :func:`find_duplicates` over N documents.

    Attributes:
        keep: ``(N,)`` bool; true for the one document kept per cluster.
        cluster: ``(N,)`` int64; the index of the kept document of each document's cluster
            (``cluster[i] == i`` exactly when ``keep[i]``).
        reason: ``(N,)`` int8; 0 kept, 1 removed as an exact duplicate (its normalised text equals
            an earlier document's), 2 removed as a near duplicate.
        stats: counts for the manifest and the log: ``documents``, ``exact_duplicates_removed``,
            ``near_duplicates_removed``, ``documents_removed``, ``duplicate_rate`` (removed /
            documents), ``clusters`` (clusters of size >= 2), ``largest_cluster``,
            ``candidate_pairs`` and ``verified_pairs`` (distinct LSH pairs, and those that passed
            the threshold), ``chars`` / ``chars_removed`` (when lengths were given), ``examples``
            (up to 5 largest clusters: ``{"keep", "size", "members"}`` with at most 10 member
            indices) and ``per_source`` (when source ids were given: the counts by source).
    """

    keep: np.ndarray
    cluster: np.ndarray
    reason: np.ndarray
    stats: dict = field(default_factory=dict)

    def summary(self) -> str:
        """One log line, e.g. ``dedup: 1,000 documents, 30 exact + 12 near duplicates removed (4.20%), ...``."""
        s = self.stats
        return (
            f"dedup: {s['documents']:,} documents, {s['exact_duplicates_removed']:,} exact + "
            f"{s['near_duplicates_removed']:,} near duplicates removed ({100 * s['duplicate_rate']:.2f}%), "
            f"{s['clusters']:,} clusters, largest {s['largest_cluster']:,}"
        )


def _key_array(keys, n: int | None) -> np.ndarray:
    if isinstance(keys, np.ndarray):
        arr = keys
    else:
        if any(len(k) != KEY_BYTES for k in keys):
            raise DataError(f"dedup: every exact key must be {KEY_BYTES} bytes (from exact_key/fingerprints)")
        arr = np.frombuffer(b"".join(keys), np.uint8).reshape(len(keys), KEY_BYTES)
    if arr.dtype != np.uint8 or arr.ndim != 2 or arr.shape[1] != KEY_BYTES or (n is not None and arr.shape[0] != n):
        raise DataError(f"dedup: keys have shape {arr.shape} and dtype {arr.dtype}, expected ({n}, {KEY_BYTES}) uint8")
    return np.ascontiguousarray(arr).view(np.dtype((np.void, KEY_BYTES))).ravel()


def components(n: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Connected components of an undirected graph on nodes ``0..n-1`` with edges ``(u[k], v[k])``.

    Returns ``(n,)`` int64 labels, ``labels[i]`` = the smallest node connected to ``i``. Vectorised
    hook-and-compress (Shiloach & Vishkin, J. Algorithms 3(1), 1982): each round hooks the larger
    root of every edge under the smaller, then pointer-jumps until every node points at a root;
    O((n + E) log n) work, no Python loop over edges.
    """
    labels = np.arange(n, dtype=np.int64)
    u = np.asarray(u, np.int64)
    v = np.asarray(v, np.int64)
    while len(u):
        lu, lv = labels[u], labels[v]
        if np.array_equal(lu, lv):
            break
        low = np.minimum(lu, lv)
        np.minimum.at(labels, lu, low)
        np.minimum.at(labels, lv, low)
        while True:
            jumped = labels[labels]
            if np.array_equal(jumped, labels):
                break
            labels = jumped
    return labels


def _band_pairs(sig: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """Distinct candidate pairs (packed ``lo * M + hi``, int64, sorted) of rows sharing a band.

    Within each bucket of equal band values every member is paired with the bucket's first
    (lowest) member and with its predecessor: O(M) pairs per band, where all pairs of a bucket
    would be quadratic in the size of large template clusters.
    """
    m = sig.shape[0]
    pos = np.arange(m)
    packed = []
    for b in range(bands):
        block = sig[:, b * rows : (b + 1) * rows].astype(np.uint64)
        # Fold the band's values into one 64-bit value: equal bands fold equally; two unequal
        # bands collide with probability ~2**-64 and would only add a pair that verification drops.
        h = np.zeros(m, np.uint64)
        for c in range(rows):
            h = (h ^ block[:, c]) * _FOLD
        order = np.argsort(h, kind="stable")  # stable: each bucket lists its rows in index order
        hs = h[order]
        same = hs[1:] == hs[:-1]
        start = np.maximum.accumulate(np.where(np.r_[True, ~same], pos, 0))
        prev = order[:-1][same], order[1:][same]
        star = np.r_[False, same] & (start < pos - 1)  # pairs with the first member not already in prev
        for lo, hi in (prev, (order[start[star]], order[star])):
            packed.append(lo.astype(np.int64) * m + hi)
    return np.unique(np.concatenate(packed)) if packed else np.empty(0, np.int64)


def find_duplicates(
    keys: Sequence[bytes] | np.ndarray | None,
    signatures: np.ndarray | None,
    cfg: DedupConfig,
    lengths: Sequence[int] | np.ndarray | None = None,
    source_ids: Sequence[int] | np.ndarray | None = None,
    source_names: Sequence[str] | None = None,
) -> DedupResult:
    """Cluster duplicate documents and keep the lowest index of each cluster (the "reduce" step).

    Args:
        keys: exact keys, N x 16 bytes (a list of :func:`exact_key` values or the ``(N, 16)``
            uint8 array of :func:`fingerprints`); required when ``cfg.exact``.
        signatures: ``(N, cfg.num_perm)`` uint32 MinHash signatures; required when ``cfg.near``.
        cfg: the dedup config (exact / near switches, bands, rows, threshold).
        lengths: optional ``(N,)`` document lengths in characters, for ``chars_removed``.
        source_ids: optional ``(N,)`` ints in ``[0, S)``: per-source counts in ``stats["per_source"]``.
        source_names: optional names of the S sources (default ``"0"``, ``"1"``, ...).

    Memory: the signatures plus a few 8-byte arrays per document and per candidate pair; at 1M
    documents and 112 hashes the signatures (448 MB) dominate. Time: one stable sort per band and a
    vectorised comparison per candidate pair; no step compares all pairs. Measured on one core:
    0.4 s for 100k documents (Python stdlib text), 15 s for 1M documents with 1.2M candidate pairs.

    Raises:
        DataError: a required input is missing or has the wrong shape, dtype or length.
        RuntimeError: the result fails its self-check (two kept documents with one exact key);
            this is a bug in this module, never bad input.
    """
    n = next((len(x) for x in (keys, signatures, lengths, source_ids) if x is not None), None)
    if n is None:
        raise DataError("dedup: find_duplicates needs keys, signatures, lengths or source_ids to know the documents")
    exact_rep = np.arange(n, dtype=np.int64)
    kv = None
    if cfg.exact:
        if keys is None:
            raise DataError("dedup: data.dedup.exact is on but no exact keys were given")
        kv = _key_array(keys, n)
        if n:
            _, first, inverse = np.unique(kv, return_index=True, return_inverse=True)
            exact_rep = first[inverse.ravel()].astype(np.int64)  # first occurrence = lowest index
    cluster = exact_rep.copy()
    candidates = verified = 0
    if cfg.near:
        if signatures is None:
            raise DataError("dedup: data.dedup.near is on but no signatures were given")
        sig = np.asarray(signatures)
        if sig.shape != (n, cfg.num_perm) or sig.dtype != np.uint32:
            raise DataError(f"dedup: signatures have shape {sig.shape} and dtype {sig.dtype}, "
                            f"expected ({n}, {cfg.num_perm}) uint32")
        # Near matching runs on one representative per exact group (the rest are settled) and
        # leaves out wordless documents, whose empty-set signatures would all look identical.
        active = (np.flatnonzero((exact_rep == np.arange(n)) & (sig.min(axis=1) != EMPTY)) if n
                  else np.empty(0, np.int64))
        sub = sig if len(active) == n else sig[active]
        pairs = _band_pairs(sub, cfg.bands, cfg.rows)
        candidates = len(pairs)
        lo, hi = np.divmod(pairs, max(len(active), 1))
        ok = np.zeros(len(pairs), bool)
        for s in range(0, len(pairs), _VERIFY_CHUNK):
            e = s + _VERIFY_CHUNK
            agree = (sub[lo[s:e]] == sub[hi[s:e]]).sum(axis=1)
            ok[s:e] = agree / cfg.num_perm >= cfg.threshold
        verified = int(ok.sum())
        labels = components(len(active), lo[ok], hi[ok])
        cluster[active] = active[labels]  # active is sorted, so the smallest label is the smallest index
        cluster = cluster[exact_rep]
    idx = np.arange(n)
    keep = cluster == idx
    reason = np.where(keep, 0, np.where(exact_rep != idx, 1, 2)).astype(np.int8)

    # Self-check: the failure of post-mortem 7.1 was silent. A kept exact copy or a cluster whose
    # kept document is not its own representative is a bug here, so it stops the run.
    if n and (not np.array_equal(cluster[cluster], cluster) or np.any(cluster > idx)):
        raise RuntimeError("dedup: internal error: cluster ids are not the lowest member of each cluster")
    if kv is not None and len(np.unique(kv[keep])) != int(keep.sum()):
        raise RuntimeError("dedup: internal error: two kept documents have the same exact key")

    stats = _stats(cluster, reason, lengths, source_ids, source_names)
    stats["candidate_pairs"] = candidates
    stats["verified_pairs"] = verified
    return DedupResult(keep=keep, cluster=cluster, reason=reason, stats=stats)


def _counts(reason: np.ndarray, chars: np.ndarray | None) -> dict:
    n = len(reason)
    removed = int(np.count_nonzero(reason))
    out = {
        "documents": n,
        "exact_duplicates_removed": int(np.count_nonzero(reason == 1)),
        "near_duplicates_removed": int(np.count_nonzero(reason == 2)),
        "documents_removed": removed,
        "duplicate_rate": removed / n if n else 0.0,
    }
    if chars is not None:
        out["chars"] = int(chars.sum())
        out["chars_removed"] = int(chars[reason != 0].sum())
    return out


def _stats(cluster, reason, lengths, source_ids, source_names) -> dict:
    n = len(cluster)
    chars = None
    if lengths is not None:
        chars = np.asarray(lengths, np.int64)
        if chars.shape != (n,):
            raise DataError(f"dedup: lengths have shape {chars.shape}, expected ({n},)")
    stats = _counts(reason, chars)
    sizes = np.bincount(cluster, minlength=n) if n else np.zeros(0, np.int64)
    reps = np.flatnonzero(sizes >= 2)
    stats["clusters"] = len(reps)
    stats["largest_cluster"] = int(sizes.max()) if n else 0
    top = reps[np.lexsort((reps, -sizes[reps]))][:5]  # largest first, ties by index
    stats["examples"] = [
        {"keep": int(r), "size": int(sizes[r]), "members": np.flatnonzero(cluster == r)[:10].tolist()} for r in top
    ]
    if source_ids is not None:
        sid = np.asarray(source_ids, np.int64)
        if sid.shape != (n,) or (n and sid.min() < 0):
            raise DataError(f"dedup: source_ids must be ({n},) non-negative ints, got shape {sid.shape}")
        count = int(sid.max()) + 1 if n else 0
        names = list(source_names) if source_names is not None else [str(i) for i in range(count)]
        if len(names) < count:
            raise DataError(f"dedup: source id {count - 1} has no name ({len(names)} source_names given)")
        stats["per_source"] = {
            name: _counts(reason[sid == i], None if chars is None else chars[sid == i]) for i, name in enumerate(names)
        }
    return stats
