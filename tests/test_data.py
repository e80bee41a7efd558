"""Data preparation: sources, tokenizers, shards, prepare, demo corpus.

Real text only: the running Python's standard library and /usr/share/common-licenses (Debian;
skipped with a reason when absent). Downloads happen only in the demo-corpus package test, and
only as root with apt-get available.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from densetrain.config import Config, DataConfig, SourceConfig
from densetrain.data.corpus import build as corpus
from densetrain.data.corpus import texts as corpus_texts
from densetrain.data.prepare import prepare
from densetrain.data.prepare import source as prepare_source
from densetrain.data.prepare.filters.chain import FilterStats, apply_filters, build_filters, clean_text
from densetrain.data.prepare.readers.documents import SkipLog
from densetrain.data.prepare.readers.paths import resolve_paths
from densetrain.data.prepare.readers.sources import iter_documents
from densetrain.data.shards import TokenFiles, sha256_file, token_size_for, write_shard
from densetrain.data.tokenizer import Tokenizer, load_tokenizer, train_bpe
from densetrain.errors import DataError

LICENSES = Path("/usr/share/common-licenses")
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files(max_bytes: int) -> list[Path]:
    """A deterministic spread of stdlib .py files (packages json, email, html, collections, ...)."""
    picked, total = [], 0
    for pkg in ("json", "html", "collections", "email", "urllib", "logging", "importlib"):
        for f in sorted((STDLIB / pkg).glob("*.py")):
            n = f.stat().st_size
            if total + n > max_bytes:
                return picked
            picked.append(f)
            total += n
    return picked


@pytest.fixture(scope="module")
def stdlib_texts() -> list[str]:
    texts = [f.read_text(encoding="utf-8") for f in _stdlib_files(700_000)]
    assert len(texts) > 20
    return texts


@pytest.fixture(scope="module")
def bpe(tmp_path_factory, stdlib_texts) -> Tokenizer:
    out = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    return train_bpe(stdlib_texts, 1024, out)


def _texts_equal_roundtrip(tok: Tokenizer, texts: list[str]) -> None:
    batch = tok.encode_batch(texts)
    for t, ids in zip(texts, batch):
        assert ids == tok.encode(t)
        assert tok.eos_id not in ids
        assert tok.decode(ids) == t


# --------------------------------------------------------------------------------------------------
# sources
# --------------------------------------------------------------------------------------------------

_BAD_JSONL = [
    b'{"text": "hello", "id": "doc-a"}',
    b'{"text": "unterminated',
    b'{"text": "bad \xff byte"}',
    b'{"body": "no text field"}',
    b'{"text": 5}',
    b"   ",
    b"[1, 2]",
    b'{"text": "world", "id": 7}',
    b'{"text": "lone \\ud800 half"}',  # JSON escapes of text that is not Unicode (no UTF-8 bytes exist for it)
    b'{"text": "a pair \\ud83d\\ude00 is an emoji"}',
]


@pytest.mark.parametrize("name", ["bad.jsonl", "bad.jsonl.gz"])
def test_jsonl_bad_records_are_counted_with_location(tmp_path, name):
    raw = b"\n".join(_BAD_JSONL) + b"\n"
    (tmp_path / name).write_bytes(gzip.compress(raw) if name.endswith(".gz") else raw)
    skips = SkipLog(print_first=0)
    docs = list(iter_documents(SourceConfig(name="s", paths=[name]), tmp_path, skips))
    assert [(d.text, d.line, d.doc_id, d.source_file) for d in docs] == [
        ("hello", 1, "doc-a", name),
        ("world", 8, f"{name}:8", name),  # a non-string id falls back to file:line
        ("a pair \U0001f600 is an emoji", 10, f"{name}:10", name),
    ]
    assert skips.total == 6
    assert dict(skips.counts) == {
        "malformed JSON": 1, "invalid UTF-8": 1, "missing text field": 1, "text field not a string": 1,
        "not a JSON object": 1, "unpaired surrogate": 1,
    }
    ex = "\n".join(skips.examples)
    for line, reason in [(2, "malformed JSON"), (3, "invalid UTF-8"), (4, "missing text field"),
                         (5, "text field not a string"), (7, "not a JSON object"),
                         (9, "unpaired surrogate: \\ud800 at character 6 of 'text'")]:
        assert f"{name}:{line}: {reason}" in ex
    assert skips.summary()["total"] == 6


def test_text_paragraphs_dirs_globs(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "b.txt").write_text("second file\n")
    (tmp_path / "d" / "sub" / "a.txt").write_text("first\n\n  \npara two\nline two\n\n\n")
    (tmp_path / "d" / ".hidden.txt").write_text("never read")
    (tmp_path / "d" / "bad.txt").write_bytes(b"line one\nline \xfe two\n")
    skips = SkipLog(print_first=0)
    docs = list(iter_documents(SourceConfig(name="t", paths=["d"], format="text"), tmp_path, skips))
    assert [d.source_file for d in docs] == ["d/b.txt", "d/bad.txt", "d/sub/a.txt"]  # sorted, hidden skipped
    assert docs[0].text == "second file\n" and docs[0].line is None
    assert docs[1].text == "line one\n"  # only the line with the bad byte is dropped
    assert skips.examples == ["d/bad.txt:2: invalid UTF-8: byte 0xfe at column 6; line dropped"]

    paras = list(iter_documents(SourceConfig(name="p", paths=["d/sub/*.txt"], format="paragraphs"), tmp_path))
    assert [(p.text, p.line) for p in paras] == [("first", 1), ("para two\nline two", 4)]
    # recursive glob, auto format = text
    assert len(resolve_paths(SourceConfig(name="g", paths=["d/**/*.txt"]), tmp_path)) == 3


def test_missing_path_is_a_one_line_data_error(tmp_path):
    src = SourceConfig(name="web", paths=["nope.jsonl"])
    with pytest.raises(DataError, match=r"nope\.jsonl: no such file \(data\.sources\[3\]\.paths\)"):
        list(iter_documents(src, tmp_path, source_index=3))
    with pytest.raises(DataError, match="glob matched nothing"):
        resolve_paths(SourceConfig(name="web", paths=["*.none"]), tmp_path, 0)


def test_common_licenses_read_as_text_documents():
    if not LICENSES.is_dir():
        pytest.skip("/usr/share/common-licenses absent (not a Debian-like system)")
    docs = list(iter_documents(SourceConfig(name="lic", paths=[str(LICENSES)], format="text"), Path("/")))
    names = {Path(d.source_file).name for d in docs}
    assert "GPL-3" in names and len(docs) == len([f for f in LICENSES.iterdir() if f.is_file()])
    gpl = next(d for d in docs if d.source_file.endswith("GPL-3"))
    assert "GNU GENERAL PUBLIC LICENSE" in gpl.text


# --------------------------------------------------------------------------------------------------
# tokenizers
# --------------------------------------------------------------------------------------------------


def test_bpe_roundtrip_and_identity(bpe, stdlib_texts, tmp_path):
    assert bpe.kind == "hf" and bpe.eos_id == 0 and bpe.eos_token == "<|endoftext|>"
    assert 300 < bpe.vocab_size <= 1024
    extra = ["naïve café — 漢字 🙂", "tabs\tand\r\nCRLF  ", "<|endoftext|> is just text here", "\x00\x7f"]
    _texts_equal_roundtrip(bpe, stdlib_texts[:30] + extra)
    assert bpe.encode("<|endoftext|>") != [bpe.eos_id]
    ident = bpe.identity()
    assert ident["sha256"] == sha256_file(bpe.name) and ident["vocab_size"] == bpe.vocab_size
    # load by spec
    shards = Path(bpe.name).parent
    assert load_tokenizer("bpe", shards).sha256 == bpe.sha256
    assert load_tokenizer(bpe.name, tmp_path).sha256 == bpe.sha256
    with pytest.raises(DataError, match="not trained yet"):
        load_tokenizer("bpe", tmp_path)
    with pytest.raises(DataError, match="tokenizer file not found"):
        load_tokenizer(str(tmp_path / "missing.json"), tmp_path)


def test_tokenizer_json_without_eos_is_rejected(tmp_path):
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers

    t = HF(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel()
    t.add_special_tokens(["<pad>"])
    t.save(str(tmp_path / "t.json"))
    with pytest.raises(DataError, match="no EOS token"):
        load_tokenizer(str(tmp_path / "t.json"), tmp_path)


def test_tiktoken_cl100k(stdlib_texts):
    try:
        tok = load_tokenizer("tiktoken:cl100k_base", ".")
    except DataError as e:
        pytest.skip(f"cl100k_base unavailable offline: {e}")
    assert (tok.vocab_size, tok.eos_id) == (100277, 100257)
    assert 100257 not in tok.encode("a <|endoftext|> b")
    _texts_equal_roundtrip(tok, stdlib_texts[:10] + ["naïve café — 漢字 🙂"])
    assert token_size_for(tok.vocab_size) == 4
    with pytest.raises(DataError, match="could not be loaded"):
        load_tokenizer("tiktoken:no_such_encoding", ".")


# --------------------------------------------------------------------------------------------------
# shards
# --------------------------------------------------------------------------------------------------


def test_token_size_rule():
    assert token_size_for(8192) == 2 and token_size_for(65536) == 2
    assert token_size_for(65537) == 4 and token_size_for(100277) == 4


def test_shards_layout_read_across_files_and_vocab_check(tmp_path):
    rng = np.random.default_rng(0)
    files_docs = [[rng.integers(0, 60000, size=n) for n in (5, 1, 17)],
                  [rng.integers(0, 60000, size=n) for n in (9, 3)]]
    for j, docs in enumerate(files_docs):
        info = write_shard(tmp_path / f"{j:06d}", docs, 2, tokenizer_name="test-tok")
        ds = tmp_path / f"{j:06d}.ds"
        lens = [len(d) for d in docs]
        assert info["tokens"] == sum(lens) and info["documents"] == len(docs) and info["sha256"] == sha256_file(ds)
        assert ds.stat().st_size == 2 * sum(lens)
        # datatrove: uint64 LE cumulative END offsets, relative to this file
        assert np.fromfile(f"{ds}.index", dtype="<u8").tolist() == np.cumsum(lens).tolist()
        assert Path(f"{ds}.metadata").read_text().split("\n")[:2] == ["test-tok|2", str(sum(lens))]
        assert np.array_equal(np.fromfile(ds, dtype="<u2"), np.concatenate(docs))
    flat = np.concatenate([np.concatenate(d) for d in files_docs])
    tf = TokenFiles(tmp_path)
    assert tf.token_size == 2 and len(tf) == flat.size == 35 and tf.n_docs == 5
    for start, n in [(0, 35), (20, 5), (22, 3), (23, 12), (10, 0), (34, 1)]:
        out = tf.read(start, n)
        assert out.dtype == np.int64 and np.array_equal(out, flat[start : start + n])
    assert tf.doc_ends().tolist() == [5, 6, 23, 32, 35]
    assert np.array_equal(tf.document(3), files_docs[1][0])
    with pytest.raises(IndexError):
        tf.read(30, 6)
    tf.check_vocab(60000)
    with pytest.raises(DataError, match=r"000000\.ds: token id \d+ >= vocabulary size 1000"):
        TokenFiles(tmp_path).check_vocab(1000)


def test_uint32_shards_and_overflow(tmp_path):
    docs = [np.array([1, 70000, 100276]), np.array([100257])]
    with pytest.raises(DataError, match="does not fit in 2 bytes"):
        write_shard(tmp_path / "a" / "000000", docs, 2)
    write_shard(tmp_path / "b" / "000000", docs, 4, tokenizer_name="cl100k_base")
    assert (tmp_path / "b" / "000000.ds").stat().st_size == 4 * 4
    tf = TokenFiles(tmp_path / "b")  # token size read from .ds.metadata
    assert tf.token_size == 4 and tf.read(0, 4).tolist() == [1, 70000, 100276, 100257]
    with pytest.raises(DataError, match="100276 >= vocabulary size 65536"):
        tf.check_vocab(65536)
    # a torn file and an inconsistent index are detected at open
    (tmp_path / "b" / "000000.ds").write_bytes(b"\x01\x00\x00")
    with pytest.raises(DataError, match="not a multiple of the token size"):
        TokenFiles(tmp_path / "b")
    (tmp_path / "b" / "000000.ds").write_bytes(b"\x01\x00\x00\x00")
    with pytest.raises(DataError, match="document ends"):
        TokenFiles(tmp_path / "b")


# --------------------------------------------------------------------------------------------------
# prepare
# --------------------------------------------------------------------------------------------------


def _corpus(tmp_path: Path) -> tuple[Path, list[SourceConfig]]:
    root = tmp_path / "corpus"
    (root / "code").mkdir(parents=True)
    for f in _stdlib_files(400_000):
        shutil.copy(f, root / "code" / f"{f.parent.name}_{f.name}")
    sources = [SourceConfig(name="code", kind="code", paths=["code"], format="text", long_docs=True)]
    lines = [json.dumps({"text": t, "id": f"para-{i}"}) for i, t in enumerate(
        p.strip() for p in (STDLIB / "json" / "__init__.py").read_text().split('"""')[1].split("\n\n") if p.strip())]
    lines += ['{"text": "broken', '{"id": "no text"}', json.dumps({"text": "   "})]
    (root / "notes.jsonl").write_text("\n".join(lines) + "\n")
    sources.append(SourceConfig(name="notes", kind="technical", paths=["notes.jsonl"]))
    if LICENSES.is_dir():
        sources.append(SourceConfig(name="licenses", kind="reference", paths=[str(LICENSES)], format="text"))
    return root, sources


def _cfg(tmp_path, root, sources, tokenizer="bpe", vocab=1024) -> Config:
    cfg = Config()
    cfg.data = DataConfig(corpus_dir=str(root), shards_dir=str(tmp_path / "shards"), tokenizer=tokenizer,
                          tokenizer_vocab_size=vocab, val_fraction=0.1, max_val_tokens=30_000, seed=7, sources=sources)
    cfg.model.vocab_size = vocab
    return cfg


def _check_source_shards(cfg: Config, i: int, src: SourceConfig, tok: Tokenizer) -> None:
    """Decoded shards == cleaned documents, index == token counts, train/val disjoint."""
    shards = Path(cfg.data.shards_dir) / src.name
    manifest = json.loads((shards / "manifest.json").read_text())
    prov = json.loads((shards / "provenance.json").read_text())
    filters = build_filters(src.filters, src.kind, cfg.data.filters)
    raw = {d.doc_id: d.text for d in iter_documents(src, Path(cfg.data.corpus_dir), SkipLog(print_first=0), i)}
    expected = {k: apply_filters(clean_text(v), filters, FilterStats()) for k, v in raw.items()}
    removed = json.loads((shards / "removed.json").read_text())
    reasons = dict(zip(removed["doc_id"], removed["reason"]))
    for doc_id, why in reasons.items():  # every removal has its reason, consistent with the filters
        if expected[doc_id] is None or not clean_text(raw[doc_id]):
            assert why == "empty" if not clean_text(raw[doc_id]) else why.split(":")[0] in {f.name for f in filters}
        else:
            assert why.startswith(("duplicate:exact:", "duplicate:near:", "contaminated:")), why
    assert manifest["stats"]["documents_read"] == len(raw)
    seen: dict[str, set] = {}
    for split in ("train", "val"):
        tf = TokenFiles(shards / split)
        tf.check_vocab(tok.vocab_size)
        p = prov[split]
        lens = np.diff(np.concatenate([[0], tf.doc_ends()]))
        assert lens.tolist() == p["tokens"]
        assert manifest["splits"][split]["tokens"] == len(tf) == sum(p["tokens"])
        for sh in manifest["splits"][split]["shards"]:
            assert sh["sha256"] == sha256_file(shards / sh["path"])
        head = 0 if tok.bos_id is None else 1  # a BOS starts every document (Llama 3)
        for k, doc_id in enumerate(p["doc_id"]):
            toks = tf.document(k)
            assert toks[-1] == tok.eos_id and tok.eos_id not in toks[:-1].tolist()
            if head:
                assert toks[0] == tok.bos_id and tok.bos_id not in toks[1:].tolist()
            assert tok.decode(toks[head:-1]) == expected[doc_id]
            assert p["files"][p["source_file"][k]]  # provenance names a file
        seen[split] = set(p["doc_id"])
    assert not seen["train"] & seen["val"]
    assert seen["train"] | seen["val"] == set(raw) - set(reasons)  # kept + removed = read, nothing lost
    assert not (seen["train"] | seen["val"]) & set(reasons)
    assert len(seen["val"]) >= 1 and manifest["splits"]["val"]["tokens"] <= cfg.data.max_val_tokens


def test_prepare_bpe_roundtrip_skip_and_redo(tmp_path):
    root, sources = _corpus(tmp_path)
    cfg = _cfg(tmp_path, root, sources)
    s = prepare(cfg)
    assert {n: v["status"] for n, v in s["sources"].items()} == {src.name: "prepared" for src in sources}
    assert s["token_size"] == 2 and s["tokenizer"]["eos_id"] == 0
    tok = load_tokenizer("bpe", cfg.data.shards_dir)
    for i, src in enumerate(sources):
        _check_source_shards(cfg, i, src, tok)
    notes = json.loads((Path(cfg.data.shards_dir) / "notes" / "manifest.json").read_text())["stats"]
    assert notes["skipped"]["counts"] == {"malformed JSON": 1, "missing text field": 1}
    assert notes["empty_after_cleaning"] == 1
    top = json.loads((Path(cfg.data.shards_dir) / "manifest.json").read_text())
    assert set(top["sources"]) == {src.name for src in sources} and top["tokenizer"]["sha256"] == tok.sha256

    # re-run: nothing to do, files untouched
    ds = Path(cfg.data.shards_dir) / "code" / "train" / "000000.ds"
    mtime = ds.stat().st_mtime_ns
    s2 = prepare(cfg)
    assert all(v["status"] == "up-to-date" for v in s2["sources"].values())
    assert ds.stat().st_mtime_ns == mtime

    # force: everything redone; BPE training is deterministic, so the tokenizer is the same
    s_force = prepare(cfg, force=True)
    assert all(v["status"] == "prepared" for v in s_force["sources"].values())
    assert s_force["tokenizer"]["sha256"] == tok.sha256

    # an input changes: only that source is redone
    victim = sorted((root / "code").iterdir())[3]
    victim.write_text(victim.read_text() + "\n# changed\n")
    s3 = prepare(cfg)
    assert s3["sources"]["code"]["status"] == "prepared"
    assert all(v["status"] == "up-to-date" for n, v in s3["sources"].items() if n != "code")
    _check_source_shards(cfg, 0, sources[0], tok)

    # the model's embedding must cover the tokenizer
    cfg.model.vocab_size = 512
    with pytest.raises(DataError, match=r"model\.vocab_size \(512\).*data\.tokenizer_vocab_size"):
        prepare(cfg)


def test_prepare_tiktoken_uint32_multi_shard(tmp_path, monkeypatch):
    try:
        load_tokenizer("tiktoken:cl100k_base", ".")
    except DataError as e:
        pytest.skip(f"cl100k_base unavailable offline: {e}")
    root = tmp_path / "corpus"
    root.mkdir()
    docs = [f.read_text() for f in _stdlib_files(150_000)]
    (root / "c.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in docs).encode()))
    src = SourceConfig(name="c", kind="code", paths=["c.jsonl.gz"])
    cfg = _cfg(tmp_path, root, [src], tokenizer="tiktoken:cl100k_base", vocab=8192)
    with pytest.raises(DataError, match=r"model\.vocab_size \(8192\) must be >= the tokenizer vocabulary "
                                        r"\(100277, data\.tokenizer="):
        prepare(cfg)
    cfg.model.vocab_size = 100352
    monkeypatch.setattr(prepare_source, "SHARD_MAX_TOKENS", 8000)  # force several train shard files
    s = prepare(cfg)
    assert s["token_size"] == 4 and s["dtype"] == "uint32"
    train_dir = Path(cfg.data.shards_dir) / "c" / "train"
    files = sorted(train_dir.glob("*.ds"))
    assert len(files) >= 3 and files[0].name == "000000.ds"
    assert sum(f.stat().st_size for f in files) == 4 * s["sources"]["c"]["train"]["tokens"]
    manifest = json.loads((Path(cfg.data.shards_dir) / "c" / "manifest.json").read_text())
    assert all(sh["tokens"] <= 8000 or sh["documents"] == 1 for sh in manifest["splits"]["train"]["shards"])
    _check_source_shards(cfg, 0, src, load_tokenizer("tiktoken:cl100k_base", "."))


def test_prepare_missing_source_path(tmp_path):
    cfg = _cfg(tmp_path, tmp_path, [SourceConfig(name="x", paths=["missing_dir"])])
    with pytest.raises(DataError, match=r"missing_dir: no such file \(data\.sources\[0\]\.paths\)"):
        prepare(cfg)


# --------------------------------------------------------------------------------------------------
# demo corpus
# --------------------------------------------------------------------------------------------------


def test_corpus_parsers_on_small_inputs():
    recs = corpus_texts.fortune_records(b"Hello _\x08w_\x08o_\x08r_\x08l_\x08d\n%\n\x1b[33mcolour\x1b[m\n%\n"
                                        + "你好".encode("gb18030") + b"\n%\n")
    assert recs == ["Hello world", "colour", "你好"]
    kjv = corpus_texts.kjv_documents(["Ge1:1 In the beginning.", "Ge1:2 And the earth.", "Ge2:1 Thus.",
                                      "Exo1:1 Now these."], "x")
    assert [d["text"] for d in kjv] == [
        "Ge\n\nChapter 1\n\n1 In the beginning.\n2 And the earth.\n\nChapter 2\n\n1 Thus.",
        "Exo\n\nChapter 1\n\n1 Now these."]
    osis = ('<title type="main">Genesis</title><chapter n="1" sID="Gen.1"/><w lemma="x">In</w> the '
            '<w>beginning</w>, God<note placement="foot">a note</note><w>created</w> &amp; '
            '<l sID="a"/>line one<l eID="a"/>'
            '<l sID="b"/>line two<l eID="b"/>')
    want = "Genesis\n\nChapter 1\n\nIn the beginning, God created &\nline one\nline two"
    assert corpus_texts.osis_to_text(osis) == want
    entry = ('Caloric \\Ca*lor"ic\\, n. [F. calorique.]\n   The principle of heat; 0[deg] to 1[deg]; {Foot\n'
             '   pound}. [=a]\n   [1913 Webster]')
    want = "Caloric, n. [F. calorique.] The principle of heat; 0° to 1°; Foot pound. ā"
    assert corpus_texts.gcide_clean(entry) == want


def test_demo_corpus_stdlib_fallback_and_marker(tmp_path, capsys):
    stats = corpus.build_demo_corpus(tmp_path, max_bytes_per_source=300_000, sources=["code", "technical", "web"],
                                     use_packages=False)
    assert "falling back to the Python standard library" in capsys.readouterr().out
    assert stats["web"]["documents"] == 0 and "unavailable" in stats["web"]["origin"]
    for name in ("code", "technical"):
        assert 0 < stats[name]["bytes"] <= 300_000
        rows = [json.loads(row) for row in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        assert len(rows) == stats[name]["documents"] and all(set(r) == {"text", "id", "source_file"} for r in rows)
        assert sum(len(r["text"].encode()) for r in rows) == stats[name]["bytes"]
    code = [json.loads(row) for row in (tmp_path / "code.jsonl").read_text().splitlines()]
    assert all(r["id"].startswith("stdlib/") and "/test/" not in r["id"] for r in code)
    assert any("def " in r["text"] for r in code)
    mtime = (tmp_path / "code.jsonl").stat().st_mtime_ns
    assert corpus.build_demo_corpus(tmp_path, max_bytes_per_source=300_000, sources=["code", "technical", "web"],
                                    use_packages=False) == stats
    assert (tmp_path / "code.jsonl").stat().st_mtime_ns == mtime
    assert [s.name for s in corpus.demo_sources()] == ["books", "reference", "technical", "web", "zh", "code"]


def test_demo_corpus_from_packages(tmp_path):
    if not (shutil.which("apt-get") and shutil.which("dpkg-deb")):
        pytest.skip("apt-get/dpkg-deb not available")
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("not root: the package download test runs only as root")
    stats = corpus.build_demo_corpus(tmp_path, max_bytes_per_source=200_000, sources=["web"])
    if stats["web"]["documents"] == 0:
        pytest.skip(f"fortunes packages could not be downloaded: {stats['web']['origin']}")
    rows = [json.loads(row) for row in (tmp_path / "web.jsonl").read_text().splitlines()]
    assert 0 < stats["web"]["bytes"] <= 200_000 and len(rows) == stats["web"]["documents"]
    assert all(r["source_file"].startswith(("fortunes:", "fortunes-min:")) for r in rows)
    assert not any("\n%\n" in r["text"] or "\x08" in r["text"] for r in rows)
    assert list((tmp_path / ".cache" / "debs").glob("fortunes_*.deb"))


def _resume_corpus(tmp_path: Path) -> tuple[Path, list[SourceConfig]]:
    root = tmp_path / "corpus"
    (root / "code").mkdir(parents=True)
    for f in _stdlib_files(1_500_000):
        shutil.copy(f, root / "code" / f"{f.parent.name}_{f.name}")
    return root, [SourceConfig(name="code", kind="code", paths=["code"], format="text")]


_PREPARE_SCRIPT = """
import sys
from pathlib import Path
import densetrain.data.prepare as P
import densetrain.data.prepare.source as PS
from densetrain.config import Config, DataConfig, SourceConfig
PS.CHUNK_BYTES = 1 << 16  # many small work items, so that the kill lands in the middle
cfg = Config()
cfg.data = DataConfig(corpus_dir=sys.argv[1], shards_dir=sys.argv[2], tokenizer="tiktoken:cl100k_base", workers=1,
                      sources=[SourceConfig(name="code", kind="code", paths=["code"], format="text")])
cfg.data.decontam.enabled = False
cfg.model.vocab_size = 100_352
P.prepare(cfg)
"""


def test_prepare_resumes_after_kill_with_identical_output(tmp_path):
    """kill -9 in the middle of a source; the re-run reuses the finished chunks and writes the
    same shards, byte for byte, as an uninterrupted run."""
    import signal
    import subprocess
    import sys
    import time

    root, _ = _resume_corpus(tmp_path)
    killed, fresh = tmp_path / "killed", tmp_path / "fresh"
    cmd = [sys.executable, "-c", _PREPARE_SCRIPT, str(root)]
    proc = subprocess.Popen(cmd + [str(killed)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if len(list(killed.glob("code/.work/*/*.npz"))) >= 3:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "prepare finished before it could be killed"
    assert not (killed / "code" / "manifest.json").exists()
    done = sorted(killed.glob("code/.work/*/*.npz"))
    out = subprocess.run(cmd + [str(killed)], capture_output=True, text=True, check=True).stdout
    assert f"resuming after {len(done)} finished chunks" in out
    subprocess.run(cmd + [str(fresh)], capture_output=True, text=True, check=True)
    a = json.loads((killed / "code" / "manifest.json").read_text())
    b = json.loads((fresh / "code" / "manifest.json").read_text())
    assert [s["sha256"] for sp in ("train", "val") for s in a["splits"][sp]["shards"]] == \
           [s["sha256"] for sp in ("train", "val") for s in b["splits"][sp]["shards"]]
    assert a["stats"] == b["stats"] and a["stats"]["documents_read"] > 10
    assert not (killed / "code" / ".work").exists()  # cleaned up once the source is final


def test_train_rejects_a_tokenizer_other_than_the_shards_one(tmp_path):
    """Shards made with one tokenizer.json, config pointing at another one with the same path name."""
    from densetrain.data.streams import open_streams
    from densetrain.errors import DataError

    root, sources = _resume_corpus(tmp_path)
    texts = [f.read_text() for f in sorted((root / "code").iterdir())]
    tok_path = tmp_path / "tok.json"
    train_bpe(texts, 300, tok_path)
    cfg = _cfg(tmp_path, root, sources, tokenizer=str(tok_path), vocab=512)
    cfg.data.decontam.enabled = False
    cfg.data.workers = 1
    prepare(cfg)
    assert open_streams(cfg, "train")["code"].n_docs > 0
    train_bpe(texts[::-1], 320, tok_path)  # same file name, another vocabulary
    with pytest.raises(DataError, match="tokenized with tokenizer sha256"):
        open_streams(cfg, "train")


def test_rerun_after_kind_change_and_warning_on_shredded_wrapped_text(tmp_path, capsys):
    """`kind` picks the 'auto' filters, so changing it re-prepares; C4's line rules on hard-wrapped
    prose keep the documents but cut most of their text, which the log must say."""
    if not LICENSES.is_dir():
        pytest.skip("/usr/share/common-licenses not present")
    root = tmp_path / "corpus"
    root.mkdir()
    for name in ("Apache-2.0", "GPL-3", "MPL-2.0"):
        shutil.copy(LICENSES / name, root / name)
    src = SourceConfig(name="lic", kind="c4", paths=["."], format="text")  # C4's own line rules
    cfg = _cfg(tmp_path, root, [src], tokenizer="tiktoken:cl100k_base", vocab=100_352)
    cfg.data.workers, cfg.data.decontam.enabled = 1, False
    prepare(cfg)
    out = capsys.readouterr().out
    assert "lic: WARNING source 'lic': filters" in out and "c4:lines removed" in out
    web = json.loads((Path(cfg.data.shards_dir) / "lic" / "manifest.json").read_text())
    src.kind = "reference"  # 'auto' no longer includes c4
    prepare(cfg)
    out = capsys.readouterr().out
    assert "up to date" not in out and "c4:lines removed" not in out
    ref = json.loads((Path(cfg.data.shards_dir) / "lic" / "manifest.json").read_text())
    assert "c4" in web["stats"]["filters"] and "c4" not in ref["stats"]["filters"]
    assert ref["splits"]["train"]["tokens"] + ref["splits"]["val"]["tokens"] > \
           2 * (web["splits"]["train"]["tokens"] + web["splits"]["val"]["tokens"])


def test_demo_corpus_never_overwrites_a_users_file(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "code.jsonl").write_text(json.dumps({"text": "mine"}) + "\n")
    with pytest.raises(DataError, match=r"code.jsonl: exists and was not written by the demo corpus builder"):
        corpus.build_demo_corpus(root, 20_000, sources=["code"], use_packages=False)
    assert (root / "code.jsonl").read_text() == json.dumps({"text": "mine"}) + "\n"
    (root / "code.jsonl").unlink()
    corpus.build_demo_corpus(root, 20_000, sources=["code"], use_packages=False)  # ours now: rebuilds are fine
    corpus.build_demo_corpus(root, 30_000, sources=["code"], use_packages=False)


def test_bom_symlink_loop_and_broken_link(tmp_path, capsys):
    root = tmp_path / "c"
    (root / "sub").mkdir(parents=True)
    (root / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "first"}).encode() + b"\n" +
                                   json.dumps({"text": "second"}).encode() + b"\n")
    (root / "sub" / "loop").symlink_to("..")
    (root / "dangling.txt").symlink_to(root / "missing.txt")
    src = SourceConfig(name="s", paths=["."])
    files = resolve_paths(src, root)
    assert [f.name for f in files] == ["a.jsonl"]
    assert "symlink loop" in capsys.readouterr().err
    skips = SkipLog()
    assert [d.text for d in iter_documents(src, root, skips, files=files)] == ["first", "second"]
    assert skips.total == 0


def test_repeated_document_ids_are_reported(tmp_path, capsys):
    root = tmp_path / "c"
    root.mkdir()
    rows = [{"text": t, "id": "same"} for t in ("first document here", "second document there")]
    (root / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _cfg(tmp_path, root, [SourceConfig(name="s", kind="code", paths=["a.jsonl"])],
               tokenizer="tiktoken:cl100k_base", vocab=100_352)
    cfg.data.workers, cfg.data.decontam.enabled = 1, False
    prepare(cfg)
    out = capsys.readouterr().out
    assert "s: WARNING 1 document ids occur more than once (e.g. 'same')" in out
    assert "WARNING" not in out.replace("WARNING 1 document ids", "")


def test_a_mostly_duplicated_source_is_called_out(tmp_path, capsys):
    """The post-mortem failure: a corpus fed many times over. Dedup removes it and the log says so."""
    root = tmp_path / "c"
    root.mkdir()
    texts = [f.read_text() for f in _stdlib_files(60_000)]
    rows = [{"text": t, "id": f"{k}-{i}"} for k in range(3) for i, t in enumerate(texts)]  # every file 3 times
    (root / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _cfg(tmp_path, root, [SourceConfig(name="s", kind="code", paths=["a.jsonl"])],
               tokenizer="tiktoken:cl100k_base", vocab=100_352)
    cfg.data.workers, cfg.data.decontam.enabled = 1, False
    prepare(cfg)
    assert "s: WARNING 67% of the documents were duplicates" in capsys.readouterr().out
    m = json.loads((Path(cfg.data.shards_dir) / "s" / "manifest.json").read_text())
    assert m["stats"]["documents_kept"] == len(texts) and m["stats"]["removed"] == {"duplicate:exact": 2 * len(texts)}


def test_threshold_change_redoes_only_the_sources_using_that_filter(tmp_path, capsys):
    root, sources = _resume_corpus(tmp_path)
    (root / "prose").mkdir()
    shutil.copy(STDLIB / "LICENSE.txt", root / "prose" / "LICENSE.txt")
    sources.append(SourceConfig(name="prose", kind="c4", paths=["prose"], format="text"))
    cfg = _cfg(tmp_path, root, sources, tokenizer="tiktoken:cl100k_base", vocab=100_352)
    cfg.data.workers, cfg.data.decontam.enabled = 1, False
    prepare(cfg)
    capsys.readouterr()
    cfg.data.filters.c4.min_words_per_line = 4  # code runs no filters; the web source runs C4
    prepare(cfg)
    out = capsys.readouterr().out
    assert "code: up to date" in out and "prose: up to date" not in out


def test_skips_past_the_printed_ones_are_pointed_to_once(tmp_path, capsys):
    raw = b"\n".join([b'{"text": "unterminated'] * 3 + [b'{"body": 1}'] * 3 + [b'{"text": "kept"}']) + b"\n"
    (tmp_path / "bad.jsonl").write_bytes(raw)
    skips = SkipLog(print_first=2)
    docs = list(iter_documents(SourceConfig(name="s", paths=["bad.jsonl"]), tmp_path, skips))
    assert [d.text for d in docs] == ["kept"] and skips.total == 6
    err = capsys.readouterr().err.splitlines()
    assert err[:2] == ["[data] skipped bad.jsonl:1: malformed JSON: Unterminated string starting at (column 10)",
                       "[data] skipped bad.jsonl:2: malformed JSON: Unterminated string starting at (column 10)"]
    assert len(err) == 3 and "bad.jsonl and others" in err[2] and "manifest.json (stats.skipped)" in err[2]
    assert skips.examples[3:] == ["bad.jsonl:4: missing text field: 'text'", "bad.jsonl:5: missing text field: 'text'",
                                  "bad.jsonl:6: missing text field: 'text'"]


def test_a_bom_and_crlf_line_ends_stay_out_of_text_and_paragraph_documents(tmp_path):
    """A UTF-8 BOM is no document's first character in any format (it was kept by ``text`` and ``paragraphs``,
    where ftfy is off: ``fix_text = false``), and a CRLF paragraph does not end in the ``\\r`` of its line end."""
    root = tmp_path / "c"
    root.mkdir()
    (root / "a.txt").write_bytes(b"\xef\xbb\xbfone\r\ntwo\r\n")
    (root / "p.txt").write_bytes(b"\xef\xbb\xbfpara one\r\nline two\r\n\r\npara two\r\n")
    skips = SkipLog()
    text = SourceConfig(name="t", paths=["a.txt"], format="text", fix_text=False)
    paragraphs = SourceConfig(name="p", paths=["p.txt"], format="paragraphs", fix_text=False)
    assert [d.text for d in iter_documents(text, root, skips)] == ["one\r\ntwo\r\n"]
    assert [d.text for d in iter_documents(paragraphs, root, skips)] == ["para one\r\nline two", "para two"]
    assert skips.total == 0
