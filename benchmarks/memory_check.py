"""Peak memory of densetrain training on CPU against the planner's analytic estimate.

    .venv/bin/python benchmarks/memory_check.py                 # tiny preset and gpt2-124m at micro-batch 1
    .venv/bin/python benchmarks/memory_check.py --only gpt2-124m --steps 3

Each model trains in its own process, twice:

* ``train``: :func:`densetrain.train.train` as a user runs it, for ``--steps`` steps; measured: the process's
  peak RSS (``ru_maxrss`` from ``wait4``, the whole process: imports, setup, steps, the final evaluation and
  checkpoint) and the trainer's own ``mem/rss_peak_gib`` at its last logged step (training only).
* ``phases``: the same config through the loop's own pieces (:func:`densetrain.train.setup.setup`,
  :func:`densetrain.train.step.compute_step`, :func:`densetrain.train.loop.commit`), with the RSS read at
  each phase boundary and its peak inside each phase sampled every 2 ms by a thread: where the memory goes.

Both run on the demo shards (vocabulary 8192 ids, which a model with vocabulary 50304 reads as well): the
``tiny`` preset's config with one stage (its main mix), no in-loop evals, tasks, samples or position evals;
for ``gpt2-124m`` the preset's model (12 x 768, 12 heads, SwiGLU d_ff 2048, vocab 50304, tied) at seq_len
1024 and batch = micro-batch = 1. The estimate is :func:`densetrain.tools.plan.layout_memory` for one process
(parameters fp32 + gradients fp32 + AdamW's two moments + activations of one micro-batch, bf16 activations
when the run uses bf16 autocast) and excludes the runtime itself; the report gives the ratio both for the
peak RSS and for the peak RSS minus the RSS of the same process after its imports (torch, densetrain).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_bench import ROOT, _env  # noqa: E402  (benchmarks/ is not a package)

GIB = 2**30
PAGE = os.sysconf("SC_PAGE_SIZE")

GPT2_MODEL = {"model.vocab_size": 50304, "model.d_model": 768, "model.n_layers": 12, "model.n_heads": 12,
              "model.n_kv_heads": 12, "model.d_ff": 2048, "model.tie_embeddings": True}


def _overrides(name: str, steps: int, run_dir: Path, shards: Path, threads: int) -> list:
    from densetrain.config import load_config

    main_mix = dict(load_config(preset="tiny").stages[0].mix)
    ov = {"data.shards_dir": str(shards), "train.run_dir": str(run_dir), "train.steps": steps,
          "train.threads": threads, "stages": [{"name": "main", "start": 0.0, "mix": main_mix}],
          "eval.every": 0, "eval.tasks": "", "eval.final_tasks": "", "eval.samples": 0, "eval.position_len": 0,
          "checkpoint.every": 0, "logging.every": 1, "logging.mfu_every": 1, "schedule.warmup_steps": 1}
    if name == "gpt2-124m":
        ov.update(GPT2_MODEL)
        ov.update({"train.seq_len": 1024, "train.batch_size": 1, "train.micro_batch_size": 1,
                   "eval.max_batches": 1})
    return list(ov.items())


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class Sampler(threading.Thread):
    """Peak RSS since the last :meth:`mark`, sampled every 2 ms."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.stop = rss(), False

    def run(self) -> None:
        while not self.stop:
            self.peak = max(self.peak, rss())
            time.sleep(0.002)

    def mark(self) -> int:
        p, self.peak = max(self.peak, rss()), rss()
        return p


def worker(mode: str, spec: str, profile: bool = False) -> None:
    """Child process: ``runtime``, ``train`` or ``phases`` with the overrides in ``spec``; prints one JSON
    line (``phases`` with ``profile``: also torch.profiler's per-op allocations of the last step's forward and
    backward, sorted by self CPU memory)."""
    import torch

    from densetrain.config import load_config
    from densetrain.schedule import lr_for, stage_at
    from densetrain.train import train
    from densetrain.train.loop import commit
    from densetrain.train.setup import setup
    from densetrain.train.step import compute_step
    from densetrain.train.watchers import Verdict

    out = {"baseline": rss()}
    cfg = load_config(preset="tiny", overrides=[tuple(kv) for kv in json.loads(spec)])
    if mode == "runtime":  # imports plus the compiled cross-entropy's first call (inductor and its modules)
        from densetrain.train.step import training_token_losses

        x = torch.randn(2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
        training_token_losses(x, torch.randint(0, 64, (2, 16))).sum().backward()
        out["runtime"] = rss()
    elif mode == "train":
        train(cfg)
    else:
        s = Sampler()
        s.start()
        run = setup(cfg)
        out["autocast"] = run.autocast is not None
        out["setup"] = {"end": rss(), "peak": s.mark()}
        logits = {}
        run.model.register_forward_hook(lambda m, i, o: logits.update(rss=rss(), bytes=o.numel() * o.element_size(),
                                                                      dtype=str(o.dtype)))
        out["steps"] = []
        for i in range(cfg.train.steps):
            st = stage_at(run.state.step, run.stages)
            prof = None
            if profile and i == cfg.train.steps - 1:  # the last step: allocations per op
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
                prof.__enter__()
            result = compute_step(run, st, lr_for(run.state.step, cfg, run.stages))
            if prof is not None:
                prof.__exit__(None, None, None)
                print(prof.key_averages().table(sort_by="self_cpu_memory_usage", row_limit=14), flush=True)
            fb = {"after_forward": logits["rss"], "fwd_bwd_peak": s.mark(), "after_backward": rss()}
            commit(run, result, Verdict.APPLY)
            fb.update(optimizer_peak=s.mark(), after_optimizer=rss(), loss=result.loss)
            out["steps"].append(fb)
        out["logits"] = {k: v for k, v in logits.items() if k != "rss"}
        s.stop = True
    print("MEMCHECK " + json.dumps(out), flush=True)


def child(mode: str, spec: list, log: Path, threads: int) -> tuple[dict, int]:
    """Run a worker (``mode`` may end in ``+profile``); return (its JSON, peak RSS in bytes from wait4)."""
    import subprocess

    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, __file__, "--worker", mode, json.dumps(spec)], cwd=ROOT,
                             env=_env(threads), stdout=f, stderr=subprocess.STDOUT)
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
    text = log.read_text()
    if p.returncode:
        raise SystemExit(f"{mode} worker failed (rc {p.returncode}); log {log}:\n{text[-3000:]}")
    line = next(ln for ln in text.splitlines() if ln.startswith("MEMCHECK "))
    return json.loads(line[len("MEMCHECK "):]), ru.ru_maxrss * 1024


def estimate(spec: list, bf16: bool) -> dict:
    from densetrain.config import load_config
    from densetrain.parallel.mesh import Layout
    from densetrain.tools.plan import layout_memory, model_counts

    cfg = load_config(preset="tiny", overrides=spec)
    m = cfg.model
    counts = model_counts(m)
    est = layout_memory(counts, m, cfg.train.seq_len, cfg.train.micro_batch_size, Layout(1, 1, 1), "none", bf16)
    return {**est, "n_params": counts["params"], "seq_len": cfg.train.seq_len, "micro": cfg.train.micro_batch_size}


def g(x: float) -> str:
    return f"{x / GIB:.3f}"


def check(name: str, steps: int, work: Path, shards: Path, threads: int, profile: bool) -> dict:
    from densetrain.metrics import read_metrics

    d = Path(tempfile.mkdtemp(dir=work, prefix=f"{name}-"))
    spec_t = _overrides(name, steps, d / "train_run", shards, threads)
    spec_p = _overrides(name, steps, d / "phases_run", shards, threads)
    t0 = time.perf_counter()
    out_t, peak_t = child("train", spec_t, d / "train.log", threads)
    wall_t = time.perf_counter() - t0
    recs = [r for r in read_metrics(d / "train_run") if r["kind"] == "train" and "mem/rss_peak_gib" in r]
    train_peak = recs[-1]["mem/rss_peak_gib"] * GIB if recs else float("nan")
    out_p, peak_p = child("phases" + ("+profile" if profile else ""), spec_p, d / "phases.log", threads)
    out_r, _ = child("runtime", spec_t, d / "runtime.log", threads)
    est = estimate(spec_t, out_p["autocast"])
    base, runtime = out_t["baseline"], out_r["runtime"]
    print(f"\n== {name}: {est['n_params'] / 1e6:.2f}M parameters, seq_len {est['seq_len']}, "
          f"micro-batch {est['micro']}, "
          f"{'bf16 autocast' if out_p['autocast'] else 'fp32'}, {steps} steps ({wall_t:.0f} s for the train run; "
          f"load {os.getloadavg()[0]:.2f})")
    print(f"  estimate (GiB): params {g(est['params'])} + grads {g(est['grads'])} + AdamW {g(est['optim'])} + "
          f"activations {g(est['activations'])} = {g(est['total'])}")
    print(f"  measured peak RSS (GiB): whole process {g(peak_t)} (train()), training steps {g(train_peak)} "
          f"(mem/rss_peak_gib at the last step); after imports {g(base)}; after imports and one compiled "
          f"cross-entropy {g(runtime)}")
    r_all, r_net = peak_t / est["total"], (train_peak - base) / est["total"]
    r_rt = (train_peak - runtime) / est["total"]
    print(f"  ratio peak / estimate: {r_all:.2f}x whole process; training peak minus the import baseline "
          f"{r_net:.2f}x; minus imports + compiled cross-entropy {r_rt:.2f}x (target <= 1.3x)")
    print(f"  phases (GiB; peak inside each phase): baseline {g(out_p['baseline'])}, "
          f"setup end {g(out_p['setup']['end'])} "
          f"(peak {g(out_p['setup']['peak'])})")
    for i, s in enumerate(out_p["steps"]):
        print(f"    step {i + 1}: after forward {g(s['after_forward'])}, forward+backward peak {g(s['fwd_bwd_peak'])}, "
              f"after backward {g(s['after_backward'])}, optimizer peak {g(s['optimizer_peak'])}, after optimizer "
              f"{g(s['after_optimizer'])} (loss {s['loss']:.3f})")
    lg = out_p["logits"]
    print(f"  logits of one micro-batch: {lg['bytes'] / 2**20:.0f} MiB ({lg['dtype']}); phases process peak RSS "
          f"{g(peak_p)}")
    if profile:
        print("  torch.profiler, last step's compute_step, top ops by self CPU memory: " + str(d / "phases.log"))
        text = (d / "phases.log").read_text()
        print("\n".join("    " + ln for ln in text[text.find("-----"):text.find("MEMCHECK")].splitlines()[:20]))
    return {"name": name, "estimate": est, "peak": peak_t, "train_peak": train_peak, "baseline": base,
            "phases": out_p, "phases_peak": peak_p}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=["tiny", "gpt2-124m"], default=None)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shards", type=Path, default=ROOT / ".cache/densetrain/shards")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--profile", action="store_true", help="torch.profiler memory table of the last step")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        mode, spec = a.worker
        return worker(mode.removesuffix("+profile"), spec, mode.endswith("+profile"))
    if not (a.shards / "manifest.json").exists():
        raise SystemExit(f"{a.shards}: no demo shards; run `densetrain prepare --preset tiny` first")
    work = a.work or Path(tempfile.mkdtemp(prefix="memory_check-"))
    work.mkdir(parents=True, exist_ok=True)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"memory_check {time.strftime('%Y-%m-%d %H:%M')}, load average {load}")
    names = ["tiny", "gpt2-124m"] if a.only is None else [a.only]
    res = [check(n, a.steps, work, a.shards, a.threads, a.profile) for n in names]
    for r in res:
        if r["name"] == "gpt2-124m":
            ok = r["peak"] <= 4 * GIB
            print(f"\ngpt2-124m at micro-batch 1: peak RSS {g(r['peak'])} GiB: {'within' if ok else 'OVER'} 4 GiB")
    print(f"scratch: {work}")


if __name__ == "__main__":
    main()
