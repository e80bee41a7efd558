"""Word normalisation and 64-bit word / k-gram hashing for n-gram matching, vectorised in numpy over a
whole batch of texts (no Python loop per word), and the membership test of hashes in a sorted key set.

Each normalised word gets a 64-bit hash (a polynomial over its UTF-8 bytes, mixed with the splitmix64
finalizer) and each k-gram a 64-bit polynomial hash of its word hashes plus an offset per k. Membership
is tested with a bitmap prefilter that fits in cache and a binary search of the few survivors. Used by
the contamination index (:mod:`densetrain.data.prepare.decontam.build`); the normalisation rule is explained there.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

import numpy as np

_NON_ASCII = re.compile(r"[^\x00-\x7f]+")
# Byte map applied last: A-Z -> a-z, other ASCII non-alphanumerics -> space, UTF-8 bytes of the
# (already normalised) non-ASCII letters unchanged.
_BYTE_TABLE = bytes(
    (c + 32 if 65 <= c <= 90 else c) if c >= 128 or chr(c).isalnum() else 32 for c in range(256)
)
_SPACE = 32
# 64-bit constants: an odd multiplier (2^64 / golden ratio) and its inverse mod 2^64 for the rolling
# hashes; splitmix64's finalizer constants (Steele et al. 2014, "Fast splittable pseudorandom number
# generators") to mix each word's hash before words are combined.
_MULT = 0x9E3779B97F4A7C15
_MULT_INV = pow(_MULT, -1, 1 << 64)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _non_ascii_words(m: re.Match) -> str:
    return "".join(c if c.isalnum() else " " for c in m.group().lower())


def _normalized_bytes(text: str) -> bytes:
    """UTF-8 of ``text``'s normalised words separated by spaces (one or more).

    Non-ASCII text is first put in Unicode NFKC form: a decomposed accent (NFD: ``i`` then U+0308) was a word
    break (``nai ve``, never matching the NFC ``naïve`` of a cleaned training document), and full-width letters
    (``ＨＥＬＬＯ``, CJK pages) and ligatures (``ﬁ``) were words of their own. Runs of non-ASCII characters are
    lower-cased and their non-alphanumerics blanked in Python;
    the ASCII rest is done by one ``bytes.translate`` (2-3x faster than a Unicode regex).
    """
    if not text.isascii():
        text = _NON_ASCII.sub(_non_ascii_words, unicodedata.normalize("NFKC", text))
    return text.encode("utf-8").translate(_BYTE_TABLE)


def normalize_words(text: str) -> list[str]:
    """The words of ``text`` for n-gram matching: lower-cased runs of Unicode letters and digits of its NFKC form.

    Every other character (punctuation, symbols, ``_``, whitespace) separates words, e.g.
    ``"Don’t  STOP-now!"`` -> ``['don', 't', 'stop', 'now']`` (see the module docstring).
    """
    return _normalized_bytes(text).decode("utf-8").split()


@dataclass
class Words:
    """The normalised words of a batch of documents, located in ``buf`` and hashed.

    Attributes:
        buf: the documents' normalised bytes, joined by one space.
        starts, ends: (W,) int64, byte span of each word in ``buf``.
        hashes: (W,) uint64, a 64-bit hash per word (equal words, equal hashes; any batch).
        room: (W,) int64, words from each word to the end of its document, itself included.
        doc: (W,) int64, the document of each word.
        first: (D + 1,) int64, the first word of each document (of the next one when it has none),
            then W: document d holds words first[d] .. first[d + 1] - 1.
    """

    buf: bytes
    starts: np.ndarray
    ends: np.ndarray
    hashes: np.ndarray
    room: np.ndarray
    doc: np.ndarray
    first: np.ndarray

    def text(self, i: int, k: int) -> str:
        """Words i .. i+k-1 joined by single spaces."""
        return " ".join(self.buf[self.starts[i] : self.ends[i + k - 1]].decode("utf-8").split())


def hash_words(texts: list[str]) -> Words:
    """Normalise and hash the words of ``texts`` in one vectorised pass.

    A word's hash is the polynomial sum_j byte_j * M^j (mod 2^64) of its UTF-8 bytes, computed for
    all words at once from prefix sums (M is odd, hence invertible mod 2^64), then put through the
    splitmix64 finalizer so that the n-gram hashes built from it are not linear in the bytes.
    """
    parts = [_normalized_bytes(t) for t in texts]
    buf = b" ".join(parts)
    b = np.frombuffer(buf, dtype=np.uint8)
    # Word boundaries: +1 where a run of non-space bytes starts, -1 one past where it ends.
    edge = np.diff(np.concatenate(([False], b != _SPACE, [False])).view(np.int8))
    starts, ends = np.flatnonzero(edge == 1), np.flatnonzero(edge == -1)
    n = len(b)
    pw = np.full(n, _MULT, dtype=np.uint64)
    if n:
        pw[0] = 1
    np.cumprod(pw, out=pw)  # M^j; uint64 products wrap modulo 2^64
    prefix = np.zeros(n + 1, dtype=np.uint64)
    np.cumsum(b * pw, out=prefix[1:])  # b is promoted to uint64
    np.cumprod(np.full(n, _MULT_INV, dtype=np.uint64), out=pw)  # reuse: M^-(j+1)
    inv_start = np.ones(len(starts), dtype=np.uint64)
    nz = starts > 0
    inv_start[nz] = pw[starts[nz] - 1]  # M^-start
    h = (prefix[ends] - prefix[starts]) * inv_start
    h ^= h >> np.uint64(30)
    h *= _MIX1
    h ^= h >> np.uint64(27)
    h *= _MIX2
    h ^= h >> np.uint64(31)
    # Words per document: documents start at the byte offsets of their parts in buf.
    doc_start = np.cumsum([0] + [len(p) + 1 for p in parts])  # (D + 1,), the last one past the end
    first = np.searchsorted(starts, doc_start)  # (D + 1,) first word of each document, then W
    counts = np.diff(first)
    doc = np.repeat(np.arange(len(texts)), counts)
    room = np.repeat(first[1:], counts) - np.arange(len(starts))
    return Words(buf, starts, ends, h, room, doc, first)


def iter_kgrams(wh: np.ndarray, lengths):
    """Yield (k, (W - k + 1,) uint64 hashes of every run of k consecutive words) for each k of
    ``lengths``, ascending, in one incremental pass (Horner's rule: h <- h * M + next word hash).

    hash(k-gram at i) = sum_{j<k} wh[i + j] * M^(k - 1 - j) + k * M  (mod 2^64); the k * M term keeps
    equal sums of different lengths apart. Stops early when W < k.
    """
    want = sorted(set(lengths))
    if not want:
        return
    w = len(wh)
    h = np.zeros(w, dtype=np.uint64)
    mult = np.uint64(_MULT)
    for j in range(want[-1]):
        m = w - j
        if m <= 0:
            return
        view = h[:m]
        view *= mult
        view += wh[j:]
        k = j + 1
        if k == want[0]:
            want.pop(0)
            yield k, view + np.uint64(k * _MULT % (1 << 64))  # the length enters the hash (see above)


def bitmap_filter(keys: np.ndarray) -> tuple[np.ndarray, np.uint64]:
    """A bit per value of the top B bits of a hash, set for every key: a membership prefilter that
    fits in cache, 2^B >= 32 * len(keys) so at most ~3% of absent hashes pass it.

    Returns:
        (2^B / 8,) uint8 bit array (bit q % 8 of byte q // 8 for top bits q) and the shift 64 - B.
    """
    b = int(min(max(np.ceil(np.log2(max(len(keys), 1))) + 5, 10), 34))
    shift = np.uint64(64 - b)
    q = keys >> shift
    bits = np.zeros(1 << (b - 3), dtype=np.uint8)
    np.bitwise_or.at(bits, (q >> np.uint64(3)).astype(np.intp), np.left_shift(1, q & np.uint64(7)).astype(np.uint8))
    return bits, shift


def lookup(h: np.ndarray, keys: np.ndarray, bitmap: tuple[np.ndarray, np.uint64],
            where: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Positions i (ascending) with h[i] in the sorted ``keys`` (and ``where[i]``), and the index of
    h[i] in ``keys``: the bitmap of :func:`bitmap_filter` rules out most absent hashes in one gather, binary
    search confirms the rest."""
    if not len(keys):
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    bits, shift = bitmap
    q = h >> shift
    hit = ((bits[q >> np.uint64(3)] >> (q & np.uint64(7)).astype(np.uint8)) & np.uint8(1)).view(bool)
    at = np.flatnonzero(hit & where if where is not None else hit)
    e = np.minimum(np.searchsorted(keys, h[at]), len(keys) - 1)
    ok = keys[e] == h[at]
    return at[ok], e[ok]


def whole_hashes(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(N,) uint64 hash of each text as one k-gram of its own word count k (0 for an empty text),
    equal to the k-gram hash of the same words in a document, and (N,) int64 word counts."""
    words = hash_words(texts)
    first = words.first[:-1]
    n = np.diff(words.first)
    out = np.zeros(len(texts), dtype=np.uint64)
    for k, h in iter_kgrams(words.hashes, set(n[n > 0].tolist())):
        sel = np.flatnonzero(n == k)
        out[sel] = h[first[sel]]
    return out, n
