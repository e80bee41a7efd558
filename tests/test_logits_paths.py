"""One definition of the model's logits (``Transformer.project``: μP output multiplier, soft-cap, tied
head) on every path that produces logits or a loss from them, against one process without tensor
parallelism (gloo, CPU, fp32).

Paths, each under two sets of model options that between them turn every option on (set ``mup_tied``:
μP init, tied embeddings, qk_norm, soft-cap; set ``std_untied``: standard init, untied head, soft-cap):
the training step's cross-entropy and z-loss (plain, chunked, vocabulary-parallel whole and chunked,
tensor parallel with gathered logits whole and chunked: loss, z-loss and every full gradient),
validation (``evaluate_val`` over a real shard, with a document mask), the logits of evaluation and of
incremental decoding (``KVCache``) and greedy generation. The HF export's parity (the multiplier folded
into ``lm_head``) is ``tests/test_hf.py``'s; soft-cap and qk_norm refuse export (``tests/test_model_options.py``).

Before the fix the vocabulary-parallel path built its own ``h @ W^T * logit_mult`` and left out the
soft-cap: its loss differed from every other path's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_script_ranks

from densetrain.loss import IGNORE_INDEX, chunked_head_losses, z_loss_sum, z_loss_sum_from_lse

_WORKER = r"""
import dataclasses, json, os, sys
import numpy as np
import torch
root, out = sys.argv[1:]
sys.path.insert(0, root)
torch.set_num_threads(1)
from densetrain.config import load_config
from densetrain.data.shards import TokenFiles, write_shard
from densetrain.evals.generative import greedy_generate
from densetrain.evals.valloss import evaluate_val
from densetrain.loss import IGNORE_INDEX
from densetrain.model.init import build_model
from densetrain.model.llama import KVCache
from densetrain.parallel import build_parallel_model, init_distributed
from densetrain.train.step import forward_backward

OPTIONS = {
    "mup_tied": {"init": "mup", "base_d_model": 16, "tie_embeddings": True, "qk_norm": True, "logit_softcap": 0.3},
    "std_untied": {"init": "standard", "tie_embeddings": False, "qk_norm": False, "logit_softcap": 0.3},
}
Z, V, B, T = 1e-2, 64, 4, 16
g = torch.Generator().manual_seed(7)
x = torch.randint(0, V, (B, T), generator=g)
y = torch.randint(0, V, (B, T), generator=g)
y[0, 5:] = IGNORE_INDEX
y[2, :3] = IGNORE_INDEX
micro = [(x[:2], y[:2], ["a", "a"]), (x[2:], y[2:], ["a", "a"])]
n = int((y != IGNORE_INDEX).sum())
shard_dir = os.path.join(os.path.dirname(out), f"shard{os.environ['RANK']}")
os.makedirs(shard_dir, exist_ok=True)
docs = [torch.randint(1, V, (k,), generator=g).tolist() + [0] for k in (9, 30, 5, 22)]  # id 0 is EOS
write_shard(os.path.join(shard_dir, "000000"), [np.array(d) for d in docs], 2)
stream = {"val": TokenFiles(shard_dir)}


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def step(model, chunk, params):
    for p in params.values():
        p.grad = None
    st = forward_backward(model, micro, n, 1, z_loss=Z, loss_chunk_tokens=chunk)
    return st, {k: full(p.grad).clone() for k, p in params.items()}


res = {}
for name, opts in OPTIONS.items():
    cfg = load_config(preset="tiny", overrides=[
        ("model.vocab_size", V), ("model.d_model", 32), ("model.n_layers", 2), ("model.n_heads", 4),
        ("model.n_kv_heads", 2), ("model.d_ff", 64), ("train.seed", 5), ("train.device", "cpu"),
        ("train.dtype", "fp32"), ("parallel.dp_replicate", 1), ("parallel.tp", 2),
        ("eval.tasks", ""), ("eval.final_tasks", ""), *[(f"model.{k}", v) for k, v in opts.items()]])
    info = init_distributed("cpu", cfg.parallel)
    model, _ = build_parallel_model(cfg, info)
    ref = build_model(cfg.model, cfg.train.seed, "cpu")
    assert model.logit_mult == ref.logit_mult and (ref.logit_mult != 1.0) == (opts["init"] == "mup")
    ref_params, params = dict(ref.named_parameters()), dict(model.named_parameters())
    want, want_g = step(ref, 0, ref_params)
    r = {"ref_loss": want.loss_sum, "ref_z": want.z_loss_sum}
    lp_mesh = model.loss_parallel_mesh
    for path, m, chunk, mesh in (("chunked", ref, 5, None), ("vocab_parallel", model, 0, lp_mesh),
                                 ("vocab_parallel_chunked", model, 5, lp_mesh), ("tp_gathered", model, 0, None),
                                 ("tp_gathered_chunked", model, 5, None)):
        if m is model:
            model.loss_parallel_mesh = mesh
        st, grads = step(m, chunk, params if m is model else ref_params)
        gdiff = max(float((grads[k] - want_g[k]).abs().max() / want_g[k].abs().max()) for k in want_g)
        r[path] = {"loss": st.loss_sum, "z": st.z_loss_sum, "grad_rel": gdiff}
    model.loss_parallel_mesh = lp_mesh
    model.eval(); ref.eval()
    with torch.no_grad():
        logits, want_logits = model(x), ref(x)
        r["eval_logits"] = float((logits - want_logits).abs().max())
        ref.cfg = dataclasses.replace(cfg.model, logit_softcap=0.0)
        r["cap_effect"] = float((ref(x) - want_logits).abs().max())  # what the soft-cap changes
        ref.cfg = cfg.model
        # incremental decoding: a prefill of 10 positions, then one position at a time
        cache = KVCache(model, torch.zeros(B, dtype=torch.long), T)
        parts = [model(x[:, :10], cache)] + [model(x[:, t:t + 1], cache) for t in range(10, T)]
        r["kv_logits"] = float((torch.cat(parts, 1) - want_logits).abs().max())
    prompts = [x[0, :6].tolist(), x[1, :3].tolist()]
    r["generate"] = greedy_generate(model, prompts, 6, "cpu", eos_id=0) == \
        greedy_generate(ref, prompts, 6, "cpu", eos_id=0)
    val = evaluate_val(model, stream, 16, 2, 2, info.device, eos_id=0, reset_positions=True)
    ref_val = evaluate_val(ref, stream, 16, 2, 2, info.device, eos_id=0, reset_positions=True)
    r["val"], r["ref_val"] = val["val"]["loss"], ref_val["val"]["loss"]
    res[name] = r
with open(f"{out}.{os.environ['RANK']}", "w") as f:
    json.dump(res, f)
torch.distributed.destroy_process_group()
sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
"""


def test_every_path_gives_the_single_process_logits_and_loss(tmp_path):
    """Tensor parallel degree 2 (2 gloo ranks) against a plain model with the same weights, per option set."""
    out = run_script_ranks(_WORKER, tmp_path, "logits", timeout=240)
    for rank in range(2):
        res = json.loads(Path(f"{out}.{rank}").read_text())
        for name, r in res.items():
            where = (rank, name)
            assert r["cap_effect"] > 0.05, where  # the soft-cap changes the logits by more than a rounding
            for path in ("chunked", "vocab_parallel", "vocab_parallel_chunked", "tp_gathered", "tp_gathered_chunked"):
                assert r[path]["loss"] == pytest.approx(r["ref_loss"], rel=1e-5), (where, path, r[path], r["ref_loss"])
                assert r[path]["z"] == pytest.approx(r["ref_z"], rel=1e-5), (where, path, r[path], r["ref_z"])
                assert r[path]["grad_rel"] < 1e-5, (where, path, r[path])
            assert r["eval_logits"] < 1e-5 and r["kv_logits"] < 1e-5, (where, r)
            assert r["generate"], where
            assert r["val"] == pytest.approx(r["ref_val"], rel=1e-6), where


def test_z_loss_ignores_an_infinite_logit_at_an_ignored_position():
    """``log Z`` is inf where a logit is; at an ignored position it must not make the z-loss sum NaN
    (``inf * 0``): the whole-logits and the per-chunk (``log Z`` given) sums, and the chunked head."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    y = torch.randint(0, 11, (2, 5), generator=g)
    y[1, 3] = IGNORE_INDEX
    finite = z_loss_sum(logits, y != IGNORE_INDEX)
    logits[1, 3, 4] = float("inf")
    mask = y != IGNORE_INDEX
    assert torch.isfinite(finite)
    assert z_loss_sum(logits, mask) == finite
    assert z_loss_sum_from_lse(torch.logsumexp(logits, -1), mask) == finite
    losses, lse = chunked_head_losses(lambda h: h, logits, y, 4)  # logits as the head's input: the identity head
    assert torch.isinf(lse[1, 3]) and losses[1, 3] == 0 and torch.isfinite(losses).all()
    assert z_loss_sum_from_lse(lse, mask) == finite
