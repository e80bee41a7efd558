"""Every norm densetrain logs or judges is the norm of the full tensor on one process, whatever the layout,
and the same on every rank: the grad norm (``clip_grad_norm``), the update norm and the parameter norm per
layer group and their ratios (``UpdateNorms``), under DDP, FSDP2, HSDP, FSDP2 x TP, DDP-replicas x TP and
FSDP2 x CP, in one launch of 4 gloo ranks (one mesh per layout). The truth is computed on each rank from
the gathered full tensors in float64.

Before the fix the logged update norm under DDP was 1/sqrt(world) of the true one (plain parameters were
weighted by 1/world and no all-reduce ran when no parameter was a DTensor). The same launch checks the
pipeline-stage sum (``FullNorms(..., extra_group=...)``) on two stages of two replicas.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from conftest import run_script_ranks

from densetrain.config import ModelConfig
from densetrain.config.recovery import GuardConfig
from densetrain.metrics import MetricsLogger
from densetrain.model.init import init_weights
from densetrain.model.llama import Transformer
from densetrain.train.watch.updates import UpdateNorms
from densetrain.train.watchers import Verdict

LAYOUTS = {
    "ddp": {"dp_replicate": 4},
    "fsdp2": {"dp_replicate": 1, "dp_shard": 4},
    "hsdp": {"dp_replicate": 2, "dp_shard": 2},
    "fsdp2xtp2": {"dp_replicate": 1, "dp_shard": 2, "tp": 2},
    "replicas_x_tp2": {"dp_replicate": 2, "tp": 2},
    "fsdp2xcp2": {"dp_replicate": 1, "dp_shard": 2, "cp": 2},
    "tp4": {"dp_replicate": 1, "tp": 4},
    "tp4_sp": {"dp_replicate": 1, "tp": 4, "sequence_parallel": True},
}

_WORKER = r"""
import json, math, os, sys
import torch
root, out = sys.argv[1:]
sys.path.insert(0, root)
torch.set_num_threads(1)
from densetrain.config import load_config
from densetrain.config.recovery import GuardConfig
from densetrain.optim import build_optimizer, set_lr
from densetrain.parallel import build_parallel_model, clip_grad_norm, init_distributed
from densetrain.parallel.norms import FullNorms
from densetrain.train.watch.updates import UpdateNorms, layer_group

LAYOUTS = json.loads(os.environ["LAYOUTS"])


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


res = {}
for name, layout in LAYOUTS.items():
    cfg = load_config(preset="tiny", overrides=[
        ("model.vocab_size", 64), ("model.d_model", 32), ("model.n_layers", 2), ("model.n_heads", 4),
        ("model.n_kv_heads", 4), ("model.d_ff", 64), ("train.seed", 3), ("train.device", "cpu"),
        ("train.dtype", "fp32"), ("eval.tasks", ""), ("eval.final_tasks", ""), ("eval.samples", 0),
        *[(f"parallel.{k}", v) for k, v in layout.items()]])
    info = init_distributed("cpu", cfg.parallel)
    model, step_model = build_parallel_model(cfg, info)
    opt = build_optimizer(model, cfg)
    set_lr(opt, 1e-2)
    g = torch.Generator().manual_seed(100 + info.dp_rank)  # different data per data-parallel rank
    x = torch.randint(0, 64, (2, 16), generator=g)
    step_model(x).float().logsumexp(-1).square().mean().backward()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    true_grad = math.sqrt(sum(float(full(p.grad).double().square().sum()) for _, p in named))
    grad_norm = float(clip_grad_norm(model, float("inf")))
    watcher = UpdateNorms(GuardConfig())
    watcher.install(model, opt)
    watcher.measure = True
    before = {n: full(p).detach().double().clone() for n, p in named}
    opt.step()
    truth = {}
    for n, p in named:
        new = full(p).detach().double()
        sq = truth.setdefault(layer_group(n), [0.0, 0.0])
        sq[0] += float((new - before[n]).square().sum())
        sq[1] += float(new.square().sum())
    want = {f"update/{k}": math.sqrt(u) for k, (u, _) in truth.items()}
    want.update({f"update_ratio/{k}": math.sqrt(u / p) for k, (u, p) in truth.items()})
    u_all, p_all = sum(u for u, _ in truth.values()), sum(p for _, p in truth.values())
    want.update({"update_norm": math.sqrt(u_all), "update_ratio": math.sqrt(u_all / p_all)})
    res[name] = {"grad_norm": grad_norm, "true_grad_norm": true_grad, "metrics": watcher.metrics(), "want": want}
# Pipeline stages (as a pipeline would lay them out): ranks 0, 1 hold stage 0's tensors (DDP replicas),
# ranks 2, 3 stage 1's; the pipeline groups {0, 2} and {1, 3} join the ranks of the same replica.
rank = torch.distributed.get_rank()
pp_groups = [torch.distributed.new_group([0, 2]), torch.distributed.new_group([1, 3])]
stage = rank // 2
mine = [torch.full((3,), 1.0 + stage), torch.full((2,), 10.0 * (1 + stage))]  # group 0, group 1 of the model
res["stages"] = FullNorms(mine, [0, 1], extra_group=pp_groups[rank % 2]).norms(mine).tolist()
with open(f"{out}.{os.environ['RANK']}", "w") as f:
    json.dump(res, f)
torch.distributed.destroy_process_group()
sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
"""


def test_norms_are_the_full_tensors_on_every_layout_and_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYOUTS", json.dumps(LAYOUTS))
    out = run_script_ranks(_WORKER, tmp_path, "norms", world=4, timeout=300)
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(4)]
    # two pipeline stages of two replicas each: every rank gets the norms of both stages' tensors per group
    want = [(3 * 1.0**2 + 3 * 2.0**2) ** 0.5, (2 * 10.0**2 + 2 * 20.0**2) ** 0.5]
    for res in ranks:
        assert res["stages"][0] == pytest.approx(want, rel=1e-6)  # fp32 norms of the local parts
    for name in LAYOUTS:
        for r, res in enumerate(ranks):
            got = res[name]
            assert got["grad_norm"] == pytest.approx(got["true_grad_norm"], rel=1e-6), (name, r, got)
            assert set(got["metrics"]) == set(got["want"]), name
            for k, v in got["want"].items():
                assert got["metrics"][k] == pytest.approx(v, rel=1e-5), (name, r, k, got["metrics"][k], v)
        # the same numbers on every rank, bitwise
        assert len({json.dumps([res[name]["grad_norm"], res[name]["metrics"]]) for res in ranks}) == 1, name


def test_update_norm_warning_names_the_group_that_moved_most(tmp_path):
    """A jump of the lr of ``layers.1`` alone (its own optimizer group) past a steady history: the event
    names ``layers.1`` with its ratio ||Δθ|| / ||θ||."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
    torch.manual_seed(0)
    model = Transformer(cfg)
    init_weights(model, cfg)
    hot = [p for n, p in model.named_parameters() if n.startswith("layers.1.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("layers.1.")]
    opt = torch.optim.AdamW([{"params": rest}, {"params": hot}], lr=1e-3)
    log = MetricsLogger(tmp_path, tensorboard=False)
    run = types.SimpleNamespace(model=model, optimizer=opt, log=log, lr_scale=1.0, state=types.SimpleNamespace(step=0))
    watcher = UpdateNorms(GuardConfig(update_every=1, min_history=4, window=8))
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for step in range(7):
        run.state.step = step
        watcher.before_step(run)
        opt.zero_grad()
        model(x).logsumexp(-1).mean().backward()
        opt.param_groups[1]["lr"] = 1e-3 if step < 6 else 1.0  # the last step: layers.1 moves ~1000x more
        opt.step()
        watcher.after_step(run, types.SimpleNamespace(index=step, lr=1e-3), Verdict.APPLY)
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    (event,) = [e for e in events if e.get("kind") == "update_norm"]
    assert event["step"] == 6 and event["values"]["group"] == "layers.1", event
    assert "layers.1 moved most" in event["text"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (last,) = [r for r in records if r["kind"] == "update" and r["step"] == 6]
    assert event["values"]["group_update_ratio"] == pytest.approx(last["update_ratio/layers.1"])
    assert last["update_ratio/layers.1"] > 10 * max(v for k, v in last.items() if k.startswith("update_ratio/layers.0"))
