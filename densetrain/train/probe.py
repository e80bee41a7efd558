"""The data-quality probe (the seed's post-mortem 7.1: loss rose from 2.3 to 2.5 after a data-source
switch because a dedup bug fed duplicated data).

Per source, two cheap signals over what was actually trained:

- **Duplicate rate**: every trained sequence is cut into non-overlapping windows of
  ``probe.window_tokens`` tokens whose hashes go into a bounded sketch (the last ``probe.sketch_size``
  hashes of that source). A window whose hash is already in the sketch *from the same epoch of the
  source* is a duplicate (windows of a later epoch legitimately repeat an earlier one). Each check
  (every ``probe.every`` steps) compares the rate since the last check with the source's running
  baseline (median of earlier checks); a rise above ``probe.dup_rate_jump`` is an event.
- **Loss trend**: the mean train loss per source between checks; an event when, within one stage, the
  mean of a source's last ``probe.trend_checks`` checks exceeds the mean of the ``trend_checks`` before by
  more than ``probe.loss_rise`` nats and more than 3 times its own check-to-check noise (median absolute
  change), while the other sources' means fell.

Events name the source and the documents of the flagged step's batch (see ``densetrain blame``). The
probe reads only this rank's samples and reduces its counts with one all-reduce per check.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

import numpy as np
import torch

from densetrain.config.recovery import ProbeConfig
from densetrain.parallel import all_reduce_sum
from densetrain.train.watchers import Verdict, Watcher


class _Sketch:
    """The last ``size`` window hashes of one source, each with the source epoch it was seen in."""

    def __init__(self, size: int):
        self.size = size
        self.seen: OrderedDict[bytes, int] = OrderedDict()

    def add(self, h: bytes, epoch: int) -> bool:
        """Remember ``h``; True when it was already seen in the same epoch."""
        dup = self.seen.get(h) == epoch
        self.seen[h] = epoch
        self.seen.move_to_end(h)
        if len(self.seen) > self.size:
            self.seen.popitem(last=False)
        return dup


class DataProbe(Watcher):
    """Duplicate rate and per-source loss trend (module docstring)."""

    name = "probe"

    def __init__(self, cfg: ProbeConfig, sources: list[str]):
        self.cfg, self.sources = cfg, sources
        self.sketch = {s: _Sketch(cfg.sketch_size) for s in sources}
        self.counts = np.zeros((len(sources), 2))  # [duplicates, windows] since the last check
        self.loss = np.zeros((len(sources), 2))  # [loss sum, tokens] since the last check
        self.dup_history: dict[str, list[float]] = {s: [] for s in sources}
        self.loss_history: dict[str, deque] = {s: deque(maxlen=2 * cfg.trend_checks) for s in sources}
        self.stage_index = -1
        self.flagged: set[tuple[str, str]] = set()

    def on_batch(self, run, samples: list) -> list:
        epochs = run.sampler.state["epoch"]
        for smp in samples:
            w = min(self.cfg.window_tokens, len(smp.tokens))
            i = self.sources.index(smp.source)
            tok = np.ascontiguousarray(smp.tokens[: len(smp.tokens) // w * w]).reshape(-1, w)
            for row in tok:
                self.counts[i, 0] += self.sketch[smp.source].add(hashlib.blake2b(row.tobytes(), digest_size=8)
                                                                 .digest(), epochs[smp.source])
            self.counts[i, 1] += len(tok)
        return samples

    def after_step(self, run, result, verdict: Verdict) -> None:
        if verdict == Verdict.ROLLBACK:
            return
        for s, (lsum, ntok) in result.stats.per_source.items():
            self.loss[self.sources.index(s)] += (lsum, ntok)
        if run.state.step % self.cfg.every == 0:
            self._check(run, result)

    def _check(self, run, result) -> None:
        counts = all_reduce_sum(torch.from_numpy(self.counts.copy())).numpy()  # loss sums are already global
        for i, s in enumerate(self.sources):
            dups, windows = counts[i]
            if windows:
                rate = dups / windows
                hist = self.dup_history[s]
                base = float(np.median(hist)) if hist else 0.0
                if len(hist) >= 1 and rate > base + self.cfg.dup_rate_jump:
                    self._event(run, result, s, "duplicates", f"source '{s}': {rate:.0%} of its trained windows "
                                f"repeat windows of the same epoch (baseline {base:.0%})",
                                {"dup_rate": rate, "baseline": base})
                else:
                    hist.append(rate)
            lsum, ntok = self.loss[i]
            if ntok:
                self.loss_history[s].append(lsum / ntok)
        self._trend(run, result)
        self.counts[:] = 0
        self.loss[:] = 0

    def _trend(self, run, result) -> None:
        if result.stage.index != self.stage_index:  # a new mix moves every source's loss: compare within a stage
            self.stage_index = result.stage.index
            for h in self.loss_history.values():
                h.clear()
            return
        k = self.cfg.trend_checks
        full = {s: np.asarray(h) for s, h in self.loss_history.items() if len(h) == 2 * k}
        if len(full) < 2:
            return
        # The mean of the last k checks against the k before (means, because a small source in a small
        # batch moves by 0.1-0.2 nats between checks at random on the demo), and against the source's
        # own check-to-check noise (median absolute change).
        change = {s: float(h[k:].mean() - h[:k].mean()) for s, h in full.items()}
        for s, d in change.items():
            others = [v for o, v in change.items() if o != s]
            noise = float(np.median(np.abs(np.diff(full[s]))))
            if d > max(self.cfg.loss_rise, 3 * noise) and np.mean(others) < 0:
                self._event(run, result, s, "loss_trend", f"source '{s}': train loss rose {d:+.3f} nats (mean of "
                            f"the last {k} checks against the {k} before) while the other sources fell "
                            f"({np.mean(others):+.3f})", {"rise": d, "others": float(np.mean(others)), "noise": noise})

    def _event(self, run, result, source: str, what: str, text: str, values: dict) -> None:
        if (source, what) in self.flagged:
            return  # once per source and signal, not at every check
        self.flagged.add((source, what))
        run.log.event(run.state.step, text, kind="data_probe", action="report",
                      values={"source": source, "signal": what, **values,
                              **run.batch_documents(result, source)})

    def state_dict(self) -> dict:
        return {"dup_history": self.dup_history, "loss_history": {s: list(h) for s, h in self.loss_history.items()}}

    def load_state_dict(self, d: dict) -> None:
        for s, h in d.get("dup_history", {}).items():
            if s in self.dup_history:
                self.dup_history[s] = list(h)
        for s, h in d.get("loss_history", {}).items():
            if s in self.loss_history:
                self.loss_history[s].extend(h)
