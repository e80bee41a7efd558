"""What a layout switch at a stage boundary costs (``stages[i].parallel``, ``densetrain.train.setup.switch_layout``):
a real 2-rank gloo run (``python -m densetrain train`` per rank, as torchrun starts them) of a preset's model shape,
pp 2 for its first stage, then cp 2 for its second (seq_len doubled), over two stdlib sources prepared once into
``--work``. Prints, per shape, the switch's seconds (checkpoint written, mesh, model wrappers and optimizer
rebuilt, checkpoint reloaded resharded: the ``switch`` event) next to the median step time on each side and the
run's plain checkpoint writes, side by side in the same run.

    .venv/bin/python benchmarks/layout_switch.py --presets tiny,gpt2-124m
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import sysconfig
from pathlib import Path

from densetrain.config import load_config, save_config
from densetrain.config.validate import model_params
from densetrain.data.prepare import prepare
from densetrain.metrics import read_events, read_metrics

ROOT = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def config(preset: str, work: Path, steps: int):
    """``preset``'s model on the stdlib sources: 8 sequences of 64 tokens per step, pp 2 for the first half, then
    4 of 128 on cp 2; fp32, one thread per rank, tied embeddings off (pipeline stages hold them apart)."""
    over = {
        "data.demo_corpus": False, "data.corpus_dir": str(STDLIB), "data.shards_dir": str(work / "shards"),
        "data.tokenizer": "bpe", "data.tokenizer_vocab_size": 512, "data.val_fraction": 0.1,
        "data.sources": [{"name": "email", "kind": "code", "paths": ["email"], "format": "text"},
                         {"name": "json", "kind": "code", "paths": ["json", "http"], "format": "text"}],
        "stages": [{"name": "main", "start": 0.0},
                   {"name": "long", "start": 0.5, "seq_len": 128, "parallel": {"pp": 1, "cp": 2}}],
        "train.run_dir": str(work / f"run-{preset}"), "train.steps": steps, "train.seq_len": 64,
        "train.batch_size": 8, "train.micro_batch_size": 2, "train.threads": 1, "train.dtype": "fp32",
        "train.device": "cpu", "model.tie_embeddings": False, "schedule.warmup_steps": 1, "parallel.pp": 2,
        "parallel.dp_replicate": 1,
        "checkpoint.every": 0, "checkpoint.keep": 0, "eval.every": 0, "eval.max_batches": 1, "eval.samples": 0,
        "eval.position_buckets": [], "eval.tasks": "", "eval.final_tasks": "", "logging.tensorboard": False,
        "logging.peak_flops": 1e11, "health.every": 0, "watchdog.every": 0, "probe.every": 0,
    }
    return load_config(preset=preset, overrides=list(over.items()))


def run(cfg, work: Path) -> None:
    path = work / f"{Path(cfg.train.run_dir).name}.toml"
    save_config(cfg, path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-m", "densetrain", "train", "--config", str(path)], cwd=ROOT,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    errs = [p.communicate()[1] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"run failed: {errs[0][-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="tiny,gpt2-124m")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--work", default="runs/bench-layout-switch")
    args = ap.parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "shards" / "tokenizer.json").exists():
        prepare(config("tiny", work, args.steps))
    print("| shape | params | switch (s) | of it: checkpoint / rebuild / reload (s) | step before (s) | step after (s) "
          "| final checkpoint write (s) | switch / step after |")
    print("|---|---|---|---|---|---|---|---|")
    for preset in args.presets.split(","):
        cfg = config(preset, work, args.steps)
        run_dir = Path(cfg.train.run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)
        run(cfg, work)
        events = read_events(run_dir)
        (sw,) = [e for e in events if e.get("action") == "switch"]
        saves = [e["values"]["seconds"] for e in events if e["kind"] == "checkpoint" and "seconds" in e["values"]]
        steps = [m for m in read_metrics(run_dir) if m["kind"] == "train"]
        half = args.steps // 2
        before = statistics.median(m["time/step_s"] for m in steps if 1 < m["step"] <= half)
        after = statistics.median(m["time/step_s"] for m in steps if m["step"] > half + 1)
        n = model_params(cfg.model)  # untied: the pipeline holds the embedding and the head apart
        v = sw["values"]
        print(f"| {preset} | {n / 1e6:.1f}M | {v['seconds']:.2f} | {v['checkpoint_s']:.2f} / {v['rebuild_s']:.2f} / "
              f"{v['load_s']:.2f} | {before:.2f} | {after:.2f} | {statistics.median(saves):.2f} | "
              f"{v['seconds'] / after:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
