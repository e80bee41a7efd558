"""A signal never waits for a whole evaluation (issue 36.3): SIGTERM to one of two ranks during an in-loop
validation of a real run abandons it on both between the same two batches, checkpoints the step and exits 75;
every evaluator (validation loss, loss by position, downstream scoring, generation) asks ``should_stop`` before
each forward batch and stops at once."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_resume import OV, finish, fresh, start, wait_for_step

from densetrain.checkpoint import list_complete
from densetrain.data.streams import open_streams
from densetrain.evals.generative import greedy_generate
from densetrain.evals.position_loss import evaluate_position_loss
from densetrain.evals.scoring import Request, score_requests
from densetrain.evals.stop import EvalStopped
from densetrain.evals.valloss import evaluate_val
from densetrain.metrics import read_events, read_metrics
from densetrain.model.init import build_model
from densetrain.train.preempt import EXIT_PREEMPTED


def test_sigterm_to_one_rank_during_validation_abandons_it_on_both_checkpoints_the_step_and_exits_75(prepared,
                                                                                                    tmp_path):
    _, make = prepared
    # Every held-out window (~1300), one per forward (micro_batch_size 1): a validation of seconds, ms per batch.
    cfg = make(tmp_path, **{**OV, "train.steps": 6, "checkpoint.every": 100, "eval.every": 2, "model.n_layers": 4,
                            "eval.max_batches": 100_000, "train.micro_batch_size": 1, "parallel.dp_shard": 2,
                            "parallel.dp_replicate": 1,
                            "stages": [{"name": "main", "start": 0.0, "mix": {"email": 0.5, "json": 0.5}}]})
    run = Path(cfg.train.run_dir)
    procs = start(fresh(cfg, tmp_path), world=2)
    wait_for_step(run, 4, procs, timeout=300)  # step 4's record is written, then its validation starts
    time.sleep(0.05)
    t0 = time.monotonic()
    procs[1].send_signal(signal.SIGTERM)  # rank 1 only: rank 0 learns it from the all-reduced stop check
    results = finish(procs)
    latency = time.monotonic() - t0
    assert [rc for rc, _ in results] == [EXIT_PREEMPTED] * 2, [err[-3000:] for _, err in results]
    (ev,) = [e for e in read_events(run) if e["kind"] == "preempt"]
    full = next(r["time/eval_s"] for r in read_metrics(run) if r["kind"] == "eval" and r["step"] == 2)
    # The step-2 validation ran whole; step 4's was abandoned by both ranks (not logged), and step 4 is checkpointed.
    assert ev["step"] == 4 and ev["values"]["abandoned"] == "validation", ev
    assert "its validation abandoned part-way" in ev["text"]
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "eval"] == [2]
    assert [s for s, _ in list_complete(run)] == [4]
    # The signal to the exit of both ranks: a batch and the checkpoint, well below the rest of a validation.
    assert full > 0.5 and latency < full, (latency, full)
    print(f"validation {full:.2f} s; signal -> exit {latency:.2f} s (checkpoint {ev['values']['seconds']:.2f} s)")


class Budget:
    """``should_stop()`` that says True from its ``n + 1``-th call on, counting the calls."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.calls > self.n


def forwards(model, fn) -> int:
    """Forward calls of ``model`` while ``fn()`` runs (whether it returns or raises :class:`EvalStopped`)."""
    calls = []
    hook = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        fn()
    except EvalStopped:
        pass
    finally:
        hook.remove()
    return len(calls)


@pytest.fixture(scope="module")
def evaluators(prepared, tmp_path_factory):
    _, make = prepared
    cfg = make(tmp_path_factory.mktemp("stop"))
    return cfg, build_model(cfg.model, 0), open_streams(cfg, "val")


def test_every_evaluator_asks_before_each_forward_batch_and_stops_there(evaluators):
    cfg, model, streams = evaluators
    runs = {
        "validation": lambda m, s: evaluate_val(m, streams, 32, 2, 4, torch.device("cpu"), should_stop=s),
        "position": lambda m, s: evaluate_position_loss(m, streams, 48, 4, [0, 16], torch.device("cpu"),
                                                        should_stop=s),
        "scoring": lambda m, s: score_requests(m, [Request(tuple(range(1, 3 + k)), 1, 1, 1) for k in range(20)],
                                               "cpu", batch_size=4, should_stop=s),
        "generation": lambda m, s: greedy_generate(m, [[1, 2, 3]] * 8, 3, "cpu", eos_id=0, batch_size=2,
                                                   should_stop=s),
    }
    for name, fn in runs.items():
        whole = forwards(model, lambda fn=fn: fn(model, None))  # never asked: runs to its end
        budget = Budget(2)
        with pytest.raises(EvalStopped):
            fn(model, budget)
        stopped = forwards(model, lambda fn=fn: fn(model, Budget(2)))
        assert budget.calls == 3, name  # asked before the first, second and third batch; stopped at the third
        # Two batches ran; a generation batch is several forwards (prefill, then one per new token): 4 batches.
        per_batch = whole // 4 if name == "generation" else 1
        assert stopped == 2 * per_batch < whole, (name, stopped, whole)
    assert np.isfinite(runs["validation"](model, None)["email"]["loss"])
