"""Object storage end to end against a real S3-compatible server (moto's standalone server over HTTP on
localhost, behind a fault-injecting TCP proxy; tests/store_server.py), through s3fs as a user's S3:

- ``prepare`` writes shards to ``s3://``; the streams read from the URL hold the same tokens as the local
  ones, by range reads through the bounded cache, each shard's sha256 checked once per object version.
"""

from __future__ import annotations

import numpy as np
import pytest
from store_server import FaultProxy, environ_restore, environ_set, free_port, make_bucket, s3_env, start_moto

from densetrain import storage
from densetrain.data.streams import open_streams


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """(proxy, bucket URL): moto on a free port, the proxy in front, this process's environment pointing at it."""
    port = free_port()
    server = start_moto(port)
    proxy = FaultProxy(port)
    cache = tmp_path_factory.mktemp("store_cache")
    old = environ_set(s3_env(f"http://127.0.0.1:{proxy.port}", str(cache)))
    storage._fs_cache.clear()
    make_bucket("densetrain-test")
    yield proxy, "s3://densetrain-test"
    environ_restore(old)
    storage._fs_cache.clear()
    proxy.close()
    server.kill()
    server.wait()


@pytest.fixture(scope="module")
def remote_shards(store, tmp_path_factory, prepared):
    """The stdlib sources of conftest's ``prepared`` prepared again, straight to ``s3://.../shards``."""
    from densetrain.data.prepare import prepare

    _, make = prepared
    url = f"{store[1]}/shards"
    cfg = make(tmp_path_factory.mktemp("remote_prep"))
    cfg.data.shards_dir = url
    prepare(cfg)
    return url


def test_prepare_writes_to_s3_and_training_reads_the_same_tokens(store, remote_shards, prepared, tmp_path):
    _, make = prepared
    local_cfg = make(tmp_path)
    remote_cfg = make(tmp_path)
    remote_cfg.data.shards_dir = remote_shards
    assert storage.isfile(f"{remote_shards}/manifest.json") and storage.isfile(f"{remote_shards}/tokenizer.json")
    local, remote = open_streams(local_cfg, "train"), open_streams(remote_cfg, "train")
    assert set(local) == set(remote) and all(len(local[k]) == len(remote[k]) for k in local)
    assert all(isinstance(f, str) and f.startswith("s3://") for s in remote.values() for f in s.files)
    before = dict(storage.counters)
    for name, stream in local.items():
        n = len(stream)
        for start in (0, 1, n // 3, n - 65):
            assert np.array_equal(stream.read(start, 65), remote[name].read(start, 65))
    hits = storage.counters["store_cache_hits"] - before["store_cache_hits"]
    misses = storage.counters["store_cache_misses"] - before["store_cache_misses"]
    assert hits == 4 * len(local) and misses == 0  # the sha256 pass at open filled the cache
