"""``optim.name = 'muon'``: torch.optim.Muon for the hidden matrices, AdamW for the rest.

- parameter groups: every attention/MLP matrix on Muon, embeddings, head and norm gains on AdamW, each group
  with its own lr (schedule x muon_lr / peak_lr), momentum and weight decay; bad optim fields are one-line errors;
- the real loop, resumed from a checkpoint in a fresh call, continues bitwise (fp32) as if never stopped;
- FSDP2 on 2 gloo ranks (each update gathered to the whole matrix for Newton-Schulz) gives the
  single-process losses and final weights over 6 fp32 steps.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path

import forked
import pytest
import torch
from conftest import gloo_env
from torch.optim._muon import _zeropower_via_newtonschulz

from densetrain.checkpoint import load_checkpoint
from densetrain.config import load_config, save_config
from densetrain.config.validate import validate
from densetrain.errors import ConfigError
from densetrain.metrics import read_metrics
from densetrain.model.init import build_model
from densetrain.optim import MuonAdamW, build_optimizer, newton_schulz_fp32, set_lr
from densetrain.tools.commands import add_subcommands
from densetrain.tools.mup import format_lr_sweep, lr_sweep
from densetrain.train import train

ROOT = Path(__file__).resolve().parents[1]
MUON = {"optim.name": "muon", "optim.muon_lr": 0.02, "optim.muon_momentum": 0.9, "optim.muon_weight_decay": 0.05,
        "eval.every": 0, "logging.tensorboard": False, "checkpoint.keep": 0}


def _cfg(**ov):
    base = {"model.vocab_size": 512, "model.d_model": 64, "model.n_layers": 2, "model.n_heads": 4,
            "model.n_kv_heads": 2, "model.d_ff": 128, "optim.peak_lr": 4e-3, "train.dtype": "fp32", **ov}
    return load_config(preset="tiny", overrides=list(base.items()))


def test_param_groups_split_hidden_matrices_from_the_rest():
    cfg = _cfg(**{"optim.name": "muon", "optim.muon_lr": 0.02, "optim.muon_momentum": 0.9,
                  "optim.muon_weight_decay": 0.05, "optim.weight_decay": 0.1})
    model = build_model(cfg.model, 0)
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, MuonAdamW)
    muon = [n for g in opt.param_groups if g["muon"] for n in g["names"]]
    adamw = [n for g in opt.param_groups if not g["muon"] for n in g["names"]]
    want_muon = [f"layers.{i}.{m}.{w}.weight" for i in range(2)
                 for m, ws in (("attention", "wq wk wv wo"), ("feed_forward", "w1 w2 w3")) for w in ws.split()]
    assert sorted(muon) == sorted(want_muon)
    assert sorted(adamw) == sorted(["tok_embeddings.weight", "output.weight", "norm.weight"]
                                   + [f"layers.{i}.{n}_norm.weight" for i in range(2) for n in ("attention", "ffn")])
    # Every parameter exactly once, and the inner optimizers hold exactly their own groups.
    assert len(muon) + len(adamw) == len(list(model.parameters()))
    assert all(g["muon"] for g in opt.muon.param_groups) and not any(g["muon"] for g in opt.adamw.param_groups)
    # Each group's own lr / momentum / weight decay: lr = schedule value x lr_scale.
    set_lr(opt, 1e-3)
    by_name = {n: g for g in opt.param_groups for n in g["names"]}
    wq = by_name["layers.0.attention.wq.weight"]
    assert wq["lr"] == pytest.approx(1e-3 * 0.02 / 4e-3) and wq["momentum"] == 0.9 and wq["weight_decay"] == 0.05
    assert by_name["output.weight"]["lr"] == 1e-3 and by_name["output.weight"]["weight_decay"] == 0.1
    assert by_name["tok_embeddings.weight"]["weight_decay"] == 0.0 and by_name["norm.weight"]["weight_decay"] == 0.0
    assert by_name["output.weight"]["betas"] == (cfg.optim.beta1, cfg.optim.beta2)
    # Under μP the AdamW groups keep their μP scale, the Muon group does not take 1/width_mult.
    mup = _cfg(**{"optim.name": "muon", "model.init": "mup", "model.base_d_model": 32})
    groups = build_optimizer(build_model(mup.model, 0), mup).param_groups
    assert {g["lr_scale"] for g in groups} == {mup.optim.muon_lr / mup.optim.peak_lr, 1.0}
    # AdamW (the default) is unchanged: one optimizer, no 'muon' key in its groups.
    plain = build_optimizer(model, _cfg())
    assert type(plain) is torch.optim.AdamW and not any("muon" in g for g in plain.param_groups)


def test_muon_step_is_torchs_and_state_round_trips():
    # train.dtype bf16: Newton-Schulz in bf16 as torch runs it, AdamW's fused kernel.
    cfg = _cfg(**{"optim.name": "muon", "optim.muon_momentum": 0.9, "optim.muon_weight_decay": 0.05,
                  "train.dtype": "bf16"})
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    ours, theirs = build_model(cfg.model, 0), build_model(cfg.model, 0)
    opt = build_optimizer(ours, cfg)
    # The same update from torch's own optimizers, built by hand from the documented split.
    named = dict(theirs.named_parameters())
    ref = [torch.optim.Muon([named[n] for g in opt.muon.param_groups for n in g["names"]], lr=1e-3 * 5.0,
                            momentum=0.9, weight_decay=0.05, nesterov=True, adjust_lr_fn="original"),
           torch.optim.AdamW([{"params": [named[n] for n in g["names"]], "weight_decay": g["weight_decay"]}
                              for g in opt.adamw.param_groups], lr=1e-3, betas=(cfg.optim.beta1, cfg.optim.beta2),
                             eps=cfg.optim.eps, fused=True)]
    assert cfg.optim.muon_lr / cfg.optim.peak_lr == 5.0

    def step(model, opts):
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        for o in opts:
            o.step()
            o.zero_grad()

    for _ in range(2):
        set_lr(opt, 1e-3)
        step(ours, [opt])
        step(theirs, ref)
    for (n, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(a, b), n
    # A fresh optimizer loaded from the state dict is the same optimizer: one more step agrees bitwise.
    again = build_model(cfg.model, 0)
    again.load_state_dict(ours.state_dict())
    opt2 = build_optimizer(again, cfg)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # a copy: load_state_dict keeps the tensors it gets
    assert opt2.muon.state is opt2.state and opt2.adamw.param_groups[0] is opt2.param_groups[1]
    for model, o in ((ours, opt), (again, opt2)):
        set_lr(o, 1e-3)
        step(model, [o])
    for a, b in zip(ours.parameters(), again.parameters()):
        assert torch.equal(a, b)


def test_fp32_newton_schulz_is_torchs_iteration_in_fp32():
    g = torch.randn(96, 40, generator=torch.Generator().manual_seed(1))
    for m in (g, g.T):
        ours = newton_schulz_fp32(m, (3.4445, -4.775, 2.0315), 5, 1e-7)
        theirs = _zeropower_via_newtonschulz(m, (3.4445, -4.775, 2.0315), 5, 1e-7).float()
        assert ours.dtype == torch.float32 and ours.shape == m.shape
        # bf16 keeps 8 bits: the two agree to bf16 precision of the O(1) entries, not better.
        assert (ours - theirs).abs().max() < 0.03 and (ours - theirs).abs().mean() < 3e-3
        # Singular values pushed into roughly (0.5, 1.5) (Jordan et al. 2024), from a spread-out spectrum.
        s = torch.linalg.svdvals(ours)
        assert 0.5 < s.min() and s.max() < 1.5 and torch.linalg.svdvals(m).max() > 10


@pytest.mark.parametrize("key,value", [("optim.name", "sgd"), ("optim.muon_lr", 0.0),
                                       ("optim.muon_momentum", 1.0), ("optim.muon_adjust_lr", "spectral")])
def test_bad_muon_fields_are_config_errors(key, value):
    cfg = _cfg(**{"optim.name": "muon"})
    setattr(cfg.optim, key.split(".")[1], value)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(cfg)


def _records(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r["kind"] == "train"]


def test_resume_with_muon_is_bitwise(prepared, tmp_path):
    _, make = prepared
    full = make(tmp_path / "full", **MUON, **{"train.steps": 6, "checkpoint.every": 3})
    train(full)
    part = make(tmp_path / "part", **MUON, **{"train.steps": 6, "checkpoint.every": 3})
    train(part, stop_after=3)
    train(part, resume=True)
    a, b = _records(full.train.run_dir), _records(part.train.run_dir)
    assert [r["step"] for r in b] == list(range(1, 7))
    assert [(r["loss"], r["grad_norm"], r["lr"]) for r in a] == [(r["loss"], r["grad_norm"], r["lr"]) for r in b]
    ckpt = "checkpoints/step_00000006"
    m1, m2 = build_model(full.model, 0), build_model(full.model, 0)
    o1, o2 = build_optimizer(m1, full), build_optimizer(m2, full)
    load_checkpoint(Path(full.train.run_dir) / ckpt, m1, o1)
    load_checkpoint(Path(part.train.run_dir) / ckpt, m2, o2)
    for (n, x), y in zip(m1.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(x, y), n
    s1, s2 = o1.state_dict()["state"], o2.state_dict()["state"]
    assert any("momentum_buffer" in v for v in s1.values()) and any("exp_avg" in v for v in s1.values())
    for k in s1:
        for name in s1[k]:
            assert torch.equal(s1[k][name], s2[k][name]), (k, name)


@pytest.mark.parametrize("layout", [{"parallel.dp_replicate": 1, "parallel.dp_shard": 2},
                                    {"parallel.dp_replicate": 1, "parallel.tp": 2}], ids=["fsdp2", "tp2"])
def test_distributed_muon_matches_single_process(prepared, tmp_path, layout):
    """Muon's Newton-Schulz needs whole matrices: FSDP2 shards rows, tensor parallelism splits wq/wk/wv/w1/w3
    by rows and wo/w2 by columns; both gather each matrix (GatheredMuon) and must step as one process does."""
    _, make = prepared
    common = {**MUON, "train.steps": 6, "checkpoint.every": 6}
    single = make(tmp_path / "single", **common)
    train(single)
    par = make(tmp_path / "par", **common, **layout)
    save_config(par, tmp_path / "par.toml")
    env = {**gloo_env(2), "PYTHONPATH": str(ROOT)}
    procs = [forked.Popen([sys.executable, "-m", "densetrain", "train", "--config", str(tmp_path / "par.toml")],
                          cwd=ROOT, text=True, stdout=forked.PIPE, stderr=forked.PIPE,
                          env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(e[-3000:] for _, e in outs)
    a, b = _records(single.train.run_dir), _records(par.train.run_dir)
    assert [r["step"] for r in b] == list(range(1, 7))
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5, abs=1e-5), (x["step"], x["loss"], y["loss"])
    m1, m2 = build_model(single.model, 0), build_model(single.model, 0)
    load_checkpoint(Path(single.train.run_dir) / "checkpoints/step_00000006", m1, None)
    load_checkpoint(Path(par.train.run_dir) / "checkpoints/step_00000006", m2, None)
    for (n, x), y in zip(m1.state_dict().items(), m2.state_dict().values()):
        assert (x - y).abs().max() <= 1e-5, (n, (x - y).abs().max().item())


def test_lr_sweep_with_muon(capsys):
    r = lr_sweep(lrs=(5e-3, 5e-2), widths=(32, 64), init="standard", steps=3, batch=4, seq_len=32,
                 optimizer="muon", adamw_lr=2e-3)
    assert r["optimizer"] == "muon" and r["settings"]["adamw_lr"] == 2e-3
    for w in (32, 64):
        losses = r["final_loss"][w]
        assert all(math.isfinite(v) and 0 < v < 6.0 for v in losses.values())
        assert losses[5e-3] != losses[5e-2]  # the swept lr is Muon's: it moves the result
        assert r["best_lr"][w] == min(losses, key=losses.get)
    assert "muon lr with adamw lr 0.002" in format_lr_sweep(r)

    parser = argparse.ArgumentParser(prog="densetrain")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["lr-sweep", "--optim", "muon", "--lrs", "2e-2", "--widths", "32", "--init", "standard",
                              "--steps", "1"])
    assert args.func(args) == 0
    assert "lr sweep (standard, muon lr with adamw lr 0.003, 1 steps)" in capsys.readouterr().out
