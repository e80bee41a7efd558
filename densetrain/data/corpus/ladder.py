"""The ladder corpus: enough real text (>= 100M tokens after cleaning and dedup) that no ladder point and no
held-out run of ``densetrain ladder`` repeats a token, built from Debian packages like the demo corpus
(:mod:`densetrain.data.corpus.build`; ``apt-get download`` + ``dpkg-deb -x``, nothing installed).

Four sources, one JSONL file each in ``corpus_dir`` (fields ``text``, ``id``, ``source_file``):

=========  =====================================================================  =====================
file       packages (Debian 12 "bookworm", main)                                  one document is
=========  =====================================================================  =====================
books      bible-kjv + bible-kjv-text, sword-text-web (the demo corpus's books)   one book of the Bible
reference  dict-gcide, jargon-text (the demo's reference, uncapped);               ~4 KB of entries
           wordnet-base (the glosses of every synset)
technical  Sphinx ``html/_sources`` of python3.11-doc, python-pandas-doc,         one page / file
           sphinx-doc; perl-doc ``.pod``; linux-source-6.1 ``Documentation/``
           ``.rst``/``.txt`` (read from its ``.tar.xz``)
code       linux-source-6.1 ``.c``/``.h``, golang-1.19-src ``.go``,              one source file
           openjdk-17-source ``.java`` (its ``src.zip``), the Python stdlib
=========  =====================================================================  =====================

**Selection.** Each origin (a package's files of one kind) lists its candidate files with their sizes before
reading any text (an archive's member headers, a tree's ``stat``), sorted by path; files larger than
:data:`MAX_FILE_BYTES` are left out (generated tables: the kernel's register headers, Unicode data). A source
with a cap (:data:`LADDER_CAPS`) shares it between its origins by max-min fairness
(:func:`densetrain.data.sampling.fair_shares`: a smaller origin is taken whole, the rest split evenly) and
takes whole files evenly through each origin (:func:`densetrain.data.sampling.spread`), so the choice depends
only on the package contents: the same packages (and Python version: the stdlib is the running interpreter's)
give the same corpus, byte for byte.

**Reproducibility.** The marker ``corpus_dir/.ladder_corpus.json`` records each package's ``.deb`` file name
(name, version) and sha256, the caps and per-source stats; a call with the same parameters and all files
present returns at once. A later Debian point release (a new linux-source-6.1, a security update of openjdk)
gives another version and so a slightly different corpus: the marker says which one was used.

The build command: ``densetrain prepare --preset ladder-corpus`` (``data.ladder_corpus = true``), which then
cleans, filters, deduplicates and tokenizes the four sources like any others (README "The ladder corpus").
"""

from __future__ import annotations

import hashlib
import os
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from densetrain.config import SourceConfig
from densetrain.data.corpus.build import (
    DEMO_PACKAGES,
    books_groups,
    file_stamp,
    read_marker,
    reference_groups,
    refuse_foreign_files,
    write_jsonl,
)
from densetrain.data.corpus.packages import DebPackages, log, sweep_scratch
from densetrain.data.corpus.stdlib import stdlib_code_documents
from densetrain.data.corpus.texts import demo_doc, doc_bytes
from densetrain.data.sampling import fair_shares, spread
from densetrain.errors import DataError
from densetrain.fileio import atomic_write_json

LADDER_VERSION = 1
"""Bumped whenever the selection or extraction changes the produced text (forces a rebuild)."""
MARKER = ".ladder_corpus.json"
MAX_FILE_BYTES = 200_000
"""Files larger than this are left out: at this size a source file is generated (register maps, tables)."""
LADDER_CAPS: dict[str, int | None] = {"books": None, "reference": None, "technical": None, "code": 300_000_000}
"""Bytes of text per source (None: all of it). Only code is capped: its packages hold far more (the kernel's
tarball unpacks to ~1.3 GB); at 300 MB it gives 109M of the 138M tokens (79%, benchmarks/RESULTS.md): with the
other three sources' 29M, past the 100M a ladder needs, with room for what dedup removes."""


@dataclass(frozen=True)
class Entry:
    """One candidate document: ``key`` its path in the package (or archive), ``size`` its bytes before reading."""

    key: str
    size: int
    doc: dict | None = None
    """The document itself when it was built before selection (books, reference)."""


@dataclass
class Origin:
    """A package's files of one kind: :meth:`entries` lists them (sorted, sizes known), :meth:`documents` reads
    the chosen ones. ``kind``: 'tree' (files under ``base`` matching ``glob`` in the unpacked package),
    'tar' / 'zip' (members of the archive ``base`` whose names end with one of ``suffixes`` and, with
    ``prefix``, sit under it), 'built' (documents made by ``build``)."""

    name: str
    package: str
    kind: str
    base: str = ""
    glob: str = "**/*"
    suffixes: tuple[str, ...] = ()
    prefix: str = ""
    skip_parts: frozenset[str] = frozenset()
    build: Callable[[Path], list[dict]] | None = field(default=None, repr=False)

    def _wanted(self, key: str) -> bool:
        parts = key.split("/")
        return (key.endswith(self.suffixes) and (not self.prefix or key.startswith(self.prefix))
                and not self.skip_parts.intersection(parts[:-1]))

    def entries(self, root: Path, tar_index: dict) -> list[Entry]:
        """Candidates of this origin in the unpacked package ``root`` (``tar_index`` caches archive listings)."""
        if self.kind == "built":
            return [Entry(d["id"], doc_bytes(d), d) for d in self.build(root)]
        if self.kind == "tree":
            base = self._base(root)
            files = sorted(f for f in base.glob(self.glob) if f.is_file() and not f.is_symlink())
            out = [Entry(f.relative_to(base).as_posix(), f.stat().st_size) for f in files]
            return [e for e in out if not self.skip_parts.intersection(e.key.split("/")[:-1])]
        archive = self._base(root)
        if archive not in tar_index:
            tar_index[archive] = _archive_listing(archive, self.kind)
        return [Entry(k, n) for k, n in tar_index[archive] if self._wanted(k)]

    def _base(self, root: Path) -> Path:
        hits = sorted(root.glob(self.base))
        if not hits:
            raise FileNotFoundError(f"{self.package}: nothing matches {self.base}")
        return hits[0]

    def documents(self, root: Path, chosen: list[Entry]) -> Iterator[dict]:
        """The chosen entries' documents, in entry order (undecodable bytes become U+FFFD)."""
        if self.kind == "built":
            yield from (e.doc for e in chosen)
            return
        src = f"{self.package}:/{self._base(root).relative_to(root).as_posix()}"
        if self.kind == "tree":
            base = self._base(root)
            for e in chosen:
                yield demo_doc(_text((base / e.key).read_bytes()), f"{self.name}/{e.key}", f"{src}/{e.key}")
            return
        want = {e.key for e in chosen}
        texts = {}
        for key, data in _archive_members(self._base(root), self.kind, want):
            texts[key] = _text(data)
        for e in chosen:
            if e.key in texts:
                yield demo_doc(texts.pop(e.key), f"{self.name}/{e.key}", f"{src}!{e.key}")


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _archive_listing(path: Path, kind: str) -> list[tuple[str, int]]:
    """(member name, size) of every regular file in a ``.tar.*`` or ``.zip``, sorted by name; for a tar the
    first path component (``linux-source-6.1/``) is dropped."""
    if kind == "zip":
        with zipfile.ZipFile(path) as z:
            return sorted((i.filename, i.file_size) for i in z.infolist() if not i.is_dir())
    out = []
    with tarfile.open(path, "r|*") as t:  # streamed: one pass over the compressed bytes, no seeks
        for m in t:
            if m.isfile():
                out.append((m.name.split("/", 1)[-1], m.size))
    return sorted(out)


def _archive_members(path: Path, kind: str, want: set[str]) -> Iterator[tuple[str, bytes]]:
    if kind == "zip":
        with zipfile.ZipFile(path) as z:
            for k in sorted(want):
                yield k, z.read(k)
        return
    with tarfile.open(path, "r|*") as t:
        for m in t:
            key = m.name.split("/", 1)[-1]
            if m.isfile() and key in want:
                yield key, t.extractfile(m).read()


def _wordnet_glosses(root: Path) -> list[dict]:
    """WordNet's synsets as text: per ``data.<pos>`` file, groups of ~4 KB of ``words: gloss`` lines
    (the file's license header, lines starting with two spaces, is left out)."""
    docs = []
    for f in sorted((root / "usr/share/wordnet").glob("data.*")):
        lines, size = [], 0
        for raw in f.read_text(encoding="utf-8", errors="replace").splitlines():
            if raw.startswith("  ") or "|" not in raw:
                continue
            head, gloss = raw.split("|", 1)
            fields = head.split()
            n = int(fields[3], 16)  # w_cnt: two-digit hexadecimal (wndb(5WN))
            words = [fields[4 + 2 * i].replace("_", " ") for i in range(n)]
            lines.append(f"{', '.join(words)}: {gloss.strip()}")
            size += len(lines[-1])
            if size >= 4000:
                docs.append(demo_doc("\n".join(lines), f"wordnet/{f.suffix[1:]}/{len(docs):05d}",
                                     f"wordnet-base:/usr/share/wordnet/{f.name}"))
                lines, size = [], 0
        if lines:
            docs.append(demo_doc("\n".join(lines), f"wordnet/{f.suffix[1:]}/{len(docs):05d}",
                                 f"wordnet-base:/usr/share/wordnet/{f.name}"))
    return docs


def _demo_groups(builder) -> Callable[[DebPackages], list[list[dict]]]:
    def run(pk: DebPackages) -> list[list[dict]]:
        notes: list[str] = []
        return builder(pk, notes, 1 << 40) or []  # uncapped: the ladder corpus takes the whole dictionary
    return run


_SRC = "usr/src/linux-source-*.tar.*"
_SPHINX = "usr/share/doc/*/html/_sources"
# name -> (kind, long_docs, demo builder of documents from several packages or None, origins)
LADDER_SOURCES: dict[str, tuple[str, bool, Callable | None, list[Origin]]] = {
    "books": ("books", True, _demo_groups(books_groups), []),
    "reference": ("reference", False, _demo_groups(reference_groups), [
        Origin("wordnet", "wordnet-base", "built", build=_wordnet_glosses)]),
    "technical": ("technical", True, None, [
        Origin("python-doc", "python3.11-doc", "tree", "usr/share/doc/python3.11/html/_sources", "**/*.rst.txt"),
        Origin("pandas-doc", "python-pandas-doc", "tree", _SPHINX, "**/*.txt"),
        Origin("sphinx-doc", "sphinx-doc", "tree", _SPHINX, "**/*.txt"),
        Origin("perl-doc", "perl-doc", "tree", "usr/share/perl/*/pod", "*.pod"),
        Origin("linux-doc", "linux-source-6.1", "tar", _SRC, suffixes=(".rst", ".txt"), prefix="Documentation/",
               skip_parts=frozenset({"translations"})),
    ]),
    "code": ("code", True, None, [
        Origin("linux", "linux-source-6.1", "tar", _SRC, suffixes=(".c", ".h")),
        Origin("go", "golang-1.19-src", "tree", "usr/share/go-1.19/src", "**/*.go", skip_parts=frozenset({"testdata"})),
        Origin("java", "openjdk-17-source", "zip", "usr/lib/jvm/openjdk-17/lib/src.zip", suffixes=(".java",)),
        Origin("python", "", "built", build=lambda _root: stdlib_code_documents()),
    ]),
}


def ladder_sources(names: list[str] | None = None) -> list[SourceConfig]:
    """The ``data.sources`` entries of the ladder corpus files (one per JSONL file)."""
    return [SourceConfig(name=n, kind=LADDER_SOURCES[n][0], paths=[f"{n}.jsonl"], format="jsonl",
                         long_docs=LADDER_SOURCES[n][1]) for n in (names or list(LADDER_SOURCES))]


def select(groups: list[list[Entry]], cap: int | None) -> list[list[Entry]]:
    """The entries kept of each origin's candidates: files over :data:`MAX_FILE_BYTES` out, then, with a
    ``cap`` (bytes), max-min fair shares of it per origin and whole files evenly through each.

    The selection reads sizes only, so it is a function of the package contents (module docstring)."""
    groups = [[e for e in g if e.doc is not None or 0 < e.size <= MAX_FILE_BYTES] for g in groups]
    if cap is None:
        return groups
    shares = fair_shares([sum(e.size for e in g) for g in groups], cap)
    return [spread(g, s, lambda e: e.size) for g, s in zip(groups, shares)]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _stamp_or_none(corpus_dir: Path, name: str) -> dict | None:
    path = corpus_dir / f"{name}.jsonl"
    return file_stamp(path) if path.is_file() else None


def _packages_of(names: list[str], table: dict) -> list[str]:
    pkgs = [p for n in names for p in DEMO_PACKAGES.get(n, []) if table[n][2] is not None]
    pkgs += [o.package for n in names for o in table[n][3] if o.package]
    return list(dict.fromkeys(pkgs))


def build_ladder_corpus(
    corpus_dir: str | os.PathLike,
    *,
    sources: list[str] | None = None,
    caps: dict[str, int | None] | None = None,
    table: dict | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> dict:
    """Build the ladder corpus into ``corpus_dir`` (see the module docstring).

    Args:
        corpus_dir: output directory; gets ``<source>.jsonl`` files and the ``.ladder_corpus.json`` marker.
        sources: subset of ``books, reference, technical, code`` (default: all).
        caps: bytes of text per source (default :data:`LADDER_CAPS`; None: uncapped).
        table: the sources' origins (default :data:`LADDER_SOURCES`; tests pass a small subset).
        cache_dir: where downloaded ``.deb`` files are kept (default ``corpus_dir/.cache/debs``).

    Returns:
        ``{source: {'documents', 'bytes' (UTF-8 text), 'origins': {origin: {'documents', 'bytes'}}}}``.

    Raises:
        DataError: apt-get/dpkg-deb missing, a package that cannot be downloaded or unpacked, an origin whose
            files are not where the package should have them, or a file in ``corpus_dir`` not written here.
    """
    t0 = time.time()
    corpus_dir, table = Path(corpus_dir), table or LADDER_SOURCES
    names = list(sources) if sources else list(table)
    bad = [n for n in names if n not in table]
    if bad:
        raise DataError(f"unknown ladder corpus source(s) {bad}; known: {list(table)}")
    caps = {n: (caps or LADDER_CAPS).get(n) for n in names}
    cache = Path(cache_dir) if cache_dir else corpus_dir / ".cache" / "debs"
    params = {"version": LADDER_VERSION, "sources": names, "caps": caps, "max_file_bytes": MAX_FILE_BYTES,
              "origins": {n: [o.name for o in table[n][3]] for n in names}}
    marker = corpus_dir / MARKER
    prev = read_marker(marker)
    if prev is not None:
        done = prev.get("complete", True) and prev.get("params") == params
        if done and all((corpus_dir / f"{n}.jsonl").is_file() for n in names):
            log(f"ladder corpus up to date in {corpus_dir} (delete {MARKER} to rebuild)")
            return prev["stats"]
    refuse_foreign_files(corpus_dir, names, prev, MARKER, "data.ladder_corpus")
    (corpus_dir / ".cache").mkdir(parents=True, exist_ok=True)
    # a killed build with the same parameters resumes: the sources it finished (file unchanged) are kept
    same = prev is not None and prev.get("params") == params
    kept = (prev or {}).get("stats") or {} if same else {}
    stats: dict[str, dict] = {n: st for n, st in kept.items()
                              if n in names and (prev.get("files") or {}).get(n) == _stamp_or_none(corpus_dir, n)}
    # recorded as soon as each is written, so a killed build's files stay ours and the next build may replace them
    written = dict((prev or {}).get("files") or {})
    sweep_scratch(corpus_dir / ".cache")
    with tempfile.TemporaryDirectory(prefix="unpack-", dir=corpus_dir / ".cache") as scratch:
        pk = DebPackages(cache, Path(scratch))
        if not pk.available:
            raise DataError("the ladder corpus needs apt-get and dpkg-deb (a Debian/Ubuntu machine): not found")
        if stats:
            log(f"ladder corpus: resuming a killed build, {sorted(stats)} already written")
        pkgs = _packages_of([n for n in names if n not in stats], table)
        pk.prefetch(pkgs)
        roots = {p: pk.get(p) for p in pkgs}
        missing = {p: pk.errors.get(p, "unavailable") for p, r in roots.items() if r is None}
        if missing:
            raise DataError("ladder corpus: packages not available: "
                            + "; ".join(f"{p}: {e}" for p, e in missing.items()))
        tar_index: dict = {}
        for name in [n for n in names if n not in stats]:
            t1 = time.time()
            _, _, demo, origins = table[name]
            parts: list[tuple[str, Origin | None, list[Entry]]] = [
                (f"{name}-{i}", None, [Entry(d["id"], doc_bytes(d), d) for d in g])
                for i, g in enumerate(demo(pk) if demo else [])]
            for o in origins:
                try:
                    parts.append((o.name, o, o.entries(roots.get(o.package) or Path("/"), tar_index)))
                except (FileNotFoundError, tarfile.TarError, zipfile.BadZipFile) as e:
                    raise DataError(f"ladder corpus: origin '{o.name}' of source '{name}': {e}") from e
            chosen = select([g for _, _, g in parts], caps[name])
            docs: list[dict] = []
            per: dict[str, dict] = {}
            for (label, o, _), g in zip(parts, chosen):
                got = o.documents(roots.get(o.package) or Path("/"), g) if o else (e.doc for e in g)
                part = [d for d in got if d["text"].strip()]
                docs.extend(part)
                per[label] = {"documents": len(part), "bytes": sum(doc_bytes(d) for d in part)}
            write_jsonl(corpus_dir / f"{name}.jsonl", docs)
            written[name] = file_stamp(corpus_dir / f"{name}.jsonl")
            nbytes = sum(p["bytes"] for p in per.values())
            stats[name] = {"documents": len(docs), "bytes": nbytes, "origins": per}
            atomic_write_json(marker, {"params": params, "complete": False, "files": written, "stats": stats})
            log(f"{name}: {len(docs)} docs, {nbytes / 1e6:.1f} MB ("
                + ", ".join(f"{k} {v['bytes'] / 1e6:.1f} MB" for k, v in per.items()) + f") [{time.time() - t1:.0f}s]")
            del docs
    debs = {p: {"deb": d.name, "sha256": _sha256(d)} for p in _packages_of(names, table) for d in [pk.deb(p)] if d}
    debs = {**((prev or {}).get("packages") or {} if same else {}), **debs}
    atomic_write_json(marker, {"params": params, "complete": True, "stats": stats, "files": written,
                               "packages": debs, "build_seconds": round(time.time() - t0, 1)})
    log(f"ladder corpus: {sum(s['bytes'] for s in stats.values()) / 1e6:.1f} MB of text in {corpus_dir} "
        f"in {time.time() - t0:.0f}s")
    return stats


def tokens_without_repeat(mix: dict[str, float], train_tokens: dict[str, int]) -> int:
    """The most tokens a run drawing sources by ``mix`` (weights, any sum) can train before some source starts
    its second epoch: ``min over sources of T_s / w_s`` with ``w_s`` the normalised weight and ``T_s`` the
    source's train tokens (the sampler draws each source at its weight: densetrain/data/mixture.py).

    Raises:
        DataError: a mix with no positive weight or naming a source without train tokens listed.
    """
    total = sum(w for w in mix.values() if w > 0)
    if total <= 0:
        raise DataError(f"mix {mix}: expected at least one positive weight")
    unknown = [n for n, w in mix.items() if w > 0 and n not in train_tokens]
    if unknown:
        raise DataError(f"mix names sources {unknown} that have no prepared train tokens ({sorted(train_tokens)})")
    return int(min(train_tokens[n] * total / w for n, w in mix.items() if w > 0))
