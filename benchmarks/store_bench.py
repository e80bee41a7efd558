"""Object storage against local files, side by side in one process, alternating: a real S3-compatible server
(moto's standalone server on localhost, tests/store_server.py) spoken to through s3fs as a user's S3.

1. Training tokens/s: one optimizer step of the preset's model (forward + backward + AdamW, one thread) on a
   global batch drawn by the run's sampler (MixtureSampler, shuffled windows) from a token stream (synthetic
   uint16 shards of ``--shard-mib`` MiB each) whose shards are local files or ``s3://`` objects (range reads
   through the bounded local cache, the next batch's windows prefetched while a step trains:
   densetrain/storage.py). The first remote pass starts from an empty cache; the second draws the same
   windows again from what the cache holds (a restart on the same node).
2. Checkpoint save and load (the ``--ckpt-preset`` model with its AdamW moments), two ways to the store,
   alternating: (a) what densetrain does: :func:`save_checkpoint` into the run directory, then the upload of
   ``checkpoint.dir`` (:func:`sync_up`); load: the fetch of :func:`fetch_newest` into an empty run directory,
   then :func:`load_checkpoint`; (b) DCP straight to the URL through torch's fsspec storage writer / reader
   (``torch.distributed.checkpoint._fsspec_filesystem.FsspecWriter`` / ``FsspecReader``, the same state dict).
3. The server's own latency: the median of 50 small GETs.

    .venv/bin/python benchmarks/store_bench.py --preset tiny --steps 20
    .venv/bin/python benchmarks/store_bench.py --preset gpt2-124m --seq-len 128 --batch-size 4 --steps 4 \
        --no-checkpoints
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.state_dict import get_state_dict

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
    ap.add_argument("--seq-len", type=int, default=0, help="train.seq_len of the preset when > 0")
    ap.add_argument("--batch-size", type=int, default=0, help="train.batch_size of the preset when > 0")
    ap.add_argument("--ckpt-preset", default="tiny", help="the model whose checkpoints are timed")
    ap.add_argument("--no-checkpoints", dest="checkpoints", action="store_false")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message=".*torch.distributed.*")  # single-process DCP warns on each call
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


def _load() -> str:
    return "load average %.1f %.1f %.1f" % os.getloadavg()


def _run(args, tmp: Path) -> None:
    over = [(k, v) for k, v in (("train.seq_len", args.seq_len), ("train.batch_size", args.batch_size),
                                ("train.micro_batch_size", args.batch_size)) if v > 0]
    if args.seq_len > 0:  # one stage at that length (a preset's long-context stage needs its own seq_len)
        over.append(("stages", [{"name": "main", "start": 0.0, "mix": load_config(args.preset).stages[0].mix}]))
    cfg = load_config(args.preset, overrides=over)
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

    print(f"CPU: {_cpu()}, {os.cpu_count()} vCPUs, {_load()}; torch {torch.__version__}; 1 thread; "
          f"preset {args.preset}: {model.num_params() / 1e6:.1f}M "
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
          f"(limit {storage.cache_limit() / 2**20:.0f} MiB); {fetched:.0f} MiB fetched; {c2['store_retries']} retries; "
          f"{_load()}")
    if args.checkpoints:
        if args.ckpt_preset != args.preset:
            cfg = load_config(args.ckpt_preset)
            model = build_model(cfg.model, cfg.train.seed, torch.device("cpu"))
            opt = build_optimizer(model, cfg)
            x = torch.randint(0, cfg.model.vocab_size, (2, 33))  # one step: AdamW's moments exist
            torch.nn.functional.cross_entropy(model(x[:, :-1]).float().flatten(0, 1), x[:, 1:].flatten()).backward()
            opt.step()
        _checkpoints(model, opt, tmp)


def _checkpoints(model, opt, tmp: Path) -> None:
    """Staged (densetrain's way) and direct (DCP's fsspec writer) alternating, 3 of each; medians printed."""
    res: dict[str, list[float]] = {k: [] for k in ("save", "upload", "load", "fetch", "direct_save", "direct_load")}
    size = 0
    for r in range(3):
        run = tmp / f"run{r}"
        res["save"].append(_timed(lambda run=run, r=r: save_checkpoint(run, r + 1, model, opt, {"step": r + 1}, 1)))
        size = sum(f.stat().st_size for f in list_complete(run)[-1][1].iterdir())
        res["upload"].append(_timed(lambda run=run, r=r: sync_up(run, f"s3://bench/ckpt{r}", 1)))
        res["load"].append(_timed(lambda run=run: load_checkpoint(list_complete(run)[-1][1], model, opt)))
        fresh = tmp / f"fresh{r}"
        res["fetch"].append(_timed(lambda fresh=fresh, r=r: fetch_newest(fresh, f"s3://bench/ckpt{r}")))
        url = f"s3://bench/direct{r}/step_{r + 1:08d}"
        # sync_files off: an object PUT is durable when it returns (fsync of an fsspec stream is os.sync())
        res["direct_save"].append(_timed(lambda url=url: dcp.save(_state(model, opt), storage_writer=FsspecWriter(
            url, sync_files=False))))
        res["direct_load"].append(_timed(lambda url=url: dcp.load(_state(model, opt),
                                                                  storage_reader=FsspecReader(url))))
    med = {k: statistics.median(v) for k, v in res.items()}
    staged_save, staged_load = med["save"] + med["upload"], med["load"] + med["fetch"]
    print(f"checkpoint {size / 2**20:.1f} MiB, median of 3, {_load()}:\n"
          f"  local: save {med['save']:.3f} s, load {med['load']:.3f} s\n"
          f"  staged (densetrain): save {med['save']:.3f} s + upload {med['upload']:.3f} s = {staged_save:.3f} s "
          f"({staged_save / med['save']:.2f}x local); fetch {med['fetch']:.3f} s + load {med['load']:.3f} s = "
          f"{staged_load:.3f} s ({staged_load / med['load']:.2f}x local)\n"
          f"  direct (DCP FsspecWriter / FsspecReader): save {med['direct_save']:.3f} s "
          f"({med['direct_save'] / med['save']:.2f}x local, {med['direct_save'] / staged_save:.2f}x staged); load "
          f"{med['direct_load']:.3f} s ({med['direct_load'] / med['load']:.2f}x local, "
          f"{med['direct_load'] / staged_load:.2f}x staged)")


def _state(model, opt) -> dict:
    """The state dict densetrain's checkpoints hold (model and optimizer, as :func:`save_checkpoint`)."""
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


if __name__ == "__main__":
    main()
