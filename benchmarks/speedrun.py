"""Speedrun against nanoGPT on this machine: wall time for densetrain's recipe to reach the validation loss that
nanoGPT's recipe reaches in ``--minutes`` of wall time, at (nearly) equal parameter count, on the same demo
shards, tokenizer and held-out tokens.

    .venv/bin/python benchmarks/speedrun.py --nanogpt /tmp/nanogpt --minutes 10
    .venv/bin/python benchmarks/speedrun.py --nanochat /work/nanochat --cpu-seconds 300   # see speedrun_nanochat.py

Both trainers run one after the other (never at the same time), with the same thread count and
``OMP_WAIT_POLICY=PASSIVE`` (:mod:`benchmarks.train_bench`'s environment).

* **nanoGPT** (``--nanogpt``, a checkout of https://github.com/karpathy/nanoGPT made outside this repository;
  its commit is printed): ``train.py`` exactly as ``benchmarks/train_bench.py`` runs it for the ``tiny`` shape
  (4 layers, d_model 128, 4 heads, 4*d GELU MLP, no bias, tied embeddings, block_size 256, batch 16, grad
  accumulation 1, dropout 0, fp32, no compile, AdamW lr 4e-3 -> 2e-4 cosine over ``max_iters`` with
  ``max_iters // 10`` warmup, betas 0.9/0.95, weight decay 0.1, clip 1.0), on the demo shards exported as its
  flat ``train.bin`` / ``val.bin``. ``max_iters`` is chosen from a 20-step calibration run so that the whole
  process (startup, its two evaluations, the cosine schedule run to its end) takes ``--minutes``; the wall
  time reported is the real one. Its final checkpoint (``ckpt.pt``) is then scored by densetrain's own
  evaluator (:func:`densetrain.evals.valloss.evaluate_val`: every source's val windows from offset 0,
  seq_len 256, ``eval.max_batches`` x micro-batch windows per source, token-weighted ``all`` row), the
  windows densetrain's in-loop evaluation scores; nanoGPT's own ``estimate_loss`` (``--eval-iters`` random
  val.bin batches) is printed beside it.
* **densetrain**: the ``tiny`` preset as shipped (its three stages and mixes, lr 4e-3 -> 2e-4 cosine over 1500
  steps with 2% warmup, batch 16 x 256 in micro-batches of 8, bf16 autocast where the CPU has it, checkpoints
  every 250 steps) with ``model.tie_embeddings = true`` for the parameter count of nanoGPT's tied GPT
  (1.79M vs 1.84M + its 33k position table), downstream tasks, samples and position evals off, and the
  validation loss every ``--eval-every`` steps. The run is stopped at the first evaluation whose
  ``val/all/loss`` is at or below nanoGPT's; its wall time is from process start to that evaluation's record
  (setup, compile, checkpoints and the evaluations included; also printed without the evaluations).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_bench import (  # noqa: E402  (benchmarks/ is not a package)
    ROOT,
    SHAPES,
    VOCAB,
    _env,
    _git_commit,
    export_nanogpt_data,
    run_nanogpt,
)


class LoadSampler(threading.Thread):
    """Samples the 1-minute load average every ``every`` seconds while a phase runs."""

    def __init__(self, every: float = 10.0):
        super().__init__(daemon=True)
        self.every, self.samples, self._stop = every, [], threading.Event()

    def run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(self.every)

    def stop(self) -> str:
        self._stop.set()
        s = self.samples or [os.getloadavg()[0]]
        return f"load average (1 min) {min(s):.2f}-{max(s):.2f}, median {statistics.median(s):.2f} ({len(s)} samples)"


def densetrain_overrides(run_dir: Path, shards: Path, threads: int, eval_every: int) -> list:
    return [("model.tie_embeddings", True), ("data.shards_dir", str(shards)), ("train.run_dir", str(run_dir)),
            ("train.threads", threads), ("eval.every", eval_every), ("eval.tasks", ""), ("eval.final_tasks", ""),
            ("eval.samples", 0), ("eval.position_len", 0)]


def score_nanogpt(ckpt: Path, nanogpt: Path, shards: Path, threads: int) -> tuple[dict, int]:
    """densetrain's evaluator on nanoGPT's checkpoint, with the tiny preset's eval settings (seq_len,
    micro-batch, max_batches). Returns (``{source: {...}, 'all': {...}}``, parameter count)."""
    import torch

    from densetrain.config import load_config
    from densetrain.data.streams import open_streams
    from densetrain.evals.valloss import evaluate_val, val_overall

    sys.path.insert(0, str(nanogpt))
    from model import GPT, GPTConfig  # nanoGPT's model.py, imported from the checkout at run time

    torch.set_num_threads(threads)
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    gpt = GPT(GPTConfig(**state["model_args"]))
    gpt.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in state["model"].items()})

    class Logits(torch.nn.Module):
        """(B, T) ids -> (B, T, V) logits: nanoGPT returns every position's logits only when given targets."""

        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, idx):
            idx = idx.contiguous()
            return self.m(idx, targets=idx)[0]

    cfg = load_config(preset="tiny", overrides=[("data.shards_dir", str(shards))])
    val = evaluate_val(Logits(gpt), open_streams(cfg, "val"), cfg.train.seq_len, cfg.train.micro_batch_size,
                       cfg.eval.max_batches, torch.device("cpu"))
    return {**val, "all": val_overall(val)}, sum(p.numel() for p in gpt.parameters())


def _records(path: Path, seen: int) -> tuple[list[dict], int]:
    """Complete JSON lines of ``path`` past byte ``seen``."""
    if not path.exists():
        return [], seen
    with open(path, "rb") as f:
        f.seek(seen)
        data = f.read()
    cut = data.rfind(b"\n") + 1
    return [json.loads(ln) for ln in data[:cut].splitlines() if ln.strip()], seen + cut


def run_densetrain_to(target: float, work: Path, shards: Path, threads: int, eval_every: int) -> dict:
    """Train the tiny recipe until ``val/all/loss <= target`` (or the schedule ends); stop the process there."""
    run_dir = Path(tempfile.mkdtemp(dir=work, prefix="densetrain-")) / "run"
    spec = json.dumps(densetrain_overrides(run_dir, shards, threads, eval_every))
    log = open(run_dir.parent / "log.txt", "w")
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "train_bench.py"), "--worker", spec],
                            cwd=ROOT, env=_env(threads), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    seen, evals, eval_s, hit = 0, [], 0.0, None
    while hit is None:
        done = proc.poll() is not None
        recs, seen = _records(run_dir / "metrics.jsonl", seen)
        for r in recs:
            if r["kind"] == "eval" and "val/all/loss" in r:
                eval_s += r.get("time/eval_s", 0.0)
                evals.append((r["step"], r["val/all/loss"], r["time"] - t0))
                print(f"    densetrain step {r['step']:5d}: val {r['val/all/loss']:.4f} at {r['time'] - t0:6.1f} s "
                      f"(load {os.getloadavg()[0]:.2f})", flush=True)
                if r["val/all/loss"] <= target:
                    hit = {"step": r["step"], "val": r["val/all/loss"], "wall_s": r["time"] - t0, "eval_s": eval_s}
                    break
        if done:
            break
        time.sleep(0.5)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    log.close()
    if hit is None and proc.returncode:
        raise SystemExit(f"densetrain failed (rc {proc.returncode}); log {run_dir.parent / 'log.txt'}:\n"
                         + (run_dir.parent / "log.txt").read_text()[-3000:])
    return {"hit": hit, "evals": evals, "run_dir": run_dir}


def main() -> None:
    if "--nanochat" in sys.argv[1:]:  # the nanochat side-by-side has its own arguments (--help lists them)
        from speedrun_nanochat import main as nanochat_main

        raise SystemExit(nanochat_main(sys.argv[1:]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="--nanochat PATH [...]: the side-by-side of benchmarks/speedrun_nanochat.py")
    ap.add_argument("--nanogpt", type=Path, required=True, help="a checkout of karpathy/nanoGPT (outside this repo)")
    ap.add_argument("--minutes", type=float, default=10.0, help="nanoGPT's wall-time budget")
    ap.add_argument("--eval-every", type=int, default=50, help="densetrain's validation interval (steps)")
    ap.add_argument("--eval-iters", type=int, default=20, help="nanoGPT's own estimate_loss batches")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shards", type=Path, default=ROOT / ".cache/densetrain/shards")
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (default: a new temp dir)")
    a = ap.parse_args()
    if not (a.nanogpt / "train.py").is_file():
        raise SystemExit(f"nanoGPT: ABSENT ({a.nanogpt}/train.py not found). Get it with: "
                         "git clone https://github.com/karpathy/nanoGPT /tmp/nanogpt (outside the repository)")
    if not (a.shards / "manifest.json").exists():
        raise SystemExit(f"{a.shards}: no demo shards; run `densetrain prepare --preset tiny` first")
    import torch

    work = a.work or Path(tempfile.mkdtemp(prefix="speedrun-"))
    work.mkdir(parents=True, exist_ok=True)
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "unknown CPU")
    print(f"nanoGPT: {a.nanogpt} at commit {_git_commit(a.nanogpt)}")
    print(f"machine: {cpu}, {os.cpu_count()} logical CPUs, threads {a.threads}; torch {torch.__version__}; "
          f"load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {time.strftime('%Y-%m-%d %H:%M')}")
    counts = export_nanogpt_data(a.shards, work / "nanogpt_data")
    shape = SHAPES["tiny"]
    print(f"data: {sum(counts['train'].values()):,} train / {sum(counts['val'].values()):,} val tokens, vocab {VOCAB}")

    # 1. calibrate nanoGPT's step time and fixed costs, then size max_iters to the budget
    cal = run_nanogpt(shape, 20, work, a.nanogpt, work / "nanogpt_data", a.threads, 3, a.eval_iters, False)
    fixed = max(0.0, cal.wall_s - 20 * cal.median_s)
    budget = 60.0 * a.minutes
    iters = max(20, int((budget - fixed) / cal.median_s))
    print(f"\n== nanoGPT calibration: {cal.median_s * 1e3:.0f} ms/step, fixed {fixed:.1f} s -> max_iters {iters} "
          f"for {a.minutes:g} min")
    load = LoadSampler()
    load.start()
    before = set(work.glob("nanogpt-*"))
    nano = run_nanogpt(shape, iters, work, a.nanogpt, work / "nanogpt_data", a.threads, 3, a.eval_iters, False)
    nano_load = load.stop()
    scratch = next(iter(set(work.glob("nanogpt-*")) - before))
    table, nano_params = score_nanogpt(scratch / "out" / "ckpt.pt", a.nanogpt, a.shards, a.threads)
    target = table["all"]["loss"]
    print(f"  nanoGPT: {iters} steps x {shape['batch'] * shape['seq_len']} tokens in {nano.wall_s:.1f} s wall "
          f"({nano.median_s * 1e3:.0f} ms/step median), {nano_params:,} parameters (incl. position table); {nano_load}")
    print(f"  nanoGPT val loss: densetrain evaluator {target:.4f} on {table['all']['tokens']:,} tokens ("
          + ", ".join(f"{s} {v['loss']:.3f}" for s, v in table.items() if s != "all")
          + f"); its own estimate_loss ({a.eval_iters} batches) {nano.val_loss:.4f}")

    # 2. densetrain until it reaches that loss
    print(f"\n== densetrain tiny recipe (tied embeddings) until val/all/loss <= {target:.4f}, "
          f"eval every {a.eval_every}")
    load = LoadSampler()
    load.start()
    dt = run_densetrain_to(target, work, a.shards, a.threads, a.eval_every)
    dt_load = load.stop()
    from densetrain.config import load_config
    from densetrain.tools.plan import model_counts

    dt_params = model_counts(load_config(preset="tiny", overrides=[("model.tie_embeddings", True)]).model)["params"]
    print(f"  {dt_load}")
    print("\n== result")
    if dt["hit"] is None:
        last = dt["evals"][-1] if dt["evals"] else (0, float("nan"), float("nan"))
        print(f"  densetrain did NOT reach {target:.4f} within its schedule: last eval step {last[0]} val "
              f"{last[1]:.4f} at {last[2]:.1f} s")
        return
    h = dt["hit"]
    ratio = h["wall_s"] / nano.wall_s
    print(f"  nanoGPT    val {target:.4f} after {nano.wall_s:7.1f} s wall ({iters} steps)")
    print(f"  densetrain val {h['val']:.4f} after {h['wall_s']:7.1f} s wall (step {h['step']}; of which in-loop "
          f"evals {h['eval_s']:.1f} s; {h['wall_s'] - h['eval_s']:.1f} s without them); {dt_params:,} "
          f"parameters")
    print(f"  ratio densetrain / nanoGPT wall time: {ratio:.3f} "
          f"(target <= 0.4: {'met' if ratio <= 0.4 else 'MISSED'}); "
          f"without densetrain's evals {(h['wall_s'] - h['eval_s']) / nano.wall_s:.3f}")
    print(f"scratch: {work}")


if __name__ == "__main__":
    main()
