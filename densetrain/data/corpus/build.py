"""The demo corpus: real text a Debian/Ubuntu machine gets from its package registry.

Nothing is installed: each package is fetched with ``apt-get download`` into a cache
(``corpus_dir/.cache/debs``) and unpacked with ``dpkg-deb -x`` into a scratch directory that is
removed afterwards. Six sources come out, one JSONL file each in ``corpus_dir`` (fields ``text``,
``id``, ``source_file``; one document per line):

============  ==============================================  ===================================
file          packages / origin                                one document is
============  ==============================================  ===================================
books         bible-kjv + bible-kjv-text (KJV, via the         one book of the Bible (long)
              packaged ``bible`` program); sword-text-web
              (World English Bible, SWORD zText module,
              decoded with zlib, OSIS markup stripped)
reference     dict-gcide (GNU Collaborative International     ~4 KB of consecutive dictionary
              Dictionary of English, dictzip = gzip);          entries; one Jargon File chapter
              jargon-text (the Jargon File)                    or ~4 KB of glossary entries
technical     python3.X-doc (``html/_sources/**/*.rst.txt``)   one documentation page
web           fortunes + fortunes-min                          20 consecutive fortunes of a file
zh            fortunes-zh (UTF-8, GB18030 tolerated)           20 consecutive fortunes/poems
code          the running Python's standard library            one ``.py`` file
============  ==============================================  ===================================

Each source is capped at ``max_bytes_per_source`` bytes of UTF-8 text. When an origin has more,
whole documents are selected evenly across it (not just its beginning), deterministically:
inputs are sorted and the selection depends only on document sizes. With several origins in one
source, smaller origins are kept whole first and the rest of the budget is shared.

Without ``apt-get``/``dpkg-deb`` (or when a download fails) the corpus falls back to what the
standard library gives: ``code`` as above and ``technical`` = the docstrings of the stdlib
modules; sources whose packages are missing are written empty, and one line says so.

A completion marker (``corpus_dir/.demo_corpus.json``) records the build parameters and stats;
a later call with the same parameters, all files present, returns at once.
"""


from __future__ import annotations

import gzip
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

from densetrain.config import SourceConfig
from densetrain.data.corpus.packages import DebPackages, log, sweep_scratch
from densetrain.data.corpus.stdlib import stdlib_code_documents, stdlib_docstring_documents
from densetrain.data.corpus.texts import (
    demo_doc,
    doc_bytes,
    fortune_documents,
    gcide_documents,
    jargon_documents,
    kjv_documents,
    sword_ztext_documents,
)
from densetrain.data.sampling import fair_shares, spread
from densetrain.errors import DataError
from densetrain.fileio import atomic_write_bytes, atomic_write_json

CORPUS_VERSION = 1
"""Bumped whenever the extraction changes the produced text (forces a rebuild)."""
MARKER = ".demo_corpus.json"

# name -> (kind, long_docs)
DEMO_SOURCES: dict[str, tuple[str, bool]] = {
    "books": ("books", True),
    "reference": ("reference", False),
    "technical": ("technical", True),
    "web": ("web", False),
    "zh": ("zh", False),
    "code": ("code", True),
}

_PY_DOC_CANDIDATES = list(dict.fromkeys([f"python3.{sys.version_info.minor}-doc", "python3.11-doc", "python3.12-doc",
                                         "python3.13-doc"]))
DEMO_PACKAGES = {
    "books": ["bible-kjv", "bible-kjv-text", "sword-text-web"],
    "reference": ["dict-gcide", "jargon-text"],
    "technical": _PY_DOC_CANDIDATES[:1],
    "web": ["fortunes", "fortunes-min"],
    "zh": ["fortunes-zh"],
    "code": [],
}


def demo_sources() -> list[SourceConfig]:
    """The ``data.sources`` entries matching the demo corpus files (one per JSONL file)."""
    return [
        SourceConfig(name=name, kind=kind, paths=[f"{name}.jsonl"], format="jsonl", text_field="text",
                     long_docs=long_docs)
        for name, (kind, long_docs) in DEMO_SOURCES.items()
    ]


def _cap_groups(groups: list[list[dict]], cap: int) -> list[dict]:
    """Cap several origins together: smaller origins stay whole, the rest share the budget evenly."""
    budgets = fair_shares([sum(doc_bytes(d) for d in g) for g in groups], cap)
    out: list[dict] = []
    for g, b in zip(groups, budgets):
        out.extend(spread(g, b, doc_bytes))
    return out


# --------------------------------------------------------------------------------------------------
# Sources from packages: each returns the document groups of its origins, or None when none was fetched
# --------------------------------------------------------------------------------------------------


def _run_kjv(bin_root: Path, data_root: Path) -> list[str]:
    # Absolute: the program runs with cwd=data, where a relative path (corpus_dir is relative in the
    # tiny preset) would name nothing and the Bible would be skipped.
    exe = (bin_root / "usr/bin/bible").resolve()
    data = (data_root / "usr/lib").resolve()
    # -f turns pretty-printing off: one verse per line, prefixed by its reference. The data
    # directory is passed as "." (cwd) because -p splits its argument on spaces.
    r = subprocess.run([str(exe), "-f", "-p", ".", "gen1:1-rev22:21"], cwd=data, capture_output=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"bible exited with {r.returncode}")
    return r.stdout.decode("utf-8", errors="replace").splitlines()


def books_groups(pk: DebPackages, notes: list[str], max_bytes: int) -> list[list[dict]] | None:
    groups = []
    kjv_bin, kjv_data = pk.get("bible-kjv"), pk.get("bible-kjv-text")
    if kjv_bin and kjv_data:
        try:
            docs = kjv_documents(_run_kjv(kjv_bin, kjv_data), "bible-kjv-text:/usr/lib/bible.data")
            groups.append(docs)
            notes.append(f"KJV {len(docs)} books")
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
            notes.append(f"KJV skipped ({e})")
    web = pk.get("sword-text-web")
    if web:
        mods = sorted((web / "usr/share/sword/modules/texts/ztext").glob("*/"))
        for m in mods:
            try:
                docs = sword_ztext_documents(m, m.name, f"sword-text-web:/usr/share/sword/modules/texts/ztext/{m.name}")
                groups.append(docs)
                notes.append(f"{m.name} {len(docs)} books")
            except (zlib.error, struct.error, OSError) as e:
                notes.append(f"{m.name} skipped (not decodable with zlib: {e})")
    return groups or None


def reference_groups(pk: DebPackages, notes: list[str], max_bytes: int) -> list[list[dict]] | None:
    groups = []
    g = pk.get("dict-gcide")
    if g:
        dz, idx = g / "usr/share/dictd/gcide.dict.dz", g / "usr/share/dictd/gcide.index"
        if dz.is_file() and idx.is_file():
            docs = gcide_documents(dz, idx, "dict-gcide:/usr/share/dictd/gcide.dict.dz", max_bytes=max_bytes)
            groups.append(docs)
            notes.append(f"GCIDE {len(docs)} chunks")
    j = pk.get("jargon-text")
    if j:
        files = sorted((j / "usr/share/doc/jargon-text").glob("jargon.txt*"))
        if files:
            f = files[0]
            raw = gzip.open(f).read() if f.suffix == ".gz" else f.read_bytes()
            origin = f"jargon-text:/usr/share/doc/jargon-text/{f.name}"
            docs = jargon_documents(raw.decode("utf-8", errors="replace"), origin)
            groups.append(docs)
            notes.append(f"Jargon File {len(docs)} docs")
    return groups or None


def _technical(pk: DebPackages, notes: list[str], max_bytes: int) -> list[list[dict]] | None:
    for pkg in _PY_DOC_CANDIDATES:
        root = pk.get(pkg)
        if not root:
            continue
        srcs = sorted(root.glob("usr/share/doc/python3*/html/_sources"))
        if not srcs:
            continue
        base = srcs[0]
        docs = []
        for f in sorted(base.rglob("*.rst.txt")):
            text = f.read_text(encoding="utf-8", errors="replace").strip()
            if text:
                rel = f.relative_to(base).as_posix()
                docs.append(demo_doc(text, f"python-doc/{rel}", f"{pkg}:/{base.relative_to(root).as_posix()}/{rel}"))
        notes.append(f"{pkg} {len(docs)} pages")
        return [docs]
    return None


def _fortune_files(root: Path, pkg: str) -> list[tuple[Path, str]]:
    d = root / "usr/share/games/fortunes"
    out = []
    for f in sorted(d.rglob("*")) if d.is_dir() else []:
        if f.is_symlink() or not f.is_file() or f.suffix in (".dat", ".u8") or f.name.startswith("."):
            continue
        out.append((f, f"{pkg}:/{f.relative_to(root).as_posix()}"))
    return out


def _web(pk: DebPackages, notes: list[str], max_bytes: int) -> list[list[dict]] | None:
    groups = []
    for pkg in ("fortunes", "fortunes-min"):
        root = pk.get(pkg)
        if root:
            docs = fortune_documents(_fortune_files(root, pkg), pkg)
            groups.append(docs)
            notes.append(f"{pkg} {len(docs)} docs")
    return groups or None


def _zh(pk: DebPackages, notes: list[str], max_bytes: int) -> list[list[dict]] | None:
    root = pk.get("fortunes-zh")
    if not root:
        return None
    docs = fortune_documents(_fortune_files(root, "fortunes-zh"), "fortunes-zh")
    notes.append(f"fortunes-zh {len(docs)} docs")
    return [docs]


# --------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------


def write_jsonl(path: Path, docs: list[dict]) -> int:
    body = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode("utf-8")
    atomic_write_bytes(path, body)
    return len(body)


def file_stamp(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def refuse_foreign_files(corpus_dir: Path, names: list[str], prev: dict | None, marker: str = MARKER,
                          flag: str = "data.demo_corpus") -> None:
    """Never overwrite a user's file: every ``<source>.jsonl`` already there must be one this
    builder wrote (recorded, unchanged, in its ``marker``; ``flag`` is the config key that builds it).

    Raises:
        DataError: a file exists that the demo builder did not write (or that changed since).
    """

    known = None if prev is None else prev.get("files")  # a marker without "files": an older builder's
    for n in names:
        path = corpus_dir / f"{n}.jsonl"
        if not path.exists():
            continue
        if prev is None or (known is not None and known.get(n) != file_stamp(path)):
            raise DataError(f"{path}: exists and was not written by the {flag.split('.')[-1].replace('_', ' ')} "
                            f"builder (no {marker} records it); {flag} = true would overwrite it: set --{flag}=false "
                            "or use another data.corpus_dir")



def read_marker(marker: Path) -> dict | None:
    """A corpus folder's marker (what it was built from): None without one, ``{}`` when it cannot be read (the
    folder is then rebuilt, as for a changed recipe)."""
    if not marker.is_file():
        return None
    try:
        return json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return {}

def build_demo_corpus(
    corpus_dir: str | os.PathLike,
    max_bytes_per_source: int = 6_000_000,
    *,
    sources: list[str] | None = None,
    use_packages: bool = True,
    cache_dir: str | os.PathLike | None = None,
) -> dict:
    """Build the demo corpus into ``corpus_dir`` (see the module docstring for the sources).

    Args:
        corpus_dir: output directory; gets ``<source>.jsonl`` files and the ``.demo_corpus.json``
            completion marker.
        max_bytes_per_source: cap on the UTF-8 text bytes of each source.
        sources: subset of ``books, reference, technical, web, zh, code`` (default: all).
        use_packages: False skips apt-get entirely (the standard-library fallback only).
        cache_dir: where downloaded ``.deb`` files are kept (default ``corpus_dir/.cache/debs``).

    Returns:
        ``{source: {'documents': int, 'bytes': int (text bytes), 'origin': str}}``; a source
        whose packages were unavailable has 0 documents and an ``'unavailable'`` origin.

    Raises:
        ValueError: an unknown source name.
    """
    t0 = time.time()
    corpus_dir = Path(corpus_dir)
    names = list(sources) if sources else list(DEMO_SOURCES)
    bad = [n for n in names if n not in DEMO_SOURCES]
    if bad:
        raise ValueError(f"unknown demo source(s) {bad}; known: {list(DEMO_SOURCES)}")
    params = {"version": CORPUS_VERSION, "max_bytes_per_source": int(max_bytes_per_source), "sources": names,
              "use_packages": use_packages}
    marker = corpus_dir / MARKER
    prev = read_marker(marker)
    if prev is not None:
        if prev.get("params") == params and all((corpus_dir / f"{n}.jsonl").is_file() for n in names):
            log(f"demo corpus up to date in {corpus_dir} (delete {MARKER} to rebuild)")
            return prev["stats"]
    refuse_foreign_files(corpus_dir, names, prev)
    corpus_dir.mkdir(parents=True, exist_ok=True)
    cache = Path(cache_dir) if cache_dir else corpus_dir / ".cache" / "debs"
    scratch_parent = corpus_dir / ".cache"
    scratch_parent.mkdir(parents=True, exist_ok=True)
    stats: dict[str, dict] = {}
    sweep_scratch(scratch_parent)
    with tempfile.TemporaryDirectory(prefix="unpack-", dir=scratch_parent) as scratch:
        pk = DebPackages(cache, Path(scratch))
        if not use_packages:
            pk.available = False
        if pk.available:
            pk.prefetch([p for n in names for p in DEMO_PACKAGES[n]])
        else:
            why = "disabled" if not use_packages else "apt-get/dpkg-deb not found"
            log(f"package download {why}: falling back to the Python standard library "
                "(code; technical = stdlib docstrings); other sources are written empty")
        builders = {"books": books_groups, "reference": reference_groups, "technical": _technical, "web": _web,
                    "zh": _zh}
        for name in names:
            t1 = time.time()
            notes: list[str] = []
            if name == "code":
                groups = [stdlib_code_documents()]
                notes.append(f"python{sys.version_info.major}.{sys.version_info.minor} stdlib {len(groups[0])} files")
            else:
                groups = builders[name](pk, notes, max_bytes_per_source) if pk.available else None
                if groups is None and name == "technical":
                    groups = [stdlib_docstring_documents(limit_bytes=max_bytes_per_source)]
                    notes.append(f"stdlib docstrings {len(groups[0])} modules (fallback)")
            if groups is None:
                missing = [p for p in DEMO_PACKAGES[name] if p in pk.errors] or DEMO_PACKAGES[name]
                reason = "; ".join(f"{p}: {pk.errors.get(p, 'unavailable')}" for p in missing)
                docs, origin = [], f"unavailable ({reason})"
            else:
                docs = _cap_groups(groups, max_bytes_per_source)
                origin = ", ".join(notes)
            write_jsonl(corpus_dir / f"{name}.jsonl", docs)
            nbytes = sum(doc_bytes(d) for d in docs)
            stats[name] = {"documents": len(docs), "bytes": nbytes, "origin": origin}
            log(f"{name}: {len(docs)} docs, {nbytes / 1e6:.2f} MB ({origin}) [{time.time() - t1:.1f}s]")
    written = {n: file_stamp(corpus_dir / f"{n}.jsonl") for n in names}
    atomic_write_json(marker, {"params": params, "stats": stats, "files": written,
                               "build_seconds": round(time.time() - t0, 1)})
    log(f"demo corpus built in {corpus_dir} in {time.time() - t0:.1f}s")
    return stats
