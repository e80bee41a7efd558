"""Training throughput side by side with nanoGPT's ``train.py`` on this machine: same shape, same tokens,
same token budget, alternating runs.

    .venv/bin/python benchmarks/train_bench.py --nanogpt /tmp/nanogpt            # both shapes, 3 runs each
    .venv/bin/python benchmarks/train_bench.py --nanogpt /tmp/nanogpt --shape gpt-13.8m --runs 5 --steps 40

nanoGPT is not a dependency and none of its code is in this repository: ``--nanogpt`` is a checkout of
https://github.com/karpathy/nanoGPT made elsewhere (its commit is printed). Without it only densetrain runs,
and the report says so. nanoGPT reads the demo shards (``densetrain prepare --preset tiny``) exported as its
flat ``uint16`` ``train.bin`` / ``val.bin`` (every source's train / val tokens concatenated) with
``meta.pkl`` giving the vocabulary size; its script runs from a scratch directory holding links to the
checkout's ``train.py``, ``model.py`` and ``configurator.py``, so the checkout is not written to.

Shapes (``--shape``):

* ``gpt-13.8m``: 6 layers, d_model 384, 6 heads, seq_len 256, batch 8, vocab 8192, tied embeddings. nanoGPT's
  GPT-2 block has a 4*d MLP; densetrain's SwiGLU uses d_ff 1024 (3 matrices) for the same parameter count
  (13.76M vs nanoGPT's 13.86M incl. its position table).
* ``tiny``: the ``tiny`` preset's shape (4 layers, d_model 128, 4 heads, 2 KV heads, d_ff 352, seq_len 256,
  batch 16); nanoGPT has no GQA, so it gets 4 heads and a 4*d MLP.

What is timed: each train step's wall interval (densetrain: the ``time`` stamps of consecutive ``train``
records in ``metrics.jsonl``; nanoGPT: its per-iteration ``time``), both covering the whole loop iteration.
The first ``--skip`` steps (compile, warm-up) are left out of tokens/s; their excess over the steady step
time is reported as "warm-up/compile s". Both processes get the same thread count and
``OMP_WAIT_POLICY=PASSIVE`` (densetrain's default; with OpenMP's busy-wait a second busy process made
training ~6x slower on these 2 cores; ``--omp-wait-policy ACTIVE`` measures the idle-machine spin instead).
Both optimisers: AdamW, same peak/min lr, warmup, cosine, betas,
weight decay, clipping. Loss after the budget: validation loss (nats/token) of each trainer on its own
evaluator over the same held-out tokens (densetrain: ``val/all/loss``, every source's val windows,
``eval.max_batches`` per source; nanoGPT: ``--eval-iters`` random batches of val.bin), plus densetrain fp32
vs its default for the 1% check.

MFU = FLOPs/token * tokens/s / peak, with FLOPs/token from :func:`densetrain.metrics.flops_per_token`'s
formula (6 N + 12 L d T, N the matmul parameters incl. the output projection; for nanoGPT its own N) and the
peaks measured in this process before and after the runs (:func:`densetrain.metrics.measure_peak_flops`,
fp32 and bf16; the larger of the two measurements). On a shared machine, where wall time depends on the
other processes, each densetrain run also reports CPU-ms per step and a CPU-time MFU (the same FLOPs over
CPU-seconds / threads, against the 1024^3 probe timed by CPU time); ``--variant KEY=VALUE`` adds paired runs
of densetrain with config overrides (one A/B per change). MFU is against the peak of the dtype a trainer ran in
(densetrain's default: what ``train.dtype = 'auto'`` chose here; nanoGPT: fp32), and against the bf16 peak too
only where the CPU has bf16 instructions (elsewhere bf16 is emulated at ~1 GFLOP/s and that ratio means nothing).
``--matmuls`` times each matrix product of the step alone in the default's dtype (shapes as autograd passes
them, glibc's heap kept as in training) against the probe timed the same way, and prints their sum against
the default's median step: what is matmul time, what is the rest. Overheads (``--overheads``): one densetrain run of the
``tiny`` preset with its own checkpoint / eval intervals, shares of wall time from its step-time breakdown.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {
    "gpt-13.8m": {"n_layers": 6, "d_model": 384, "n_heads": 6, "n_kv_heads": 6, "d_ff": 1024, "seq_len": 256,
                  "batch": 8, "peak_lr": 1e-3, "min_lr": 1e-4},
    "tiny": {"n_layers": 4, "d_model": 128, "n_heads": 4, "n_kv_heads": 2, "d_ff": 352, "seq_len": 256,
             "batch": 16, "peak_lr": 4e-3, "min_lr": 2e-4},
}
VOCAB = 8192
TORCH_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}  # train.dtype's words -> torch attribute names


@dataclass
class RunResult:
    """One trainer run: per-step wall seconds (steady steps only), warm-up excess, final val loss."""

    name: str
    step_s: list[float]
    warmup_s: float
    val_loss: float
    wall_s: float
    cpu_s: float
    extra: dict = field(default_factory=dict)

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)


def export_nanogpt_data(shards: Path, out: Path) -> dict:
    """Write ``out/train.bin``, ``out/val.bin`` (flat uint16, every source's tokens in sorted source order)
    and ``out/meta.pkl`` (``{'vocab_size': VOCAB}``); return token counts per split and source."""
    from densetrain.data.shards import TokenFiles

    out.mkdir(parents=True, exist_ok=True)
    counts: dict = {"train": {}, "val": {}}
    sources = sorted(p.name for p in shards.iterdir() if (p / "train").is_dir())
    for split in ("train", "val"):
        with open(out / f"{split}.bin", "wb") as f:
            for s in sources:
                tf = TokenFiles(shards / s / split)
                toks = tf.read(0, len(tf))
                if toks.max() >= 65536:
                    raise SystemExit(f"{s}: token ids do not fit uint16")
                toks.astype(np.uint16).tofile(f)
                counts[split][s] = len(tf)
    with open(out / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": VOCAB}, f)
    return counts


def flops_per_token_gpt(shape: dict) -> float:
    """The same formula for nanoGPT's GPT: N = L * 12 d^2 (attention 4 d^2, MLP 8 d^2) + d * vocab (tied head)."""
    d, L, T = shape["d_model"], shape["n_layers"], shape["seq_len"]
    return 6.0 * (L * 12 * d * d + d * VOCAB) + 12.0 * L * d * T


def densetrain_overrides(shape: dict, steps: int, run_dir: Path, shards: Path, counts: dict, threads: int,
                         extra: dict) -> list:
    """Config overrides of the ``tiny`` preset for a bench run: one stage whose mix is proportional to each
    source's train tokens (as nanoGPT's uniform windows over the concatenation), no in-loop evals or tasks,
    one checkpoint at the end, the final validation loss."""
    from densetrain.config.schema import EvalConfig

    total = sum(counts["train"].values())
    mix = {s: n / total for s, n in counts["train"].items()}
    ov = {"model.n_layers": shape["n_layers"], "model.d_model": shape["d_model"], "model.n_heads": shape["n_heads"],
          "model.n_kv_heads": shape["n_kv_heads"], "model.d_ff": shape["d_ff"], "model.vocab_size": VOCAB,
          "model.tie_embeddings": True, "data.shards_dir": str(shards),
          "train.seq_len": shape["seq_len"], "train.batch_size": shape["batch"],
          "train.micro_batch_size": shape["batch"], "train.steps": steps, "train.run_dir": str(run_dir),
          "train.threads": threads, "stages": [{"name": "main", "start": 0.0, "mix": mix}],
          "optim.peak_lr": shape["peak_lr"], "optim.min_lr": shape["min_lr"], "optim.weight_decay": 0.1,
          "optim.grad_clip": 1.0, "schedule.kind": "cosine", "schedule.warmup_steps": max(1, steps // 10),
          "eval.every": 0, "eval.tasks": "", "eval.final_tasks": "", "eval.max_batches": 8,
          "checkpoint.every": 0, "logging.every": 10}
    if hasattr(EvalConfig(), "position_buckets"):  # the position-bucket eval runs at the end: not timed, not needed
        ov["eval.position_buckets"] = []
    ov.update(extra)
    return list(ov.items())


def worker(spec: str) -> None:
    """Child process: train with the overrides in ``spec`` (JSON list of [key, value]); the process CPU time
    at the start of every step goes to ``cpu_stamps.json`` next to the run directory (CPU seconds per step
    depend far less on other processes' load than wall seconds)."""
    import densetrain.train.loop as loop
    from densetrain.config import load_config
    from densetrain.train import train

    cfg = load_config(preset="tiny", overrides=[tuple(kv) for kv in json.loads(spec)])
    stamps, compute_step = [], loop.compute_step

    def timed(*args, **kwargs):
        stamps.append(time.process_time())
        return compute_step(*args, **kwargs)

    loop.compute_step = timed
    try:
        train(cfg)
    finally:
        (Path(cfg.train.run_dir).parent / "cpu_stamps.json").write_text(json.dumps(stamps))


WAIT_POLICY = "PASSIVE"  # --omp-wait-policy: both trainers' OpenMP wait policy


def _env(threads: int, wait_policy: str | None = None) -> dict:
    env = dict(os.environ, OMP_WAIT_POLICY=wait_policy or WAIT_POLICY, OMP_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(cmd: list[str], cwd: Path, env: dict, log: Path) -> tuple[float, float]:
    """Run ``cmd``; return (wall s, CPU s of the child). Raises SystemExit on failure with the log's tail."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if rc:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed (rc {rc}); log {log}:\n" + log.read_text()[-3000:])
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _steady(times: list[float], skip: int) -> tuple[list[float], float]:
    steady = times[skip:]
    med = statistics.median(steady)
    return steady, sum(max(0.0, t - med) for t in times[:skip])


def run_densetrain(name: str, shape: dict, steps: int, work: Path, shards: Path, counts: dict, threads: int,
                   skip: int, extra: dict) -> RunResult:
    from densetrain.metrics import read_metrics

    run_dir = Path(tempfile.mkdtemp(dir=work, prefix=f"{name}-"))
    spec = json.dumps(densetrain_overrides(shape, steps, run_dir / "run", shards, counts, threads, extra))
    wall, cpu = _run([sys.executable, __file__, "--worker", spec], ROOT, _env(threads), run_dir / "log.txt")
    recs = read_metrics(run_dir / "run")
    train = [r for r in recs if r["kind"] == "train"]
    stamps = [r["time"] for r in train]
    # Step 1's interval starts at the end of setup, which the loop does not stamp: its own step_s.
    times = [train[0]["time/step_s"]] + [b - a for a, b in zip(stamps, stamps[1:])]
    steady, warm = _steady(times, skip)
    val = [r for r in recs if r["kind"] == "eval" and "val/all/loss" in r]
    log = (run_dir / "log.txt").read_text()
    stamps = json.loads((run_dir / "cpu_stamps.json").read_text())
    cpu_step_s = statistics.median(b - a for a, b in zip(stamps[skip:], stamps[skip + 1:]))
    return RunResult(name, steady, warm, val[-1]["val/all/loss"] if val else float("nan"), wall, cpu,
                     {"dtype_line": next((ln for ln in log.splitlines() if ln.startswith("train.dtype=")), ""),
                      "data_wait_s": sum(r.get("time/data_wait_s", 0.0) for r in train[skip:]) / len(steady),
                      "train_loss": train[-1]["loss"], "cpu_step_s": cpu_step_s, "threads": threads,
                      # the record interval minus the step's own time: logging, watcher and interval checks
                      "loop_overhead_s": statistics.median(b["time"] - a["time"] - b["time/step_s"]
                                                           for a, b in zip(train[skip:], train[skip + 1:]))})


def run_nanogpt(shape: dict, steps: int, work: Path, nanogpt: Path, data_dir: Path, threads: int, skip: int,
                eval_iters: int, compile_: bool) -> RunResult:
    scratch = Path(tempfile.mkdtemp(dir=work, prefix="nanogpt-"))
    for f in ("train.py", "model.py", "configurator.py"):
        (scratch / f).symlink_to(nanogpt / f)
    (scratch / "data").mkdir()
    (scratch / "data" / "densetrain_demo").symlink_to(data_dir)
    args = {"dataset": "densetrain_demo", "device": "cpu", "dtype": "float32", "compile": compile_,
            "n_layer": shape["n_layers"], "n_head": shape["n_heads"], "n_embd": shape["d_model"],
            "block_size": shape["seq_len"], "batch_size": shape["batch"], "gradient_accumulation_steps": 1,
            "dropout": 0.0, "bias": False, "max_iters": steps, "lr_decay_iters": steps,
            "eval_interval": steps, "eval_iters": eval_iters, "log_interval": 1, "always_save_checkpoint": False,
            "learning_rate": shape["peak_lr"], "min_lr": shape["min_lr"], "warmup_iters": max(1, steps // 10),
            "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "grad_clip": 1.0, "out_dir": str(scratch / "out")}
    cmd = [sys.executable, "train.py"] + [f"--{k}={v}" for k, v in args.items()]
    wall, cpu = _run(cmd, scratch, _env(threads), scratch / "log.txt")
    log = (scratch / "log.txt").read_text()
    times = [float(m) / 1e3 for m in re.findall(r"^iter \d+: loss [\d.]+, time ([\d.]+)ms", log, re.M)]
    # iter 0 includes the first evaluation and iter `steps` the last one: both are left out.
    steady, warm = _steady(times[1:steps], skip - 1)
    vals = re.findall(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)", log, re.M)
    val = float(vals[-1][1]) if vals and int(vals[-1][0]) == steps else float("nan")
    return RunResult("nanogpt" + ("-compile" if compile_ else ""), steady, warm, val, wall, cpu)


def _git_commit(path: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def overheads(work: Path, shards: Path, threads: int, steps: int) -> None:
    """One run of the ``tiny`` preset as configured (its checkpoint and eval intervals, tasks included) for
    ``steps`` steps; print data wait, checkpoint blocking and in-loop evals as shares of wall time."""
    from densetrain.config import load_config
    from densetrain.metrics import read_metrics

    cfg = load_config(preset="tiny")
    run_dir = Path(tempfile.mkdtemp(dir=work, prefix="overheads-")) / "run"
    ov = [("train.steps", steps), ("train.run_dir", str(run_dir)), ("data.shards_dir", str(shards)),
          ("train.threads", threads), ("eval.final_tasks", "")]
    wall, _ = _run([sys.executable, __file__, "--worker", json.dumps(ov)], ROOT, _env(threads),
                   run_dir.parent / "log.txt")
    recs = read_metrics(run_dir)
    train = [r for r in recs if r["kind"] == "train"]
    t_first, t_last = train[0]["time"] - train[0]["time/step_s"], recs[-1]["time"]
    loop_s = t_last - t_first
    data = sum(r.get("time/data_wait_s", 0.0) for r in train)
    step_s = sum(r["time/step_s"] for r in train)
    evals = sum(r.get("time/eval_s", 0.0) + r.get("time/tasks_s", 0.0) for r in recs if r["kind"] == "eval")
    ckpt = sum(r.get("seconds", 0.0) or (r.get("values") or {}).get("seconds", 0.0) for r in recs
               if r["kind"] == "event" and "checkpoint step_" in r.get("text", ""))
    if not ckpt:  # older event records: parse "(1.23s)"
        ckpt = sum(float(m) for r in recs if r["kind"] == "event"
                   for m in re.findall(r"checkpoint step_\d+ \(([\d.]+)s\)", r.get("text", "")))
    print(f"\n== overheads: tiny preset, {steps} steps (checkpoint.every {cfg.checkpoint.every}, eval.every "
          f"{cfg.eval.every}, tasks '{cfg.eval.tasks}' every {cfg.eval.tasks_every}, limit {cfg.eval.tasks_limit})")
    print(f"  loop wall {loop_s:.1f} s (process {wall:.1f} s incl. setup); train steps {step_s:.1f} s")
    print(f"  data wait        {data:7.2f} s = {100 * data / step_s:5.2f}% of step time (target < 2%)")
    print(f"  checkpoint block {ckpt:7.2f} s = {100 * ckpt / loop_s:5.2f}% of wall time (target < 5%)")
    print(f"  in-loop evals    {evals:7.2f} s = {100 * evals / loop_s:5.2f}% of wall time (target < 10%)")


def cpu_time_peak(dtype, threads: int, n: int = 1024, trials: int = 15) -> float:
    """The 1024^3 matmul probe of :func:`densetrain.metrics.measure_peak_flops` timed by process CPU time
    instead of wall time: best FLOPs per CPU-second of ``trials`` matmuls, times ``threads``. The denominator of
    the bench's CPU-time MFU (CPU-ms/step with every thread busy), which load on a shared machine inflates
    far less than the wall-clock figures; not the MFU the trainer logs. Run in a child with the trainers'
    ``OMP_WAIT_POLICY=PASSIVE`` (a spinning thread would count the other's descheduled time as CPU time)."""
    import torch

    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(trials):
        c0 = time.process_time()
        a @ b
        best = min(best, time.process_time() - c0)
    return 2.0 * n**3 / best * threads


def step_matmuls(shape: dict) -> list[tuple[str, int, tuple, tuple, bool, bool]]:
    """The matrix products of one densetrain train step at ``shape`` (tied head, bf16 matmul attention with
    K/V repeated to every query head): ``(name, calls per step, A shape, B shape, A transposed, B
    transposed)``, one product A @ B each, A and B given as stored and used transposed where flagged, as
    autograd passes them (``F.linear`` forward ``x @ W^T``, input gradient ``dY @ W``, weight gradient
    ``dY^T @ x``; attention's products batched over B x n_heads). FLOPs: 2 M K N per (batched) product;
    their sum is :func:`densetrain.metrics.flops_per_token` times the step's tokens (tests/test_train_bench.py)."""
    d, ff, L, T, B = shape["d_model"], shape["d_ff"], shape["n_layers"], shape["seq_len"], shape["batch"]
    M, H = B * T, shape["n_heads"]
    hd = d // H
    kv = shape["n_kv_heads"] * hd
    out = []
    for name, k, n, count in (("wq", d, d, L), ("wk/wv", d, kv, 2 * L), ("wo", d, d, L), ("w1/w3", d, ff, 2 * L),
                              ("w2", ff, d, L), ("head", d, VOCAB, 1)):
        out += [(f"{name} fwd", count, (M, k), (n, k), False, True),       # x @ W^T
                (f"{name} dX", count, (M, n), (n, k), False, False),       # dY @ W
                (f"{name} dW", count, (M, n), (M, k), True, False)]        # dY^T @ x
    bh = (B * H,)
    out += [("attn q@k^T", L, bh + (T, hd), bh + (T, hd), False, True),
            ("attn p@v", L, bh + (T, T), bh + (T, hd), False, False),
            ("attn dP=dO@v^T", L, bh + (T, hd), bh + (T, hd), False, True),
            ("attn dV=p^T@dO", L, bh + (T, T), bh + (T, hd), True, False),
            ("attn dQ=dS@k", L, bh + (T, T), bh + (T, hd), False, False),
            ("attn dK=dS^T@q", L, bh + (T, T), bh + (T, hd), True, False)]
    return out


def time_matmuls(shape_name: str, dtype_name: str, threads: int, repeats: int = 5, calls: int = 20) -> dict:
    """Child process: each product of :func:`step_matmuls` timed alone (wall clock, best of ``repeats`` means
    over ``calls`` calls, inputs allocated once, glibc's heap kept as in training by
    :func:`densetrain.train.step.keep_freed_memory`) and the 1024^3 probe the same way; JSON-ready."""
    import torch

    from densetrain.train.step import keep_freed_memory

    keep_freed_memory()  # as in training: without it every new output is page-faulted in (~10% at this shape)
    torch.set_num_threads(threads)
    dtype = getattr(torch, TORCH_DTYPES[dtype_name])
    gen = torch.Generator().manual_seed(0)

    def operand(dims, transposed):
        x = torch.randn(dims, dtype=dtype, generator=gen)
        return x.transpose(-2, -1) if transposed else x

    def best_s(a, b) -> float:
        a @ b
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                a @ b
            best = min(best, (time.perf_counter() - t0) / calls)
        return best

    probe = torch.randn(1024, 1024, dtype=dtype, generator=gen)
    rows = []
    for name, count, sa, sb, ta, tb in step_matmuls(SHAPES[shape_name]):
        a, b = operand(sa, ta), operand(sb, tb)
        flops = 2.0 * a.shape[-2] * a.shape[-1] * b.shape[-1] * (a.numel() // (a.shape[-2] * a.shape[-1]))
        rows.append({"name": name, "count": count, "flops": flops, "s": best_s(a, b),
                     "dims": f"{'x'.join(map(str, a.shape))} @ {'x'.join(map(str, b.shape))}"})
    return {"dtype": dtype_name, "probe_flops": 2.0 * 1024**3 / best_s(probe, probe), "rows": rows,
            "repeats": repeats, "calls": calls}


def matmul_report(shape_name: str, threads: int, dtype: str, runs: list, flops_per_token, ModelConfig) -> None:
    """Print :func:`time_matmuls` (run in a child with the trainers' environment): each product's time and
    rate as a share of the probe, their sum per step against the default's median step, and the MFU the step
    would have if it were its matmuls alone (the ceiling of removing every non-matmul cost)."""
    out = subprocess.run([sys.executable, __file__, "--matmul-worker", f"{shape_name},{dtype},{threads}"],
                         env=_env(threads), capture_output=True, text=True, check=True).stdout
    t = json.loads(out.strip().splitlines()[-1])
    probe, shape = t["probe_flops"], SHAPES[shape_name]
    print(f"-- {shape_name} matmuls alone ({dtype}, {threads} threads, best of {t['repeats']} x {t['calls']} calls; "
          "probe 1024^3 "
          f"{probe / 1e9:.0f} GFLOP/s measured the same way)")
    total_s = total_f = 0.0
    for r in t["rows"]:
        rate = r["flops"] / r["s"]
        total_s, total_f = total_s + r["count"] * r["s"], total_f + r["count"] * r["flops"]
        print(f"  {r['name']:16s} {r['dims']:28s} x{r['count']:3d}  {r['s'] * 1e3:7.3f} ms  {rate / 1e9:6.0f} GFLOP/s "
              f"({100 * rate / probe:5.1f}% of probe)  {r['count'] * r['s'] * 1e3:7.1f} ms/step")
    step_s = statistics.median(r.median_s for r in runs)
    tok = shape["batch"] * shape["seq_len"]
    model_flops = flops_per_token(_model_config(shape, ModelConfig), shape["seq_len"]) * tok
    if dtype != "bf16":
        print("  (fp32 attention runs SDPA's fused CPU kernel, not these attn products: they stand in for its FLOPs)")
    print(f"  sum: {total_f / 1e9:.1f} GFLOP in {total_s * 1e3:.0f} ms ({100 * total_f / total_s / probe:.1f}% of "
          f"probe); densetrain's median step {step_s * 1e3:.0f} ms, so matmuls {100 * total_s / step_s:.0f}% and "
          f"the rest {(step_s - total_s) * 1e3:.0f} ms; MFU if the step were its matmuls: "
          f"{100 * model_flops / total_s / probe:.1f}% (model FLOPs {model_flops / 1e9:.1f} G/step)")


def _overrides(text: str) -> dict:
    """``"a.b=1,c.d=false"`` -> ``{"a.b": 1, "c.d": False}`` (each value JSON if it parses, else the string)."""
    out = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nanogpt", type=Path, help="a checkout of karpathy/nanoGPT (outside this repository)")
    ap.add_argument("--shape", choices=[*SHAPES, "both"], default="both")
    ap.add_argument("--runs", type=int, default=3, help="alternating runs of each trainer (>= 3)")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per run (token budget = steps x batch x T)")
    ap.add_argument("--skip", type=int, default=3, help="first steps left out of tokens/s (compile, warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-iters", type=int, default=20, help="nanoGPT val batches for its final val loss")
    ap.add_argument("--shards", type=Path, default=ROOT / ".cache/densetrain/shards")
    ap.add_argument("--no-fp32", action="store_true", help="skip densetrain's fp32 runs (the loss check)")
    ap.add_argument("--nanogpt-compile", action="store_true", help="also run nanoGPT with torch.compile")
    ap.add_argument("--overheads", type=int, default=0, metavar="STEPS", help="also the overhead run (tiny preset)")
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (default: a new temp dir)")
    ap.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                    help="also run densetrain with these config overrides (values as JSON, else strings), "
                         "alternating with the default; repeatable (one A/B per change)")
    ap.add_argument("--omp-wait-policy", choices=["PASSIVE", "ACTIVE"], default="PASSIVE",
                    help="OpenMP wait policy of both trainers (ACTIVE: idle threads spin; only on an otherwise "
                         "idle machine; the CPU-time probe stays PASSIVE)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--matmuls", action="store_true",
                    help="also time each matrix product of the step alone (in the default's dtype) against the "
                         "1024^3 probe: the step's matmul time, the rest is non-matmul work")
    ap.add_argument("--cpu-peak", help=argparse.SUPPRESS)  # child: "THREADS,DTYPE", cpu_time_peak in the trainers' env
    ap.add_argument("--matmul-worker", help=argparse.SUPPRESS)  # child: "SHAPE,DTYPE,THREADS", time_matmuls
    ap.error = lambda msg: ap.exit(2, f"train_bench.py: {msg} (see --help)\n")  # one line, not the usage block
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker)
    if a.cpu_peak:
        import torch

        threads, dtype = a.cpu_peak.split(",")
        torch.set_num_threads(int(threads))
        return print(cpu_time_peak(getattr(torch, TORCH_DTYPES[dtype]), int(threads)))
    if a.matmul_worker:
        shape_name, dtype, threads = a.matmul_worker.split(",")
        return print(json.dumps(time_matmuls(shape_name, dtype, int(threads))))
    global WAIT_POLICY
    WAIT_POLICY = a.omp_wait_policy  # the trainers' children (their environment is set by _env)

    import torch

    from densetrain.config import ModelConfig
    from densetrain.metrics import flops_per_token, measure_peak_flops
    from densetrain.model.precision import cpu_has_bf16, resolve_dtype

    if not (a.shards / "manifest.json").exists():
        ap.error(f"--shards {a.shards}: no demo shards (manifest.json); run `densetrain prepare --preset tiny` first")
    work = a.work or Path(tempfile.mkdtemp(prefix="train_bench-"))
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(a.threads)
    nanogpt = a.nanogpt
    if nanogpt is None or not (nanogpt / "train.py").is_file():
        print(f"nanoGPT: ABSENT ({'no --nanogpt given' if nanogpt is None else f'{nanogpt}/train.py not found'}); "
              "only densetrain runs, no ratio. Get it with: git clone https://github.com/karpathy/nanoGPT /tmp/nanogpt")
        nanogpt = None
    else:
        print(f"nanoGPT: {nanogpt} at commit {_git_commit(nanogpt)}")
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "unknown CPU")
    print(f"machine: {cpu}, {os.cpu_count()} logical CPUs, threads {a.threads}, OMP_WAIT_POLICY {a.omp_wait_policy}, "
          f"bf16 matmul instructions: "
          f"{cpu_has_bf16()}; torch {torch.__version__}; load average {os.getloadavg()[0]:.2f}")
    auto = resolve_dtype("auto", torch.device("cpu"))  # prints what the default becomes here, with both rates
    counts = export_nanogpt_data(a.shards, work / "nanogpt_data")
    print(f"data: {sum(counts['train'].values()):,} train / {sum(counts['val'].values()):,} val tokens "
          f"({', '.join(counts['train'])}) -> {work / 'nanogpt_data'}")
    dev = torch.device("cpu")
    peaks = {"fp32": measure_peak_flops(dev, torch.float32), "bf16": measure_peak_flops(dev, torch.bfloat16),
             "cpu": float(subprocess.run([sys.executable, __file__, "--cpu-peak", f"{a.threads},{auto}"],
                                              env=_env(a.threads, "PASSIVE"), capture_output=True, text=True,
                                              check=True).stdout)}

    results: dict[str, dict[str, list[RunResult]]] = {}
    for shape_name in SHAPES if a.shape == "both" else [a.shape]:
        shape = SHAPES[shape_name]
        variants = {f"densetrain[{v}]": _overrides(v) for v in a.variant}
        kinds = ["densetrain", *variants] + ([] if a.no_fp32 else ["densetrain-fp32"])
        kinds = (["nanogpt"] if nanogpt else []) + kinds + (["nanogpt-compile"] if nanogpt and a.nanogpt_compile
                                                             else [])
        res = results[shape_name] = {k: [] for k in kinds}
        dtypes = {k: "fp32" if k.startswith("nanogpt") or k.endswith("fp32") else variants.get(k, {}).get(
            "train.dtype", auto) for k in kinds}
        print(f"\n== {shape_name}: {shape}; {a.steps} steps x {shape['batch'] * shape['seq_len']} tokens, "
              f"{a.runs} alternating runs of {', '.join(kinds)}")
        for r in range(a.runs):
            order = kinds if r % 2 == 0 else kinds[::-1]  # alternate which trainer goes first
            for k in order:
                if k.startswith("nanogpt"):
                    rr = run_nanogpt(shape, a.steps, work, nanogpt, work / "nanogpt_data", a.threads, a.skip,
                                     a.eval_iters, k.endswith("compile"))
                else:
                    rr = run_densetrain(k, shape, a.steps, work, a.shards, counts, a.threads, a.skip,
                                        {"train.dtype": "fp32"} if k.endswith("fp32") else variants.get(k, {}))
                res[k].append(rr)
                print(f"  run {r + 1} {k:16s} {rr.median_s * 1e3:7.1f} ms/step  "
                      f"{shape['batch'] * shape['seq_len'] / rr.median_s:7.0f} tok/s  val {rr.val_loss:.4f}  "
                      f"warm-up/compile {rr.warmup_s:5.1f} s  process {rr.wall_s:5.1f} s wall, {rr.cpu_s:5.1f} s CPU "
                      + (f"{rr.extra['cpu_step_s'] * 1e3:.0f} CPU-ms/step " if "cpu_step_s" in rr.extra else "")
                      + f"(load {os.getloadavg()[0]:.1f})", flush=True)
    after = {"fp32": measure_peak_flops(dev, torch.float32), "bf16": measure_peak_flops(dev, torch.bfloat16)}
    print(f"\nmatmul peaks (1024^3, best of 7, before / after the runs): "
          f"fp32 {peaks['fp32'] / 1e9:.0f} / {after['fp32'] / 1e9:.0f} GFLOP/s, "
          f"bf16 {peaks['bf16'] / 1e9:.0f} / {after['bf16'] / 1e9:.0f} GFLOP/s; MFU below uses the larger")
    # A probe slowed by a moment of load (a VM's neighbours, a run just ended) would inflate MFU, even past 100%.
    peaks.update({k: max(peaks[k], after[k]) for k in after})
    for shape_name, res in results.items():
        report(shape_name, SHAPES[shape_name], res, peaks, flops_per_token, ModelConfig, dtypes, auto)
        if a.matmuls:
            matmul_report(shape_name, a.threads, auto, res["densetrain"], flops_per_token, ModelConfig)
    if a.overheads:
        overheads(work, a.shards, a.threads, a.overheads)
    print(f"\nscratch: {work}")


def _model_config(shape: dict, ModelConfig):
    return ModelConfig(vocab_size=VOCAB, d_model=shape["d_model"], n_layers=shape["n_layers"],
                       n_heads=shape["n_heads"], n_kv_heads=shape["n_kv_heads"], d_ff=shape["d_ff"],
                       tie_embeddings=True)


def report(shape_name: str, shape: dict, res: dict, peaks: dict, flops_per_token, ModelConfig, dtypes: dict,
           auto: str) -> None:
    """Median tokens/s per trainer, ratio vs nanoGPT with the spread over runs paired in order, MFU against
    the measured peak of the dtype each trainer ran in (and against the bf16 peak too where this CPU has bf16
    instructions: without them bf16 is emulated and its "peak" means nothing), the final losses. The CPU-time
    MFU is against the probe of ``auto``, the default's dtype here."""
    tok = shape["batch"] * shape["seq_len"]
    cfg = _model_config(shape, ModelConfig)
    from densetrain.model.precision import cpu_has_bf16

    shown = ["fp32", "bf16"] if cpu_has_bf16() else ["fp32"]
    fpt = {"densetrain": flops_per_token(cfg, shape["seq_len"]), "nanogpt": flops_per_token_gpt(shape)}
    print(f"-- {shape_name} summary (median of per-run medians; FLOPs/token densetrain {fpt['densetrain'] / 1e6:.1f}M, "
          f"nanoGPT {fpt['nanogpt'] / 1e6:.1f}M)")
    base = res.get("nanogpt")
    for k, runs in res.items():
        tps = [tok / r.median_s for r in runs]
        f = fpt["nanogpt" if k.startswith("nanogpt") else "densetrain"]
        med = statistics.median(tps)
        mfu = ", ".join(f"{100 * f * med / peaks[dt]:5.1f}% of {dt} peak" for dt in shown)
        line = (f"  {k:16s} {med:7.0f} tok/s (runs {min(tps):.0f}-{max(tps):.0f})  {dtypes[k]}  MFU {mfu}  "
                f"val loss {statistics.median([r.val_loss for r in runs]):.4f}  "
                f"warm-up/compile {statistics.median([r.warmup_s for r in runs]):.1f} s")
        if "cpu_step_s" in runs[0].extra and dtypes[k] == auto:
            cpu_ms = statistics.median([r.extra["cpu_step_s"] for r in runs]) * 1e3
            threads = max(1, int(runs[0].extra.get("threads", 1)))
            cpu_mfu = f * tok / (cpu_ms / 1e3 / threads) / peaks["cpu"]
            line += (f"  {cpu_ms:.0f} CPU-ms/step (CPU-time MFU: {100 * cpu_mfu:.1f}% of the probe's "
                     f"{peaks['cpu'] / 1e9:.0f} {auto} GFLOP per CPU-second x {threads} threads)")
        if "loop_overhead_s" in runs[0].extra:
            line += (f"  data wait {1e3 * statistics.median([r.extra['data_wait_s'] for r in runs]):.1f} ms/step, "
                     f"log+checks {1e3 * statistics.median([r.extra['loop_overhead_s'] for r in runs]):.1f} ms/step")
        if k.startswith("densetrain[") and k != "densetrain":
            ratios = [r0.median_s / r.median_s for r, r0 in zip(runs, res["densetrain"])]
            line += (f"  vs default: paired runs {min(ratios):.3f}-{max(ratios):.3f}x "
                     f"(median {statistics.median(ratios):.3f}x)")
        if base and k != "nanogpt":
            ratios = [tok / r.median_s / (tok / b.median_s) for r, b in zip(runs, base)]
            line += (f"  ratio vs nanoGPT {med / statistics.median([tok / b.median_s for b in base]):.2f}x "
                     f"(paired runs {min(ratios):.2f}-{max(ratios):.2f}x)")
        print(line)
    if "densetrain-fp32" in res:
        d = statistics.median([r.val_loss for r in res["densetrain"]])
        f32 = statistics.median([r.val_loss for r in res["densetrain-fp32"]])
        print(f"  loss check: densetrain default val {d:.4f} vs fp32 {f32:.4f}: {100 * (d - f32) / f32:+.2f}% "
              f"({'within' if abs(d - f32) <= 0.01 * f32 else 'OUTSIDE'} 1%)")


if __name__ == "__main__":
    main()
