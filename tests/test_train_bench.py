"""benchmarks/train_bench.py --matmuls: the list of a step's matrix products it times is the step's own, and
its FLOPs are the model's FLOPs formula."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from densetrain.config import ModelConfig
from densetrain.metrics import flops_per_token
from densetrain.model.llama import Transformer

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("train_bench", ROOT / "benchmarks" / "train_bench.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["train_bench"] = bench  # its dataclass looks its module up there
_spec.loader.exec_module(bench)

SMALL_GQA = {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 96, "seq_len": 16, "batch": 2}


def _logical(sa, sb, ta, tb):
    """(A, B) shapes of the product as multiplied: the stored shapes with the flagged transposes applied."""
    t = lambda s, f: s[:-2] + (s[-1], s[-2]) if f else s  # noqa: E731
    return tuple(t(sa, ta)), tuple(t(sb, tb))


@pytest.mark.parametrize("name", ["gpt-13.8m", "tiny"])
def test_the_products_flops_are_the_models_flops_formula(name):
    shape = bench.SHAPES[name]
    total = 0.0
    for _, count, sa, sb, ta, tb in bench.step_matmuls(shape):
        a, b = _logical(sa, sb, ta, tb)
        assert a[-1] == b[-2] and a[:-2] == b[:-2]  # the product is defined
        batch = a[0] if len(a) == 3 else 1
        total += count * 2.0 * batch * a[-2] * a[-1] * b[-1]
    tokens = shape["batch"] * shape["seq_len"]
    want = flops_per_token(bench._model_config(shape, ModelConfig), shape["seq_len"]) * tokens
    assert total == want  # 183.6 GFLOP per step at gpt-13.8m; GQA's narrower K/V counted by both


def test_the_linear_products_are_what_autograd_runs():
    """Every aten::mm of a real fp32 forward + backward of the model (GQA, tied head) at a small shape, by its
    operand shapes, against the non-attention entries of step_matmuls (fp32 attention is SDPA, not mm)."""
    shape = SMALL_GQA
    torch.manual_seed(0)
    model = Transformer(bench._model_config(shape, ModelConfig))
    tokens = torch.randint(0, bench.VOCAB, (shape["batch"], shape["seq_len"]))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        model(tokens).float().sum().backward()
    ran = Counter(tuple(tuple(s) for s in e.input_shapes[:2]) for e in prof.events() if e.name == "aten::mm")
    want = Counter()
    for name, count, sa, sb, ta, tb in bench.step_matmuls(shape):
        if not name.startswith("attn"):
            want[_logical(sa, sb, ta, tb)] += count
    assert ran == want
