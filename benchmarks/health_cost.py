"""What a hardware health check (densetrain/health.py) costs: its duration, and its share of the training time
at ``health.every`` (default 1000 steps), against a step of the preset's model shape measured side by side in
the same process (forward + backward + AdamW of ``batch_size / micro_batch_size`` micro-batches of random
tokens at the first stage's ``seq_len``; no data needed).

    .venv/bin/python benchmarks/health_cost.py --preset tiny
    .venv/bin/torchrun --nproc_per_node=2 benchmarks/health_cost.py --preset tiny   # with the collectives

Prints medians over ``--repeats`` (checks) and ``--steps`` (steps), and the ratios. Under torchrun every rank
measures (gloo on CPU) and rank 0 prints.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from densetrain.config import load_config
from densetrain.health import check
from densetrain.model.llama import Transformer
from densetrain.parallel import init_distributed


def step_seconds(cfg, steps: int) -> float:
    """Median seconds of one optimizer step of ``cfg.model`` in fp32 (see the module docstring)."""
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    accum = cfg.train.batch_size // cfg.train.micro_batch_size
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.train.seq_len + 1))
    times = []
    for i in range(steps + 2):  # two warm-up steps
        t0 = time.perf_counter()
        for _ in range(accum):
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.preset)
    info = init_distributed("cpu", cfg.parallel)
    step_s = step_seconds(cfg, args.steps)
    checks = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        rows, _ = check(info.device, torch.float32, info.mesh, cfg.health)
        checks.append(time.perf_counter() - t0)
    check_s = statistics.median(checks)
    every = cfg.health.every
    if info.is_main:
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                   "?")
        print(f"CPU: {cpu}, {os.cpu_count()} cores; {info.world_size} rank(s), {args.threads} thread(s) each; "
              f"preset {args.preset}, fp32")
        print(f"health check: median {check_s:.3f} s of {args.repeats} (min {min(checks):.3f}, max {max(checks):.3f}); "
              f"figures: {', '.join(rows[0].figures)}")
        print(f"training step: median {step_s * 1e3:.1f} ms of {args.steps}")
        print(f"check / step = {check_s / step_s:.1f}x; at health.every = {every}: "
              f"{check_s / (every * step_s):.3%} of the training time")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
