"""``densetrain blame RUN STEP``: the documents whose tokens made the global batch of a step.

Nothing is logged per step for this: the mixture sampler is deterministic, so the batch of step
``STEP`` (the ``step`` of its ``metrics.jsonl`` record: the update with index ``STEP - 1``) is
re-drawn from the newest checkpoint before it (its sampler state), replaying the steps in between,
including the data that rollbacks skipped (from ``events.jsonl``). Each window is then mapped to
documents through the shard index and ``provenance.json``. The replay checks itself against the
record's ``sample_index`` and fails loudly when they disagree.
"""

from __future__ import annotations

from pathlib import Path

from densetrain.checkpoint import list_complete, read_trainer_state
from densetrain.config import load_config
from densetrain.data.mixture import MixtureSampler
from densetrain.data.provenance import window_documents
from densetrain.data.streams import open_streams
from densetrain.dcp_read import read_metadata
from densetrain.errors import DataError
from densetrain.metrics import read_events, read_metrics
from densetrain.schedule import resolve_stages, stage_at
from densetrain.train.step import draw_samples


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
    cfg = load_config(path=run_dir / "config.toml")
    record = next((r for r in read_metrics(run_dir) if r.get("kind") == "train" and r["step"] == step), None)
    if record is None:
        raise DataError(f"{run_dir}/metrics.jsonl: no train record for step {step}")
    streams = open_streams(cfg, "train")
    stages = resolve_stages(cfg, available=set(streams))
    index = step - 1
    sampler = MixtureSampler(streams)
    start, base = 0, None
    for s, path in list_complete(run_dir):
        if s <= index:
            start, base = s, path
    if base is not None:
        # Only the JSON sampler state is used, but a checkpoint holding a crafted .metadata is refused as by
        # every reader of checkpoints (the trust rule; one line naming the file).
        read_metadata(base)
        sampler.load_state_dict(read_trainer_state(base)["sampler"])
    # Rollbacks to that checkpoint: the steps they undid drew data too (the data they skip), and a
    # manual rollback may skip batches; replayed in the order they happened.
    for e in read_events(run_dir):
        v = e.get("values", {})
        if e.get("kind") != "rollback" or e.get("step") != start or start > index:
            continue
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


def format_blame(res: dict) -> str:
    """One line per document: sample index, source, file:line, doc id, tokens of it in the window."""
    lines = [f"step {res['step']} (stage {res['stage']}): {len(res['samples'])} sequences from sample "
             f"{res['sample_index']}"]
    for smp in res["samples"]:
        for d in smp["documents"]:
            lines.append(f"  sample {smp['index']:>7}  {d['source']:<12} {d['file']}:{d['line']}  id={d['doc_id']}  "
                         f"{d['tokens']} tokens")
    return "\n".join(lines)
