"""Health false alarms on a busy CPU (issue 44): one rank's first health check at the machine's usual load, then
``--checks`` checks while ``--spinners`` Python spinners keep the cores busy. Counts the checks with a raw outlier
(a figure below ``health.min_ratio`` of the rank's first measurement: each was a hardware alarm before issue 44,
whose rule had no CPU share and no second measurement, so this count is a lower bound of the old alarms) and
the checks with a hardware alarm now (:func:`densetrain.health.judge`'s cause 'hardware').

    python benchmarks/health_under_load.py --checks 8 --spinners 4
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import torch

from densetrain.config import HealthConfig
from densetrain.health import check, judge


def _spin() -> None:
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checks", type=int, default=8)
    ap.add_argument("--spinners", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg, cpu = HealthConfig(), torch.device("cpu")
    first, _ = check(cpu, torch.float32, None, cfg)
    print(f"first: {first[0].figures} {first[0].context}")
    hogs = [mp.Process(target=_spin, daemon=True) for _ in range(args.spinners)]
    for h in hogs:
        h.start()
    time.sleep(3)  # the spinners running
    raw_alarms = alarms = 0
    try:
        for i in range(args.checks):
            rows, outliers = check(cpu, torch.float32, None, cfg, first)
            raw = judge(rows, first, cfg)
            raw_alarms += bool(raw)
            alarms += any(o["cause"] == "hardware" for o in outliers)
            print(i, {k: f"{v:.3g}" for k, v in rows[0].figures.items()},
                  {k: round(v, 2) for k, v in rows[0].context.items()},
                  [(o["figure"], round(o["ratio"], 2), round(o["per_cpu_ratio"], 2), o["cause"]) for o in outliers])
    finally:
        for h in hogs:
            h.terminate()
    print(f"checks with a raw outlier (a hardware alarm before issue 44): {raw_alarms}/{args.checks}; "
          f"hardware alarms now: {alarms}/{args.checks}")


if __name__ == "__main__":
    main()
