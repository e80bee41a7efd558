"""The demo corpus sources the running Python gives without any package: ``code`` (one document per
standard-library ``.py`` file) and, when ``python3.X-doc`` cannot be fetched, the fallback
``technical`` source (the docstrings of the standard-library modules)."""

from __future__ import annotations

import ast
import sys
import sysconfig
from pathlib import Path

from densetrain.data.corpus.texts import demo_doc, doc_bytes

_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_PYTHON = f"python{sys.version_info.major}.{sys.version_info.minor}"  # the source_file prefix of stdlib records


def _skip_stdlib(rel: Path) -> bool:
    parts = set(rel.parts[:-1])
    return bool(parts & {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


def _stdlib_files() -> tuple[Path, list[Path]]:
    base = Path(sysconfig.get_paths()["stdlib"])
    files = [f for f in sorted(base.rglob("*.py")) if not _skip_stdlib(f.relative_to(base))]
    return base, files


def stdlib_code_documents() -> list[dict]:
    """One document per standard-library ``.py`` file (tests and site-packages excluded).

    Files that are not valid UTF-8, empty, or over 1 MB are skipped.
    """
    base, files = _stdlib_files()
    docs = []
    for f in files:
        try:
            if f.stat().st_size > 1_000_000:
                continue
            text = f.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            rel = f.relative_to(base).as_posix()
            docs.append(demo_doc(text, f"stdlib/{rel}", f"{_PYTHON}:{rel}"))
    return docs


def stdlib_docstring_documents(limit_bytes: int | None = None) -> list[dict]:
    """Fallback ``technical`` source: one document per stdlib module with its docstrings.

    A document reads ``Module json``, the module docstring, then for each public top-level
    class/function with a docstring its signature line and docstring. Stops once
    ``limit_bytes`` bytes (if given) are collected, taking modules evenly across the library.
    """
    base, files = _stdlib_files()
    stride = 1
    if limit_bytes is not None:
        # Parse only about as many modules as needed (~1.5 KB of docstrings per module on average).
        stride = max(1, len(files) // max(1, limit_bytes // 1500))
    docs, total = [], 0
    for f in files[::stride]:
        try:
            tree = ast.parse(f.read_bytes())
        except (SyntaxError, ValueError, OSError):
            continue
        rel = f.relative_to(base)
        mod = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        parts = [f"Module {mod}"]
        if (d := ast.get_docstring(tree)):
            parts.append(d)
        for node in tree.body:
            if isinstance(node, _DEFINITIONS) and not node.name.startswith("_"):
                d = ast.get_docstring(node)
                if not d:
                    continue
                if isinstance(node, ast.ClassDef):
                    head = f"class {node.name}"
                else:
                    head = f"{node.name}({ast.unparse(node.args)})"
                parts.append(f"{head}\n{d}")
        if len(parts) > 1:
            doc = demo_doc("\n\n".join(parts), f"stdlib-doc/{mod}", f"{_PYTHON}:{rel.as_posix()}")
            docs.append(doc)
            total += doc_bytes(doc)
            if limit_bytes is not None and total >= limit_bytes:
                break
    return docs
