"""The input files of one configured source: ``data.sources[i].paths`` expanded into files in
reading order, their names as recorded in provenance, and the format of each.

A source names files, directories (walked recursively, sorted) or globs, relative to
``data.corpus_dir``. Hidden files and directories (names starting with ``.``) and ``__pycache__``
directories are skipped when walking a directory: they are caches, temporaries of atomic writes and
markers. A Hugging Face ``save_to_disk`` folder (``state.json`` listing ``_data_files``, or
``dataset_info.json`` next to ``*.arrow`` files) is ONE dataset: naming it (or a directory above it)
gives its Arrow files in ``state.json`` order, never its JSON files or stale ``cache-*.arrow`` files.
A ``DatasetDict`` folder is walked into its split folders (sorted by split name).

Fatal (:class:`DataError`): a configured path that does not exist, a ``save_to_disk`` folder whose
``state.json`` is unreadable or lists a missing file.
"""

from __future__ import annotations

import glob as _glob
import os
import sys
from pathlib import Path

from densetrain.config import SourceConfig
from densetrain.errors import DataError
from densetrain.fileio import read_json

_GLOB_CHARS = set("*?[")


def save_to_disk_files(folder: Path) -> list[Path] | None:
    """The Arrow files of a Hugging Face ``save_to_disk`` folder in dataset order; None if it is not one.

    A folder is one when its ``state.json`` lists ``_data_files`` (their order is the row order),
    or, without that, when it holds ``dataset_info.json`` and ``*.arrow`` files (then the sorted
    ``data-*.arrow`` files, else all ``*.arrow``).

    Raises:
        DataError: ``state.json`` is unreadable next to a ``dataset_info.json``, its
            ``_data_files`` is malformed, or it lists a file that does not exist.
    """
    folder = Path(folder)
    state, has_info = folder / "state.json", (folder / "dataset_info.json").is_file()
    if state.is_file():
        try:
            obj = read_json(state)  # a few KiB; too large or too deep: ReadRefused, an OSError
        except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            if has_info:
                raise DataError(f"{state}: unreadable datasets state.json ({e})") from None
            return None  # somebody else's state.json: an ordinary directory
        entries = obj.get("_data_files") if isinstance(obj, dict) else None
        if entries is not None:
            names_ok = isinstance(entries, list) and all(
                isinstance(e, dict) and isinstance(e.get("filename"), str) for e in entries)
            if not names_ok:
                raise DataError(f"{state}: _data_files must be a list of {{'filename': str}}")
            files = [folder / e["filename"] for e in entries]
            for f in files:
                if not f.is_file():
                    raise DataError(f"{f}: listed in {state} but missing")
            return files
    if has_info:
        arrows = sorted(folder.glob("data-*.arrow")) or sorted(folder.glob("*.arrow"))
        if arrows:
            return arrows
    return None


def _walk(directory: Path) -> list[Path]:
    """All input files under ``directory``, recursively, sorted, skipping hidden names and __pycache__.

    A ``save_to_disk`` folder contributes its Arrow files in dataset order at its place in the
    sorted order, and is not walked into; a ``DatasetDict`` folder (``dataset_dict.json``) only
    its split folders.
    """
    groups: list[tuple[Path, list[Path]]] = []  # (sort key, files in their order)
    seen_dirs: set[str] = set()
    for root, dirs, files in os.walk(directory, followlinks=True):
        # Symlinked directories are followed once: a link back up the tree would walk forever.
        real = os.path.realpath(root)
        if real in seen_dirs:
            print(f"[data] skipped {root}: symlink loop (already read as {real})", file=sys.stderr)
            dirs[:] = []
            continue
        seen_dirs.add(real)
        ds_files = save_to_disk_files(Path(root))
        if ds_files is not None:
            groups.append((Path(root), ds_files))
            dirs[:] = []
            continue
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        if "dataset_dict.json" in files:  # a DatasetDict: its split folders only, not the JSON file
            continue
        for f in files:
            path = Path(root) / f
            if f.startswith("."):
                continue
            if not path.exists():  # a dangling symlink: nothing to read, and not worth stopping for
                print(f"[data] skipped {path}: broken symlink", file=sys.stderr)
                continue
            groups.append((path, [path]))
    return [f for _, fs in sorted(groups, key=lambda g: g[0]) for f in fs]


def resolve_paths(src: SourceConfig, corpus_dir: Path, source_index: int | None = None) -> list[Path]:
    """Expand ``src.paths`` into the de-duplicated list of input files, in reading order.

    Relative paths are resolved against ``corpus_dir``; ``~`` is expanded. Directories are walked
    recursively (sorted; hidden names and ``__pycache__`` skipped); globs support ``**``. A
    ``save_to_disk`` folder gives its Arrow files in ``state.json`` order (:func:`save_to_disk_files`).

    Raises:
        DataError: a path (or glob) matches nothing, ``src.paths`` is empty, or a ``save_to_disk``
            folder is broken (see :func:`save_to_disk_files`).
    """
    key = f"data.sources[{source_index}]" if source_index is not None else f"data.sources[name={src.name!r}]"
    if not src.paths:
        raise DataError(f"{key}.paths is empty for source '{src.name}'")
    corpus_dir = Path(corpus_dir)
    seen: set[Path] = set()
    files: list[Path] = []
    for raw in src.paths:
        p = Path(os.path.expanduser(raw))
        if not p.is_absolute():
            p = corpus_dir / p
        if _GLOB_CHARS & set(str(raw)):
            matches = [Path(m) for m in sorted(_glob.glob(str(p), recursive=True))]
            found: list[Path] = []
            for m in matches:
                found.extend(_walk(m) if m.is_dir() else [m] if m.is_file() else [])
            if not found:
                raise DataError(f"{p}: no such file (glob matched nothing) ({key}.paths)")
        elif p.is_dir():
            found = _walk(p)
        elif p.is_file():
            found = [p]
        else:
            raise DataError(f"{p}: no such file ({key}.paths)")
        for f in found:
            if f not in seen:
                seen.add(f)
                files.append(f)
    return files


def display_path(path: Path, corpus_dir: Path) -> str:
    """``path`` relative to ``corpus_dir`` when inside it (stable provenance), else absolute.

    Symlinks are not resolved: two names of one file (``GPL`` -> ``GPL-3``) are two inputs with
    two document ids (and exact duplicates of each other, which dedup then reports).
    """
    absolute = Path(os.path.abspath(path))
    try:
        return str(absolute.relative_to(os.path.abspath(corpus_dir)))
    except ValueError:
        return str(absolute)


_AUTO_SUFFIXES = (
    ((".jsonl", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst", ".jsonl.zstd", ".json.zstd"), "jsonl"),
    ((".parquet",), "parquet"),
    ((".arrow",), "arrow"),
)


def file_format(path: Path, fmt: str) -> str:
    """The effective format of one file: ``fmt`` unless it is ``'auto'`` (then by extension, see the module doc)."""
    if fmt != "auto":
        return fmt
    name = path.name.lower()
    for suffixes, f in _AUTO_SUFFIXES:
        if name.endswith(suffixes):
            return f
    return "text"


def estimated_text_bytes(files: list[Path]) -> int:
    """Rough bytes of text in ``files``: compressed inputs (gzip, zstd, Parquet) count ~4x their size.

    Only for balancing samples and sizing progress bars, never for limits.
    """
    return sum(f.stat().st_size * (4 if f.name.endswith((".gz", ".zst", ".parquet")) else 1) for f in files)
