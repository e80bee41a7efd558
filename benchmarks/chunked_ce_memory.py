"""Peak memory of one forward + backward of the output head and cross-entropy: plain vs chunked.

    .venv/bin/python benchmarks/chunked_ce_memory.py                    # vocab 128256, seq 4096, d_model 4096
    .venv/bin/python benchmarks/chunked_ce_memory.py --d-model 1024     # the same logits, a quarter of the matmuls

The head is what :func:`densetrain.train.step.forward_backward` runs after the last block: the final
RMSNorm, the output projection ``(d_model -> vocab_size)`` and the per-token cross-entropy plus z-loss,
either plain (:func:`densetrain.loss.token_losses` on the whole ``(seq, vocab)`` logits, the path of
micro-batches below ``LOGIT_CHUNK_ELEMENTS``) or chunked (:func:`densetrain.loss.chunked_head_losses`
at :func:`densetrain.loss.chunk_tokens_for`'s chunk). The logits' size does not depend on ``d_model``, so
a smaller ``--d-model`` measures the same logit memory with smaller weights and faster matmuls.

Each variant runs in its own process. Measured: on CUDA ``torch.cuda.max_memory_allocated`` minus the
allocation before the step; on CPU the growth of the process's peak RSS (``ru_maxrss``) over its value
after the weights, their gradient buffer and the input were allocated and touched. Both include the
weight gradient (the same in both variants) and exclude the weights themselves.

Measured (2026-12-01, 2 shared Zen 4 cores under a load of ~8, CPU fp32, ``--d-model 512``): plain 9.82 GiB
(5.0 x the 1.96 GiB of logits: the logits, their log-softmax, the z-loss's logsumexp input and the
gradients), chunked (523 tokens per chunk) 1.62 GiB, of which 0.24 GiB is the weight gradient; the same loss.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def _child(variant: str, vocab: int, seq: int, d_model: int, device: str) -> dict:
    import torch

    from densetrain.loss import chunk_tokens_for, chunked_head_losses, token_losses, z_loss_sum, z_loss_sum_from_lse
    from densetrain.model.llama import RMSNorm

    torch.manual_seed(0)
    dev = torch.device(device)
    norm = RMSNorm(d_model).to(dev)
    head = torch.nn.Linear(d_model, vocab, bias=False, device=dev)
    head.weight.grad = torch.zeros_like(head.weight)  # allocated up front: the same in both variants
    x = torch.randn(1, seq, d_model, device=dev, requires_grad=True)
    y = torch.randint(0, vocab, (1, seq), device=dev)
    mask = torch.ones_like(y, dtype=torch.bool)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    chunk = chunk_tokens_for(vocab, seq)
    t0 = time.perf_counter()
    h = norm(x)
    if variant == "plain":
        logits = head(h)
        loss = token_losses(logits, y).sum() + 1e-4 * z_loss_sum(logits, mask)
    else:
        losses, lse = chunked_head_losses(head, h, y, chunk)
        loss = losses.sum() + 1e-4 * z_loss_sum_from_lse(lse, mask)
    loss.backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"variant": variant, "chunk_tokens": chunk if variant == "chunked" else seq, "peak_bytes": peak,
            "seconds": time.perf_counter() - t0, "loss": float(loss)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--device", default="cuda" if __import__("torch").cuda.is_available() else "cpu")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(a.child, a.vocab, a.seq, a.d_model, a.device)))
        return
    rows = []
    for variant in ("plain", "chunked"):
        out = subprocess.run([sys.executable, __file__, "--child", variant, "--vocab", str(a.vocab), "--seq",
                              str(a.seq), "--d-model", str(a.d_model), "--device", a.device],
                             cwd=ROOT, capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    logits = a.seq * a.vocab * 4
    print(f"vocab {a.vocab}, seq {a.seq}, d_model {a.d_model}, {a.device}; fp32 logits of the whole sequence: "
          f"{logits / GIB:.2f} GiB")
    for r in rows:
        print(f"  {r['variant']:<8} chunk {r['chunk_tokens']:>5} tokens  peak {r['peak_bytes'] / GIB:6.2f} GiB "
              f"({r['peak_bytes'] / logits:.2f} x the logits)  {r['seconds']:.1f} s  loss {r['loss']:.6g}")


if __name__ == "__main__":
    main()
