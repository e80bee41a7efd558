"""The throughput watchdog (the seed's post-mortem 7.2: MFU fell from 50% to 35% over weeks because
two GPUs had degraded memory bandwidth) and the hang detector.

Every ``watchdog.every`` steps each rank's mean phase times over the window (data: drawing and
copying the batch; forward; backward, which under DDP includes waiting for the gradient all-reduce;
sync: the step's collectives (the token-count all-reduce before the forward, clipping and the
reductions after the backward) and the wait in them; optimizer; checkpoint; eval) are gathered on
every rank with one all-reduce (each rank fills its own row, reduced with MAX: the batch-sum
reduction would keep only tensor-parallel rank 0's rows). Two comparisons name a slow rank:

- **with its own baseline** (the median of its first good windows): its step time is
  ``watchdog.threshold`` above it for ``watchdog.sustain`` windows in a row, and one of its phases
  without collectives (data, forward, optimizer) grew by more than ``threshold`` of the baseline step
  time: a slow device makes every rank's step slower, because the others wait for it in the
  all-reduce, but only its own local phases grew;
- **with the other ranks** (so a rank slow from step 1, which has no faster baseline, is named too):
  one of its local phases exceeds the median of the other ranks' by more than ``threshold`` of the
  median step time, for ``sustain`` windows in a row.

The phase named is the local phase that grew (or exceeds the others) most. MFU is reported beside it.

A busy host is not a slow device. With several ranks a phase's growth counts only beyond the median growth of
the other ranks in that phase: contention that slows every rank of a shared host (load 5 on 2 cores made both
ranks' optimizer phase grow) names none of them, and a rank slowed on its own still stands out. Each rank's row
also carries the share of the CPU time its threads asked for that they got over the window
(:func:`densetrain.health.cpu_got`: CPU time against run-queue wait), its run-queue wait per step
(:func:`densetrain.health.cpu_waited`) and the host's load average: a named rank whose excess, less the growth
of its run-queue wait, is no longer above the bar is named as slowed by **contention** (other processes took its
CPU), not as a slow device: such an event has action ``busy`` (a slow device: ``report``) and starts no hardware
health check. A rank is named only after ``sustain`` windows in a row (a re-check).
Under tensor parallelism the forward holds the TP collectives, so there a slow rank's TP peers show
the same forward time and only its data and optimizer phases tell it apart.

The heartbeat thread: when no step completes for ``watchdog.hang_seconds``, every rank dumps its
Python stacks with ``faulthandler`` to stderr and ``RUN_DIR/hang_rank<r>.txt`` (once per hang),
before the collective timeout kills the job, so the stack of the rank that is stuck can be read. It also
rewrites ``RUN_DIR/heartbeat/rank<r>.json`` (host, pid and the process's start time, the attempt, step, phase,
wall time) every few seconds and at a step's end at most once a second: a rank whose process stopped answering
(SIGSTOP, a wedged driver, a swapping node) leaves a stale file. A heartbeat belongs to one attempt of the job
(:func:`attempt_id`: torchrun's run id and restart count): after a restart, the files of the previous attempt's
ranks are not read as this attempt's. Whether the writer is alive is decided from the file, not from its age
alone: on its own host, a process that no longer exists, is a zombie (killed, not yet reaped by torchrun's
agent) or is another process that reuses its pid (another start time) is dead. The file also
carries the main thread's progress (:data:`PROGRESS`: the step and phase it last reached, set by the watchdog's
hooks): a rank whose main thread is stuck in a busy loop (an infinite loop in a data worker) keeps a fresh
heartbeat, but stays behind the ranks that wait for it in a collective. When a collective times out
(``parallel.timeout_s``) or loses a peer, :func:`collective_failure_line` names the collective and, from those
files, the ranks that did not arrive (stale, gone, or behind; gloo's timeout message does not say which peer it
waited for), so the job exits with one line and torchrun's elastic agent can restart it.
"""

from __future__ import annotations

import faulthandler
import functools
import os
import re
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from densetrain.config.recovery import WatchdogConfig
from densetrain.fileio import json_text, read_json
from densetrain.health import cpu_got, cpu_sample, cpu_waited, host_load
from densetrain.metrics import flops_per_token
from densetrain.parallel import all_reduce_max, collective_timeout
from densetrain.train.watchers import Verdict, Watcher

PHASES = ("data", "forward", "backward", "sync", "optimizer", "checkpoint", "eval")
LOCAL = ("data", "forward", "optimizer")  # phases with no collective: only a rank's own speed shows there
# Where a rank's main thread last was, in the order a step passes them (the heartbeat file's "phase"): set by the
# watchdog's hooks, so that a rank whose heartbeat thread lives but whose main thread is stuck (a busy loop) can
# be told from the ranks waiting in a collective further on. "end": after the step (evaluation, checkpoint, the
# next step's stop check); "data": drawing the batch; "forward": the token count, forward and backward;
# "optimizer": clipping, the step's reductions, the optimizer.
PROGRESS = ("end", "data", "forward", "optimizer")
# The window table's columns after the phases: the step time, the run-queue wait per step (s), the CPU share got
# and the load average.
STEP, WAIT, GOT, LOAD = range(len(PHASES), len(PHASES) + 4)
COLUMNS = len(PHASES) + 4


def attempt_id() -> str:
    """This attempt of the job, the same on each of its ranks: torchrun's ``TORCHELASTIC_RUN_ID`` and
    ``TORCHELASTIC_RESTART_COUNT`` (another after each restart), else Slurm's job id and restart count, else the
    rendezvous address (``MASTER_ADDR:MASTER_PORT``). A relaunch with the same id is told apart by time
    (:func:`read_heartbeats`)."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env:
        return f"{env['TORCHELASTIC_RUN_ID']}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if "SLURM_JOB_ID" in env:
        return f"slurm{env['SLURM_JOB_ID']}/{env.get('SLURM_RESTART_COUNT', '0')}"
    return f"{env.get('MASTER_ADDR', 'localhost')}:{env.get('MASTER_PORT', '')}"


@functools.cache
def process_started() -> float:
    """Wall time (s since the epoch) this process started (``/proc``: boot time plus its start in clock ticks);
    the time of the first call where ``/proc`` is missing."""
    try:
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + process_start(os.getpid()) / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, TypeError, ValueError):
        return time.time()


def process_start(pid: int) -> int | None:
    """Start time of process ``pid`` (clock ticks since boot, ``/proc/PID/stat`` field 22), or None when there
    is no such process or it is a zombie (dead, not yet reaped): a pid reused later has another start time."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3, starttime field 22
    return None if fields[0] in ("Z", "X") else int(fields[19])


class Heartbeat:
    """A daemon thread that dumps all Python stacks when :meth:`beat` is not called for ``seconds``, and
    rewrites the rank's heartbeat file ``beat_file`` every ``every`` seconds (module docstring)."""

    def __init__(self, seconds: float, path, log=None, beat_file: Path | None = None, every: float = 5.0,
                 rank: int = 0):
        self.seconds, self.path, self.log, self.rank = seconds, path, log, rank
        self.beat_file, self.every = beat_file, min(every, seconds / 4)
        self.attempt, self.started = attempt_id(), process_start(os.getpid())
        self.lock = threading.Lock()  # the thread and a step's end both write the file
        self.written = 0.0  # monotonic time of the last write
        self.last = time.monotonic()
        self.step = 0
        self.phase = "setup"  # before the first step: no position in PROGRESS yet
        self.moved = time.time()  # wall time the main thread last reached a new phase
        self.dumped = False
        self._stop = threading.Event()
        self._write_beat()
        self.thread = threading.Thread(target=self._watch, name="densetrain-heartbeat", daemon=True)
        self.thread.start()

    def beat(self, step: int = 0) -> None:
        """A step completed: ``step`` steps are done."""
        self.last, self.dumped = time.monotonic(), False
        self.progress(step, "end")
        if self.last - self.written >= 1.0:  # the file's step stays within a second of the real one
            self._write_beat()

    def progress(self, step: int, phase: str) -> None:
        """The main thread reached ``phase`` (one of :data:`PROGRESS`) of step ``step``; written with the next
        heartbeat (a few plain assignments: the thread reads them, no lock needed for a snapshot)."""
        self.step, self.phase, self.moved = step, phase, time.time()

    def _write_beat(self) -> None:
        """The heartbeat file, replaced by a rename (a reader never sees half of it; no fsync: it matters only
        while the job runs)."""
        if self.beat_file is None:
            return
        rec = {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(), "start": self.started,
               "attempt": self.attempt, "step": self.step, "phase": self.phase, "moved": self.moved,
               "time": time.time(), "every": self.every}
        with self.lock:
            try:
                self.beat_file.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.beat_file.with_suffix(".tmp")
                tmp.write_text(json_text(rec))
                os.replace(tmp, self.beat_file)
                self.written = time.monotonic()
            except OSError:  # a full disk must not stop the watcher; the stale file then says so
                pass

    def _watch(self) -> None:
        while not self._stop.wait(self.every):
            self._write_beat()
            idle = time.monotonic() - self.last
            if idle >= self.seconds and not self.dumped:
                self.dumped = True
                print(f"densetrain: no step completed for {idle:.0f}s: Python stacks of every thread follow "
                      f"(also in {self.path})", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                with open(self.path, "w") as f:
                    faulthandler.dump_traceback(file=f, all_threads=True)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)  # no heartbeat file half-written after the run has returned


class Watchdog(Watcher):
    """Per-rank phase times against a baseline; events naming slow ranks and phases (module docstring)."""

    name = "watchdog"

    def __init__(self, cfg: WatchdogConfig, rank: int, world_size: int, run_dir):
        self.cfg, self.rank, self.world = cfg, rank, world_size
        self.acc = np.zeros(len(PHASES) + 1)  # phase sums + step-time sum over the current window
        self.n = 0
        self.cpu0 = cpu_sample()  # the CPU time and run-queue wait at the window's start
        self.windows = 0  # windows seen since the last reset
        self.baseline: np.ndarray | None = None  # (world, COLUMNS) mean seconds per step, CPU share, load
        self.early: list[np.ndarray] = []
        self.slow_streak = np.zeros(world_size, dtype=int)  # windows in a row slower than the rank's baseline
        self.peer_streak = np.zeros(world_size, dtype=int)  # windows in a row slower than the other ranks
        self.flagged: set[int] = set()
        self.marks: tuple[float, float] = (0.0, 0.0)
        self.stage_index = -1
        self.tokens = 0
        self.reports = 0  # throughput drops reported so far (the health watcher checks the hardware after each)
        # Heartbeats a few times per collective timeout: a rank silent for longer than that is stale, not slow.
        every = min(5.0, collective_timeout().total_seconds() / 4)
        self.heartbeat = Heartbeat(cfg.hang_seconds, run_dir / f"hang_rank{rank}.txt",
                                   beat_file=run_dir / "heartbeat" / f"rank{rank}.json",
                                   every=every, rank=rank) if cfg.hang_seconds else None

    def before_step(self, run) -> None:
        if self.heartbeat is not None:
            self.heartbeat.progress(run.state.step, "data")
        # Checkpoint and eval time since the last step began (they follow a step's after_step): recorded
        # per phase, but not part of the step time compared with the baseline (evals come in bursts).
        ck, ev = run.checkpointer.seconds, run.eval_seconds
        self.acc[PHASES.index("checkpoint")] += ck - self.marks[0]
        self.acc[PHASES.index("eval")] += ev - self.marks[1]
        self.marks = (ck, ev)
        self.t0 = time.perf_counter()

    def on_batch(self, run, samples: list) -> list:
        if self.heartbeat is not None:
            self.heartbeat.progress(run.state.step, "forward")
        return samples

    def on_grads(self, run, stats) -> None:
        if self.heartbeat is not None:
            self.heartbeat.progress(run.state.step, "optimizer")

    def after_step(self, run, result, verdict: Verdict) -> None:
        if self.heartbeat is not None:
            self.heartbeat.beat(run.state.step)
        if verdict == Verdict.ROLLBACK:
            return
        if result.stage.index != self.stage_index:  # another seq_len / batch: another cost per step
            self.reset()
            self.stage_index = result.stage.index
        s = result.stats
        self.acc += [result.data_s, s.forward_s, s.backward_s, result.sync_s, run.optimizer_seconds, 0.0, 0.0,
                     time.perf_counter() - self.t0]
        self.n += 1
        self.tokens += s.n_tokens
        if self.n >= self.cfg.every:
            self._window(run, result)

    def reset(self) -> None:
        """Start a new baseline (a stage switch changes seq_len and the cost per step)."""
        self.acc[:] = 0
        self.cpu0 = cpu_sample()
        self.n = self.windows = 0
        self.baseline, self.early = None, []
        self.slow_streak[:] = 0
        self.peer_streak[:] = 0

    def _window(self, run, result) -> None:
        now = cpu_sample()
        got, waited, self.cpu0 = cpu_got(self.cpu0, now), cpu_waited(self.cpu0, now), now
        row = np.concatenate([self.acc / self.n, [waited / self.n, 1.0 if got is None else got,
                                                   host_load().get("load", 0.0)]])
        table = torch.zeros(self.world, COLUMNS, dtype=torch.float64, device=run.info.device)
        table[self.rank] = torch.from_numpy(row)
        table = all_reduce_max(table).cpu().numpy()  # every rank's row (values >= 0; zeros elsewhere), on every rank
        tokens_per_step = self.tokens / self.n
        self.acc[:] = 0
        self.n = self.tokens = 0
        # A data-parallel rank's tokens, which its tensor-parallel ranks share; the FLOPs are split over all ranks.
        rank_tokens = tokens_per_step / run.info.dp_size
        flops = flops_per_token(run.cfg.model, result.stage.seq_len) * tokens_per_step / self.world
        for r in range(self.world):  # one perf record per rank: the report plots tokens/s and mfu per rank
            step_s = table[r, STEP]
            run.log.log(run.state.step, {"rank": r, "step_s": step_s, "cpu_got": table[r, GOT],
                                         "cpu_wait_s": table[r, WAIT],
                                         "tokens_per_sec": rank_tokens / step_s if step_s > 0 else None,
                                         "mfu": flops / step_s / run.peak_flops if step_s > 0 else None,
                                         **{f"time/{p}_s": table[r, i] for i, p in enumerate(PHASES)}}, kind="perf")
        self.windows += 1
        if self.windows <= self.cfg.warmup:
            return
        new = self.decide(table)
        if not new:
            return
        device = any(cause == "device" for _, _, cause in new.values())
        self.reports += device  # contention alone starts no hardware health check
        run.log.event(run.state.step, "throughput drop: " + "; ".join(text for _, text, _ in new.values()),
                      kind="throughput", action="report" if device else "busy",
                      values={"ranks": list(new), "phases": {str(r): phase for r, (phase, _, _) in new.items()},
                              "causes": {str(r): cause for r, (_, _, cause) in new.items()},
                              "step_s": table[:, STEP].tolist(), "cpu_got": table[:, GOT].tolist(),
                              "baseline_step_s": None if self.baseline is None else self.baseline[:, STEP].tolist()})

    def decide(self, table: np.ndarray) -> dict[int, tuple[str, str, str]]:
        """The ranks newly named by one window's ``table`` ((world, :data:`COLUMNS`): mean seconds per step of
        each phase, the step, the run-queue wait, the CPU share got, the load average; every rank holds the
        same table, so every
        rank decides the same): rank -> (phase, text, cause 'device' or 'contention'). Updates the streaks,
        the baseline and the ranks already named."""
        local = [PHASES.index(p) for p in (LOCAL if self.world > 1 else PHASES[:5])]
        named = {**self._vs_peers(table, local), **self._vs_baseline(table, local)}
        self.flagged &= {r for r in range(self.world) if self.slow_streak[r] or self.peer_streak[r]}
        new = {r: named[r] for r in sorted(named) if r not in self.flagged}
        self.flagged |= set(new)
        return new

    def _cause(self, table: np.ndarray, r: int, excess: float, ref_wait: float, bar: float) -> tuple[str, str]:
        """(cause, text to add) of rank ``r``'s ``excess`` seconds per step: 'contention' when, less the growth
        of its run-queue wait over ``ref_wait`` (its baseline's, or the other ranks'), the excess is no longer
        above ``bar`` (the rank would not be named per CPU-second), else 'device'."""
        if excess - (table[r, WAIT] - ref_wait) > bar:
            return "device", ""
        load = f", load average {table[r, LOAD]:.1f} on {host_load()['cores']:.0f} cores" if table[r, LOAD] else ""
        return "contention", (f" (the host is busy: this rank waited {table[r, WAIT] * 1e3:.0f} ms/step for a "
                              f"core, it got {table[r, GOT]:.0%} of the CPU time it asked for{load}; contention "
                              "from other processes, not a slow device)")

    def _vs_peers(self, table: np.ndarray, local: list[int]) -> dict[int, tuple[str, str, str]]:
        """Ranks whose local phases exceed the other ranks' median by ``threshold`` of the median step time
        for ``sustain`` windows: rank -> (phase, text, cause)."""
        if self.world < 2:
            return {}
        step, out = float(np.median(table[:, STEP])), {}
        for r in range(self.world):
            others = [q for q in range(self.world) if q != r]
            peers = np.median(table[others], axis=0)
            excess = table[r, local] - peers[local]
            i = int(np.argmax(excess))
            lagging = excess[i] > self.cfg.threshold * step
            self.peer_streak[r] = self.peer_streak[r] + 1 if lagging else 0
            if self.peer_streak[r] >= self.cfg.sustain:
                p = local[i]
                cause, why = self._cause(table, r, excess[i], peers[WAIT], self.cfg.threshold * step)
                out[r] = (PHASES[p], f"rank {r} phase '{PHASES[p]}' {table[r, p] * 1e3:.0f} ms/step vs "
                                     f"{peers[p] * 1e3:.0f} ms on the other ranks (median){why}", cause)
        return out

    def _vs_baseline(self, table: np.ndarray, local: list[int]) -> dict[int, tuple[str, str, str]]:
        """Ranks slower than their own baseline for ``sustain`` windows, with a local phase that grew (one
        process: any phase) beyond the other ranks' median growth of it: rank -> (phase, text, cause). The
        first windows make the baseline."""
        if self.baseline is None:
            self.early.append(table)
            if len(self.early) >= 3:
                self.baseline = np.median(np.stack(self.early), axis=0)
            return {}
        base = self.baseline
        slow = table[:, STEP] > base[:, STEP] * (1 + self.cfg.threshold)
        self.slow_streak = np.where(slow, self.slow_streak + 1, 0)
        if not slow.any():
            self.baseline = 0.9 * base + 0.1 * table  # drift slowly with healthy windows
            return {}
        growth, out = table - base, {}
        for r in range(self.world):
            # One process waits for nobody: any phase can be its own. Several: only the local phases tell, and
            # only beyond what the other ranks' same phase grew (a busy host slows them all).
            others = np.median(np.delete(growth, r, axis=0), axis=0) if self.world > 1 else np.zeros(COLUMNS)
            own = growth[r, local] - others[local]
            bar = self.cfg.threshold * base[r, STEP]
            if self.slow_streak[r] < self.cfg.sustain or (self.world > 1 and own.max() <= bar):
                continue
            i = int(np.argmax(own))
            p = local[i]
            cause, why = self._cause(table, r, own[i], base[r, WAIT] + others[WAIT], bar)
            out[r] = (PHASES[p], f"rank {r} {table[r, STEP] * 1e3:.0f} ms/step vs {base[r, STEP] * 1e3:.0f} ms "
                                 f"baseline, phase '{PHASES[p]}' +{growth[r, p] * 1e3:.0f} ms{why}", cause)
        return out

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()


_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_PEER_GONE = re.compile(r"connection (reset|closed) by peer|broken pipe", re.IGNORECASE)


def read_heartbeats(run_dir: Path, attempt: str | None = None, since: float = 0.0) -> dict[int, dict]:
    """rank -> its last heartbeat record (``RUN_DIR/heartbeat/rank<r>.json``; unreadable files left out), only
    those of ``attempt`` (:func:`attempt_id`) written at or after ``since`` (s since the epoch) when given: a file
    of an earlier attempt, or last written before this process started (:func:`process_started`: every rank of
    an attempt writes its first heartbeat after the rendezvous, which waits for each of them), is not this
    attempt's."""
    out = {}
    for path in sorted((Path(run_dir) / "heartbeat").glob("rank*.json")):
        try:
            rec = read_json(path)
            if (attempt is None or rec.get("attempt") == attempt) and float(rec["time"]) >= since:
                out[int(rec["rank"])] = rec
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return out


def writer_alive(rec: dict) -> bool | None:
    """Whether the process that wrote heartbeat record ``rec`` still runs: False when, on this host, its pid is
    gone, a zombie or another process (another start time); None on another host (unknown from here)."""
    if rec.get("host") != socket.gethostname():
        return None
    try:
        started = process_start(int(rec.get("pid", 0)))
    except (TypeError, ValueError):
        return False
    return started is not None and rec.get("start") in (None, started)


def silent_ranks(beats: dict[int, dict], world: int, now: float | None = None) -> dict[int, str]:
    """Ranks (of ``world``) that stopped answering: no heartbeat file of this attempt, heartbeat stale (older
    than 3 beats, at least 2 s) or written by a process that is dead (:func:`writer_alive`): rank -> why."""
    now = time.time() if now is None else now
    out = {}
    for r in range(world):
        rec = beats.get(r)
        if rec is None:
            out[r] = "no heartbeat of this attempt (still starting up, or never started)"
            continue
        where = f"host {rec.get('host')}, pid {rec.get('pid')}"
        if writer_alive(rec) is False:
            out[r] = (f"{where}: the process is dead (killed or exited), its last heartbeat "
                      f"{now - rec['time']:.0f} s ago at step {rec.get('step')}")
        elif now - rec["time"] > max(3 * rec.get("every", 5.0), 2.0):
            out[r] = f"{where}: last heartbeat {now - rec['time']:.0f} s ago, at step {rec.get('step')}"
    return out


def _position(rec: dict) -> tuple[int, int] | None:
    """Where a heartbeat record's main thread was, comparable between ranks: (step, index in PROGRESS); before
    the first step (-1, 0); None for a record without a phase."""
    phase = rec.get("phase")
    if phase == "setup":
        return (-1, 0)
    if phase not in PROGRESS or not isinstance(rec.get("step"), int):
        return None
    return (rec["step"], PROGRESS.index(phase))


def behind_ranks(beats: dict[int, dict], rank: int, now: float | None = None) -> dict[int, str]:
    """Ranks whose main thread is behind ``rank``'s (an earlier phase or step in their heartbeat records) while
    their heartbeat is fresh: alive but stuck before the collective ``rank`` waits in (a busy loop, e.g. in a
    data worker): rank -> why. Ranks at ``rank``'s position or further wait in a collective too."""
    now = time.time() if now is None else now
    mine = _position(beats.get(rank, {}))
    if mine is None:
        return {}
    out = {}
    for r, rec in beats.items():
        pos = _position(rec)
        if r == rank or pos is None or pos >= mine or writer_alive(rec) is False:  # the dead are not busy
            continue
        where = "before its first step" if pos[0] < 0 else f"in phase '{rec['phase']}' of step {rec['step']}"
        out[r] = (f"host {rec.get('host')}, pid {rec.get('pid')}: heartbeat fresh, but its main thread has not moved "
                  f"for {now - rec.get('moved', now):.0f} s, still {where} (busy there; this rank waits in phase "
                  f"'{beats[rank]['phase']}' of step {beats[rank]['step']})")
    return out


def collective_failure_line(exc: BaseException, run_dir: Path, rank: int, world: int) -> str | None:
    """One line for a collective that timed out (``parallel.timeout_s``) or lost a peer (a killed rank), from
    ``exc`` as torch.distributed raises it: the collective (the torch.distributed call and the densetrain line
    that made it) and the ranks that did not arrive, from the heartbeat files (:func:`silent_ranks`,
    :func:`behind_ranks`; gloo's message does not say which peer it waited for; ``rank`` is this process, left
    out of them). None when ``exc`` is neither."""
    timed_out, gone = _TIMEOUT.search(str(exc)), _PEER_GONE.search(str(exc))
    if not isinstance(exc, RuntimeError) or not (timed_out or gone):
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    c10d = [f for f in frames if f.filename.endswith("distributed_c10d.py")]
    ours = [f for f in frames if "densetrain" in f.filename]
    # A pipeline schedule waits on its own send/recv work objects (torch.distributed.pipelining), no c10d frame
    p2p = [f for f in frames if f.filename.endswith(("pipelining/schedules.py", "pipelining/stage.py"))]
    if c10d:
        call = c10d[0].name
    elif p2p:
        call = f"send/recv of pipeline stages ({p2p[-1].name})"
    elif any(f.name in ("backward", "run_backward", "_engine_run_backward") for f in frames):
        call = "gradient reduction (DDP/FSDP hooks in the backward)"  # started by autograd, not by Python
    else:
        return None
    where = f" in {Path(ours[-1].filename).name}:{ours[-1].lineno} {ours[-1].name}()" if ours else ""
    what = (f"timed out after {collective_timeout().total_seconds():g} s (parallel.timeout_s)" if timed_out
            else f"failed: {gone.group(0).lower()}")
    beats = read_heartbeats(run_dir, attempt_id(), process_started())
    silent = {r: why for r, why in silent_ranks(beats, world).items() if r != rank}
    silent = {**behind_ranks(beats, rank), **silent}
    if not beats:  # doctor, or watchdog.hang_seconds = 0: nothing on disk tells
        missing = f"which rank did not arrive is unknown (no heartbeat files of this attempt in {run_dir}/heartbeat)"
    elif silent:
        missing = "rank(s) not arriving: " + "; ".join(f"{r} ({why})" for r, why in sorted(silent.items()))
    else:
        missing = ("every other rank's heartbeat is fresh: one is alive but busy elsewhere (its stack: "
                   f"{run_dir}/hang_rank<r>.txt after watchdog.hang_seconds)")
    return f"collective {call}{where} {what}; {missing}"
