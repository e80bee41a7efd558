"""FSDP2 under pipelining in the step-time model (densetrain/cost/step.py ``stage_gathers``, ``pipelined_dp``,
``Parallel.pp_grad_sync``), checked against what torch 2.13's pipelining runtime does: the all-gathers its
interleaved schedule lowers to, and on real gloo ranks (pp 2 x dp_shard 2) when a stage's gathers and
reduce-scatters run and whether FSDP2's final callback runs as a last backward (which makes the compute stream
wait for the reduce-scatters on a GPU)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
from pathlib import Path

import pytest

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
