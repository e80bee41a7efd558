"""A real GCS-compatible server for the gs:// tests: ``gcp-storage-emulator`` (PyPI, pure Python: the JSON API
over HTTP, simple / multipart / resumable uploads, range reads, md5 ETags) in a subprocess on a free localhost
port, spoken to through gcsfs exactly as a user's GCS emulator is, by the clients' standard settings:

- ``STORAGE_EMULATOR_HOST``: the endpoint (gcsfs and google-cloud-storage read it);
- ``FSSPEC_GS_TOKEN=anon``: anonymous credentials (fsspec's per-protocol config from the environment), so that
  no credential chain is searched (google-auth would otherwise ask the GCE metadata server);
- ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``: gcsfs's plain JSON-API file system. By default gcsfs (>= 2026.x)
  first asks the Storage Control gRPC API for each bucket's layout (zonal / hierarchical namespace); the
  emulator speaks no gRPC, and each lookup then waits out a 60 s timeout before gcsfs falls back to this same
  JSON-API path. Read by gcsfs at import, so it must be in the environment before gcsfs is imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

# Before any import of gcsfs in this process (it reads the variable once); processes started later inherit it.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"


def start_gcs(port: int, log) -> subprocess.Popen:
    """gcp-storage-emulator on ``port`` (in memory), ready to answer (or an AssertionError with its output); its
    log goes to file ``log``."""
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gcp_storage_emulator", "start", "-H", "127.0.0.1",
                                 "--port", str(port), "--in-memory", "-q"], stdout=out, stderr=subprocess.STDOUT)
    t0 = time.monotonic()
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/storage/v1/b", timeout=1)
            return proc
        except OSError:
            assert proc.poll() is None, open(log).read()[-2000:]
            assert time.monotonic() - t0 < 60, "gcp-storage-emulator did not start in 60 s"
            time.sleep(0.1)


def gcs_env(endpoint: str, cache: str) -> dict:
    """The environment of a process that uses the emulator (module docstring), with a 10 s retry budget."""
    return {"STORAGE_EMULATOR_HOST": endpoint, "FSSPEC_GS_TOKEN": "anon", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            "DENSETRAIN_STORE_CACHE": cache, "DENSETRAIN_STORE_RETRY_S": "10"}


def make_bucket(name: str) -> None:
    import gcsfs

    gcsfs.GCSFileSystem(token="anon", project="densetrain-test", skip_instance_cache=True).mkdir(name)
