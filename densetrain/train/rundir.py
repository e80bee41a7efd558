"""The run directory's ownership and history, for setup (train/setup.py): one job at a time (the ``.lock``
flock), a new run never mixed into an old one, ``train.resume = auto``'s same-run check, the dtype a run
started in, and setting aside what a rollback abandons. Split from setup.py, behaviour unchanged."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import time
from pathlib import Path

import torch

from densetrain.checkpoint import (
    CheckpointError,
    CheckpointReadError,
    list_complete,
    read_trainer_state,
    set_aside,
)
from densetrain.checkpoint.mirror import note_set_aside, settle
from densetrain.config import Config, absolute_paths, load_config, to_dict
from densetrain.errors import EXIT_REPEATED, ConfigError, TrainError
from densetrain.fileio import (
    atomic_write_bytes,
    atomic_write_json,
    fsync_dir,
    json_text,
    other_kind,
    read_json,
    read_jsonl,
)
from densetrain.metrics import read_metrics
from densetrain.parallel import DistInfo, all_reduce_sum
from densetrain.storage import StoreUnavailable


def refuse_existing_run(run_dir: Path, info: DistInfo) -> None:
    """Refuse to mix a new run into an old one's metrics and checkpoints (a run that recorded a step or saved
    a checkpoint). Rank 0 looks (the run dir may be on its node only) and every rank learns the answer, so
    none is left waiting."""
    # A start that failed before its first step (no val tokens, a bad source) leaves config.toml, the lock and
    # an empty metrics.jsonl: that is no run to protect, and sending the user to --resume would train from the
    # failed start's config.toml instead of the corrected one.
    metrics = run_dir / "metrics.jsonl"
    taken = info.is_main and ((metrics.exists() and metrics.stat().st_size > 0) or bool(list_complete(run_dir)))
    if all_reduce_sum(torch.tensor([int(taken)], device=info.device)).item():
        raise TrainError(f"{run_dir} already holds a run; continue it with --resume {run_dir} "
                         f"or choose another --train.run_dir")


def refuse_other_kind(run_dir: Path, info: DistInfo) -> None:
    """A run directory is new, empty or a run's: refuse one that holds another command's files (prepared
    shards, a ladder, an export; :func:`densetrain.fileio.other_kind`), before anything is written there
    (``train.resume = 'auto'`` would otherwise start "a new run" inside a shards directory). Rank 0 looks;
    every rank learns the answer.

    Raises:
        TrainError: one line naming the directory and what it holds.
    """
    why = other_kind(run_dir, "run", "train.run_dir") if info.is_main else ""
    if all_reduce_sum(torch.tensor([int(bool(why))], device=info.device)).item():
        raise TrainError(why or f"{run_dir}: holds no run (rank 0 says what it holds); choose another "
                                "--train.run_dir")


RUN_IDENTITY = ("model", "data", "stages", "optim", "schedule")
"""The config sections (and ``train.seed``) that make a run the run it is: ``train.resume = 'auto'`` continues a
run directory only when its config.toml agrees on them (other keys, e.g. ``train.steps`` or ``[faults]``, may
change on a restart, as they may on --resume)."""


def _first_difference(old: dict, new: dict) -> str:
    """``'section.key: OLD there, NEW here'`` for the first key of :data:`RUN_IDENTITY` (or ``train.seed``) in
    which two configs (:func:`~densetrain.config.to_dict`) differ; '' when they agree."""
    pairs = [(sec, old.get(sec), new.get(sec)) for sec in RUN_IDENTITY]
    pairs.append(("train", {"seed": old["train"]["seed"]}, {"seed": new["train"]["seed"]}))
    for section, a, b in pairs:
        if a == b:
            continue
        if not (isinstance(a, dict) and isinstance(b, dict)):  # [[stages]]: a list
            return f"[{section}] differs"
        k = next(k for k in {**a, **b} if a.get(k) != b.get(k))
        return f"{section}.{k}: {a.get(k)!r} there, {b.get(k)!r} here"
    return ""


def refuse_model_change(run_dir: Path, cfg: Config, info: DistInfo) -> None:
    """``--resume``: the model asked for (``cfg.model``, the run's config.toml with the command's flags) must be
    the run's own. A checkpoint's tensors catch a change of shape only: another ``qk_norm``, ``rope_theta``,
    ``norm_eps`` or ``logit_softcap`` would train on silently as another model and be written into config.toml
    (where the job's own ``train.resume = 'auto'`` restart then refuses it). Checked before any checkpoint is
    tried, fetched or set aside. Rank 0 reads; every rank learns the answer.

    Raises:
        TrainError: one line naming the first differing ``model.*`` key and both values.
    """
    diff = ""
    if info.is_main and (run_dir / "config.toml").exists():
        with contextlib.suppress(ConfigError):  # a config.toml that does not load is said by the resume itself
            old, new = to_dict(load_config(path=run_dir / "config.toml"))["model"], to_dict(cfg)["model"]
            k = next((k for k in {**old, **new} if old.get(k) != new.get(k)), None)
            diff = f"model.{k}: {old.get(k)!r} in its config.toml, {new.get(k)!r} asked" if k else ""
    if all_reduce_sum(torch.tensor([int(bool(diff))], device=info.device)).item():
        raise TrainError(f"--resume {run_dir}: {diff or 'another model.* setting'}; model.* settings cannot change "
                         f"on --resume (the checkpoint is that model's): start a new run (another --train.run_dir)")


def check_same_run(run_dir: Path, cfg: Config, info: DistInfo) -> None:
    """``train.resume = 'auto'``: refuse a run directory whose ``config.toml`` is another run's (differs in
    :data:`RUN_IDENTITY`) or does not load. Rank 0 reads it; every rank learns the answer.

    Raises:
        TrainError: one line naming the first differing key and both values.
    """
    diff = ""
    if info.is_main and (run_dir / "config.toml").exists():
        try:
            # Paths compared absolute: config.toml keeps them so, an older one and the command as given
            diff = _first_difference(to_dict(absolute_paths(load_config(path=run_dir / "config.toml"))),
                                     to_dict(absolute_paths(cfg)))
        except ConfigError as e:  # said by rank 0 once every rank has learnt that there is a difference
            diff = f"its config.toml does not load: {e}"
    if all_reduce_sum(torch.tensor([int(bool(diff))], device=info.device)).item():
        raise TrainError(f"train.resume=auto: {run_dir} holds another run ({diff or 'its config.toml differs'}); "
                         f"choose another --train.run_dir, or continue that run with --resume {run_dir}")



_RUN_LOCKS: dict[Path, int] = {}  # run dir -> the open lock file of this process (flock is per open file)


def lock_run_dir(run_dir: Path, info: DistInfo) -> None:
    """Take the run directory for this job: rank 0 holds an exclusive ``flock`` on ``RUN_DIR/.lock``
    until :func:`unlock_run_dir` (or the process's end: the kernel drops it, even after kill -9), so a
    second trainer on the same run (an accidental second ``--resume``, a requeue while the old job still
    runs) is refused instead of interleaving its steps with the first's. Every rank learns the answer.

    Raises:
        TrainError: another process holds the run (one line naming it and the holder's pid).
    """
    import fcntl

    held_by = ""
    if info.is_main and run_dir.resolve() not in _RUN_LOCKS:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held_by = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
        else:
            _RUN_LOCKS[run_dir.resolve()] = fd
    if all_reduce_sum(torch.tensor([int(bool(held_by))], device=info.device)).item():
        raise TrainError(f"{run_dir} is being trained by another process (pid {held_by or 'on rank 0'}); "
                         f"wait for it to end or stop it before resuming")


def claim_run_dir(run_dir: Path) -> None:
    """Write this process's pid into the ``.lock`` it holds (for the message that refuses a second trainer),
    once setup has accepted the run: a ``train`` refused after taking the lock (an existing run without
    ``--resume``, no checkpoint at ``--rollback-to``) leaves the file of the run it refused as it was."""
    fd = _RUN_LOCKS.get(Path(run_dir).resolve())
    if fd is not None:
        with contextlib.suppress(OSError):  # the pid is for the message only (a full disk: the write
            os.ftruncate(fd, 0)              # that matters, config.toml, then says so)
            os.pwrite(fd, str(os.getpid()).encode(), 0)


def unlock_run_dir(run_dir: Path) -> None:
    """Release :func:`lock_run_dir`'s lock (a no-op where this process holds none)."""
    fd = _RUN_LOCKS.pop(Path(run_dir).resolve(), None)
    if fd is not None:
        os.close(fd)



_EVAL_NAME = re.compile(r"step_(\d+)\.json")  # RUN_DIR/evals/step_XXXXXXXX.json (densetrain eval)


def keep_started_dtype(cfg: Config, run_dir: Path, step: int | None = None,
                       device: torch.device | None = None) -> tuple[Config, str | None]:
    """``cfg`` with ``train.dtype = 'auto'`` replaced by the dtype the run's checkpoint was trained in
    (``trainer_state.json`` ``dtype`` of the newest readable complete checkpoint, at or before ``step`` for a
    rollback, as the load picks it), and a line saying so;
    ``(cfg, None)`` when the dtype is explicit or no checkpoint records one (those before this field measure
    again). Why: 'auto' is measured per process (:func:`densetrain.model.precision.resolve_dtype`), and a
    resume on a CPU near the bf16 threshold, or on another CPU (an Intel without AMX picks fp32 where a Zen 4
    picks bf16), would switch a run's precision in the middle; a resume continues it instead. An explicit
    ``train.dtype`` still changes it. In a process group every rank must find the same (else one rank would
    skip the all-reduce that measuring does while another reaches it): one MIN/MAX all-reduce on ``device``.

    Raises:
        TrainError: the ranks found different dtypes (or some none), e.g. a run directory not shared by all.
    """
    if cfg.train.dtype != "auto":
        return cfg, None
    done = list_complete(run_dir)[::-1]  # newest first: the one a resume loads, or older ones if it is unreadable
    saved, path = None, None
    for path in [p for s, p in done if step is None or s <= step]:  # a rollback loads `step` or falls back
        try:
            state = read_trainer_state(path)
        except (CheckpointError, CheckpointReadError):  # the resume itself says what is wrong with it, falls back
            continue
        saved = state.get("dtype") if isinstance(state, dict) else None
        break
    code = {"fp32": 1, "bf16": 2}.get(saved, 0)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        codes = torch.tensor([code, -code], device=device)
        torch.distributed.all_reduce(codes, op=torch.distributed.ReduceOp.MAX)
        if int(codes[0]) != -int(codes[1]):
            raise TrainError(f"{run_dir}: the ranks read different train.dtype records from its checkpoints "
                             "(is the run directory shared by every rank?); set train.dtype explicitly to resume")
    if not code:
        return cfg, None
    kept = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, dtype=saved))
    return kept, (f"train.dtype=auto: {saved}, the dtype of checkpoint {path.name} (a resumed run keeps its "
                  f"precision; set train.dtype to change it)")


def configured_steps(run_dir: Path) -> int | None:
    """``train.steps`` of the run's saved config.toml (None when it cannot be read)."""
    try:
        return load_config(path=run_dir / "config.toml").train.steps
    except (ConfigError, OSError):
        return None


def set_aside_future(run_dir: Path, step: int, is_main: bool, remote: str = "") -> list[Path]:
    """A rollback to ``step`` (``--rollback-to`` or the guard's): set aside, in
    ``RUN_DIR/checkpoints_set_aside/``, the checkpoints after ``step`` (:func:`set_aside`) and every file
    made from those abandoned steps, so that no file of the run directory shows numbers of steps that no
    longer exist: ``summary.json`` of a later step (or unreadable), ``report.html`` / ``report.png`` (made
    from the metrics being rewound; ``densetrain report`` redraws them) and ``evals/step_N.json`` of
    N > ``step`` (into ``checkpoints_set_aside/evals/``). Each is moved by one rename (kept, as the
    checkpoints are; a second rollback past the same file adds ``.1``, ``.2``, ...); rank 0 moves, every
    rank waits (in :func:`set_aside`). With ``remote`` (``checkpoint.dir``), the copies there after ``step`` are
    set aside there too (:func:`densetrain.checkpoint.mirror.settle`; no upload may be in flight), recorded
    first, so that a store that does not answer (said in one line) or a kill leaves it to the next upload or
    resume, which do it before anything else.

    Returns:
        The new paths of the files and checkpoints moved (local ones).
    """
    run_dir, moved = Path(run_dir), []
    if is_main and remote:
        note_set_aside(run_dir, step)
        try:
            settle(run_dir, remote)
        except StoreUnavailable as e:
            print(f"densetrain: warning: the checkpoints after step {step} in {remote} are set aside at the next "
                  f"upload or resume (the store did not answer: {e})", file=sys.stderr)
    if is_main:
        aside = run_dir / "checkpoints_set_aside"
        stale = [run_dir / "report.html", run_dir / "report.png"]
        try:
            if read_json(run_dir / "summary.json")["steps"] > step:  # a regular file of <= 16 MiB (fileio)
                stale.append(run_dir / "summary.json")
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError, KeyError):  # unreadable: it cannot be trusted either
            stale.append(run_dir / "summary.json")
        evals = run_dir / "evals"
        if evals.is_dir():
            stale += [p for p in sorted(evals.iterdir()) if (m := _EVAL_NAME.fullmatch(p.name)) and int(m[1]) > step]
        for path in (p for p in stale if p.is_file()):
            dest_dir = aside / path.parent.relative_to(run_dir)
            dest_dir.mkdir(parents=True, exist_ok=True)
            dest, k = dest_dir / path.name, 1
            while dest.exists():
                dest, k = dest_dir / f"{path.name}.{k}", k + 1
            os.replace(path, dest)
            fsync_dir(path.parent)
            moved.append(dest)
    return moved + set_aside(run_dir, step)


ATTEMPTS_DIR = "attempts"
"""``RUN_DIR/attempts/``: under torchrun's elastic agent, how each attempt of the job ended (``rank<r>.jsonl``,
one record per attempt and rank) and, once one failed as the attempt before it did, ``stop.json``."""
_KEEP_ATTEMPTS = 200  # records kept per rank (a job restarted without end must not grow the file without bound)


def _elastic_job() -> tuple[str | None, int]:
    """(torchrun's run id, this attempt's index): ``TORCHELASTIC_RUN_ID`` (``--rdzv-id``, e.g. Slurm's job id;
    a fresh uuid per ``--standalone`` launch) and ``TORCHELASTIC_RESTART_COUNT``; (None, 0) outside torchrun."""
    return os.environ.get("TORCHELASTIC_RUN_ID"), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _reached_step(run_dir: Path) -> int | None:
    """The last step the run recorded in metrics.jsonl (None: none, or unreadable here)."""
    try:
        return max((r["step"] for r in read_metrics(run_dir) if r.get("kind") == "train"), default=None)
    except OSError:
        return None


def _failure_line(prev: dict, rec: dict) -> str:
    at = f"at step {rec['step']}" if rec["step"] is not None else "before its first step"
    return (f"{rec['run_dir']}: attempt {rec['attempt']} failed as attempt {prev['attempt']} did, {at} "
            f"({rec['error'][:300]}): a deterministic failure, not retried (exit status {EXIT_REPEATED}; later "
            f"restarts of this job exit at once); fix the cause, then start a new job")


def end_attempt(run_dir: Path, rank: int, outcome: str, error: BaseException | None = None) -> str | None:
    """Record how this attempt of a torchrun job ended on this rank (``outcome``: 'done', 'preempted',
    'failed' or 'skipped'; ``error``: the failure) in ``RUN_DIR/attempts/rank<r>.jsonl`` (rewritten
    atomically); a no-op outside torchrun's elastic agent (no ``TORCHELASTIC_RUN_ID``).

    Returns:
        For a failure that repeats the previous attempt's of the same job (the same error type and text at
        the same step: a config the mesh refuses, a divergence at the same step), the one line saying so,
        after writing ``attempts/stop.json`` that makes the job's later restarts exit at once
        (:func:`stopped_job`); else None.
    """
    run_id, attempt = _elastic_job()
    if run_id is None:
        return None
    text = re.sub(r"^\[rank \d+\] ", "", str(error).strip().splitlines()[0] if error and str(error).strip() else "")
    rec = {"run_id": run_id, "attempt": attempt, "rank": rank, "outcome": outcome, "step": _reached_step(run_dir),
           "error": f"{type(error).__name__}: {text}" if error else "", "time": round(time.time(), 3),
           "run_dir": str(run_dir)}
    path = run_dir / ATTEMPTS_DIR / f"rank{rank}.jsonl"
    try:
        old = read_jsonl(path)[0] if path.exists() else []
    except OSError:  # damaged: started afresh (it only serves this comparison)
        old = []
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, "".join(json_text(r) + "\n" for r in [*old, rec][-_KEEP_ATTEMPTS:]).encode())
    except OSError:  # no run directory to write in (its parent is a file, a full disk): the failure says itself
        return None
    prev = next((r for r in reversed(old) if r.get("run_id") == run_id and r.get("attempt") == attempt - 1), None)
    if outcome != "failed" or prev is None or prev.get("outcome") != "failed" \
            or (prev.get("error"), prev.get("step")) != (rec["error"], rec["step"]):
        return None
    line = _failure_line(prev, rec)
    atomic_write_json(run_dir / ATTEMPTS_DIR / "stop.json", {**rec, "text": line})
    return line


def stopped_job(run_dir: Path) -> str | None:
    """At the start of an attempt under torchrun: the one line to exit with (status ``EXIT_REPEATED``, before
    any work) when an earlier attempt of this job failed as the one before it did (``attempts/stop.json`` of
    this ``TORCHELASTIC_RUN_ID``: torchrun restarts on any failure, so its remaining restarts end here in
    seconds). A ``stop.json`` of another job (a new submission, presumably after a fix) is removed, said on
    stderr. None: go on."""
    run_id, attempt = _elastic_job()
    path = run_dir / ATTEMPTS_DIR / "stop.json"
    if run_id is None or not path.exists():
        return None
    try:
        stop = read_json(path)
    except (OSError, ValueError):
        stop = {}
    if not isinstance(stop, dict):
        stop = {}
    if stop.get("run_id") != run_id:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        print(f"densetrain: note: {path} of an earlier job removed ({str(stop.get('text', '?'))[:300]}): this job "
              "tries again", file=sys.stderr, flush=True)
        return None
    return (f"{run_dir}: attempt {attempt} not started: attempt {stop.get('attempt')} of this job failed as the one "
            f"before it did ({str(stop.get('error', '?'))[:300]}); not retried (exit status {EXIT_REPEATED}): fix "
            f"the cause, then start a new job")
