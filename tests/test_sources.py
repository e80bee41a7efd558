"""Source readers and bad input: Parquet (FineWeb schema), HF save_to_disk folders, zstd/gzip
streams (whole, truncated, corrupt), huge documents, and broken token shards.

Real text only: lines and files of the running Python's standard library. Every file is written
here with the real writers (pyarrow, datasets, zstandard, gzip, ``write_shard``).
"""

from __future__ import annotations

import gzip
import json
import sysconfig
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from densetrain.config import SourceConfig, load_config
from densetrain.data.prepare.readers.documents import Document, SkipLog
from densetrain.data.prepare.readers.paths import file_format, resolve_paths, save_to_disk_files
from densetrain.data.prepare.readers.sources import iter_documents
from densetrain.data.shards import TokenFiles, write_shard
from densetrain.errors import ConfigError, DataError

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _lines(module: str, n: int) -> list[str]:
    """The first ``n`` non-blank lines (stripped) of a stdlib module: short real documents."""
    out = [ln.strip() for ln in (STDLIB / module).read_text(encoding="utf-8").splitlines() if ln.strip()]
    assert len(out) >= n, module
    return out[:n]


def _read(src: SourceConfig, root: Path, **kw) -> tuple[list[Document], SkipLog]:
    skips = SkipLog(print_first=0)
    return list(iter_documents(src, root, skips, **kw)), skips


def _fineweb_table(texts: list, start: int = 0) -> pa.Table:
    """FineWeb's columns (datatrove's parquet writer) plus a timestamp and a nested column."""
    n = len(texts)
    ids = [f"<urn:uuid:{start + i:08d}>" for i in range(n)]
    return pa.table({
        "text": pa.array(texts, pa.string()),
        "id": pa.array(ids, pa.string()),
        "dump": pa.array(["CC-MAIN-2024-10"] * n),
        "url": pa.array([f"https://docs.python.org/3/{start + i}" for i in range(n)]),
        "date": pa.array(["2024-02-21T10:00:00Z"] * n),
        "file_path": pa.array([f"s3://commoncrawl/{start + i}.warc.gz" for i in range(n)]),
        "language": pa.array(["en"] * n),
        "language_score": pa.array([0.5 + (start + i) / 10000 for i in range(n)], pa.float64()),
        "token_count": pa.array([start + i for i in range(n)], pa.int64()),
        "crawled": pa.array([1_700_000_000_000_000 + i for i in range(n)], pa.timestamp("us")),
        "tags": pa.array([["a", "b"]] * n, pa.list_(pa.string())),  # nested: not metadata
    })


# --------------------------------------------------------------------------------------------------
# Parquet
# --------------------------------------------------------------------------------------------------


def test_parquet_fineweb_schema_rows_metadata_and_bad_rows(tmp_path):
    texts: list = _lines("_pydecimal.py", 2500)
    texts[1499] = None  # row 1500: null text
    pq.write_table(_fineweb_table(texts), tmp_path / "a.parquet", row_group_size=900)
    assert pq.ParquetFile(tmp_path / "a.parquet").num_row_groups == 3
    # same columns, but the text column holds integers: every row is skipped, with the rows named
    pq.write_table(pa.table({"text": pa.array([1, 2, 3], pa.int64()), "id": ["x", "y", "z"]}), tmp_path / "b.parquet")

    docs, skips = _read(SourceConfig(name="fw", paths=["."]), tmp_path)  # auto: .parquet
    assert len(docs) == 2499
    want = [(t, "a.parquet", i + 1, f"<urn:uuid:{i:08d}>") for i, t in enumerate(texts) if t is not None]
    assert [(d.text, d.source_file, d.line, d.doc_id) for d in docs] == want
    d = docs[1500]  # row 1502 (the null row 1500 is missing from the documents)
    assert d.line == 1502 and d.text == texts[1501]
    assert d.meta == {
        "dump": "CC-MAIN-2024-10", "url": "https://docs.python.org/3/1501", "date": "2024-02-21T10:00:00Z",
        "file_path": "s3://commoncrawl/1501.warc.gz", "language": "en", "language_score": 0.5 + 1501 / 10000,
        "token_count": 1501, "crawled": "2023-11-14 22:13:20.001501",
    }
    assert dict(skips.counts) == {"text field not a string": 4}
    assert skips.examples == [
        "a.parquet:1500: text field not a string: 'text' is null",
        "b.parquet:1: text field not a string: column 'text' is int64; rows 1-3",
    ]


def test_parquet_text_field_invalid_utf8_and_missing_column(tmp_path):
    good = _lines("json/__init__.py", 3)
    # Parquet does not validate UTF-8: build a string column with one bad value
    raw = [s.encode() for s in good[:2]] + [b"caf\xe9"] + [good[2].encode()]
    offsets = np.cumsum([0] + [len(r) for r in raw]).astype(np.int32)
    arr = pa.Array.from_buffers(pa.string(), 4, [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(b"".join(raw))])
    pq.write_table(pa.table({"body": arr, "n": [1, 2, 3, 4]}), tmp_path / "u.parquet")
    docs, skips = _read(SourceConfig(name="u", paths=["u.parquet"], format="parquet", text_field="body"), tmp_path)
    assert [(d.text, d.line, d.doc_id, d.meta) for d in docs] == [
        (good[0], 1, "u.parquet:1", {"n": 1}), (good[1], 2, "u.parquet:2", {"n": 2}),
        (good[2], 4, "u.parquet:4", {"n": 4}),
    ]
    assert skips.examples == ["u.parquet:3: invalid UTF-8: byte 0xe9 at offset 3"]

    docs, skips = _read(SourceConfig(name="u", paths=["u.parquet"]), tmp_path)  # text_field 'text' absent
    assert docs == [] and dict(skips.counts) == {"missing text field": 4}
    assert skips.examples == ["u.parquet: missing text field: no column 'text' (columns: body, n); 4 rows"]


def test_truncated_parquet_is_skipped_and_the_next_file_read(tmp_path):
    texts = _lines("argparse.py", 300)
    pq.write_table(_fineweb_table(texts[:150]), tmp_path / "000.parquet", row_group_size=50)
    pq.write_table(_fineweb_table(texts[150:], start=150), tmp_path / "001.parquet", row_group_size=50)
    blob = (tmp_path / "000.parquet").read_bytes()
    (tmp_path / "000.parquet").write_bytes(blob[: len(blob) // 2])  # the file cut in half
    (tmp_path / "002.parquet").write_bytes(b"")  # an empty file
    docs, skips = _read(SourceConfig(name="fw", paths=["*.parquet"]), tmp_path)
    assert [d.text for d in docs] == texts[150:]
    assert [d.line for d in docs] == list(range(1, 151)) and docs[0].source_file == "001.parquet"
    assert dict(skips.counts) == {"unreadable Parquet": 2}
    assert skips.examples[0] == (
        "000.parquet: unreadable Parquet: Parquet magic bytes not found in footer. "
        "Either the file is corrupted or this is not a parquet file."
    )
    assert skips.examples[1].startswith("002.parquet: unreadable Parquet: ")


# --------------------------------------------------------------------------------------------------
# Hugging Face save_to_disk folders and Arrow files
# --------------------------------------------------------------------------------------------------


def test_save_to_disk_folder_is_one_dataset_in_state_json_order(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    texts = _lines("argparse.py", 10)
    ds = datasets.Dataset.from_dict({"text": texts, "id": [f"ex-{i}" for i in range(10)],
                                     "score": [i / 4 for i in range(10)]})
    ds.save_to_disk(str(tmp_path / "corpus" / "hf"), num_shards=3)
    folder = tmp_path / "corpus" / "hf"
    stale = (folder / "data-00000-of-00003.arrow").read_bytes()
    (folder / "cache-0123.arrow").write_bytes(stale)  # stale cache: not data
    (tmp_path / "corpus" / "notes.txt").write_text(texts[0])

    src = SourceConfig(name="hf", paths=["."])
    files = resolve_paths(src, tmp_path / "corpus")
    assert [f.name for f in files] == ["data-00000-of-00003.arrow", "data-00001-of-00003.arrow",
                                       "data-00002-of-00003.arrow", "notes.txt"]
    docs, skips = _read(src, tmp_path / "corpus")
    assert skips.total == 0
    assert [d.text for d in docs] == texts + [texts[0]]
    hf = docs[:10]
    assert [d.doc_id for d in hf] == [f"ex-{i}" for i in range(10)]
    assert [d.meta for d in hf] == [{"score": i / 4} for i in range(10)]
    # rows are numbered within each arrow file (4 + 3 + 3 rows)
    assert [(d.source_file, d.line) for d in hf][3:5] == [("hf/data-00000-of-00003.arrow", 4),
                                                          ("hf/data-00001-of-00003.arrow", 1)]

    # the order is state.json's, not the file names'
    state = json.loads((folder / "state.json").read_text())
    state["_data_files"].reverse()
    (folder / "state.json").write_text(json.dumps(state))
    docs, _ = _read(SourceConfig(name="hf", paths=["hf"]), tmp_path / "corpus")
    assert [d.text for d in docs] == texts[7:] + texts[4:7] + texts[:4]

    # a broken dataset description is a one-line error before anything is read
    state["_data_files"].append({"filename": "data-00009-of-00003.arrow"})
    (folder / "state.json").write_text(json.dumps(state))
    with pytest.raises(DataError, match=r"data-00009-of-00003\.arrow: listed in .*state\.json but missing"):
        save_to_disk_files(folder)


def test_dataset_dict_folder_and_truncated_arrow(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    texts = _lines("json/decoder.py", 60)
    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": texts[:50]}),
        "test": datasets.Dataset.from_dict({"text": texts[50:]}),
    })
    dd.save_to_disk(str(tmp_path / "dd"))
    files = resolve_paths(SourceConfig(name="dd", paths=["dd"]), tmp_path)
    assert [f.relative_to(tmp_path).as_posix() for f in files] == ["dd/test/data-00000-of-00001.arrow",
                                                                   "dd/train/data-00000-of-00001.arrow"]
    docs, skips = _read(SourceConfig(name="dd", paths=["dd/train"], format="arrow"), tmp_path)
    assert [d.text for d in docs] == texts[:50] and skips.total == 0
    assert docs[-1].doc_id == "dd/train/data-00000-of-00001.arrow:50"

    # an Arrow stream of several batches cut short: the complete batches are kept
    table = pa.table({"text": texts})
    with pa.OSFile(str(tmp_path / "s.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        for k in range(0, 60, 20):
            w.write_batch(table.slice(k, 20).to_batches()[0])
    blob = (tmp_path / "s.arrow").read_bytes()
    (tmp_path / "s.arrow").write_bytes(blob[: len(blob) - 300])
    docs, skips = _read(SourceConfig(name="s", paths=["s.arrow"]), tmp_path)
    assert [d.text for d in docs] == texts[:40]
    assert dict(skips.counts) == {"unreadable Arrow": 1}
    assert skips.examples[0].startswith("s.arrow:41: unreadable Arrow: ")


# --------------------------------------------------------------------------------------------------
# Compressed streams
# --------------------------------------------------------------------------------------------------


def _jsonl(texts: list[str]) -> bytes:
    rows = ({"text": t, "id": f"d{i}", "url": f"u{i}", "n": i} for i, t in enumerate(texts))
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def test_text_file_with_one_invalid_byte_loses_only_that_line(tmp_path):
    """Issue 14: one Latin-1 byte in a UTF-8 text file drops its line, not the file; the skip log names
    file:line (plain and gzip text, and the paragraph reader, which keeps the rest of the paragraph)."""
    lines = (STDLIB / "textwrap.py").read_text(encoding="utf-8").split("\n")
    bad = next(i for i, line in enumerate(lines) if i > 100 and line.strip() and lines[i + 1].strip())
    raw = [line.encode("utf-8") for line in lines]
    raw[bad] = raw[bad] + b" caf\xe9"  # a Latin-1 e-acute pasted into a UTF-8 file
    data = b"\n".join(raw)
    (tmp_path / "plain.txt").write_bytes(data)
    (tmp_path / "packed.txt").write_bytes(gzip.compress(data))
    want = "\n".join(lines[:bad] + lines[bad + 1 :])
    for name in ("plain.txt", "packed.txt"):
        skips = SkipLog(print_first=0)
        docs = list(iter_documents(SourceConfig(name="t", paths=[name], format="text"), tmp_path, skips))
        assert [d.text for d in docs] == [want], name
        column = len(raw[bad])  # the last byte of the line
        assert skips.examples == [f"{name}:{bad + 1}: invalid UTF-8: byte 0xe9 at column {column}; line dropped"]
        assert skips.counts == {"invalid UTF-8": 1}

    skips = SkipLog(print_first=0)
    paras = list(iter_documents(SourceConfig(name="p", paths=["plain.txt"], format="paragraphs"), tmp_path, skips))
    assert skips.examples == [f"plain.txt:{bad + 1}: invalid UTF-8: byte 0xe9 at column {column}; line dropped"]
    holder = [p for p in paras if p.line <= bad + 1][-1]  # the paragraph that held the bad line
    end = next(i for i in range(bad, len(lines)) if not lines[i].strip())
    assert holder.text == "\n".join(lines[holder.line - 1 : bad] + lines[bad + 1 : end])
    assert sum(len(p.text.split("\n")) for p in paras) == sum(1 for ln in lines if ln.strip()) - 1


def test_zstd_jsonl_and_text_by_magic_bytes(tmp_path):
    texts = _lines("argparse.py", 400)
    raw = _jsonl(texts)
    cctx = zstandard.ZstdCompressor(level=3)
    half = raw.index(b"\n", len(raw) // 2) + 1
    # two frames (pzstd-style)
    (tmp_path / "a.jsonl.zst").write_bytes(cctx.compress(raw[:half]) + cctx.compress(raw[half:]))
    (tmp_path / "b.jsonl").write_bytes(cctx.compress(raw[:half]))  # no .zst suffix: detected by magic bytes
    page = (STDLIB / "json" / "encoder.py").read_text(encoding="utf-8")
    (tmp_path / "c.txt.zst").write_bytes(cctx.compress(page.encode()))

    docs, skips = _read(SourceConfig(name="z", paths=["a.jsonl.zst", "b.jsonl", "c.txt.zst"]), tmp_path)
    assert skips.total == 0
    n_half = raw[:half].count(b"\n")
    assert [d.text for d in docs] == texts + texts[:n_half] + [page]
    assert (docs[7].doc_id, docs[7].line, docs[7].meta) == ("d7", 8, {"url": "u7", "n": 7})  # other fields kept
    assert docs[-1].source_file == "c.txt.zst" and docs[-1].line is None and docs[-1].meta is None


@pytest.mark.parametrize("kind", ["gzip", "zstd"])
def test_truncated_stream_keeps_records_before_the_cut(tmp_path, kind):
    page = "".join((STDLIB / m).read_text(encoding="utf-8") for m in ("_pydecimal.py", "typing.py", "argparse.py"))
    texts = [page[i * 600 : (i + 1) * 600] for i in range(700)]  # 420 KB + JSON escapes: several zstd blocks
    raw = _jsonl(texts)
    if kind == "gzip":
        comp = gzip.compress(raw)
        cut = comp[: len(comp) // 2]
        readable = zlib.decompressobj(wbits=31).decompress(cut)  # what a gzip reader can get out of the cut file
    else:
        comp = zstandard.ZstdCompressor(level=1).compress(raw)  # several 128 KiB blocks
        cut = comp[: len(comp) // 2]
        readable = zstandard.ZstdDecompressor().decompressobj().decompress(cut)
    k = readable.count(b"\n")
    assert 0 < k < len(texts)
    (tmp_path / "cut.jsonl").write_bytes(cut)
    (tmp_path / "whole.jsonl").write_bytes(raw[: raw.index(b"\n") + 1])  # a later file is still read
    docs, skips = _read(SourceConfig(name="c", paths=["cut.jsonl", "whole.jsonl"]), tmp_path)
    assert [d.text for d in docs[:k]] == texts[:k] and docs[k].source_file == "whole.jsonl"
    assert dict(skips.counts) == {f"truncated {kind}": 1}
    assert skips.examples[0].startswith(f"cut.jsonl:{k + 1}: truncated {kind}: the stream ends before its end marker")

    # whole-file text: the partial document is not kept; paragraphs: the complete ones are
    (tmp_path / "cut.txt").write_bytes(cut)
    docs, skips = _read(SourceConfig(name="t", paths=["cut.txt"], format="text"), tmp_path)
    assert docs == [] and skips.examples[0].startswith(f"cut.txt: truncated {kind}")
    lines = _lines("_pydecimal.py", 5000)
    paras = ["\n".join(lines[i : i + 5]) for i in range(0, 5000, 5)]  # 1000 paragraphs, ~200 KB
    blob = "\n\n".join(paras).encode()
    pcomp = gzip.compress(blob) if kind == "gzip" else zstandard.ZstdCompressor(level=1).compress(blob)
    (tmp_path / "p.txt").write_bytes(pcomp[: len(pcomp) * 9 // 10])  # past the first 128 KiB zstd block
    docs, skips = _read(SourceConfig(name="p", paths=["p.txt"], format="paragraphs"), tmp_path)
    assert 0 < len(docs) < 1000 and [d.text for d in docs] == paras[: len(docs)]
    assert [d.line for d in docs[:3]] == [1, 7, 13]
    assert dict(skips.counts) == {f"truncated {kind}": 1}


def test_corrupt_streams_are_logged(tmp_path):
    raw = _jsonl(_lines("argparse.py", 300))
    comp = bytearray(gzip.compress(raw))
    comp[-6] ^= 0xFF  # a byte of the CRC-32 trailer: every record decodes, the check fails at the end
    (tmp_path / "crc.jsonl.gz").write_bytes(bytes(comp))
    docs, skips = _read(SourceConfig(name="g", paths=["crc.jsonl.gz"]), tmp_path)
    assert len(docs) == 300 and dict(skips.counts) == {"corrupt gzip": 1}
    assert skips.examples[0].startswith("crc.jsonl.gz:301: corrupt gzip: CRC check failed")
    # a flipped byte inside the compressed data (deflate may decode it into garbage that the CRC
    # catches at the end, zstd fails at the block); the next file is still read
    blobs = (("mid.jsonl.gz", gzip.compress(raw)), ("mid.jsonl.zst", zstandard.ZstdCompressor().compress(raw)))
    for name, blob in blobs:
        bad = bytearray(blob)
        bad[len(bad) // 2] ^= 0xFF
        (tmp_path / name).write_bytes(bytes(bad))
    (tmp_path / "ok.jsonl").write_bytes(raw)
    docs, skips = _read(SourceConfig(name="m", paths=["mid.jsonl.gz", "mid.jsonl.zst", "ok.jsonl"]), tmp_path)
    assert [d.source_file for d in docs][-300:] == ["ok.jsonl"] * 300
    assert sum(d.source_file == "ok.jsonl" for d in docs) == 300
    assert skips.counts["corrupt gzip"] == 1 and skips.counts["corrupt zstd"] == 1
    assert ("mid.jsonl.zst:1: corrupt zstd: zstd decompressor error: Data corruption detected; reading of the file "
            "stops here") in skips.examples


# --------------------------------------------------------------------------------------------------
# Huge documents
# --------------------------------------------------------------------------------------------------


def test_huge_documents_are_skipped_with_their_size(tmp_path):
    cap = 1000
    big = "\n".join(_lines("argparse.py", 300))[:5000]  # no blank line: one paragraph
    assert len(big.encode()) == 5000 and not big.endswith("\n")
    # JSONL: the limit is on the record line; exactly `cap` bytes passes, one more does not
    small, frame = json.dumps({"text": "x"}), len(json.dumps({"text": ""}))
    at_cap, over = json.dumps({"text": "y" * (cap - frame)}), json.dumps({"text": "y" * (cap - frame + 1)})
    assert (len(at_cap), len(over)) == (cap, cap + 1)
    lines = [small, json.dumps({"text": big}), at_cap, over, small]
    (tmp_path / "a.jsonl").write_text("\n".join(lines))  # no final newline
    docs, skips = _read(SourceConfig(name="h", paths=["a.jsonl"]), tmp_path, max_document_bytes=cap)
    assert [d.line for d in docs] == [1, 3, 5]
    big_line = len(lines[1].encode())
    assert skips.examples == [
        f"a.jsonl:2: document too large: record of {big_line:,} bytes > data.max_document_bytes (1,000)",
        "a.jsonl:4: document too large: record of 1,001 bytes > data.max_document_bytes (1,000)",
    ]
    # text files (plain and gzip), a paragraph, a parquet value
    (tmp_path / "b.txt").write_text(big)
    (tmp_path / "c.txt.gz").write_bytes(gzip.compress(big.encode()))
    docs, skips = _read(SourceConfig(name="t", paths=["b.txt", "c.txt.gz"]), tmp_path, max_document_bytes=cap)
    assert docs == [] and skips.examples == [
        f"{n}: document too large: file of 5,000 bytes > data.max_document_bytes (1,000)" for n in ("b.txt", "c.txt.gz")
    ]
    (tmp_path / "d.txt").write_text(f"short one\n\n{big}\n\nshort two\n")
    docs, skips = _read(SourceConfig(name="p", paths=["d.txt"], format="paragraphs"), tmp_path, max_document_bytes=cap)
    # 3: big's first line
    assert [(d.text, d.line) for d in docs] == [("short one", 1), ("short two", 3 + big.count("\n") + 2)]
    assert skips.examples == ["d.txt:3: document too large: paragraph of 5,000 bytes > data.max_document_bytes (1,000)"]
    pq.write_table(_fineweb_table(["short", big, "é" * 600]), tmp_path / "e.parquet")
    docs, skips = _read(SourceConfig(name="q", paths=["e.parquet"]), tmp_path, max_document_bytes=cap)
    assert [d.text for d in docs] == ["short"]
    assert skips.examples == [
        "e.parquet:2: document too large: text of 5,000 bytes > data.max_document_bytes (1,000)",
        "e.parquet:3: document too large: text of 1,200 bytes > data.max_document_bytes (1,000)",  # UTF-8 bytes
    ]


# --------------------------------------------------------------------------------------------------
# Format detection and config
# --------------------------------------------------------------------------------------------------


def test_auto_format_detection(tmp_path):
    for name, fmt in [("a.jsonl", "jsonl"), ("a.JSONL.GZ", "jsonl"), ("a.json.zst", "jsonl"), ("a.jsonl.zst", "jsonl"),
                      ("a.parquet", "parquet"), ("data-00000-of-00001.arrow", "arrow"), ("a.txt.zst", "text"),
                      ("a.json", "text")]:
        assert file_format(Path(name), "auto") == fmt, name
    assert file_format(Path("a.parquet"), "text") == "text"
    texts = _lines("json/scanner.py", 6)
    (tmp_path / "1.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(texts[:1])))
    pq.write_table(pa.table({"text": texts[1:2]}), tmp_path / "2.parquet")
    schema = pa.schema([("text", pa.string())])
    with pa.OSFile(str(tmp_path / "3.arrow"), "wb") as sink, pa.ipc.new_file(sink, schema) as w:
        w.write_table(pa.table({"text": texts[2:3]}))  # Arrow *file* format (Feather v2)
    (tmp_path / "4.txt").write_text(texts[3])
    (tmp_path / "5.json.gz").write_bytes(gzip.compress(_jsonl(texts[4:6])))
    docs, skips = _read(SourceConfig(name="mix", paths=["."]), tmp_path)
    assert skips.total == 0
    assert [(d.source_file, d.text) for d in docs] == [
        ("1.jsonl.zst", texts[0]), ("2.parquet", texts[1]), ("3.arrow", texts[2]), ("4.txt", texts[3]),
        ("5.json.gz", texts[4]), ("5.json.gz", texts[5]),
    ]
    assert len({d: 1 for d in docs}) == 6  # hashable although meta is a dict


def test_config_accepts_new_formats_and_checks_max_document_bytes():
    sources = [{"name": "web", "paths": ["x"], "format": "parquet"}, {"name": "hf", "paths": ["y"], "format": "arrow"}]
    stages = [{"name": "main", "start": 0.0, "mix": {"web": 1.0}}]
    cfg = load_config(preset="tiny", overrides=[("data.sources", sources), ("stages", stages),
                                                ("data.max_document_bytes", 1 << 20)])
    assert [s.format for s in cfg.data.sources] == ["parquet", "arrow"] and cfg.data.max_document_bytes == 1 << 20
    with pytest.raises(ConfigError, match=r"data\.sources\[0\]\.format must be .*parquet.*arrow.*got 'xml'"):
        load_config(preset="tiny", overrides=[("data.sources", [{"name": "web", "paths": ["x"], "format": "xml"}])])
    with pytest.raises(ConfigError, match="data.max_document_bytes must be positive"):
        load_config(preset="tiny", overrides=[("data.max_document_bytes", 0)])


# --------------------------------------------------------------------------------------------------
# Shards
# --------------------------------------------------------------------------------------------------


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_shard_with_ids_over_the_vocab_names_file_id_and_offset(tmp_path):
    docs = [np.array([5, 9, 2]), np.array([7, 600, 3, 601, 0]), np.array([1])]
    write_shard(tmp_path / "000000", [np.array([4, 4])], 2)
    write_shard(tmp_path / "000001", docs, 2)
    tf = TokenFiles(tmp_path)
    tf.check_vocab(602)
    with pytest.raises(DataError) as e:
        tf.check_vocab(512)
    assert _one_line(e) == (
        f"{tmp_path / '000001.ds'}: token id 601 >= vocabulary size 512 at token offset 6 "
        "(document 1 of the file; 2 of 9 ids out of range) "
        "(shards made with another tokenizer? check data.tokenizer and model.vocab_size)"
    )


def test_torn_shard_and_index_mismatch_are_one_line_errors(tmp_path):
    write_shard(tmp_path / "000000", [np.array([1, 2, 3]), np.array([4, 5])], 2)
    ds, idx = tmp_path / "000000.ds", tmp_path / "000000.ds.index"
    good_ds, good_idx = ds.read_bytes(), idx.read_bytes()
    assert len(TokenFiles(tmp_path)) == 5

    ds.write_bytes(good_ds + b"\x07")  # torn: 11 bytes of uint16
    with pytest.raises(DataError) as e:
        TokenFiles(tmp_path)
    assert _one_line(e) == f"{ds}: size 11 bytes is not a multiple of the token size 2"

    ds.write_bytes(good_ds + b"\x07\x00")  # one token more than the index describes
    with pytest.raises(DataError) as e:
        TokenFiles(tmp_path)
    assert _one_line(e) == (f"{idx}: document ends do not match 000000.ds: last document end is 5 but the file "
                            "holds 6 tokens")

    ds.write_bytes(good_ds)
    idx.write_bytes(good_idx[:-3])
    with pytest.raises(DataError, match=r"000000\.ds\.index: size 13 bytes is not a multiple of 8"):
        TokenFiles(tmp_path)
    idx.write_bytes(np.array([4, 3, 5], dtype="<u8").tobytes())
    with pytest.raises(DataError, match=r"000000\.ds\.index: document ends decrease at document 1 \(4 -> 3\)"):
        TokenFiles(tmp_path)
