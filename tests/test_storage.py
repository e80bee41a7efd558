"""Object storage end to end against a real S3-compatible server (moto's standalone server over HTTP on
localhost, behind a fault-injecting TCP proxy; tests/store_server.py), through s3fs as a user's S3:

- ``prepare`` writes shards to ``s3://``; the streams read from the URL hold the same tokens as the local
  ones, by range reads through the bounded cache, each shard's sha256 checked once per object version.
- Faults are retried and counted; a failed background prefetch is raised by the next read of its block.
- A 2-rank run from the store survives kill -9 mid-upload and an upload outage (exit 75), and an outage of its
  shard reads (every rank stops at one step with exit 75), each time resumed bitwise by the same command.
- A rollback sets aside the store's later checkpoints (also when the store was down at the rollback);
  replay and blame fetch the checkpoint they need from ``checkpoint.dir``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from store_server import (
    FaultProxy,
    environ_restore,
    environ_set,
    free_port,
    make_bucket,
    prepare_to,
    s3_env,
    start_moto,
)
from test_resume import finish, fresh, trajectory
from test_resume import start as start_train

from densetrain import storage
from densetrain.checkpoint import list_complete, mirror
from densetrain.cli import main
from densetrain.data.shards import TokenFiles, write_shard
from densetrain.data.streams import open_streams
from densetrain.errors import EXIT_PREEMPTED, ConfigError, TrainError
from densetrain.metrics import read_events, read_metrics
from densetrain.storage.retry import _transient


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """(proxy, bucket URL): moto on a free port, the proxy in front (for the training processes, :func:`start`);
    this process talks to moto directly (its polls must not meet the faults)."""
    port, cache = free_port(), tmp_path_factory.mktemp("store_cache")
    server = start_moto(port, cache.parent / "moto.log")
    proxy = FaultProxy(port)
    old = environ_set(s3_env(f"http://127.0.0.1:{port}", str(cache)))
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
    return prepare_to(f"{store[1]}/shards", prepared, tmp_path_factory.mktemp("remote_prep"))


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
        for at in (0, 1, n // 3, n - 65):
            assert np.array_equal(stream.read(at, 65), remote[name].read(at, 65))
    hits = storage.counters["store_cache_hits"] - before["store_cache_hits"]
    misses = storage.counters["store_cache_misses"] - before["store_cache_misses"]
    assert hits == 4 * len(local) and misses == 0  # the sha256 pass at open filled the cache



def test_a_prepare_into_a_url_deletes_the_shards_an_earlier_larger_prepare_left_there(store, remote_shards, prepared,
                                                                                       tmp_path):
    """An upload adds and replaces objects: a shard of an earlier prepare that wrote more of them (another machine,
    a larger corpus) stayed in the store, was listed with the new ones, and every start failed on the token count
    ("re-run densetrain prepare", which changed nothing). Prepare deletes it, as it does locally."""
    _, make = prepared
    cfg = make(tmp_path)
    cfg.data.shards_dir = remote_shards
    name = cfg.data.sources[0].name
    before = {k: len(v) for k, v in open_streams(cfg, "train").items()}
    stale = tmp_path / "stale"
    write_shard(stale / "000099", [np.arange(50)], 2)
    storage.put_tree(stale, f"{remote_shards}/{name}/train")
    storage.put_tree(stale, f"{remote_shards}/another_data_set/train")  # not prepare's: kept
    assert "000099.ds" in storage.listdir(f"{remote_shards}/{name}/train")
    prepare_to(remote_shards, prepared, tmp_path / "again")  # up to date here: publishes the same files again
    assert not any(n.startswith("000099") for n in storage.listdir(f"{remote_shards}/{name}/train"))
    assert "000099.ds" in storage.listdir(f"{remote_shards}/another_data_set/train")
    storage.remove_tree(f"{remote_shards}/another_data_set")
    assert {k: len(v) for k, v in open_streams(cfg, "train").items()} == before


def test_a_status_is_read_from_the_error_not_from_digits_in_its_url():
    """A timeout on a store whose port or object name holds 403/404 (a proxy on port 34035, shard 000404.ds) is
    retried like any timeout (it was taken for a refusal: every rank stopped at its first slow read); the status
    botocore recorded decides for s3fs's translated errors, whatever their text says."""
    import errno

    from botocore.exceptions import ClientError, EndpointConnectionError, IncompleteReadError, ReadTimeoutError
    from s3fs.errors import translate_boto_error

    def answer(status: int, code: str):
        return translate_boto_error(ClientError({"Error": {"Code": code, "Message": "m"},
                                                 "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject"))

    url = "http://127.0.0.1:34035/bucket/shards/email/train/000404.ds"
    transient = [ReadTimeoutError(endpoint_url=url), EndpointConnectionError(endpoint_url=url),
                 answer(503, "SlowDown"), answer(500, "InternalError"), answer(503, "NoSuchKey404"),
                 OSError(errno.EIO, f"{url}: 500 answer"), TimeoutError(f"reading {url}"),
                 IncompleteReadError(actual_bytes=403, expected_bytes=1 << 20)]  # a body cut short: was a refusal
    permanent = [answer(404, "NoSuchKey"), answer(403, "AccessDenied"), answer(400, "SlowDownAndTimeout"),
                 FileNotFoundError(url), RuntimeError("403 Forbidden"), RuntimeError("HTTP status 404"),
                 ValueError("bad value")]
    assert [_transient(e) for e in transient] == [True] * len(transient), transient
    assert [_transient(e) for e in permanent] == [False] * len(permanent), permanent


def test_store_faults_are_retried_and_counted_and_an_outage_is_one_line(store, monkeypatch):
    proxy, bucket = store
    storage.write_bytes(f"{bucket}/faults/blob", b"x" * 1000)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    monkeypatch.setattr(storage, "_fs_cache", {})  # a client of the proxy's endpoint
    before = storage.counters["store_retries"]
    proxy.fail_next(["503", "503", "503"])
    assert storage.read_bytes(f"{bucket}/faults/blob", 1 << 20) == b"x" * 1000
    assert storage.counters["store_retries"] - before == 3
    with pytest.raises(FileNotFoundError):  # not retried: a missing object is not an outage
        storage.read_bytes(f"{bucket}/faults/none", 1 << 20)
    assert storage.counters["store_retries"] - before == 3
    # A body cut off mid-transfer (aiohttp's ClientPayloadError, from a ContentLengthError of code 400: its parser's
    # verdict, not the store's answer) was taken for a 400 refusal and stopped the run at once.
    proxy.cut_bytes, faults = 404, proxy.faults
    proxy.faulty("cut", 0.5, only=b"GET")
    assert storage.read_bytes(f"{bucket}/faults/blob", 1 << 20) == b"x" * 1000
    assert storage.counters["store_retries"] - before > 3 and proxy.faults > faults
    monkeypatch.setenv("DENSETRAIN_STORE_RETRY_S", "2")
    proxy.faulty("503", 60)
    try:
        with pytest.raises(storage.StoreUnavailable) as e:
            storage.read_bytes(f"{bucket}/faults/blob", 1 << 20)
    finally:
        proxy.faulty("pass", 0)
    assert str(e.value).startswith(f"{bucket}/faults/blob: the object store did not answer for ") and \
        "(DENSETRAIN_STORE_RETRY_S=2; last error" in str(e.value) and "\n" not in str(e.value)
    assert "testing" not in str(e.value)  # the credentials are never in a message


def test_range_reads_through_a_bounded_cache(store, tmp_path, monkeypatch):
    _, bucket = store
    data = np.random.default_rng(0).integers(0, 65535, 3 << 20, dtype=np.uint16)  # 6 MiB: 6 blocks
    storage.write_bytes(f"{bucket}/bounded/a.ds", data.tobytes())
    monkeypatch.setenv("DENSETRAIN_STORE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("DENSETRAIN_STORE_CACHE_MIB", "3")
    monkeypatch.setattr(storage, "_cache", None)
    arr = storage.open_array(f"{bucket}/bounded/a.ds", np.uint16)
    misses = storage.counters["store_cache_misses"]
    assert np.array_equal(arr[1000:1100], data[1000:1100])  # a window: one 1 MiB block now, the next ones behind
    assert storage.counters["store_cache_misses"] - misses == 1
    for a in (5 << 19, (3 << 20) - 7, 123_456):  # across blocks, the last tokens, the first block again
        assert np.array_equal(arr[a - 300:a], data[a - 300:a])
    assert np.array_equal(np.asarray(arr), data)  # every block, more than the cache holds
    storage._shared()[1].shutdown(wait=True)  # the readahead done (a new pool is made on the next use)
    monkeypatch.setattr(storage, "_pool", None)
    held = sum(f.stat().st_size for f in (tmp_path / "cache" / "blocks").rglob("*") if f.is_file())
    assert 0 < held <= 3 << 20


def test_a_failed_prefetch_is_raised_by_the_next_read_of_its_block(store, tmp_path, monkeypatch):
    proxy, bucket = store
    data = np.arange(3 << 19, dtype=np.uint16)  # 3 MiB: 3 blocks
    storage.write_bytes(f"{bucket}/prefetch/a.ds", data.tobytes())
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    monkeypatch.setenv("DENSETRAIN_STORE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("DENSETRAIN_STORE_RETRY_S", "1")
    for name in ("_fs_cache", "_cache", "_pool"):  # a client of the proxy, an empty cache, a pool of this test
        monkeypatch.setattr(storage, name, {} if name == "_fs_cache" else None)
    arr = storage.open_array(f"{bucket}/prefetch/a.ds", np.uint16)
    proxy.faulty("503", 60)
    try:
        arr.prefetch(1 << 19, 1 << 20)  # block 1, in the background: it fails past the 1 s budget
        t0 = time.monotonic()
        while arr._inflight:
            assert time.monotonic() - t0 < 30
            time.sleep(0.05)
    finally:
        proxy.faulty("pass", 0)
    with pytest.raises(storage.StoreUnavailable):  # the store answers again, but the failure is not lost
        arr[(1 << 19) + 5:(1 << 19) + 10]
    assert np.array_equal(arr[(1 << 19) + 5:(1 << 19) + 10], data[(1 << 19) + 5:(1 << 19) + 10])  # said once
    assert np.array_equal(arr[0:10], data[0:10])
    storage._shared()[1].shutdown(wait=True)


def test_an_object_rewritten_after_the_run_opened_it_is_refused_not_read(store, tmp_path, monkeypatch):
    # Found trying it as a user: shards overwritten in the store mid-run (same size) were trained on (loss to 1e-4)
    # once the cache let their blocks go; a range read names no version, so each fetched block is now checked
    # against the version the run opened (and verified against its manifest).
    _, bucket = store
    url = f"{bucket}/rewrite/a.ds"
    data = np.arange(3 << 19, dtype=np.uint16)  # 3 MiB: 3 blocks
    storage.write_bytes(url, data.tobytes())
    monkeypatch.setenv("DENSETRAIN_STORE_CACHE", str(tmp_path / "cache"))
    for name in ("_cache", "_pool"):  # an empty cache, a pool of this test
        monkeypatch.setattr(storage, name, None)
    kept = storage.open_array(url, np.uint16)
    assert np.array_equal(kept[5:10], data[5:10])  # the version it opened: read as it is (and its blocks cached)
    other = f"{bucket}/rewrite/b.ds"
    storage.write_bytes(other, data.tobytes())
    arr = storage.open_array(other, np.uint16)  # opened (as a run opens and verifies its shards), nothing read yet
    storage.write_bytes(other, np.full_like(data, 7).tobytes())  # rewritten in the store: the same size, other tokens
    with pytest.raises(storage.ObjectChanged, match=r"rewrite/b.ds: changed in the object store since this run "
                                                    r"verified it against its manifest \(version "):
        arr[5:10]
    url = other
    fresh = storage.open_array(url, np.uint16)  # a run that opens (and verifies) the new version reads it
    assert np.array_equal(fresh[(2 << 19) + 5:(2 << 19) + 10], np.full(5, 7, np.uint16))
    storage._shared()[1].shutdown(wait=True)


def test_keys_with_spaces_unicode_plus_percent_and_a_folder_named_like_its_parent_list_and_read(store, tmp_path):
    """Keys s3fs must not quote or unquote (a space, ü, ``+``, ``%2F``, ``=``) read back as written, the bucket alone
    lists with or without its trailing slash, and a folder holding a folder of its own name lists it (the folder's
    own marker was left out by name: ``s3://b/train/train``, a source "train"'s split "train", listed empty)."""
    _, bucket = store
    shards = tmp_path / "shards"
    write_shard(shards / "000000", [np.arange(5), np.arange(7)], 2)
    write_shard(shards / "000001", [np.arange(3)], 2)
    for prefix in (f"{bucket}/keys/a b/ü+%2F=x", f"{bucket}/keys/train/train"):
        storage.put_tree(shards, prefix)
        assert storage.listdir(prefix) == sorted(p.name for p in shards.iterdir())
        assert TokenFiles(prefix).read(0, 15).tolist() == [*range(5), *range(7), *range(3)]
    assert storage.listdir(f"{bucket}/keys") == ["a b", "train"]
    assert storage.listdir(f"{bucket}/keys/train") == ["train"]  # was []
    assert "keys" in storage.listdir(bucket) and storage.listdir(bucket) == storage.listdir(f"{bucket}/")


def test_folder_marker_objects_are_folders_not_files(store, tmp_path):
    """A folder made in the S3 console (or by Hadoop's s3a) is a zero-byte object ``folder/``: it is listed as the
    folder, never read as a shard, and fetching the tree makes it a folder (get_tree fetched it as a file onto the
    folder itself: FileExistsError, so a checkpoint in such a folder could not be fetched)."""
    _, bucket = store
    fs, _ = storage._fs(bucket)
    root = f"{fs._strip_protocol(bucket)}/marked"
    fs.pipe({f"{root}/": b"", f"{root}/sub/": b""})
    write_shard(tmp_path / "shards" / "000000", [np.arange(5)], 2)
    storage.put_tree(tmp_path / "shards", f"{bucket}/marked")
    assert storage.listdir(f"{bucket}/marked") == ["000000.ds", "000000.ds.index", "000000.ds.metadata", "sub"]
    assert TokenFiles(f"{bucket}/marked").read(0, 5).tolist() == list(range(5))
    storage.get_tree(f"{bucket}/marked", tmp_path / "got")
    assert sorted(str(p.relative_to(tmp_path / "got")) for p in (tmp_path / "got").rglob("*")) == \
        ["000000.ds", "000000.ds.index", "000000.ds.metadata", "sub"]
    assert (tmp_path / "got" / "sub").is_dir()


def test_a_folder_of_more_than_a_thousand_objects_lists_whole(store):
    """S3 answers a listing 1,000 keys at a time: the 1,001st shard is listed too (a listing that stops at one page
    trains on a silently smaller corpus), and in name order whatever order the store gives."""
    _, bucket = store
    fs, _ = storage._fs(bucket)
    names = [f"{i:05d}.ds" for i in range(1001, -1, -1)]  # written in reverse order
    fs.pipe({f"{fs._strip_protocol(bucket)}/many/{n}": b"\0\0" for n in names})
    assert storage.listdir(f"{bucket}/many") == sorted(names)


def test_a_checkpoint_dir_in_a_missing_bucket_is_refused_at_the_start(store, tmp_path):
    # Found trying it as a user: the first upload, after the first checkpoint interval of training, said so.
    with pytest.raises(TrainError, match=r"^checkpoint.dir s3://no-such-bucket-45/ck: cannot write there "
                                         r"\(FileNotFoundError: .*\); expected an existing bucket"):
        mirror.open_store(tmp_path / "run", "s3://no-such-bucket-45/ck", resume=False)


def test_missing_credentials_are_one_line_naming_the_url(store, tmp_path, monkeypatch):
    # Found trying it as a user: botocore's NoCredentialsError reached the command line as a 79-line traceback.
    _, bucket = store
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    for k in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(k, str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to ask
    monkeypatch.setattr(storage, "_fs_cache", {})
    with pytest.raises(ConfigError, match=rf"^{bucket}/nocreds/x.ds: no credentials for the object store "
                                          r"\(NoCredentialsError\): give them through the client's standard chain"):
        storage.exists(f"{bucket}/nocreds/x.ds")


def test_a_read_that_fails_leaves_the_sampler_where_it_was(remote_shards, prepared, tmp_path, monkeypatch):
    from densetrain.data.mixture import MixtureSampler

    _, make = prepared
    cfg = make(tmp_path)
    cfg.data.shards_dir = remote_shards
    streams = open_streams(cfg, "train")
    sampler = MixtureSampler(streams)
    sampler.next_samples(4, "main", {"email": 0.5, "json": 0.5}, 32, shuffle_seed=1)
    state = sampler.state_dict()

    def down(*a, **k):
        raise storage.StoreUnavailable("s3://...: the object store did not answer")

    for stream in streams.values():
        monkeypatch.setattr(stream, "read", down)
    with pytest.raises(storage.StoreUnavailable):
        sampler.next_samples(4, "main", {"email": 0.5, "json": 0.5}, 32, shuffle_seed=1)
    assert sampler.state_dict() == state  # the batch a failed read could not give is drawn again later


def test_async_saves_upload_in_the_background(store, remote_shards, prepared, tmp_path):
    from densetrain.train import train

    _, make = prepared
    url = f"{store[1]}/async/checkpoints"
    cfg = make(tmp_path, **{**OV, "train.resume": "", "checkpoint.async_save": True, "checkpoint.every": 1,
                            "data.shards_dir": remote_shards, "checkpoint.dir": url})
    train(cfg)
    run = Path(cfg.train.run_dir)
    assert _remote_steps(url) == [7, 8] and [s for s, _ in list_complete(run)] == [7, 8]
    uploads = [e for e in read_events(run) if e.get("action") == "uploaded"]
    assert [e["step"] for e in uploads] == list(range(1, 9))  # each one, the last one waited for

# ------------------------------------------------------------------------------------------------------
# A 2-rank run whose shards and checkpoints live only in the store: kill -9 mid-upload, an outage, resume
# ------------------------------------------------------------------------------------------------------

OV = {"train.steps": 8, "checkpoint.every": 2, "checkpoint.keep": 2, "eval.every": 0, "logging.tensorboard": False,
      "watchdog.every": 0, "probe.every": 0, "train.device": "cpu", "train.resume": "auto"}
SLOW = [{"kind": "slow_rank", "step": 0, "rank": 0, "ms": 300}]  # only sleeps: the trajectory is unchanged


def start(argv: list[str], proxy: FaultProxy, **env: str) -> list:
    """``densetrain train ARGV`` as two gloo ranks whose store is reached through ``proxy`` (``env``: more
    variables of their environment)."""
    old = environ_set({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}", **env})
    try:
        return start_train(argv, world=2)
    finally:
        environ_restore(old)


@contextlib.contextmanager
def answering_503(proxy: FaultProxy, monkeypatch):
    """This process's store client behind ``proxy``, which answers 503 (SlowDown) to everything inside the block;
    a 1 s retry budget, so that the outage is past it at once."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    monkeypatch.setenv("DENSETRAIN_STORE_RETRY_S", "1")
    monkeypatch.setattr(storage, "_fs_cache", {})
    proxy.faulty("503", 60)
    try:
        yield
    finally:
        proxy.faulty("pass", 0)


def _wait(cond, procs, what: str, timeout: float = 120) -> None:
    t0 = time.monotonic()
    while not cond():
        assert all(p.poll() is None for p in procs), (what, [p.communicate()[1][-3000:] for p in procs])
        assert time.monotonic() - t0 < timeout, what
        time.sleep(0.1)


def _remote_steps(url) -> list[int]:
    return [s for s, _ in mirror.remote_complete(url)]


@pytest.fixture(scope="module")
def reference(store, remote_shards, prepared, tmp_path_factory):
    """The trajectory of an uninterrupted 2-rank run of OV reading the store's shards (checkpoints local)."""
    _, make = prepared
    tmp = tmp_path_factory.mktemp("reference")
    ref_cfg = make(tmp / "ref", **OV, **{"data.shards_dir": remote_shards}, faults=SLOW)
    res = finish(start(fresh(ref_cfg, tmp), store[0]))
    assert [rc for rc, _ in res] == [0, 0], [e[-3000:] for _, e in res]
    want = trajectory(Path(ref_cfg.train.run_dir))
    assert sorted(want) == list(range(1, 9))
    return want


def test_two_ranks_from_the_store_survive_kill_and_outage_and_resume_bitwise(store, remote_shards, prepared,
                                                                            reference, tmp_path):
    proxy, bucket = store
    _, make = prepared
    want = reference

    url = f"{bucket}/run/checkpoints"
    cfg = make(tmp_path / "run", **OV, **{"data.shards_dir": remote_shards, "checkpoint.dir": url}, faults=SLOW)
    run, argv = Path(cfg.train.run_dir), fresh(cfg, tmp_path)
    procs = start(argv, proxy)
    # Short outages during step 4's upload (three 503 SlowDown answers, two reset connections): retried, counted.
    _wait(lambda: _remote_steps(url) == [2], procs, "step 2 uploaded")
    base = proxy.faults
    proxy.fail_next(["503", "503", "503", "reset", "reset"])
    uploaded = lambda: [e for e in read_events(run) if e.get("action") == "uploaded" and e["step"] == 4]  # noqa: E731
    _wait(uploaded, procs, "step 4 uploaded")
    (up4,) = uploaded()
    assert _remote_steps(url) == [2, 4]
    # Each 503 is one retry of ours; a reset of a pooled idle connection may be retried by the HTTP client
    # itself (aiohttp reconnects once) before our layer sees it.
    assert proxy.faults - base == 5 and 4 <= up4["values"]["store_retries"] <= 5, up4
    # kill -9 while step 6's upload hangs on a store that stopped answering
    proxy.faulty("stall", 3600)
    _wait(lambda: proxy.faults > base + 5, procs, "an upload of step 6 under way")
    for p in procs:
        p.kill()
    finish(procs)
    proxy.faulty("pass", 0)
    assert _remote_steps(url) == [2, 4]  # step 6 not listed: its marker never came
    shutil.rmtree(run / "checkpoints")  # the run directory's copies are gone: the resume reads the store

    # The same command resumes from the store's step 4; an outage of its writes longer than the retry budget
    # (503 SlowDown to every upload) at step 6's upload stops it there with 75, the checkpoint on local disk only.
    proxy.faulty("503", 3600, only=b"PUT")
    res = finish(start(argv, proxy))
    proxy.faulty("pass", 0)
    assert [rc for rc, _ in res] == [EXIT_PREEMPTED] * 2, [e[-3000:] for _, e in res]
    last = res[0][1].strip().splitlines()[-1]
    assert last == (f"densetrain: stopped by an outage of {url} after step 6 (checkpoint step_00000006 written to "
                    f"local disk only, not uploaded); continue with: densetrain train --resume {run}"), last
    assert [s for s, _ in list_complete(run)] == [4, 6] and _remote_steps(url) == [2, 4]

    res = finish(start(argv, proxy))  # the store is back: the same command finishes the run
    assert [rc for rc, _ in res] == [0, 0], [e[-3000:] for _, e in res]
    assert trajectory(run) == want
    last = [r for r in read_metrics(run) if r["kind"] == "train"][-1]
    assert last["store_cache_hits"] > 0 and last["store_retries"] == 0  # counted in the metrics (rank 0)
    assert _remote_steps(url) == [6, 8]  # retention (keep 2) in the store too

    # eval and export of the URL equal those of the run directory's own step 8
    assert main(["eval", url]) == 0
    assert main(["eval", str(run / "checkpoints" / "step_00000008")]) == 0
    (copy,) = (storage.cache_dir() / "runs").glob("*/evals/step_00000008.json")
    assert json.loads(copy.read_text())["val"] == json.loads((run / "evals" / "step_00000008.json").read_text())["val"]
    assert main(["export", f"{url}/step_00000008", str(tmp_path / "hf_remote")]) == 0
    assert main(["export", str(run / "checkpoints" / "step_00000008"), str(tmp_path / "hf_local")]) == 0
    assert (tmp_path / "hf_remote" / "model.safetensors").read_bytes() == \
        (tmp_path / "hf_local" / "model.safetensors").read_bytes()


def test_an_outage_of_shard_reads_stops_every_rank_at_a_step_and_the_same_command_resumes_bitwise(
        store, remote_shards, prepared, reference, tmp_path):
    """The shards' store stops answering range reads mid-run (longer than the retry budget) while it still takes
    the checkpoints: both ranks stop at one step boundary with exit 75 and that step's checkpoint, written and
    uploaded; once the store answers again the same command finishes the run bitwise as if never stopped."""
    proxy, bucket = store
    _, make = prepared
    url = f"{bucket}/readout/checkpoints"
    cfg = make(tmp_path / "run", **OV, **{"data.shards_dir": remote_shards, "checkpoint.dir": url}, faults=SLOW)
    run, argv = Path(cfg.train.run_dir), fresh(cfg, tmp_path)
    # A cache of their own that keeps no block: every training window is a range read of the store.
    env = {"DENSETRAIN_STORE_CACHE": str(tmp_path / "cache"), "DENSETRAIN_STORE_CACHE_MIB": "0",
           "DENSETRAIN_STORE_TIMEOUT_S": "3", "DENSETRAIN_STORE_RETRY_S": "5"}
    procs = start(argv, proxy, **env)
    _wait(lambda: any(r["kind"] == "train" and r["step"] >= 2 for r in read_metrics(run)), procs, "step 2")
    base = proxy.faults
    proxy.faulty("stall", 3600, only=f"GET /{bucket[len('s3://'):]}/shards/".encode())  # the shards' objects only
    try:
        res = finish(procs)
    finally:
        proxy.faulty("pass", 0)
    assert proxy.faults > base
    assert [rc for rc, _ in res] == [EXIT_PREEMPTED] * 2, [e[-3000:] for _, e in res]
    (stop,) = [e for e in read_events(run) if e.get("kind") == "preempt"]
    step = stop["step"]
    assert 2 <= step < 8 and stop["values"]["checkpoint"] == f"step_{step:08d}"
    assert stop["values"]["error"].startswith(("rank 0: s3://", "rank 1: s3://")) and \
        "the object store did not answer" in stop["values"]["error"]
    last = res[0][1].strip().splitlines()[-1]
    assert last == (f"densetrain: stopped by an outage of {remote_shards} after step {step} (checkpoint "
                    f"step_{step:08d} written); continue with: densetrain train --resume {run}"), last
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"] == list(range(1, step + 1))
    assert list_complete(run)[-1][0] == step and _remote_steps(url)[-1] == step  # uploaded: that store answered

    res = finish(start(argv, proxy, **env))  # the store answers again: the same command finishes the run
    assert [rc for rc, _ in res] == [0, 0], [e[-3000:] for _, e in res]
    assert trajectory(run) == reference
    assert _remote_steps(url) == [6, 8]


def test_an_outage_of_held_out_reads_during_validation_stops_every_rank_there_and_resumes_bitwise(
        store, remote_shards, prepared, reference, tmp_path):
    """The store stops answering the held-out shards' reads while the training windows still come: at the next
    validation every rank's read fails past the retry budget, and every rank (not only the one whose read failed,
    which left the others waiting in the evaluation's next collective before) abandons it at the same batch,
    checkpoints that step and exits 75; the same command then finishes the run on the uninterrupted trajectory."""
    proxy, bucket = store
    _, make = prepared
    url = f"{bucket}/valout/checkpoints"
    cfg = make(tmp_path / "run", **{**OV, "data.shards_dir": remote_shards, "checkpoint.dir": url,
                                    "eval.every": 3, "eval.max_batches": 1}, faults=SLOW)
    run, argv = Path(cfg.train.run_dir), fresh(cfg, tmp_path)
    env = {"DENSETRAIN_STORE_CACHE": str(tmp_path / "cache"), "DENSETRAIN_STORE_CACHE_MIB": "0",
           "DENSETRAIN_STORE_TIMEOUT_S": "3", "DENSETRAIN_STORE_RETRY_S": "5"}
    procs = start(argv, proxy, **env)
    _wait(lambda: any(r["kind"] == "eval" and r["step"] == 3 for r in read_metrics(run)), procs, "validation 3")
    proxy.faulty("stall", 3600, only=f"GET /{bucket[len('s3://'):]}/shards/email/val/".encode())
    try:
        res = finish(procs)
    finally:
        proxy.faulty("pass", 0)
    assert [rc for rc, _ in res] == [EXIT_PREEMPTED] * 2, [e[-3000:] for _, e in res]
    (stop,) = [e for e in read_events(run) if e.get("kind") == "preempt"]
    assert stop["step"] == 6 and stop["values"]["checkpoint"] == "step_00000006", stop
    assert stop["values"]["abandoned"] == "validation" and "did not answer" in stop["values"]["error"], stop
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "eval"] == [3]  # nothing of the abandoned one
    res = finish(start(argv, proxy, **env))  # the store answers again: the same command finishes the run
    assert [rc for rc, _ in res] == [0, 0], [e[-3000:] for _, e in res]
    assert trajectory(run) == reference


# ------------------------------------------------------------------------------------------------------
# Rollbacks with checkpoints in the store; replay and blame of such a run
# ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def remote_run(store, remote_shards, prepared, tmp_path_factory):
    """(config, checkpoint.dir URL, trajectory): a 1-process run of 6 steps whose checkpoints (every 2, keep 2)
    are uploaded to the store."""
    from densetrain.train import train

    _, make = prepared
    tmp = tmp_path_factory.mktemp("remote_run")
    url = f"{store[1]}/remote_run/checkpoints"
    cfg = make(tmp, **{**OV, "train.resume": "", "train.steps": 6, "data.shards_dir": remote_shards,
                       "checkpoint.dir": url})
    train(cfg)
    assert _remote_steps(url) == [4, 6]
    return cfg, url, trajectory(Path(cfg.train.run_dir))


def test_a_checkpoint_dir_claimed_by_a_second_run_stops_the_first_ones_uploads(remote_run, tmp_path):
    # Found trying it as a user: two runs started at once on one fresh checkpoint.dir both exited 0 saying
    # "uploaded" while each replaced or set aside the other's checkpoints. The first to start writes OWNER; a run
    # that finds another's token there is refused, and an upload that finds its token replaced stops.
    cfg, url, _ = remote_run
    run = Path(cfg.train.run_dir)
    mine = (run / mirror.LOCAL_OWNER).read_text()
    owner = storage.join(url, mirror.OWNER)
    assert storage.read_bytes(owner, 256).decode() == mine and len(mine) == 16
    other = tmp_path / "other_run"  # a second run on the same checkpoint.dir, before any checkpoint is there
    assert mirror.claim(other, url, resume=False).startswith(f"checkpoint.dir {url} belongs to another run (OWNER "
                                                             f"{mine}, this run's none)")
    storage.write_bytes(owner, b"0123456789abcdef")  # as if that second run had started first and claimed it
    try:
        before = storage.listdir(url)
        with pytest.raises(TrainError, match=rf"checkpoint.dir {url} was claimed by another run \(OWNER "
                                             rf"0123456789abcdef, this run's {mine}\) while this run wrote there"):
            mirror.sync_up(run, url, keep=2)
        assert storage.listdir(url) == before  # nothing uploaded, nothing set aside
        assert mirror.claim(run, url, resume=True).startswith(f"checkpoint.dir {url} belongs to another run")
        lost = tmp_path / "new_machine"  # the same run resumed where its run directory is gone: takes the token
        assert mirror.claim(lost, url, resume=True) == "" and (lost / mirror.LOCAL_OWNER).read_text() == \
            "0123456789abcdef"
    finally:
        storage.write_bytes(owner, mine.encode())


def test_a_rollback_sets_aside_the_store_copies_too_and_a_resume_never_fetches_them(remote_run, store, tmp_path):
    from densetrain.train import train

    cfg0, url0, want = remote_run
    cfg = copy.deepcopy(cfg0)  # a run of its own: the module's run stays as it is for replay and blame
    run = tmp_path / "run"
    shutil.copytree(cfg0.train.run_dir, run)
    cfg.train.run_dir, cfg.checkpoint.dir = str(run), f"{store[1]}/rollback/checkpoints"
    storage.put_tree(run / "checkpoints", cfg.checkpoint.dir, last=("COMPLETE",))
    (run / "config.toml").write_text((run / "config.toml").read_text().replace(url0, cfg.checkpoint.dir))
    url = cfg.checkpoint.dir
    assert _remote_steps(url) == [4, 6]

    # --rollback-to 4, stopped before its first new step (no new upload): the store's step 6 is set aside at once
    train(cfg, resume=True, rollback_to=4, stop_after=4)
    assert [s for s, _ in list_complete(run)] == [4] and _remote_steps(url) == [4]
    assert storage.listdir(f"{url}/set_aside") == ["step_00000006"]
    assert storage.read_bytes(f"{url}/set_aside/step_00000006/COMPLETE", 1 << 20) == \
        (run / "checkpoints_set_aside" / "step_00000006" / "COMPLETE").read_bytes()
    assert not (run / "checkpoints_set_aside" / mirror.PENDING).exists()

    # A fresh machine: the resume fetches step 4 (not the set-aside 6) and trains 5 and 6 again, bitwise
    shutil.rmtree(run / "checkpoints")
    train(cfg, resume=True)
    assert trajectory(run) == want
    assert _remote_steps(url) == [4, 6] and storage.listdir(f"{url}/set_aside") == ["step_00000006"]


def test_a_rollback_the_store_missed_is_set_aside_there_by_the_next_resume(remote_run, store, tmp_path, monkeypatch):
    from densetrain.train.rundir import set_aside_future

    cfg0, url0, _ = remote_run
    run, url = tmp_path / "run", f"{store[1]}/missed/checkpoints"
    shutil.copytree(cfg0.train.run_dir, run)
    storage.put_tree(run / "checkpoints", url, last=("COMPLETE",))
    # The rollback to 4 meets a store that does not answer: the local side is done, the store's is recorded.
    with answering_503(store[0], monkeypatch):
        set_aside_future(run, 4, True, url)
    assert [s for s, _ in list_complete(run)] == [4] and _remote_steps(url) == [4, 6]
    assert json.loads((run / "checkpoints_set_aside" / mirror.PENDING).read_text()) == {"after_step": 4}
    # The next resume (here: its fetch) sets the store's 6 aside before anything else and fetches nothing newer.
    assert mirror.fetch_newest(run, url) is None
    assert _remote_steps(url) == [4] and storage.listdir(f"{url}/set_aside") == ["step_00000006"]
    assert not (run / "checkpoints_set_aside" / mirror.PENDING).exists()


def test_replay_and_blame_fetch_the_checkpoint_they_need_from_the_store(remote_run, tmp_path):
    from densetrain.tools.blame import blame
    from densetrain.tools.replay import replay

    cfg, url, _ = remote_run
    run = tmp_path / "run"  # the run directory without its checkpoints: they live in checkpoint.dir only
    shutil.copytree(cfg.train.run_dir, run, ignore=shutil.ignore_patterns("checkpoints*"))
    local = tmp_path / "local"  # the same run with its checkpoints, and without the store
    shutil.copytree(cfg.train.run_dir, local)
    (local / "config.toml").write_text((local / "config.toml").read_text().replace(url, ""))
    assert list_complete(run) == [] and _remote_steps(url) == [4, 6]
    got, want = replay(run, 6), replay(local, 6)  # from step_00000004, fetched
    assert got["checkpoint"] == want["checkpoint"] == "step_00000004" and got["reproduced"]
    assert got["replayed"] == want["replayed"] and got["logged"] == want["logged"]
    b_got, b_want = blame(run, 5), blame(local, 5)
    (rec,) = [r for r in read_metrics(run) if r["kind"] == "train" and r["step"] == 5]
    assert b_got == b_want and b_got["sample_index"] == rec["sample_index"] and len(b_got["samples"]) == 8
    (part,) = (storage.cache_dir() / "runs").glob("*/partial/step_00000004")  # blame: the sampler state only
    assert sorted(p.name for p in part.iterdir()) == [".metadata", "COMPLETE", "trainer_state.json"]


def test_a_store_that_does_not_answer_is_exit_75_in_one_line(remote_run, store, monkeypatch, capsys):
    _, url, _ = remote_run
    with answering_503(store[0], monkeypatch):
        rc = main(["eval", url])
    assert rc == EXIT_PREEMPTED  # a temporary failure: the same command works once the store is back
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"densetrain: error: {url}: the object store did not answer for "), last


def test_a_read_outage_that_also_stops_uploads_keeps_the_checkpoint_local_and_says_so(remote_shards, prepared, store,
                                                                                     tmp_path, monkeypatch):
    """One process whose shards and checkpoint.dir are both behind the proxy, which stops answering at step 2:
    the read outage stops the run there; the stop's checkpoint cannot be uploaded either, which its one line
    says (the event still carries the read's error). Before storage._no_expect_continue that upload waited for
    ever for its "100 Continue"."""
    import threading

    from densetrain.errors import Preempted
    from densetrain.train import train

    proxy, bucket = store
    _, make = prepared
    url = f"{bucket}/both_down/checkpoints"
    cfg = make(tmp_path, **{**OV, "train.resume": "", "checkpoint.every": 0, "data.shards_dir": remote_shards,
                            "checkpoint.dir": url})  # no upload before the outage: it meets a read first
    run = Path(cfg.train.run_dir)
    for k, v in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}", "DENSETRAIN_STORE_CACHE": str(tmp_path / "c"),
                 "DENSETRAIN_STORE_CACHE_MIB": "0", "DENSETRAIN_STORE_TIMEOUT_S": "1",
                 "DENSETRAIN_STORE_RETRY_S": "2"}.items():
        monkeypatch.setenv(k, v)
    for name in ("_fs_cache", "_cache", "_pool"):
        monkeypatch.setattr(storage, name, {} if name == "_fs_cache" else None)

    def stall_after_step_2():
        t0 = time.monotonic()
        while not any(r["kind"] == "train" and r["step"] >= 2 for r in read_metrics(run)):
            if time.monotonic() - t0 > 120:
                return
            time.sleep(0.02)
        proxy.faulty("stall", 3600)

    watcher = threading.Thread(target=stall_after_step_2, daemon=True)
    watcher.start()
    try:
        with pytest.raises(Preempted) as e:
            train(cfg)
    finally:
        proxy.faulty("pass", 0)
        watcher.join()
    (stop,) = [ev for ev in read_events(run) if ev.get("kind") == "preempt"]
    step = stop["step"]
    assert str(e.value) == (f"stopped by an outage of {url} after step {step} (checkpoint step_{step:08d} written "
                            f"to local disk only, not uploaded); continue with: densetrain train --resume {run}")
    assert stop["values"]["uploaded"] is False and stop["values"]["error"].startswith("rank 0: s3://")
    assert stop["values"]["signal"] == f"an outage of {remote_shards}"
    assert list_complete(run)[-1][0] == step and step < 8
