"""The ladder corpus (densetrain/data/corpus/ladder.py): its selection on a small real package subset
(sphinx-doc + perl-doc, ~10 MB of .deb), the marker, and the no-repeat token budget. The full build is a
command (``densetrain prepare --preset ladder-corpus``), not a test. The package tests run only as root with
apt-get available, like the demo corpus's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from densetrain.config import load_config
from densetrain.data.corpus import ladder
from densetrain.errors import ConfigError, DataError

_SPHINX = "usr/share/doc/*/html/_sources"
_TABLE = {"technical": ("technical", True, None, [
    ladder.Origin("sphinx-doc", "sphinx-doc", "tree", _SPHINX, "**/*.txt"),
    ladder.Origin("perl-doc", "perl-doc", "tree", "usr/share/perl/*/pod", "*.pod"),
])}
_CAP = 400_000


def _need_apt():
    if not (shutil.which("apt-get") and shutil.which("dpkg-deb")):
        pytest.skip("apt-get/dpkg-deb not available")
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("not root: the package download test runs only as root")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The subset built twice (into two directories, one .deb cache) and the packages unpacked for reference."""
    _need_apt()
    root = tmp_path_factory.mktemp("ladder")
    cache = root / "debs"
    try:
        stats = ladder.build_ladder_corpus(root / "a", caps={"technical": _CAP}, table=_TABLE, cache_dir=cache)
    except DataError as e:
        pytest.skip(f"packages could not be downloaded: {e}")
    again = ladder.build_ladder_corpus(root / "b", caps={"technical": _CAP}, table=_TABLE, cache_dir=cache)
    unpacked = {}
    for pkg in ("sphinx-doc", "perl-doc"):
        deb = sorted(cache.glob(f"{pkg}_*.deb"))[-1]
        unpacked[pkg] = root / "x" / pkg
        unpacked[pkg].mkdir(parents=True)
        subprocess.run(["dpkg-deb", "-x", str(deb), str(unpacked[pkg])], check=True)
    return root, stats, again, unpacked


def test_selection_shares_the_cap_and_spreads_through_each_package(built):
    root, stats, _, unpacked = built
    rows = [json.loads(line) for line in (root / "a" / "technical.jsonl").read_text().splitlines()]
    per = stats["technical"]["origins"]
    sphinx_files = sorted(f for f in next(iter(sorted(unpacked["sphinx-doc"].glob(_SPHINX)))).rglob("*.txt"))
    pod_dir = next(iter(sorted(unpacked["perl-doc"].glob("usr/share/perl/*/pod"))))
    pods = sorted(pod_dir.glob("*.pod"))
    sphinx_bytes = sum(f.stat().st_size for f in sphinx_files)
    # max-min fairness: both packages hold more than half the cap, so each gets half of it
    assert sphinx_bytes > _CAP // 2 and sum(f.stat().st_size for f in pods) > _CAP // 2
    for name in ("sphinx-doc", "perl-doc"):
        assert _CAP // 2 - ladder.MAX_FILE_BYTES < per[name]["bytes"] <= _CAP // 2
    assert stats["technical"]["bytes"] == sum(len(r["text"].encode()) for r in rows)
    assert len(rows) == stats["technical"]["documents"] == per["sphinx-doc"]["documents"] + per["perl-doc"]["documents"]
    # whole files, read back unchanged, from the beginning to the end of each package's sorted list
    perl = [r for r in rows if r["id"].startswith("perl-doc/")]
    names = [r["id"].split("/", 1)[1] for r in perl]
    assert names == sorted(names) and names[0] == pods[0].name
    assert names[-1] in {f.name for f in pods[len(pods) * 3 // 4:]}
    for r in perl:
        assert r["text"] == (pod_dir / r["id"].split("/", 1)[1]).read_text(encoding="utf-8", errors="replace")
        assert r["source_file"].startswith("perl-doc:/usr/share/perl/")
    big = {f.name for f in pods if f.stat().st_size > ladder.MAX_FILE_BYTES}
    assert big and not big & set(names)  # e.g. perlfunc.pod: a file over the limit is never taken


def test_build_is_reproducible_and_recorded(built):
    root, stats, again, _ = built
    assert stats == again
    assert (root / "a" / "technical.jsonl").read_bytes() == (root / "b" / "technical.jsonl").read_bytes()
    marker = json.loads((root / "a" / ladder.MARKER).read_text())
    assert set(marker["packages"]) == {"sphinx-doc", "perl-doc"}
    for rec in marker["packages"].values():
        assert rec["deb"].endswith(".deb") and len(rec["sha256"]) == 64
    mtime = (root / "a" / "technical.jsonl").stat().st_mtime_ns
    assert ladder.build_ladder_corpus(root / "a", caps={"technical": _CAP}, table=_TABLE,
                                      cache_dir=root / "debs") == stats  # up to date: not rewritten
    assert (root / "a" / "technical.jsonl").stat().st_mtime_ns == mtime
    # a build killed after writing a file leaves an incomplete marker: the next build replaces the file
    m = json.loads((root / "a" / ladder.MARKER).read_text())
    (root / "a" / ladder.MARKER).write_text(json.dumps({"params": m["params"], "complete": False, "files": m["files"]}))
    (root / "a" / ".cache" / "unpack-killed" / "usr").mkdir(parents=True)  # a killed build's scratch directory
    assert ladder.build_ladder_corpus(root / "a", caps={"technical": _CAP}, table=_TABLE,
                                      cache_dir=root / "debs") == stats
    assert (root / "a" / "technical.jsonl").stat().st_mtime_ns != mtime
    assert not list((root / "a" / ".cache").glob("unpack-*"))
    m = json.loads((root / "a" / ladder.MARKER).read_text())
    assert m["complete"] is True
    # killed after a source was written and recorded with its stats: that source is kept, not rebuilt
    mtime = (root / "a" / "technical.jsonl").stat().st_mtime_ns
    (root / "a" / ladder.MARKER).write_text(json.dumps({**m, "complete": False}))
    assert ladder.build_ladder_corpus(root / "a", caps={"technical": _CAP}, table=_TABLE,
                                      cache_dir=root / "debs") == stats
    assert (root / "a" / "technical.jsonl").stat().st_mtime_ns == mtime
    after = json.loads((root / "a" / ladder.MARKER).read_text())
    assert after.pop("build_seconds") >= 0 and after == {k: v for k, v in m.items() if k != "build_seconds"}


def test_the_ladder_corpus_never_overwrites_a_users_file(tmp_path):
    (tmp_path / "technical.jsonl").write_text('{"text": "mine"}\n')
    with pytest.raises(DataError, match=r"technical.jsonl: exists and was not written by the ladder corpus builder"):
        ladder.build_ladder_corpus(tmp_path, table=_TABLE)
    assert (tmp_path / "technical.jsonl").read_text() == '{"text": "mine"}\n'


def test_tokens_without_repeat():
    # code runs out first: 650 tokens at weight 0.65 of 1.0 -> 1000; books would last 40 / 0.03 = 1333
    assert ladder.tokens_without_repeat({"books": 0.03, "code": 0.65, "technical": 0.32},
                                        {"books": 40, "code": 650, "technical": 400}) == 1000
    # weights need not sum to 1; a zero weight is no constraint
    assert ladder.tokens_without_repeat({"a": 2, "b": 2, "c": 0}, {"a": 100, "b": 300, "c": 1}) == 200
    with pytest.raises(DataError, match="no prepared train tokens"):
        ladder.tokens_without_repeat({"zz": 1.0}, {"a": 1})


def test_preset_and_config():
    cfg = load_config(preset="ladder-corpus")
    assert cfg.data.ladder_corpus and not cfg.data.demo_corpus
    names = [s.name for s in cfg.data.sources]
    assert names == [s.name for s in ladder.ladder_sources()] == list(ladder.LADDER_SOURCES)
    assert set(cfg.stages[0].mix) == set(ladder.LADDER_SOURCES)
    with pytest.raises(ConfigError, match="data.demo_corpus and data.ladder_corpus are both true"):
        load_config(preset="ladder-corpus", overrides=[("data.demo_corpus", True)])


def test_origin_filters_archive_members():
    o = ladder.Origin("linux-doc", "linux-source-6.1", "tar", "x", suffixes=(".rst", ".txt"), prefix="Documentation/",
                      skip_parts=frozenset({"translations"}))
    keys = ["Documentation/admin-guide/README.rst", "Documentation/translations/zh_CN/index.rst",
            "Documentation/Makefile", "kernel/sched/core.c", "Documentation/process/howto.txt"]
    want = ["Documentation/admin-guide/README.rst", "Documentation/process/howto.txt"]
    assert [k for k in keys if o._wanted(k)] == want
