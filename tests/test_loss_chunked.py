"""The chunked cross-entropy (:func:`densetrain.loss.chunked_head_losses`) computes plain cross-entropy
(losses, z-loss, per-source sums, gradients of the logits' input and of the head's weight) without
holding the logits of more than one chunk for the backward."""

import pytest
import torch

from densetrain.config import ModelConfig
from densetrain.loss import (
    IGNORE_INDEX,
    LOGIT_CHUNK_ELEMENTS,
    chunk_tokens_for,
    chunked_head_losses,
    token_losses,
    z_loss_sum,
    z_loss_sum_from_lse,
)
from densetrain.model.init import init_weights
from densetrain.model.llama import Transformer
from densetrain.train.step import forward_backward

Z = 1e-2  # a z-loss coefficient large enough that its gradient shows in the comparison


def _head(V=1000, D=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(D, V, bias=False, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(V, D, generator=g))  # logits of size ~4: a peaked softmax
    h = torch.randn(3, 21, D, generator=g, dtype=dtype)
    y = torch.randint(0, V, (3, 21), generator=g)
    y[0, :5] = IGNORE_INDEX
    y[2, -3:] = IGNORE_INDEX
    return lin, h, y


def _close(a, b, tol=1e-6):
    """max |a - b| <= tol * max |b|."""
    a, b = a.detach(), b.detach()
    assert float((a - b).abs().max()) <= tol * float(b.abs().max()), (float((a - b).abs().max()), float(b.abs().max()))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-6), (torch.float32, 1e-5)])
def test_chunked_equals_plain_cross_entropy_with_z_loss(dtype, tol):
    """In float64 the two agree to 1e-6 (the same math); in fp32 to rounding (``log Z - z_target`` is not
    ``F.cross_entropy``'s order of operations)."""
    lin, h0, y = _head(dtype=dtype)
    mask = y != IGNORE_INDEX
    h = h0.clone().requires_grad_()
    logits = lin(h)
    want = token_losses(logits, y)
    (want.sum() + Z * z_loss_sum(logits, mask)).backward()
    want_h, want_w = h.grad.clone(), lin.weight.grad.clone()
    lin.weight.grad = None
    for chunk in (1, 8, 63, 1000):  # 63 tokens in all: uneven chunks, one token, one chunk
        hc = h0.clone().requires_grad_()
        got, lse = chunked_head_losses(lin, hc, y, chunk)
        assert got.shape == y.shape and bool((got[~mask] == 0).all())
        _close(got, want, tol)
        _close(lse, torch.logsumexp(lin(h0), -1), tol)
        (got.sum() + Z * z_loss_sum_from_lse(lse, mask)).backward()
        _close(hc.grad, want_h, tol)  # the gradient reaching the logits' input
        _close(lin.weight.grad, want_w, tol)
        lin.weight.grad = None


def test_chunked_saves_one_chunk_not_the_logits():
    """The bytes autograd keeps for the backward: plain cross-entropy keeps the (n, V) logits' log-softmax;
    the chunked one keeps each chunk's input only (the logits are recomputed per chunk in the backward)."""
    lin, h0, y = _head()
    n, V = y.numel(), lin.weight.shape[0]

    def saved_bytes(fn):
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return total[0]

    h = h0.clone().requires_grad_()
    assert saved_bytes(lambda: token_losses(lin(h), y)) >= n * V * 4
    assert saved_bytes(lambda: chunked_head_losses(lin, h, y, 8)) < 8 * V * 4


def test_chunk_size_rule():
    # Llama 3's vocabulary at a 4096-token micro-batch: 523 tokens per chunk (2**26 logits).
    assert chunk_tokens_for(128256, 4096) == LOGIT_CHUNK_ELEMENTS // 128256 == 523
    # The golden trajectory's micro-batches (2 x 64 tokens, vocabulary 512) and the tiny preset's (8 x 256,
    # 8192): no chunking, the plain path.
    assert chunk_tokens_for(512, 128) == 0 and chunk_tokens_for(8192, 2048) == 0


def test_forward_backward_chunked_equals_plain():
    """The step with the chunked head (forced, 5 tokens per chunk) gives the plain step's loss sums,
    z-loss, per-source sums and parameter gradients, with the μP logit multiplier and tied embeddings."""
    cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, tie_embeddings=True)
    torch.manual_seed(0)
    m = Transformer(cfg)
    init_weights(m, cfg)
    m = m.double()  # float64: the comparison shows the math, not fp32 rounding
    m.logit_mult = 0.5
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 97, (4, 24), generator=g)
    y = torch.randint(0, 97, (4, 24), generator=g)
    y[1, 7:] = IGNORE_INDEX
    micro = [(x[:2], y[:2], ["a", "b"]), (x[2:], y[2:], ["a", "a"])]
    n = int((y != IGNORE_INDEX).sum())
    runs = []
    for chunk in (0, 5):
        m.zero_grad(set_to_none=True)
        stats = forward_backward(m, micro, n, z_loss=Z, loss_chunk_tokens=chunk)
        runs.append((stats, {k: p.grad.clone() for k, p in m.named_parameters()}))
    (plain, g_plain), (chunked, g_chunked) = runs
    assert chunked.n_tokens == plain.n_tokens == n
    assert abs(chunked.loss_sum - plain.loss_sum) <= 1e-6 * plain.loss_sum
    assert abs(chunked.z_loss_sum - plain.z_loss_sum) <= 1e-6 * plain.z_loss_sum
    for src in ("a", "b"):
        assert chunked.per_source[src][1] == plain.per_source[src][1]
        assert abs(chunked.per_source[src][0] - plain.per_source[src][0]) <= 1e-6 * plain.per_source[src][0]
    for k in g_plain:
        _close(g_chunked[k], g_plain[k])


_VOCAB_PARALLEL_WORKER = r"""
import json, os, sys, types
import torch
sys.path.insert(0, sys.argv[1])
torch.set_num_threads(1)
import torch.distributed as dist
dist.init_process_group("gloo")
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from densetrain.loss import IGNORE_INDEX, token_losses, z_loss_sum, z_loss_sum_from_lse
from densetrain.parallel.loss_parallel import loss_parallel_context, vocab_parallel_head

Z, V, D = 1e-2, 1000, 16
mesh = init_device_mesh("cpu", (2,))
g = torch.Generator().manual_seed(0)
w = torch.randn(V, D, generator=g, dtype=torch.float64)
h0 = torch.randn(3, 21, D, generator=g, dtype=torch.float64)
y = torch.randint(0, V, (3, 21), generator=g)
y[0, :5] = IGNORE_INDEX
mask = y != IGNORE_INDEX
ref = torch.nn.Linear(D, V, bias=False, dtype=torch.float64)
with torch.no_grad():
    ref.weight.copy_(w)
h = h0.clone().requires_grad_()
logits = ref(h) * 0.5
want = token_losses(logits, y)
(want.sum() + Z * z_loss_sum(logits, mask)).backward()
out = {}
for chunk in (0, 8):
    lin = torch.nn.Linear(D, V, bias=False, dtype=torch.float64)
    with torch.no_grad():
        lin.weight.copy_(w)
    parallelize_module(lin, mesh, ColwiseParallel(output_layouts=Replicate()))
    model = types.SimpleNamespace(output=lin)
    project = lambda h, matmul: matmul(h) * 0.5  # the model's logits (Transformer.project) with a μP multiplier
    hc = h0.clone().requires_grad_()
    with loss_parallel_context(mesh):
        losses, lse = vocab_parallel_head(model, mesh, y, chunk)(project, hc)
        (losses.sum() + Z * z_loss_sum_from_lse(lse, mask)).backward()
    local = lin.weight.to_local().shape[0]
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max())
    out[chunk] = {"loss": rel(losses, want), "lse": rel(lse, torch.logsumexp(logits, -1)),
                  "h_grad": rel(hc.grad, h.grad), "w_grad": rel(lin.weight.grad.full_tensor(), ref.weight.grad),
                  "local_rows": local}
with open(sys.argv[2] + "." + os.environ["RANK"], "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
os._exit(0)
"""


def test_vocab_parallel_cross_entropy_equals_plain_on_two_ranks(tmp_path):
    """The loss-parallel head of tensor parallelism (2 gloo ranks, each holding half the vocabulary),
    whole and chunked, with z-loss and the μP logit multiplier, in float64: losses, log Z and the
    gradients of the head's input and weight equal plain cross-entropy within 1e-6."""
    import json
    from pathlib import Path

    from conftest import run_script_ranks

    out = run_script_ranks(_VOCAB_PARALLEL_WORKER, tmp_path, "vp")
    for r in range(2):
        res = json.loads(Path(f"{out}.{r}").read_text())
        for chunk, d in res.items():
            assert d["local_rows"] == 500  # each rank holds (and computes logits for) half the vocabulary
            for k in ("loss", "lse", "h_grad", "w_grad"):
                assert d[k] <= 1e-6, (r, chunk, k, d[k])
