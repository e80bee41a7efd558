"""On one GPU: the per-rank kernels that decide the planner's choice between context and tensor parallelism at
8K (issue 41), measured beside what the step-time model (densetrain/cost/step.py) charges for them.

The planner's disputed picks (llama3-405b at 8K: PP 64 x CP 16 x TP 2 against Meta's TP 8 / PP 16; llama3-70b on
256 with torchtitan's batch: CP 8 against FSDP 32 x TP 8) rest on terms no published run checks: the block GEMMs
at a CP rank's few rows (512 at CP 16) and densetrain's CP attention kernel (FlexAttention over the gathered keys
with the block mask of a rank's two load-balanced chunks, ``parallel/context.py``) against SDPA's causal kernel
over the whole sequence. One GPU measures exactly those, per layer, forward and backward; the collectives need
several GPUs and are not measured here.

Per case: the layer's four GEMMs (qkv, wo, w1w3, w2; forward, and the backward's data and weight gradients) and
its attention forward + backward, in ms, the model's ms beside them (the shipped profile of this GPU: ``h200``
or ``h100-sxm``, whose peak both share), and ``ratio``: the layer's measured / model. Then, per pair of
layouts, the per-rank compute of a step (layer time x the layers and micro-batches a rank runs) measured against
the model's. Ends with
``planner_gpu: measured / model per-rank layer compute X..Y over N cases``.

    python benchmarks/planner_gpu.py             # on a CUDA GPU (about a minute)
    python benchmarks/planner_gpu.py --tiny      # the code path on this CPU, tiny shapes (no numbers to judge)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from densetrain.config import load_config  # noqa: E402
from densetrain.cost import load_hardware, step  # noqa: E402
from densetrain.cost.flops import attention_flops, gemm_shapes, shape_of  # noqa: E402
from densetrain.parallel.context import ContextParallelAttention, chunk_index, gathered_index  # noqa: E402

# name, preset, seq_len, sequences per micro-batch, tp, cp, (layers, micro-batches) a rank runs per step
CASES = [
    ("405B 8K, Meta TP 8 / PP 16 (v 8) / DP 128", "llama3-405b", 8192, 1, 8, 1, (8, 16)),
    ("405B 8K, pick PP 64 (v 2) x CP 16 x TP 2 x FSDP 8", "llama3-405b", 8192, 1, 2, 16, (2, 256)),
    ("405B 8K, PP 16 (v 8) x TP 4 x CP 2 x HSDP 2 x 64", "llama3-405b", 8192, 1, 4, 2, (8, 16)),
    ("70B 8K, torchtitan FSDP 32 x TP 8, micro 16", "llama3-70b", 8192, 16, 8, 1, (80, 1)),
    ("70B 8K, pick HSDP 2 x 16 x CP 8, micro 16", "llama3-70b", 8192, 16, 1, 8, (80, 1)),
]
PAIRS = [(0, 1), (0, 2), (3, 4)]
TINY = [("tiny, TP 1", "tiny", 128, 2, 1, 1, (2, 1)), ("tiny, CP 2", "tiny", 128, 2, 1, 2, (2, 1))]


def timed(fn, device, warmup: int = 2, iters: int = 5) -> float:
    """Seconds of one ``fn()``: the mean of ``iters`` after ``warmup`` (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        t0 = torch.cuda.Event(enable_timing=True)
        t1 = torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(iters):
            fn()
        t1.record()
        torch.cuda.synchronize()
        return t0.elapsed_time(t1) / 1e3 / iters
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters


def gemms(m, rows: int, tp: int, device, dtype) -> float:
    """Measured seconds of one block's four GEMMs at ``rows`` rows: forward, and backward's two per GEMM."""
    def one(M: int, K: int, N: int) -> float:
        x, w = torch.randn(M, K, device=device, dtype=dtype), torch.randn(K, N, device=device, dtype=dtype)
        dy = torch.randn(M, N, device=device, dtype=dtype)
        return timed(lambda: (x @ w, dy @ w.T, x.T @ dy), device)

    return sum(one(M, K, N) for _, M, K, N in gemm_shapes(m, rows, tp, head=False))


def attention(m, seq_len: int, micro: int, tp: int, cp: int, device, dtype) -> tuple[float, float]:
    """Measured seconds of one layer's attention forward + backward on CP rank 0 and of building its block mask:
    densetrain's kernels (SDPA causal on repeated K/V heads without CP; with CP, FlexAttention over the gathered
    keys, ``ContextParallelAttention._flex``)."""
    s = shape_of(m)
    h, kv, hd = s.n_heads // tp, max(s.n_kv_heads // tp, 1), s.head_dim
    local = seq_len // cp
    q = torch.randn(micro, h, local, hd, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(micro, kv, seq_len, hd, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(micro, kv, seq_len, hd, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(micro, h, local, hd, device=device, dtype=dtype)
    mask_s = 0.0
    if cp == 1:
        def run():
            rk, rv = k.repeat_interleave(h // kv, dim=1), v.repeat_interleave(h // kv, dim=1)
            F.scaled_dot_product_attention(q, rk, rv, is_causal=True).backward(g)
    else:
        to = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
        attend = ContextParallelAttention(None, to(chunk_index(seq_len, 0, cp)), to(gathered_index(seq_len, cp)),
                                          seq_len=seq_len)

        def build():
            attend._memo.pop("block", None)
            attend._flex(q.detach(), k.detach(), v.detach(), None)

        def run():
            if device.type == "cuda":
                attend._flex(q, k, v, None).backward(g)
            else:  # FlexAttention has no CPU backward: the --tiny code path times the forward only
                attend._flex(q.detach(), k.detach(), v.detach(), None)

        run()  # compiles FlexAttention, builds the block mask once
        mask_s = max(0.0, timed(build, device) - timed(lambda: attend._flex(q.detach(), k.detach(), v.detach(),
                                                                             None), device))
    return timed(run, device), mask_s


def model_layer(m, hw, seq_len: int, micro: int, tp: int, cp: int) -> tuple[float, float]:
    """The model's seconds of one layer's GEMMs and attention, forward + backward (``step.step_time``'s terms:
    the GEMMs' backward 2x, attention's 2.5x, FlexAttention's rates under CP)."""
    s, rows = shape_of(m), micro * seq_len // cp
    mm = sum(step.gemm_s(M, K, N, hw.peak_bf16_flops, hw) for _, M, K, N in gemm_shapes(s, rows, tp, head=False))
    attn = attention_flops(s, rows, seq_len, tp) / (hw.peak_bf16_flops * (hw.attention_efficiency
                                                                           or step.ATTENTION_EFFICIENCY))
    fwd, bwd = (hw.flex_forward_rate or 1.0, hw.flex_backward_rate or 1.0) if cp > 1 else (1.0, 1.0)
    return 3 * mm, attn / fwd + 2.5 * attn / bwd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on this machine's CPU: the code path only")
    a = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    hw = load_hardware("h200" if "H200" in name else "h100-sxm")
    cases = TINY if a.tiny else CASES
    print(f"device: {name}; model profile: {hw.name}; bf16 peak {hw.peak_bf16_flops / 1e12:.0f} TFLOP/s")
    print(f"{'case':<50} {'rows':>7} {'GEMMs ms':>9} {'model':>7} {'attn ms':>8} {'model':>7} {'ratio':>6}"
          f" {'mask ms':>8}")
    rows_out = []
    for label, preset, seq_len, micro, tp, cp, (layers, n_micro) in cases:
        m = load_config(preset).model
        g = gemms(m, micro * seq_len // cp, tp, device, dtype)
        att, mask_s = attention(m, seq_len, micro, tp, cp, device, dtype)
        pg, pa = model_layer(m, hw, seq_len, micro, tp, cp)
        ratio = (g + att) / (pg + pa)
        rows_out.append((label, (g + att) * layers * n_micro, (pg + pa) * layers * n_micro, ratio))
        print(f"{label:<50} {micro * seq_len // cp:>7} {g * 1e3:>9.2f} {pg * 1e3:>7.2f} {att * 1e3:>8.2f}"
              f" {pa * 1e3:>7.2f} {ratio:>6.2f} {mask_s * 1e3:>8.2f}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for i, j in ([] if a.tiny else PAIRS):
        (la, ma, pa_, _), (lb, mb, pb, _) = rows_out[i], rows_out[j]
        print(f"per-rank compute of a step, {lb} against {la}: measured {mb:.2f} / {ma:.2f} s ({mb / ma - 1:+.1%}),"
              f" model {pb:.2f} / {pa_:.2f} s ({pb / pa_ - 1:+.1%})")
    ratios = [r[3] for r in rows_out]
    print(f"planner_gpu: measured / model per-rank layer compute {min(ratios):.2f}..{max(ratios):.2f} over "
          f"{len(ratios)} cases ({name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
