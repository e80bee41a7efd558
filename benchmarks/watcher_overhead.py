"""The cost of the watchers (guard, throughput watchdog, data probe) per training step, measured inside
one process on the prepared shards of a preset.

Runs the real loop's pieces (``setup``, ``compute_step``, ``decide``, ``commit``) for ``--steps`` steps
and times every watcher call (``before_step``, ``on_batch``, ``judge``, ``after_step``) separately from
the step itself, then prints the watchers' share of the step time. Timing the calls directly, rather
than two whole runs against each other, keeps the figure meaningful on a noisy shared machine.

    .venv/bin/python benchmarks/watcher_overhead.py --preset tiny --steps 60
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict

from densetrain.config import load_config
from densetrain.optim import set_lr
from densetrain.schedule import lr_for, stage_at
from densetrain.train.loop import commit
from densetrain.train.setup import setup
from densetrain.train.step import compute_step
from densetrain.train.watchers import decide


class Timed:
    """Wraps a watcher; accumulates seconds per method."""

    def __init__(self, inner, totals):
        self.inner, self.totals, self.name = inner, totals, inner.name

    def __getattr__(self, attr):
        fn = getattr(self.inner, attr)
        if not callable(fn):
            return fn

        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.totals[f"{self.name}.{attr}"] += time.perf_counter() - t0
        return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("overrides", nargs="*", help="--section.key=value")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ov = [("train.run_dir", tmp), ("eval.every", 0), ("eval.tasks", ""), ("eval.final_tasks", ""),
              ("checkpoint.every", 0), ("logging.tensorboard", False), ("watchdog.every", 10), ("probe.every", 20)]
        cfg = load_config(args.preset, overrides=ov)
        cfg.train.steps = max(cfg.train.steps, args.steps)
        run = setup(cfg)
        totals: dict[str, float] = defaultdict(float)
        run.watchers = [Timed(w, totals) for w in run.watchers]
        step_s = 0.0
        for i in range(args.steps):
            t0 = time.perf_counter()
            st = stage_at(run.state.step, run.stages)
            for w in run.watchers:
                w.before_step(run)
            set_lr(run.optimizer, lr_for(run.state.step, cfg, run.stages))
            result = compute_step(run, st, 1e-3)
            verdict = decide(run.watchers, run, result)
            commit(run, result, verdict)
            for w in run.watchers:
                w.after_step(run, result, verdict)
            if i >= 3:  # the first steps compile kernels
                step_s += time.perf_counter() - t0
        for w in run.watchers:
            w.close()
        run.log.close()
    n = args.steps - 3
    watch = sum(totals.values())
    print(f"{args.preset}: {n} steps, {step_s / n * 1e3:.1f} ms/step; watchers {watch / args.steps * 1e3:.3f} ms/step "
          f"= {watch / args.steps / (step_s / n) * 100:.2f}% of a step")
    for k, v in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<28} {v / args.steps * 1e3:8.3f} ms/step")


if __name__ == "__main__":
    main()
