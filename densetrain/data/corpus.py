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

import ast
import gzip
import html
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
import unicodedata
import zlib
from pathlib import Path

from densetrain.config import SourceConfig
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

_PY_DOC_CANDIDATES = list(dict.fromkeys([f"python3.{sys.version_info.minor}-doc", "python3.11-doc", "python3.12-doc", "python3.13-doc"]))
_PACKAGES = {
    "books": ["bible-kjv", "bible-kjv-text", "sword-text-web"],
    "reference": ["dict-gcide", "jargon-text"],
    "technical": _PY_DOC_CANDIDATES[:1],
    "web": ["fortunes", "fortunes-min"],
    "zh": ["fortunes-zh"],
    "code": [],
}

_CHUNK_BYTES = 4000  # target size of grouped documents (dictionary entries, glossary entries)
_FORTUNES_PER_DOC = 20


def demo_sources() -> list[SourceConfig]:
    """The ``data.sources`` entries matching the demo corpus files (one per JSONL file)."""
    return [
        SourceConfig(name=name, kind=kind, paths=[f"{name}.jsonl"], format="jsonl", text_field="text", long_docs=long_docs)
        for name, (kind, long_docs) in DEMO_SOURCES.items()
    ]


def _log(msg: str) -> None:
    print(f"[corpus] {msg}", flush=True)


def _doc(text: str, doc_id: str, source_file: str) -> dict:
    return {"text": text, "id": doc_id, "source_file": source_file}


def _nbytes(doc: dict) -> int:
    return len(doc["text"].encode("utf-8"))


# --------------------------------------------------------------------------------------------------
# Packages
# --------------------------------------------------------------------------------------------------


class _Packages:
    """Download (apt-get download) and unpack (dpkg-deb -x) Debian packages, without installing."""

    def __init__(self, cache_dir: Path, extract_root: Path):
        self.cache_dir = cache_dir
        self.extract_root = extract_root
        self.available = bool(shutil.which("apt-get") and shutil.which("dpkg-deb"))
        self.updated = False
        self.errors: dict[str, str] = {}

    def _cached(self, pkg: str) -> Path | None:
        debs = sorted(self.cache_dir.glob(f"{pkg}_*.deb"))
        return debs[-1] if debs else None

    def _apt_download(self, pkgs: list[str]) -> tuple[bool, str]:
        try:
            r = subprocess.run(["apt-get", "download", "-q", *pkgs], cwd=self.cache_dir, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            return False, str(e)
        if r.returncode == 0:
            return True, ""
        lines = (r.stderr or "").strip().splitlines()
        errs = [l for l in lines if l.startswith("E:")]
        return False, errs[-1] if errs else lines[-1] if lines else f"exit status {r.returncode}"

    def _update(self) -> None:
        # A fresh container often has empty package lists; refreshing them needs root.
        if self.updated or not hasattr(os, "geteuid") or os.geteuid() != 0:
            return
        self.updated = True
        _log("package download failed; running apt-get update -qq (root, package lists may be empty)")
        try:
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired):
            pass

    def prefetch(self, pkgs: list[str]) -> None:
        """Download every package not cached yet, in one apt-get call when possible."""
        if not self.available:
            return
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        todo = [p for p in pkgs if self._cached(p) is None]
        if not todo:
            return
        _log(f"apt-get download {' '.join(todo)}")
        ok, _ = self._apt_download(todo)
        if not ok:
            self._update()
            ok, _ = self._apt_download(todo)
        if not ok:  # one bad name fails the whole call: fetch what can be fetched one by one
            for p in todo:
                if self._cached(p) is None:
                    ok1, err = self._apt_download([p])
                    if not ok1:
                        self.errors[p] = err or "apt-get download failed"

    def get(self, pkg: str) -> Path | None:
        """Unpacked root of ``pkg`` (downloading it if needed), or None when unavailable."""
        if not self.available:
            return None
        dest = self.extract_root / pkg
        if dest.is_dir():
            return dest
        deb = self._cached(pkg)
        if deb is None:
            self.prefetch([pkg])
            deb = self._cached(pkg)
        if deb is None:
            self.errors.setdefault(pkg, "download failed")
            return None
        tmp = self.extract_root / f".{pkg}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        r = subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp)], capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            self.errors[pkg] = f"dpkg-deb -x failed: {r.stderr.strip()[-200:]}"
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        tmp.rename(dest)
        return dest


# --------------------------------------------------------------------------------------------------
# Capping
# --------------------------------------------------------------------------------------------------


def _spread(docs: list, budget: int, size=_nbytes) -> list:
    """At most ``budget`` bytes of whole documents, chosen evenly across the list (error diffusion)."""
    sizes = [size(d) for d in docs]
    total = sum(sizes)
    if total <= budget:
        return docs
    frac = budget / total
    # Starting with one document's worth of credit keeps the first document (e.g. Genesis).
    out, credit, used = [], float(sizes[0]) if sizes else 0.0, 0
    for d, n in zip(docs, sizes):
        credit += n * frac
        if n <= credit and used + n <= budget:
            out.append(d)
            credit -= n
            used += n
    return out


def fair_shares(sizes: list[int], budget: int) -> list[int]:
    """Split ``budget`` (bytes) over parts of ``sizes`` bytes: equal shares, except that a part
    smaller than its share is taken whole and leaves the rest to the others (max-min fairness)."""
    shares = [0] * len(sizes)
    left, remaining = budget, len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: sizes[i]):
        shares[i] = min(sizes[i], left // remaining)
        left -= shares[i]
        remaining -= 1
    return shares


def _cap_groups(groups: list[list[dict]], cap: int) -> list[dict]:
    """Cap several origins together: smaller origins stay whole, the rest share the budget evenly."""
    budgets = fair_shares([sum(_nbytes(d) for d in g) for g in groups], cap)
    out: list[dict] = []
    for g, b in zip(groups, budgets):
        out.extend(_spread(g, b))
    return out


def _chunk_entries(entries: list[str], doc_prefix: str, source_file: str, sep: str = "\n\n") -> list[dict]:
    """Group consecutive entries into documents of about ``_CHUNK_BYTES`` bytes."""
    docs, cur, size = [], [], 0
    for e in entries:
        cur.append(e)
        size += len(e.encode("utf-8"))
        if size >= _CHUNK_BYTES:
            docs.append(_doc(sep.join(cur), f"{doc_prefix}/{len(docs):05d}", source_file))
            cur, size = [], 0
    if cur:
        docs.append(_doc(sep.join(cur), f"{doc_prefix}/{len(docs):05d}", source_file))
    return docs


def _collapse_lines(text: str) -> str:
    """Collapse runs of spaces within lines, strip lines, and allow at most one blank line."""
    lines = [re.sub(r"[ \t\u00a0]+", " ", l).strip() for l in text.split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def _reflow(lines: list[str], indent: int) -> str:
    """Dedent by ``indent``; paragraphs whose lines all sit at exactly that indent are joined
    into one line (they are just wrapped prose); other paragraphs (code, tables, art) keep
    their line breaks and relative indentation."""
    paras: list[list[str]] = [[]]
    for l in lines:
        if l.strip():
            paras[-1].append(l.rstrip())
        elif paras[-1]:
            paras.append([])
    out = []
    pad = " " * indent
    for p in paras:
        if not p:
            continue
        if all(l.startswith(pad) and not l[indent:indent + 1].isspace() for l in p):
            out.append(" ".join(l.strip() for l in p))
        else:
            out.append("\n".join(l[indent:] if l.startswith(pad) else l.strip() for l in p))
    return "\n\n".join(out)


# --------------------------------------------------------------------------------------------------
# books: KJV (bible program) and World English Bible (SWORD zText)
# --------------------------------------------------------------------------------------------------

_KJV_BOOKS = [
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth", "1 Samuel",
    "2 Samuel", "1 Kings", "2 Kings", "1 Chronicles", "2 Chronicles", "Ezra", "Nehemiah", "Esther", "Job",
    "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon", "Isaiah", "Jeremiah", "Lamentations", "Ezekiel",
    "Daniel", "Hosea", "Joel", "Amos", "Obadiah", "Jonah", "Micah", "Nahum", "Habakkuk", "Zephaniah",
    "Haggai", "Zechariah", "Malachi", "Matthew", "Mark", "Luke", "John", "Acts", "Romans", "1 Corinthians",
    "2 Corinthians", "Galatians", "Ephesians", "Philippians", "Colossians", "1 Thessalonians",
    "2 Thessalonians", "1 Timothy", "2 Timothy", "Titus", "Philemon", "Hebrews", "James", "1 Peter",
    "2 Peter", "1 John", "2 John", "3 John", "Jude", "Revelation",
]
_VERSE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")


def kjv_documents(lines: list[str], source_file: str) -> list[dict]:
    """One document per book from ``bible -f`` output (``Ge1:1 In the beginning ...`` per line).

    A book reads ``Genesis``, then per chapter ``Chapter 1`` and one verse per line as
    ``1 In the beginning ...``.
    """
    books: list[tuple[str, list[tuple[int, int, str]]]] = []
    for line in lines:
        m = _VERSE.match(line.rstrip())
        if not m:
            continue
        abbr, ch, vs, text = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4).strip()
        if not books or books[-1][0] != abbr:
            books.append((abbr, []))
        books[-1][1].append((ch, vs, text))
    names = _KJV_BOOKS if len(books) == len(_KJV_BOOKS) else [b[0] for b in books]
    docs = []
    for (abbr, verses), name in zip(books, names):
        parts = [name]
        last_ch = None
        for ch, vs, text in verses:
            if ch != last_ch:
                parts.append(f"\nChapter {ch}\n")
                last_ch = ch
            parts.append(f"{vs} {text}")
        docs.append(_doc("\n".join(parts), f"kjv/{name.replace(' ', '_')}", source_file))
    return docs


def _run_kjv(bin_root: Path, data_root: Path) -> list[str]:
    exe = bin_root / "usr/bin/bible"
    data = data_root / "usr/lib"
    # -f turns pretty-printing off: one verse per line, prefixed by its reference. The data
    # directory is passed as "." (cwd) because -p splits its argument on spaces.
    r = subprocess.run([str(exe), "-f", "-p", ".", "gen1:1-rev22:21"], cwd=data, capture_output=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"bible exited with {r.returncode}")
    return r.stdout.decode("utf-8", errors="replace").splitlines()


def _attrs(tag: str) -> dict[str, str]:
    return dict(re.findall(r'(\w+)="([^"]*)"', tag))


def osis_to_text(s: str) -> str:
    """Plain text of an OSIS fragment (as stored in SWORD modules).

    Footnotes are dropped; titles, paragraphs, poetry lines and chapters start new lines
    (chapters as ``Chapter N``); all other markup is removed and entities are unescaped.
    """
    s = re.sub(r"</?w\b[^>]*>", "", s)  # word-level lemma tags: most of the markup, inline
    # A footnote sits between two words without spaces around it ("God<note>..</note>created").
    s = re.sub(r"(\w?)<note\b.*?</note>(\w?)", lambda m: m.group(1) + (" " if m.group(1) and m.group(2) else "") + m.group(2), s, flags=re.S)

    def tag(m: re.Match) -> str:
        t = m.group(0)
        name = m.group(1)
        a = _attrs(t)
        if name == "chapter":
            return f"\n\nChapter {a['n']}\n\n" if "sID" in a and "n" in a else "\n\n"
        if name == "title":
            return "\n\n"
        if name == "div" and a.get("type") in ("x-p", "paragraph", "book", "section", "majorSection", "introduction"):
            return "\n\n"
        if name in ("l", "item"):
            return "" if "eID" in a or t.startswith("</") else "\n"  # a line break before each line
        if name == "lb":
            return "\n"
        if name in ("lg", "list"):
            return "\n\n"
        return ""

    s = re.sub(r"</?([A-Za-z]+)\b[^>]*>", tag, s)
    return _collapse_lines(html.unescape(s))


def sword_ztext_documents(moddir: Path, module: str, source_prefix: str) -> list[dict]:
    """One document per book from a SWORD zText module (``ot``/``nt`` ``.bzs`` + ``.bzz``).

    ``.bzs`` holds one (offset, compressed size, size) uint32 triple per block; each block of
    ``.bzz`` is a zlib stream. Blocks are concatenated in order and split at the OSIS book
    ``<div type="book" sID=...>`` markers; text before the first book (a preface) is kept too.
    """
    stream = []
    for part in ("ot", "nt"):
        bzs, bzz = moddir / f"{part}.bzs", moddir / f"{part}.bzz"
        if not (bzs.is_file() and bzz.is_file()):
            continue
        idx, data = bzs.read_bytes(), bzz.read_bytes()
        for i in range(len(idx) // 12):
            off, size, _ = struct.unpack_from("<III", idx, 12 * i)
            stream.append(zlib.decompress(data[off : off + size]).decode("utf-8", errors="replace"))
    s = "".join(stream)
    starts = []
    for m in re.finditer(r"<div\b[^>]*>", s):
        a = _attrs(m.group(0))
        if a.get("type") == "book" and "sID" in a:
            starts.append((m.start(), a.get("osisID", f"book{len(starts)}")))
    bounds = [(0, "preface")] + starts
    docs = []
    for k, (pos, osis_id) in enumerate(bounds):
        end = bounds[k + 1][0] if k + 1 < len(bounds) else len(s)
        text = osis_to_text(s[pos:end])
        if len(text) > 200:
            docs.append(_doc(text, f"{module}/{osis_id}", f"{source_prefix}/{osis_id}"))
    return docs


def _books(pk: _Packages, notes: list[str], max_bytes: int) -> list[list[dict]] | None:
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


# --------------------------------------------------------------------------------------------------
# reference: GCIDE and the Jargon File
# --------------------------------------------------------------------------------------------------

_B64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}
_COMBINING = {"=": "\u0304", "`": "\u0300", "'": "\u0301", ".": "\u0307", '"': "\u0308", "~": "\u0303", ",": "\u0327"}
_GCIDE_NAMED = {
    "deg": "°", "frac12": "½", "frac14": "¼", "frac34": "¾", "frac13": "⅓", "frac23": "⅔", "ae": "æ", "AE": "Æ",
    "oe": "œ", "OE": "Œ", "root": "√", "sect": "§", "para": "¶", "pound": "£", "times": "×", "divide": "÷",
    "minus": "−", "prime": "′", "dprime": "″", "cent": "¢", "middot": "·", "ounce": "℥", "dram": "ʒ",
    "th": "þ", "TH": "Þ", "dh": "ð", "DH": "Ð", "hand": "☞", "asterism": "⁂", "flat": "♭", "sharp": "♯",
}
_GCIDE_SOURCE = re.compile(r"\[(?:[^\[\]\n]*?(?:Webster|WordNet|PJC|Century|Suppl|RP|MW|JC|Chambers)[^\[\]\n]*)\]")


def _dictd_int(s: str) -> int:
    n = 0
    for c in s:
        n = n * 64 + _B64[c]
    return n


def _gcide_accents(s: str) -> str:
    def sub(m: re.Match) -> str:
        a, b = m.group(1), m.group(2)
        if len(a) == 1 and a in _COMBINING and b.isalpha() and len(b) == 1:
            return b + _COMBINING[a]  # [=a] macron, [`e] grave, ...
        if len(b) == 1 and b == "^" and a.isalpha() and len(a) == 1:
            return a + "\u0306"  # [a^] breve
        if len(a) == 1 and a == "^" and b.isalpha() and len(b) == 1:
            return b + "\u0302"  # [^a] circumflex
        return m.group(0)

    s = re.sub(r"\[([=`'.\"~,^]|[A-Za-z])([A-Za-z^])\]", sub, s)
    s = re.sub(r"\[([A-Za-z0-9]+)\]", lambda m: _GCIDE_NAMED.get(m.group(1), m.group(0)), s)
    return s


def gcide_clean(raw: str) -> str:
    """Plain text of one GCIDE entry (dictd form): headword, definitions, quotations.

    Drops pronunciation/syllabification (``\\Ca*lor"ic\\``, ``(k[.a]*l...)``) and source tags
    (``[1913 Webster]``); turns the ASCII accent codes (``[=a]``, ``[`e]``, ``[deg]``) into
    Unicode; removes cross-reference braces; joins the wrapped lines of each paragraph.
    """
    s = re.sub(r"\\[^\\\n]*\\", "", raw)  # \Ca*lor"ic\ syllabification
    s = re.sub(r"\([^()\n]*\*[^()\n]*\)", "", s)  # (k[.a]*l[o^]r) pronunciation
    s = _GCIDE_SOURCE.sub("", s)
    s = _gcide_accents(s).replace("{", "").replace("}", "")
    paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", s)]
    text = "\n\n".join(p for p in paras if p)
    text = re.sub(r" +([,;.])", r"\1", text)
    return unicodedata.normalize("NFC", text).strip()


def gcide_documents(dict_dz: Path, index: Path, source_file: str, max_bytes: int | None = None) -> list[dict]:
    """Documents of ~4 KB of consecutive GCIDE entries (in dictionary order).

    With ``max_bytes``, only about 1.5x that many raw bytes of entry groups are cleaned, chosen
    evenly across the alphabet (the caller caps the result exactly): the dictionary is ~40 MB.
    """
    data = gzip.open(dict_dz).read()
    spans = set()
    for line in index.read_text(encoding="utf-8", errors="replace").splitlines():
        parts = line.split("\t")
        if len(parts) >= 3 and not parts[0].startswith("00-"):
            try:
                spans.add((_dictd_int(parts[1]), _dictd_int(parts[2])))
            except KeyError:
                continue
    chunks: list[list[tuple[int, int]]] = [[]]
    last_end, size = -1, 0
    for off, n in sorted(spans):
        if off < last_end:  # nested/overlapping span: already covered
            continue
        last_end = off + n
        chunks[-1].append((off, n))
        size += n
        if size >= _CHUNK_BYTES:
            chunks.append([])
            size = 0
    chunks = [c for c in chunks if c]
    if max_bytes is not None:
        chunks = _spread(chunks, int(1.5 * max_bytes), size=lambda c: sum(n for _, n in c))
    docs = []
    for c in chunks:
        entries = []
        for off, n in c:
            raw = data[off : off + n]
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("cp1252", errors="replace")  # a handful of entries carry cp1252 quotes
            text = gcide_clean(text)
            if text:
                entries.append(text)
        if entries:
            first = entries[0].split(None, 1)[0].strip(",;.")
            docs.append(_doc("\n\n".join(entries), f"gcide/{c[0][0]:08d}-{first}", source_file))
    return docs


_JARGON_SECTION = re.compile(r"^(Chapter\s\d+\.|Appendix\s[A-Z]\.|Glossary$|Bibliography$)")  # \s: NBSPs
_JARGON_ENTRY = re.compile(r"^   :(.+?):\s*(.*)$")


def jargon_documents(text: str, source_file: str) -> list[dict]:
    """The Jargon File: one document per chapter/appendix, glossary entries grouped by ~4 KB."""
    lines = text.split("\n")
    sections: list[tuple[str, list[str]]] = []
    for line in lines:
        if _JARGON_SECTION.match(line):
            sections.append((" ".join(line.split()), []))
        elif sections:
            sections[-1][1].append(line)
    docs = []
    for title, body in sections:
        if title.startswith("Chapter 3."):
            continue  # revision history: a box-drawing table of version numbers
        if title == "Glossary":
            entries, cur = [], None
            for line in body:
                m = _JARGON_ENTRY.match(line)
                if m:
                    if cur:
                        entries.append(cur)
                    cur = [f"   {m.group(1)}: {m.group(2)}".rstrip()]
                elif re.match(r"^  [A-Z0-9]$", line) or re.match(r"^\s+Part [IVX]+\.", line) or re.match(r"^\S", line):
                    if cur:  # letter heading / part heading: the list that follows is a table of contents
                        entries.append(cur)
                    cur = None
                elif cur is not None:
                    cur.append(line)
            if cur:
                entries.append(cur)
            texts = [_reflow(e, 3).replace("{", "").replace("}", "") for e in entries]
            docs.extend(_chunk_entries([t for t in texts if t], "jargon/glossary", source_file))
        else:
            t = _reflow(body, 3).replace("{", "").replace("}", "")
            if len(t) > 200:
                docs.append(_doc(f"{title}\n\n{t}", f"jargon/{title.split('.')[0].replace(' ', '_')}", source_file))
    return docs


def _reference(pk: _Packages, notes: list[str], max_bytes: int) -> list[list[dict]] | None:
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
            docs = jargon_documents(raw.decode("utf-8", errors="replace"), f"jargon-text:/usr/share/doc/jargon-text/{f.name}")
            groups.append(docs)
            notes.append(f"Jargon File {len(docs)} docs")
    return groups or None


# --------------------------------------------------------------------------------------------------
# technical: Python documentation sources
# --------------------------------------------------------------------------------------------------


def _technical(pk: _Packages, notes: list[str], max_bytes: int) -> list[list[dict]] | None:
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
                docs.append(_doc(text, f"python-doc/{rel}", f"{pkg}:/{base.relative_to(root).as_posix()}/{rel}"))
        notes.append(f"{pkg} {len(docs)} pages")
        return [docs]
    return None


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
            docs.append(_doc(text, f"stdlib/{rel}", f"python{sys.version_info.major}.{sys.version_info.minor}:{rel}"))
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
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                d = ast.get_docstring(node)
                if not d:
                    continue
                if isinstance(node, ast.ClassDef):
                    head = f"class {node.name}"
                else:
                    head = f"{node.name}({ast.unparse(node.args)})"
                parts.append(f"{head}\n{d}")
        if len(parts) > 1:
            doc = _doc("\n\n".join(parts), f"stdlib-doc/{mod}", f"python{sys.version_info.major}.{sys.version_info.minor}:{rel.as_posix()}")
            docs.append(doc)
            total += _nbytes(doc)
            if limit_bytes is not None and total >= limit_bytes:
                break
    return docs


# --------------------------------------------------------------------------------------------------
# web / zh: fortunes
# --------------------------------------------------------------------------------------------------


def _decode_lenient(b: bytes) -> str | None:
    for enc in ("utf-8", "gb18030"):
        try:
            return b.decode(enc)
        except UnicodeDecodeError:
            continue
    return None


def fortune_records(data: bytes) -> list[str]:
    """The fortunes of a strfile source file (records separated by lines holding only ``%``).

    Each record is decoded as UTF-8, else GB18030 (older Chinese files), else dropped.
    Overstrike sequences (``_\\bX``, old-style bold/underline) and ANSI colour escapes are removed.
    """
    out = []
    for rec in re.split(rb"\n%\n", b"\n" + data.replace(b"\r\n", b"\n") + b"\n"):
        text = _decode_lenient(rec)
        if text is None:
            continue
        text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)
        text = re.sub(r".\x08", "", text)
        text = text.replace("\x08", "").strip("\n").rstrip()
        if text.strip() and text.strip() != "%":
            out.append(text)
    return out


def fortune_documents(files: list[tuple[Path, str]], prefix: str) -> list[dict]:
    """Documents of ``_FORTUNES_PER_DOC`` consecutive fortunes per file; files as (path, source_file)."""
    docs = []
    for path, source_file in files:
        recs = fortune_records(path.read_bytes())
        for k in range(0, len(recs), _FORTUNES_PER_DOC):
            docs.append(_doc("\n\n".join(recs[k : k + _FORTUNES_PER_DOC]), f"{prefix}/{path.name}/{k // _FORTUNES_PER_DOC:04d}", source_file))
    return docs


def _fortune_files(root: Path, pkg: str) -> list[tuple[Path, str]]:
    d = root / "usr/share/games/fortunes"
    out = []
    for f in sorted(d.rglob("*")) if d.is_dir() else []:
        if f.is_symlink() or not f.is_file() or f.suffix in (".dat", ".u8") or f.name.startswith("."):
            continue
        out.append((f, f"{pkg}:/{f.relative_to(root).as_posix()}"))
    return out


def _web(pk: _Packages, notes: list[str], max_bytes: int) -> list[list[dict]] | None:
    groups = []
    for pkg in ("fortunes", "fortunes-min"):
        root = pk.get(pkg)
        if root:
            docs = fortune_documents(_fortune_files(root, pkg), pkg)
            groups.append(docs)
            notes.append(f"{pkg} {len(docs)} docs")
    return groups or None


def _zh(pk: _Packages, notes: list[str], max_bytes: int) -> list[list[dict]] | None:
    root = pk.get("fortunes-zh")
    if not root:
        return None
    docs = fortune_documents(_fortune_files(root, "fortunes-zh"), "fortunes-zh")
    notes.append(f"fortunes-zh {len(docs)} docs")
    return [docs]


# --------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------


def _write_jsonl(path: Path, docs: list[dict]) -> int:
    body = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode("utf-8")
    atomic_write_bytes(path, body)
    return len(body)


def _file_stamp(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _refuse_foreign_files(corpus_dir: Path, names: list[str], prev: dict | None) -> None:
    """Never overwrite a user's file: every ``<source>.jsonl`` already there must be one this
    builder wrote (recorded, unchanged, in the marker).

    Raises:
        DataError: a file exists that the demo builder did not write (or that changed since).
    """
    from densetrain.errors import DataError

    known = None if prev is None else prev.get("files")  # a marker without "files": an older builder's
    for n in names:
        path = corpus_dir / f"{n}.jsonl"
        if not path.exists():
            continue
        if prev is None or (known is not None and known.get(n) != _file_stamp(path)):
            raise DataError(f"{path}: exists and was not written by the demo corpus builder; data.demo_corpus = true "
                            "(the tiny preset's default) would overwrite it: set --data.demo_corpus=false or use another "
                            "data.corpus_dir")


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
    params = {"version": CORPUS_VERSION, "max_bytes_per_source": int(max_bytes_per_source), "sources": names, "use_packages": use_packages}
    marker = corpus_dir / MARKER
    prev = None
    if marker.is_file():
        try:
            prev = json.loads(marker.read_text())
        except (OSError, json.JSONDecodeError):
            prev = {}
        if prev.get("params") == params and all((corpus_dir / f"{n}.jsonl").is_file() for n in names):
            _log(f"demo corpus up to date in {corpus_dir} (delete {MARKER} to rebuild)")
            return prev["stats"]
    _refuse_foreign_files(corpus_dir, names, prev)
    corpus_dir.mkdir(parents=True, exist_ok=True)
    cache = Path(cache_dir) if cache_dir else corpus_dir / ".cache" / "debs"
    scratch_parent = corpus_dir / ".cache"
    scratch_parent.mkdir(parents=True, exist_ok=True)
    stats: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="unpack-", dir=scratch_parent) as scratch:
        pk = _Packages(cache, Path(scratch))
        if not use_packages:
            pk.available = False
        if pk.available:
            pk.prefetch([p for n in names for p in _PACKAGES[n]])
        else:
            why = "disabled" if not use_packages else "apt-get/dpkg-deb not found"
            _log(f"package download {why}: falling back to the Python standard library "
                 "(code; technical = stdlib docstrings); other sources are written empty")
        builders = {"books": _books, "reference": _reference, "technical": _technical, "web": _web, "zh": _zh}
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
                missing = [p for p in _PACKAGES[name] if p in pk.errors] or _PACKAGES[name]
                reason = "; ".join(f"{p}: {pk.errors.get(p, 'unavailable')}" for p in missing)
                docs, origin = [], f"unavailable ({reason})"
            else:
                docs = _cap_groups(groups, max_bytes_per_source)
                origin = ", ".join(notes)
            _write_jsonl(corpus_dir / f"{name}.jsonl", docs)
            nbytes = sum(_nbytes(d) for d in docs)
            stats[name] = {"documents": len(docs), "bytes": nbytes, "origin": origin}
            _log(f"{name}: {len(docs)} docs, {nbytes / 1e6:.2f} MB ({origin}) [{time.time() - t1:.1f}s]")
    written = {n: _file_stamp(corpus_dir / f"{n}.jsonl") for n in names}
    atomic_write_json(marker, {"params": params, "stats": stats, "files": written,
                               "build_seconds": round(time.time() - t0, 1)})
    _log(f"demo corpus built in {corpus_dir} in {time.time() - t0:.1f}s")
    return stats
