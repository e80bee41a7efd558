"""Object storage against local files, side by side in one process, alternating: a real S3-compatible server
(moto's standalone server on localhost, tests/store_server.py) spoken to through s3fs as a user's S3.

1. Training tokens/s: one optimizer step of the preset's model (forward + backward + AdamW, one thread) on a
   global batch drawn by the run's sampler (MixtureSampler, shuffled windows) from a token stream (synthetic
   uint16 shards of ``--shard-mib`` MiB each) whose shards are local files or ``s3://`` objects (range reads
   through the bounded local cache, the next batch's windows prefetched while a step trains:
   densetrain/storage.py). The first remote pass starts from an empty cache; the second draws the same
   windows again from what the cache holds (a restart on the same node).
2. Checkpoint save and load: :func:`save_checkpoint` into the run directory, then (remote) the upload of
   ``checkpoint.dir`` (:func:`sync_up`); load: (remote) the fetch of :func:`fetch_newest` into an empty run
   directory, then :func:`load_checkpoint`.
3. The server's own latency: the median of 50 small GETs.

    .venv/bin/python benchmarks/store_bench.py --preset tiny --steps 20
"""

from __future__ import annotations

import argparse
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
from densetrain.data.mixture import MixtureSampler  # noqa: E402
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

    def step(sampler: MixtureSampler) -> tuple[float, float]:
        t0 = time.perf_counter()
        rows = sampler.next_samples(batch, "main", {"src": 1.0}, seq, shuffle_seed=0)
        x = torch.from_numpy(np.stack([r.tokens for r in rows]))
        t1 = time.perf_counter()
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return t1 - t0, time.perf_counter() - t0

    times: dict[tuple, list[float]] = {}
    reads: dict[tuple, list[float]] = {}
    counts = [dict(storage.counters)]
    step(MixtureSampler({"src": streams["local"]}))  # warm-up: allocations, first kernels
    passes = ("cold cache", "warm cache")
    for label in passes:  # each pass draws the same windows from sampler state 0, local and s3 alternating
        samplers = {"local": MixtureSampler({"src": streams["local"]}), "s3": MixtureSampler({"src": streams["s3"]})}
        for k in range(args.steps):
            for side in (("local", "s3") if k % 2 == 0 else ("s3", "local")):
                r, t = step(samplers[side])
                times.setdefault((label, side), []).append(t)
                reads.setdefault((label, side), []).append(r)
        counts.append(dict(storage.counters))
    c0, c1, c2 = counts
    tokens = batch * seq
    med = {k: statistics.median(v) for k, v in times.items()}
    rd = {k: statistics.median(v) for k, v in reads.items()}
    cache_mib = sum(f.stat().st_size for f in (storage.cache_dir() / "blocks").rglob("*") if f.is_file()) / 2**20

    def rate(a, b):
        hits = b["store_cache_hits"] - a["store_cache_hits"]
        return hits / max(hits + b["store_cache_misses"] - a["store_cache_misses"], 1)

    print(f"CPU: {_cpu()}; torch {torch.__version__}; 1 thread; preset {args.preset}: {model.num_params() / 1e6:.1f}M "
          f"parameters, batch {batch} x seq_len {seq}; {args.shards} shards x {args.shard_mib} MiB; "
          f"moto server on localhost: median small GET {latency * 1e3:.1f} ms; median of {args.steps} steps")
    for label in passes:
        lo, s3 = med[(label, "local")], med[(label, "s3")]
        extra = rd[(label, "s3")] - rd[(label, "local")]
        print(f"{label}: step local {lo * 1e3:.1f} ms ({tokens / lo:.0f} tokens/s), s3 {s3 * 1e3:.1f} ms "
              f"({tokens / s3:.0f} tokens/s): {lo / s3:.3f}x local; batch read local {rd[(label, 'local')] * 1e3:.2f} "
              f"ms, s3 {rd[(label, 's3')] * 1e3:.2f} ms: +{extra / lo * 100:.2f}% of a local step")
    fetched = (c2["store_bytes_fetched"] - c0["store_bytes_fetched"]) / 2**20
    print(f"cache: hit rate {rate(c0, c1):.3f} first pass, {rate(c1, c2):.3f} second; {cache_mib:.0f} MiB held "
          f"(limit {storage.cache_limit() / 2**20:.0f} MiB); {fetched:.0f} MiB fetched; {c2['store_retries']} retries")
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
