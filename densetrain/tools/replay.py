"""``densetrain replay RUN STEP``: was a spike caused by the data or by the machine?

The step is recomputed from the run's newest checkpoint before it, in one process (whatever layout the run
had: FSDP2, tensor or context parallel checkpoints are resharded on load): the checkpoint's
model, optimizer, RNG and sampler state are loaded (without one, the seeded initial weights, which
are those of a single process on any layout), the updates between it and ``STEP`` are applied
again (skipping those the run skipped, and the data its rollbacks skipped, as ``densetrain blame``
replays the sampler), then the global batch of ``STEP`` (the ``step`` of its metrics.jsonl record:
the update with index ``STEP - 1``; events, the guard's ``[step N]`` among them, carry the index, so
the skip event of update N says ``densetrain replay RUN N+1``) is drawn by the same deterministic
sampler, with the run's data faults (``[[faults]]`` of kinds that are not device faults) re-created,
and its loss and gradient norm are computed and compared with the logged ones (those of the guard's
event for that step, which also carries every rank's own part of them, else the train record):

- reproduced within ``rtol`` (fp32 noise: another reduction order over ranks and micro-batches moves
  the loss by ~1e-6 relative) -> **data**: the batch's loss per document, and the documents that carry
  most of the excess loss over the guard's window median (source, file:line, id, as ``blame`` names
  them);
- not reproduced -> **machine or nondeterminism**: the ranks whose local loss (their rows of the
  batch) or gradient norm differ from the replay, and the advice to exclude their node.

The verdict is printed and appended to ``RUN_DIR/events_replay.jsonl`` (kind ``replay``), which every
reader of the run's events merges with ``events.jsonl`` (a replay may run while training still writes
there). Runs made without ``train.dtype = fp32`` replay within their autocast noise only.

A step that was non-finite and is non-finite again is reproduced (data or recipe, not the machine). What cannot be
replayed is said in one line: a step without its record, or a record without the numbers compared, a
checkpoint without the sampler state (an older densetrain), a negative or non-finite ``rtol``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from densetrain.checkpoint import CheckpointError, localize, read_trainer_state, run_checkpoints
from densetrain.config import anchor_run_paths, load_config
from densetrain.config.recovery import MACHINE_FAULTS
from densetrain.data.provenance import window_documents
from densetrain.errors import ConfigError, DataError
from densetrain.fileio import json_text
from densetrain.loss import IGNORE_INDEX, token_losses
from densetrain.metrics import read_events, read_metrics
from densetrain.optim import set_lr
from densetrain.schedule import lr_for, stage_at
from densetrain.train.loop import commit
from densetrain.train.setup import setup
from densetrain.train.step import compute_step, draw_samples, make_micro_batches
from densetrain.train.watchers import Verdict

SPIKE_KINDS = ("loss_spike", "nonfinite")
SHARE = 0.8  # the documents named carry at least this share of the batch's excess loss


def close(a: float | None, b: float | None, rtol: float) -> bool:
    """``a`` and ``b`` equal within ``rtol`` relative, or both non-finite (``None``: a non-finite number
    as metrics.jsonl / events.jsonl write it, strict JSON's ``null``)."""
    a, b = (math.nan if x is None else x for x in (a, b))
    if not (math.isfinite(a) and math.isfinite(b)):
        return not math.isfinite(a) and not math.isfinite(b)
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-12)


def _number(x) -> float | None:
    """A logged number: a float (a non-finite one is ``null`` in strict JSON, read back as None), else None."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _finite(x) -> bool:
    return _number(x) is not None and math.isfinite(x)


def _logged(run_dir: Path, cfg, step: int) -> tuple[dict, dict | None]:
    """(``{"loss", "grad_norm", "sample_index", "median"}`` logged for ``step``, the guard's event or None).
    ``median``: the guard's (its event's), else that of the finite train losses of the ``guard.window`` steps
    before (skipped steps' losses are ``null`` and left out), None without any.

    Raises:
        DataError: neither a guard event nor a train record for ``step``, or one without the numbers a replay
            compares (a run written by an older densetrain).
    """
    events = [e for e in read_events(run_dir) if e.get("kind") in SPIKE_KINDS and e.get("step") == step - 1
              and e.get("rank", 0) == 0]
    records = [r for r in read_metrics(run_dir) if r.get("kind") == "train"]
    window = [r["loss"] for r in records if isinstance(r.get("step"), int)
              and step - cfg.guard.window <= r["step"] < step and _finite(r.get("loss"))]
    median = float(np.median(window)) if window else None
    spike = events[-1] if events else None
    if spike:
        src, where = spike.get("values", {}), f"{run_dir}/events.jsonl: the {spike['kind']} event of step {step}"
    else:
        src = next((r for r in records if r.get("step") == step), None)
        if src is None:
            raise DataError(f"{run_dir}: no guard event and no train record for step {step}")
        where = f"{run_dir}/metrics.jsonl: the train record of step {step}"
    if not isinstance(src.get("sample_index"), int) or not {"loss", "grad_norm"} <= set(src):
        raise DataError(f"{where} has no loss, grad_norm and sample_index (a run of an older densetrain?): "
                        "the step cannot be replayed")
    # A non-finite number is null in the files: None, as close() takes it.
    logged = {"loss": _number(src["loss"]), "grad_norm": _number(src["grad_norm"]),
              "sample_index": src["sample_index"],
              "median": _number(src.get("median")) if _number(src.get("median")) is not None else median}
    return logged, spike


def _original_path(run_dir: Path, start: int, index: int, spike: dict | None) -> tuple[list[dict], set[int]]:
    """What the run did between checkpoint ``start`` and update ``index`` (before the spike event, when
    there is one): the rollback events to ``start`` (whose skipped data must be skipped again) and the
    updates it skipped."""
    until = spike.get("time", math.inf) if spike else math.inf
    events = [e for e in read_events(run_dir) if e.get("time", 0) < until]
    rollbacks = [e for e in events if e.get("kind") == "rollback" and e.get("step") == start]
    since = rollbacks[-1].get("time", -math.inf) if rollbacks else -math.inf
    skipped = {e["step"] for e in events if e.get("kind") in SPIKE_KINDS and e.get("action") == "skip"
               and start <= e["step"] < index and e.get("time", 0) > since and e.get("rank", 0) == 0}
    return rollbacks, skipped


def _replay_config(cfg, tmp: Path):
    """The run's config for a quiet one-process replay in ``tmp``: no device faults, no other watchers, and
    one process whatever layout the run had (its checkpoint is resharded on load by DCP)."""
    rc = copy.deepcopy(cfg)
    rc.train.run_dir = str(tmp)
    rc.checkpoint.dir = ""  # the checkpoint replayed from is linked into tmp; nothing is fetched or uploaded
    rc.parallel = dataclasses.replace(cfg.parallel, dp_replicate=1, dp_shard=1, tp=1, cp=1, sequence_parallel=False)
    rc.faults = [f for f in cfg.faults if f.kind not in MACHINE_FAULTS]
    rc.guard.replica_every = rc.guard.update_every = 0
    rc.guard.replay = False
    rc.watchdog.every, rc.watchdog.hang_seconds, rc.probe.every = 0, 0.0, 0
    rc.train.gc_freq = 0  # the replay calls before_step only: a gc watcher would leave the collector off
    rc.logging.tensorboard = False
    return rc


def _row_losses(run, stage, samples) -> torch.Tensor:
    """Per-token losses (B, T) fp32 of the global batch ``samples`` under the replayed weights."""
    eos_id = run.tokenizer.eos_id if stage.document_mask else None
    out = []
    with torch.no_grad():
        for x, y, _, more in make_micro_batches(samples, stage.micro_batch_size, run.info.device, eos_id,
                                                stage.reset_positions):
            with run.autocast or contextlib.nullcontext():
                logits = run.model(x, **more)
            out.append(torch.where(y != IGNORE_INDEX, token_losses(logits, y), 0.0).float().cpu())  # select, not * mask
    return torch.cat(out)


def document_losses(run, samples, losses: torch.Tensor, median: float) -> list[dict]:
    """Loss per document of the batch: ``[{"source", "file", "line", "doc_id", "tokens", "loss",
    "excess"}, ...]``, where ``excess`` is its loss sum minus ``median`` per token (nats), largest first.

    Target ``j`` of a window predicts window token ``j + 1``, so it belongs to that token's document.
    """
    docs: dict[tuple, dict] = {}
    for smp, row in zip(samples, losses.double().numpy()):
        pos = 0
        for d in window_documents(run.cfg.data.shards_dir, smp.source, run.train_streams[smp.source], smp.start,
                                  len(smp.tokens)):
            lo, hi = max(pos - 1, 0), pos + d["tokens"] - 1  # targets whose next token is in this document
            pos += d["tokens"]
            key = (d["source"], d["file"], d["line"], d["doc_id"])
            acc = docs.setdefault(key, {**d, "tokens": 0, "loss_sum": 0.0})
            acc["tokens"] += hi - lo
            acc["loss_sum"] += float(row[lo:hi].sum())
    out = []
    for d in docs.values():
        if d["tokens"]:
            out.append({**{k: d[k] for k in ("source", "file", "line", "doc_id", "tokens")},
                        "loss": d["loss_sum"] / d["tokens"], "excess": d["loss_sum"] - median * d["tokens"]})
    return sorted(out, key=lambda d: -d["excess"])


def carriers(docs: list[dict], share: float = SHARE, limit: int = 20) -> list[dict]:
    """The fewest documents (at most ``limit``), largest excess first, whose positive excess loss adds up
    to ``share`` of the batch's; each with its ``share``. When some documents' loss is non-finite (a
    non-finite step), those documents, with ``share`` None: they carry all of it."""
    bad = [d for d in docs if not math.isfinite(d["loss"])]
    if bad:
        return [{**d, "share": None} for d in bad[:limit]]
    total = sum(d["excess"] for d in docs if math.isfinite(d["excess"]) and d["excess"] > 0)
    out, acc = [], 0.0
    for d in docs:
        if not total or not d["excess"] > 0 or len(out) >= limit or (out and acc >= share * total):
            break
        acc += d["excess"]
        out.append({**d, "share": d["excess"] / total})
    return out


def compare_ranks(partials: list[dict], row_losses: np.ndarray, grad_norm: float, batch_size: int,
                  rtol: float, loss_sum: float | None = None) -> list[dict]:
    """Each rank's logged local loss sum (its rows of the batch) and gradient norm against the replay's.

    ``row_losses``: (batch_size,) loss sums of the replayed rows (a plain forward); ``loss_sum``: the replayed
    step's own loss sum over the batch, after the data faults the replay re-creates (``loss_spike`` scales the
    step's loss after the forward): each rank's rows get their share of it, so a re-created fault does not look
    like a rank's error. A non-finite replayed sum gives non-finite shares, which agree with non-finite logs."""
    dp_size = max(p["dp_rank"] for p in partials) + 1
    per = batch_size // dp_size
    total = float(row_losses.sum())
    scale = loss_sum / total if loss_sum is not None and total else 1.0
    out = []
    for p in partials:
        mine = float(row_losses[p["dp_rank"] * per:(p["dp_rank"] + 1) * per].sum()) * scale
        loss_ok, grad_ok = close(p["loss_sum"], mine, rtol), close(p["grad_norm"], grad_norm, rtol)
        out.append({"rank": p["rank"], "dp_rank": p["dp_rank"], "loss_sum": p["loss_sum"], "replayed_loss_sum": mine,
                    "grad_norm": p["grad_norm"], "replayed_grad_norm": grad_norm,
                    "differs": [k for k, ok in (("loss", loss_ok), ("grad_norm", grad_ok)) if not ok]})
    return out


def check_arguments(run_dir: Path, step: int, rtol: float) -> None:
    """The arguments of :func:`replay` make sense: ``rtol`` finite and >= 0, ``step`` >= 1.

    Raises:
        ConfigError: one line naming the bad value.
    """
    if not (isinstance(rtol, (int, float)) and math.isfinite(rtol) and rtol >= 0):
        raise ConfigError(f"--rtol {rtol}: expected a finite relative tolerance >= 0 (e.g. 1e-3)")
    if step < 1:
        raise ConfigError(f"step {step}: expected a step >= 1 as in {run_dir}/metrics.jsonl (the STEP-th update)")


def replay_start(run_dir: Path, index: int, store: str = "") -> tuple[int, Path | None]:
    """(step, path) of the newest complete checkpoint at or before update ``index`` (``(0, None)``: none, the
    seeded initial weights), among the run directory's and those of its ``checkpoint.dir`` ``store`` (one there
    that the run directory lacks is fetched into the local cache: :func:`densetrain.checkpoint.localize`).

    Raises:
        DataError: that checkpoint's ``trainer_state.json`` lacks the sampler state (written by an older
            densetrain) or cannot be read: the batches after it cannot be re-drawn.
    """
    before = [(s, p) for s, p in run_checkpoints(run_dir, store) if s <= index]
    if not before:
        return 0, None
    start, ckpt = before[-1][0], Path(localize(before[-1][1]))
    try:
        state = read_trainer_state(ckpt)
    except CheckpointError as e:
        raise DataError(f"{e}: step {index + 1} cannot be replayed from it") from None
    if not isinstance(state, dict) or not isinstance(state.get("sampler"), dict) or not isinstance(
            state.get("step"), int):
        raise DataError(f"{ckpt}/trainer_state.json has no sampler state (written by an older densetrain?): the "
                        f"batches after step {start} cannot be re-drawn, so step {index + 1} cannot be replayed")
    return start, ckpt


def replay(run_dir: str | Path, step: int, rtol: float = 1e-3) -> dict:
    """The verdict on ``step`` (1-based, as in metrics.jsonl) of the run in ``run_dir`` (module docstring).

    Returns:
        ``{"step", "index", "checkpoint", "logged": {"loss", "grad_norm"}, "replayed": {...},
        "reproduced", "verdict": "data" | "machine", "ranks": [per-rank comparison], "suspect_ranks",
        "median", "documents": [carriers of the excess loss] (data), "text"}``.
    Raises:
        ConfigError: ``rtol`` not finite or negative, ``step`` < 1.
        DataError: no record of the step, or one without the numbers compared; a checkpoint without the sampler
            state; or the replayed sampler does not reach the recorded batch (one line each).
    """
    run_dir = Path(run_dir)
    check_arguments(run_dir, step, rtol)
    cfg = anchor_run_paths(load_config(path=run_dir / "config.toml"), run_dir)  # from any directory
    index = step - 1
    logged, spike = _logged(run_dir, cfg, step)
    start, ckpt = replay_start(run_dir, index, cfg.checkpoint.dir)  # none that early: the seeded initial weights
    rollbacks, skipped = _original_path(run_dir, start, index, spike)
    with tempfile.TemporaryDirectory(prefix="densetrain-replay-") as tmp, contextlib.redirect_stdout(sys.stderr):
        if ckpt is not None:
            (Path(tmp) / "checkpoints").mkdir()
            os.symlink(ckpt.resolve(), Path(tmp) / "checkpoints" / ckpt.name)
        run = setup(_replay_config(cfg, Path(tmp)), resume=ckpt is not None)
        for e in rollbacks:  # the data the run skipped after rolling back to this checkpoint
            v = e.get("values", {})
            if e.get("action") == "rollback":
                for s in range(start, v["from_step"]):
                    draw_samples(run.sampler, stage_at(s, run.stages), keep=range(0))
            elif e.get("action") == "skip_data":
                while run.sampler.state["samples_seen"] < v["skipped_samples"][1]:
                    draw_samples(run.sampler, stage_at(start, run.stages), keep=range(0))
        stage = None
        while True:
            st = stage_at(run.state.step, run.stages)
            if st != stage:
                run.model.set_rope(st.rope_theta, st.rope_scaling)
                stage = st
            for w in run.watchers:
                w.before_step(run)
            lr = lr_for(run.state.step, run.cfg, run.stages) * run.lr_scale
            set_lr(run.optimizer, lr)
            result = compute_step(run, st, lr)
            if run.state.step == index:
                break
            commit(run, result, Verdict.SKIP if run.state.step in skipped else Verdict.APPLY)
        if result.first_sample != logged["sample_index"]:
            raise DataError(f"{run_dir}: the replayed batch of step {step} starts at sample {result.first_sample}, "
                            f"the run's at {logged['sample_index']} (changed shards, or a manual --skip-batches?)")
        losses = _row_losses(run, st, result.samples)
        row_sums = losses.double().sum(dim=1).numpy()
        median = logged["median"] if logged["median"] is not None else result.loss
        docs = document_losses(run, result.samples, losses, median)
        run.log.close()
    ranks = compare_ranks(spike["values"]["ranks"], row_sums, result.grad_norm, st.batch_size, rtol,
                          result.stats.loss_sum) if spike and spike["values"].get("ranks") else []
    differ = [r["rank"] for r in ranks if r["differs"]]
    suspects = differ if len(differ) < len(ranks) else []
    same = close(logged["loss"], result.loss, rtol) and close(logged["grad_norm"], result.grad_norm, rtol)
    # A step that was non-finite and is again, from the same weights and data, reproduced: the data (or the
    # recipe) made it so; the ranks' parts of a non-finite sum compare nothing more.
    nonfinite = not (_finite(logged["loss"]) and _finite(logged["grad_norm"]))
    reproduced = same and (not differ or nonfinite)
    # A reproduced step whose loss is not above the window's median has no excess to blame on documents.
    excess = nonfinite or logged["loss"] > median
    verdict = ("data" if excess else "normal") if reproduced else "machine"
    documents = carriers(docs) if verdict == "data" else []
    if nonfinite and documents and documents[0]["share"] is not None:
        documents = []  # finite in a plain forward (e.g. overflowed afterwards): excess over a median means nothing
    out = {"step": step, "index": index, "checkpoint": ckpt.name if ckpt else "the initial weights",
           "logged": {k: logged[k] for k in ("loss", "grad_norm")},
           "replayed": {"loss": result.loss, "grad_norm": result.grad_norm}, "reproduced": reproduced,
           "verdict": verdict, "ranks": ranks, "suspect_ranks": suspects,
           "median": median, "documents": documents, "rtol": rtol}
    out["text"] = verdict_text(out)
    return out


def _doc_words(d: dict) -> str:
    """``source file:line id=ID (share, loss)`` of one carrier of :func:`carriers`."""
    where = f"{d['source']} {d['file']}" + (f":{d['line']}" if d["line"] is not None else "")
    what = "loss non-finite" if d["share"] is None else f"{d['share']:.0%}, loss {d['loss']:.3f}"
    return f"{where} id={d['doc_id']} ({what})"


def verdict_text(v: dict) -> str:
    """One paragraph: what was compared and what it means."""
    g = lambda x: "non-finite" if x is None or not math.isfinite(x) else f"{x:.5g}"
    head = (f"replay of step {v['step']} from {v['checkpoint']}: loss {g(v['replayed']['loss'])} (logged "
            f"{g(v['logged']['loss'])}), grad_norm {g(v['replayed']['grad_norm'])} (logged "
            f"{g(v['logged']['grad_norm'])})")
    if v["verdict"] == "normal":
        return (f"{head}: reproduced, and the loss is not above the median {v['median']:.4g} of the guard's "
                "window: not a spike, no data to blame")
    if v["verdict"] == "data":
        docs = "; ".join(_doc_words(d) for d in v["documents"][:5])
        n = len(v["documents"])
        more = f" and {n - 5} more" if n > 5 else ""
        if not n:  # e.g. a non-finite step whose every document scores finite in a plain forward
            return (f"{head}: reproduced, so the data or the recipe caused it (not the machine); no document "
                    "stands out: the batch as a whole, or the weights and lr before it")
        if v["documents"][0]["share"] is None:
            return (f"{head}: reproduced, so the data caused it (not the machine); {n} document"
                    f"{'s' if n != 1 else ''} with a non-finite loss: {docs}{more}")
        share = sum(d["share"] for d in v["documents"])
        return (f"{head}: reproduced, so the data caused it; {n} document{'s carry' if n != 1 else ' carries'} "
                f"{share:.0%} of the excess loss over the median {v['median']:.4g}: {docs}{more}")
    if v["suspect_ranks"]:
        what = ", ".join(f"rank {r['rank']} ({' and '.join(r['differs'])})" for r in v["ranks"] if r["differs"])
        return (f"{head}: not reproduced, so the machine (or nondeterminism) caused it; the replay differs from "
                f"the local results of {what} and agrees with the other ranks: exclude the node of "
                f"rank{'s' if len(v['suspect_ranks']) > 1 else ''} {', '.join(map(str, v['suspect_ranks']))} "
                "and resume from a checkpoint before the step")
    return (f"{head}: not reproduced, so the machine (or nondeterminism) caused it; no single rank's local "
            "results stand out (none were logged, or all differ): check every node, or nondeterministic kernels")


def append_event(run_dir: Path, v: dict, action: str | None = None) -> None:
    """Append the verdict ``v`` (or a failure: ``{"index", "text"}``) to ``RUN_DIR/events_replay.jsonl``."""
    values = {k: v[k] for k in v if k not in ("text", "index")}
    rec = {"kind": "replay", "step": v["index"], "rank": 0, "time": time.time(), "text": v["text"],
           "action": action or v.get("verdict"), "values": values}
    # One write() on an O_APPEND descriptor: replays started for spikes in a row may finish together.
    fd = os.open(Path(run_dir) / "events_replay.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json_text(rec) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
