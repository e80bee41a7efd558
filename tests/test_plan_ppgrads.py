"""FSDP2 under pipelining in the step-time model (densetrain/cost/step.py ``stage_gathers``, ``pipelined_dp``,
``Parallel.pp_grad_sync``), checked against what torch 2.13's pipelining runtime does: the all-gathers its
interleaved schedule lowers to, and on real gloo ranks (pp 2 x dp_shard 2) when a stage's gathers and
reduce-scatters run and whether FSDP2's final callback runs as a last backward (which makes the compute stream
wait for the reduce-scatters on a GPU)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
from conftest import gloo_env

from densetrain.config import load_config
from densetrain.cost import Parallel, load_hardware, step_time
from densetrain.cost.step import CONTENTION, PP_GRAD_SYNC, bus_bytes, collective_s, link, stage_gathers

H100 = load_hardware("h100-sxm")


def torch_unshards(pp: int, v: int, m: int, rank: int) -> int:
    """``UNSHARD`` actions in torch's own lowering of its interleaved 1F1B schedule for pipeline rank ``rank``."""
    from torch.distributed.pipelining.schedules import (
        ScheduleInterleaved1F1B,
        _add_unshard_reshard,
        _ComputationType,
    )

    sched = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)  # the schedule's order without process groups
    sched.pp_group_size, sched.n_local_stages, sched.rank, sched._n_microbatches = pp, v, rank, m
    sched.number_of_rounds = max(1, m // pp)
    sched.microbatches_per_round = m // sched.number_of_rounds
    actions = _add_unshard_reshard(sched._calculate_single_rank_operations(rank))
    return sum(a.computation_type == _ComputationType.UNSHARD for a in actions)


@pytest.mark.parametrize("pp", [2, 4, 8, 16])
def test_stage_gathers_equal_torchs_lowered_interleaved_schedule(pp):
    """Up to 3 stages stay gathered: v <= 3 gathers each stage once a call, more stages are gathered again as they
    re-enter the window (pp 16 v 8: 13 gathers of 8 stages; pp 8 v 16 m 32: 111 of 16)."""
    for v in (2, 3, 4, 8, 16):
        for m in (pp, 2 * pp, 4 * pp):
            for rank in (0, pp // 2, pp - 1):
                assert stage_gathers(pp, v, m, rank) == torch_unshards(pp, v, m, rank), (pp, v, m, rank)
    assert stage_gathers(pp, 3, pp) == 3 and stage_gathers(pp, 1, pp) == 1
    if pp == 16:
        assert stage_gathers(16, 8, 16) == 13
    if pp == 8:
        assert stage_gathers(8, 16, 32) == 111


def _rank_params(m, pp: int, tp: int) -> float:
    from densetrain.cost.flops import block_matmul_params

    return (m.n_layers * block_matmul_params(m) + 2 * m.d_model * m.vocab_size) / (pp * tp)


def test_last_exposes_each_calls_reduction_whole():
    """``last``: torch's REDUCE_GRAD reduce-scatters a stage's gradients after its last backward of the call and
    FSDP2's final callback makes the compute stream wait for them: the whole reduction is exposed, once per
    schedule call, even at 128K where one micro-batch's backward would have covered it (the model before hid it
    behind one backward: 0 s exposed here)."""
    m = load_config("llama3-405b").model
    par = Parallel(1, 8, 8, 16, 16, "interleaved_1f1b", 8, 0, True, attention="sdpa")  # Meta's 128K layout
    bw, lat, _ = link(H100, 8, 8 * 16)
    rs = sum(collective_s("reduce_scatter", 4 * _rank_params(m, 16, 8) / 8, 128, bw, lat) for _ in range(8))
    one = step_time(m, par, H100, 131072, 128, 1)  # 16 micro-batches a rank, one call
    assert one["parts"]["dp"] >= rs > 0.3
    two = step_time(m, dataclasses.replace(par, microbatches=8), H100, 131072, 128, 1)  # two calls of 8
    # the second call reduces again (8 stages' reduce-scatters) and gathers its first stage again, both exposed,
    # and its other 12 stage gathers run beside the compute at CONTENTION of their time (8 blocks a rank at pp 16
    # v 8: 2 FSDP2 groups a stage, a block and the root)
    gather = bus_bytes("all_gather", 2 * _rank_params(m, 16, 8) / 8, 128) / bw + 2 * 127 * lat
    assert stage_gathers(16, 8, 16) == stage_gathers(16, 8, 8) == 13
    assert two["parts"]["dp"] - one["parts"]["dp"] == pytest.approx(rs + gather + CONTENTION * 12 * gather, rel=1e-6)
    assert two["bytes"]["dp"] > one["bytes"]["dp"]


def test_dp_bytes_count_gathers_per_window_and_reductions_per_mode():
    """Bytes a rank sends for FSDP2 under pipelining: every stage gather (``stage_gathers`` per call), the fp32
    reduce-scatter once a call (``last``) or every micro-batch (``microbatch``), the replicas' all-reduce once a
    call."""
    m = load_config("llama3-405b").model
    par = Parallel(2, 8, 8, 16, 16, "interleaved_1f1b", 8, 0, True, attention="sdpa")  # HSDP 2 x 8, CP 16
    params = _rank_params(m, 16, 8)
    n_sh, n_micro = 8 * 16, 8  # 128 sequences over dp 2 x 8: 8 micro-batches a rank
    want = {}
    for mode in PP_GRAD_SYNC:
        n_rs = n_micro if mode == "microbatch" else 1
        want[mode] = (bus_bytes("all_gather", stage_gathers(16, 8, n_micro) * params / 8 * 2, n_sh)
                      + n_rs * bus_bytes("reduce_scatter", 4 * params, n_sh)
                      + bus_bytes("all_reduce", 4 * params / n_sh, 2))
        got = step_time(m, dataclasses.replace(par, pp_grad_sync=mode), H100, 131072, 128, 1)["bytes"]["dp"]
        assert got == pytest.approx(want[mode], rel=1e-9), mode
    assert want["microbatch"] > 4 * want["last"]


def test_microbatch_hides_its_reductions_behind_the_next_micro_batches():
    """``microbatch``: 16 x the reduce-scatter bytes, each beside the compute but the call's last per stage. Where
    the compute covers them (Meta's 128K layout: 16 micro-batches of 128K tokens a rank) they cost only CONTENTION
    of their time (and the memory of unsharded gradients is saved: tools/plan/memory.py); where it cannot (Meta's
    8K layout at DP 128: 16 short micro-batches, each reduce-scatter ~0.5 s over the network), the excess is
    exposed."""
    m = load_config("llama3-405b").model
    long = Parallel(1, 8, 8, 16, 16, "interleaved_1f1b", 8, 0, True, attention="sdpa")
    last = step_time(m, long, H100, 131072, 128, 1)
    micro = step_time(m, dataclasses.replace(long, pp_grad_sync="microbatch"), H100, 131072, 128, 1)
    bw, lat, _ = link(H100, 8, 128)
    rs = 8 * collective_s("reduce_scatter", 4 * _rank_params(m, 16, 8) / 8, 128, bw, lat)  # one micro-batch's
    assert last["parts"]["dp"] < micro["parts"]["dp"] <= last["parts"]["dp"] + CONTENTION * 15 * rs * (1 + 1e-9)
    assert micro["bytes"]["dp"] > 8 * last["bytes"]["dp"]
    assert {k: v for k, v in micro["parts"].items() if k != "dp"} == {k: v for k, v in last["parts"].items()
                                                                      if k != "dp"}
    short = Parallel(1, 128, 8, 1, 16, "interleaved_1f1b", 8, 0, True, attention="sdpa")
    last8 = step_time(m, short, H100, 8192, 2048, 1)
    micro8 = step_time(m, dataclasses.replace(short, pp_grad_sync="microbatch"), H100, 8192, 2048, 1)
    # 16 reduce-scatters of ~0.36 s (5.8 s) beside 5.7 s of compute: CONTENTION of it, and what it cannot cover
    busy = last8["parts"]["compute"] + last8["parts"]["recompute"]
    bw, lat, _ = link(H100, 8, 128)
    rs8 = 8 * collective_s("reduce_scatter", 4 * _rank_params(m, 16, 8) / 8, 128, bw, lat)
    assert 16 * rs8 > busy
    assert micro8["parts"]["dp"] >= 16 * rs8 - busy + CONTENTION * busy
    assert micro8["step_s"] > last8["step_s"] + 1.0
    # no sharding (replicas only): the mode changes nothing (the all-reduce waits for the last either way)
    rep = Parallel(16, 1, 8, 1, 16, "interleaved_1f1b", 8, 0, True, attention="sdpa")
    assert step_time(m, rep, H100, 8192, 2048, 1)["step_s"] == pytest.approx(
        step_time(m, dataclasses.replace(rep, pp_grad_sync="microbatch"), H100, 8192, 2048, 1)["step_s"])
    with pytest.raises(ValueError, match="pp_grad_sync must be one of"):
        step_time(m, dataclasses.replace(long, pp_grad_sync="step"), H100, 131072, 128, 1)


_TRACE = r"""
import json, sys
import torch, torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
from torch.distributed.pipelining.stage import _PipelineStageBase
from densetrain.config import load_config
from densetrain.parallel.dist import init_distributed
from densetrain.parallel.parallelize import build_parallel_model
from densetrain.train.step import forward_backward

mode = sys.argv[1]
events, where = [], []  # what ran, in order; the torch action we are inside ("U": an UNSHARD, "R": a REDUCE_GRAD)

def wrap(owner, name, before):
    orig = getattr(owner, name)
    def f(*a, **k):
        tag = before(*a, **k)
        if tag:
            where.append(tag)
        try:
            return orig(*a, **k)
        finally:
            if tag:
                where.pop()
    setattr(owner, name, f)

def collective(kind):
    return lambda *a, **k: events.append([kind, where[-1] if where else "-"])
wrap(dist, "all_gather_single", collective("AG"))
wrap(dist, "reduce_scatter_single", collective("RS"))
# torch's UNSHARD action calls unshard() on every FSDP2 module of the stage, its root (the chunk) first;
# FSDP2's own hooks gather through the parameter groups, not through this method
wrap(FSDPModule, "unshard", lambda self, *a, **k: (events.extend([["U", 0]] if any(self is c for c in chunks)
                                                                 else []), "U")[1])
wrap(_PipelineStageBase, "perform_reduce_grad", lambda self, *a, **k: (events.append(["R", self.stage_index]), "R")[1])
wrap(_PipelineStageBase, "backward_one_chunk", lambda self, *a, **k: events.append(["B", self.stage_index]))
wrap(FSDPState, "_root_post_backward_final_callback",
     lambda self: events.append(["final", bool(self._state_ctx.is_last_backward), where[-1] if where else "-"]))

over = [("model.n_layers", 6), ("train.dtype", "fp32"), ("eval.samples", 0), ("eval.tasks", ""),
        ("eval.final_tasks", ""), ("parallel.dp_replicate", 1), ("parallel.dp_shard", 2),
        ("parallel.pp", 2), ("parallel.pp_schedule", "interleaved_1f1b"), ("parallel.pp_virtual_stages", 4)]
if mode != "default":
    over.append(("parallel.pp_grad_sync", mode))
cfg = load_config("tiny", overrides=over)
info = init_distributed("cpu", cfg.parallel)
model, pipe = build_parallel_model(cfg, info)
chunks = list(pipe.chunks)
torch.manual_seed(info.dp_rank)
mbs = [(x[:, :-1], x[:, 1:], ["web"]) for x in torch.randint(0, cfg.model.vocab_size, (4, 1, 33))]
forward_backward(pipe, mbs, 4 * 32 * 2, 2)  # the first step also infers the stages' buffers
events.clear()
forward_backward(pipe, mbs, 4 * 32 * 2, 2)
print(json.dumps({"pp_rank": info.pp_rank, "calls": 4 // pipe.microbatches(4), "m": pipe.microbatches(4),
                  "events": events}))
"""


def _run_trace(mode: str, tmp_path) -> list[dict]:
    import forked

    script = tmp_path / "trace.py"
    script.write_text(_TRACE)
    env = {**gloo_env(4), "PYTHONPATH": str(Path(__file__).parents[1])}
    procs = [forked.Popen([sys.executable, str(script), mode], text=True, stdout=forked.PIPE, stderr=forked.PIPE,
                          env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(4)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    return [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]


def test_a_real_interleaved_fsdp2_step_gathers_and_reduces_as_the_model_says(tmp_path):
    """4 gloo ranks, pp 2 x dp_shard 2, interleaved 1F1B with 4 stages a rank (more than torch keeps gathered),
    4 micro-batches a rank in 2 schedule calls of 2 (densetrain's default count), torch's own ``last`` sync.
    Every FSDP2 all-gather runs inside an UNSHARD action, as many stage UNSHARDs per call as
    :func:`stage_gathers` says; every reduce-scatter runs inside a REDUCE_GRAD (one per stage and call, the
    stage's backwards all before it, other stages' backwards after it) whose FSDP2 final callback runs as a last
    backward: on a GPU that callback makes the compute stream wait for the reduce-scatters
    (``current_stream().wait_event``), so nothing after it runs beside them."""
    for rank in _run_trace("default", tmp_path):
        ev, pp_rank, calls, m = rank["events"], rank["pp_rank"], rank["calls"], rank["m"]
        assert (calls, m) == (2, 2)
        assert sum(e[0] == "U" for e in ev) == calls * stage_gathers(2, 4, m, pp_rank) > calls * 4
        assert [e[1] for e in ev if e[0] == "AG"] == ["U"] * sum(e[0] == "AG" for e in ev)  # only in UNSHARDs
        rs = [e[1] for e in ev if e[0] == "RS"]
        assert rs and set(rs) == {"R"}
        reduces = [i for i, e in enumerate(ev) if e[0] == "R"]
        assert len(reduces) == calls * 4
        for i in reduces:
            stage = ev[i][1]
            call_end = next(j for j in reduces if j >= i and reduces.index(j) % 4 == 3)
            assert not any(e[0] == "B" and e[1] == stage for e in ev[i:call_end + 1])  # its backwards done
        first = reduces[0]
        assert any(e[0] == "B" for e in ev[first:reduces[3]])  # other stages' backwards follow the first reduction
        finals = [e for e in ev if e[0] == "final"]
        assert [f[1] for f in finals if f[2] == "R"] == [True] * sum(f[2] == "R" for f in finals) != []
        assert all(not f[1] for f in finals if f[2] != "R")  # the backwards' own callbacks: not a last backward


def test_the_plan_times_both_syncs_and_its_commands_run_the_chosen_one():
    """Memory decides which sync fits, the model which is faster: Meta's 128K layout of llama3-405b (PP 16 x CP 16
    x TP 8 x FSDP 8, interleaved v 4) needs full recomputation under torch's ``last`` (every gradient unsharded in
    fp32: 76.5 GiB with selective) and fits with selective under ``microbatch`` (72.1 GiB), which the plan keeps;
    llama3-70b on 128 GPUs runs one layout for every stage with ``microbatch`` on a stage: the printed command
    carries ``pp_grad_sync`` per stage and loads to it."""
    from densetrain.config.loading import parse_overrides
    from densetrain.parallel.mesh import Layout
    from densetrain.parallel.stage_layout import stage_layouts
    from densetrain.schedule import resolve_stages
    from densetrain.tools.plan import format_layout_plan, layout_plan, model_counts
    from densetrain.tools.plan.layouts import stage_fit, timed_fit
    from densetrain.tools.plan.report import layout_plan_json
    from densetrain.tools.plan.verdict import configured_stages

    cfg = load_config("llama3-405b")
    r = layout_plan(cfg, 16384, sequence_parallel=True, preset="llama3-405b")
    long = next(i for i, s in enumerate(r["stages"]) if s["seq_len"] == 131072)
    row, lay = r["stages"][long], Layout(1, 8, 8, 16, 16)
    par = dataclasses.replace(cfg.parallel, pp_schedule="interleaved_1f1b", pp_virtual_stages=4)
    counts, usable = model_counts(cfg.model), r["usable_bytes"]
    last, micro = (stage_fit(counts, cfg.model, row, lay, par, usable, True, True, grad_sync=g) for g in PP_GRAD_SYNC)
    assert (last["ac"], micro["ac"]) == ("full", "selective")
    sel = [stage_fit(counts, cfg.model, row, lay, par, usable, True, True, ("selective",), g) for g in PP_GRAD_SYNC]
    assert not sel[0]["fits"] and sel[1]["fits"] and sel[1]["bytes"]["total"] < sel[0]["bytes"]["total"]
    best = timed_fit(counts, cfg.model, row, lay, par, usable, H100, True, True)
    assert best["grad_sync"] == "microbatch" and best["ac"] == "selective"
    assert r["published"]["stages"][long]["grad_sync"] == "microbatch"

    cfg = load_config("llama3-70b")
    r = layout_plan(cfg, 128, sequence_parallel=cfg.parallel.sequence_parallel)
    sug = r["suggested"]
    syncs = [st["grad_sync"] for st in sug["stages"]]
    assert "microbatch" in syncs
    line = next(ln for ln in format_layout_plan(r).splitlines() if ln.startswith("one layout"))
    flags = line.split("densetrain train ... ")[1]
    assert "pp_grad_sync=microbatch" in flags
    run = load_config("llama3-70b", overrides=parse_overrides(flags.split()))
    got = stage_layouts(run, resolve_stages(run), 128)
    assert [p.pp_grad_sync for p, _ in got] == syncs
    assert all(v["runs"] for v in configured_stages(run, 128, model_counts(run.model), r["usable_bytes"]))
    js = layout_plan_json(r)
    assert [s["pp_grad_sync"] for s in js["stages"]] == [s["ranked"][0]["stages"][i].get("grad_sync")
                                                          for i, s in enumerate(r["stages"])]
    assert "pp_grad_sync" in js["suggested"]["train_flags"]


def test_a_real_microbatch_sync_reduces_in_each_backward_and_waits_only_at_the_calls_end(tmp_path):
    """The same 4-rank step under ``pp_grad_sync = "microbatch"``: each backward's reduce-scatters run inside the
    backward (FSDP2's post-backward hooks; the backward's own final callback is not a last backward, so nothing
    waits for them there), as many a step as micro-batches per stage, none in REDUCE_GRAD, whose final callback
    (a last backward: the wait) ends each call; the gathers stay those of :func:`stage_gathers`."""
    for rank in _run_trace("microbatch", tmp_path):
        ev, pp_rank, calls, m = rank["events"], rank["pp_rank"], rank["calls"], rank["m"]
        assert sum(e[0] == "U" for e in ev) == calls * stage_gathers(2, 4, m, pp_rank)
        rs = [e[1] for e in ev if e[0] == "RS"]
        backwards = sum(e[0] == "B" for e in ev)
        assert backwards == 4 * calls * m and len(rs) >= backwards and set(rs) == {"-"}  # one or more groups each
        finals = [e for e in ev if e[0] == "final"]
        assert all(f[1] == (f[2] == "R") for f in finals) and sum(f[2] == "R" for f in finals) >= 4 * calls
