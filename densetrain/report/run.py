"""What the report draws, read from a run directory: the metric records by kind, the structured
events, the stage spans, the validation points on each side of a stage switch, per-rank series, and the
ladder and prediction of a run trained with ``eval.ladder``.

No plotting here: the PNG (:mod:`densetrain.report.png`) and the HTML page
(:mod:`densetrain.report.html`) draw the same series, so they cannot disagree. Everything tolerates a
run that is still going or was killed: missing files give empty tables, torn lines are skipped.
"""

from __future__ import annotations

import colorsys
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from densetrain.fileio import MAX_CONFIG_BYTES, read_json, read_text_bounded
from densetrain.metrics import read_log_records, read_metrics

Points = list[tuple[int, float]]


@dataclass
class Event:
    """One structured event (``events.jsonl``): ``kind`` is e.g. stage, checkpoint, loss_spike,
    nonfinite, rollback, throughput, data_probe, fault, resume, note."""

    kind: str
    step: int
    text: str
    rank: int | None = None
    time: float | None = None
    action: str | None = None
    values: dict = field(default_factory=dict)


@dataclass
class StageSpan:
    """Consecutive train records of one stage; ``first``/``last`` are record steps (inclusive)."""

    name: str
    first: int
    last: int


@dataclass
class Boundary:
    """A stage switch and the eval records closest to it on each side, within the two stages
    (``None`` when a stage had no evaluation)."""

    step: int  # steps done at the switch (its 'stage' event's step); the new stage's first record is step + 1
    before: str
    after: str
    eval_before: dict | None
    eval_after: dict | None


@dataclass
class RunData:
    """Everything the report shows, by kind of record."""

    run_dir: Path
    train: list[dict]
    evals: list[dict]
    final_evals: list[dict]
    checkpoint_evals: list[dict]  # `densetrain eval` of saved checkpoints (RUN_DIR/evals/), as eval records
    perf: list[dict]
    events: list[Event]
    summary: dict
    config_text: str | None
    spans: list[StageSpan]
    boundaries: list[Boundary]
    ladder_dir: Path | None = None  # eval.ladder of a run with a prediction (the report's scaling panel)
    prediction: dict | None = None  # summary.json's prediction, else the 'prediction' event's values


def read_events(run_dir: Path, records: list[dict] | None = None) -> list[Event]:
    """The events of a run: ``RUN_DIR/events.jsonl`` (one JSON object a line; torn or malformed lines
    skipped), or, for runs older than that file, the ``kind="event"`` records of ``metrics.jsonl``
    (``records``; read when not given), which carry only ``step`` and ``text`` and are listed as notes."""
    path = Path(run_dir) / "events.jsonl"
    if not path.exists():
        records = read_metrics(run_dir) if records is None else records
        return [Event(kind="note", step=int(r.get("step", 0)), text=str(r.get("text", "")), time=r.get("time"))
                for r in records if r.get("kind") == "event"]
    out = []
    replays = Path(run_dir) / "events_replay.jsonl"  # `densetrain replay` verdicts (tools/replay.py)
    # Regular files only, malformed lines skipped and noted (read_log_records; a FIFO or a link to /dev/zero is one
    # line naming the file).
    recs = read_log_records(path) + (read_log_records(replays) if replays.exists() else [])
    for r in recs:
        out.append(Event(kind=r["kind"], step=r["step"], text=str(r.get("text") or ""),
                         rank=r.get("rank"), time=r.get("time"), action=r.get("action"),
                         values=r.get("values") if isinstance(r.get("values"), dict) else {}))
    return sorted(out, key=lambda e: e.time or 0) if replays.exists() else out


def read_checkpoint_evals(run_dir: Path) -> list[dict]:
    """The results ``densetrain eval`` wrote to ``RUN_DIR/evals/*.json``, each as an eval record
    (``kind="checkpoint_eval"``, ``step``, ``stage``, ``checkpoint``, ``val/<source>/loss`` and ``/bpb``,
    ``eval/<task>/<metric>``), by step; unreadable files (not JSON, not a regular file, over 16 MiB: an eval
    result is a few KiB) are skipped with a note on stderr."""
    out = []
    for path in sorted((Path(run_dir) / "evals").glob("*.json")):
        try:
            res = read_json(path, MAX_CONFIG_BYTES)
        except (OSError, ValueError) as e:
            print(f"densetrain: note: skipped {path} ({e})", file=sys.stderr)
            continue
        if not isinstance(res, dict) or not isinstance(res.get("step"), int):
            continue
        rec = {"kind": "checkpoint_eval", "step": res["step"], "stage": res.get("stage"),
               "checkpoint": res.get("checkpoint"), "file": path.name}
        for src, v in (res.get("val") or {}).items():
            if isinstance(v, dict):
                rec.update({f"val/{src}/{k}": v[k] for k in ("loss", "bpb") if k in v})
        rec.update({f"eval/{k}": v for k, v in (res.get("downstream") or {}).items()})
        out.append(rec)
    return sorted(out, key=lambda r: r["step"])


def stage_spans(train: list[dict]) -> list[StageSpan]:
    """Runs of consecutive train records with the same ``stage`` (records in step order)."""
    spans: list[StageSpan] = []
    for r in train:
        name = str(r.get("stage", "?"))
        if spans and spans[-1].name == name:
            spans[-1].last = r["step"]
        else:
            spans.append(StageSpan(name, r["step"], r["step"]))
    return spans


def stage_boundaries(spans: list[StageSpan], evals: list[dict], key: str = "val/all/loss") -> list[Boundary]:
    """For each stage switch, the last eval record with ``key`` inside the stage that ends and the first
    one inside the stage that begins, so the two points show what the switch did.

    An eval record at step ``k`` scores the model after update ``k``, which the train record of step
    ``k`` belongs to, so it is inside a span when ``first <= k <= last``.
    """
    scored = sorted((r for r in evals if key in r), key=lambda r: r["step"])
    out = []
    for a, b in zip(spans, spans[1:]):
        before = [r for r in scored if a.first <= r["step"] <= a.last]
        after = [r for r in scored if b.first <= r["step"] <= b.last]
        # A record's step counts the steps completed, so the stage that begins after step k has its first
        # record at k + 1; the switch is at k, the step its 'stage' event and the console give it.
        out.append(Boundary(b.first - 1, a.name, b.name, before[-1] if before else None, after[0] if after else None))
    return out


def ladder_of(summary: dict, events: list[Event], config_text: str | None) -> tuple[Path | None, dict | None]:
    """The ladder a run was trained with (``eval.ladder``) and its prediction: ``summary.json``'s ``prediction``
    (with the outcome) of a finished run, else the ``prediction`` event's values (a running or killed run);
    the ladder directory from the prediction, else from ``config.toml`` (``(None, None)``: no ladder)."""
    pred = summary.get("prediction") if isinstance(summary.get("prediction"), dict) else None
    if pred is None:
        pred = next((e.values for e in events if e.kind == "prediction" and e.values.get("flops")), None)
    ladder = (pred or {}).get("ladder")
    if not ladder and config_text:
        try:
            ladder = tomllib.loads(config_text).get("eval", {}).get("ladder")
        except tomllib.TOMLDecodeError:
            ladder = None
    return (Path(ladder) if isinstance(ladder, str) and ladder else None), pred


def load_run(run_dir: Path) -> RunData:
    """Read ``metrics.jsonl``, ``events.jsonl``, ``summary.json``, ``config.toml`` and ``evals/`` of a run.

    Raises:
        FileNotFoundError: the run has no training records.
    """
    run_dir = Path(run_dir)
    recs = read_metrics(run_dir)
    by_kind: dict[str, list[dict]] = {}
    for r in recs:
        if isinstance(r.get("step"), int):
            by_kind.setdefault(str(r.get("kind")), []).append(r)
    for rs in by_kind.values():
        rs.sort(key=lambda r: r["step"])  # stable: a rank's records keep their order within a step
    train = by_kind.get("train", [])
    if not train:
        raise FileNotFoundError(f"{run_dir / 'metrics.jsonl'}: no training records")
    evals = by_kind.get("eval", [])
    summary_path, config_path = run_dir / "summary.json", run_dir / "config.toml"
    try:  # a few KiB (train/loop.py); not a regular file or over 16 MiB: one line naming it (ReadRefused)
        summary = read_json(summary_path, MAX_CONFIG_BYTES) if summary_path.exists() else {}
    except ValueError:  # not JSON (a hand edit): the report goes on without it
        summary = {}
    summary = summary if isinstance(summary, dict) else {}
    spans = stage_spans(train)
    events = sorted(read_events(run_dir, recs), key=lambda e: e.step)  # stable: same-step order kept
    config_text = read_text_bounded(config_path, errors="replace") if config_path.exists() else None
    ladder_dir, prediction = ladder_of(summary, events, config_text)
    return RunData(run_dir=run_dir, train=train, evals=evals, final_evals=by_kind.get("final_eval", []),
                   checkpoint_evals=read_checkpoint_evals(run_dir), perf=by_kind.get("perf", []), summary=summary,
                   events=events, config_text=config_text, spans=spans, boundaries=stage_boundaries(spans, evals),
                   ladder_dir=ladder_dir, prediction=prediction)


def step_range(data: RunData) -> tuple[float, float]:
    """The x range every panel shares: the first step that has a record or an event to the last train
    record, half a step of margin each side (the stage bands' edges)."""
    first = min([data.train[0]["step"]] + [e.step for e in data.events])
    return first - 0.5, data.train[-1]["step"] + 0.5


def points(records: list[dict], key: str) -> Points:
    """``(step, value)`` of every record that has a numeric ``key``."""
    return [(r["step"], float(r[key])) for r in records
            if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]


def keys(records: list[dict], prefix: str, suffix: str = "") -> list[str]:
    """Sorted metric names of ``records`` that start with ``prefix`` and end with ``suffix``."""
    return sorted({k for r in records for k in r if k.startswith(prefix) and k.endswith(suffix)})


def headline_keys(records: list[dict]) -> tuple[list[str], list[str]]:
    """The ``eval/<task>/headline`` names of ``records``, split by unit: ``(scores, bits_per_byte)``. Scores
    are fractions in [0, 1], higher better (``acc``, ``acc_norm``, ``exact_match``, ``pass_at_1``); a task
    whose headline is bits per byte (``gsm8k_bpb``, ``humaneval_bpb``: the headline equals its ``bpb`` and it
    has no ``acc``) is lower-better and unbounded, so the two never share an axis."""
    bpb = {k for r in records for k in r if k.startswith("eval/") and k.endswith("/headline")
           and r.get(k[:-len("headline")] + "bpb") == r[k] and k[:-len("headline")] + "acc" not in r}
    heads = keys(records, "eval/", "/headline")
    return [k for k in heads if k not in bpb], [k for k in heads if k in bpb]


def per_rank(data: RunData, key: str) -> dict[str, Points]:
    """``key`` per rank: from the ``kind="perf"`` records that carry a ``rank`` (one series each,
    ``"rank N"``), else the train records (``"all ranks"``: a single-rank run, or the global number)."""
    ranked: dict[int, Points] = {}
    for r in data.perf:
        if isinstance(r.get("rank"), int):
            ranked.setdefault(r["rank"], []).extend(points([r], key))
    ranked = {k: v for k, v in ranked.items() if v}
    if ranked:
        return {f"rank {k}": ranked[k] for k in sorted(ranked)}
    pts = points(data.train, key)
    return {"all ranks": pts} if pts else {}


def source_name(key: str) -> str:
    """``'val/books/loss'`` -> ``'books'``; ``'eval/hellaswag/headline'`` -> ``'hellaswag'``."""
    return key.split("/")[1]


def unigram_baselines(summary: dict) -> dict[str, float]:
    """Unigram entropy (nats/token) per source and ``all`` from ``summary.json``'s val table."""
    return {s: float(v["unigram_entropy"]) for s, v in summary.get("val", {}).items()
            if isinstance(v, dict) and isinstance(v.get("unigram_entropy"), (int, float))}


def loss_at(train: list[dict], step: int) -> float | None:
    """Train loss of the last record at or before ``step`` (the first record's for earlier steps): the
    height of an event marker on the loss curve."""
    losses = points(train, "loss")
    before = [v for s, v in losses if s <= step]
    return before[-1] if before else (losses[0][1] if losses else None)


# One colour per event kind, shared by the PNG and the HTML page; unknown kinds are grey.
EVENT_COLORS = {
    "stage": "#4c4c4c", "checkpoint": "#2ca02c", "loss_spike": "#d62728", "nonfinite": "#9467bd",
    "rollback": "#ff7f0e", "throughput": "#8c564b", "data_probe": "#e377c2", "fault": "#000000",
    "resume": "#17becf", "epoch": "#bcbd22", "note": "#7f7f7f", "replay": "#1f77b4", "replica_mismatch": "#e31a1c",
    "update_norm": "#fdbf6f",
}
# Series colours (matplotlib's tab10) and the stage-band fills.
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf"]
# After tab10, its light tints (tab20's other half): a report with more than ten downstream tasks (arc_easy and
# winogrande are the 2nd and 12th) still gives each its own colour.
_TINTS = ["#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7", "#dbdb8d",
          "#9edae5"]
STAGE_FILLS = ["#e8f0fe", "#fdecea", "#e6f4ea", "#fef7e0", "#f3e8fd"]


def task_colors(names: list[str]) -> dict[str, str]:
    """A distinct colour per name (the downstream tasks of both panels, scores and bits per byte, so two tasks
    never share one across panels): tab10, then tab20's tints, then hues spaced by the golden ratio (distinct
    for any count; shades close together only past 20 tasks)."""
    out = {}
    for i, name in enumerate(dict.fromkeys(names)):
        if i < len(PALETTE) + len(_TINTS):
            out[name] = (PALETTE + _TINTS)[i]
        else:
            r, g, b = colorsys.hsv_to_rgb(i * 0.618033988749895 % 1.0, 0.65, 0.8)
            out[name] = f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"
    return out


def event_color(kind: str) -> str:
    return EVENT_COLORS.get(kind, "#7f7f7f")


def format_values(values: dict) -> str:
    """An event's ``values`` as ``k=v, ...`` with floats to 4 significant digits."""
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())
