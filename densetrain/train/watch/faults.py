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
- ``slow_memory``: from ``step`` on, ``rank``'s memory-bound work is ``factor`` times slower: (1) in training,
  its first forward pass of each step first copies a 16 MiB buffer over and over for ``factor - 1`` times the
  duration of its previous forward pass without them (memory traffic, not a sleep: the phase the watchdog sees
  grows by that factor); (2) the health check's copy benchmark on that rank reports ``1/factor`` of the
  bandwidth it measured (:func:`densetrain.health.throttle_memory`: scaled, so that ranks sharing one host's
  memory in a CPU rehearsal do not slow each other's measurement). A rehearsal of 7.2's diagnosis, not a
  model of HBM: the matmul figure stays as it is.
- ``hang``: at ``step``, ``rank``'s process stops answering: with ``mode = "stop"`` it sends itself SIGSTOP
  (every thread stops, the heartbeat too, as on a wedged node); with ``"busy"`` its main thread spins forever
  while the step's batch is drawn (an infinite loop in a data worker: the heartbeat thread lives on, and its
  file shows the main thread stuck in phase 'data'). The other ranks' next collective times out after
  ``parallel.timeout_s`` and names it. Only SIGKILL (or SIGCONT) ends the stopped process; SIGTERM does not end
  the busy one (densetrain stops at the next step boundary, never reached): torchrun's agent sends SIGKILL after
  its grace period.
- ``duplicate_data``: from ``step``, every window of ``source`` is replaced by the first one seen (a
  dedup bug feeding repeated data, post-mortem 7.1).
- ``kill``: the process dies as with kill -9 at ``step``, or in the middle of that step's checkpoint
  write with ``during_checkpoint``: after the shards, before the completion marker; with
  ``checkpoint.async_save``, while the background thread is writing the shards.
- ``bitflip``: one bit (``bit``) of one element (``element``) of parameter ``param`` flips on ``rank``:
  in the weight before the step's forward pass, or with ``grad`` in its gradient after the
  data-parallel reduction (silent data corruption: that replica now differs from the others).
- ``bad_batch``: the first ``rows`` sequences of the global batch (all with 0) become windows of
  ``source`` at seeded random places, read corrupted (a bad shard region): uniformly random token ids
  (``tokens = "random"``) or the window's first token repeated (``"repeat"``). The event lists the
  windows' documents, so a replay verdict can be checked against them.
- ``lr_jump``: from ``step`` on, the lr the optimizer applies is ``factor`` times the scheduled one
  (the logged lr does not show it, as with a wrong multiplier elsewhere).

The data faults (all but the machine faults ``nan_grad``, ``slow_rank``, ``slow_memory``, ``hang``, ``kill``
and ``bitflip``) are deterministic in
the step and the row, so ``densetrain replay`` re-creates them and only the device faults go missing.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import torch

from densetrain.config.recovery import FaultConfig
from densetrain.data.provenance import window_documents
from densetrain.errors import TrainError
from densetrain.fileio import atomic_write_json, read_json
from densetrain.health import throttle_memory
from densetrain.schedule import stage_at
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
        self.marker_read = False  # the kill marker of an earlier process merged into fired (once per process)
        self.grad_flips: list[FaultConfig] = []  # bitflips in gradients due in this step's on_grads
        self.memory_factor = 1.0  # slow_memory: how many times slower this rank's memory-bound work is
        self.copy_s = 0.0  # slow_memory: seconds of extra copies in the step's forward pass
        self.forward_s = 0.0  # slow_memory: the previous step's forward time without the extra copies
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # slow_memory: what it copies
        self.device: torch.device | None = None
        self.spin: FaultConfig | None = None  # hang with mode 'busy': due in this step's on_batch

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
        # Kills outlive the process: merged once, also when the checkpoint resumed from restored faults fired
        # before it (before: only into an empty set, so a kill after a fired loss_spike came back on every resume).
        if not self.marker_read:
            self.marker_read = True
            self.fired |= set(read_json(marker)) if marker.exists() else set()
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
        self._slow_memory(run)
        for f in self._now(run, "hang"):
            if f.rank == self.rank and f.mode == "busy":
                self.spin = f  # in on_batch: while the batch is drawn
            elif f.rank == self.rank:
                self._fired(run, f, f"rank {self.rank} stops answering (SIGSTOP to itself)")
                os.kill(os.getpid(), signal.SIGSTOP)
        for f in self._now(run, "bitflip"):
            if f.rank == self.rank and f.grad:
                self.grad_flips.append(f)  # in on_grads, once the gradients exist
            elif f.rank == self.rank:
                self._flip(run, f, _param(run.model, f.param))

    def _sleep(self, *_) -> None:
        if self.sleep_due:
            time.sleep(self.sleep_due)
            self.sleep_due = 0.0
        if self.memory_factor > 1 and not self.copy_s:
            self.copy_s = _copy_for((self.memory_factor - 1) * self.forward_s, self._buffers())

    def _slow_memory(self, run) -> None:
        """Turn on ``slow_memory`` (module docstring) from its step: the hook and the health benchmark's factor."""
        self.copy_s = 0.0  # this step's extra copies are still to come
        slow = [f for f in self._now(run, "slow_memory", from_step=True) if f.rank == self.rank]
        if not slow or self.memory_factor > 1:  # none, or on already
            return
        self.memory_factor = max(f.factor for f in slow)
        throttle_memory(self.memory_factor)
        self.device = run.info.device
        if self.hook is None:
            self.hook = run.model.register_forward_pre_hook(self._sleep)
        self._fired(run, slow[0], f"rank {self.rank}'s memory-bound work {self.memory_factor:g}x slower from now on")

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.buffers is None:
            src = torch.ones(4 * 2**20, device=self.device)  # 16 MiB of fp32
            self.buffers = (src, torch.empty_like(src))
        return self.buffers

    def after_step(self, run, result, verdict) -> None:
        if self.memory_factor > 1:  # the forward pass's own time, without this step's extra copies
            self.forward_s = max(0.0, result.stats.forward_s - self.copy_s)

    def on_batch(self, run, samples: list) -> list:
        if self.spin is not None:
            self._fired(run, self.spin, f"rank {self.rank} stops answering (its main thread spins forever)")
            while True:  # pure Python: the GIL is handed over every few ms, so the heartbeat thread runs on
                pass
        for f in self._now(run, "duplicate_data", from_step=True):
            for s in samples:
                if s.source == f.source:  # one repeated window per sequence length (stages change it)
                    first = self.repeat.setdefault((f.source, len(s.tokens)), s)
                    s.tokens, s.start = first.tokens.copy(), first.start
            if f.step == run.state.step:
                self._fired(run, f, f"windows of '{f.source}' repeated from now on")
        for f in self._now(run, "bad_batch"):
            self._bad_batch(run, f, samples)
        return samples

    def _bad_batch(self, run, f: FaultConfig, samples: list) -> None:
        """Replace this rank's samples among the first ``f.rows`` of the global batch (module docstring)."""
        st = stage_at(run.state.step, run.stages)
        first = run.sampler.state["samples_seen"] - st.batch_size  # the batch was drawn already
        stream, rows, docs = run.train_streams[f.source], [], []
        for s in samples:
            row = s.index - first
            if f.rows and row >= f.rows:
                continue
            rng = np.random.default_rng([f.step, row])  # the same window on any rank and in a replay
            start = int(rng.integers(0, len(stream) - len(s.tokens)))
            window = stream.read(start, len(s.tokens))
            s.tokens = (rng.integers(0, run.tokenizer.vocab_size, len(window)) if f.tokens == "random"
                        else np.full_like(window, window[0]))
            s.source, s.start = f.source, start
            rows.append(s.index)
            docs += window_documents(run.cfg.data.shards_dir, f.source, stream, start, len(s.tokens))
        run.log.event(run.state.step, f"injected fault bad_batch: {len(rows)} sequences replaced by {f.tokens} tokens "
                                      f"of '{f.source}'", kind="fault", action="injected", all_ranks=True,
                      values={"fault": "bad_batch", "rank": self.rank, "samples": rows, "documents": docs})

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
        for f in self.grad_flips:
            self._flip(run, f, _param(run.model, f.param).grad)
        self.grad_flips = []
        jumps = self._now(run, "lr_jump", from_step=True)
        for f in jumps:  # the scheduled lr is set before the step; the optimizer applies this one
            for g in run.optimizer.param_groups:
                g["lr"] *= f.factor
            if f.step == run.state.step:
                self._fired(run, f, f"lr x{f.factor:g} from now on")

    def _flip(self, run, f: FaultConfig, t: torch.Tensor) -> None:
        old, new = flip_bit(t, f.element, f.bit)
        what = f"{'gradient' if f.grad else 'weight'} {f.param or 'of the first parameter'}"
        self._fired(run, f, f"bit {f.bit} of element {f.element} of the {what} on rank {self.rank}: "
                            f"{old:.6g} -> {new:.6g}")


def _copy_for(seconds: float, buffers: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Copy ``buffers[0]`` into ``buffers[1]`` until ``seconds`` have passed (at least once); returns the time."""
    src, dst = buffers
    t0 = time.perf_counter()
    while True:
        dst.copy_(src)
        if src.device.type == "cuda":
            torch.cuda.synchronize(src.device)
        if time.perf_counter() - t0 >= seconds:
            return time.perf_counter() - t0


def _param(model: torch.nn.Module, name: str) -> torch.nn.Parameter:
    """Parameter ``name`` of ``model`` ('' the first one).

    Raises:
        TrainError: no such parameter (the message lists a few names).
    """
    params = dict(model.named_parameters())
    if not name:
        return next(iter(params.values()))
    if name not in params:
        raise TrainError(f"faults: bitflip param '{name}' is not a parameter of the model (e.g. "
                         f"{', '.join(list(params)[:4])})")
    return params[name]


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def flip_bit(t: torch.Tensor, element: int, bit: int) -> tuple[float, float]:
    """Flip bit ``bit`` of element ``element % numel`` of ``t`` (its local shard for a DTensor), in
    place; return the element's value before and after.

    Raises:
        TrainError: ``bit`` is beyond the element's width.
    """
    local = t.to_local() if hasattr(t, "to_local") else t
    flat = local.detach().view(-1)
    width = 8 * flat.element_size()
    if bit >= width:
        raise TrainError(f"faults: bitflip bit {bit} is beyond the {width}-bit elements of this tensor")
    i = element % flat.numel()
    old = float(flat[i])
    mask = 1 << bit
    if mask >= 1 << (width - 1) and width > 8:  # the sign bit of a signed view
        mask -= 1 << width
    with torch.no_grad():
        flat.view(_INT_VIEW[flat.element_size()])[i] ^= mask
    return old, float(flat[i])
