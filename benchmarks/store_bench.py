"""Object storage against local files, side by side in one process, alternating: a real S3-compatible server
(moto's standalone server on localhost, tests/store_server.py) spoken to through s3fs as a user's S3.

1. Training tokens/s: one optimizer step of the preset's model (forward + backward + AdamW, one thread) on a
   global batch of shuffled windows read from a token stream (synthetic uint16 shards of ``--shard-mib`` MiB
   each) whose shards are local files or ``s3://`` objects (range reads through the bounded local cache:
   densetrain/storage.py). The first remote pass starts from an empty cache (every block a miss); the
   later ones read what the cache holds, as a run does after its first epoch or a restart on the same node.
2. Checkpoint save and load: :func:`save_checkpoint` into the run directory, then (remote) the upload of
   ``checkpoint.dir`` (:func:`sync_up`); load: (remote) the fetch of :func:`fetch_newest` into an empty run
   directory, then :func:`load_checkpoint`.
3. The server's own latency: the median of 50 small GETs.

    .venv/bin/python benchmarks/store_bench.py --preset tiny --steps 20
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from store_server import environ_set, free_port, make_bucket, s3_env, start_moto  # noqa: E402

from densetrain import storage  # noqa: E402
from densetrain.checkpoint import list_complete, load_checkpoint, save_checkpoint  # noqa: E402
from densetrain.checkpoint.mirror import fetch_newest, sync_up  # noqa: E402
from densetrain.config import load_config  # noqa: E402
from densetrain.data.shards import TokenFiles, write_shard  # noqa: E402
from densetrain.model.init import build_model  # noqa: E402
from densetrain.optim import build_optimizer  # noqa: E402


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=20, help="steps per side (alternating)")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--shard-mib", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="store-bench-"))
    port = free_port()
    server = start_moto(port, tmp / "moto.log")
    try:
        environ_set(s3_env(f"http://127.0.0.1:{port}", str(tmp / "cache")))
        make_bucket("bench")
        _run(args, tmp)
    finally:
        server.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def _run(args, tmp: Path) -> None:
    cfg = load_config(args.preset)
    vocab, seq, batch = cfg.model.vocab_size, cfg.train.seq_len, cfg.train.batch_size
    rng = np.random.default_rng(0)
    local = tmp / "shards"
    n_tok = args.shard_mib << 19  # uint16
    for i in range(args.shards):
        write_shard(local / f"{i:06d}", [rng.integers(0, min(vocab, 65535), n_tok)], 2)
    storage.put_tree(local, "s3://bench/shards")
    streams = {"local": TokenFiles(local), "s3": TokenFiles("s3://bench/shards")}

    def gets():
        return _timed(lambda: storage.read_bytes(f"s3://bench/shards/{0:06d}.ds.metadata", 1 << 20))

    latency = statistics.median(gets() for _ in range(50))

    model = build_model(cfg.model, cfg.train.seed, torch.device("cpu"))
    opt = build_optimizer(model, cfg)
    total = len(streams["local"])

    def step(stream: TokenFiles, starts) -> tuple[float, float]:
        t0 = time.perf_counter()
        x = torch.from_numpy(np.stack([stream.read(s, seq + 1) for s in starts]))
        t1 = time.perf_counter()
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return t1 - t0, time.perf_counter() - t0

    times = {k: [] for k in ("local", "s3_cold", "s3_warm")}
    reads = {k: [] for k in times}
    windows = [rng.integers(0, total - seq - 1, batch) for _ in range(args.steps)]
    step(streams["local"], windows[0])  # warm-up: allocations, first kernels
    c0 = dict(storage.counters)
    for k, starts in enumerate(windows):  # the first pass over the windows: the remote cache starts empty
        order = ("local", "s3") if k % 2 == 0 else ("s3", "local")
        for side in order:
            r, t = step(streams[side], starts)
            key = side if side == "local" else "s3_cold"
            times[key].append(t)
            reads[key].append(r)
    c1 = dict(storage.counters)
    for k, starts in enumerate(windows):  # the same windows again: the cache holds their blocks
        for side in (("local", "s3") if k % 2 else ("s3", "local")):
            r, t = step(streams[side], starts)
            if side == "s3":
                times["s3_warm"].append(t)
                reads["s3_warm"].append(r)
    c2 = dict(storage.counters)
    tokens = batch * seq
    med = {k: statistics.median(v) for k, v in times.items()}
    rd = {k: statistics.median(v) for k, v in reads.items()}
    cache_mib = sum(f.stat().st_size for f in (storage.cache_dir() / "blocks").rglob("*") if f.is_file()) / 2**20

    def rate(a, b, key):
        n = (b[key + "_hits"] - a[key + "_hits"]) + (b[key + "_misses"] - a[key + "_misses"])
        return (b[key + "_hits"] - a[key + "_hits"]) / max(n, 1)

    print(f"CPU: {_cpu()}; torch {torch.__version__}; 1 thread; preset {args.preset}: {model.num_params() / 1e6:.1f}M "
          f"parameters, batch {batch} x seq_len {seq}; {args.shards} shards x {args.shard_mib} MiB; "
          f"moto server on localhost: median small GET {latency * 1e3:.1f} ms; median of {args.steps} steps")
    for k in times:
        print(f"{k:8s}: step {med[k] * 1e3:8.1f} ms (read {rd[k] * 1e3:7.2f} ms), {tokens / med[k]:9.0f} tokens/s, "
              f"{med['local'] / med[k]:.3f}x local")
    print(f"cache: first pass hit rate {rate(c0, c1, 'store_cache'):.3f}, second pass {rate(c1, c2, 'store_cache'):.3f};"
          f" {cache_mib:.0f} MiB held (limit {storage.cache_limit() / 2**20:.0f} MiB), "
          f"{(c2['store_bytes_fetched'] - c0['store_bytes_fetched']) / 2**20:.0f} MiB fetched, "
          f"{c2['store_retries']} retries")
    _checkpoints(model, opt, tmp)


def _checkpoints(model, opt, tmp: Path) -> None:
    res: dict[str, list[float]] = {k: [] for k in ("save", "upload", "load", "fetch")}
    size = 0
    for r in range(3):
        run = tmp / f"run{r}"
        res["save"].append(_timed(lambda run=run, r=r: save_checkpoint(run, r + 1, model, opt, {"step": r + 1}, 1)))
        size = sum(f.stat().st_size for f in list_complete(run)[-1][1].iterdir())
        res["upload"].append(_timed(lambda run=run, r=r: sync_up(run, f"s3://bench/ckpt{r}", 1)))
        res["load"].append(_timed(lambda run=run: load_checkpoint(list_complete(run)[-1][1], model, opt)))
        fresh = tmp / f"fresh{r}"
        res["fetch"].append(_timed(lambda fresh=fresh, r=r: fetch_newest(fresh, f"s3://bench/ckpt{r}")))
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"checkpoint {size / 2**20:.1f} MiB, median of 3: save {med['save']:.3f} s local, +{med['upload']:.3f} s "
          f"upload ({(med['save'] + med['upload']) / med['save']:.2f}x); load {med['load']:.3f} s local, "
          f"+{med['fetch']:.3f} s fetch ({(med['load'] + med['fetch']) / med['load']:.2f}x)")


if __name__ == "__main__":
    main()
