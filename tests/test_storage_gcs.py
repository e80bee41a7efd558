"""gs:// end to end against a real GCS-compatible server: gcp-storage-emulator over HTTP on localhost
(tests/gcs_server.py), spoken to through gcsfs by the clients' standard settings (``STORAGE_EMULATOR_HOST``,
anonymous credentials through fsspec's ``FSSPEC_GS_TOKEN``):

- gcsfs's own exceptions for each HTTP status are classified as densetrain's retry layer must (429 / 5xx /
  timeouts / dropped connections retried; 403 / 404 / 412 not);
- ``prepare`` writes shards to ``gs://``; they read back as the local ones' tokens;
- two gloo ranks train from them and checkpoint to ``gs://``; rank 0 is killed (-9) at step 5; the same command
  resumes from the store bitwise equal to an uninterrupted run that read local shards; eval and export read
  the remote checkpoint and equal those of the local copy.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

import aiohttp
import fsspec.config
import numpy as np
import pytest
from gcs_server import gcs_env, make_bucket, start_gcs
from store_server import environ_restore, environ_set, free_port, prepare_to
from test_resume import finish, fresh, trajectory
from test_resume import start as start_train

from densetrain import storage
from densetrain.checkpoint import list_complete, mirror
from densetrain.cli import main
from densetrain.data.streams import open_streams
from densetrain.metrics import read_events
from densetrain.storage.retry import _transient

gcsfs_retry = pytest.importorskip("gcsfs.retry")


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """The bucket's URL: the emulator on a free port, this process and those it starts its clients.

    No fault proxy in front (tests/store_server.py's, as for moto): the emulator serves one connection at a time
    (http.server.HTTPServer), and the proxy opens its connection to the server when the client connects, so one
    such connection not yet used stops the emulator answering anyone. The faults are tested against moto."""
    port, cache = free_port(), tmp_path_factory.mktemp("gcs_cache")
    server = start_gcs(port, cache.parent / "gcs.log")
    old = environ_set(gcs_env(f"http://127.0.0.1:{port}", str(cache)))
    conf = fsspec.config.conf.setdefault("gs", {})  # fsspec read FSSPEC_GS_TOKEN at its import: set it here too
    conf["token"] = "anon"
    storage._fs_cache.clear()
    make_bucket("densetrain-gcs")
    fs, _ = storage._fs("gs://densetrain-gcs")
    # the plain JSON-API client: gcsfs read GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT when it was first imported
    assert type(fs).__name__ == "GCSFileSystem", (type(fs), sys.modules["gcsfs"].__file__)
    yield "gs://densetrain-gcs"
    conf.pop("token", None)
    environ_restore(old)
    storage._fs_cache.clear()
    server.kill()
    server.wait()


def _raised(status: int) -> Exception:
    """The exception gcsfs itself raises for an answer of ``status`` (its own response check)."""
    try:
        gcsfs_retry.validate_response(status, json.dumps({"error": {"code": status, "message": "m"}}).encode(),
                                      "b/o")
    except Exception as e:  # noqa: BLE001 - what gcsfs raises is the point
        return e
    raise AssertionError(f"gcsfs accepted status {status}")


def test_gcsfs_errors_are_retried_when_transient():
    transient = [_raised(s) for s in (408, 429, 500, 502, 503, 504)] + [
        aiohttp.ServerTimeoutError("Timeout on reading data from socket"),
        aiohttp.ClientOSError(104, "Connection reset by peer"), aiohttp.ServerDisconnectedError(),
        aiohttp.ClientPayloadError("Response payload is not completed"), asyncio.TimeoutError()]
    permanent = [_raised(s) for s in (400, 401, 403, 404, 412)]
    assert [_transient(e) for e in transient] == [True] * len(transient), transient
    assert [_transient(e) for e in permanent] == [False] * len(permanent), permanent


@pytest.fixture(scope="module")
def remote_shards(gcs, tmp_path_factory, prepared):
    """The stdlib sources of conftest's ``prepared`` prepared again, straight to ``gs://.../shards``."""
    return prepare_to(f"{gcs}/shards", prepared, tmp_path_factory.mktemp("gcs_prep"))


def test_prepare_writes_to_gs_and_the_reads_are_the_local_tokens(remote_shards, prepared, tmp_path):
    _, make = prepared
    local_cfg, remote_cfg = make(tmp_path), make(tmp_path)
    remote_cfg.data.shards_dir = remote_shards
    assert storage.isfile(f"{remote_shards}/manifest.json") and storage.isfile(f"{remote_shards}/tokenizer.json")
    local, remote = open_streams(local_cfg, "train"), open_streams(remote_cfg, "train")
    assert set(local) == set(remote) and all(len(local[k]) == len(remote[k]) for k in local)
    assert all(isinstance(f, str) and f.startswith("gs://") for s in remote.values() for f in s.files)
    for key, stream in local.items():
        n = len(stream)
        for at in (0, 1, n // 3, n - 65):  # range reads of the emulator's objects
            assert np.array_equal(stream.read(at, 65), remote[key].read(at, 65))
    size, etag = storage.stat(remote[key].files[0])
    assert size > 0 and etag not in ("", "None")  # the object's version for the cache key (gcsfs: its md5 etag)


OV = {"train.steps": 8, "checkpoint.every": 2, "checkpoint.keep": 2, "eval.every": 0, "logging.tensorboard": False,
      "watchdog.every": 0, "probe.every": 0, "train.device": "cpu", "train.resume": "auto"}


KILL = [{"kind": "kill", "step": 5, "rank": 0}]  # as kill -9: the trajectory is unchanged


def _start(argv: list[str]) -> list:
    """``densetrain train ARGV`` as two gloo ranks."""
    return start_train(argv, world=2)


def _remote_steps(url) -> list[int]:
    return [s for s, _ in mirror.remote_complete(url)]


def test_two_ranks_from_gs_survive_kill_and_resume_bitwise_then_eval_and_export(gcs, remote_shards, prepared,
                                                                                 tmp_path):
    bucket = gcs
    _, make = prepared
    ref_cfg = make(tmp_path / "ref", **OV)  # local shards, local checkpoints
    res = finish(_start(fresh(ref_cfg, tmp_path)))
    assert [rc for rc, _ in res] == [0, 0], [e[-3000:] for _, e in res]
    want = trajectory(Path(ref_cfg.train.run_dir))
    assert sorted(want) == list(range(1, 9))

    url = f"{bucket}/run/checkpoints"
    cfg = make(tmp_path / "run", **OV, **{"data.shards_dir": remote_shards, "checkpoint.dir": url}, faults=KILL)
    run, argv = Path(cfg.train.run_dir), fresh(cfg, tmp_path)
    procs = _start(argv)
    procs[0].wait(timeout=300)  # rank 0 killed (-9) before its 6th step; rank 1 then waits in a collective
    procs[1].kill()
    finish(procs)
    assert procs[0].returncode == -9
    newest = _remote_steps(url)[-1]
    assert newest in (2, 4), _remote_steps(url)  # step 4's upload may still have been under way: not listed
    shutil.rmtree(run / "checkpoints")  # the run directory's copies are gone: the resume reads the store

    res = finish(_start(argv))  # the same command
    assert [rc for rc, _ in res] == [0, 0], [e[-3000:] for _, e in res]
    resumed = [e for e in read_events(run) if e.get("kind") == "resume"]
    assert resumed and resumed[-1]["step"] == newest, resumed
    assert trajectory(run) == want  # bitwise: loss, grad_norm, sample_index, lr of every step
    assert _remote_steps(url) == [6, 8] and [s for s, _ in list_complete(run)] == [6, 8]  # retention in the store

    assert main(["eval", url]) == 0
    assert main(["eval", str(run / "checkpoints" / "step_00000008")]) == 0
    (copy,) = (storage.cache_dir() / "runs").glob("*/evals/step_00000008.json")
    assert json.loads(copy.read_text())["val"] == json.loads((run / "evals" / "step_00000008.json").read_text())["val"]
    assert main(["export", f"{url}/step_00000008", str(tmp_path / "hf_remote")]) == 0
    assert main(["export", str(run / "checkpoints" / "step_00000008"), str(tmp_path / "hf_local")]) == 0
    assert (tmp_path / "hf_remote" / "model.safetensors").read_bytes() == \
        (tmp_path / "hf_local" / "model.safetensors").read_bytes()
