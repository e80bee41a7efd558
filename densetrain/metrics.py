"""Metrics: the one FLOP counter, MFU, memory, and the sinks (metrics.jsonl, TensorBoard, Weights & Biases,
console).

Metric names are the field's: ``loss``, ``grad_norm``, ``lr``, ``tokens_per_sec``, ``mfu``,
``val/<source>/loss``; in TensorBoard and W&B the records of another kind than train/eval/update are
under a prefix (``perf/rank<r>/``, ``final/``: :func:`series_tag`), so that one tag is one series.
Every record carries ``step`` (steps completed: iterations of the loop, those whose update the guard
skipped included) and ``tokens`` (target tokens consumed, summed over ranks). Both files are strict
JSON, one object a line: a non-finite number (a NaN loss of a skipped step) is written as ``null``
(:func:`json_line`), never as Python's ``NaN``/``Infinity``, which other JSON readers (browsers, jq,
pandas' ``lines=True``) refuse.
"""

from __future__ import annotations

import dataclasses
import math
import re
import resource
import sys
import time
import uuid
from pathlib import Path

import torch

from densetrain.config import Config
from densetrain.cost.flops import flops_per_token  # noqa: F401  the one FLOP counter, re-exported
from densetrain.errors import ConfigError, DataError
from densetrain.fileio import MAX_LOG_BYTES, atomic_write_bytes, json_text, read_jsonl, read_text_bounded


def measure_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024,
                       trials: int = 7, seconds: float = 0.1) -> float:
    """Achievable matmul FLOP/s of ``device``: the best of ``trials`` timings of ``n x n`` matmuls
    (each ~``seconds`` long; a matmul is ``2 n^3`` FLOPs).

    Used as the mfu denominator when ``logging.peak_flops`` is 0: on a CPU no datasheet number is
    meaningful, so mfu is relative to what this machine's BLAS actually reaches. The best trial, not
    the mean, is taken so that a moment of contention from another process does not lower the peak
    (which would inflate mfu).
    """
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up (thread pool, kernels)
    _sync(device)
    best = 0.0
    for _ in range(trials):
        iters, t0 = 0, time.perf_counter()
        while True:
            a @ b
            iters += 1
            _sync(device)
            dt = time.perf_counter() - t0
            if dt >= seconds:
                break
        best = max(best, 2.0 * n**3 * iters / dt)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak memory in GiB since the previous call (the start of the process for the first): the peak
    resident set ``mem/rss_peak_gib``, and on CUDA the peak allocated/reserved by torch
    (``mem/allocated_gib``, ``mem/reserved_gib``); then the peaks are reset, so a series of calls
    every k steps misses no peak in between (the peak of the run is the largest sample).

    The resident peak is Linux's ``VmHWM`` (``/proc/self/status``), reset by writing ``5`` to
    ``/proc/self/clear_refs`` (proc(5), Linux >= 4.0); where either is unavailable it is
    ``ru_maxrss``, the peak since the process started (never reset). CUDA's peaks are reset with
    ``torch.cuda.reset_peak_memory_stats``.
    """
    out = {"mem/rss_peak_gib": _rss_peak_since_last() / 2**30}
    if device.type == "cuda":
        out["mem/allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["mem/reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    return out


def _rss_peak_since_last() -> int:
    """Peak resident bytes since the previous call (``VmHWM``, then reset), or since start (``ru_maxrss``)."""
    try:
        with open("/proc/self/status") as f:
            hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))  # kB
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return hwm
    except (OSError, StopIteration, ValueError):
        # ru_maxrss is KiB on Linux (bytes on macOS).
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def format_rate(tokens_per_sec: float) -> str:
    """``tokens_per_sec`` for the console with three significant digits in a readable unit:
    ``"37.5 tok/s"``, ``"12.3k tok/s"``, ``"4.56M tok/s"`` (never ``"0.0k"`` for a slow run). The unit is
    chosen after rounding, so 999.6 is ``"1k tok/s"``, not ``"1e+03 tok/s"``; a non-finite rate (a clock
    that did not move) is ``"inf tok/s"`` / ``"nan tok/s"`` without a unit prefix."""
    if not math.isfinite(tokens_per_sec):
        return f"{tokens_per_sec} tok/s"
    shown = abs(float(f"{tokens_per_sec:.3g}"))  # the value as printed, so 999.6 (shown 1e+03) takes the k
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if shown >= scale:
            return f"{tokens_per_sec / scale:.3g}{unit} tok/s"
    return f"{tokens_per_sec:.3g} tok/s"


class WandbSink:
    """The run in Weights & Biases (``logging.wandb``): every metric record and every event that TensorBoard
    gets, logged against the metric ``step`` (W&B's own step counter only orders the calls). Offline with
    ``WANDB_MODE=offline`` (files under ``RUN_DIR/wandb``, uploaded later with ``wandb sync``); the other
    ``WANDB_*`` variables (entity, API key, base URL) apply as W&B documents them.

    Each start of the run (fresh, ``--resume``, ``train.resume = auto``, a torchrun restart) and each rollback
    is a new W&B run of one W&B group (``RUN_DIR/wandb_group``: the id of the first one), which
    :class:`MetricsLogger` fills with the run's whole history first (:meth:`MetricsLogger.resend`:
    ``metrics.jsonl`` rewound to the checkpoint, ``events.jsonl``): the newest W&B run of the group is
    complete and exact, one row per step. Why not continue one W&B run (``resume="allow"``): W&B history is
    append-only and its own step counter must only increase, so the steps redone after a kill -9 were
    either logged twice or (offline, where the resumed segment restarted that counter below the first
    segment's last row: at 5 after 10) not kept, while the killed process's unflushed rows were gone: the
    rows between the checkpoint and the kill were in neither. W&B's ``fork_from`` / ``resume_from`` need the
    server (they are applied there, by W&B's own step counter). The id of the current W&B run is in
    ``RUN_DIR/wandb_run_id``; each new one records the one before in its config (``wandb_previous``). Events
    go into one incremental table ``events`` (columns step, kind, action, text). :meth:`close` returns once
    the W&B files are complete on disk (it ends W&B's service process, so any other W&B run of the process
    too).

    Raises:
        ConfigError: the ``wandb`` package is not installed, or W&B cannot start the run (not logged in, no
            network): one line saying how to log in or go offline.
        DataError: ``RUN_DIR/wandb_run_id`` or ``RUN_DIR/wandb_group`` does not hold a run id.
    """

    def __init__(self, run_dir: Path, cfg: Config, resumed_at: int | None = None):
        try:
            import wandb  # only when logging.wandb is on: the package is optional
        except ImportError:
            raise ConfigError("logging.wandb = true needs the wandb package (pip install wandb), "
                              "or set logging.wandb = false") from None
        self.wandb = wandb
        previous = _read_wandb_id(run_dir / "wandb_run_id")
        run_id = uuid.uuid4().hex[:12]
        group = _read_wandb_id(run_dir / "wandb_group") or previous or run_id
        atomic_write_bytes(run_dir / "wandb_group", group.encode())
        atomic_write_bytes(run_dir / "wandb_run_id", run_id.encode())
        try:
            self.run = wandb.init(project=cfg.logging.wandb_project, name=cfg.logging.wandb_name or run_dir.name,
                                  id=run_id, group=group, dir=str(run_dir),
                                  config={**dataclasses.asdict(cfg), "wandb_previous": previous,
                                          "wandb_resumed_at_step": resumed_at})
        except Exception as e:  # wandb.errors.UsageError (not logged in), CommError (no network), ...
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ConfigError(f"logging.wandb: W&B could not start the run ({first}); log in with `wandb login`, "
                              "or run offline with WANDB_MODE=offline, or set logging.wandb = false") from None
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.events = wandb.Table(columns=["step", "kind", "action", "text"], log_mode="INCREMENTAL")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log({**scalars, "step": step})

    def event(self, step: int, kind: str, action: str | None, text: str) -> None:
        self.events.add_data(step, kind, action or "", text)
        self.run.log({"events": self.events, "step": step})

    def finish(self) -> None:
        """Finish this W&B run (another may follow in this process: a rollback's)."""
        self.run.finish()

    def close(self) -> None:
        """Finish the run and wait until W&B's service process has written its files and exited."""
        self.run.finish()
        # finish() only tells the service to close the run: its file could still be a bare header when
        # finish() returned (10 of 30 times on a loaded machine), and under torchrun the ranks leave with
        # os._exit (cli.entry), which skips W&B's own atexit teardown. teardown() waits for the service.
        self.wandb.teardown()


def _read_wandb_id(path: Path) -> str | None:
    """The W&B run id in ``path`` (None when there is no such file).

    Raises:
        DataError: the file holds something else (W&B refuses /\\#?%: in ids; ours are 12 of [a-z0-9])."""
    if not path.exists():
        return None
    run_id = read_text_bounded(path, 1024).strip()
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", run_id):
        raise DataError(f"{path}: not a W&B run id (1-64 letters, digits, _ or -), got {run_id[:80]!r}; "
                        "delete the file to start a new W&B run group")
    return run_id


def _scalars(metrics: dict, kind: str = "train") -> dict[str, float]:
    """The numeric entries of a record (what TensorBoard and W&B plot; strings such as the stage are not),
    under the tag each gets there (:func:`series_tag`)."""
    return {series_tag(kind, k, metrics): v for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not (kind == "perf" and k == "rank")}


def series_tag(kind: str, name: str, metrics: dict) -> str:
    """The TensorBoard / W&B tag of metric ``name`` of a ``kind`` record: one tag, one series, one value per
    step. ``train``, ``eval`` and ``update`` records keep the name (their names never meet at a step). The
    per-rank records (one a rank at a step: the watchdog's ``perf``, with the same ``tokens_per_sec`` and
    ``mfu`` names as a ``train`` record; the health checks' ``health`` figures) go to ``<kind>/rank<r>/<name>``;
    the end-of-run ``final_eval`` (its tasks may be those the last in-loop evaluation ran, at the same step) to
    ``final/<name>``; any other kind to ``<kind>/<name>``. metrics.jsonl keeps the names as they are, with the
    ``kind`` beside them."""
    if kind in ("train", "eval", "update"):
        return name
    if kind in ("perf", "health"):
        return f"{kind}/rank{metrics.get('rank', 0)}/{name}"
    if kind == "final_eval":
        return f"final/{name}"
    return f"{kind}/{name}"


def json_line(rec: dict) -> str:
    """One strict JSON line (no newline) of ``rec``: non-finite floats become ``null`` (module docstring)."""
    return json_text(rec)


class MetricsLogger:
    """Writes metric records to ``RUN_DIR/metrics.jsonl``, TensorBoard (``RUN_DIR/tb``), Weights & Biases
    (``logging.wandb``, :class:`WandbSink`) and the console, and structured events to ``RUN_DIR/events.jsonl``.

    Only rank 0 writes metrics. On resume the JSONL file is appended to, and records at or after the
    resumed step are dropped first so a killed-and-resumed run leaves one record per step. Events are
    never rewritten: ``events.jsonl`` is the history of what happened, rollbacks included.

    Args:
        wandb: the run's config when ``logging.wandb`` is on (its project, name and hyperparameters), else None.
    """

    def __init__(self, run_dir: Path, rank: int = 0, tensorboard: bool = True, resume_step: int | None = None,
                 wandb: Config | None = None):
        self.enabled = rank == 0
        self.rank = rank
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.tensorboard = tensorboard
        self.tb = None
        self.wandb = None
        if not self.enabled:
            return
        if resume_step is not None and self.path.exists():
            self._truncate_after(resume_step, keep_events=False)
        self._open(None if resume_step is None else resume_step + 1)
        self.wandb_cfg = wandb
        if wandb is not None:
            self.wandb = WandbSink(self.run_dir, wandb, resumed_at=resume_step)
            self.resend()

    def _open(self, purge_step: int | None) -> None:
        self.f = open(self.path, "a", buffering=1)
        self.events = open(self.run_dir / "events.jsonl", "a", buffering=1)
        if self.tensorboard:
            # Imported here: it pulls in the tensorboard package, which a run with logging.tensorboard = false
            # (e.g. a GPU image without it) must not need.
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events after the checkpoint's step left by a killed run (or a rollback).
            if purge_step is not None:
                after_newest_event_file(self.run_dir / "tb")
            self.tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=purge_step)

    def _truncate_after(self, step: int, keep_events: bool) -> None:
        # Lines read_log_records skips (a torn last line from a kill -9, damage) are dropped here; json_line is
        # what wrote the others, so they are rewritten byte for byte.
        keep = [json_line(rec) for rec in read_log_records(self.path)
                if rec["step"] <= step or (keep_events and rec["kind"] == "event")]
        atomic_write_bytes(self.path, ("\n".join(keep) + "\n" if keep else "").encode())

    def rewind(self, step: int) -> None:
        """After a rollback to ``step``: drop metric records past it from metrics.jsonl and TensorBoard,
        so the logs show one trajectory (events are kept: they say what happened)."""
        if not self.enabled:
            return
        self._close_files()
        self._truncate_after(step, keep_events=True)
        self._open(step + 1)
        if self.wandb is not None:  # W&B history is append-only: a new W&B run of the group, from the files
            self.wandb.finish()
            self.wandb = WandbSink(self.run_dir, self.wandb_cfg, resumed_at=step)
            self.resend()

    def resend(self) -> None:
        """Send the run's history so far to a new W&B run (:class:`WandbSink`): every metric record of
        ``metrics.jsonl`` (as rewound to the checkpoint: the steps a resume redoes come live, once) and every
        event of ``events.jsonl``, in file order, as :meth:`log` and :meth:`event` sent them (a metric that
        was not finite, ``null`` in the file, is left out)."""
        for rec in read_log_records(self.path):
            if rec["kind"] != "event":
                values = {k: v for k, v in rec.items() if k not in ("kind", "step", "time")}
                self.wandb.log(rec["step"], _scalars(values, rec["kind"]))
        events = self.run_dir / "events.jsonl"
        for rec in read_log_records(events) if events.exists() else []:
            self.wandb.event(rec["step"], rec["kind"], rec.get("action"), str(rec.get("text", "")))

    def log(self, step: int, metrics: dict, kind: str = "train") -> None:
        """Record ``metrics`` (name -> number or string) at ``step`` in all sinks."""
        if not self.enabled:
            return
        rec = {"kind": kind, "step": step, "time": time.time(), **metrics}
        self.f.write(json_line(rec) + "\n")
        scalars = _scalars(metrics, kind)
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(step, scalars)

    def event(self, step: int, text: str, kind: str = "note", action: str | None = None, values: dict | None = None,
              all_ranks: bool = False) -> None:
        """A notable event: ``events.jsonl`` (``{kind, step, rank, time, text, action, values}``), the
        console, TensorBoard text and a ``kind="event"`` record in metrics.jsonl.

        Args:
            kind: what happened ('stage', 'checkpoint', 'loss_spike', 'nonfinite', 'rollback',
                'throughput', 'data_probe', 'fault', 'resume', 'note', ...).
            action: what the run did about it ('skip', 'rollback', 'stop', None).
            values: the numbers behind it (JSON values).
            all_ranks: record it from every rank (e.g. a fault injected on one rank); rank 0 otherwise.
        """
        if not (self.enabled or all_ranks):
            return
        rec = {"kind": kind, "step": step, "rank": self.rank, "time": time.time(), "text": text, "action": action,
               "values": values or {}}
        print(f"[step {step}]{f' [rank {self.rank}]' if self.rank else ''} {text}", flush=True)
        if not self.enabled:  # another rank: its own file, merged by readers
            with open(self.run_dir / f"events_rank{self.rank}.jsonl", "a") as f:
                f.write(json_line(rec) + "\n")
            return
        self.events.write(json_line(rec) + "\n")
        self.f.write(json_line({"kind": "event", "step": step, "time": rec["time"], "text": text,
                                 "event": kind}) + "\n")
        if self.tb is not None:
            self.tb.add_text("events", f"[{kind}] {text}", step)
        if self.wandb is not None:
            self.wandb.event(step, kind, action, text)

    def console(self, line: str) -> None:
        if self.enabled:
            print(line, flush=True)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None
        self._close_files()

    def _close_files(self) -> None:
        if not self.enabled or self.f.closed:
            return
        self.f.close()
        self.events.close()
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def after_newest_event_file(tb_dir: Path, max_wait_s: float = 2.0) -> None:
    """Wait until the clock's whole second is past the creation second of ``tb_dir``'s newest TensorBoard event file
    (at most ``max_wait_s``). TensorBoard reads a directory's files in name order, and a name starts with its
    writer's creation time in whole seconds, then host and pid: a writer opened within the second of the previous
    one (a resume or a rollback right after one) could sort before it, and that file's purge then discarded the
    new writer's steps (a rollback, a kill and an in-process resume in one second kept the killed run's steps
    21-23 and lost the resumed 21-26). A clock more than ``max_wait_s`` behind (another host) is not waited for."""
    stamps = [int(p.name.split(".")[3]) for p in tb_dir.glob("events.out.tfevents.*")
              if p.name.count(".") >= 4 and p.name.split(".")[3].isdigit()]
    wait = max(stamps, default=0) + 1 - time.time()
    if 0 < wait <= max_wait_s:
        time.sleep(wait)


_NOTED_SKIPS: set[str] = set()


def read_log_records(path: Path) -> list[dict]:
    """The records of a run's JSON Lines log ``path`` (metrics.jsonl, events*.jsonl): objects with an integer
    ``step`` and a string ``kind``, as :meth:`MetricsLogger.log` / :meth:`MetricsLogger.event` write them. Other
    lines (damage, an edit, nesting too deep; :func:`densetrain.fileio.read_jsonl`) are skipped and counted in
    one note on stderr per file and process; a torn last line of a killed run is dropped without a note.

    Raises: ReadRefused (an OSError: not a regular file, e.g. a FIFO or a link to /dev/zero, or over
    MAX_LOG_BYTES; one line naming the file); OSError."""
    records, skipped = read_jsonl(path, MAX_LOG_BYTES)
    out = []
    for rec in records:
        if type(rec.get("step")) is int and isinstance(rec.get("kind"), str):
            out.append(rec)
        else:
            skipped.append(f"{path}: a record without an integer 'step' and a string 'kind'")
    if skipped and str(path) not in _NOTED_SKIPS:
        _NOTED_SKIPS.add(str(path))
        print(f"densetrain: note: skipped {len(skipped)} malformed line(s) of {path} (first: {skipped[0]})",
              file=sys.stderr)
    return out


def read_metrics(run_dir: Path) -> list[dict]:
    """All records of ``RUN_DIR/metrics.jsonl`` (:func:`read_log_records`: malformed lines skipped and noted)."""
    path = Path(run_dir) / "metrics.jsonl"
    return read_log_records(path) if path.exists() else []


def read_events(run_dir: Path) -> list[dict]:
    """All structured events of a run (``events.jsonl`` and other ranks' ``events_rank<r>.jsonl``),
    ordered by time (:func:`read_log_records`: malformed lines skipped and noted)."""
    out = [e for path in sorted(Path(run_dir).glob("events*.jsonl")) for e in read_log_records(path)]
    return sorted(out, key=lambda e: e["time"] if type(e.get("time")) in (int, float) else 0)
