"""The cost model (densetrain/cost/): the MFU FLOP count against the real model's parameters, NCCL's bus-bandwidth
factors, where a group's ranks sit, the bubble counted once, hardware profiles, and the published runs of
benchmarks/planner_check.py within 15%."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from densetrain.config import load_config
from densetrain.cost import (
    CHECKED_ERROR,
    Parallel,
    flops_per_token,
    load_hardware,
    profile_names,
    step_time,
    write_hardware,
)
from densetrain.cost.flops import attention_flops
from densetrain.cost.step import ATTENTION_EFFICIENCY, bus_bytes, collective_s, link
from densetrain.errors import ConfigError
from densetrain.metrics import flops_per_token as metrics_flops
from densetrain.model.llama import Transformer

H100 = load_hardware("h100-sxm")


def test_mfu_flops_are_torchtitans_count_of_the_real_model():
    m = load_config("llama3-8b").model
    with torch.device("meta"):
        model = Transformer(m)
    # 6 N without the input embedding (norm gains are not matmuls) + 12 L H d_head T, attention not halved
    n = sum(p.numel() for name, p in model.named_parameters() if "norm" not in name and "tok_embeddings" not in name)
    want = 6 * n + 12 * m.n_layers * m.n_heads * (m.d_model // m.n_heads) * 8192
    assert flops_per_token(m, 8192) == want == pytest.approx(5.79e10, rel=0.01)
    assert metrics_flops is flops_per_token  # the training log's mfu uses the same count


def test_nccl_bus_factors_and_placement():
    assert bus_bytes("all_reduce", 800, 8) == 2 * 7 / 8 * 800 and bus_bytes("all_gather", 800, 8) == 7 / 8 * 800
    assert bus_bytes("reduce_scatter", 800, 1) == 0
    assert collective_s("all_reduce", 1e9, 4, 1e10, 1e-6) == pytest.approx(2 * 3 / 4 * 0.1 + 6e-6)
    # tp 8 fills a node (NVLink); a group 8 apart has one rank a node (its NIC); 2 apart spans 2 nodes x 4 NICs
    assert link(H100, 1, 8)[2] == "nvlink" and link(H100, 8, 16)[2] == "network"
    assert link(H100, 8, 16)[0] == pytest.approx(link(H100, 2, 8)[0] / 4)


def test_nvlink_sharp_speeds_only_a_whole_nodes_all_reduce():
    """NCCL's NVLS all-reduce: ~480 GB/s bus bandwidth over a node's 8 H100s, the ring's rate on 2-4 (NVIDIA/nccl
    issue 1455); all-gather and reduce-scatter keep the ring's (issue 1083); an A100 node has none."""
    from dataclasses import replace

    from densetrain.cost.step import allreduce_bw

    ring = link(H100, 1, 8)[0]
    assert allreduce_bw(H100, 1, 8, ring) == 480e9 and allreduce_bw(H100, 1, 4, ring) == ring
    assert allreduce_bw(H100, 2, 4, ring) == ring  # 4 ranks 2 apart: not the whole node
    assert load_hardware("a100-80gb").nvls_bus_bytes_per_s == 0 and load_hardware("h200").nvls_bus_bytes_per_s
    m = load_config("llama3-70b").model
    plain, sp = Parallel(1, 32, 8), Parallel(1, 32, 8, sequence_parallel=True)
    no_nvls = replace(H100, nvls_bus_bytes_per_s=0.0)
    with_, without = (step_time(m, plain, h, 8192, 512, 16, "full")["parts"]["tp"] for h in (H100, no_nvls))
    assert with_ == pytest.approx(without * ring / 480e9, rel=0.01)  # TP 8 without SP: all-reduces only
    assert step_time(m, sp, H100, 8192, 512, 16, "full")["parts"]["tp"] == pytest.approx(
        step_time(m, sp, no_nvls, 8192, 512, 16, "full")["parts"]["tp"], rel=0.01)  # SP: all-gathers, reduce-scatters


def test_densetrains_cp_runs_flexattention_at_the_profiles_rate():
    """Under CP densetrain runs FlexAttention (parallel/context.py), without it SDPA's causal kernel (cuDNN's on an
    H100 with a recent cuDNN): the CP layout's attention at the profile's flex rates (0.85 forward, 0.76 backward
    on H100: Dong et al. 2024), a document-masked stage's at them whatever the layout, Llama 3's kernel at SDPA's."""
    from dataclasses import replace

    m = load_config("llama3-8b").model
    same = replace(H100, flex_forward_rate=0.0, flex_backward_rate=0.0)  # no difference between the kernels
    cp = Parallel(1, 2, 1, 2, sequence_parallel=False)
    flex, sdpa, equal = (step_time(m, p, h, 8192, 2, 1, "none")["parts"]["compute"]
                         for p, h in ((cp, H100), (replace(cp, attention="sdpa"), H100), (cp, same)))
    assert sdpa == pytest.approx(equal) and flex > sdpa
    attn = attention_flops(m, 4096, 8192) / (H100.peak_bf16_flops * ATTENTION_EFFICIENCY) * m.n_layers
    assert flex - sdpa == pytest.approx(attn * (1 / 0.85 - 1) + 2.5 * attn * (1 / 0.76 - 1), rel=1e-6)
    one = Parallel(1, 4)  # no CP: SDPA, unless the stage masks documents
    assert step_time(m, replace(one, attention="flex"), H100, 8192, 4, 1)["step_s"] > \
        step_time(m, one, H100, 8192, 4, 1)["step_s"]
    with pytest.raises(ValueError, match="attention must be one of"):
        step_time(m, replace(one, attention="fa3"), H100, 8192, 4, 1)


def test_bubble_is_counted_once_and_the_parts_add_up():
    m = load_config("llama3-405b").model
    one = step_time(m, Parallel(1, 64, 8, 1, 16, "interleaved_1f1b", 8, 0, True), H100, 8192, 2048)
    p = one["parts"]
    assert one["step_s"] == pytest.approx(sum(p.values()))
    busy = p["compute"] + p["recompute"] + p["tp"] + p["cp"]
    assert p["bubble"] == pytest.approx(15 / (8 * 32) * busy)  # (pp - 1) / (v m) of the busy time
    # Table 4: doubling DP at a fixed batch halves the micro-batches per rank; the bubble does not shrink
    two = step_time(m, Parallel(1, 128, 8, 1, 16, "interleaved_1f1b", 8, 0, True), H100, 8192, 2048)
    assert two["parts"]["bubble"] == pytest.approx(p["bubble"], rel=0.01) and two["mfu"] < one["mfu"] - 0.01
    with pytest.raises(ValueError, match="do not split"):
        step_time(m, Parallel(1, 3), H100, 8192, 2048)


def test_pipeline_pace_is_the_slowest_stage_with_the_head():
    from densetrain.cost.step import pipeline_pace

    # 405B, 126 blocks: Llama 3's pp 16 x v 8 leaves the head's stage a block short (8 a rank); torchtitan's pp 8
    # runs 16 on the slowest rank; 70B's 80 blocks on pp 4 cannot spare the head's rank a whole block
    assert pipeline_pace(126, 16, 8, 0.63) == (8, 0) and pipeline_pace(126, 8, 1, 0.63) == (16, 0)
    assert pipeline_pace(80, 4, 1, 0.6) == (20, 1) and pipeline_pace(4, 1, 1, 0.5) == (4, 1)
    assert pipeline_pace(4, 2, 1, 2.0) == (3, 0)  # a head of two blocks' time: 3 blocks, and 1 + the head


def test_tp_and_cp_implementations_are_charged_as_they_send():
    m = load_config("llama3-70b").model
    sync = step_time(m, Parallel(1, 32, 8, sequence_parallel=True), H100, 8192, 512, 16, "full")
    asy = step_time(m, Parallel(1, 32, 8, sequence_parallel=True, async_tp=True), H100, 8192, 512, 16, "full")
    assert asy["bytes"]["tp"] == sync["bytes"]["tp"]  # AsyncTP moves the same bytes, beside the GEMMs
    assert sync["parts"]["tp"] / 8 < asy["parts"]["tp"] < sync["parts"]["tp"]  # a piece of each stays exposed
    plain = step_time(m, Parallel(1, 32, 8), H100, 8192, 512, 16, "none")  # no SP: 2 + 5 all-reduces a block
    sp = step_time(m, Parallel(1, 32, 8, sequence_parallel=True), H100, 8192, 512, 16, "none")
    assert plain["bytes"]["tp"] > 1.7 * sp["bytes"]["tp"]
    kv = step_time(m, Parallel(1, 32, 1, 8), H100, 65536, 32, 1, "none")
    wide = step_time(m, Parallel(1, 32, 1, 8, cp_exchange="expanded"), H100, 65536, 32, 1, "none")
    # torch's ring attention on K/V repeated to n_heads: 8x the bytes of a 70B exchange, 3 passes not 2
    assert wide["bytes"]["cp"] == pytest.approx(kv["bytes"]["cp"] * 8 * 3 / 2)


def test_async_tp_hides_what_torchs_pass_fuses_not_the_backwards_reduce_scatters():
    """torch's micro-pipeline pass fuses an all-gather into the matmuls it feeds and a reduce-scatter into the one
    matmul that alone feeds it: the backward's reduce-scatters follow a sum of input gradients (q/k/v, w1/w3) and
    stay exposed; under Float8 so do the backward's all-gathers (a cast sits before the matmul)."""
    from densetrain.cost.step import async_tp_exposed

    big = [1.0] * 4  # GEMMs long enough to cover any collective
    # forward: each fused collective leaves its first of 8 pieces; backward: 2 reduce-scatters whole
    assert async_tp_exposed(big, 0.01, 0.02, 8, 1, False) == pytest.approx(4 * 0.01 / 8 + 2 * 0.02 + 2 * 0.02 / 8)
    assert async_tp_exposed(big, 0.01, 0.02, 8, 2, True) == pytest.approx(2 * 4 * 0.01 / 8 + 4 * 0.02)
    m = load_config("llama3-70b").model
    par = Parallel(1, 32, 8, sequence_parallel=True, async_tp=True)
    sync = step_time(m, Parallel(1, 32, 8, sequence_parallel=True), H100, 8192, 512, 16, "full", "fp8")
    fp8 = step_time(m, par, H100, 8192, 512, 16, "full", "fp8")
    bf16 = step_time(m, par, H100, 8192, 512, 16, "full", "bf16")
    # under full recomputation 8 of a block's 12 collectives are forward ones (fused, the all-gathers in fp8:
    # 6 of the 10 units of bytes); the 4 backward ones are not (the old model hid them too: 0.31x of sync)
    assert 0.5 * sync["parts"]["tp"] < fp8["parts"]["tp"] < 0.7 * sync["parts"]["tp"]
    assert bf16["parts"]["tp"] < fp8["parts"]["tp"]  # bf16's backward all-gathers are fused
    # the PyTorch team measured "~8% E2E speedup in Llama3 70B" with AsyncTP at TP 8 (discuss.pytorch.org, 2024):
    # 10.1% / 9.0% here without / with op-level checkpointing (8.0-8.1% before session 17 refitted
    # NETWORK_EFFICIENCY 0.5 -> 0.7: FSDP's traffic hides more, so TP is a larger share); hiding the backward too
    # (the older model) gave 11.5%
    for ac in ("none", "op"):
        plain, fused = (step_time(m, Parallel(1, 8, 8, sequence_parallel=True, async_tp=a), H100, 8192, 16, 2, ac)
                        for a in (False, True))
        assert 0.06 < plain["step_s"] / fused["step_s"] - 1 < 0.11


def test_a_measured_operator_cost_is_charged_per_counted_operator():
    from dataclasses import replace

    from densetrain.cost.flops import BASE_OPS, block_ops, optimizer_ops

    m = load_config("tiny").model
    hw = load_hardware("h100-sxm")
    base = replace(hw, sms=0, op_overhead_s=1e-12)  # no GPU tiles, a negligible operator cost
    slow = replace(base, op_overhead_s=1e-3)
    one, two = (step_time(m, Parallel(), h, 64, 2, 1, "none", "fp32")["step_s"] for h in (base, slow))
    ops = 2 * (m.n_layers * sum(block_ops(m)) + sum(BASE_OPS)) + optimizer_ops(m, m.n_layers)
    assert two - one == pytest.approx(ops * (1e-3 - 1e-12), rel=1e-6)


def test_operator_counts_are_the_real_blocks():
    """:data:`densetrain.cost.flops.BLOCK_OPS` / ``GQA_OPS`` / ``BASE_OPS`` against the operators a real model of
    1 and 2 blocks runs (a TorchDispatchMode counts every aten call), for a GQA (tiny) and a multi-head shape."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from densetrain.cost.flops import BASE_OPS, block_ops
    from densetrain.loss import token_losses
    from densetrain.model.init import build_model

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    for overrides in ([], [("model.n_kv_heads", 4)]):
        counts = []
        for n_layers in (1, 2):
            m = load_config("tiny", overrides=[("model.n_layers", n_layers), *overrides]).model
            model, x = build_model(m, 0), torch.randint(0, m.vocab_size, (2, 9))
            fwd, bwd = Count(), Count()
            with fwd:
                loss = token_losses(model(x[:, :-1]), x[:, 1:]).mean()
            with bwd:
                loss.backward()
            counts.append((fwd.n, bwd.n))
        assert (counts[1][0] - counts[0][0], counts[1][1] - counts[0][1]) == block_ops(m)
        base = (counts[0][0] - block_ops(m)[0], counts[0][1] - block_ops(m)[1])
        assert abs(base[0] - BASE_OPS[0]) <= 1 and base[1] == BASE_OPS[1], base  # 35 or 36 by the shape


def test_profiles_load_and_bad_ones_are_one_line(tmp_path):
    assert profile_names() == ["a100-80gb", "b200", "h100-96gb-500w", "h100-sxm", "h200"]
    assert load_hardware("h100-96gb-500w").hbm_bytes_per_s == 2.4e12  # torchtitan's Grand Teton H100s
    assert load_hardware("b200").peak_bf16_flops == 2250e12 and load_hardware("a100-80gb").memory_gib == 80
    back = load_hardware(write_hardware(H100, tmp_path / "mine.json"))
    assert back == H100 and load_hardware(write_hardware(H100, tmp_path / "mine.toml")) == H100
    (tmp_path / "bad.toml").write_text('name = "x"\npeak_bf16_flops = -1\n')
    with pytest.raises(ConfigError, match="missing key"):
        load_hardware(tmp_path / "bad.toml")
    good = H100.to_toml().replace("gpus_per_node = 8", "gpus_per_node = 0")
    (tmp_path / "zero.toml").write_text(good)
    with pytest.raises(ConfigError, match="gpus_per_node = 0: expected a finite number > 0"):
        load_hardware(tmp_path / "zero.toml")


def test_published_runs_within_15_percent_but_two():
    spec = importlib.util.spec_from_file_location("planner_check", Path(__file__).parents[1] / "benchmarks" /
                                                  "planner_check.py")
    pc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pc)
    rows = pc.table()
    assert len(rows) == 19 and sum(r["role"] == "fit" for r in rows) == 3
    assert all(abs(r["error"]) < 0.02 for r in rows if r["role"] == "fit")
    # the known misses (docs/planner.md): torchtitan's 8B FSDP + CP rows at 128K and 256K run 2.4x slower than at
    # 64K for 1.7x the FLOPs a token; every other row is within 10%
    missed = {r["name"] for r in rows if abs(r["error"]) >= 0.15}
    assert missed == {"titan 8B FSDP 2 x CP 4 at 128K, Float8", "titan 8B FSDP 1 x CP 8 at 256K, Float8"}, missed
    assert sum(abs(r["error"]) < 0.10 for r in rows) >= 17


def test_doctor_writes_this_machines_profile_that_plan_reads(tmp_path, capsys):
    from densetrain.cli import main

    path = tmp_path / "me.toml"
    main(["doctor", "--preset", "tiny", "--health.seconds=0.01", "--health.trials=1", "--health.copy_mib=1",
          "--profile", str(path)])
    out = capsys.readouterr().out
    assert f"wrote this machine's hardware profile to {path}" in out
    # One rank measures no collective: the profile's links are its memory bandwidth, and it says so.
    assert "note: one rank measured no collective, so the profile's nvlink and net bandwidth are its memory " \
        "bandwidth" in out
    hw = load_hardware(path)
    assert hw.peak_bf16_flops > 0 and hw.hbm_bytes_per_s > 0 and hw.gpus_per_node == 1
    # The per-operator cost is an intercept of two timings (doctor.op_overhead): on a busy machine it may come
    # out 0 (clamped), so only its presence and range are this machine-independent test's to check.
    assert 0 <= hw.op_overhead_s < 1e-3
    assert main(["plan", "--preset", "tiny", "--gpus", "1", "--hardware", str(path), "--json"]) == 0
    assert '"mfu"' in capsys.readouterr().out
    assert hw.nvlink_bytes_per_s == hw.net_bytes_per_s == hw.hbm_bytes_per_s


def test_doctor_profile_at_a_directory_is_one_line_before_measuring(tmp_path, capsys):
    """Review of issue 44: ``doctor --profile DIR`` measured, then printed ``[Errno 21] Is a directory:
    '/tmp/.rv.tmp14174' -> '/tmp/rv'``, naming a temp file the user never gave."""
    from densetrain.cli import main

    missing = tmp_path / "no"
    for bad, why in ((tmp_path, "is a directory"), (missing / "me.toml", f"{missing} is not a directory")):
        assert main(["doctor", "--preset", "tiny", "--health.seconds=0.01", "--profile", str(bad)]) == 2
        cap = capsys.readouterr()
        assert cap.err.startswith(f"densetrain: error: --profile {bad}: {why}") and cap.err.count("\n") == 1, cap.err
        assert "healthy" not in cap.out  # refused before measuring
    assert sorted(p.name for p in tmp_path.iterdir()) == []


_COUNT = r"""
import collections, json, sys
import torch, torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from densetrain.config import load_config
from densetrain.parallel.dist import init_distributed
from densetrain.parallel.parallelize import build_parallel_model
from densetrain.train.step import forward_backward

kind, world = sys.argv[1], int(sys.argv[2])
sent = collections.Counter()  # bytes one rank sends, at NCCL's ring factors
def ring(name, nbytes, n):  # all-reduce 2 (n - 1) / n, all-gather and reduce-scatter (n - 1) / n of the whole
    sent[name] += (2 if name == "all_reduce" else 1) * (n - 1) / n * nbytes

def counting(name, orig):  # FSDP2's collectives (c10d calls)
    def f(*a, **k):
        out, inp = k.get("output", a[0] if a else None), k.get("input", a[1] if len(a) > 1 else None)
        t = out if name == "all_gather" else inp
        ring(name, t.numel() * t.element_size(), dist.get_world_size(k.get("group")))
        return orig(*a, **k)
    return f
dist.all_gather_single = counting("all_gather", dist.all_gather_single)
dist.reduce_scatter_single = counting("reduce_scatter", dist.reduce_scatter_single)

class Functional(TorchDispatchMode):  # tensor parallel's collectives: DTensor's functional collectives
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("_c10d_functional.all_reduce"):
            ring("all_reduce", args[0].numel() * args[0].element_size(), world)
        elif name.startswith("_c10d_functional.all_gather"):
            ring("all_gather", world * args[0].numel() * args[0].element_size(), world)
        elif name.startswith("_c10d_functional.reduce_scatter"):
            ring("reduce_scatter", args[0].numel() * args[0].element_size(), world)
        return func(*args, **(kwargs or {}))

layout = {"fsdp": [("parallel.dp_shard", -1)], "ddp": [("parallel.dp_replicate", world), ("parallel.dp_shard", 1)],
          "tp": [("parallel.dp_shard", 1), ("parallel.tp", world)]}[kind]
cfg = load_config("tiny", overrides=[("parallel.dp_replicate", 1), ("train.dtype", "fp32"), *layout])
info = init_distributed("cpu", cfg.parallel)
model, step_model = build_parallel_model(cfg, info)
if kind == "ddp":  # DDP's buckets are all-reduced in C++: a comm hook sees each bucket and all-reduces it
    def hook(state, bucket):
        buf = bucket.buffer()
        ring("all_reduce", buf.numel() * buf.element_size(), world)
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0] / world)
    step_model.register_comm_hook(None, hook)
x = torch.randint(0, cfg.model.vocab_size, (1, 65))
with Functional():  # one micro-batch's forward and backward, the training step's own (AdamW sends nothing)
    forward_backward(step_model, [(x[:, :-1], x[:, 1:], ["web"])], 64, 1 if kind == "tp" else world)
if info.rank == 0:
    print(json.dumps(sent))
"""


@pytest.mark.parametrize("kind,world,dim,par", [("fsdp", 2, "dp", Parallel(dp_shard=2)),
                                                ("fsdp", 4, "dp", Parallel(dp_shard=4)),
                                                ("ddp", 2, "dp", Parallel(dp_replicate=2)),
                                                ("tp", 2, "tp", Parallel(tp=2))])
def test_bytes_per_step_equal_a_counted_gloo_step(kind, world, dim, par, tmp_path):
    """What FSDP2 (all-gathers, reduce-scatters), DDP (its gradient buckets) and tensor parallelism (DTensor's
    functional all-reduces: 7 a block without SP, the embedding's, the head's and the loss's) send in a real
    training micro-step on ``world`` gloo ranks equals the cost model's bytes of that mesh dimension."""
    import json
    import os
    import socket
    import sys

    import forked

    script = tmp_path / "count.py"
    script.write_text(_COUNT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    procs = [forked.Popen([sys.executable, str(script), kind, str(world)], text=True, stdout=forked.PIPE,
                          stderr=forked.PIPE, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(world)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    sent = json.loads(outs[0][0].strip().splitlines()[-1])
    m = load_config("tiny").model
    batch = 1 if kind == "tp" else world
    want = step_time(m, par, H100, 64, batch, 1, precision="fp32")["bytes"][dim]
    assert sum(sent.values()) == pytest.approx(want, rel=0.02)  # the model leaves out the norm gains (0.04%)


def test_checked_error_is_planner_checks_mean_over_the_rows_not_fitted():
    spec = importlib.util.spec_from_file_location("planner_check", Path(__file__).parents[1] / "benchmarks" /
                                                  "planner_check.py")
    pc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pc)
    checked = [abs(r["error"]) for r in pc.table() if r["role"] == "check"]
    assert CHECKED_ERROR == pytest.approx(sum(checked) / len(checked), abs=0.0005)


@pytest.mark.parametrize("preset, gpus", [("llama3-8b", 8), ("llama3-8b", 128)])
def test_the_plan_says_which_listed_layouts_are_within_the_models_error(preset, gpus):
    """A runner-up closer to the pick than the model's checked error is one the model does not tell apart: each
    stage's note counts the listed layouts whose excess is under :data:`CHECKED_ERROR` exactly (and all that run
    the stage, at least as many), and is there only where some are (the main stage: every runner-up +9% or more,
    no note; the long-context stage has some)."""
    from densetrain.tools.plan import format_layout_plan, layout_plan
    from densetrain.tools.plan.report import layout_plan_json

    r = layout_plan(load_config(preset), gpus, preset=preset)
    text, js = format_layout_plan(r), layout_plan_json(r)
    said = {}
    for stage in re.findall(r"^stage '.*\n(?:  .*\n?)*", text, flags=re.M):  # a stage's line and its indented ones
        excess = [float(m) / 100 for m in re.findall(r" s  \+([0-9.]+)%", stage)]
        close = sum(e < CHECKED_ERROR for e in excess)
        notes = re.findall(r"does not tell the pick from (\d+) of the (\d+) layouts of other shapes that run the stage "
                           r"\((\d+) listed above\)", stage)
        assert excess and [n[2] for n in notes] == ([str(close)] if close else []), stage
        assert all(int(n[2]) <= int(n[0]) <= int(n[1]) for n in notes)
        said[stage.split("'")[1]] = notes
    assert said["main"] == [] and said["long_context"] != []
    assert {st["name"]: st["within_error"] for st in js["stages"]} == {k: int(n[0][0]) if n else 0
                                                                       for k, n in said.items()}
