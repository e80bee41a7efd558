"""Plain-text documents from the formats the demo corpus packages ship (:mod:`densetrain.data.corpus.build`):
``bible -f`` output (KJV), OSIS markup in SWORD zText modules (World English Bible), GCIDE in dictd
form, the Jargon File, strfile fortune files.

A document is a JSON-able dict ``{'text', 'id', 'source_file'}`` (:func:`demo_doc`), one line of the
corpus JSONL files. Everything here is a pure function of bytes already on disk; fetching the
packages is :mod:`densetrain.data.corpus.packages`.
"""

from __future__ import annotations

import gzip
import html
import re
import struct
import unicodedata
import zlib
from pathlib import Path

from densetrain.data.sampling import spread

_CHUNK_BYTES = 4000  # target size of grouped documents (dictionary entries, glossary entries)
_FORTUNES_PER_DOC = 20


def demo_doc(text: str, doc_id: str, source_file: str) -> dict:
    """One demo corpus record (a JSONL line): ``{'text', 'id', 'source_file'}``."""
    return {"text": text, "id": doc_id, "source_file": source_file}


def doc_bytes(doc: dict) -> int:
    """UTF-8 bytes of a record's text (the unit of every demo corpus cap)."""
    return len(doc["text"].encode("utf-8"))


def _chunk_entries(entries: list[str], doc_prefix: str, source_file: str, sep: str = "\n\n") -> list[dict]:
    """Group consecutive entries into documents of about ``_CHUNK_BYTES`` bytes."""
    docs, cur, size = [], [], 0
    for e in entries:
        cur.append(e)
        size += len(e.encode("utf-8"))
        if size >= _CHUNK_BYTES:
            docs.append(demo_doc(sep.join(cur), f"{doc_prefix}/{len(docs):05d}", source_file))
            cur, size = [], 0
    if cur:
        docs.append(demo_doc(sep.join(cur), f"{doc_prefix}/{len(docs):05d}", source_file))
    return docs


def _collapse_lines(text: str) -> str:
    """Collapse runs of spaces within lines, strip lines, and allow at most one blank line."""
    lines = [re.sub(r"[ \t\u00a0]+", " ", line).strip() for line in text.split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def _reflow(lines: list[str], indent: int) -> str:
    """Dedent by ``indent``; paragraphs whose lines all sit at exactly that indent are joined
    into one line (they are just wrapped prose); other paragraphs (code, tables, art) keep
    their line breaks and relative indentation."""
    paras: list[list[str]] = [[]]
    for line in lines:
        if line.strip():
            paras[-1].append(line.rstrip())
        elif paras[-1]:
            paras.append([])
    out = []
    pad = " " * indent
    for p in paras:
        if not p:
            continue
        if all(line.startswith(pad) and not line[indent : indent + 1].isspace() for line in p):
            out.append(" ".join(line.strip() for line in p))
        else:
            out.append("\n".join(line[indent:] if line.startswith(pad) else line.strip() for line in p))
    return "\n\n".join(out)


# --------------------------------------------------------------------------------------------------
# books: KJV (bible program output) and World English Bible (SWORD zText)
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
    for (_, verses), name in zip(books, names):
        parts = [name]
        last_ch = None
        for ch, vs, text in verses:
            if ch != last_ch:
                parts.append(f"\nChapter {ch}\n")
                last_ch = ch
            parts.append(f"{vs} {text}")
        docs.append(demo_doc("\n".join(parts), f"kjv/{name.replace(' ', '_')}", source_file))
    return docs


def _attrs(tag: str) -> dict[str, str]:
    return dict(re.findall(r'(\w+)="([^"]*)"', tag))


def osis_to_text(s: str) -> str:
    """Plain text of an OSIS fragment (as stored in SWORD modules).

    Footnotes are dropped; titles, paragraphs, poetry lines and chapters start new lines
    (chapters as ``Chapter N``); all other markup is removed and entities are unescaped.
    """
    s = re.sub(r"</?w\b[^>]*>", "", s)  # word-level lemma tags: most of the markup, inline
    # A footnote sits between two words without spaces around it ("God<note>..</note>created").
    s = re.sub(r"(\w?)<note\b.*?</note>(\w?)",
               lambda m: m.group(1) + (" " if m.group(1) and m.group(2) else "") + m.group(2), s, flags=re.S)

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
            docs.append(demo_doc(text, f"{module}/{osis_id}", f"{source_prefix}/{osis_id}"))
    return docs


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
        chunks = spread(chunks, int(1.5 * max_bytes), size=lambda c: sum(n for _, n in c))
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
            docs.append(demo_doc("\n\n".join(entries), f"gcide/{c[0][0]:08d}-{first}", source_file))
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
                docs.append(demo_doc(f"{title}\n\n{t}", f"jargon/{title.split('.')[0].replace(' ', '_')}", source_file))
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
            doc_id = f"{prefix}/{path.name}/{k // _FORTUNES_PER_DOC:04d}"
            docs.append(demo_doc("\n\n".join(recs[k : k + _FORTUNES_PER_DOC]), doc_id, source_file))
    return docs
