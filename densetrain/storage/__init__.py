"""Where a path may be a URL: local files and object storage (``s3://``, ``gs://``, any fsspec protocol) behind
one set of functions, used by the shard reader, the checkpointer and the run-file readers the way
:mod:`densetrain.fileio` is. Nothing above this module tests whether a path is remote.

- **Local paths** go to the file system as before (:mod:`densetrain.fileio`'s bounded reads, ``np.memmap``);
  their behaviour is exactly that of a run without object storage.
- **URLs** go through fsspec and the protocol's well-kept client (``s3fs``, ``gcsfs``: ``pip install
  'densetrain[s3]'``). Credentials come from the client's own chain (environment, config files, instance
  role) and are never logged; an S3-compatible endpoint from ``AWS_ENDPOINT_URL``, the client's setting.
- **Retries** (:func:`retrying`, :mod:`densetrain.storage.retry`): a transient error (HTTP 5xx, ``SlowDown``, a
  timeout, a reset connection) is retried with exponential backoff (0.2 s doubling to 5 s) for up to
  ``DENSETRAIN_STORE_RETRY_S`` seconds (default 120) in all; each retry is counted in :data:`counters`
  (``store_retries``, in the training log). Past the budget, :class:`StoreUnavailable`. Not found and permission
  errors are not retried.
  s3fs's own retries are turned off so that every retry is counted here; gcsfs retries each request itself
  (6 tries over ~31 s, fixed when it is imported), so a gs:// outage is noticed that much later and those tries
  are not counted. Each request waits at most ``DENSETRAIN_STORE_TIMEOUT_S`` seconds (default 10) to connect
  and to read its answer (S3 and GCS).
- **Range reads with a bounded local cache** (:class:`RemoteArray`): a remote shard is read in 1 MiB blocks,
  each kept in a local cache directory (``DENSETRAIN_STORE_CACHE``, default ``~/.cache/densetrain/store``)
  bounded to ``DENSETRAIN_STORE_CACHE_MIB`` (default 16384 MiB; least recently used blocks go first). Blocks
  are fetched ahead in the background by up to :data:`PREFETCH_THREADS` range reads: those of the next
  batch's windows, which the sampler names (:meth:`RemoteArray.prefetch`, a window of one batch), and after a
  miss the next :data:`PREFETCH_BLOCKS` (file order). Hits and misses are counted (``store_cache_hits``,
  ``store_cache_misses``: blocks asked for by a read; a block being prefetched counts as a hit).
  A background fetch that fails (an outage past the retry budget) is raised by the next read of that block, once.
- **Digests once** (:func:`sha256`): a remote file's sha256 is computed by one streaming read (which also
  fills the cache) and remembered in the cache under its ETag, so a later run does not read it again.
- **Trees** (:func:`put_tree`, :func:`get_tree`, :func:`move_tree`, :func:`remove_tree`): a folder is uploaded
  (or moved) with its marker files last (``last``), so a reader that waits for the marker never reads a partial
  upload.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from densetrain.errors import ConfigError, DataError
from densetrain.fileio import ReadRefused, atomic_write_bytes, open_regular, parse_json_line, read_bytes_bounded
from densetrain.storage.retry import StoreUnavailable, _count, counters, retry_seconds, retrying

__all__ = ["StoreUnavailable", "counters", "retry_seconds", "retrying"]  # also importable from here

BLOCK_BYTES = 1 << 20
"""Bytes per range read and cache block: 1 MiB. Below ~1 MiB an object store's GET costs about its latency
whatever the size (tens of ms); larger blocks only add bytes that a shuffled window (seq_len + 1 tokens, a few
KiB to 32 KiB) does not use."""
PREFETCH_BLOCKS = 8
"""Blocks fetched ahead in the background after a miss (an 8 MiB window: reading in file order)."""
PREFETCH_THREADS = 16
"""Range reads in flight at once: the windows of the next batch (:meth:`RemoteArray.prefetch`) and readahead."""
_lock = threading.Lock()

def is_remote(path) -> bool:
    """Whether ``path`` names an fsspec URL other than ``file://`` (for this module and its tests)."""
    s = os.fspath(path) if isinstance(path, os.PathLike) else path
    return isinstance(s, str) and "://" in s and not s.startswith("file://")


_fs_cache: dict[str, object] = {}


def _fs(path):
    """(filesystem, path without protocol) of URL ``path``. Listings are not cached (another process adds and
    deletes checkpoints); s3fs's own retries are off (:func:`retrying` counts each; gcsfs keeps its own); short
    timeouts so that a store that stops answering is noticed in seconds, not minutes."""
    from fsspec.core import split_protocol, url_to_fs  # fsspec only where a URL is used

    protocol = split_protocol(path)[0]
    fs = _fs_cache.get(protocol)
    if fs is None:
        opts: dict = {"use_listings_cache": False, "skip_instance_cache": True}
        if protocol in ("s3", "s3a"):
            timeout = float(os.environ.get("DENSETRAIN_STORE_TIMEOUT_S", "10"))
            opts["config_kwargs"] = {"retries": {"total_max_attempts": 1, "mode": "standard"},
                                     "connect_timeout": timeout, "read_timeout": timeout}
        elif protocol in ("gs", "gcs"):  # gcsfs passes no timeout to aiohttp by default: a stalled store hangs
            from aiohttp import ClientTimeout  # gcsfs's HTTP client, only where a gs:// URL is used

            timeout = float(os.environ.get("DENSETRAIN_STORE_TIMEOUT_S", "10"))
            opts["requests_timeout"] = ClientTimeout(sock_connect=timeout, sock_read=timeout)
        try:
            fs, _ = url_to_fs(path, **opts)
        except ImportError as e:  # s3fs / gcsfs not installed
            raise ConfigError(f"{path}: the {protocol}:// protocol needs its fsspec client: pip install "
                              f"'densetrain[s3]' (or gcsfs for gs://) ({e})") from None
        except ValueError as e:  # fsspec knows no such protocol (e.g. S3://: its names are lower case)
            raise ConfigError(f"{path}: {e}; expected an fsspec URL such as s3://bucket/path or gs://bucket/path") \
                from None
        if hasattr(fs, "retries"):
            fs.retries = 1
        if protocol in ("s3", "s3a"):
            _no_expect_continue(fs)
        _fs_cache[protocol] = fs
    return fs, fs._strip_protocol(path)


def _no_expect_continue(fs) -> None:
    """Make s3fs's client send uploads without ``Expect: 100-continue`` (botocore adds it to every PUT with a
    file body): aiohttp waits for the ``100 Continue`` answer with no timeout, so a store that accepts the
    connection and then stops answering held an upload for ever (measured: 569 s until the store came back,
    read_timeout 1 s); without it the upload's answer is waited for under ``read_timeout`` like any other."""
    from botocore.handlers import add_expect_header
    from fsspec.asyn import sync

    sync(fs.loop, fs.set_session)  # the client, made now (no request is sent)
    fs.s3.meta.events.unregister("before-call.s3", add_expect_header)


# --------------------------------------------------------------------------------------------------
# Paths
# --------------------------------------------------------------------------------------------------

def join(base, *parts):
    """``base / parts``: a Path for a local ``base``, a ``/``-joined string for a URL."""
    if is_remote(base):
        return "/".join([str(base).rstrip("/"), *(str(p).strip("/") for p in parts)])
    return Path(base).joinpath(*parts)


def name(path) -> str:
    """The last component of ``path`` (a file or folder name)."""
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def parent(path):
    """The folder holding ``path``."""
    return str(path).rstrip("/").rsplit("/", 1)[0] if is_remote(path) else Path(path).parent


def canonical(path):
    """One name per file, to compare two spellings: the resolved path (symlinks followed), or the URL itself."""
    return path if is_remote(path) else Path(path).resolve()


def _kind(path) -> str | None:
    """'file', 'directory' or None (absent) of URL ``path``; unlike fsspec's ``isfile`` / ``exists``, which
    answer False on any error, a transient error is retried and an outage raised (StoreUnavailable)."""
    fs, p = _fs(path)
    try:
        return retrying(str(path), fs.info, p).get("type")
    except FileNotFoundError:
        return None


def exists(path) -> bool:
    return Path(path).exists() if not is_remote(path) else _kind(path) is not None


def isdir(path) -> bool:
    return Path(path).is_dir() if not is_remote(path) else _kind(path) == "directory"


def isfile(path) -> bool:
    return Path(path).is_file() if not is_remote(path) else _kind(path) == "file"


def listdir(path) -> list[str]:
    """Sorted names in folder ``path`` (files and folders); [] when it does not exist."""
    if not is_remote(path):
        return sorted(p.name for p in Path(path).iterdir()) if Path(path).is_dir() else []
    fs, p = _fs(path)
    try:
        entries = retrying(str(path), fs.ls, p, detail=False)
    except FileNotFoundError:
        return []
    # Some stores list the folder itself (its marker object): left out by its whole path, not by its name, which a
    # child may share (s3://b/train/train: the source "train"'s split "train" was left out).
    return sorted(name(e) for e in entries if e.rstrip("/") != p.rstrip("/"))


def stat(path) -> tuple[int, str | int]:
    """(size in bytes, version) of file ``path``: the version is ``st_mtime_ns`` locally, the object's ETag
    remotely; either changes when the file is rewritten. Raises: FileNotFoundError; StoreUnavailable."""
    if not is_remote(path):
        st = Path(path).stat()
        return st.st_size, st.st_mtime_ns
    fs, p = _fs(path)
    info = retrying(str(path), fs.info, p)
    if info.get("type") == "directory":
        raise IsADirectoryError(str(path))
    return int(info["size"]), str(info.get("ETag") or info.get("etag") or info.get("md5Hash") or info.get("mtime"))


# --------------------------------------------------------------------------------------------------
# Reads
# --------------------------------------------------------------------------------------------------

def read_bytes(path, max_bytes: int) -> bytes:
    """The bytes of file ``path``, at most ``max_bytes`` (:func:`densetrain.fileio.read_bytes_bounded` locally).

    Raises: ReadRefused (over the limit, not a regular file); FileNotFoundError; StoreUnavailable."""
    if not is_remote(path):
        return read_bytes_bounded(path, max_bytes)
    size, _ = stat(path)
    if size > max_bytes:
        raise ReadRefused(path, f"{size} bytes, larger than the {max_bytes}-byte limit for this file")
    fs, p = _fs(path)
    data = retrying(str(path), fs.cat_file, p)
    _count("store_bytes_fetched", len(data))
    return data


def read_json(path, max_bytes: int):
    """The JSON value in file ``path`` (:func:`read_bytes`). Raises: as read_bytes; json.JSONDecodeError."""
    return parse_json_line(read_bytes(path, max_bytes).decode("utf-8"), path)


def cache_dir() -> Path:
    """The local cache of remote reads (``DENSETRAIN_STORE_CACHE``, default ``~/.cache/densetrain/store``)."""
    return Path(os.environ.get("DENSETRAIN_STORE_CACHE", Path.home() / ".cache" / "densetrain" / "store"))


def cache_limit() -> int:
    """Bytes the cache's blocks may take (``DENSETRAIN_STORE_CACHE_MIB``, default 16384 MiB)."""
    return int(float(os.environ.get("DENSETRAIN_STORE_CACHE_MIB", "16384")) * (1 << 20))


def cache_key(path, version) -> str:
    return hashlib.sha256(f"{path}\n{version}".encode()).hexdigest()[:32]


def local_copy(path) -> Path:
    """A local path holding file ``path``'s bytes: ``path`` itself when local, else a copy in the cache
    (fetched once per ETag); for small files a library wants by path (a tokenizer.json)."""
    if not is_remote(path):
        return Path(path)
    size, version = stat(path)
    dest = cache_dir() / "files" / cache_key(path, version) / name(path)
    if not dest.is_file() or dest.stat().st_size != size:
        fs, p = _fs(path)
        data = retrying(str(path), fs.cat_file, p)
        _count("store_bytes_fetched", len(data))
        atomic_write_bytes(dest, data)
    return dest


class _BlockCache:
    """Blocks of remote files on local disk, least recently used evicted past :func:`cache_limit`."""

    def __init__(self):
        self.root = cache_dir() / "blocks"
        self.root.mkdir(parents=True, exist_ok=True)
        self.used = sum(f.stat().st_size for f in self.root.glob("*/*") if f.is_file())
        self.lock = threading.Lock()

    def path(self, key: str, block: int) -> Path:
        return self.root / key / f"{block:08d}"

    def get(self, key: str, block: int, lo: int = 0, hi: int | None = None) -> bytes | None:
        """Bytes ``[lo, hi)`` of a cached block (all of it by default), or None when it is not cached."""
        f = self.path(key, block)
        try:
            with open(f, "rb") as fh:
                fh.seek(lo)
                data = fh.read(-1 if hi is None else hi - lo)
        except OSError:
            return None
        with contextlib.suppress(OSError):
            os.utime(f)  # recency for eviction
        return data

    def put(self, key: str, block: int, data: bytes) -> None:
        limit = cache_limit()
        if len(data) > limit:
            return
        with self.lock:
            if self.used + len(data) > limit:
                # a tenth of the cache at a time: one listing per many blocks, not one per block
                self._evict(max(self.used + len(data) - limit, limit // 10))
        # Renamed into place whole (another process may read it now), not fsynced: a cache, not a record.
        f = self.path(key, block)
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_name(f".{f.name}.tmp{os.getpid()}-{threading.get_ident()}")
        tmp.write_bytes(data)
        os.replace(tmp, f)
        with self.lock:
            self.used += len(data)

    def _evict(self, need: int) -> None:
        files = sorted((f.stat().st_mtime_ns, f) for f in self.root.glob("*/[0-9]*") if f.is_file())
        for _, f in files:
            if need <= 0:
                break
            n = f.stat().st_size
            f.unlink(missing_ok=True)
            self.used -= n
            need -= n


_cache: _BlockCache | None = None
_pool: ThreadPoolExecutor | None = None


def _shared() -> tuple[_BlockCache, ThreadPoolExecutor]:
    global _cache, _pool
    with _lock:
        if _cache is None or _cache.root != cache_dir() / "blocks":
            _cache = _BlockCache()
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=PREFETCH_THREADS, thread_name_prefix="densetrain-prefetch")
    return _cache, _pool


class ObjectChanged(DataError):
    """A remote shard's object differs from the version this run opened and verified (its ETag or size moved):
    the data under the run changed, which no retry or resume on the same URL mends."""


class RemoteArray:
    """A 1-D token array of a remote file read by byte ranges through the block cache: ``arr[a:b]`` reads only
    the blocks it covers (and prefetches the next :data:`PREFETCH_BLOCKS` in the background on a miss).

    Args:
        path: the file's URL. dtype: its element type. size: its length in bytes. version: its ETag.
    """

    def __init__(self, path: str, dtype: np.dtype, size: int, version):
        self.path, self.dtype, self.nbytes = path, np.dtype(dtype), int(size)
        self.size = self.nbytes // self.dtype.itemsize
        self.shape = (self.size,)
        self.key, self.version = cache_key(path, version), version
        self._inflight: dict[int, object] = {}
        self._failed: dict[int, BaseException] = {}  # block -> its background fetch's error, not yet raised
        self._ilock = threading.Lock()

    def _fetch(self, block: int) -> bytes:
        cache, _ = _shared()
        data = cache.get(self.key, block)
        if data is not None:
            return data
        fs, p = _fs(self.path)
        start = block * BLOCK_BYTES
        end = min(start + BLOCK_BYTES, self.nbytes)
        try:
            data = retrying(self.path, fs.cat_file, p, start=start, end=end)
        except FileNotFoundError as e:  # the object or its bucket deleted (a store restarted empty) under the run
            raise ObjectChanged(f"{self.path}: gone from the object store since this run opened it ({e}); nothing "
                                f"of it was read: restore it (prepare again into that URL), then --resume") from None
        # A range read names no object version, so an object rewritten in the store mid-run (prepare re-run into
        # the same URL, another job) would be read and trained on, past the manifest's sha256 that vetted the version
        # this run opened. One HEAD after each fetched block sees any change that could have reached its bytes.
        size, version = stat(self.path)
        if cache_key(self.path, version) != self.key or size != self.nbytes or len(data) != end - start:
            raise ObjectChanged(f"{self.path}: changed in the object store since this run verified it against its "
                                f"manifest (version {self.version} -> {version}, {self.nbytes} -> {size} bytes); "
                                f"nothing of the new object was used: prepare into a new URL and start a new run, "
                                f"or restore the object and --resume")
        _count("store_bytes_fetched", len(data))
        cache.put(self.key, block, data)
        return data

    def _part(self, block: int, lo: int, hi: int) -> bytes:
        """Bytes ``[lo, hi)`` of ``block``: from the cache (a hit, also when a prefetch of it is under way), else
        fetched now (a miss), which also starts the readahead of the next :data:`PREFETCH_BLOCKS`."""
        cache, _ = _shared()
        data = cache.get(self.key, block, lo, hi)
        if data is not None:
            _count("store_cache_hits")
            return data
        with self._ilock:
            fut, failed = self._inflight.get(block), self._failed.pop(block, None)
        if failed is not None:  # its prefetch failed (an outage past the retry budget): said here, once
            raise failed
        if fut is not None:  # being prefetched: wait for it rather than fetching twice
            _count("store_cache_hits")
            return fut.result()[lo:hi]
        _count("store_cache_misses")
        data = self._fetch(block)
        last = (self.nbytes - 1) // BLOCK_BYTES
        self._submit(range(block + 1, min(block + 1 + PREFETCH_BLOCKS, last + 1)))
        return data[lo:hi]

    def _submit(self, blocks) -> None:
        """Fetch ``blocks`` in the background, those not cached nor already under way."""
        cache, pool = _shared()
        for b in blocks:
            with self._ilock:
                if b in self._inflight or cache.path(self.key, b).exists():
                    continue
                fut = pool.submit(self._fetch, b)
                self._inflight[b] = fut
                self._failed.pop(b, None)  # fetched again: an earlier failure is no longer news
            fut.add_done_callback(lambda f, b=b: self._drop(b, f))

    def prefetch(self, a: int, b: int) -> None:
        """Fetch the blocks holding elements ``[a, b)`` in the background (the windows of the next batch)."""
        lo, hi = a * self.dtype.itemsize, b * self.dtype.itemsize
        if hi > lo:
            self._submit(range(lo // BLOCK_BYTES, (hi - 1) // BLOCK_BYTES + 1))

    def _drop(self, block: int, fut) -> None:
        """A background fetch ended: a failure is kept for the next read of that block to raise (a prefetch that
        waited out the retry budget is an outage the reader must hear of, not a lost exception in a thread)."""
        with self._ilock:
            self._inflight.pop(block, None)
            if not fut.cancelled() and fut.exception() is not None:
                self._failed[block] = fut.exception()

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            return np.asarray(self)[key]
        a, b, _ = key.indices(self.size)
        if b <= a:
            return np.zeros(0, dtype=self.dtype)
        lo, hi = a * self.dtype.itemsize, b * self.dtype.itemsize
        parts = [self._part(k, max(lo - k * BLOCK_BYTES, 0), min(hi - k * BLOCK_BYTES, BLOCK_BYTES))
                 for k in range(lo // BLOCK_BYTES, (hi - 1) // BLOCK_BYTES + 1)]
        return np.frombuffer(b"".join(parts), dtype=self.dtype)

    def __array__(self, dtype=None, copy=None):
        arr = self[0:self.size]
        return arr.astype(dtype) if dtype is not None else arr

    def max(self):
        return np.asarray(self).max()


def open_array(path, dtype) -> np.ndarray | RemoteArray:
    """File ``path`` as a read-only 1-D array of ``dtype``: ``np.memmap`` locally, a :class:`RemoteArray`
    for a URL (range reads through the cache). An empty file gives an empty array."""
    size, version = stat(path)
    if size == 0:
        return np.zeros(0, dtype=dtype)
    if not is_remote(path):
        return np.memmap(path, dtype=dtype, mode="r")
    return RemoteArray(str(path), dtype, size, version)


def sha256(path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of file ``path``'s bytes. Remote: one streaming read of whole blocks, which also fill the
    cache; the digest is remembered in the cache under the object's ETag, so asking again reads nothing.

    Raises: ReadRefused (a local non-regular file); FileNotFoundError; StoreUnavailable."""
    if not is_remote(path):
        h = hashlib.sha256()
        with open_regular(path) as f:
            while b := f.read(chunk):
                h.update(b)
        return h.hexdigest()
    size, version = stat(path)
    key = cache_key(path, version)
    known = cache_dir() / "sha256" / key
    if known.is_file():
        return known.read_text().strip()
    arr = RemoteArray(str(path), np.uint8, size, version)
    h = hashlib.sha256()
    for block in range((size + BLOCK_BYTES - 1) // BLOCK_BYTES):
        h.update(arr._fetch(block))
    digest = h.hexdigest()
    atomic_write_bytes(known, digest.encode())
    return digest


# --------------------------------------------------------------------------------------------------
# Writes and trees
# --------------------------------------------------------------------------------------------------

def write_bytes(path, data: bytes) -> None:
    """Write file ``path`` whole: atomically locally (:func:`densetrain.fileio.atomic_write_bytes`); remotely
    one PUT, which an object store makes visible whole or not at all."""
    if not is_remote(path):
        atomic_write_bytes(Path(path), data)
        return
    fs, p = _fs(path)
    retrying(str(path), fs.pipe_file, p, data)


def put_tree(local: Path, target, last: tuple[str, ...] = ()) -> None:
    """Copy folder ``local`` (recursively; not its hidden folders nor temp files) to ``target`` (a URL or a local
    folder), the files named in ``last``
    (at any depth) after all others, in that order, so their presence means the rest is there.

    Raises: StoreUnavailable; OSError."""
    local = Path(local)
    # Not: temp files of killed writers (.NAME.tmpPID), hidden folders (a prepare's .decontam cache). DCP's
    # .metadata is a hidden file and goes.
    files = sorted(p for p in local.rglob("*") if p.is_file() and not re.fullmatch(r"\..+\.tmp\d+", p.name)
                   and not any(d.startswith(".") for d in p.relative_to(local).parts[:-1]))
    ordered = [f for f in files if f.name not in last] + sorted(
        (f for f in files if f.name in last), key=lambda f: (last.index(f.name), -len(f.parts)))
    for f in ordered:
        dest = join(target, *f.relative_to(local).parts)
        if is_remote(target):
            fs, p = _fs(dest)
            retrying(dest, fs.put_file, str(f), p)
        else:
            atomic_write_bytes(Path(dest), f.read_bytes())


def get_tree(source, local: Path) -> None:
    """Copy folder ``source`` (recursively) into the local folder ``local``. Raises: StoreUnavailable; OSError."""
    local = Path(local)
    if not is_remote(source):
        shutil.copytree(source, local, dirs_exist_ok=True)
        return
    fs, p = _fs(source)
    for f in retrying(str(source), fs.find, p):
        rel = f[len(p):].strip("/")
        dest = local / rel
        if f.endswith("/"):  # a folder marker object (the S3 console's "Create folder", Hadoop's s3a): no file
            dest.mkdir(parents=True, exist_ok=True)  # (fetched as one, the folder itself: FileExistsError)
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        retrying(f, fs.get_file, f, str(dest))
        _count("store_bytes_fetched", dest.stat().st_size)


def remove_tree(path) -> None:
    """Delete folder ``path`` and everything under it (nothing when it does not exist)."""
    if not is_remote(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    fs, p = _fs(path)
    with contextlib.suppress(FileNotFoundError):
        retrying(str(path), fs.rm, p, recursive=True)


def move_tree(source, target, last: tuple[str, ...] = ()) -> None:
    """Move folder ``source`` to ``target`` (on the same store; ``target`` must not exist). Locally one rename. An
    object store has no rename: the files named in ``last`` (in ``source`` itself) are deleted first and written
    to ``target`` after all others, so that while the objects are copied (on the store's side) and deleted, neither
    folder is listed as holding them (a reader waits for the marker, :func:`put_tree`).

    Raises: StoreUnavailable; OSError."""
    if not is_remote(source):
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        os.replace(source, target)
        return
    fs, p = _fs(source)
    held = {n: read_bytes(join(source, n), 16 << 20) for n in last if isfile(join(source, n))}
    for n in held:
        retrying(str(source), fs.rm_file, f"{p}/{n}")
    retrying(str(source), fs.copy, p, _fs(target)[1], recursive=True)
    for n, data in held.items():
        write_bytes(join(target, n), data)
    remove_tree(source)


def staging_dir(target) -> Path:
    """A local folder to write ``target``'s files into before :func:`publish`: ``target`` itself when local; for a
    URL a folder in the cache (kept, so that a second run finds what the first one wrote)."""
    if not is_remote(target):
        return Path(target)
    return cache_dir() / "staging" / cache_key(target, "staged")


def publish(local: Path, target, last: tuple[str, ...] = (), prune: tuple[str, ...] = ()) -> None:
    """Upload :func:`staging_dir` ``local`` to ``target`` (:func:`put_tree`, ``last`` files last); nothing when
    ``target`` is local (the files are already there). First, the files under ``target`` whose names end with one
    of ``prune``, in a subfolder that ``local`` has too, and that ``local`` does not hold are deleted: an upload adds
    and replaces objects, so what an earlier, larger publish left (a shard ``000003.ds`` where this one writes three)
    would stay and be read. Other folders (another data set beside these, in the same bucket) are not touched.

    Raises: StoreUnavailable; OSError."""
    if not is_remote(target):
        return
    if prune:
        fs, p = _fs(target)
        try:
            found = retrying(str(target), fs.find, p)
        except FileNotFoundError:
            found = []
        for f in found:
            rel = f[len(p):].strip("/")
            mine = Path(local) / rel
            if rel.endswith(prune) and "/" in rel and mine.parent.is_dir() and not mine.is_file():
                retrying(f, fs.rm_file, f)
    put_tree(local, target, last)
