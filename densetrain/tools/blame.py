"""``densetrain blame RUN STEP``: the documents whose tokens made the global batch of a step.

Nothing is logged per step for this: the mixture sampler is deterministic, so the batch of step
``STEP`` (the ``step`` of its ``metrics.jsonl`` record: the update with index ``STEP - 1``) is
re-drawn from the newest checkpoint before it (its sampler state), replaying the steps in between,
including the data that rollbacks skipped (from ``events.jsonl``). Each window is then mapped to
documents through the shard index and ``provenance.json``. The replay checks itself against the
record's ``sample_index`` and fails loudly when they disagree.

The shards must be those the step was trained on: every checkpoint records a fingerprint of the train
shards (``trainer_state.json`` ``data``: names, sizes, modification times), and the one saved after the
step (else the one before it) must match the shards there now; after a re-prepare blame refuses in one
line instead of naming other documents. The rollback events replayed are checked too (types, and bounds:
``from_step`` within ``train.steps``, skipped samples within the step's ``sample_index``), so a crafted
``events.jsonl`` cannot make the replay loop for ever or trace back.
"""

from __future__ import annotations

import sys
from pathlib import Path

from densetrain.checkpoint import localize, read_trainer_state, run_checkpoints
from densetrain.config import anchor_run_paths, load_config
from densetrain.data.mixture import MixtureSampler
from densetrain.data.provenance import window_documents
from densetrain.data.streams import data_fingerprint, open_streams
from densetrain.dcp_read import read_metadata, verify_checkpoint
from densetrain.errors import DataError
from densetrain.metrics import read_events, read_metrics
from densetrain.schedule import resolve_stages, stage_at
from densetrain.train.step import draw_samples

STATE_FILES = (".metadata", "trainer_state.json")
"""The files of a checkpoint that blame reads (with its marker): a checkpoint in the store is fetched without its
weights."""


def _draw(sampler: MixtureSampler, stages, step: int, keep: range | None = None):
    st = stage_at(step, stages)
    return st, draw_samples(sampler, st, keep)


def blame(run_dir: str | Path, step: int) -> dict:
    """The global batch of ``step`` (1-based, as in metrics.jsonl) with its documents.

    Returns:
        ``{"step", "stage", "sample_index", "samples": [{"index", "source", "start", "tokens",
        "documents": [{"source", "file", "line", "doc_id", "tokens"}, ...]}, ...]}`` where ``tokens``
        of a sample is its token ids (seq_len + 1).
    Raises:
        DataError: no such step in the run, or the replay does not reproduce the recorded batch.
        CheckpointError, CheckpointReadError: the checkpoint replayed from has an unreadable
            ``trainer_state.json`` or ``.metadata``; UntrustedCheckpointError: a crafted ``.metadata``.
    """
    run_dir = Path(run_dir)
    cfg = anchor_run_paths(load_config(path=run_dir / "config.toml"), run_dir)  # from any directory
    record = next((r for r in read_metrics(run_dir) if r.get("kind") == "train" and r["step"] == step), None)
    if record is None:
        raise DataError(f"{run_dir}/metrics.jsonl: no train record for step {step}")
    streams = open_streams(cfg, "train")
    stages = resolve_stages(cfg, available=set(streams))
    index = step - 1
    sampler = MixtureSampler(streams)
    start, base = 0, None
    done = run_checkpoints(run_dir, cfg.checkpoint.dir)  # the run dir's, and the store's it lacks (URLs)
    for s, path in done:
        if s <= index:
            start, base = s, path
    _check_shards(run_dir, step, streams, done)
    if base is not None:
        base = Path(localize(base, STATE_FILES))
        # Only the JSON sampler state is used, but a checkpoint holding a crafted .metadata is refused as by
        # every reader of checkpoints (the trust rule; one line naming the file), a damaged one too.
        verify_checkpoint(base, names=[".metadata"])
        read_metadata(base)
        saved = read_trainer_state(base).get("sampler")
        try:
            if saved is None:
                raise KeyError("missing")
            sampler.load_state_dict(saved)
        except (ValueError, TypeError, KeyError) as e:
            raise DataError(f"{base}/trainer_state.json: sampler: {e} (expected the sampler state of this "
                            "run's sources)") from None
    # Rollbacks to that checkpoint: the steps they undid drew data too (the data they skip), and a
    # manual rollback may skip batches; replayed in the order they happened.
    for e, v in _rollback_events(run_dir, start, index, cfg.train.steps, record):
        if e.get("action") == "rollback":
            for s in range(start, v["from_step"]):
                _draw(sampler, stages, s, keep=range(0))
        elif e.get("action") == "skip_data":
            while sampler.state["samples_seen"] < v["skipped_samples"][1]:
                _draw(sampler, stages, start, keep=range(0))
    for s in range(start, index):
        _draw(sampler, stages, s, keep=range(0))
    first = sampler.state["samples_seen"]
    st, samples = _draw(sampler, stages, index)
    if first != record["sample_index"]:
        raise DataError(f"{run_dir}: replaying the sampler to step {step} gives sample {first}, but the run recorded "
                        f"{record['sample_index']} (a manual --skip-batches or changed shards?)")
    out = []
    for smp in samples:
        docs = window_documents(cfg.data.shards_dir, smp.source, streams[smp.source], smp.start, len(smp.tokens))
        out.append({"index": smp.index, "source": smp.source, "start": smp.start, "tokens": smp.tokens.tolist(),
                    "documents": docs})
    return {"step": step, "stage": st.name, "sample_index": first, "samples": out}


def _check_shards(run_dir: Path, step: int, streams, done: list) -> None:
    """The train shards now are those step ``step`` was trained on: the data fingerprint recorded by the
    first checkpoint saved at or after it (its process trained the step), else by the newest before it, of the
    run's checkpoints ``done`` (:func:`densetrain.checkpoint.run_checkpoints`).

    Raises:
        DataError: they differ (re-prepared, or copied without keeping modification times).
    """
    after = [(s, p) for s, p in done if s >= step]
    s, path = (after[0] if after else done[-1]) if done else (None, None)
    if path is None:
        print(f"densetrain: note: {run_dir} has no checkpoint recording its train shards; blame cannot check that "
              f"they are still the ones step {step} was trained on", file=sys.stderr)
        return
    recorded = read_trainer_state(Path(localize(path, STATE_FILES))).get("data", {})
    now = data_fingerprint(streams)
    changed = sorted(k for k in set(recorded) | set(now) if recorded.get(k) != now.get(k))
    if changed:
        raise DataError(f"{run_dir}: the train shards of {changed} differ from those step {step} was trained on "
                        f"(recorded in {path.name}): re-prepared since? blame would name other documents; "
                        "blame with the shards the run used")


def _rollback_events(run_dir: Path, start: int, index: int, max_step: int, record: dict) -> list[tuple[dict, dict]]:
    """The rollback events of ``events.jsonl`` that returned to checkpoint ``start`` (only when ``start`` <=
    ``index``), each with its values, checked: ``rollback`` has an integer ``from_step`` in
    ``start + 1 .. max_step`` (``train.steps``); ``skip_data`` has ``skipped_samples`` ``[a, b]``, integers
    with ``0 <= a <= b <=`` the record's ``sample_index`` (the samples seen before the step).

    Raises:
        DataError: one line naming events.jsonl, the event's step and the key.
    """
    if start > index:
        return []
    out, limit = [], record.get("sample_index")
    for e in read_events(run_dir):
        if not isinstance(e, dict) or e.get("kind") != "rollback" or e.get("step") != start:
            continue
        v = e.get("values", {})
        where = f"{run_dir}/events.jsonl: rollback event at step {start}"
        if not isinstance(v, dict):
            raise DataError(f"{where}: values: expected an object")
        if e.get("action") == "rollback":
            f = v.get("from_step")
            if type(f) is not int or not start < f <= max_step:
                raise DataError(f"{where}: from_step: expected an integer in {start + 1}..{max_step} (train.steps), "
                                f"got {str(f)[:40]}")
        elif e.get("action") == "skip_data":
            sk = v.get("skipped_samples")
            if not (isinstance(sk, list) and len(sk) == 2 and all(type(x) is int for x in sk)
                    and type(limit) is int and 0 <= sk[0] <= sk[1] <= limit):
                raise DataError(f"{where}: skipped_samples: expected [first, last] integers with 0 <= first <= "
                                f"last <= {limit} (the step's sample_index), got {str(sk)[:60]}")
        else:
            continue
        out.append((e, v))
    return out


def _where(doc: dict) -> str:
    """``file:line`` for a jsonl document; just ``file`` when the source has no lines (text format: one
    document per file, ``line`` None)."""
    return doc["file"] if doc["line"] is None else f"{doc['file']}:{doc['line']}"


def format_blame(res: dict) -> str:
    """One line per document: sample index, source, file:line, doc id, tokens of it in the window."""
    lines = [f"step {res['step']} (stage {res['stage']}): {len(res['samples'])} sequences from sample "
             f"{res['sample_index']}"]
    for smp in res["samples"]:
        for d in smp["documents"]:
            lines.append(f"  sample {smp['index']:>7}  {d['source']:<12} {_where(d)}  id={d['doc_id']}  "
                         f"{d['tokens']} tokens")
    return "\n".join(lines)
