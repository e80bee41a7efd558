"""Chinchilla planner: the paper's Table 3 reproduced by C = 6ND, D = 20N; presets; throughput; errors; CLI."""

from __future__ import annotations

import argparse
import math

import forked
import pytest

from densetrain.tools.plan import CHINCHILLA_TABLE3, format_plan, nearest_preset, plan, preset_shapes


@pytest.fixture(scope="module")
def presets():
    return preset_shapes()


@pytest.mark.parametrize("row", CHINCHILLA_TABLE3, ids=lambda r: r.label)
def test_table3_rows_from_flops(row, presets):
    """Every budget of Hoffmann et al. 2022 Table 3 gives the published params and tokens within 10 %."""
    r = plan(flops=row.flops, presets=presets)
    assert r["params"] == pytest.approx(row.params, rel=0.10)
    assert r["tokens"] == pytest.approx(row.tokens, rel=0.10)
    assert r["flops"] == pytest.approx(row.flops, rel=1e-12)
    assert 6 * r["params"] * r["tokens"] == pytest.approx(row.flops, rel=1e-12)
    assert r["table3"]["label"] == row.label


def test_table3_exact_rows():
    """Spot values quoted in the docs (rounding of the paper's table)."""
    r = plan(flops=1.92e19)
    assert round(r["params"] / 1e6) == 400 and round(r["tokens"] / 1e9, 1) == 8.0
    r = plan(flops=1.21e20)
    assert r["params"] == pytest.approx(1e9, rel=0.01) and r["tokens"] == pytest.approx(20.2e9, rel=0.01)
    r = plan(flops=1.23e22)
    assert r["params"] == pytest.approx(10e9, rel=0.02) and r["tokens"] == pytest.approx(205.1e9, rel=0.02)


@pytest.mark.parametrize("row", CHINCHILLA_TABLE3, ids=lambda r: r.label)
def test_table3_rows_from_params(row, presets):
    # 12 %: the 67B row prints 1.5T tokens although its own budget gives 5.76e23 / (6 * 67e9) = 1.43T;
    # D = 20 N gives 1.34T (6 % below 1.43T, 11 % below the printed 1.5T). Every other row is within 8 %.
    r = plan(params=row.params, presets=presets)
    assert r["tokens"] == pytest.approx(row.tokens, rel=0.12)
    assert r["flops"] == pytest.approx(row.flops, rel=0.16)  # C ~ N^2: twice the token error
    assert plan(tokens=r["tokens"], presets=presets)["params"] == pytest.approx(row.params, rel=1e-12)


def test_presets_match_real_models(presets):
    import torch

    from densetrain.config import load_config
    from densetrain.model.llama import Transformer

    by_name = {p["name"]: p for p in presets}
    assert {"tiny", "gpt2-124m", "llama3-8b"} <= set(by_name)
    cfg = load_config(preset="tiny")
    assert by_name["tiny"]["params"] == Transformer(cfg.model).num_params()
    assert by_name["llama3-8b"]["params"] == pytest.approx(8.03e9, rel=0.005)  # Llama 3 paper: 8.03B
    assert nearest_preset(8e9, presets)["name"] == "llama3-8b"
    assert nearest_preset(5e6, presets)["name"] == "tiny"
    assert [p["params"] for p in presets] == sorted(p["params"] for p in presets)
    assert torch.get_default_device().type == "cpu"  # the meta-device builds leave no global state


def test_wall_time(presets):
    # 1.21e20 FLOPs at 1e15 FLOP/s x 0.5 mfu = 2.42e5 s.
    r = plan(flops=1.21e20, peak_flops=1e15, mfu=0.5, presets=presets)
    assert r["seconds"] == pytest.approx(2.42e5)
    assert r["hours"] == pytest.approx(2.42e5 / 3600)
    assert r["throughput"]["tokens_per_sec"] == pytest.approx(r["tokens"] / r["seconds"])
    # Declared tokens/s: seconds = D / tps, and the implied mfu is reported against a peak.
    r = plan(params=1e9, tokens_per_sec=1e5, peak_flops=1e15, presets=presets)
    assert r["seconds"] == pytest.approx(20e9 / 1e5)
    assert r["throughput"]["implied_mfu"] == pytest.approx(6 * 1e9 * 1e5 / 1e15)
    p = r["preset"]
    assert p["seconds"] == pytest.approx(p["flops_per_token"] * p["optimal_tokens"] / (6e9 * 1e5))
    assert p["tokens_at_budget"] == pytest.approx(r["flops"] / (6 * p["params"]))
    assert plan(flops=1e20, presets=presets)["seconds"] is None


def test_hours(presets):
    r = plan(hours=10, peak_flops=1e15, mfu=0.4, presets=presets)
    assert r["flops"] == pytest.approx(1e15 * 0.4 * 36000)
    assert r["seconds"] == pytest.approx(36000)
    assert r["tokens"] == pytest.approx(20 * r["params"])
    r = plan(hours=2, tokens_per_sec=5e4, presets=presets)
    assert r["tokens"] == pytest.approx(5e4 * 7200) and r["params"] == pytest.approx(5e4 * 7200 / 20)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({}, "exactly one"),
        ({"flops": 1e20, "params": 1e9}, "exactly one"),
        ({"flops": -1.0}, "flops must be a positive"),
        ({"flops": math.nan}, "flops must be a positive"),
        ({"hours": 5}, "needs a throughput"),
        ({"flops": 1e20, "mfu": 1.5}, "mfu"),
        ({"params": 1e9, "tokens_per_sec": 0}, "tokens_per_sec"),
    ],
)
def test_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan(**kwargs)


def test_format_and_cli(capsys, presets):
    text = format_plan(plan(flops=1.21e20, peak_flops=1e15, presets=presets))
    assert "1.004e+09" in text and "1 Billion" in text and "nearest preset" in text and "h (" in text

    from densetrain.tools.commands import add_subcommands

    parser = argparse.ArgumentParser(prog="densetrain")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", "--flops", "1.92e19", "--peak-flops", "1e15"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "4.000e+08" in out and "8e+09" not in out and "8B" in out
    args = parser.parse_args(["plan", "--hours", "3"])
    assert args.func(args) == 2
    assert "densetrain: error: hours needs a throughput" in capsys.readouterr().err
    args = parser.parse_args(["plan", "--flops", "1e20", "--params", "1e9"])
    assert args.func(args) == 2
    assert "give exactly one of --flops" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# Memory and layout planner
# --------------------------------------------------------------------------------------------------


def test_llama3_8b_on_64_h100s():
    from densetrain.config import load_config
    from densetrain.parallel.mesh import Layout
    from densetrain.tools.plan import GIB, format_layout_plan, layout_plan

    r = layout_plan(load_config(preset="llama3-8b"), 64, 80)
    assert r["model"]["params"] == 8_030_261_248
    by = {x["layout"]: x for x in r["layouts"]}
    # DDP holds 16 bytes per parameter: 120 GiB before any activation; never fits.
    ddp = by[Layout(64, 1, 1)]["stages"][0]
    assert not ddp["fits"] and ddp["bytes"]["params"] + ddp["bytes"]["grads"] + ddp["bytes"]["optim"] == \
        pytest.approx(16 * 8_030_261_248)
    # FSDP over all 64: 1.9 GiB of state each; 8192-token sequences fit without recomputation at tp 1,
    # FSDP over 4 (HSDP 16 x 4) needs selective recomputation. The cross-entropy is chunked (8192 x 128256
    # logits exceed 2**26), so no stage holds the whole logits.
    fsdp = by[Layout(1, 64, 1)]["stages"][0]
    assert fsdp["fits"] and fsdp["ac"] == "none" and fsdp["bytes"]["chunked_loss"]
    state = fsdp["bytes"]["params"] + fsdp["bytes"]["grads"] + fsdp["bytes"]["optim"]
    assert state / GIB == pytest.approx(1.87, abs=0.01)
    assert by[Layout(16, 4, 1)]["stages"][0]["ac"] == "selective"
    # 131072-token sequences: no layout without context parallelism runs them (131072 tokens of
    # activations per GPU); cp 2 halves the tokens per GPU and, with full recomputation, fits.
    assert not any(x["stages"][2]["fits"] for x in r["layouts"] if x["layout"].cp == 1)
    long = by[Layout(8, 4, 1, 2)]["stages"][2]
    assert long["fits"] and long["ac"] == "full"
    sug = r["suggested"]
    assert sug is not None and sug["runs_all"] and sug["layout"].cp >= 2
    assert r["stages"][2]["best"].cp >= 2
    # time from the cost model: the best layout's step is its parts' sum; no stage time is assumed
    t = r["stages"][0]["time"]
    assert r["stages"][0]["step_s"] == pytest.approx(sum(t["parts"].values())) and 0.3 < t["mfu"] < 0.6
    assert r["days"] == pytest.approx(sum(s["days"] for s in r["stages"]))
    assert sug["days"] >= r["days"]  # one layout for all stages is never faster than each stage on its own
    assert r["tokens"] == pytest.approx(sum(s["tokens"] for s in r["stages"])) and 14e12 < r["tokens"] < 16e12
    text = format_layout_plan(r)
    assert "fits no layout" not in text
    assert "one layout for every stage: " in text and "--parallel.cp=" in text
    days = round(r["days"])
    assert 365 < r["days"] < 440  # the cost model's time (docs/planner.md), over a year: said
    assert f"total: {days} days, 15T tokens" in text and "rejected " in text and "do not fit in memory" in text
    assert f"warning: the run takes {days} days (1.1 years) on 64 GPUs" in text


def test_one_gpu_blames_the_state_not_the_logits():
    """On one 80 GiB GPU the 8B model's fp32 parameters, gradients and AdamW moments (120 GiB) are what
    does not fit; the advice says so and gives the parts."""
    from densetrain.config import load_config
    from densetrain.tools.plan import format_layout_plan, layout_plan

    text = format_layout_plan(layout_plan(load_config(preset="llama3-8b"), 1, 80))
    line = next(x for x in text.splitlines() if x.startswith("stage 'main' fits no layout"))
    assert "state 119.7" in line and "parameters, gradients and AdamW moments" in line and "logits" not in line


def test_plan_cli_memory_mode(capsys):
    from densetrain.tools.commands import add_subcommands

    parser = argparse.ArgumentParser(prog="densetrain")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", "--preset", "gpt2-124m", "--gpus", "8", "--gpu-memory-gib", "80"])
    # 8 DDP ranks x micro-batch 4 exceed the long_context stage's 16 sequences: tp 2 lets 4 ranks split it. The
    # configured layout (DDP 8; micro-batch 16 at the 8K stages' 64 sequences) runs no stage: the plan says so per
    # stage after its suggestions, and exits 2.
    assert args.func(args) == 2
    cap = capsys.readouterr()
    assert "do not split the batch" in cap.out
    assert "one layout for every stage: " in cap.out
    err = cap.err.strip().splitlines()
    assert [x.split(":")[1].strip() for x in err] == ["error"] * 3, err
    assert err[0].startswith("densetrain: error: stage 'main' ([parallel]): dp_replicate=8 dp_shard=1 tp=1 cannot "
                             "run it: its batch of 64 sequences does not split into 8 data-parallel ranks x "
                             "micro_batch_size 16"), err
    assert "stage 'long_context' ([parallel]): dp_replicate=8 dp_shard=1 tp=1 cannot run it: its batch of 16 " in err[2]
    assert "configured layout: does NOT run: stage 'anneal' ([parallel]): " in cap.out
    args = parser.parse_args(["plan", "--params", "1.2e9", "--tokens", "2.4e10", "--gpus", "8",
                              "--gpu-memory-gib", "40"])
    assert args.func(args) == 0
    assert "1.2B parameters" in capsys.readouterr().out
    args = parser.parse_args(["plan", "--preset", "tiny", "--gpus", "8", "--hardware", "no-such-gpu"])
    assert args.func(args) == 2
    assert "--hardware no-such-gpu: no such file or profile" in capsys.readouterr().err


def test_train_dry_run_prints_the_plan_without_data(tmp_path):
    import sys

    r = forked.run([sys.executable, "-m", "densetrain", "train", "--preset", "llama3-8b", "--dry-run",
                    "--train.run_dir", str(tmp_path / "run"), "--parallel.dp_replicate=-1", "--parallel.dp_shard=1"],
                   capture_output=True, text=True, timeout=120, env={**__import__("os").environ, "WORLD_SIZE": "64"})
    # [parallel] as DDP (: every rank holds the whole 8B model's state) needs 172.5 GiB a GPU at the 8K
    # stages, over the 80 GiB assumed without a GPU: the plan is printed, then refused with status 2.
    assert r.returncode == 2, r.stderr
    assert "dry run: 64 process(es), 80 GiB per GPU (assumed" in r.stdout
    assert "stage 'main': seq_len 8192" in r.stdout and "one layout for every stage" in r.stdout
    assert ("densetrain: error: stage 'main': dp_replicate=64 dp_shard=1 tp=1 needs 172.5 GiB per GPU with "
            "activation checkpointing none, over the 72.6 GiB usable") in r.stderr
    assert not (tmp_path / "run").exists()


_MEASURE = r"""
import json, resource, sys, torch
from densetrain.config import ModelConfig
from densetrain.model.llama import Transformer
from densetrain.loss import token_losses
from densetrain.parallel.parallelize import apply_activation_checkpointing
torch.set_num_threads(1)
ac, B, T = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
m = ModelConfig(vocab_size=512, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=768)
torch.manual_seed(0)
model = Transformer(m)
apply_activation_checkpointing(model, ac)
x = torch.randint(0, 512, (B, T))
model(x[:1, :8]).sum().backward()  # allocate gradients and warm up outside the measured step
params = {p.untyped_storage().data_ptr() for p in model.parameters()}
seen, saved = set(), [0]

def pack(t):
    key = (t.untyped_storage().data_ptr(), t.dtype)
    if key not in seen and key[0] not in params:  # parameters are not activations
        seen.add(key)
        saved[0] += t.untyped_storage().nbytes()
    return t

base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    logits = model(x)
    loss = token_losses(logits, x).sum()
peak_forward = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
loss.backward()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"saved": saved[0], "rss_forward": peak_forward - base, "rss_peak": peak - base}))
"""


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_activation_estimate_against_measured_cpu(ac, tmp_path):
    """The estimate of :func:`activation_bytes_per_token` (fp32) against the bytes autograd actually
    saves (hooks on saved tensors, each storage once) and against the growth of the process's peak RSS
    over the forward, in a fresh process. Under checkpointing the hooks see only the block inputs and
    the head (a recomputed block's tensors are saved later, inside the backward), so the comparison is
    with the estimate less one block's recomputation."""
    import json
    import sys

    from densetrain.config import ModelConfig
    from densetrain.tools.plan import activation_bytes_per_token

    B, T = 4, 512
    script = tmp_path / "measure.py"
    script.write_text(_MEASURE)
    r = forked.run([sys.executable, str(script), ac, str(B), str(T)], capture_output=True, text=True,
                   timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    m = ModelConfig(vocab_size=512, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=768)
    est = activation_bytes_per_token(m, 1, ac, act_bytes=4)
    # The hooks see what autograd saves: under checkpointing only the block inputs (the kept and the
    # recomputed tensors live inside the checkpoint), and never the logits (held by the caller, counted
    # in the estimate's head as 4 V bytes per token).
    blocks_seen = est["blocks"] if ac == "none" else m.n_layers * 4 * m.d_model
    predicted_saved = (blocks_seen + est["head"] - 4 * m.vocab_size) * B * T
    ratio = predicted_saved / got["saved"]
    # Peak RSS (a high-water mark since the process started) also holds the forward's temporaries and
    # the allocator's slack, and grows only past earlier peaks: reported, not asserted.
    rss = {k: est["total"] * B * T / got[k] if got[k] > 0 else float("nan") for k in ("rss_forward", "rss_peak")}
    print(f"ac={ac}: estimate/saved-by-autograd {ratio:.3f}, estimate/peak-RSS growth over the forward "
          f"{rss['rss_forward']:.3f}, over forward+backward {rss['rss_peak']:.3f}")
    assert 0.9 < ratio < 1.1, (ac, got, predicted_saved)


_MEASURE_TP_SP = r"""
import json, os, sys
import torch
root, out = sys.argv[1:]
sys.path.insert(0, root)
torch.set_num_threads(1)
from torch.distributed.tensor import DTensor
from densetrain.config import load_config
from densetrain.loss import token_losses
from densetrain.parallel import build_parallel_model, init_distributed

cfg = load_config(preset="tiny", overrides=[
    ("model.vocab_size", 512), ("model.d_model", 256), ("model.n_layers", 4), ("model.n_heads", 4),
    ("model.n_kv_heads", 2), ("model.d_ff", 768), ("train.device", "cpu"), ("train.dtype", "fp32"),
    ("eval.tasks", ""), ("eval.final_tasks", ""), ("eval.samples", 0),
    ("parallel.dp_replicate", 1), ("parallel.tp", 2), ("parallel.sequence_parallel", True)])
info = init_distributed("cpu", cfg.parallel)
model, _ = build_parallel_model(cfg, info)
x = torch.randint(0, 512, (4, 512), generator=torch.Generator().manual_seed(0))
local = lambda t: t._local_tensor if isinstance(t, DTensor) else t
params = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
seen, saved, skipped = set(), [0], [0]

def pack(t):
    t = local(t)
    try:
        key = (t.untyped_storage().data_ptr(), t.dtype)
    except RuntimeError:  # a tensor without a storage of its own: reported, not counted
        skipped[0] += t.numel() * t.element_size()
        return t
    if key not in seen and key[0] not in params:  # parameters are not activations
        seen.add(key)
        saved[0] += t.untyped_storage().nbytes()
    return t

with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    token_losses(model(x), x).sum()
with open(out + "." + os.environ["RANK"], "w") as f:
    json.dump({"saved": saved[0], "skipped": skipped[0]}, f)
torch.distributed.destroy_process_group()
os._exit(0)
"""


def test_activation_estimate_tp2_sequence_parallel_against_autograd(tmp_path):
    """The estimate at tp 2 with sequence parallelism (fp32, no checkpointing) against the bytes autograd
    saves on each of 2 gloo ranks (local shards of DTensors, each storage once), forward of 4 x 512
    tokens and the cross-entropy of the gathered logits (the evaluation path: the logits are the caller's,
    their log-softmax is autograd's)."""
    import json
    from pathlib import Path

    from conftest import run_script_ranks

    from densetrain.config import ModelConfig
    from densetrain.tools.plan import activation_bytes_per_token

    out = run_script_ranks(_MEASURE_TP_SP, tmp_path, "measure_tp")
    m = ModelConfig(vocab_size=512, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=768)
    est = activation_bytes_per_token(m, 2, "none", act_bytes=4, sequence_parallel=True)
    predicted = (est["blocks"] + est["head"] - 4 * m.vocab_size) * 4 * 512
    for r in range(2):
        got = json.loads(Path(f"{out}.{r}").read_text())
        ratio = predicted / got["saved"]
        print(f"rank {r}: estimate/saved-by-autograd at tp 2 + sequence parallel: {ratio:.3f} (bytes of saved "
              f"tensors without a storage of their own, not counted: {got['skipped']})")
        assert 0.85 < ratio < 1.15, ratio
