"""The cost of the stop check an in-loop evaluation makes before each forward batch (issue 36.3), against
the batch itself, on ``--world`` gloo ranks of one machine (or one process).

Each rank builds the preset's model and times, side by side, ``--calls`` evaluation forward batches of the
first stage's shape (``micro_batch_size`` x ``seq_len``, no grad) and ``--calls`` stop checks
(:meth:`densetrain.train.preempt.StopRequest.asked`: one MAX all-reduce of one number under a process group,
a plain read in one process). Timing the two directly keeps the ratio meaningful on a noisy shared machine.

    .venv/bin/python benchmarks/eval_stop_check.py --preset tiny --world 2
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from densetrain.config import load_config
from densetrain.model.init import build_model
from densetrain.schedule import resolve_stages
from densetrain.train.preempt import StopRequest


def _rank(rank: int, world: int, port: int, preset: str, calls: int) -> None:
    torch.set_num_threads(1)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = load_config(preset)
    st = resolve_stages(cfg)[0]
    model = build_model(cfg.model, cfg.train.seed).eval()
    x = torch.randint(0, cfg.model.vocab_size, (st.micro_batch_size, st.seq_len))
    stop = StopRequest(torch.device("cpu"))
    with torch.no_grad():
        model(x)  # warm-up
        t0 = time.perf_counter()
        for _ in range(calls):
            model(x)
        forward = (time.perf_counter() - t0) / calls
    if world > 1:  # else the first check would time the other rank's remaining forwards
        dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        stop.asked()
    check = (time.perf_counter() - t0) / calls
    stop.restore()
    if rank == 0:
        print(f"{preset}: {world} rank(s), batch {st.micro_batch_size}x{st.seq_len}: forward {forward * 1e3:.2f} ms, "
              f"stop check {check * 1e6:.0f} us = {check / forward:.2%} of a batch")
    if world > 1:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if args.world == 1:
        _rank(0, 1, port, args.preset, args.calls)
    else:
        mp.spawn(_rank, args=(args.world, port, args.preset, args.calls), nprocs=args.world)


if __name__ == "__main__":
    main()
