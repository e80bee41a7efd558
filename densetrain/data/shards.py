"""Token shards in datatrove's tokenized layout, so datatrove output trains as is (and vice versa).

One shard ``NAME.ds`` with its companions (checked against datatrove's ``TokenizedFile`` /
``DocumentTokenizer`` and ``DatatroveFolderDataset``):

* ``NAME.ds`` — the token ids of all documents back to back, flat little-endian, ``uint16``
  (``token_size`` 2) when ``vocab_size <= 65536`` else ``uint32`` (``token_size`` 4). Each
  document already ends with the EOS token, and starts with the BOS token where the tokenizer has
  one (Llama 3's ``<|begin_of_text|>``, as Meta trains; GPT-2: EOS only); nothing else separates
  documents.
* ``NAME.ds.index`` — ``uint64`` little-endian, one value per document: the document's END
  offset in tokens, cumulative and relative to the start of this ``.ds`` file (so the last value
  equals the file's token count). No header.
* ``NAME.ds.metadata`` — text, three lines: ``<tokenizer name>|<token_size>``, the token count,
  and the count humanised (e.g. ``1.23 MT``). datatrove reads the token size from the first line.

A directory of shards is read in sorted file-name order as ONE concatenated token stream by
:class:`TokenFiles`.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from densetrain import storage
from densetrain.errors import DataError
from densetrain.fileio import MAX_CONFIG_BYTES, ReadRefused, atomic_write_bytes

SHARD_MAX_TOKENS = 1 << 26
"""Max tokens per train shard file (64 Mi) that ``prepare`` and the datatrove pipeline write; a longer
single document gets a shard of its own."""

SHARD_SUFFIXES = (".ds", ".ds.index", ".ds.metadata", ".ds.loss")
"""The endings of a shard's files (``.ds.loss``: datatrove's loss mask, never written here): what a new prepare
deletes of an earlier one's in a split folder, local or in the object store."""

_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


def token_size_for(vocab_size: int) -> int:
    """Bytes per token: 2 (uint16) when every id fits (``vocab_size <= 65536``), else 4 (uint32).

    Same rule as datatrove.
    """
    return 2 if vocab_size <= 65536 else 4


def token_dtype(token_size: int) -> np.dtype:
    """The little-endian numpy dtype of a token size (2 -> ``<u2``, 4 -> ``<u4``).

    Raises:
        DataError: ``token_size`` is not 2 or 4.
    """
    try:
        return _DTYPES[int(token_size)]
    except KeyError:
        raise DataError(f"token_size must be 2 or 4 bytes, got {token_size}") from None


def _humanize(n: int) -> str:
    """Metric-prefixed token count, like datatrove's metadata (``1.23 MT``)."""
    for div, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g} {prefix}T"
    return f"{n} T"


def _ds_path(path_prefix: str | os.PathLike) -> Path:
    p = Path(path_prefix)
    return p if p.name.endswith(".ds") else p.with_name(p.name + ".ds")


def write_shard(
    path_prefix: str | os.PathLike,
    docs_tokens: list[np.ndarray],
    token_size: int,
    tokenizer_name: str = "Unknown Tokenizer",
) -> dict:
    """Write one shard atomically: ``PREFIX.ds``, ``PREFIX.ds.metadata``, then ``PREFIX.ds.index`` last.

    Each file goes through temp file + fsync + rename; the index is written last so that its
    presence means the shard is complete.

    Args:
        path_prefix: ``dir/000000`` or ``dir/000000.ds``.
        docs_tokens: one 1-D integer array (or list) per document, EOS already appended (and BOS
            prepended, for a tokenizer with one).
        token_size: 2 (uint16) or 4 (uint32) bytes per token.
        tokenizer_name: written into the ``.metadata`` file.

    Returns:
        ``{'file': name of the .ds, 'tokens': int, 'documents': int, 'max_token': the largest id (-1 when
        empty), 'sha256': of the .ds, 'index_sha256': of the .ds.index, 'mtime_ns' / 'index_mtime_ns': of
        the written files}`` (the mtimes are the fast path of :func:`check_shard_hashes`; ``max_token``
        spares :meth:`TokenFiles.check_vocab` a read of the shard).

    Raises:
        DataError: a token id is negative or does not fit in ``token_size`` bytes.
    """
    dtype = token_dtype(token_size)
    ds = _ds_path(path_prefix)
    arrays = [np.asarray(t) for t in docs_tokens]
    lengths = np.array([a.size for a in arrays], dtype=np.uint64)
    flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    hi = -1
    if flat.size:
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0 or hi > np.iinfo(dtype).max:
            raise DataError(f"{ds}: token id {lo if lo < 0 else hi} does not fit in {token_size} bytes")
    data = flat.astype(dtype, copy=False).tobytes()
    index = np.cumsum(lengths, dtype=np.uint64).astype("<u8").tobytes()
    n_tokens = int(lengths.sum())
    atomic_write_bytes(ds, data)
    meta = f"{tokenizer_name}|{token_size}\n{n_tokens}\n{_humanize(n_tokens)}"
    atomic_write_bytes(ds.with_name(ds.name + ".metadata"), meta.encode())
    atomic_write_bytes(ds.with_name(ds.name + ".index"), index)
    return {
        "file": ds.name,
        "tokens": n_tokens,
        "documents": len(arrays),
        "max_token": hi,
        "sha256": hashlib.sha256(data).hexdigest(),
        "index_sha256": hashlib.sha256(index).hexdigest(),
        "mtime_ns": ds.stat().st_mtime_ns,
        "index_mtime_ns": ds.with_name(ds.name + ".index").stat().st_mtime_ns,
    }


# (file suffix, manifest key of its sha256, manifest key of its mtime) of the two files a shard entry hashes
_HASHED = (("", "sha256", "mtime_ns"), (".index", "index_sha256", "index_mtime_ns"))


def check_shard_hashes(src_dir: Path, shards: list[dict], where: str | os.PathLike, full: bool = False,
                       record: bool = False) -> int:
    """Check a source's shard files against the sha256s its manifest records (entries as returned by
    :func:`write_shard`, ``path`` relative to ``src_dir``), so that token ids edited in place — same
    size, so the token counts still agree — never train silently.

    Fast path: a file whose mtime equals the recorded ``mtime_ns`` is taken as unchanged (one stat, no
    read); any other file is hashed (a full read). An entry with no recorded mtime (a manifest of an
    older densetrain) is hashed only when ``record`` (``prepare`` does, once, and records the mtimes),
    so a start of training never reads a whole corpus; ``full`` hashes every file
    (``densetrain prepare --verify``). A file that hashes equal but has a new mtime (copied without
    ``cp -p``) gets its new mtime written into the entry, in place.

    Args:
        where: the manifest, named in the error.

    Returns: how many entries were updated in place (the caller may rewrite the manifest).
    Raises:
        DataError: one line naming the first shard file whose sha256 differs from the manifest's.
    """
    updated = 0
    for sh in shards:
        ds = storage.join(src_dir, sh["path"])
        for suffix, sha_key, time_key in _HASHED:
            if sha_key not in sh:  # a registered datatrove folder records no sha256 of its .ds
                continue
            f = _companion(ds, suffix)
            mtime = storage.stat(f)[1]  # an object's ETag: never a recorded mtime, so hashed (once: storage.sha256)
            if not full and (mtime == sh.get(time_key) or (time_key not in sh and not record)):
                continue
            got = sha256_file(f)
            if got != sh[sha_key]:
                raise DataError(f"{f}: sha256 {got[:12]} differs from {sh[sha_key][:12]} in {where}: the shard "
                                "changed after `densetrain prepare` (edited in place?); re-run `densetrain prepare`")
            if sh.get(time_key) != mtime:
                sh[time_key] = mtime
                updated += 1
    return updated


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes, read in ``chunk`` pieces (no size limit: a shard may be many GB); a URL's
    once per object version (:func:`densetrain.storage.sha256`).

    Raises: ReadRefused (an OSError): not a regular file (a link to /dev/zero would be hashed forever)."""
    return storage.sha256(path, chunk)


def _companion(ds, suffix: str):
    """The file ``ds`` + ``suffix`` beside shard ``ds`` (a Path, or a URL string)."""
    return Path(f"{ds}{suffix}") if isinstance(ds, Path) else f"{ds}{suffix}"


def _read_metadata_token_size(ds) -> int | None:
    meta = _companion(ds, ".metadata")
    if not storage.isfile(meta):
        return None
    first = storage.read_bytes(meta, MAX_CONFIG_BYTES).decode("utf-8", errors="replace").split("\n", 1)[0]
    if "|" in first:
        tail = first.rsplit("|", 1)[1].strip()
        if tail.isdigit():
            return int(tail)
    return None


def _read_index(idx, ds, n_tokens: int) -> np.ndarray:
    """The document END offsets of ``idx`` (int64), checked against its ``.ds`` of ``n_tokens`` tokens.

    Raises:
        DataError: the index size is not a multiple of 8 bytes, an end decreases (or does not fit
            int64), or the last end is not the file's token count.
    """
    try:
        data = storage.read_bytes(idx, 8 * (n_tokens + 1))  # one end per document, at most one per token
    except ReadRefused as e:
        raise DataError(f"{idx}: not a document index of {storage.name(ds)} ({e.strerror})") from None
    if len(data) % 8:
        raise DataError(f"{idx}: size {len(data)} bytes is not a multiple of 8 (uint64 document ends); torn write?")
    ends = np.frombuffer(data, dtype="<u8")
    if ends.size and int(ends.max()) > np.iinfo(np.int64).max:
        raise DataError(f"{idx}: document end {int(ends.max())} is not a token offset (corrupt index)")
    ends = ends.astype(np.int64)
    if ends.size and np.any(np.diff(ends) < 0):
        k = int(np.argmax(np.diff(ends) < 0)) + 1
        raise DataError(f"{idx}: document ends decrease at document {k} ({int(ends[k - 1])} -> {int(ends[k])})")
    if (int(ends[-1]) if ends.size else 0) != n_tokens:
        last = f"last document end is {int(ends[-1])}" if ends.size else "empty index"
        raise DataError(f"{idx}: document ends do not match {storage.name(ds)}: {last} but the file holds "
                        f"{n_tokens} tokens")
    return ends


class TokenFiles:
    """All ``*.ds`` files of a directory (sorted by name) read as ONE concatenated token stream.

    Files are memory-mapped (a URL's are read by byte ranges through a bounded local cache,
    :func:`densetrain.storage.open_array`); nothing is read until asked. The token size comes from the
    ``token_size`` argument, else from the ``.ds.metadata`` files (datatrove writes them), else 2
    (datatrove's default). Each file's ``.ds.index`` gives its document ends; a file without one
    counts as a single document.

    Args:
        path: a directory, one ``.ds`` file, or a list of ``.ds`` files (kept in the given order); local paths
            or URLs (``s3://...``).
        token_size: 2 or 4 bytes per token; ``None`` to read it from the metadata.

    Raises:
        DataError: no ``.ds`` file found, a file size is not a multiple of the token size, an index
            is inconsistent with its file, or the metadata files disagree on the token size.
    """

    def __init__(self, path: str | os.PathLike | list, token_size: int | None = None):
        if isinstance(path, (list, tuple)):
            files = [storage.join(p) for p in path]
        else:
            p = storage.join(path)
            if storage.isdir(p):
                files = [storage.join(p, n) for n in storage.listdir(p) if n.endswith(".ds") and not n.startswith(".")]
                files = [f for f in files if storage.isfile(f)]
            elif storage.isfile(p):
                files = [p]
            else:
                raise DataError(f"{p}: no such shard file or directory")
        if not files:
            raise DataError(f"{path}: no .ds token files")
        self.files: list = files  # Paths, or URL strings
        if token_size is None:
            sizes = {s for s in (_read_metadata_token_size(f) for f in files) if s is not None}
            if len(sizes) > 1:
                raise DataError(f"{path}: shards disagree on token size {sorted(sizes)} (.ds.metadata)")
            token_size = sizes.pop() if sizes else 2
        self.token_size = int(token_size)
        self.dtype = token_dtype(self.token_size)
        self._maps: list = []  # np.memmap, or storage.RemoteArray for a URL
        self._ends: list[np.ndarray] = []
        lengths = []
        for f in files:
            nbytes = storage.stat(f)[0]
            if nbytes % self.token_size:
                raise DataError(f"{f}: size {nbytes} bytes is not a multiple of the token size {self.token_size}")
            n = nbytes // self.token_size
            mm = storage.open_array(f, self.dtype)
            self._maps.append(mm)
            lengths.append(n)
            idx = _companion(f, ".index")
            if storage.isfile(idx):
                ends = _read_index(idx, f, n)
            else:
                ends = np.array([n] if n else [], dtype=np.int64)
            self._ends.append(ends)
        self._lengths = np.array(lengths, dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(self._lengths)[:-1]]).astype(np.int64)
        self._total = int(self._lengths.sum())
        self._doc_ends: np.ndarray | None = None
        self._max: dict[int, int] = {}
        self.vocab_size: int | None = None  # set by check_vocab: every read() is then checked against it

    def __len__(self) -> int:
        """Total number of tokens over all files."""
        return self._total

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens ``[start, start + n)`` of the concatenated stream as an int64 array of shape (n,).

        The range may cross file boundaries.

        Raises:
            IndexError: the range is not inside ``[0, len(self))``.
            DataError: after :meth:`check_vocab`, the range holds an id >= its ``vocab_size`` (one max over
                the n tokens read: ~2 us for a 4k window).
        """
        start, n = int(start), int(n)
        if start < 0 or n < 0 or start + n > self._total:
            raise IndexError(f"token range [{start}, {start + n}) outside [0, {self._total})")
        out = np.empty(n, dtype=np.int64)
        for i, off, pos, take in self._pieces(start, n):
            out[pos : pos + take] = self._maps[i][off : off + take]
        if self.vocab_size is not None and n and int(out.max()) >= self.vocab_size:
            self._out_of_vocab(start, out)
        return out

    @property
    def prefetches(self) -> bool:
        """Whether :meth:`prefetch` does anything: some file is read by byte ranges (a URL), not memory-mapped."""
        return any(hasattr(m, "prefetch") for m in self._maps)

    def prefetch(self, start: int, n: int) -> None:
        """Start fetching tokens ``[start, start + n)`` in the background (no-op for memory-mapped files, whose
        pages the OS reads ahead); a later :meth:`read` of them then finds them in the local cache. A range
        outside the stream is ignored (a hint, not a read)."""
        start, n = int(start), int(n)
        if start < 0 or n <= 0 or start + n > self._total:
            return
        for i, off, _, take in self._pieces(start, n):
            if hasattr(self._maps[i], "prefetch"):
                self._maps[i].prefetch(off, off + take)

    def _pieces(self, start: int, n: int):
        """The files holding tokens ``[start, start + n)`` (a range inside the stream), in order: ``(file index,
        offset in that file, offset in the range, count)`` per non-empty piece; :meth:`read` and :meth:`prefetch`."""
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        pos = 0
        while pos < n:
            off = start + pos - int(self._starts[i])
            take = min(n - pos, int(self._lengths[i]) - off)
            if take > 0:
                yield i, off, pos, take
                pos += take
            i += 1

    def _out_of_vocab(self, start: int, out: np.ndarray) -> None:
        """Raise the one line for a read ``out`` (from token ``start``) holding an id >= :attr:`vocab_size`:
        a file :meth:`check_vocab` passed on its manifest's word (or that changed since) is wrong here, and
        an embedding lookup would end in an IndexError (or a CUDA assert) inside the step."""
        at = start + int(np.argmax(out >= self.vocab_size))
        i = int(np.searchsorted(self._starts, at, side="right")) - 1
        off = at - int(self._starts[i])
        raise DataError(f"{self.files[i]}: token id {int(out[at - start])} >= vocabulary size {self.vocab_size} at "
                        f"token offset {off}, though its manifest records a smaller largest id (the file changed "
                        "after prepare, or was made with another tokenizer); re-run densetrain prepare")

    def doc_ends(self) -> np.ndarray:
        """Global cumulative document END offsets (tokens, int64), over all files in order."""
        if self._doc_ends is None:
            parts = [e + s for e, s in zip(self._ends, self._starts)]
            self._doc_ends = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return self._doc_ends

    @property
    def n_docs(self) -> int:
        """Number of documents over all files."""
        return int(self.doc_ends().size)

    def document(self, k: int) -> np.ndarray:
        """Tokens of document ``k`` (its BOS, if any, and EOS included), int64."""
        ends = self.doc_ends()
        start = int(ends[k - 1]) if k > 0 else 0
        return self.read(start, int(ends[k]) - start)

    def max_token(self) -> int:
        """Largest token id over all files (-1 when empty); one full pass, cached per file."""
        best = -1
        for i, mm in enumerate(self._maps):
            if i not in self._max:
                self._max[i] = int(mm.max()) if mm.size else -1
            best = max(best, self._max[i])
        return best

    def check_vocab(self, vocab_size: int, recorded: list[int | None] | None = None) -> None:
        """Check that every token id is < ``vocab_size``, reading only the files that need it.

        A file is not read when its token size holds no id >= ``vocab_size`` (uint16 and ``vocab_size``
        >= 65536) or when ``recorded`` gives its largest id below ``vocab_size``; any other file is read
        once (max over the memmap; the per-file maxima are cached), and a failing one again, to locate
        the offending token.

        Args:
            recorded: per file of :attr:`files`, its largest id as its manifest recorded it (``max_token``
                of :func:`write_shard`; only for a file the manifest's sha256 check has vouched for), or
                None where unknown. ``vocab_size`` is kept: every later :meth:`read` checks its tokens against it
                (cheaply), so a file vouched for by its manifest but holding a larger id still fails with one line.
        Raises:
            DataError: naming the first file holding an id >= ``vocab_size``, its largest id, the
                token offset (within the file) and document of that id, and how many ids are out of range.
        """
        self.vocab_size = int(vocab_size)
        for i, (f, mm) in enumerate(zip(self.files, self._maps)):
            known = recorded[i] if recorded is not None else None
            if np.iinfo(self.dtype).max < vocab_size or (known is not None and known < vocab_size):
                continue
            if i not in self._max:
                self._max[i] = int(mm.max()) if mm.size else -1
            if self._max[i] >= vocab_size:
                mm = np.asarray(mm)  # the whole file: only to name the offending token
                off = int(np.argmax(mm))  # first position of the largest id
                doc = int(np.searchsorted(self._ends[i], off, side="right"))
                n_bad = int(np.count_nonzero(mm >= vocab_size))
                raise DataError(
                    f"{f}: token id {self._max[i]} >= vocabulary size {vocab_size} at token offset {off} "
                    f"(document {doc} of the file; {n_bad} of {mm.size} ids out of range) "
                    "(shards made with another tokenizer? check data.tokenizer and model.vocab_size)"
                )

    def __repr__(self) -> str:
        return f"TokenFiles({len(self.files)} files, {self._total} tokens, token_size={self.token_size})"
