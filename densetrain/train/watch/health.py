"""The health watcher: hardware health checks (:mod:`densetrain.health`) while training, at start-up, every
``health.every`` steps and after each throughput drop the watchdog reports, so that "rank 1 is slow in
forward" is followed by "rank 1: memory bandwidth 0.4x the median" (the seed's post-mortem 7.2).

Every rank decides the same: the step is the same everywhere and the watchdog's verdicts come from a table
every rank holds. Each check writes one ``health`` record per rank to metrics.jsonl and one ``health`` event
per outlier; its time is outside the watchdog's step times (it runs after the watchdog's ``after_step``).
The run's first check is kept in ``RUN_DIR/health_first.json`` (not in the checkpoint, whose contents stay
deterministic), so that a restarted or resumed run still compares each rank with its first measurement.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from densetrain.config.recovery import HealthConfig
from densetrain.fileio import atomic_write_json, read_json
from densetrain.health import Row, check
from densetrain.train.watchers import Verdict, Watcher


class HealthWatch(Watcher):
    """Runs :func:`densetrain.health.check` when due (module docstring); keeps the first check's rows."""

    name = "health"

    def __init__(self, cfg: HealthConfig, watchdog=None):
        self.cfg, self.watchdog = cfg, watchdog
        self.first: list[Row] | None = None
        self.started = False
        self.seen = 0  # watchdog reports already followed by a check

    def before_step(self, run) -> None:
        if not self.started:
            self.started = True
            self.check(run, "start-up")

    def after_step(self, run, result, verdict: Verdict) -> None:
        reports = self.watchdog.reports if self.watchdog is not None else 0
        if reports > self.seen:
            self.seen = reports
            self.check(run, "after the watchdog's throughput drop")
        elif self.cfg.every and run.state.step % self.cfg.every == 0:
            self.check(run, f"every {self.cfg.every} steps")

    def check(self, run, why: str) -> list[dict]:
        """Measure, gather, judge; log the records and the outliers' events. Returns the outliers."""
        path = run.run_dir / "health_first.json"
        if self.first is None and path.exists():  # a restart: the run's first check, from its first start
            try:
                self.first = [Row(**r) for r in read_json(path)]
            except (OSError, ValueError, TypeError):
                self.first = None  # measured again below
        t0 = time.perf_counter()
        rows, outliers = check(run.info.device, torch.bfloat16 if run.autocast else torch.float32, run.info.mesh,
                               self.cfg, self.first)
        seconds = time.perf_counter() - t0
        if self.first is None:
            self.first = rows
            if run.info.is_main:
                atomic_write_json(path, [dataclasses.asdict(r) for r in rows])
        step = run.state.step
        for r in rows:
            run.log.log(step, {"rank": r.rank, "host": r.host, "why": why, "seconds": seconds,
                               **{f"health/{k}": v for k, v in r.figures.items()}}, kind="health")
        for o in outliers:
            run.log.event(step, f"health check ({why}): {o['text']}", kind="health", action="report",
                          values={k: v for k, v in o.items() if k != "text"})
        return outliers
