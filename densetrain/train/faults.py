"""Fault injection (``[[faults]]``) for rehearsing recovery and for testing it.

Each configured fault happens at its update index (``step``, 0-based), once: a rollback that
replays that index does not meet it again (it was the batch or the device that was bad, and the
rollback skips the batch); ``slow_rank`` and ``duplicate_data`` last from ``step`` on. Each is logged
as a ``fault`` event when it fires. With no faults configured the injector is not installed at all, so it costs
nothing. Kinds:

- ``loss_spike``: multiply the step's loss and gradients by ``factor`` (what a bad batch does).
- ``nan_grad``: one gradient becomes NaN on ``rank`` only (a flaky device).
- ``slow_rank``: ``rank`` sleeps ``ms`` per step inside its forward passes from ``step`` on (a
  device with degraded memory bandwidth, the seed's post-mortem 7.2).
- ``duplicate_data``: from ``step``, every window of ``source`` is replaced by the first one seen (a
  dedup bug feeding repeated data, post-mortem 7.1).
- ``kill``: the process dies as with kill -9 at ``step``, or in the middle of that step's checkpoint
  write with ``during_checkpoint``: after the shards, before the completion marker; with
  ``checkpoint.async_save``, while the background thread is writing the shards.
"""

from __future__ import annotations

import json
import os
import signal
import time

import torch

from densetrain.config.recovery import FaultConfig
from densetrain.fileio import atomic_write_json
from densetrain.train.watchers import Watcher


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class FaultInjector(Watcher):
    """Carries out ``faults`` (module docstring) on this rank."""

    name = "faults"

    def __init__(self, faults: list[FaultConfig], rank: int):
        self.faults, self.rank = faults, rank
        self.repeat: dict[tuple, object] = {}  # duplicate_data: (source, length) -> the window repeated
        self.hook = None
        self.sleep_due = 0.0  # slow_rank: seconds the next forward pass sleeps (set at each step's start)
        self.fired: set[int] = set()  # indices into faults of the one-time faults that happened

    def _now(self, run, kind: str, from_step: bool = False) -> list[FaultConfig]:
        step, out = run.state.step, []
        for i, f in enumerate(self.faults):
            if f.kind == kind and (f.step <= step if from_step else f.step == step and i not in self.fired):
                out.append(f)
                if not from_step:
                    self.fired.add(i)
        return out

    def state_dict(self) -> dict:
        return {"fired": sorted(self.fired)}

    def load_state_dict(self, d: dict) -> None:
        self.fired = set(d.get("fired", []))

    def _fired(self, run, f: FaultConfig, text: str) -> None:
        run.log.event(run.state.step, f"injected fault {f.kind}: {text}", kind="fault", action="injected",
                      values={"fault": f.kind, "rank": self.rank}, all_ranks=True)

    def before_step(self, run) -> None:
        marker = run.run_dir / f"faults_fired_rank{self.rank}.json"
        if run.state.step == 0 or not self.fired and marker.exists():  # kills outlive the process
            self.fired |= set(json.loads(marker.read_text())) if marker.exists() else set()
        for f in self._now(run, "kill"):
            if f.rank == self.rank:
                atomic_write_json(marker, sorted(self.fired))  # the resumed run must not meet it again
                self._fired(run, f, "process killed" + (" during the checkpoint write" if f.during_checkpoint else ""))
                if not f.during_checkpoint:
                    _die()
                run.checkpointer.on_written = _die
        slow = [f for f in self._now(run, "slow_rank", from_step=True) if f.rank == self.rank]
        # The sleep is due once per step, in the step's first forward pass (not split over micro-batches,
        # whose count per rank depends on the world size; not in eval forwards).
        self.sleep_due = sum(f.ms for f in slow) / 1000
        if slow and self.hook is None:
            self.hook = run.model.register_forward_pre_hook(self._sleep)
            self._fired(run, slow[0], f"rank {self.rank} sleeps {sum(f.ms for f in slow):g} ms per step from now on")

    def _sleep(self, *_) -> None:
        if self.sleep_due:
            time.sleep(self.sleep_due)
            self.sleep_due = 0.0

    def on_batch(self, run, samples: list) -> list:
        for f in self._now(run, "duplicate_data", from_step=True):
            for s in samples:
                if s.source == f.source:  # one repeated window per sequence length (stages change it)
                    first = self.repeat.setdefault((f.source, len(s.tokens)), s)
                    s.tokens, s.start = first.tokens.copy(), first.start
            if f.step == run.state.step:
                self._fired(run, f, f"windows of '{f.source}' repeated from now on")
        return samples

    def on_grads(self, run, stats) -> None:
        for f in self._now(run, "loss_spike"):
            stats.loss_sum *= f.factor
            for sums in stats.per_source.values():
                sums[0] *= f.factor
            for p in run.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(f.factor)
            self._fired(run, f, f"loss and gradients x{f.factor:g}")
        for f in self._now(run, "nan_grad"):
            if f.rank == self.rank:
                next(p for p in run.model.parameters() if p.grad is not None).grad.view(-1)[0] = torch.nan
                self._fired(run, f, f"a NaN gradient on rank {self.rank}")
