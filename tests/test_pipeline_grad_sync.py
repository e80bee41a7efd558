"""``parallel.pp_grad_sync`` (densetrain/parallel/pipeline.py): when a pipelined FSDP2 rank reduce-scatters.

Under ``"last"`` (torch's ``PipelineStage``) every gradient of a rank's stages stays unsharded in fp32 until the
last micro-batch of a schedule call; under ``"microbatch"`` (:func:`~densetrain.parallel.pipeline.
reduce_scatter_backward`) FSDP2 reduce-scatters each micro-batch and accumulates shards. One 4-rank gloo job
(pp 2 x dp_shard 2, fp32, an 8-block model, 4 micro-batches of one row per rank and step), for ``1f1b`` and
``interleaved_1f1b`` (2 stages a rank), under both values:

* (a) at every forward of a step (after some micro-batch's backward) no parameter group holds an unsharded
  gradient under "microbatch", while under "last" they do and no shard has been reduced yet;
* the peak bytes a rank holds gathered (parameters, unsharded gradients and FSDP2's reduce-scatter input
  buffers, at each FSDP2 post-backward, where FSDP2 reduces) equal the memory plan's transient term
  (:func:`~densetrain.tools.plan.memory.layout_memory`) under "last", and under "microbatch" on the last
  pipeline rank of 1f1b, and never exceed it;
* (b) the gradients of a step equal one process's and each other's within 1e-5;
* (c) three AdamW steps' losses equal one process's.

The same under HSDP (pp 2 x dp_replicate 2 x dp_shard 2, 8 ranks, 1f1b; slow). What FSDP2 holds is read from
its parameter groups (torch's private ``FSDPParamGroup`` fields, observed only: ``post_backward`` is wrapped to
look before it runs, never replaced).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_script_ranks

from densetrain.config import load_config
from densetrain.errors import ConfigError
from densetrain.parallel.mesh import Layout
from densetrain.tools.plan.memory import layout_memory, model_counts, pipeline_fit, pipeline_ranks

_WORKER = r"""
import json, os, sys
root, layout, out = sys.argv[1:]
HSDP = layout == "hsdp"  # pp 2 x dp_replicate 2 x dp_shard 2 (8 ranks), else pp 2 x dp_shard 2
sys.path.insert(0, root)
import torch
torch.set_num_threads(1)
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from densetrain.config import load_config
from densetrain.model.init import build_model
from densetrain.optim import build_optimizer, set_lr
from densetrain.parallel import build_parallel_model, init_distributed
from densetrain.parallel.mesh import Layout
from densetrain.tools.plan.memory import layout_memory, model_counts
from densetrain.train.step import forward_backward

T, M, STEPS, LR = 16, 4, 3, 3e-3  # per step: 4 micro-batches of 1 row on each dp rank
B = M * (4 if HSDP else 2)  # rows per step


def config(schedule, mode, **more):
    over = {"model.vocab_size": 512, "model.d_model": 64, "model.n_layers": 8, "model.n_heads": 4,
            "model.n_kv_heads": 2, "model.d_ff": 128, "model.tie_embeddings": False, "model.document_mask": False,
            "train.seed": 3, "train.device": "cpu", "train.dtype": "fp32", "eval.tasks": "", "eval.final_tasks": "",
            "eval.samples": 0, "stages": [{"name": "main"}], "parallel.pp": 2, "parallel.dp_replicate": 1 + HSDP,
            "parallel.dp_shard": 2, "parallel.pp_schedule": schedule, "parallel.pp_microbatches": M,
            "parallel.pp_virtual_stages": 2 if schedule == "interleaved_1f1b" else 1, "parallel.pp_grad_sync": mode}
    return load_config(preset="tiny", overrides=list({**over, **more}.items()))


class Watch:
    # What the rank holds of its gradients during a step, read from FSDP2's parameter groups (observed only).
    groups, seen, peak, on = [], [], 0, False

    @classmethod
    def held(cls):
        grads = sum(t.numel() for g in cls.groups for fp in g.fsdp_params
                    for t in (fp.unsharded_accumulated_grad, getattr(getattr(fp, "_unsharded_param", None), "grad",
                                                                       None)) if t is not None)
        gathered = sum(fp.sharded_param.numel() for g in cls.groups if g.is_unsharded for fp in g.fsdp_params)
        # a reduced group's flat reduce-scatter input, kept until the next group's reduction
        staged = {id(st.reduce_scatter_input): st.reduce_scatter_input.numel() for g in cls.groups
                  for st in g.comm_ctx.reduce_scatter_states}
        return grads, sum(staged.values()), gathered

    @classmethod
    def before_forward(cls, *_):
        if cls.on:
            grads, _, _ = cls.held()
            shards = sum(1 for g in cls.groups for fp in g.fsdp_params if fp.sharded_param.grad is not None)
            partial = sum(1 for g in cls.groups if g._partial_reduce_output is not None)  # HSDP: awaiting all-reduce
            cls.seen.append([grads, shards, partial])


_post_backward = FSDPParamGroup.post_backward


def post_backward(self, *args):
    if Watch.on:
        Watch.peak = max(Watch.peak, 4 * sum(Watch.held()))  # fp32 bytes
    return _post_backward(self, *args)


FSDPParamGroup.post_backward = post_backward


def batch(step):  # the same rows every step: the loss must fall
    return torch.randint(0, 512, (B, T + 1), generator=torch.Generator().manual_seed(100))


def micro_batches(x):
    return [(x[i:i + 1, :-1], x[i:i + 1, 1:], ["s"]) for i in range(len(x))]


def run(schedule, mode):
    cfg = config(schedule, mode)
    info = init_distributed("cpu", cfg.parallel)
    model, pipe = build_parallel_model(cfg, info)
    Watch.groups = list({id(g): g for c in pipe.chunks for m in c.modules() if isinstance(m, FSDPModule)
                         for g in [m._get_fsdp_state()._fsdp_param_group] if g is not None}.values())
    for c in pipe.chunks:
        c.register_forward_pre_hook(Watch.before_forward)
    opt = build_optimizer(model, cfg)
    rows = slice(info.dp_rank * M, (info.dp_rank + 1) * M)
    res = {"losses": [], "seen": [], "decisions": [d for d in pipe.decisions if "pp_grad_sync" in d]}
    for step in range(STEPS):
        Watch.seen, Watch.peak, Watch.on = [], 0, step > 0  # the first step also builds the stages
        stats = forward_backward(pipe, micro_batches(batch(step)[rows]), B * T, info.grad_scale)
        Watch.on = False
        if step == 0:
            res["grads"] = {n: p.grad.full_tensor().flatten().tolist() for n, p in model.named_parameters()}
        else:
            res["seen"].append(Watch.seen)
            res["peak"] = Watch.peak
        loss = torch.tensor([stats.loss_sum], dtype=torch.float64)
        dist.all_reduce(loss)  # the last stage's ranks hold the losses, each of its dp ranks its rows'
        res["losses"].append(float(loss) / (B * T))
        set_lr(opt, LR)
        opt.step()
        opt.zero_grad(set_to_none=True)
    virtual = cfg.parallel.pp_virtual_stages
    plan = layout_memory(model_counts(cfg.model), cfg.model, T, 1, Layout(1 + HSDP, 2, 1, 1, 2), "none",
                         mixed_precision=False, pipeline={"schedule": schedule, "virtual": virtual,
                                                          "microbatches": M, "grad_sync": mode}, pp_rank=info.pp_rank)
    res["planned"] = plan["transient"]
    res["pp_rank"] = info.pp_rank
    return res


def one_process():
    cfg = config("1f1b", "last")
    model = build_model(cfg.model, cfg.train.seed, "cpu")
    opt = build_optimizer(model, cfg)
    res = {"losses": []}
    for step in range(STEPS):
        stats = forward_backward(model, micro_batches(batch(step)), B * T)
        if step == 0:
            res["grads"] = {n: p.grad.flatten().tolist() for n, p in model.named_parameters()}
        res["losses"].append(stats.loss_sum / (B * T))
        set_lr(opt, LR)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return res


schedules = ("1f1b",) if HSDP else ("1f1b", "interleaved_1f1b")
result = {f"{s}/{m}": run(s, m) for s in schedules for m in ("last", "microbatch")}
result["one"] = one_process()
if not HSDP:
    tp = config("1f1b", "microbatch", **{"parallel.dp_shard": 1, "parallel.tp": 2})
    _, pipe = build_parallel_model(tp, init_distributed("cpu", tp.parallel))
    result["no_fsdp"] = [d for d in pipe.decisions if "pp_grad_sync" in d]
with open(f"{out}.{dist.get_rank()}", "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
"""

SCHEDULES = ("1f1b", "interleaved_1f1b")
M = 4  # micro-batches per rank and step (the worker's)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The 4-rank job's results, one dict per rank (the worker above)."""
    return job(tmp_path_factory, "fsdp", 4)


@pytest.fixture(scope="module")
def hsdp_ranks(tmp_path_factory):
    """The same under HSDP, 8 ranks (pp 2 x dp_replicate 2 x dp_shard 2), 1f1b only."""
    return job(tmp_path_factory, "hsdp", 8)


def job(tmp_path_factory, layout: str, world: int) -> list[dict]:
    out = run_script_ranks(_WORKER, tmp_path_factory.mktemp(f"pp_grad_sync_{layout}"), "pp_grad_sync", world=world,
                           timeout=600, args=(layout,))
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_microbatch_keeps_no_unsharded_gradient_between_micro_batches(ranks, schedule):
    for res in ranks:
        last, micro = res[f"{schedule}/last"], res[f"{schedule}/microbatch"]
        for seen in micro["seen"]:  # each forward after a backward of the step: shards reduced, nothing unsharded
            assert len(seen) >= M and all(grads == 0 for grads, _, _ in seen), seen
            assert any(shards > 0 for _, shards, _ in seen), seen
        for seen in last["seen"]:  # torch's path: unsharded gradients accumulate, no shard reduced before the end
            assert any(grads > 0 for grads, _, _ in seen) and all(shards == 0 for _, shards, _ in seen), seen


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_held_bytes_are_the_memory_plans(ranks, schedule):
    for res in ranks:
        last, micro = res[f"{schedule}/last"], res[f"{schedule}/microbatch"]
        print(schedule, "pp rank", last["pp_rank"], "peak gathered bytes (params + unsharded grads): last",
              last["peak"], "planned", last["planned"], "| microbatch", micro["peak"], "planned", micro["planned"])
        assert last["peak"] == last["planned"], (schedule, last["peak"], last["planned"])
        assert micro["peak"] < last["peak"] and micro["peak"] <= micro["planned"], (schedule, micro)
        if schedule == "1f1b" and last["pp_rank"] == 1:  # the head's gradient waits through the blocks' backward
            assert micro["peak"] == micro["planned"], (micro["peak"], micro["planned"])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gradients_and_losses_equal_last_and_one_process(ranks, schedule):
    one = ranks[0]["one"]
    for res in ranks:
        last, micro = res[f"{schedule}/last"], res[f"{schedule}/microbatch"]
        assert set(micro["grads"]) == set(last["grads"]) and len(micro["grads"]) > 0
        for name, g in micro["grads"].items():
            for other in (last["grads"][name], one["grads"][name]):
                assert max(abs(a - b) for a, b in zip(g, other)) < 1e-5, name
        assert micro["losses"] == pytest.approx(one["losses"], rel=1e-5, abs=0)
        assert last["losses"] == pytest.approx(one["losses"], rel=1e-5, abs=0)
        assert one["losses"][-1] < one["losses"][0] - 0.1  # the steps train the rows: a wrong update would show


def test_the_decision_is_logged_once_and_ignored_without_fsdp(ranks):
    for res in ranks:
        for schedule in SCHEDULES:
            assert [d.split(" (")[0] for d in res[f"{schedule}/microbatch"]["decisions"]] == [
                "pipeline: FSDP2 reduce-scatters the gradients every micro-batch and accumulates shards"]
            assert len(res[f"{schedule}/last"]["decisions"]) == 1
        assert res["no_fsdp"] == ["pipeline: parallel.pp_grad_sync = 'microbatch' ignored: no FSDP2 (no data-parallel "
                                  "ranks), no gradients to reduce-scatter"]


@pytest.mark.slow
def test_hsdp_reduce_scatters_every_micro_batch_and_all_reduces_once(hsdp_ranks):
    """Under HSDP the reduce-scattered shards of the call's micro-batches wait in FSDP2's partial output and
    the replicas' all-reduce runs on the last backward only: nothing unsharded and no shard written mid-step,
    and the gradients and losses still equal one process's (an all-reduce left out would not)."""
    one = hsdp_ranks[0]["one"]
    for res in hsdp_ranks:
        last, micro = res["1f1b/last"], res["1f1b/microbatch"]
        for seen in micro["seen"]:
            assert all(grads == 0 and shards == 0 for grads, shards, _ in seen), seen
            assert any(partial > 0 for _, _, partial in seen), seen
        assert micro["peak"] < last["peak"] == last["planned"] and micro["peak"] <= micro["planned"]
        for name, g in micro["grads"].items():
            for other in (last["grads"][name], one["grads"][name]):
                assert max(abs(a - b) for a, b in zip(g, other)) < 1e-5, name
        assert micro["losses"] == pytest.approx(one["losses"], rel=1e-5, abs=0)


def test_a_bad_value_is_one_line():
    with pytest.raises(ConfigError) as e:
        load_config(preset="tiny", overrides=[("parallel.pp", 2), ("parallel.pp_grad_sync", "step")])
    assert str(e.value) == "parallel.pp_grad_sync must be one of last, microbatch, got 'step'"


@pytest.mark.parametrize("mode", ["last", "microbatch"])
def test_pipeline_fit_passes_the_mode_to_the_memory_plan(mode):
    """The planner's pipeline settings carry ``parallel.pp_grad_sync``; under "microbatch" a rank of llama3-405b at
    PP 16 x TP 8 x FSDP 128 holds a few blocks' and its root's unsharded fp32 gradients, not all of its own."""
    cfg = load_config(preset="llama3-405b", overrides=[("parallel.pp_grad_sync", mode)])
    lay = Layout(1, 128, 8, 1, 16)
    pipe, why = pipeline_fit(lay, 2048, 1, cfg.parallel)
    assert why == "" and pipe["grad_sync"] == mode
    counts, m = model_counts(cfg.model), cfg.model
    rank = pipeline_ranks(counts, m, 16)[15]  # the last stage: 7 blocks and the head
    local = (rank["params"] - rank["norm"]) / 8 + rank["norm"]
    mem = layout_memory(counts, m, 8192, 1, lay, "selective", pipeline=pipe, pp_rank=15)
    blocks = pipe["virtual"] + 1  # the one computed, and each stage module's last reduce-scatter input
    grads = 4 * local if mode == "last" else 4 * (blocks * counts["block"] + rank["params"] - 7 * counts["block"]) / 8
    assert mem["transient"] == pytest.approx(2 * local + grads)


def test_microbatch_sync_without_pipelining_is_said_once(prepared, tmp_path):
    """At pp 1 the key has nothing to act on: the run's layout line says it is ignored (a decision, logged once)."""
    from densetrain.metrics import read_events
    from densetrain.train import train

    _, make = prepared
    cfg = make(tmp_path, **{"train.steps": 4, "eval.every": 0, "stages": [{"name": "main", "start": 0.0}],
                            "parallel.pp_grad_sync": "microbatch"})
    train(cfg, stop_after=1)
    lines = [e["text"] for e in read_events(tmp_path / "run") if e.get("kind") == "parallel"]
    assert len(lines) == 1 and lines[0].endswith("; parallel.pp_grad_sync = 'microbatch' ignored: no pipelining "
                                                 "(pp 1)"), lines
