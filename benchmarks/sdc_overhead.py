"""The cost of the silent-data-corruption checks per training step: the update-norm measurement
(``guard.update_every``: a copy of the parameters before ``optimizer.step()``, the difference and norms
after it) and the replica checksum (``guard.replica_every``: an integer sum over every parameter and
optimizer moment), against the step they watch, at a preset's shape.

The step is the real one (``forward_backward`` over the preset's micro-batches, clipping, AdamW) on
random tokens: the checks' cost does not depend on the data. Their calls are timed directly, inside
the same steps, rather than two runs against each other, so the share stays meaningful on a noisy
shared machine. The checksum's all-reduce is left out (one process); it moves ``8 x tensors x world``
bytes once per ``replica_every`` steps.

    .venv/bin/python benchmarks/sdc_overhead.py --preset tiny --steps 20
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from types import SimpleNamespace

import torch

from densetrain.config import load_config
from densetrain.model.init import build_model
from densetrain.optim import build_optimizer
from densetrain.parallel import autocast_for, clip_grad_norm
from densetrain.train.step import forward_backward
from densetrain.train.watch.replicas import ReplicaCheck, checksum
from densetrain.train.watch.updates import UpdateNorms
from densetrain.train.watchers import Verdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    cfg = load_config(args.preset)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(cfg.model, cfg.train.seed).to(device)
    optimizer = build_optimizer(model, cfg)
    autocast = autocast_for(cfg.train.dtype, device)
    B, T, micro = cfg.train.batch_size, cfg.train.seq_len, cfg.train.micro_batch_size
    gen = torch.Generator().manual_seed(0)
    log = SimpleNamespace(log=lambda *a, **k: None, event=lambda *a, **k: None)
    run = SimpleNamespace(model=model, optimizer=optimizer, state=SimpleNamespace(step=0), lr_scale=1.0, log=log)
    updates = UpdateNorms(dataclasses.replace(cfg.guard, update_every=1), 1)  # measured at every step here
    spent = {"update": 0.0}

    def timed(fn):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent["update"] += time.perf_counter() - t0
        return call

    updates._pre, updates._post, updates.after_step = timed(updates._pre), timed(updates._post), \
        timed(updates.after_step)
    replicas = ReplicaCheck.__new__(ReplicaCheck)  # only its tensor list: no process group here
    step_s, check_s, opt_s = [], [], []
    for i in range(args.steps + 2):
        tokens = torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=gen).to(device)
        mbs = [(tokens[j:j + micro, :-1], tokens[j:j + micro, 1:], ["x"] * micro) for j in range(0, B, micro)]
        spent["update"] = 0.0
        t0 = time.perf_counter()
        updates.before_step(run)
        forward_backward(model, mbs, B * T, 1, 0.0, autocast)
        clip_grad_norm(model, cfg.optim.grad_clip)
        t_opt = time.perf_counter()
        optimizer.step()
        t_opt = time.perf_counter() - t_opt
        optimizer.zero_grad(set_to_none=True)
        updates.after_step(run, SimpleNamespace(index=i, lr=cfg.optim.peak_lr), Verdict.APPLY)
        if device.type == "cuda":
            torch.cuda.synchronize()
        total = time.perf_counter() - t0
        t1 = time.perf_counter()
        sums = torch.stack([checksum(t) for t in replicas._tensors(run)[1]]).cpu()
        check = time.perf_counter() - t1
        run.state.step += 1
        if i >= 2:  # the first steps warm up allocators and kernels
            step_s.append(total - spent["update"])
            check_s.append(check)
            opt_s.append(t_opt - spent["update"])
            spent.setdefault("updates", []).append(spent["update"])
    step = sorted(step_s)[len(step_s) // 2]
    upd = sorted(spent["updates"])[len(step_s) // 2]
    chk = sorted(check_s)[len(check_s) // 2]
    every = cfg.guard.replica_every or 1
    print(f"preset {args.preset}: {model.num_params() / 1e6:.2f}M parameters, batch {B} x {T}, {device.type}, "
          f"{torch.get_num_threads()} threads; medians over {len(step_s)} steps ({len(sums)} tensors checksummed)")
    print(f"  step (forward, backward, clip, AdamW)  {step * 1e3:9.2f} ms")
    print(f"  of which AdamW's step                  {sorted(opt_s)[len(opt_s) // 2] * 1e3:9.2f} ms")
    ue = cfg.guard.update_every or 1
    print(f"  update norms (one measured step)       {upd * 1e3:9.2f} ms  {upd / step:7.3%} of a step; "
          f"every {ue} steps: {upd / ue / step:.3%}")
    print(f"  replica checksum (one check)           {chk * 1e3:9.2f} ms  {chk / step:7.3%} of a step; "
          f"every {every} steps: {chk / every / step:.4%}")
    print(f"  both, per step (defaults)              {(upd / ue + chk / every) / step:7.3%}")


if __name__ == "__main__":
    main()
