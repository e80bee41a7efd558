"""Training-side bugs other frameworks shipped, checked against densetrain where no other test pins them
(the sweep of docs/training_bugs.md; each class's other guards are named there).

- weight decay routing of the default AdamW: decay on 2-D matrices only (not norm gains, not the embedding
  unless ``optim.decay_embeddings``), a tied embedding/head one parameter, μP's per-group lr and its weight
  decay scaled so that ``lr * weight_decay`` stays the standard one; checked through a real AdamW step;
- the lr schedule with ``warmup_steps = 0`` and a step count nothing divides: the first step at the peak,
  the last exactly at ``min_lr``, in step and token units;
- RoPE tables at long positions built inside bf16 autocast are the fp32 tables, and a base switched after
  tables were built for the longest length (the long-context stage) leaves no stale table: the forward is a
  fresh model's;
- attention with fewer queries than keys (a cached or chunked forward) is bottom-right aligned;
- bf16: the cross-entropy of bf16 logits is computed in fp32 (no bf16 log-softmax), RMSNorm's statistic too;
- the real loop accumulating 8 micro-batches takes the step of one micro-batch (loss, grad norm, z-loss on).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from densetrain.config import ModelConfig, load_config
from densetrain.loss import token_losses
from densetrain.metrics import read_metrics
from densetrain.model.init import build_model
from densetrain.model.llama import KVCache, RMSNorm, rope_cos_sin
from densetrain.model.rope import rope_frequencies
from densetrain.optim import build_optimizer, set_lr
from densetrain.schedule import lr_for, resolve_stages
from densetrain.train import train

SMALL = {"model.vocab_size": 64, "model.d_model": 32, "model.n_layers": 2, "model.n_heads": 4,
         "model.n_kv_heads": 2, "model.d_ff": 64, "train.dtype": "fp32", "optim.weight_decay": 0.1}


def _cfg(**ov):
    return load_config(preset="tiny", overrides=list({**SMALL, **ov}.items()))


def _groups_by_name(opt) -> dict[str, dict]:
    return {n: g for g in opt.param_groups for n in g["names"]}


def test_adamw_decays_matrices_only_and_keeps_lr_times_decay_under_mup():
    cfg = _cfg()
    model = build_model(cfg.model, 0)
    by_name = _groups_by_name(build_optimizer(model, cfg))
    assert sorted(by_name) == sorted(n for n, _ in model.named_parameters())  # every parameter exactly once
    decayed = sorted(n for n, g in by_name.items() if g["weight_decay"] > 0)
    assert decayed == sorted(n for n, p in model.named_parameters() if p.ndim == 2 and n != "tok_embeddings.weight")
    assert "output.weight" in decayed and not any("norm" in n for n in decayed)
    assert _groups_by_name(build_optimizer(model, _cfg(**{"optim.decay_embeddings": True})))[
        "tok_embeddings.weight"]["weight_decay"] == 0.1

    tied = _cfg(**{"model.tie_embeddings": True})
    tied_model = build_model(tied.model, 0)
    assert tied_model.output.weight is tied_model.tok_embeddings.weight
    tied_groups = _groups_by_name(build_optimizer(tied_model, tied))
    assert "output.weight" not in tied_groups and tied_groups["tok_embeddings.weight"]["weight_decay"] == 0.0

    # μP at width_mult 2: hidden matrices get lr / 2 and weight_decay * 2, everything else the standard values.
    mup = _cfg(**{"model.init": "mup", "model.base_d_model": 16})
    mup_model = build_model(mup.model, 0)
    opt = build_optimizer(mup_model, mup)
    set_lr(opt, 1e-2)
    groups = _groups_by_name(opt)
    wq, head, gain = (groups[n] for n in ("layers.0.attention.wq.weight", "output.weight", "norm.weight"))
    assert (wq["lr"], wq["weight_decay"]) == (pytest.approx(5e-3), pytest.approx(0.2))
    assert (head["lr"], head["weight_decay"], gain["lr"], gain["weight_decay"]) == (1e-2, 0.1, 1e-2, 0.0)
    # A real step with zero gradients moves a parameter by decay alone: wq and the head shrink by the same
    # factor 1 - lr * weight_decay = 1 - 1e-3, the gains and the embedding do not move.
    before = {n: p.detach().clone() for n, p in mup_model.named_parameters()}
    for p in mup_model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    after = dict(mup_model.named_parameters())
    for n in ("layers.0.attention.wq.weight", "layers.1.feed_forward.w2.weight", "output.weight"):
        torch.testing.assert_close(after[n].detach(), before[n] * (1 - 1e-3), rtol=1e-6, atol=0)
    for n in ("norm.weight", "layers.0.ffn_norm.weight", "tok_embeddings.weight"):
        assert torch.equal(after[n].detach(), before[n])


@pytest.mark.parametrize("unit", ["steps", "tokens"])
@pytest.mark.parametrize("kind", ["cosine", "wsd"])
def test_no_warmup_and_an_odd_step_count_start_at_peak_and_end_at_min_lr(kind, unit):
    peak, low, steps = 3e-3, 3e-4, 43  # 43: no stage fraction or decay fraction divides it
    cfg = _cfg(**{"schedule.kind": kind, "schedule.unit": unit, "schedule.warmup_steps": 0, "train.steps": steps,
                  "optim.peak_lr": peak, "optim.min_lr": low})
    stages = resolve_stages(cfg)
    lrs = [lr_for(s, cfg, stages) for s in range(steps)]
    assert lrs[0] == peak  # warmup_steps 0: no step at lr 0, the first update at the peak
    assert lrs[-1] == pytest.approx(low, rel=1e-12)
    assert all(a >= b for a, b in zip(lrs, lrs[1:])) and min(lrs) >= low
    # lr is a pure function of the step: what a resumed process computes for step k is this list's k-th entry
    assert [lr_for(s, cfg, resolve_stages(cfg)) for s in (17, 41)] == [lrs[17], lrs[41]]


def _angles64(head_dim: int, theta: float, n: int) -> torch.Tensor:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    a = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    return torch.cat((a, a), dim=-1)  # (n, head_dim)


def test_rope_tables_at_long_positions_stay_fp32_inside_bf16_autocast():
    # HF transformers computed the angles under the caller's bf16 autocast: at position 1e5 a bf16 angle is
    # off by hundreds of radians. Here they must be the fp32 tables, within fp32's error of exact ones.
    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=64, rope_theta=500000.0)
    model = build_model(cfg, 0)
    n = 131072
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cos, sin = model.rope_cache(n)
    assert cos.dtype == sin.dtype == torch.float32
    ref_cos, ref_sin = rope_cos_sin(cfg.head_dim, cfg.rope_theta, n)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    exact = _angles64(cfg.head_dim, cfg.rope_theta, n)
    # fp32 angles: |error| <= position x fp32 rounding of inv_freq (~131072 * 6e-8 = 8e-3 rad), not radians
    assert (cos.double() - exact.cos()).abs().max() < 0.02 and (sin.double() - exact.sin()).abs().max() < 0.02
    bf16_angles = torch.outer(torch.arange(n, dtype=torch.bfloat16),
                              rope_frequencies(cfg.head_dim, cfg.rope_theta).bfloat16())
    assert (bf16_angles.double()[:, 0] - exact[:, 0]).abs().max() > 100  # what the bug looked like


def test_a_rope_base_switched_between_forwards_leaves_no_stale_table():
    # Long-context stage: rope_theta 10k -> 500k. Tables already built for the longest length at 10k (an
    # evaluation at the long seq_len) must not survive the switch: a cache keyed on length only (litgpt's,
    # HF's dynamic RoPE) would serve them; nor a switch back (a rollback into the earlier stage).
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, rope_theta=10000.0)
    model = build_model(cfg, 0).double()
    x = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(0))
    model(x)
    old = model.rope_cos.clone()
    fresh = build_model(dataclasses.replace(cfg, rope_theta=500000.0), 0).double()
    model.set_rope(500000.0, cfg.rope_scaling)
    for n in (16, 48):
        torch.testing.assert_close(model(x[:, :n]), fresh(x[:, :n]), rtol=0, atol=0)
    assert model.rope_cos.dtype == torch.float32 and not torch.equal(model.rope_cos, old)
    model.set_rope(10000.0, cfg.rope_scaling)
    torch.testing.assert_close(model(x[:, :16]), build_model(cfg, 0).double()(x[:, :16]), rtol=0, atol=0)


def test_fewer_queries_than_keys_are_aligned_bottom_right():
    # torch's is_causal=True with 3 queries and 8 keys masks top-left (query 0 sees key 0 only): wrong for the
    # last 3 positions of a sequence. The cached forward must give each new token every key up to its own.
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
    model = build_model(cfg, 0).double()
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    full = model(x)  # (2, 8, vocab)
    cache = KVCache(model, torch.zeros(2, dtype=torch.long), 8)
    model(x[:, :5], cache)
    tail = model(x[:, 5:], cache)  # 3 queries over 8 keys
    torch.testing.assert_close(tail, full[:, 5:], rtol=1e-10, atol=1e-10)
    q, k = torch.randn(1, 1, 3, 4, dtype=torch.float64), torch.randn(1, 1, 8, 4, dtype=torch.float64)
    top_left = F.scaled_dot_product_attention(q, k, k, is_causal=True)  # the trap, for contrast
    bottom_right = F.scaled_dot_product_attention(q, k, k, attn_mask=torch.ones(3, 8, dtype=torch.bool).tril(5))
    assert not torch.allclose(top_left, bottom_right)


def test_bf16_logits_cross_entropy_and_rmsnorm_statistic_run_in_fp32():
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 16, 4096, generator=g) * 8).bfloat16()
    y = torch.randint(0, 4096, (2, 16), generator=g)
    losses = token_losses(logits, y)
    assert losses.dtype == torch.float32
    exact = F.cross_entropy(logits.double().flatten(0, 1), y.flatten(), reduction="none").view(2, 16)
    # fp32 log-softmax of the bf16 values: ~1e-6; a bf16 log-softmax is off by ~0.05 nats at this size
    assert (losses.double() - exact).abs().max() < 1e-4
    assert (F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").double().view(2, 16)
            - exact).abs().max() > 1e-3  # what a bf16 loss looks like: it must not be ours
    norm = RMSNorm(256)
    x = (torch.randn(4, 256, generator=g) * 1e3 + 1e3).bfloat16()  # mean of squares ~2e6: 8 mantissa bits lose it
    out = norm(x)
    xd = x.double()
    ref = xd / (xd.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()
    assert (out.double() - ref).abs().max() < 2 ** -8 * ref.abs().max()  # one bf16 rounding of the result


def test_the_loop_accumulating_one_sequence_at_a_time_trains_as_one_micro_batch(prepared, tmp_path):
    # Gradient accumulation through the real loop: 8 micro-batches of 1 sequence (4 in the long-context stage,
    # with its document mask) take the step of 1 micro-batch of 8, loss and gradient alike, z-loss on. (Training
    # windows have no ignored targets, so every micro-batch counts alike; uneven counts, the HF transformers
    # 2024 report, are tests/test_grad_accum.py's and, over ranks, tests/test_parallel_layouts.py's.) A step
    # that summed micro-batch means instead had 8x the grad norm.
    _, make = prepared
    quiet = {"eval.every": 0, "checkpoint.every": 0, "logging.tensorboard": False, "optim.z_loss": 1e-3,
             "model.document_mask": True}
    records = {}
    for micro in (1, 8):
        cfg = make(tmp_path / str(micro), **quiet, **{"train.micro_batch_size": micro})
        train(cfg)
        records[micro] = [r for r in read_metrics(tmp_path / str(micro) / "run") if r["kind"] == "train"]
    assert [r["seq_len"] for r in records[1]] == [32] * 8 + [64] * 2
    for a, b in zip(records[1], records[8], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), a["step"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), a["step"]
