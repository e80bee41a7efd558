"""Memory and step time of a pipelined FSDP2 rank under ``parallel.pp_grad_sync`` "last" and "microbatch",
side by side, beside the memory plan's transient bytes.

    .venv/bin/python benchmarks/pp_grad_sync.py                 # d_model 512, 8 blocks, 4 micro-batches
    .venv/bin/python benchmarks/pp_grad_sync.py --dp-shard 4 --microbatches 8   # 8 processes

``2 dp_shard`` processes (gloo, one thread each) run pp 2 x dp_shard (1f1b, fp32) through full training steps (AdamW)
of ``m`` micro-batches of one row per data-parallel rank, once per mode. Memory (:class:`HeapPeak`): the
peak of the heap bytes a rank's process has in use during its last step's forward and backward above those
at the step's start (glibc's ``mallinfo2``, every thread: torch's CPU tensors and gloo's buffers), sampled
every 0.2 ms. The difference of the two modes' peaks is what keeping every gradient unsharded until the
last micro-batch costs; beside it the planner's (:func:`densetrain.tools.plan.memory.layout_memory`:
transient terms "last" minus "microbatch", 4 bytes per parameter of the rank less two blocks' and the root
group's), less the sharded gradients (4 bytes per parameter / dp_shard) that "microbatch" allocates from the
first micro-batch and "last" at its end only (the plan counts them held throughout, as they are at the
optimizer step). A process's peak resident memory (``ru_maxrss``) is printed too but does not measure this on
CPU: glibc keeps freed memory in its arenas. Step times are the median over
``--steps`` steps (the first, which builds the stages, not counted): one reduce-scatter per micro-batch
instead of one per step; wall times on shared cores are noisy, compare them as a ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = [("model.vocab_size", 4096), ("model.d_model", 512), ("model.n_layers", 8), ("model.n_heads", 8),
         ("model.n_kv_heads", 4), ("model.d_ff", 1536), ("model.tie_embeddings", False), ("train.device", "cpu"),
         ("train.dtype", "fp32"), ("eval.tasks", ""), ("eval.final_tasks", ""), ("eval.samples", 0),
         ("model.document_mask", False), ("stages", [{"name": "main"}]), ("parallel.pp", 2),
         ("parallel.dp_replicate", 1), ("parallel.pp_schedule", "1f1b")]


def config(mode: str, m: int, dp_shard: int):
    from densetrain.config import load_config

    return load_config(preset="tiny", overrides=[*MODEL, ("parallel.pp_microbatches", m),
                                                 ("parallel.dp_shard", dp_shard), ("parallel.pp_grad_sync", mode)])


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


class HeapPeak:
    """Context: ``rise``, the most bytes the process's heap had in use inside it above those at its start (glibc
    ``mallinfo2``: ``uordblks`` allocated in the arenas plus ``hblkhd`` in mmapped blocks, all threads), sampled
    every 0.2 ms by a thread (a shorter peak can be missed). Linux with glibc only."""

    def __init__(self):
        self._libc = ctypes.CDLL("libc.so.6")
        self._libc.mallinfo2.restype = _Mallinfo2

    def used(self) -> int:
        info = self._libc.mallinfo2()
        return info.uordblks + info.hblkhd

    def _sample(self) -> None:
        while not self._done.is_set():
            self._peak = max(self._peak, self.used())
            time.sleep(2e-4)

    def __enter__(self):
        self._start = self._peak = self.used()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        self.rise = max(self._peak, self.used()) - self._start


def rank_main(args) -> None:
    """One rank: median step seconds and peak resident MiB, gathered and written by rank 0."""
    import torch
    import torch.distributed as dist

    from densetrain.optim import build_optimizer, set_lr
    from densetrain.parallel import build_parallel_model, init_distributed
    from densetrain.train.step import forward_backward

    torch.set_num_threads(1)
    cfg = config(args.mode, args.microbatches, args.dp_shard)
    info = init_distributed("cpu", cfg.parallel)
    model, pipe = build_parallel_model(cfg, info)
    opt = build_optimizer(model, cfg)
    x = torch.randint(0, 4096, (args.microbatches, args.seq_len + 1), generator=torch.Generator().manual_seed(0))
    mbs = [(x[i:i + 1, :-1], x[i:i + 1, 1:], ["s"]) for i in range(args.microbatches)]
    got = []
    for step in range(args.steps + 2):  # the last step's memory sampled (its time not counted)
        dist.barrier()
        t0 = time.perf_counter()
        with HeapPeak() if step > args.steps else contextlib.nullcontext() as heap:
            forward_backward(pipe, mbs, args.dp_shard * args.microbatches * args.seq_len, info.grad_scale)
        set_lr(opt, 1e-4)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        got.append(time.perf_counter() - t0)
    mine = {"pp_rank": info.pp_rank, "step_s": statistics.median(got[1:-1]), "rise_mib": heap.rise / 2**20,
            "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # Linux: KiB
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if info.rank == 0:
        Path(args.out).write_text(json.dumps(every))
    dist.destroy_process_group()


def launch(args, mode: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, "WORLD_SIZE": str(2 * args.dp_shard), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        argv = [sys.executable, __file__, "--mode", mode, "--microbatches", str(args.microbatches), "--seq-len",
                str(args.seq_len), "--steps", str(args.steps), "--dp-shard", str(args.dp_shard), "--out", str(out)]
        procs = [subprocess.Popen([*argv, "--rank", str(r)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
                 for r in range(2 * args.dp_shard)]
        if any(p.wait() != 0 for p in procs):
            raise SystemExit("a rank failed (its error is above)")
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--microbatches", type=int, default=4, help="micro-batches of one row per rank and step")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dp-shard", type=int, default=2, help="FSDP2 shards per pipeline stage")
    ap.add_argument("--mode", default="", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank >= 0:
        return rank_main(args)

    from densetrain.parallel.mesh import Layout
    from densetrain.tools.plan.memory import layout_memory, model_counts, pipeline_ranks

    runs = {mode: launch(args, mode) for mode in ("last", "microbatch")}
    m = config("last", args.microbatches, args.dp_shard).model
    counts = model_counts(m)
    print(f"pp 2 x dp_shard {args.dp_shard}, 1f1b, {args.microbatches} micro-batches of 1 x {args.seq_len} tokens "
          f"per rank, d_model {m.d_model}, {m.n_layers} blocks, vocab {m.vocab_size}, fp32, gloo; median of "
          f"{args.steps} steps")
    print(f"{'rank':>4} {'pp':>3} {'step peak MiB: last':>20} {'microbatch':>11} {'saved':>7} {'plan saves':>11} "
          f"{'- shards':>9} {'RSS MiB: last':>14} {'microbatch':>11} {'step s: last':>13} {'microbatch':>11} "
          f"{'ratio':>6}")
    for r, (a, b) in enumerate(zip(runs["last"], runs["microbatch"])):
        lay = Layout(1, args.dp_shard, 1, 1, 2)
        plan = {mode: layout_memory(counts, m, args.seq_len, 1, lay, "none", mixed_precision=False,
                                    pipeline={"schedule": "1f1b", "microbatches": args.microbatches,
                                              "grad_sync": mode}, pp_rank=a["pp_rank"])["transient"]
                for mode in runs}
        saved = (plan["last"] - plan["microbatch"]) / 2**20
        shards = 4 * pipeline_ranks(counts, m, 2)[a["pp_rank"]]["params"] / args.dp_shard / 2**20
        print(f"{r:>4} {a['pp_rank']:>3} {a['rise_mib']:>20.1f} {b['rise_mib']:>11.1f} "
              f"{a['rise_mib'] - b['rise_mib']:>7.1f} {saved:>11.1f} {saved - shards:>9.1f} "
              f"{a['peak_mib']:>14.1f} {b['peak_mib']:>11.1f} {a['step_s']:>13.3f} {b['step_s']:>11.3f} "
              f"{b['step_s'] / a['step_s']:>6.2f}")


if __name__ == "__main__":
    main()
