"""Does the step-time model (densetrain/cost/step.py) predict published training runs?

For every published run below: its shape, layout, batch and hardware into :func:`densetrain.cost.step_time`,
the predicted MFU (or tokens/s per GPU) beside the published one, and the relative error; the three runs the
efficiency constants were fitted on are marked ``fit``, the others ``check``. Ends with the line
``planner_check: max relative error X% over N runs``.

    python benchmarks/planner_check.py            # the table
    python benchmarks/planner_check.py --fit      # re-fit the three constants on the ``fit`` rows (grid search)

Sources (each row cites its own):

* Llama 3: Dubey et al. 2024, "The Llama 3 Herd of Models", sec. 3.3.2 and Table 4 (405B on H100 SXM 80GB,
  bf16, MFU by the report's own count, 6N + attention not halved; profile ``h100-sxm``). The third row's DP is
  8: 16,384 / (8 x 16 x 16); the printed 4 is a typo. The report gives no virtual-stage count; the rows use
  v = 8 (one block per virtual stage of a pipeline rank's 8 layers, the finest its interleaved schedule
  allows): with v = 2 the bubble alone would be (16 - 1) / (2 x 16) = 47% of the busy time at 16
  micro-batches, above what 41% MFU leaves. No activation recomputation is assumed. CP: the report's
  all-gather of the n_kv_heads keys and values (``cp_exchange="kv"``).
* torchtitan: its repository's ``benchmarks/llama3_h100_202412_torchtitan.md`` (read from the source, Tables
  1-6), tokens/s per GPU read at step 90, seq_len 8192 unless stated, torch.compile, torchtitan 9dec370 (its
  train_configs: 8B op-level selective AC). Machine: Grand Teton, H100 96 GB HBM2e at 2.4 TB/s, 500 W power
  limit, 400 Gb/s per GPU (profile ``h100-96gb-500w``; its peak is a named assumption, see the profile). Table
  1 / 3: 8B FSDP on 8 / 128 GPUs, local batch 2, selective AC, bf16 and Float8. Table 2: 8B FSDP + CP on 8
  GPUs at 32K-262K, local batch 1, full AC, Float8. Table 4: 70B FSDP 32 x TP 8, local batch 16, global 512,
  full AC, Float8, without and with AsyncTP. Table 5: 405B FSDP 8 x TP 8 x PP 8, local batch 32 in 8
  micro-batches (torchtitan's default: the pipeline degree), 1F1B and interleaved (2 stages a rank), full AC,
  Float8, AsyncTP. Table 6: 405B TP 8 x PP 8 1F1B with FSDP x CP at 32K-262K, local batch 8 in 8
  micro-batches, full AC, Float8, AsyncTP. Float8: the blocks' linear layers at the fp8 peak with the same GEMM
  efficiency, plus the casts' bytes (dynamic tensorwise scaling); attention and the output head stay bf16;
  FSDP2 gathers fp8 weights (the 405B config's ``enable_fsdp_float8_all_gather``). CP: torch's ring attention
  (rotate method ``allgather``) on K/V repeated to n_heads before SDPA at 9dec370 (``cp_exchange="expanded"``,
  densetrain/cost/step.py ``CP_EXCHANGE``). AsyncTP: what torch's micro-pipeline pass fuses (the forward's
  collectives; not the backward's reduce-scatters, nor Float8's backward all-gathers: ``step.async_tp_exposed``).

FSDP2 under pipelining (Llama 3's rows and torchtitan's Tables 5-6): as torch 2.13's runtime runs it
(``step.pipelined_dp``: each stage re-gathered as it re-enters the interleaved schedule's window of 3 gathered
stages, its reduce-scatter exposed after its last backward of the call: ``pp_grad_sync = "last"``, torch's and
torchtitan's). Llama 3's own runtime is not torch's; its rows are charged the same.

Known misses: Table 2's 64K and 128K rows (FSDP 4 x CP 2, FSDP 2 x CP 4) hold the same 32K tokens on every GPU;
between them every per-rank cost that depends on seq_len at most doubles (attention's keys, the gathered K/V, the
ring's steps), so a step can take at most 2x as long a local token. The table gives 2,540 / 1,071 = 2.37x: no
per-rank work term explains it, and none is fitted to it; the 256K row (1.95x the 128K one) inherits the miss.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from densetrain.config import load_config  # noqa: E402
from densetrain.cost import Parallel, load_hardware, step  # noqa: E402
from densetrain.cost.step import step_time  # noqa: E402

LLAMA3 = "Dubey et al. 2024, Llama 3 report, Table 4"
TITAN = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
SXM, GT = "h100-sxm", "h100-96gb-500w"
TPS = "tokens_per_sec_per_gpu"


def meta(dp, cp=1) -> Parallel:
    """A Llama 3 layout: TP 8 with sequence parallelism, PP 16 interleaved (v = 8), its own fused attention kernel."""
    return Parallel(1, dp, 8, cp, 16, "interleaved_1f1b", 8, 0, True, attention="sdpa")


def titan(dp_shard=1, tp=1, cp=1, pp=1, schedule="1f1b", virtual=1, microbatches=0, async_tp=False) -> Parallel:
    """A torchtitan layout: sequence parallel with TP, torch's ring-attention CP on expanded K/V heads, SDPA's
    flash kernel per ring step."""
    return Parallel(1, dp_shard, tp, cp, pp, schedule, virtual, microbatches, tp > 1, async_tp, "expanded", "sdpa")


# name, preset, hardware, Parallel, seq_len, batch (sequences), micro, ac, precision, metric, value, role, source
RUNS = [
    ("llama3-405b 8K, 8,192 GPUs", "llama3-405b", SXM,
     meta(64), 8192, 2048, 1, "none", "bf16", "mfu", 0.43, "fit",
     f"{LLAMA3} row 1: TP 8, CP 1, PP 16, DP 64, 430 TFLOP/s/GPU"),
    ("llama3-405b 8K, 16,384 GPUs", "llama3-405b", SXM,
     meta(128), 8192, 2048, 1, "none", "bf16", "mfu", 0.41, "check",
     f"{LLAMA3} row 2: TP 8, CP 1, PP 16, DP 128, 400 TFLOP/s/GPU"),
    ("llama3-405b 128K, 16,384 GPUs", "llama3-405b", SXM,
     meta(8, 16), 131072, 128, 1, "none", "bf16", "mfu", 0.38, "fit",
     f"{LLAMA3} row 3: TP 8, CP 16, PP 16, DP 8, 380 TFLOP/s/GPU"),
    ("titan 8B FSDP 8", "llama3-8b", GT, titan(8), 8192, 16, 2, "op", "bf16", TPS, 6667, "fit",
     f"{TITAN} Table 1: FSDP + torch.compile, local batch 2, selective AC"),
    ("titan 8B FSDP 8, Float8", "llama3-8b", GT, titan(8), 8192, 16, 2, "op", "fp8", TPS, 8532, "check",
     f"{TITAN} Table 1: FSDP + torch.compile + Float8"),
    ("titan 8B FSDP 128", "llama3-8b", GT, titan(128), 8192, 256, 2, "op", "bf16", TPS, 6514, "check",
     f"{TITAN} Table 3: FSDP + torch.compile, local batch 2, selective AC"),
    ("titan 8B FSDP 128, Float8", "llama3-8b", GT, titan(128), 8192, 256, 2, "op", "fp8", TPS, 8380, "check",
     f"{TITAN} Table 3: FSDP + torch.compile + Float8"),
] + [
    (f"titan 8B FSDP {8 // c} x CP {c} at {seq // 1024}K, Float8", "llama3-8b", GT, titan(8 // c, cp=c), seq,
     8 // c, 1, "full", "fp8", TPS, value, "check", f"{TITAN} Table 2: FSDP + CP, local batch 1, full AC")
    for c, seq, value in ((1, 32768, 3890), (2, 65536, 2540), (4, 131072, 1071), (8, 262144, 548))
] + [
    ("titan 70B FSDP 32 x TP 8, Float8", "llama3-70b", GT, titan(32, 8), 8192, 512, 16, "full", "fp8", TPS, 829,
     "check", f"{TITAN} Table 4: 2D, local batch 16, global 512, full AC"),
    ("titan 70B FSDP 32 x TP 8, Float8, AsyncTP", "llama3-70b", GT, titan(32, 8, async_tp=True), 8192, 512, 16,
     "full", "fp8", TPS, 876, "check", f"{TITAN} Table 4: 2D + AsyncTP"),
    ("titan 405B FSDP 8 x TP 8 x PP 8 1F1B", "llama3-405b", GT, titan(8, 8, 1, 8, "1f1b", 1, 8, True), 8192, 256, 4,
     "full", "fp8", TPS, 100, "check", f"{TITAN} Table 5: 1F1B, local batch 32, 8 micro-batches, Float8, AsyncTP"),
    ("titan 405B FSDP 8 x TP 8 x PP 8 interleaved", "llama3-405b", GT,
     titan(8, 8, 1, 8, "interleaved_1f1b", 2, 8, True), 8192, 256, 4, "full", "fp8", TPS, 128, "check",
     f"{TITAN} Table 5: interleaved 1F1B, 2 stages a rank"),
] + [
    (f"titan 405B TP 8 x PP 8 x FSDP {8 // c} x CP {c} at {seq // 1024}K", "llama3-405b", GT,
     titan(8 // c, 8, c, 8, "1f1b", 1, 8, True), seq, 8 * (8 // c), 1, "full", "fp8", TPS, value, "check",
     f"{TITAN} Table 6: 1F1B, local batch 8, 8 micro-batches, Float8, AsyncTP")
    for c, seq, value in ((1, 32768, 76), (2, 65536, 47), (4, 131072, 31), (8, 262144, 16))
]


@functools.lru_cache(maxsize=None)
def shape(preset: str):
    return load_config(preset).model


@functools.lru_cache(maxsize=None)
def hardware(name: str):
    return load_hardware(name)


def predict(run) -> dict:
    name, preset, hw, par, seq, batch, micro, ac, prec, metric, value, role, source = run
    res = step_time(shape(preset), par, hardware(hw), seq, batch, micro, ac, prec, fp8_all_gather=prec == "fp8")
    return {"name": name, "metric": metric, "published": value, "predicted": res[metric], "role": role,
            "error": res[metric] / value - 1, "source": source, "result": res}


def table() -> list[dict]:
    return [predict(r) for r in RUNS]


def fit() -> tuple[float, float, float]:
    """Grid search of the three constants minimising the largest error over the ``fit`` rows."""
    grid = {"GEMM_EFFICIENCY": [x / 100 for x in range(40, 81, 2)],
            "ATTENTION_EFFICIENCY": [x / 100 for x in range(16, 71, 2)],
            "NETWORK_EFFICIENCY": [x / 100 for x in range(30, 101, 5)]}
    best = None
    fit_rows = [r for r in RUNS if r[11] == "fit"]
    for g, a, n in itertools.product(*grid.values()):
        step.GEMM_EFFICIENCY, step.ATTENTION_EFFICIENCY, step.NETWORK_EFFICIENCY = g, a, n
        worst = max(abs(predict(r)["error"]) for r in fit_rows)
        if best is None or worst < best[0]:
            best = (worst, g, a, n)
    step.GEMM_EFFICIENCY, step.ATTENTION_EFFICIENCY, step.NETWORK_EFFICIENCY = best[1:]
    print(f"fitted on {len(fit_rows)} runs: GEMM_EFFICIENCY = {best[1]}, ATTENTION_EFFICIENCY = {best[2]}, "
          f"NETWORK_EFFICIENCY = {best[3]} (largest fit error {best[0]:.1%})")
    return best[1:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fit", action="store_true", help="re-fit the three efficiency constants on the fit rows")
    a = ap.parse_args(argv)
    if a.fit:
        fit()
    rows = table()
    print(f"{'run':<52} {'role':<6} {'metric':<8} {'published':>10} {'predicted':>10} {'error':>7}  step parts (s)")
    for r in rows:
        unit = (lambda x: f"{x:.1%}") if r["metric"] == "mfu" else (lambda x: f"{x:,.0f}")
        parts = ", ".join(f"{k} {v:.3g}" for k, v in r["result"]["parts"].items() if v)
        print(f"{r['name']:<52} {r['role']:<6} {'MFU' if r['metric'] == 'mfu' else 'tok/s/GPU':<8} "
              f"{unit(r['published']):>10} {unit(r['predicted']):>10} {r['error']:>+7.1%}  {parts}")
    for role in ("fit", "check"):
        errs = [abs(r["error"]) for r in rows if r["role"] == role]
        print(f"{role}: {len(errs)} runs, max relative error {max(errs):.1%}, mean {sum(errs) / len(errs):.1%}")
    for r in rows:
        print(f"  {r['name']}: {r['source']}")
    worst = max(abs(r["error"]) for r in rows)
    print(f"planner_check: max relative error {worst:.1%} over {len(rows)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
