"""The cost of checkpoint content verification: a save that hashes every file (xxh3-64, in the same pass
as its fsync) and a load that re-hashes them before reading, against the same save and load without
digests, side by side in one process, alternating, medians of ``--repeats``.

The baseline is the real code with the digest step swapped for what it replaced: at save, an fsync of
each file (the protocol's ``_fsync_tree`` before digests); at load, nothing. The files are in the page
cache for both (the common case right after a save, and on a resume of a machine that wrote them): the
load's ratio is then the hashing itself; reading from a cold disk, verification pulls the files into the
cache that DCP's read then uses, so its share is smaller still. The non-finite weight check of a load is
timed apart. Also printed: xxh3-64 throughput on one core, and zlib.crc32 / blake2b for comparison.

    .venv/bin/python benchmarks/ckpt_verify_cost.py --preset tiny --repeats 5
    .venv/bin/python benchmarks/ckpt_verify_cost.py --preset gpt2-124m --repeats 3
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import torch
import xxhash

import densetrain.checkpoint.load as ckpt_load
import densetrain.checkpoint.save as ckpt_save
from densetrain.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from densetrain.config import load_config
from densetrain.dcp_read import hash_file
from densetrain.model.init import build_model
from densetrain.optim import build_optimizer

VERIFY = ckpt_load.verify_checkpoint  # the real one; the baseline swaps in a no-op


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _fsync_only(path: Path, fsync: bool = False) -> dict:
    """The baseline's stand-in for ``hash_file``: fsync only, a constant record (the marker stays valid)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return {"bytes": 0, "xxh3_64": "0" * 16}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(args.preset)
    model = build_model(cfg.model, cfg.train.seed, torch.device("cpu"))
    opt = build_optimizer(model, cfg)
    model(torch.randint(0, cfg.model.vocab_size, (1, 16))).float().logsumexp(-1).mean().backward()
    opt.step()  # optimizer moments exist, as in a real checkpoint
    opt.zero_grad()
    times: dict[str, list[float]] = {k: [] for k in ("save", "save_base", "load", "load_base", "finite")}
    with tempfile.TemporaryDirectory(prefix="ckpt-verify-") as tmp:
        run = Path(tmp)
        for r in range(args.repeats):
            for k, verify in enumerate((r % 2 == 0, r % 2 == 1)):  # alternate which goes first
                ckpt_save.hash_file = hash_file if verify else _fsync_only
                step = 2 * r + k + 1  # each load reads the checkpoint just saved (retention keeps 1)
                times["save" if verify else "save_base"].append(
                    _timed(lambda s=step: save_checkpoint(run, s, model, opt, {"step": s}, keep=1)))
                ckpt_load.verify_checkpoint = VERIFY if verify else (lambda *a, **k: False)
                path = latest_checkpoint(run)
                times["load" if verify else "load_base"].append(_timed(lambda p=path: load_checkpoint(p, model, opt)))
            times["finite"].append(_timed(lambda: all(bool(torch.isfinite(p.sum())) for p in model.parameters())))
        ckpt_save.hash_file = hash_file
        ckpt_load.verify_checkpoint = VERIFY
        last = latest_checkpoint(run)
        size = sum(f.stat().st_size for f in last.iterdir())
        save_checkpoint(run, 2 * args.repeats + 1, model, opt, {"step": 2 * args.repeats + 1}, keep=1)  # with digests
        last = latest_checkpoint(run)
        files = [f for f in last.iterdir() if f.name != "COMPLETE"]
        # The digest passes alone, on the same files, alternating (less noise than whole saves on a busy box):
        # the save's extra work is hashing where the baseline only fsyncs; the load's is verify_checkpoint.
        for _ in range(2 * args.repeats):
            times.setdefault("hash_pass", []).append(_timed(lambda: [hash_file(f, fsync=True) for f in files]))
            times.setdefault("fsync_pass", []).append(_timed(lambda: [_fsync_only(f, fsync=True) for f in files]))
            times.setdefault("verify_pass", []).append(_timed(lambda: VERIFY(last)))
    med = {k: statistics.median(v) for k, v in times.items()}
    data = os.urandom(256 << 20)
    rates = {name: (256 / 1024) / _timed(lambda f=f: f(data)) for name, f in
             (("xxh3_64", lambda b: xxhash.xxh3_64(b).digest()), ("zlib.crc32", zlib.crc32),
              ("blake2b", lambda b: hashlib.blake2b(b).digest()))}
    print(f"CPU: {_cpu()}; torch {torch.__version__}; 1 thread; preset {args.preset}: "
          f"{model.num_params() / 1e6:.1f}M parameters, checkpoint {size / 2**20:.1f} MiB; median of {args.repeats}")
    print(f"save: {med['save']:.3f} s with digests, {med['save_base']:.3f} s without: "
          f"{med['save'] / med['save_base']:.3f}x")
    print(f"load: {med['load']:.3f} s verified, {med['load_base']:.3f} s unverified: "
          f"{med['load'] / med['load_base']:.3f}x (the non-finite weight check: {med['finite'] * 1e3:.1f} ms, "
          f"{med['finite'] / med['load_base'] * 100:.1f}% of the load)")
    extra_save = med["hash_pass"] - med["fsync_pass"]
    print(f"digest passes alone: save +{extra_save:.3f} s ({extra_save / med['save_base'] * 100:.1f}% of a save "
          f"without digests), load +{med['verify_pass']:.3f} s ({med['verify_pass'] / med['load_base'] * 100:.1f}% of "
          f"an unverified load)")
    print("hash throughput, one core, 256 MiB in memory: " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in rates.items()))

if __name__ == "__main__":
    main()
