"""The data-quality probe (the seed's post-mortem 7.1: loss rose from 2.3 to 2.5 after a data-source
switch because a dedup bug fed duplicated data).

Per source, two cheap signals over what was actually trained:

- **Duplicate rate**: every trained sequence is cut into non-overlapping windows of
  ``probe.window_tokens`` tokens whose hashes go into a bounded sketch (the last ``probe.sketch_size``
  hashes of that source). A window whose hash is already in the sketch *from the same epoch of the
  source* is a duplicate (windows of a later epoch legitimately repeat an earlier one); the epoch is
  the sample's own (:attr:`densetrain.data.mixture.Sample.epoch`), not the sampler's counter after the
  draw, which a batch that crosses an epoch would give to its last windows of the old epoch. Each check
  (every ``probe.every`` steps) compares the rate since the last check with the source's running
  baseline (median of earlier checks); a rise above ``probe.dup_rate_jump`` is an event.
- **Loss trend**: the mean train loss per source between checks; an event when, within one stage, the
  mean of a source's last ``probe.trend_checks`` checks exceeds the mean of the ``trend_checks`` before by
  more than ``probe.loss_rise`` nats and more than 3 times its own check-to-check noise (median absolute
  change), while the other sources fell.

The sketch covers the **global** batch: each rank hashes its own rows, and at each check one
all-reduce (an int64 table, a row per global sample since the last check, filled by the rank that
holds it) gives every rank every row in global sample order, so a window repeated on another rank is
seen, and every rank holds the same sketch and counts (those of a 1-process run of the same data).
Events name the source and the documents of the flagged step's batch (see ``densetrain blame``).
"""

from __future__ import annotations

import hashlib
import math
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
        self.seen: OrderedDict[int, int] = OrderedDict()

    def add(self, h: int, epoch: int) -> bool:
        """Remember ``h``; True when it was already seen in the same epoch."""
        dup = self.seen.get(h) == epoch
        self.seen[h] = epoch
        self.seen.move_to_end(h)
        if len(self.seen) > self.size:
            self.seen.popitem(last=False)
        return dup


HEAD = 3  # table columns before the hashes: source index + 1 (0: a row no rank filled), epoch, hash count


def window_hashes(tokens: np.ndarray, window_tokens: int) -> list[int]:
    """Signed 64-bit blake2b hashes of the non-overlapping ``window_tokens``-token windows of ``tokens``
    (a shorter sequence is one window; a tail shorter than a window is not hashed)."""
    w = min(window_tokens, len(tokens))
    rows = np.ascontiguousarray(tokens[: len(tokens) // w * w]).reshape(-1, w)
    return [int.from_bytes(hashlib.blake2b(r.tobytes(), digest_size=8).digest(), "little", signed=True) for r in rows]


class DataProbe(Watcher):
    """Duplicate rate and per-source loss trend (module docstring)."""

    name = "probe"

    def __init__(self, cfg: ProbeConfig, sources: list[str]):
        self.cfg, self.sources = cfg, sources
        self.sketch = {s: _Sketch(cfg.sketch_size) for s in sources}
        self.tables: list[torch.Tensor] = []  # this rank's rows of each global batch since the last check
        self.counts = np.zeros((len(sources), 2))  # [duplicates, windows] of the last check
        self.loss = np.zeros((len(sources), 2))  # [loss sum, tokens] since the last check
        self.dup_history: dict[str, list[float]] = {s: [] for s in sources}
        self.loss_history: dict[str, deque] = {s: deque(maxlen=2 * cfg.trend_checks) for s in sources}
        self.stage_index = -1
        self.flagged: set[tuple[str, str]] = set()

    def add_batch(self, samples: list, first_sample: int, batch_size: int, seq_len: int) -> None:
        """Keep this rank's rows of a global batch of ``batch_size`` rows from ``first_sample`` (windows of
        ``seq_len + 1`` tokens) for the next :meth:`count`."""
        table = torch.zeros(batch_size, HEAD + (seq_len + 1) // min(self.cfg.window_tokens, seq_len + 1),
                            dtype=torch.int64)
        for smp in samples:
            h = window_hashes(smp.tokens, self.cfg.window_tokens)
            table[smp.index - first_sample, : HEAD + len(h)] = torch.tensor(
                [self.sources.index(smp.source) + 1, smp.epoch, len(h), *h], dtype=torch.int64)
        self.tables.append(table)

    def count(self, device: torch.device | None = None) -> np.ndarray:
        """Reduce the kept rows over ranks (on ``device``: NCCL reduces GPU tensors only), run them through
        the sketches in global sample order, and return the per-source [duplicates, windows] (the same
        array on every rank)."""
        width = max((t.shape[1] for t in self.tables), default=HEAD)
        table = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in self.tables]) \
            if self.tables else torch.zeros(0, width, dtype=torch.int64)
        self.tables = []
        rows = all_reduce_sum(table.to(device or 'cpu')).cpu().tolist()
        counts = np.zeros((len(self.sources), 2))
        for src, epoch, n, *hashes in rows:
            if src:
                sketch = self.sketch[self.sources[src - 1]]
                counts[src - 1] += (sum(sketch.add(h, epoch) for h in hashes[:n]), n)
        return counts

    def after_step(self, run, result, verdict: Verdict) -> None:
        if verdict == Verdict.ROLLBACK:
            return
        self.add_batch(result.samples, result.first_sample, result.stage.batch_size, result.stage.seq_len)
        for s, (lsum, ntok) in result.stats.per_source.items():
            self.loss[self.sources.index(s)] += (lsum, ntok)
        if run.state.step % self.cfg.every == 0:
            self._check(run, result)

    def _check(self, run, result) -> None:
        self.counts = counts = self.count(run.info.device)  # loss sums are already global
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
            if ntok and math.isfinite(lsum):  # a skipped NaN step: no trend point (and none saved as null)
                self.loss_history[s].append(lsum / ntok)
        self._trend(run, result)
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
