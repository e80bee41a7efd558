#!/usr/bin/env bash
# One-GPU check (<= 9 minutes): gpt2-124m and a ~1B shape, bf16 + per-block compile + FSDP2 over one
# rank, ~2 minutes each; prints tokens/s, MFU against a bf16 matmul peak measured in the same run, and
# peak memory against the planner's estimate.
#
# The GPU image has its own torch (2.11 at last look), Python 3.12 and no package registry: densetrain's
# missing pure-Python deps are installed from wheels carried in the working tree (benchmarks/wheels/,
# fill it with `pip download -d benchmarks/wheels tomli-w tqdm ...` on a machine with a registry).
# Usage: bash benchmarks/gpu_check.sh [SECONDS_PER_SHAPE (default 120)]
set -euo pipefail
cd "$(dirname "$0")/.."
SECS="${1:-120}"
if [ -d benchmarks/wheels ]; then
  python -m pip install --no-index --find-links benchmarks/wheels --no-deps -q benchmarks/wheels/*.whl || true
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python - "$SECS" <<'PY'
import sys, time
import torch
from densetrain.config import load_config
from densetrain.loss import token_losses
from densetrain.metrics import flops_per_token
from densetrain.optim import build_optimizer
from densetrain.parallel import init_distributed
from densetrain.tools.plan import layout_memory, model_counts
from densetrain.parallel.mesh import Layout

secs = float(sys.argv[1])
assert torch.cuda.is_available(), "no CUDA device"
dev = torch.device("cuda")
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
for _ in range(3):
    a @ a
torch.cuda.synchronize(); t0 = time.perf_counter(); n = 20
for _ in range(n):
    a @ a
torch.cuda.synchronize(); peak = 2 * 8192**3 * n / (time.perf_counter() - t0)
del a
print(f"bf16 matmul peak measured: {peak / 1e12:.0f} TFLOP/s")

import os
os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
torch.distributed.init_process_group("nccl")
shapes = {
    "gpt2-124m": dict(preset="gpt2-124m", seq=1024, micro=16, over={}),
    "~1B": dict(preset="gpt2-124m", seq=2048, micro=4, over={"model.d_model": 2048, "model.n_layers": 16,
                "model.n_heads": 16, "model.n_kv_heads": 8, "model.d_ff": 5632, "model.vocab_size": 50304}),
}
for name, s in shapes.items():
    over = [("train.device", "cuda"), ("train.dtype", "bf16"), ("parallel.dp_replicate", 1),
            ("parallel.dp_shard", 1), ("parallel.compile_blocks", True), *s["over"].items()]
    cfg = load_config(preset=s["preset"], overrides=over)
    info = init_distributed("cuda", cfg.parallel)
    # FSDP2 over one rank: the same code path as a sharded job (Layout.uses_fsdp is False for 1 rank).
    from densetrain.parallel.parallelize import apply_fsdp, compile_blocks, load_reference_weights
    from densetrain.model.llama import Transformer
    with torch.device("meta"):
        model = Transformer(cfg.model)
    compile_blocks(model)
    apply_fsdp(model, info.mesh["dp_shard"] if info.mesh is not None else
               torch.distributed.device_mesh.init_device_mesh("cuda", (1,)), bf16=True)
    model.to_empty(device=dev)
    load_reference_weights(model, cfg, dev)
    opt = build_optimizer(model, cfg)
    x = torch.randint(0, cfg.model.vocab_size, (s["micro"], s["seq"] + 1), device=dev)
    torch.cuda.reset_peak_memory_stats()
    steps, t_start, t_warm = 0, time.perf_counter(), None
    while time.perf_counter() - t_start < secs:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x[:, :-1])
        token_losses(logits, x[:, 1:]).mean().backward()
        opt.step(); opt.zero_grad(set_to_none=True)
        steps += 1
        if steps == 3:
            torch.cuda.synchronize(); t_warm, warm_steps = time.perf_counter(), steps
    torch.cuda.synchronize()
    dt = time.perf_counter() - t_warm
    tok_s = (steps - warm_steps) * s["micro"] * s["seq"] / dt
    mfu = flops_per_token(cfg.model, s["seq"]) * tok_s / peak
    counts = model_counts(cfg.model)
    # One rank holds the whole state; FSDP2's gathered-block transient is that of a sharded layout.
    est = layout_memory(counts, cfg.model, s["seq"], s["micro"], Layout(1, 1, 1), "none")
    est["total"] += layout_memory(counts, cfg.model, s["seq"], s["micro"], Layout(1, 2, 1), "none")["transient"]
    measured = torch.cuda.max_memory_allocated()
    print(f"{name}: {model.num_params() / 1e6:.0f}M params, {tok_s:,.0f} tokens/s, mfu {mfu * 100:.1f}%, "
          f"peak memory {measured / 2**30:.2f} GiB, planner {est['total'] / 2**30:.2f} GiB "
          f"(ratio {est['total'] / measured:.2f})")
    del model, opt, logits
    torch.cuda.empty_cache()
torch.distributed.destroy_process_group()
PY
# Issue 41: the per-rank kernels behind the planner's CP-against-TP picks at 8K, beside the step-time model
# (about a minute; docs/planner.md "What one GPU can check").
python benchmarks/planner_gpu.py
