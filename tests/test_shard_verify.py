"""Token ids edited inside a shard without changing its size: the manifest's sha256s catch them before
a run starts and when ``prepare`` reuses the shards (a stat per file; the hash only where the mtime
changed, or everywhere with ``prepare --verify``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import one_source_config

from densetrain.data.prepare import prepare
from densetrain.data.shards import TokenFiles, sha256_file
from densetrain.data.streams import open_streams
from densetrain.errors import DataError


def _edit_one_token(ds: Path, keep_mtime: bool = False) -> None:
    """Change one token id in place (same size, so every count still agrees)."""
    st = ds.stat()
    ids = np.fromfile(ds, dtype="<u2")
    ids[len(ids) // 2] = (int(ids[len(ids) // 2]) + 1) % 50000
    with open(ds, "r+b") as f:
        f.write(ids.tobytes())
    if keep_mtime:
        os.utime(ds, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.fixture
def cfg(tmp_path):
    cfg = one_source_config(tmp_path, tmp_path / "shards")
    prepare(cfg)
    return cfg


def _train_shard(cfg) -> tuple[Path, dict]:
    src = Path(cfg.data.shards_dir) / "email"
    return src / "train" / "000000.ds", json.loads((src / "manifest.json").read_text())


def test_an_edited_shard_stops_training_and_is_prepared_again(cfg, capsys):
    ds, manifest = _train_shard(cfg)
    want = manifest["splits"]["train"]["shards"][0]["sha256"]
    _edit_one_token(ds)
    with pytest.raises(DataError) as e:
        open_streams(cfg, "train")
    msg = str(e.value)
    assert msg.startswith(f"{ds}: sha256 ") and "email/manifest.json" in msg and "\n" not in msg, msg
    capsys.readouterr()
    s = prepare(cfg)  # reuse check: the shard is named and the source redone
    out = capsys.readouterr().out
    assert f"{ds}: sha256" in out and "preparing the source again" in out, out
    assert s["sources"]["email"]["status"] == "prepared" and sha256_file(ds) == want
    assert open_streams(cfg, "train")["email"].n_docs > 0


def test_an_edit_that_keeps_the_mtime_is_found_by_prepare_verify(cfg):
    ds, manifest = _train_shard(cfg)
    _edit_one_token(ds, keep_mtime=True)
    open_streams(cfg, "train")  # the fast path trusts an unchanged mtime: a stat, no read
    assert prepare(cfg)["sources"]["email"]["status"] == "up-to-date"
    assert prepare(cfg, verify=True)["sources"]["email"]["status"] == "prepared"
    assert sha256_file(ds) == manifest["splits"]["train"]["shards"][0]["sha256"]


def test_an_intact_shard_with_a_new_mtime_is_hashed_once_and_recorded(cfg):
    ds, manifest = _train_shard(cfg)
    os.utime(ds, ns=(ds.stat().st_atime_ns, ds.stat().st_mtime_ns + 10**9))  # copied without cp -p
    open_streams(cfg, "train")  # hashed, equal: trains
    assert prepare(cfg)["sources"]["email"]["status"] == "up-to-date"
    _, after = _train_shard(cfg)
    assert after["splits"]["train"]["shards"][0]["mtime_ns"] == ds.stat().st_mtime_ns
    assert manifest["splits"]["train"]["shards"][0]["mtime_ns"] != ds.stat().st_mtime_ns


def test_a_start_checks_token_ids_from_the_recorded_maximum_and_reads_a_shard_only_without_one(cfg):
    ds, manifest = _train_shard(cfg)
    entry = manifest["splits"]["train"]["shards"][0]
    assert entry["max_token"] == TokenFiles(ds).max_token() < cfg.model.vocab_size  # prepare recorded it
    # An id past model.vocab_size (50304) written in place, the mtime put back: the start takes the shard
    # as prepare wrote it (a stat, as for the sha256) and its recorded maximum answers: no token is read
    # (before: the whole shard was read at every start, and this edit refused).
    st = ds.stat()
    ids = np.fromfile(ds, dtype="<u2")
    ids[7] = 60000
    ids.tofile(ds)
    os.utime(ds, ns=(st.st_atime_ns, st.st_mtime_ns))
    open_streams(cfg, "train")
    # Without a recorded maximum (a manifest of an older densetrain) the shard is read and refused, in one
    # line naming it and the offending id; a recorded maximum past the vocabulary is refused the same way.
    sub = Path(cfg.data.shards_dir) / "email" / "manifest.json"
    for recorded in (None, 50304):
        if recorded is None:
            del entry["max_token"]
        else:
            entry["max_token"] = recorded
        sub.write_text(json.dumps(manifest))
        with pytest.raises(DataError) as e:
            open_streams(cfg, "train")
        msg = str(e.value)
        assert msg.startswith(f"{ds}: token id 60000 >= vocabulary size 50304 at token offset 7 ") and "\n" not in msg
