"""The compute dtype of a run: what ``train.dtype = 'auto'`` becomes on this device, measured where
the instruction set alone does not say (a CPU's bf16 matmuls can be slower than its fp32 ones)."""

from __future__ import annotations

import functools
import os
import time

import torch


def cpu_has_bf16() -> bool:
    """True when this CPU has bf16 matmul instructions (AVX512-BF16 or AMX-BF16 tiles), which oneDNN
    uses for bf16 matmuls. Without them bf16 matmuls are emulated and slower than fp32. Having them is
    necessary for bf16 to pay, not sufficient: see :func:`choose_cpu_dtype`."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


BF16_MIN_SPEEDUP = 1.3
"""bf16 autocast is 'auto''s choice on a CPU only when its bf16 matmuls run at least this many times the
fp32 rate: a bf16 step also pays casts of activations and weights (~15% of a bf16 step at the 13.8M
benchmark shape, 2 Zen 4 cores, benchmarks/RESULTS.md) and rounds every product to 8 mantissa bits.
Measured 1024^3 rates: AMD Zen 4 with AVX512-BF16 928 vs 224 GFLOP/s (4.1x: bf16); an Intel Xeon
(family 6 model 207) under KVM with AVX512-BF16 but its AMX tiles not exposed 146 vs 256 (0.57x: oneDNN's
``avx512_core_bf16`` kernel, fp32 is faster; bf16 training there ran at 1055 vs 1815 tok/s)."""


def choose_cpu_dtype(has_bf16: bool, fp32_flops: float, bf16_flops: float) -> tuple[str, str]:
    """'bf16' or 'fp32' for ``train.dtype = 'auto'`` on a CPU, and the reason in words.

    Args:
        has_bf16: :func:`cpu_has_bf16`. fp32_flops, bf16_flops: measured matmul FLOP/s
            (:func:`cpu_matmul_rates`; ignored without bf16 instructions).
    Returns: (dtype, reason); bf16 iff the instructions exist and bf16 matmuls reach
    :data:`BF16_MIN_SPEEDUP` times the fp32 rate.
    """
    if not has_bf16:
        return "fp32", "fp32 (this CPU has no AVX512-BF16/AMX-BF16 instructions, bf16 matmuls would be emulated)"
    ratio = bf16_flops / fp32_flops
    rates = (f"bf16 matmuls at {ratio:.2f}x fp32 here, {bf16_flops / 1e9:.0f} vs {fp32_flops / 1e9:.0f} "
             f"GFLOP/s at 1024^3")
    if ratio >= BF16_MIN_SPEEDUP:
        return "bf16", f"bf16 autocast with fp32 master weights ({rates})"
    return "fp32", f"fp32 ({rates}; bf16 needs >= {BF16_MIN_SPEEDUP}x to pay for its casts)"


@functools.cache
def cpu_matmul_rates(n: int = 1024, trials: int = 3) -> tuple[float, float]:
    """(fp32, bf16) FLOP/s of ``n x n`` matmuls on this CPU with the current thread count: the best of
    ``trials`` single matmuls each, the two dtypes interleaved so that a moment of load hits both.
    About 0.1 s at 1024 on 2 cores; measured once per process. Not :func:`densetrain.metrics.measure_peak_flops`
    (the mfu denominator, ~0.7 s per dtype, a layer above this one): a ratio of two dtypes measured side by
    side is what the choice needs, not either peak."""
    gen = torch.Generator().manual_seed(0)  # not the global RNG: a run's draws must not depend on a probe
    a = {dt: torch.randn(n, n, dtype=dt, generator=gen) for dt in (torch.float32, torch.bfloat16)}
    best = dict.fromkeys(a, float("inf"))
    for dt in a:
        a[dt] @ a[dt]  # warm-up: thread pool, oneDNN kernel selection
    for _ in range(trials):
        for dt, x in a.items():
            t0 = time.perf_counter()
            x @ x
            best[dt] = min(best[dt], time.perf_counter() - t0)
    return 2.0 * n**3 / best[torch.float32], 2.0 * n**3 / best[torch.bfloat16]


_RESOLVED: dict[str, str] = {}


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """``train.dtype`` as run on ``device``: 'bf16' or 'fp32'. 'auto' is bf16 on CUDA; elsewhere (a CPU, or
    the meta device of a model not yet materialised) it is
    :func:`choose_cpu_dtype` of the measured matmul rates, decided once per process, printed by rank 0,
    and agreed by every rank of a process group (bf16 only where every rank found it faster: one MIN
    all-reduce, which every rank reaches at its first call in the same place of setup)."""
    if dtype != "auto":
        return dtype
    if device.type == "cuda":
        return "bf16"
    if "cpu" not in _RESOLVED:
        has = cpu_has_bf16()
        fp32, bf16 = cpu_matmul_rates() if has else (1.0, 0.0)
        choice, reason = choose_cpu_dtype(has, fp32, bf16)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            vote = torch.tensor([int(choice == "bf16")])
            torch.distributed.all_reduce(vote, op=torch.distributed.ReduceOp.MIN)
            if choice == "bf16" and not vote.item():
                choice, reason = "fp32", reason + "; fp32 because another rank measured bf16 slower"
        _RESOLVED["cpu"] = choice
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"train.dtype=auto: {reason}", flush=True)
    return _RESOLVED["cpu"]
