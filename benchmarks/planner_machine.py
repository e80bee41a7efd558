"""Does the cost model predict densetrain's own steps on this machine? (issue 41 item 6, one process)

Per round: this machine's profile measured as ``densetrain doctor --profile`` measures it (the matmul rate and
the copy bandwidth of :mod:`densetrain.health`, efficiencies 1: reached rates), then densetrain's step timed on
the same shape (its model, cross-entropy and AdamW, fp32, random tokens: no data loader), side by side with
:func:`densetrain.cost.step_time`'s prediction; the ratio per round and its median.

    python benchmarks/planner_machine.py --shape gpt2-124m --seq-len 256 --rounds 3

On a shared machine both measurements move with the other processes' load; measuring the profile right
before each round's steps keeps them under the same load. Not modelled: eager PyTorch's per-operator cost
(tens of µs on a CPU), which is most of a step of the tiny preset.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from densetrain.config import load_config  # noqa: E402
from densetrain.cost import Parallel, measured_hardware, step_time  # noqa: E402
from densetrain.health import matmul_rate, memory_bandwidth  # noqa: E402
from densetrain.loss import token_losses  # noqa: E402
from densetrain.model.init import build_model  # noqa: E402
from densetrain.optim import build_optimizer  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="gpt2-124m", help="preset whose model shape is timed (default %(default)s)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro", type=int, default=2, help="sequences per step")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round (after one warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = load_config(a.shape)
    m, cpu = cfg.model, torch.device("cpu")
    model = build_model(m, 0)
    opt = build_optimizer(model, cfg)
    x = torch.randint(0, m.vocab_size, (a.micro, a.seq_len + 1))

    def one_step() -> float:
        t0 = time.perf_counter()
        token_losses(model(x[:, :-1]), x[:, 1:]).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    one_step()  # warm-up: allocations, AdamW state
    ratios = []
    print(f"{a.shape}: seq_len {a.seq_len}, {a.micro} sequences a step, fp32, {a.threads} threads")
    for r in range(a.rounds):
        hw = measured_hardware(matmul_rate(cpu, torch.float32, 0.2, 3), memory_bandwidth(cpu, 64, 0.2, 3), None, 1,
                               16, "this machine")
        measured = statistics.median(one_step() for _ in range(a.steps))
        pred = step_time(m, Parallel(), hw, a.seq_len, a.micro, a.micro, "none", "fp32")
        ratios.append(pred["step_s"] / measured)
        print(f"  round {r}: matmul {hw.peak_bf16_flops / 1e9:.1f} GFLOP/s, copy {hw.hbm_bytes_per_s / 1e9:.1f} "
              f"GB/s; measured {measured:.3f} s, predicted {pred['step_s']:.3f} s, predicted/measured "
              f"{ratios[-1]:.2f}")
    print(f"planner_machine: {a.shape} predicted/measured median {statistics.median(ratios):.2f} over "
          f"{a.rounds} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
