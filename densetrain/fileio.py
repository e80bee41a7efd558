"""Atomic file writes: write to a temporary name in the same directory, fsync, rename.

A reader therefore sees either the old file or the complete new one, never a torn write, even if
the process is killed (kill -9) in the middle. What a killed writer leaves (``.NAME.tmpPID`` files,
``.NAME.tmp-PID`` / ``.NAME.old-PID`` folders of a dead PID) is swept by the next run
(:func:`sweep_stale_temps`, :func:`recover_folder_swap`); whole folders are swapped in one atomic
step where the OS can (:func:`exchange_paths`).

Every JSON file and printout of the project is strict JSON (RFC 8259), made by :func:`json_text`: a
non-finite float (a NaN loss, an infinite ratio) becomes ``null``, never Python's ``NaN`` / ``Infinity``,
which other JSON readers (browsers, jq, pandas) refuse.

Every file densetrain reads goes through :func:`open_regular` (or the readers built on it:
:func:`read_bytes_bounded`, :func:`read_text_bounded`, :func:`read_json`, :func:`read_jsonl`,
:func:`read_toml`, :func:`parse_json_line`): it must be a regular file once symlinks are followed (a link
to ``/dev/zero`` would be read until memory runs out, a FIFO would block the reader forever), no larger than a
limit where its kind implies one; JSON/TOML nested deeper than Python's parsers recurse is refused, not a
traceback. A refusal is a :class:`ReadRefused` (an ``OSError``, so every reader's "cannot read" handling and the
CLI's one line apply).
The documented exception: ``--config /dev/stdin`` style pipes are not supported; write the TOML to a file.
"""

from __future__ import annotations

import ctypes
import errno
import json
import math
import os
import re
import shutil
import stat
import tomllib
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """fsync a directory so that a rename inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file + fsync + rename + directory fsync).

    Raises: OSError (e.g. ENOSPC) after removing the temp file; ``path`` keeps its old content."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:  # a full disk, an interrupt: leave the old file and no temp file
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None:  # f.write names no file: name the one meant
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    fsync_dir(path.parent)


_TEMP_NAME = re.compile(r"\..+\.tmp(\d+)")  # the temp names of atomic_write_bytes: .NAME.tmpPID


def sweep_stale_temps(root: Path) -> list[Path]:
    """Delete the temp files :func:`atomic_write_bytes` left under ``root`` (recursively) when its process
    was killed: ``.NAME.tmpPID`` whose PID is no longer running (a live writer's temp files stay).

    Returns: the deleted paths.
    """
    removed = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            m = _TEMP_NAME.fullmatch(name)
            if m and not pid_alive(int(m.group(1))):
                path = Path(dirpath) / name
                path.unlink(missing_ok=True)
                removed.append(path)
    return removed


def finite_or_null(obj):
    """``obj`` (JSON values: dicts, lists, numbers, strings) with every NaN or infinite float replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_null(v) for v in obj]
    return obj


def json_text(obj, indent: int | None = None, **kw) -> str:
    """``obj`` as strict JSON text (non-finite floats as ``null``, module docstring); ``kw`` go to
    :func:`json.dumps` (e.g. ``default=str``). The one JSON encoder of the project's files and printouts."""
    return json.dumps(finite_or_null(obj), indent=indent, allow_nan=False, **kw)


def atomic_write_json(path: Path, obj) -> None:
    """Write ``obj`` as indented strict JSON (:func:`json_text`) atomically."""
    atomic_write_bytes(Path(path), (json_text(obj, indent=2) + "\n").encode())


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this machine (signal 0 probes without signalling); used to
    tell a temp file of a killed writer (sweep it) from one another writer is still filling."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def exchange_paths(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` (both must exist, files or directories) in one atomic step:
    Linux ``renameat2(RENAME_EXCHANGE)`` (kernel 3.15+, glibc 2.28+; ext4, xfs, btrfs, tmpfs, ...).

    Returns: False where the C library or the file system lacks it (the caller falls back to two
    renames). Raises: OSError for any other failure.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):  # not glibc / not Linux
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):  # the file system (NFS, old overlayfs) cannot
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def recover_folder_swap(target: Path) -> None:
    """Undo what a killed writer of folder ``target`` left next to it. Such a writer fills
    ``.NAME.tmp-PID`` and then puts it in place of ``target`` (an HF export, an imported run); one that
    cannot swap atomically first moves the old ``target`` to ``.NAME.old-PID``. For a PID no longer
    running: ``.old-PID`` goes back to ``target`` when that is missing (killed between the two renames),
    every other such folder is deleted. Folders of a live PID (a writer running now) are left alone."""
    target = Path(target)
    if not target.parent.is_dir():
        return
    left = []
    for p in target.parent.iterdir():
        m = re.fullmatch(rf"\.{re.escape(target.name)}\.(old|tmp)-(\d+)", p.name)
        if m and not pid_alive(int(m.group(2))):
            left.append((m.group(1) != "old", p))  # the old folder first: it may be restored
    for is_tmp, p in sorted(left):
        if not is_tmp and not target.exists():
            os.replace(p, target)
        else:
            shutil.rmtree(p, ignore_errors=True)
    if left:
        fsync_dir(target.parent)


# --------------------------------------------------------------------------------------------------
# Bounded, regular reads
# --------------------------------------------------------------------------------------------------

MAX_CONFIG_BYTES = 16 << 20
"""TOML configs, HF config.json, small run files (markers, state, manifests): 16 MiB; ours are a few KiB."""
MAX_JSON_BYTES = 1 << 30
"""Large JSON files (a tokenizer.json: Llama 3's is 9 MB, the largest HF ones ~40 MB): 1 GiB."""
_TOO_DEEP = "nested too deeply (Python's JSON/TOML parsers recurse once per level, ~1000 at most)"


class ReadRefused(OSError):
    """A file densetrain will not read: not a regular file, over its size limit, or nested too deeply.
    ``str()`` is one line: ``PATH: why``; ``strerror`` is the why alone."""

    def __init__(self, path, why: str):
        super().__init__(errno.EINVAL, why, str(path))

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def open_regular(path, max_bytes: int | None = None):
    """``path`` opened for binary reading after checking, on the opened descriptor (so a swap between check
    and read cannot slip through), that it is a regular file (symlinks followed) of at most ``max_bytes``.
    Opened non-blocking, so a FIFO is refused instead of waiting for a writer.

    Raises: ReadRefused (not a regular file, too large); FileNotFoundError / PermissionError as ``open``."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
            raise ReadRefused(path, f"is {kind}, expected a regular file" + (
                f" (a link to {os.path.realpath(path)})" if os.path.islink(path) else ""))
        if max_bytes is not None and st.st_size > max_bytes:
            raise ReadRefused(path, f"{st.st_size} bytes, larger than the {max_bytes}-byte limit for this file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes_bounded(path, max_bytes: int) -> bytes:
    """The bytes of regular file ``path`` (:func:`open_regular`), at most ``max_bytes`` (also when it grows
    while read). Raises: ReadRefused; OSError."""
    with open_regular(path, max_bytes) as f:
        # read(n) allocates n bytes up front: ask for the size the file has (+1 to see it grow), then read on
        # in 1 MiB pieces while it grows, up to the limit.
        data = f.read(min(os.fstat(f.fileno()).st_size, max_bytes) + 1)
        while len(data) <= max_bytes and (more := f.read(min(1 << 20, max_bytes + 1 - len(data)))):
            data += more
    if len(data) > max_bytes:
        raise ReadRefused(path, f"larger than the {max_bytes}-byte limit for this file")
    return data


def read_text_bounded(path, max_bytes: int = MAX_CONFIG_BYTES, errors: str = "strict") -> str:
    """:func:`read_bytes_bounded` decoded as UTF-8. Raises: ReadRefused; OSError; UnicodeDecodeError."""
    return read_bytes_bounded(path, max_bytes).decode("utf-8", errors=errors)


def parse_json_line(text: str, where):
    """``json.loads(text)``, a RecursionError (nesting deeper than the parser follows) turned into one line
    naming ``where`` (a file, or 'FILE line N' for a JSONL line). Raises: ReadRefused; json.JSONDecodeError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ReadRefused(where, _TOO_DEEP) from None


MAX_LOG_BYTES = 4 << 30
"""A run's JSON Lines logs (metrics.jsonl, events.jsonl, ladder.jsonl): 4 GiB. A metrics record is ~400 bytes
and a run writes a few a step, so a million-step run's metrics.jsonl is ~1-2 GB; a link to /dev/zero is not."""


def read_jsonl(path, max_bytes: int = MAX_LOG_BYTES, strict: bool = False) -> tuple[list[dict], list[str]]:
    """The JSON objects, one a line, of regular file ``path`` (:func:`open_regular`) of at most ``max_bytes``.
    Blank lines are ignored; a line that is not a JSON object (an edit, damage, nesting deeper than the parser
    follows) is skipped, never a traceback. A last line without its newline that does not parse is the torn
    write of a killed writer (the logs are appended a line at a time): dropped without a word.

    Args:
        strict: for a file rewritten whole (atomically: no torn tail), where a bad line is damage that would
            change what is computed from the file (a ladder's points): refuse it instead of skipping it.
    Returns: (the objects in file order, one ``'PATH:LINE: why'`` per other line skipped, for the caller to
        count and show; empty when ``strict``).
    Raises: ReadRefused: not a regular file, over ``max_bytes``; with ``strict``, the first bad line
        (``PATH:LINE: why``). OSError."""
    records, skipped = [], []
    lines = read_text_bounded(path, max_bytes, errors="replace").split("\n")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError) as e:
            why = _TOO_DEEP if isinstance(e, RecursionError) else "not JSON"
        else:
            if isinstance(rec, dict):
                records.append(rec)
                continue
            why = f"a JSON {type(rec).__name__}, expected an object"
        if strict:
            raise ReadRefused(f"{path}:{n}", f"{why} (expected one JSON object a line)")
        if n < len(lines) or why != "not JSON":  # else the torn tail of a killed writer
            skipped.append(f"{path}:{n}: {why}")
    return records, skipped


def read_json(path, max_bytes: int = MAX_CONFIG_BYTES):
    """The JSON value in regular file ``path`` (:func:`open_regular`) of at most ``max_bytes``.
    Raises: ReadRefused (also: nested too deeply); OSError; UnicodeDecodeError; json.JSONDecodeError."""
    return parse_json_line(read_text_bounded(path, max_bytes), path)


def read_toml(path, max_bytes: int = MAX_CONFIG_BYTES) -> dict:
    """The TOML document in regular file ``path`` (:func:`open_regular`) of at most ``max_bytes``.
    Raises: ReadRefused (also: nested too deeply); OSError; UnicodeDecodeError; tomllib.TOMLDecodeError."""
    text = read_text_bounded(path, max_bytes)
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise ReadRefused(path, _TOO_DEEP) from None


def take_lease(target: Path) -> Path | None:
    """A read lease on ``target`` (a file or folder that another process may delete, e.g. a checkpoint under
    retention): the empty file ``NAME.reader-PID`` beside it, which the deleter consults
    (:func:`leases_of`) after taking ``target`` out of sight. Returns the lease's path, or None where the
    folder is not writable (a read-only copy of a run: nothing deletes there)."""
    lease = Path(target).with_name(f"{Path(target).name}.reader-{os.getpid()}")
    try:
        lease.touch()
        fsync_dir(lease.parent)
    except OSError:
        return None
    return lease


def release_lease(lease: Path | None) -> None:
    """Drop a lease of :func:`take_lease` (None: nothing to drop)."""
    if lease is not None:
        Path(lease).unlink(missing_ok=True)


def leases_of(target: Path) -> list[int]:
    """PIDs of the live processes holding a read lease on ``target`` (:func:`take_lease`); leases of processes
    no longer running (a killed reader) are deleted on the way."""
    target, live = Path(target), []
    pattern = re.compile(rf"{re.escape(target.name)}\.reader-(\d+)")
    for p in target.parent.iterdir() if target.parent.is_dir() else ():
        m = pattern.fullmatch(p.name)
        if m and pid_alive(int(m.group(1))):
            live.append(int(m.group(1)))
        elif m:
            p.unlink(missing_ok=True)
    return live


def sweep_temps_of(target: Path) -> list[Path]:
    """Delete the temp files :func:`atomic_write_bytes` left beside ``target`` (``.NAME.tmpPID``) when its
    writer was killed (its PID no longer runs); a live writer's stay. Returns the deleted paths."""
    target, removed = Path(target), []
    pattern = re.compile(rf"\.{re.escape(target.name)}\.tmp(\d+)")
    for p in target.parent.iterdir() if target.parent.is_dir() else ():
        m = pattern.fullmatch(p.name)
        if m and not pid_alive(int(m.group(1))):
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


KIND_FILE = ".densetrain-kind"
"""The file naming what a directory a densetrain command writes into holds (one word of :data:`DIR_KINDS`)."""

DIR_KINDS = {  # kind -> (what it holds, in words; files by which one made before KIND_FILE existed is recognised)
    "run": ("a training run", ("config.toml", "metrics.jsonl", "checkpoints")),
    "shards": ("prepared shards", ("manifest.json", "tokenizer.train.json", ".decontam")),
    "ladder": ("a scaling ladder", ("ladder.json", "ladder.jsonl")),
    "export": ("a Hugging Face export", ("model.safetensors", "model.safetensors.index.json")),
}


def directory_kind(path) -> tuple[str, str] | None:
    """``(kind, why)`` of directory ``path`` (a key of :data:`DIR_KINDS`): its :data:`KIND_FILE`, else the
    first kind whose files it holds (a directory from before the marker, e.g. an older run); None when it is
    missing, empty or holds none of them."""
    path = Path(path)
    try:
        kind = read_text_bounded(path / KIND_FILE, 64, errors="replace").strip()
    except OSError:  # none (or not a regular file): judged by its files
        kind = ""
    if kind in DIR_KINDS:
        return kind, f"its {KIND_FILE} says so"
    for kind, (_, signs) in DIR_KINDS.items():
        found = next((s for s in signs if (path / s).exists()), None)
        if found:
            return kind, f"it holds {found}"
    return None


_STEP_DIR = re.compile(r"^step_\d+(\.tmp)?$")
"""A checkpoint's directory name (``densetrain.checkpoint.common``: ``step_00000010``, ``.tmp`` while saved)."""


def _belongs_elsewhere(path: Path) -> str:
    """Why directory ``path``, which holds no kind's files, still belongs to a training run: it holds checkpoint
    step directories, or it lies inside a run directory (its parent or grandparent, e.g. ``RUN/checkpoints``);
    '' when neither. A parent holding only a config.toml is not taken for a run (``exp/config.toml`` beside a
    new ``exp/run`` is a common layout)."""
    if path.is_dir():
        step = next((p.name for p in sorted(path.iterdir()) if p.is_dir() and _STEP_DIR.match(p.name)), None)
        if step:
            return f"holds checkpoint step directories ({step}): a training run's checkpoints"
    for up in list(path.resolve().parents)[:2]:
        found = directory_kind(up)
        if found and found[0] == "run" and found[1] != "it holds config.toml":
            return f"is inside {DIR_KINDS['run'][0]} at {up} ({found[1]})"
    return ""


def other_kind(path, kind: str, what: str) -> str:
    """'' when ``what`` (a command or key, e.g. ``train.run_dir``) may write its ``kind`` of files into
    directory ``path`` (new, empty, unrecognised, or of that kind); else the one line refusing it, naming the
    directory and what it holds (the caller raises it as its own error type): ``path`` is not a directory
    (a regular file), holds another kind's files, holds checkpoint step directories, or lies inside a
    training run's directory (e.g. its ``checkpoints/``)."""
    path = Path(path)
    takes = f"{what} takes a new or empty directory, or one of {DIR_KINDS[kind][0]}"
    if path.exists() and not path.is_dir():
        st = path.stat()
        is_a = next((name for test, name in _KINDS if test(st.st_mode)), "a regular file")
        return f"{what}: {path} is {is_a}, not a directory; {takes}"
    found = directory_kind(path) if path.is_dir() else None
    if found is None:
        why = _belongs_elsewhere(path)
        return f"{what}: {path} {why}, not {DIR_KINDS[kind][0]}; {takes}" if why else ""
    if found[0] == kind:
        return ""
    return f"{path}: holds {DIR_KINDS[found[0]][0]} ({found[1]}), not {DIR_KINDS[kind][0]}; {takes}"


def mark_kind(path, kind: str) -> None:
    """Write ``path``'s :data:`KIND_FILE` (atomically) unless it has one; ``path`` must exist."""
    if not (Path(path) / KIND_FILE).exists():
        atomic_write_bytes(Path(path) / KIND_FILE, f"{kind}\n".encode())
