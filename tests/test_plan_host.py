"""The host's share of a step (densetrain/cost/host.py): its counts against what a real 2-rank gloo step runs,
its time as counts x the profile's unit costs, and the profile's host figures through ``doctor --profile`` and
``plan --hardware``."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import gloo_env

from densetrain.config import load_config
from densetrain.cost import Parallel, load_hardware, step_time
from densetrain.cost.host import (
    KERNEL_CALLS,
    OPTIM_DTENSOR_OPS,
    TP_DTENSOR_OPS,
    dtensor_ops,
    fsdp_groups,
    kernel_calls,
    loss_parallel_logits,
)

H100 = load_hardware("h100-sxm")

_COUNT = r"""
import collections, json, sys
import torch
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from densetrain.config import load_config
from densetrain.optim import build_optimizer
from densetrain.parallel.dist import init_distributed
from densetrain.parallel.parallelize import build_parallel_model
from densetrain.train.step import forward_backward

class Count(TorchDispatchMode):  # a DTensor dispatch: an operator the mode sees with a DTensor argument
    n = gemm = attention = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = [y for a in (*args, *(kwargs or {}).values()) for y in (a if isinstance(a, (list, tuple)) else [a])]
        self.n += any(isinstance(a, DTensor) for a in flat)
        name = func.overloadpacket.__name__  # kernel calls: GEMMs, attention forwards
        self.gemm += name in ("mm", "addmm", "bmm", "baddbmm")
        self.attention += name.startswith("_scaled_dot_product") and not name.endswith("backward")
        return func(*args, **(kwargs or {}))

import densetrain.parallel.loss_parallel as lp
logits = [0]  # the rank's logits through the vocabulary-parallel cross-entropy: rows x its vocabulary slice
chunk = lp._vocab_parallel_chunk
def counted_chunk(project, weight, mesh, h, targets):
    logits[0] += h.shape[0] * weight.to_local().shape[0]
    return chunk(project, weight, mesh, h, targets)
lp._vocab_parallel_chunk = counted_chunk

groups = collections.Counter()  # FSDP2's hooks, one call a group a pass
for hook in ("pre_forward", "post_backward"):
    orig = getattr(FSDPParamGroup, hook)
    def counted(self, *a, _orig=orig, _hook=hook, **k):
        groups[_hook] += 1
        return _orig(self, *a, **k)
    setattr(FSDPParamGroup, hook, counted)

kind = sys.argv[1]
layout = {"fsdp": [("parallel.dp_shard", 2)], "tp": [("parallel.dp_shard", 1), ("parallel.tp", 2)],
          "single": [("parallel.dp_shard", 1)]}[kind]
out = {}
info = None
for n_layers in (1, 3):
    cfg = load_config("tiny", overrides=[("parallel.dp_replicate", 1), ("train.dtype", "fp32"),
                                         ("model.n_layers", n_layers), *layout])
    info = info or init_distributed("cpu", cfg.parallel)
    model, step_model = build_parallel_model(cfg, info)
    opt = build_optimizer(model, cfg)
    x = torch.randint(0, cfg.model.vocab_size, (1, 33))
    def step():  # one micro-batch's forward and backward, then the optimizer step
        forward_backward(step_model, [(x[:, :-1], x[:, 1:], ["web"])], 32, 2 if kind == "fsdp" else 1)
        opt.step()
        opt.zero_grad(set_to_none=True)
    step()  # the first creates AdamW's state (two zeros_like a parameter): not a step's work
    groups.clear()
    logits[0] = 0
    with Count() as count:
        step()
    out[n_layers] = {"dtensor": count.n, "logits": logits[0], "gemm": count.gemm, "attention": count.attention,
                     **groups}
if info.rank == 0:
    print(json.dumps(out))
"""


@pytest.mark.parametrize("kind,par", [("tp", Parallel(tp=2)), ("fsdp", Parallel(dp_shard=2)), ("single", Parallel())])
def test_counts_equal_a_real_gloo_step(kind, par, tmp_path):
    """The DTensor dispatches (TP's blocks and head, the optimizer's foreach operators), FSDP2 groups, logits
    through the vocabulary-parallel cross-entropy and kernel calls (GEMMs, attention) that
    :mod:`densetrain.cost.host` counts equal those a real training micro-step and AdamW step run on 2 gloo ranks
    (one process for ``single``), for the tiny preset at 1 and 3 blocks (so per block and outside the blocks
    both)."""
    import forked

    script = tmp_path / "count.py"
    script.write_text(_COUNT)
    ranks = par.world
    env = {**gloo_env(ranks), "PYTHONPATH": str(Path(__file__).parents[1])}
    procs = [forked.Popen([sys.executable, str(script), kind], text=True, stdout=forked.PIPE, stderr=forked.PIPE,
                          env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(ranks)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    counted = json.loads(outs[0][0].strip().splitlines()[-1])
    for n_layers in (1, 3):
        got = counted[str(n_layers)]
        assert got["dtensor"] == dtensor_ops(par, 1, n_layers, 1), (n_layers, got)
        assert got.get("pre_forward", 0) == got.get("post_backward", 0) == fsdp_groups(par, 1, n_layers, 1)
        # one micro-batch of 32 tokens: the rank's 32 x 8192 / tp logits (none without TP)
        assert got["logits"] == loss_parallel_logits(par, 1, 1, 32 * 8192 / par.tp), (n_layers, got)
        assert (got["gemm"], got["attention"]) == kernel_calls(1, n_layers, 1), (n_layers, got)
    if kind == "tp":  # the constants themselves, so that a change in torch shows which one moved
        assert counted["3"]["dtensor"] - counted["1"]["dtensor"] == 2 * TP_DTENSOR_OPS[0]
        assert counted["1"]["dtensor"] == TP_DTENSOR_OPS[0] + TP_DTENSOR_OPS[1] + OPTIM_DTENSOR_OPS
    elif kind == "fsdp":
        assert counted["1"]["dtensor"] == OPTIM_DTENSOR_OPS and counted["3"]["pre_forward"] == 4
    else:  # one process: no DTensor, no FSDP2; 7 linears a block (3 GEMMs each) and the head's 3
        assert counted["1"]["dtensor"] == 0 and "pre_forward" not in counted["1"]
        assert counted["3"]["gemm"] - counted["1"]["gemm"] == 2 * KERNEL_CALLS[0] == 42
        assert counted["1"]["gemm"] == KERNEL_CALLS[0] + KERNEL_CALLS[2] and counted["3"]["attention"] == 3


def test_host_time_is_counts_times_the_profiles_unit_costs():
    """The host part of :func:`step_time` is the counted DTensor dispatches, FSDP2 groups and kernel calls at the
    profile's unit costs (a kernel call's beyond its operators' ``op_overhead_s``), plus, where collectives run
    on the compute's cores, what the step model hid of the data-parallel collectives at their measured rates; the
    GPU profiles (no unit costs) add nothing."""
    m = load_config("tiny").model
    cpu = replace(H100, sms=0, dtensor_op_s=1e-4, fsdp_group_s=2e-3, loss_parallel_logit_s=1e-8, op_overhead_s=4e-6,
                  gemm_call_s=2.4e-5, attention_call_s=3e-4)
    for par, batch in ((Parallel(tp=2), 2), (Parallel(dp_shard=2), 4), (Parallel(dp_replicate=2), 4),
                       (Parallel(), 2)):
        assert step_time(m, par, H100, 128, batch, 1, "none", "fp32")["parts"]["host"] == 0.0
        got = step_time(m, par, cpu, 128, batch, 1, "none", "fp32")["parts"]["host"]
        n_micro = batch // (par.dp_shard * par.dp_replicate)
        want = dtensor_ops(par, n_micro, m.n_layers, 1) * 1e-4 + fsdp_groups(par, n_micro, m.n_layers, 1) * 2e-3
        want += loss_parallel_logits(par, n_micro, 1, 128 * 8192 / par.tp) * 1e-8
        # per micro-batch 4 blocks x 21 GEMMs + the head's 3, at 20 µs beyond the operator; 4 attention calls
        # (a forward and a backward operator each) at 292 µs
        want += n_micro * ((4 * 21 + 3) * 2e-5 + 4 * 2.92e-4)
        assert got == pytest.approx(want, rel=1e-9)
    # a profile whose kernel calls cost no more than their operators adds nothing for them
    flat = replace(cpu, gemm_call_s=1e-6, attention_call_s=5e-6)
    assert step_time(m, Parallel(), flat, 128, 2, 1, "none", "fp32")["parts"]["host"] == 0.0
    # tp 2, 2 micro-batches of 128 tokens: each rank takes 2 x 128 x 4096 logits through the split passes
    assert loss_parallel_logits(Parallel(tp=2), 2, 1, 128 * 8192 / 2) == 2 * 128 * 4096
    assert loss_parallel_logits(Parallel(tp=2), 2, 0, 128 * 8192 / 2) == 0  # a pipeline stage without the head
    # tp 2, one micro-batch of each of 2 sequences: 4 blocks and the head, then AdamW's 15
    assert dtensor_ops(Parallel(tp=2), 2, 4, 1) == 2 * (141 * 4 + 52) + 15
    # FSDP2 on 2 ranks with gloo's collectives on the cores: the hidden all-gathers and reduce-scatter are
    # charged at their own rates (a reduce-scatter 4x slower than the link costs 4x the link's time)
    on = replace(cpu, collectives_on_cores=1.0, nvlink_bytes_per_s=1e9, latency_intra_s=1e-6,
                 all_gather_bytes_per_s=1e9, reduce_scatter_bytes_per_s=0.25e9, network_efficiency=1.0)
    fsdp = step_time(m, Parallel(dp_shard=2), on, 128, 4, 1, "none", "fp32")
    off = step_time(m, Parallel(dp_shard=2), replace(on, collectives_on_cores=0.0), 128, 4, 1, "none", "fp32")
    params = m.n_layers * (128 * (128 + 2 * 64) + 128 * 128 + 3 * 128 * 352) + 128 * 8192 * (
        1 if m.tie_embeddings else 2)
    gathered = 2 * 4 * (params + (m.n_layers - 1) * (128 * 256 + 128 * 128 + 3 * 128 * 352))  # 2 micro-batches
    comm = 0.5 * gathered / 1e9 + 0.5 * 4 * params / 0.25e9
    assert fsdp["parts"]["host"] - off["parts"]["host"] == pytest.approx(comm - fsdp["parts"]["dp"], rel=1e-6)


def test_doctor_profile_has_the_host_figures_and_plan_reads_them(tmp_path, capsys):
    """``doctor --profile`` on one CPU process measures the DTensor and FSDP2 unit costs on densetrain's own
    probe model (a private 1-rank group, gone afterwards) and marks the collectives as on the cores; ``plan
    --hardware`` reads the file back and a TP layout's predicted step then holds a host part."""
    import torch.distributed as dist

    from densetrain.cli import main

    path = tmp_path / "me.json"
    assert main(["doctor", "--preset", "tiny", "--health.seconds=0.01", "--health.trials=1",
                 "--health.copy_mib=1", "--profile", str(path)]) in (0, 3)  # healthy, or busy on a shared host
    assert not dist.is_initialized()  # the probes' private group is destroyed
    hw = load_hardware(path)
    assert hw.collectives_on_cores == 1.0 and hw.all_gather_bytes_per_s == 0.0  # one rank: no collective
    # intercepts of two timings: 0 when a busy machine makes the wrapped run no slower, never absurd
    assert 0 <= hw.dtensor_op_s < 0.05 and 0 <= hw.fsdp_group_s < 0.5
    assert 0 <= hw.loss_parallel_logit_s < 1e-6  # a logit's split passes: ns, not µs
    # a small GEMM's and attention call's cost beyond their FLOPs: µs to ms here, more on a busy machine (the
    # loader's bound, 1 s, is what holds everywhere)
    assert 0 <= hw.gemm_call_s < 1.0 and 0 <= hw.attention_call_s < 1.0
    raw = json.loads(path.read_text())
    assert raw["dtensor_op_s"] == hw.dtensor_op_s and raw["fsdp_group_s"] == hw.fsdp_group_s
    assert raw["loss_parallel_logit_s"] == hw.loss_parallel_logit_s
    assert raw["gemm_call_s"] == hw.gemm_call_s and raw["attention_call_s"] == hw.attention_call_s
    capsys.readouterr()
    assert main(["plan", "--preset", "tiny", "--gpus", "1", "--hardware", str(path), "--json"]) == 0
    assert '"mfu"' in capsys.readouterr().out
    m = load_config("tiny").model
    tp = step_time(m, Parallel(tp=2), replace(hw, dtensor_op_s=max(hw.dtensor_op_s, 1e-6)), 128, 2, 1, "none",
                   "fp32")
    assert tp["parts"]["host"] >= dtensor_ops(Parallel(tp=2), 2, m.n_layers, 1) * 1e-6
    # one process: the host part is the profile's kernel calls, each beyond its operators' fixed cost
    gemms, attentions = kernel_calls(2, m.n_layers, 1)
    want = (gemms * max(0.0, hw.gemm_call_s - hw.op_overhead_s)
            + attentions * max(0.0, hw.attention_call_s - 2 * hw.op_overhead_s))
    assert step_time(m, Parallel(), hw, 128, 2, 1, "none", "fp32")["parts"]["host"] == pytest.approx(want, rel=1e-9)


def test_doctor_profile_on_two_gloo_ranks_measures_the_pair(tmp_path):
    """``doctor --profile`` as torchrun starts it on 2 CPU ranks: every rank runs the host probes on the pair
    (fixed counts, so their collectives match) and rank 0 writes the gloo all-gather and reduce-scatter rates
    beside the DTensor and FSDP2 costs."""
    import forked

    path = tmp_path / "pair.toml"
    env = {**gloo_env(2), "LOCAL_WORLD_SIZE": "2", "PYTHONPATH": str(Path(__file__).parents[1])}
    argv = [sys.executable, "-m", "densetrain", "doctor", "--preset", "tiny", "--health.seconds=0.01",
            "--health.trials=1", "--health.copy_mib=1", "--profile", str(path)]
    procs = [forked.Popen(argv, text=True, stdout=forked.PIPE, stderr=forked.PIPE,
                          env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    hw = load_hardware(path)
    assert hw.all_gather_bytes_per_s > 0 and hw.reduce_scatter_bytes_per_s > 0 and hw.collectives_on_cores == 1.0
    assert 0 <= hw.dtensor_op_s < 0.05 and 0 <= hw.fsdp_group_s < 0.5 and hw.gpus_per_node == 2
    assert 0 <= hw.loss_parallel_logit_s < 1e-6
