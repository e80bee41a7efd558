"""The health watcher: hardware health checks (:mod:`densetrain.health`) while training, at start-up, every
``health.every`` steps and after each throughput drop the watchdog reports, so that "rank 1 is slow in
forward" is followed by "rank 1: memory bandwidth 0.4x the median" (the seed's post-mortem 7.2).

Every rank decides the same: the step is the same everywhere and the watchdog's verdicts come from a table
every rank holds. Each check writes one ``health`` record per rank to metrics.jsonl and one ``health`` event
per outlier; its time is outside the watchdog's step times (it runs after the watchdog's ``after_step``).
The run's first check is kept in ``RUN_DIR/health_first.json`` (not in the checkpoint, whose contents stay
deterministic), so that a restarted or resumed run still compares each rank with its first measurement; a
damaged one is said in an event and replaced by the next check.

Only hardware outliers are health alarms (``health`` events, action ``report``). Outliers that contention
explains (:func:`densetrain.health.judge`: a busy host, another process on the GPU) are said once, in one
``health`` event with action ``busy``, until a check no longer finds them: a shared machine does not repeat them
at every check, but a rank's figure that becomes an outlier while the host is busy (a fault that struck then)
is said when it first appears, beside the ones already said.
"""

from __future__ import annotations

import time

import torch

from densetrain.config.recovery import HealthConfig
from densetrain.fileio import atomic_write_json
from densetrain.health import Row, check, read_first, rows_json
from densetrain.train.watchers import Verdict, Watcher


class HealthWatch(Watcher):
    """Runs :func:`densetrain.health.check` when due (module docstring); keeps the first check's rows."""

    name = "health"

    def __init__(self, cfg: HealthConfig, watchdog=None, measure_fn=None):
        self.cfg, self.watchdog, self.measure_fn = cfg, watchdog, measure_fn  # measure_fn: tests inject figures
        self.first: list[Row] | None = None
        self.started = False
        self.seen = 0  # watchdog reports already followed by a check
        self.busy_said: set[tuple[int, str]] = set()  # (rank, figure) of contention outliers already said

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
        if self.first is None:  # a restart: the run's first check, from its first start
            self.first, damaged = read_first(path)
            if damaged and run.info.is_main:
                run.log.event(run.state.step, f"health: {damaged}; this check becomes the run's first measurement",
                              kind="health", action="replace")
        t0 = time.perf_counter()
        rows, outliers = check(run.info.device, torch.bfloat16 if run.autocast else torch.float32, run.info.mesh,
                               self.cfg, self.first, self.measure_fn)
        seconds = time.perf_counter() - t0
        if self.first is None:
            self.first = rows
            if run.info.is_main:
                atomic_write_json(path, rows_json(rows))
        step = run.state.step
        for r in rows:
            run.log.log(step, {"rank": r.rank, "host": r.host, "why": why, "seconds": seconds,
                               **r.figures}, kind="health")  # tagged health/rank<r>/<figure>
        for o in outliers:
            if o["cause"] == "hardware":
                run.log.event(step, f"health check ({why}): {o['text']}", kind="health", action="report",
                              values={k: v for k, v in o.items() if k != "text"})
        busy = [o for o in outliers if o["cause"] == "contention"]
        new = [o for o in busy if (o["rank"], o["figure"]) not in self.busy_said]
        if new:
            run.log.event(step, f"health check ({why}): {new[0]['text']}"
                                + (f" (and {len(new) - 1} more figure(s) of busy ranks)" if len(new) > 1 else "")
                                + "; said once until a check no longer finds it", kind="health", action="busy",
                          values={"outliers": [{k: v for k, v in o.items() if k != "text"} for o in new]})
        self.busy_said = {(o["rank"], o["figure"]) for o in busy}
        return outliers
