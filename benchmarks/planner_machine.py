"""Does the cost model predict densetrain's own steps on this machine? (issue 41 item 6)

For each shape (``--shapes``) and layout (``--layouts``: ``single`` one process; ``ddp``, ``fsdp``, ``tp``,
``pp`` two gloo ranks), in rounds: the worker processes measure this machine's profile as ``densetrain doctor
--profile`` does (matmul rate and copy bandwidth of :mod:`densetrain.health`, the all-reduce bus bandwidth and
one-element latency over the two ranks, :func:`densetrain.tools.doctor.op_overhead`, the host's share:
:func:`densetrain.tools.doctor.host_figures`), then time densetrain's real step on that layout
(:func:`densetrain.parallel.parallelize.build_parallel_model`, :func:`densetrain.train.step.forward_backward`
and AdamW; fp32, random tokens, no data loader; glibc keeping freed memory, as training sets it on a CPU), and
rank 0 prints :func:`densetrain.cost.step_time`'s prediction from the profile beside the measured step:
predicted / measured per run. Prediction and measurement run in the same process one right after the other,
so both see the same load; the load average and the processes' CPU share (:func:`densetrain.health.cpu_got`)
are printed. Measured is the fastest of the timed steps (at least ``--steps``, and ``--min-seconds`` of CPU), as
the profile's rates are the fastest of their tries (the median beside it). The closing table and line judge each
row on its quietest round (the largest CPU share), in CPU seconds (what 2 ranks on 2 shared cores leave
comparable; wall seconds beside them): ``planner_machine: N of 10 within 25% (worst X)``.

    python benchmarks/planner_machine.py                                # tiny and gpt2-124m, every layout
    python benchmarks/planner_machine.py --shapes tiny --layouts single,ddp --rounds 3

Batch: ``--micro`` sequences a rank (``single``, ``ddp``, ``fsdp``: one micro-batch a rank; ``tp``: the
``--micro`` sequences shared by the two ranks; ``pp``: ``--micro`` micro-batches of one sequence, 1F1B).
Each process runs ``--threads`` threads (2 ranks on 2 cores: 1 each).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from densetrain.config import load_config  # noqa: E402
from densetrain.cost import Parallel, measured_hardware, step_time  # noqa: E402

WALL = time.perf_counter


def cpu_seconds(fn, calls: int) -> float:
    """CPU seconds of this process per call of ``fn`` (the best of 3 tries of ``calls`` calls)."""
    best = float("inf")
    for _ in range(3):
        c0 = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - c0) / calls)
    return max(best, 1e-9)


LAYOUTS = {  # name: (ranks, overrides, Parallel)
    "single": (1, [], Parallel()),
    "ddp": (2, [("parallel.dp_replicate", 2), ("parallel.dp_shard", 1)], Parallel(dp_replicate=2)),
    "fsdp": (2, [("parallel.dp_shard", 2)], Parallel(dp_shard=2)),
    "tp": (2, [("parallel.dp_shard", 1), ("parallel.tp", 2)], Parallel(tp=2)),
    # tied embeddings cannot split over stages: pp runs the shape untied (gpt2-124m: one more 38.6M head)
    "pp": (2, [("parallel.dp_shard", 1), ("parallel.pp", 2), ("parallel.pp_schedule", "1f1b"),
               ("model.tie_embeddings", False)], Parallel(pp=2)),
}


def worker(a) -> None:
    """One rank: profile, then the timed steps; rank 0 prints one JSON line."""
    import torch.distributed as dist

    from densetrain.health import COLLECTIVE_MIB, collective_figures, cpu_got, cpu_sample, memory_bandwidth
    from densetrain.optim import build_optimizer
    from densetrain.parallel import init_distributed
    from densetrain.parallel.parallelize import build_parallel_model
    from densetrain.tools.doctor import attention_rate, host_figures, loss_rate, op_overhead, training_gemm_rate
    from densetrain.train.step import forward_backward, keep_freed_memory

    torch.set_num_threads(a.threads)
    keep_freed_memory()  # as densetrain's training sets it on a CPU (train.keep_freed_memory, default true)
    ranks, overrides, par = LAYOUTS[a.layout]
    cfg = load_config(a.shape, overrides=[("train.dtype", "fp32"), ("parallel.dp_replicate", 1),
                                          ("train.seq_len", a.seq_len), ("eval.tasks", ""), ("eval.samples", 0),
                                          ("eval.final_tasks", ""), *overrides])
    info = init_distributed("cpu", cfg.parallel)
    model, step_model = build_parallel_model(cfg, info)
    opt = build_optimizer(model, cfg)
    m, cpu = cfg.model, torch.device("cpu")
    dp = par.dp_replicate * par.dp_shard
    if a.layout == "pp":
        micro, n_micro, batch = 1, a.micro, a.micro
    else:
        micro, n_micro, batch = a.micro, 1, a.micro * dp
    g = torch.Generator().manual_seed(1 + info.rank // (ranks // dp if dp > 1 else ranks))
    xs = [torch.randint(0, m.vocab_size, (micro, a.seq_len + 1), generator=g) for _ in range(n_micro)]
    mbs = [(x[:, :-1], x[:, 1:], ["web"] * micro) for x in xs]

    def one_step() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        forward_backward(step_model, mbs, batch * a.seq_len, dp)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, time.process_time() - c0

    def profile(clock):
        figures = collective_figures(dist.group.WORLD, "world", cpu, 2) if ranks > 1 and clock is WALL else {}
        if ranks > 1 and clock is not WALL:  # the all-reduce's CPU seconds (a rank waiting for its peer is idle)
            big, tiny = torch.ones(COLLECTIVE_MIB * 2**20 // 4), torch.ones(1)
            figures = {"world/all_reduce": 2 * (ranks - 1) / ranks * big.numel() * 4
                       / cpu_seconds(lambda: dist.all_reduce(big), 4),
                       "world/all_reduce_lat": cpu_seconds(lambda: dist.all_reduce(tiny), 50)}
        return measured_hardware(training_gemm_rate(cpu, 0.1, 3, clock),
                                 memory_bandwidth(cpu, 64, 0.1, 3, clock)[0],
                                 figures.get("world/all_reduce"), ranks, 16, "this machine",
                                 op_overhead(cpu, clock=clock),
                                 figures["world/all_reduce_lat"] / 2 if figures else None,
                                 loss_rate(cpu, 0.1, 3, clock), attention_rate(cpu, 0.1, 3, clock),
                                 host_figures(info, clock))

    one_step()  # warm-up: allocations, AdamW state
    # timed steps: at least --steps and at least --min-seconds of them (the same count on every rank: their
    # collectives match). The fastest of 3 is not the undisturbed step on a shared machine: at load 11 the
    # fastest of the first 3 tiny TP steps was 0-37% above the fastest of 12 (benchmarks/RESULTS.md, issue 41
    # item 6, session 17), while the profile's rates are each the fastest of tries of ~0.1 s
    # counted in the step's CPU seconds, its own work: a wall count shrinks as the load grows (3 steps at load 13)
    steps = torch.tensor([max(a.steps, math.ceil(a.min_seconds / max(one_step()[1], 1e-6)))])
    if ranks > 1:
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    out = {}
    for kind, clock in (("wall", WALL), ("cpu", time.process_time)):
        hw = profile(clock)
        c0 = cpu_sample()
        times = [one_step()[kind == "cpu"] for _ in range(int(steps))]
        share = cpu_got(c0, cpu_sample()) or 1.0  # of the CPU time this process asked for, what it got
        if ranks > 1:  # wall: the slowest rank's steps (every rank waits for it); CPU: the ranks' mean
            t = torch.tensor(times)
            dist.all_reduce(t, op=dist.ReduceOp.MAX if kind == "wall" else dist.ReduceOp.SUM)
            times = (t / (1 if kind == "wall" else ranks)).tolist()
            got = torch.tensor([share])
            dist.all_reduce(got, op=dist.ReduceOp.MIN)
            share = got.item()
        pred = step_time(m, par, hw, a.seq_len, batch, micro, "none", "fp32")
        # in CPU seconds the bubble is idle time: a rank waiting for its peer uses no CPU
        predicted = pred["step_s"] - (pred["parts"]["bubble"] if kind == "cpu" else 0.0)
        # the fastest step, as the profile's rates are the fastest of their tries: both the cost undisturbed by
        # the other processes on the machine (the median is printed beside it)
        out[kind] = {"measured": min(times), "median": statistics.median(times), "predicted": predicted,
                     "parts": pred["parts"], "share": share, "load": os.getloadavg()[0],
                     "matmul": hw.peak_bf16_flops, "copy": hw.hbm_bytes_per_s, "op_overhead": hw.op_overhead_s,
                     "link": hw.nvlink_bytes_per_s, "latency": hw.latency_intra_s,
                     "dtensor": hw.dtensor_op_s, "fsdp": hw.fsdp_group_s, "loss_parallel": hw.loss_parallel_logit_s,
                     "gemm_call": hw.gemm_call_s, "attention_call": hw.attention_call_s,
                     "steps": len(times)}
    if info.rank == 0:
        print(json.dumps(out))
    if ranks > 1:
        dist.destroy_process_group()


def launch(a, shape: str, layout: str) -> dict:
    """Run the worker on ``layout``'s ranks (as torchrun would start them); rank 0's JSON line."""
    ranks = LAYOUTS[layout][0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = a.threads if ranks == 1 else max(1, a.threads // ranks)
    env = {**os.environ, "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE",  # densetrain's default (no spin)
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    argv = [sys.executable, __file__, "--worker", "--shape", shape, "--layout", layout, "--seq-len",
            str(a.seq_len), "--micro", str(a.micro), "--steps", str(a.steps), "--threads", str(threads),
            "--min-seconds", str(a.min_seconds)]
    procs = [subprocess.Popen(argv, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(ranks)]
    outs = [p.communicate(timeout=900) for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{shape} {layout}: a rank failed:\n" + "\n".join(e[-2000:] for _, e in outs))
    return json.loads(outs[0][0].strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="tiny,gpt2-124m")
    ap.add_argument("--layouts", default="single,ddp,fsdp,tp,pp")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro", type=int, default=2, help="sequences a rank (see the module docstring)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run, at least (after two warm-ups)")
    ap.add_argument("--min-seconds", type=float, default=2.0,
                    help="timed steps per run, at least these CPU seconds of them")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--layout", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    shapes, layouts = a.shapes.split(","), a.layouts.split(",")
    print(f"seq_len {a.seq_len}, {a.micro} sequences a rank, fp32, {a.threads} threads in all; load average "
          f"{os.getloadavg()[0]:.1f} at the start")
    runs = {(s, lay): [] for s in shapes for lay in layouts}
    for r in range(a.rounds):
        for s in shapes:
            for lay in layouts:  # interleaved: every layout once per round
                res = launch(a, s, lay)
                runs[(s, lay)].append(res)
                for k, v in res.items():
                    parts = ", ".join(f"{n} {x * 1e3:.0f}" for n, x in v["parts"].items() if x * 1e3 >= 0.5)
                    print(f"round {r} {s:<9} {lay:<6} {k:<4} measured {v['measured'] * 1e3:6.0f} ms (median "
                          f"{v['median'] * 1e3:.0f} of {v['steps']})  predicted {v['predicted'] * 1e3:6.0f} ms  ratio "
                          f"{v['predicted'] / v['measured']:.2f}  CPU share {v['share']:.2f} (matmul "
                          f"{v['matmul'] / 1e9:.0f} GFLOP/s, copy {v['copy'] / 1e9:.1f} GB/s, op "
                          f"{v['op_overhead'] * 1e6:.1f} us, DTensor {v['dtensor'] * 1e6:.0f} us, FSDP group "
                          f"{v['fsdp'] * 1e6:.0f} us, loss-parallel {v['loss_parallel'] * 1e9:.1f} ns a logit, "
                          f"GEMM call {v['gemm_call'] * 1e6:.0f} us, attention call "
                          f"{v['attention_call'] * 1e6:.0f} us, link {v['link'] / 1e9:.2f} GB/s, latency "
                          f"{v['latency'] * 1e6:.0f} us; ms: {parts}) load {v['load']:.1f}", flush=True)
    # each row judged on its quietest round: the one whose processes got the largest share of the CPU they
    # asked for while their CPU-timed steps ran (densetrain.health.cpu_got)
    print("| shape | layout | CPU ms measured / predicted | ratio | wall ms measured / predicted | ratio | "
          "CPU share | load |")
    print("|---|---|---|---|---|---|---|---|")
    within, worst, wall_within = 0, 0.0, 0
    for (s, lay), rs in runs.items():
        q = max(rs, key=lambda res: res["cpu"]["share"])
        c, w = q["cpu"], q["wall"]
        rc, rw = c["predicted"] / c["measured"], w["predicted"] / w["measured"]
        within += abs(rc - 1) <= 0.25
        wall_within += abs(rw - 1) <= 0.25
        worst = max(worst, abs(rc - 1))
        print(f"| {s} | {lay} | {c['measured'] * 1e3:,.0f} / {c['predicted'] * 1e3:,.0f} | {rc:.2f} | "
              f"{w['measured'] * 1e3:,.0f} / {w['predicted'] * 1e3:,.0f} | {rw:.2f} | {c['share']:.2f} | "
              f"{c['load']:.1f} |")
    n = len(runs)
    print(f"planner_machine: wall seconds {wall_within} of {n} within 25%; load average {os.getloadavg()[0]:.1f} "
          "at the end")
    print(f"planner_machine: {within} of {n} within 25% (worst {worst:.0%}; CPU seconds, quietest of {a.rounds} "
          "rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
