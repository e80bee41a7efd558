"""The pipeline bubble measured in a pp 2 gloo run on CPU, beside the planner's ``(pp - 1) / (m + pp - 1)``.

    .venv/bin/python benchmarks/pp_bubble.py                      # 1f1b, m = 2 4 8 16
    .venv/bin/python benchmarks/pp_bubble.py --schedule gpipe --microbatches 2 4 8 --steps 6

Two processes (gloo, one thread each) run a pp 2 model (:mod:`densetrain.parallel.pipeline`, fp32, 4 blocks:
the split gives each stage 3 layers) through full training steps of ``m`` micro-batches of the same size,
for several ``m``; each step's wall time is the median over ``--steps`` steps (the first, which builds the
stages, not counted). A step of ``m`` micro-batches takes ``T(m) = a m + b``: every micro-batch adds one
stage's forward and backward (``a``) and the fill and drain add ``(pp - 1) a`` plus fixed costs (``b``).
The slope ``a`` fitted over the ``m`` values (least squares) is the busy time per micro-batch, so the idle
fraction of a step is ``1 - a m / T(m)`` (point-to-point waits and the step's fixed costs count as idle).
Beside it, each rank's own idle fraction ``1 - c_r / T(m)`` from the CPU seconds ``c_r`` its main thread
spent in the step (gloo waits in other threads or blocked: not counted). Side by side, the same
micro-batch through the whole model in one process (``t1``, the baseline): a balanced split's stage takes
``t1 / pp``, the ideal ``a``.

The numbers are wall times on shared cores: use an otherwise idle machine with at least ``pp`` cores.
Measured results are in docs/distributed.md, "Pipeline parallelism".
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = [("model.vocab_size", 512), ("model.d_model", 256), ("model.n_layers", 4), ("model.n_heads", 4),
         ("model.n_kv_heads", 2), ("model.d_ff", 768), ("model.tie_embeddings", False), ("train.device", "cpu"),
         ("train.dtype", "fp32"), ("eval.tasks", ""), ("eval.final_tasks", ""), ("eval.samples", 0),
         ("model.document_mask", False), ("stages", [{"name": "main"}])]


def batches(m: int, micro: int, seq_len: int):
    import torch

    x = torch.randint(0, 512, (m * micro, seq_len + 1), generator=torch.Generator().manual_seed(m))
    return [(x[i:i + micro, :-1], x[i:i + micro, 1:], ["s"] * micro) for i in range(0, m * micro, micro)]


def rank_main(args) -> None:
    """One pipeline rank: the median step time per micro-batch count, written by rank 0."""
    import torch
    import torch.distributed as dist

    from densetrain.config import load_config
    from densetrain.parallel import build_parallel_model, init_distributed
    from densetrain.train.step import forward_backward

    torch.set_num_threads(1)
    times = {}
    for m in args.microbatches:
        cfg = load_config(preset="tiny", overrides=[*MODEL, ("parallel.pp", 2), ("parallel.dp_replicate", 1),
                                                    ("parallel.pp_schedule", args.schedule),
                                                    ("parallel.pp_microbatches", m)])
        info = init_distributed("cpu", cfg.parallel)
        model, step_model = build_parallel_model(cfg, info)
        mbs = batches(m, args.micro, args.seq_len)
        got, cpu = [], []
        for _ in range(args.steps + 1):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            forward_backward(step_model, mbs, m * args.micro * args.seq_len)
            c1 = time.thread_time()
            dist.barrier()  # the step ends when the last rank's backward does
            got.append(time.perf_counter() - t0)
            cpu.append(c1 - c0)
            model.zero_grad(set_to_none=True)
        both = [None, None]
        dist.all_gather_object(both, statistics.median(cpu[1:]))
        times[m] = [statistics.median(got[1:]), both]
    if info.rank == 0:
        Path(args.out).write_text(json.dumps(times))
    dist.destroy_process_group()


def one_process(args) -> float:
    """Median seconds of one micro-batch's forward and backward through the whole model in one process."""
    import torch

    from densetrain.config import load_config
    from densetrain.model.init import build_model
    from densetrain.train.step import forward_backward

    torch.set_num_threads(1)
    cfg = load_config(preset="tiny", overrides=MODEL)
    model = build_model(cfg.model, 0, "cpu")
    mbs = batches(1, args.micro, args.seq_len)
    got = []
    for _ in range(args.steps + 1):
        t0 = time.perf_counter()
        forward_backward(model, mbs, args.micro * args.seq_len)
        got.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return statistics.median(got[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--micro", type=int, default=4, help="rows per micro-batch")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank >= 0:
        return rank_main(args)

    import numpy as np

    from densetrain.parallel.pipeline import bubble_fraction

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        argv = [sys.executable, __file__, "--schedule", args.schedule, "--micro", str(args.micro), "--seq-len",
                str(args.seq_len), "--steps", str(args.steps), "--out", str(out), "--microbatches",
                *map(str, args.microbatches)]
        procs = [subprocess.Popen([*argv, "--rank", str(r)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
                 for r in range(2)]
        if any(p.wait() != 0 for p in procs):
            raise SystemExit("a pipeline rank failed (its error is above)")
        times = {int(k): v for k, v in json.loads(out.read_text()).items()}
    t1 = one_process(args)
    ms = sorted(times)
    a, b = np.polyfit(ms, [times[m][0] for m in ms], 1)
    print(f"pp 2 {args.schedule}, micro-batches of {args.micro} x {args.seq_len} tokens, d_model 256, 4 blocks, "
          f"fp32, gloo; median of {args.steps} steps")
    print(f"fit T(m) = {a * 1e3:.1f} ms * m + {b * 1e3:.1f} ms; one process, whole model: {t1 * 1e3:.1f} ms per "
          f"micro-batch (ideal stage time t1/2 = {t1 * 5e2:.1f} ms, fitted a / (t1/2) = {a / (t1 / 2):.2f})")
    print(f"{'m':>4} {'step ms':>9} {'idle (fit)':>11} {'idle rank 0, 1 (CPU time)':>26} {'planner bubble':>15} "
          f"{'fit/planner':>12}")
    for m in ms:
        wall, cpu = times[m]
        idle, plan = 1 - a * m / wall, bubble_fraction(2, m)
        ranks = ", ".join(f"{1 - c / wall:.1%}" for c in cpu)
        print(f"{m:>4} {wall * 1e3:>9.1f} {idle:>11.1%} {ranks:>26} {plan:>15.1%} {idle / plan:>12.2f}")


if __name__ == "__main__":
    main()
