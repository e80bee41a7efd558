"""Side by side with nanochat on CPU, at equal CPU-seconds, on the same FineWeb documents; scored in bits per
byte on the same held-out UTF-8 text (``benchmarks/speedrun.py --nanochat PATH`` calls :func:`main`).

    .venv/bin/python benchmarks/speedrun.py --nanochat /work/nanochat --cpu-seconds 300

* **Data**: the parquet files of ``--fineweb`` (FineWeb sample-10BT documents) in name order; the last
  ``--val-files`` are held out. nanochat reads them as its shards (the training files symlinked, the held-out
  documents written as the last shard, which is its val split), its base dir set by ``NANOCHAT_BASE_DIR``;
  densetrain reads the training files as one Parquet source (no filters, no dedup: the same documents).
* **Tokenizers**: each its own, trained on the training files with vocabulary ``--vocab`` (nanochat's
  ``scripts.tok_train --vocab-size``; densetrain's byte-level BPE of ``densetrain prepare``).
* **nanochat**: ``scripts.base_train`` of the checkout as its CPU recipe runs it (``runs/runcpu.sh``: head dim
  64, full-context windows, seq 512; its Muon + AdamW, warmdown, torch.compile), at ``--depth`` with
  ``--batch-tokens`` per step, in its Python (``--nanochat-python``, default ``PATH/.venv/bin/python``). Its lr
  warmup is min(40, steps / 10) steps, densetrain's rule (its default 40 would fill most of a short run).
* **densetrain**: the same depth, width (64 x depth), head dim, seq_len, vocabulary and tokens per step, one
  stage; each of ``--variants`` (``name:fraction`` of the budget).
* **Budget**: each run gets ``--cpu-seconds`` x its fraction of CPU time (user + sys of its process tree, read
  with ``os.wait4``: the measure that a shared, loaded machine disturbs least). Step counts come from one short
  calibration run per side (CPU-seconds of the fixed start-up and per step, from ``/proc`` at each logged step).
  Every run compiles from a cold inductor cache of its own (nanochat compiles its model, densetrain its loss),
  unless ``--inductor-cache DIR`` gives all runs one warm cache (the second run of a shape: no compile cost).
* **Score**: :mod:`bpb_stream` on the held-out documents (the first ``--score-bytes``), each model with its
  own tokenizer, fp32; nanochat's checkpoint is loaded by its own code in its own interpreter.

Prints tokens/s (per CPU-second and per wall second), parameters, bpb, and for the first variant the
CPU-seconds at which its checkpoints (every fifth of the run) first reach nanochat's final bpb.
Exits 0 with a ``SKIPPED:`` line when the FineWeb sample or the nanochat checkout is absent.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from bpb_stream import bpb, stream_nats  # noqa: E402  (benchmarks/ is not a package)

_SAMPLE = Path("shared") / "data" / "fineweb_sample"
DEFAULT_FINEWEB = next((p / _SAMPLE for p in ROOT.parents if (p / _SAMPLE).is_dir()), ROOT.parent / _SAMPLE)
"""The repository's ``../shared/data/fineweb_sample`` (the nearest such folder above it)."""
STEP_LINE = re.compile(r"^\s*step\s+(\d+)/")

VARIANTS = {
    # AdamW for everything: densetrain's default optimizer.
    "adamw": {"optim.name": "adamw", "optim.peak_lr": 3e-3, "optim.min_lr": 1.5e-4},
    # Muon for the hidden matrices (lr 0.02, nanochat's matrix_lr), AdamW at 3e-3 for embeddings/head/norms.
    "muon": {"optim.name": "muon", "optim.muon_lr": 0.02, "optim.peak_lr": 3e-3, "optim.min_lr": 1.5e-4},
    # ... plus nanochat's QK-norm and logit soft-capping at 15.
    "muon_qk": {"optim.name": "muon", "optim.muon_lr": 0.02, "optim.peak_lr": 3e-3, "optim.min_lr": 1.5e-4,
                "model.qk_norm": True, "model.logit_softcap": 15.0},
}
"""densetrain settings compared (``--variants name:fraction,...``); the shape and data are shared."""

_NANOCHAT_SCORE = r"""
import json, os, sys
nanochat, here, docs_file, depth = sys.argv[1:]
sys.path[:0] = [nanochat, here]
import torch
from bpb_stream import stream_nats
from nanochat.checkpoint_manager import load_model
torch.set_num_threads(1)
model, tok, meta = load_model("base", torch.device("cpu"), phase="eval", model_tag=f"d{depth}")
docs = [json.loads(ln) for ln in open(docs_file)]
ids = []
for d in docs:
    ids += [tok.get_bos_token_id()] + tok.encode(d)
def loss_sum(x, y):
    return model(x, targets=y, loss_reduction="none").float().sum()
nats, n = stream_nats(loss_sum, ids, int(meta["model_config"]["sequence_len"]))
params = sum(p.numel() for p in model.parameters())
print("RESULT " + json.dumps({"nats": nats, "targets": n, "tokens": len(ids), "params": params,
                              "step": meta["step"]}))
"""


def tree_cpu(pid: int) -> float:
    """CPU-seconds (user + sys) so far of process ``pid``, its waited-for children and its live descendants."""
    tick = os.sysconf("SC_CLK_TCK")
    stats, parent = {}, {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            raw = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        f = raw[raw.rfind(")") + 2:].split()
        parent[int(d)] = int(f[1])
        stats[int(d)] = sum(int(x) for x in f[11:15]) / tick  # utime stime cutime cstime
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, 0.0)
        todo += [c for c, pp in parent.items() if pp == p]
    return total


def measured(cmd: list[str], env: dict, cwd: Path, log: Path, cache: Path | None = None) -> dict:
    """Run ``cmd`` to its end; return ``{'cpu_s', 'wall_s', 'stamps': [(step, cpu_s), ...]}`` where the total is
    the child's rusage from ``os.wait4`` (user + sys of it and every descendant it waited for) and a stamp is
    the process tree's CPU time when the child printed a ``step N/`` line. ``cache``: the inductor cache to
    use (default a fresh one per run). Raises SystemExit on failure."""
    t0 = time.perf_counter()
    stamps = []
    # A fresh inductor cache per run: every torch.compile (nanochat's model, densetrain's loss) starts cold,
    # as on a first run, and no run reuses another's kernels.
    env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(cache or log.parent / f"{log.stem}_inductor")}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            out.write(line)
            out.flush()
            m = STEP_LINE.match(line)
            if m:
                stamps.append((int(m.group(1)), tree_cpu(proc.pid)))
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"failed (rc {proc.returncode}): {' '.join(cmd)}\n{log.read_text()[-3000:]}")
    cpu = usage.ru_utime + usage.ru_stime
    return {"cpu_s": max(cpu, stamps[-1][1] if stamps else 0.0), "wall_s": time.perf_counter() - t0,
            "stamps": stamps}


def steps_for(cal: dict, cal_steps: int, budget: float) -> tuple[int, float, float]:
    """(steps that fit ``budget`` CPU-seconds, fixed CPU-s, CPU-s per step) from a calibration run: per step is
    the median gap between consecutive step stamps after the first, fixed is the rest of its total."""
    st = [c for _, c in cal["stamps"]]
    gaps = sorted(b - a for a, b in zip(st[1:], st[2:])) or [cal["cpu_s"] / cal_steps]
    per = max(gaps[len(gaps) // 2], 1e-3)
    fixed = max(0.0, cal["cpu_s"] - per * cal_steps)
    return max(10, int((budget - fixed) / per)), fixed, per


def parquet_texts(files: list[Path]) -> list[str]:
    import pyarrow.parquet as pq

    return [t for f in files for t in pq.read_table(f, columns=["text"]).column("text").to_pylist()]


def place_nanochat_data(train: list[Path], val: list[Path], base: Path) -> None:
    """nanochat's data dir: training files as ``shard_00000..`` (symlinks), the held-out files as one last shard."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = base / "base_data_climbmix"
    data.mkdir(parents=True, exist_ok=True)
    for i, f in enumerate(train):
        link = data / f"shard_{i:05d}.parquet"
        if not link.exists():
            link.symlink_to(f.resolve())
    pq.write_table(pa.table({"text": parquet_texts(val)}), data / f"shard_{len(train):05d}.parquet")


def densetrain_config(work: Path, train: list[Path], a: argparse.Namespace, steps: int, name: str, extra: dict):
    from densetrain.config import load_config

    d = 64 * a.depth
    ov = {
        "data.demo_corpus": False, "data.corpus_dir": str(work), "data.shards_dir": str(work / "dt_shards"),
        "data.tokenizer": "bpe", "data.tokenizer_vocab_size": a.vocab, "data.val_fraction": 0.005,
        "data.decontam.enabled": False,
        "data.sources": [{"name": "fineweb", "kind": "web", "paths": [str(f) for f in train], "format": "parquet",
                          "filters": ["none"], "dedup": False}],
        "stages": [{"name": "main", "start": 0.0}],
        "model.vocab_size": a.vocab, "model.d_model": d, "model.n_layers": a.depth, "model.n_heads": d // 64,
        "model.n_kv_heads": d // 64, "model.d_ff": 3 * d, "model.tie_embeddings": False,
        "train.run_dir": str(work / f"dt_{name}"), "train.steps": steps, "train.seq_len": 512,
        "train.batch_size": a.batch_tokens // 512, "train.micro_batch_size": min(8, a.batch_tokens // 512),
        "train.threads": a.threads,
        "schedule.kind": "wsd", "schedule.decay_fraction": 0.5, "schedule.warmup_steps": max(1, min(40, steps // 10)),
        "checkpoint.every": max(1, steps // 5), "checkpoint.keep": 0, "logging.every": 1, "logging.tensorboard": False,
        "eval.every": 0, "eval.tasks": "", "eval.final_tasks": "", "eval.samples": 0, "eval.position_len": 0,
        "eval.max_batches": 1,
        **extra,
    }
    return load_config(preset="tiny", overrides=list(ov.items()))


def score_densetrain(cfg, ckpt: Path, docs: list[str]) -> dict:
    import torch
    import torch.nn.functional as F

    from densetrain.checkpoint import load_checkpoint
    from densetrain.data.tokenizer import Tokenizer
    from densetrain.model.init import build_model

    torch.set_num_threads(1)
    model = build_model(cfg.model, cfg.train.seed)
    load_checkpoint(ckpt, model, None)
    model.eval()
    tok = Tokenizer.from_file(Path(cfg.data.shards_dir) / "tokenizer.json")
    ids = [tok.eos_id]
    for d in docs:
        ids += tok.encode(d) + [tok.eos_id]

    def loss_sum(x, y):
        return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten(), reduction="sum")

    nats, n = stream_nats(loss_sum, ids, cfg.train.seq_len)
    return {"nats": nats, "targets": n, "tokens": len(ids), "params": sum(p.numel() for p in model.parameters())}


def _parallel(jobs: dict) -> dict:
    """Run ``{name: callable}`` in threads (each starts its own process); return ``{name: result}``."""
    out, errors = {}, []

    def go(k, f):
        try:
            out[k] = f()
        except BaseException as e:  # noqa: BLE001  (reported below, after every job ended)
            errors.append(f"{k}: {e}")

    threads = [threading.Thread(target=go, args=kv) for kv in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit("\n".join(errors))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nanochat", type=Path, required=True, help="a checkout of karpathy/nanochat (outside this repo)")
    ap.add_argument("--nanochat-python", type=Path, help="its interpreter (default PATH/.venv/bin/python)")
    ap.add_argument("--fineweb", type=Path, default=DEFAULT_FINEWEB, help="folder of FineWeb parquet files")
    ap.add_argument("--val-files", type=int, default=2, help="last parquet files held out (default %(default)s)")
    ap.add_argument("--cpu-seconds", type=float, default=300.0, help="CPU budget of a full run (default %(default)s)")
    ap.add_argument("--variants", default="muon:1.0,adamw:1.0,muon_qk:1.0",
                    help=f"densetrain runs, name:fraction of the budget; names {sorted(VARIANTS)}")
    ap.add_argument("--depth", type=int, default=4, help="layers; width 64 x depth, head dim 64 (default 4)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch-tokens", type=int, default=8192, help="tokens per optimizer step (default 8192)")
    ap.add_argument("--calib-steps", type=int, default=6)
    ap.add_argument("--steps", type=int, nargs=2, metavar=("NANOCHAT", "DENSETRAIN"),
                    help="step counts of a full-budget run from an earlier calibration (skips calibrating)")
    ap.add_argument("--score-bytes", type=int, default=200_000,
                    help="score the held-out documents in order up to this many UTF-8 bytes (default %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="threads per run (default 1; runs go in parallel)")
    ap.add_argument("--work", type=Path, help="scratch directory (default: a new temp dir)")
    ap.add_argument("--inductor-cache", type=Path, help="one torch.compile cache for every run (default: a cold "
                    "one per run)")
    a = ap.parse_args(argv)

    files = sorted(a.fineweb.glob("*.parquet")) if a.fineweb.is_dir() else []
    if len(files) <= a.val_files:
        print(f"SKIPPED: no FineWeb sample ({a.fineweb} has {len(files)} parquet files, need > {a.val_files})")
        return 0
    py = a.nanochat_python or a.nanochat / ".venv" / "bin" / "python"
    if not (a.nanochat / "scripts" / "base_train.py").is_file() or not py.exists():
        print(f"SKIPPED: nanochat checkout or its Python absent ({a.nanochat}/scripts/base_train.py, {py}); "
              "check it out outside this repository and make a Python 3.11 venv at PATH/.venv with CPU torch")
        return 0
    variants = [(v.split(":")[0], float(v.split(":")[1])) for v in a.variants.split(",")]
    unknown = [n for n, _ in variants if n not in VARIANTS]
    if unknown:
        print(f"speedrun: error: unknown variant(s) {unknown}; known: {sorted(VARIANTS)}", file=sys.stderr)
        return 2
    import torch

    from densetrain.config import save_config

    work = (a.work or Path(tempfile.mkdtemp(prefix="speedrun-nanochat-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    train, val = files[:-a.val_files], files[-a.val_files:]
    held = parquet_texts(val)
    docs, nbytes = [], 0
    for doc in held:  # whole documents, in file order, up to --score-bytes
        if docs and nbytes + len(doc.encode("utf-8")) > a.score_bytes:
            break
        docs.append(doc)
        nbytes += len(doc.encode("utf-8"))
    (work / "heldout.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    commit = subprocess.run(["git", "-C", str(a.nanochat), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "unknown CPU")
    print(f"{time.strftime('%Y-%m-%d %H:%M')}; {cpu}, {os.cpu_count()} logical CPUs; load "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; torch {torch.__version__}; nanochat {commit}")
    print(f"data: {len(train)} training files, {len(val)} held out ({len(held)} documents; scored: the first "
          f"{len(docs)}, {nbytes:,} UTF-8 bytes)")

    base = work / "nanochat_base"
    nenv = dict(os.environ, NANOCHAT_BASE_DIR=str(base), OMP_NUM_THREADS=str(a.threads), OMP_WAIT_POLICY="PASSIVE",
                PYTHONUNBUFFERED="1",
                PYTHONPATH=str(a.nanochat))
    denv = dict(os.environ, OMP_NUM_THREADS=str(a.threads), OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=str(ROOT),
                PYTHONUNBUFFERED="1")
    place_nanochat_data(train, val, base)
    prep_cfg = densetrain_config(work, train, a, 10, "prep", {})
    save_config(prep_cfg, work / "prep.toml")
    prep = _parallel({
        "nanochat": lambda: measured([str(py), "-m", "scripts.tok_train", f"--vocab-size={a.vocab}"], nenv,
                                     a.nanochat, work / "nanochat_tok.log"),
        "densetrain": lambda: measured([sys.executable, "-m", "densetrain", "prepare", "--config",
                                        str(work / "prep.toml")], denv, ROOT, work / "densetrain_prep.log"),
    })
    print(f"tokenizers + data preparation (not in the budget): nanochat {prep['nanochat']['cpu_s']:.0f} CPU-s, "
          f"densetrain {prep['densetrain']['cpu_s']:.0f} CPU-s")

    d = 64 * a.depth
    nano_cmd = [str(py), "-m", "scripts.base_train", "--device-type=cpu", f"--depth={a.depth}", "--head-dim=64",
                "--window-pattern=L", "--max-seq-len=512", f"--device-batch-size={a.batch_tokens // 512}",
                f"--total-batch-size={a.batch_tokens}", "--eval-every=-1", "--core-metric-every=-1",
                "--sample-every=-1"]

    def dt_run(name: str, steps: int, tag: str) -> dict:
        extra = {**VARIANTS[name], **({"checkpoint.every": 0} if tag == "calib" else {})}  # calib: no mid-run saves
        cfg = densetrain_config(work, train, a, steps, tag, extra)
        save_config(cfg, work / f"{tag}.toml")
        r = measured([sys.executable, "-m", "densetrain", "train", "--config", str(work / f"{tag}.toml")], denv,
                     ROOT, work / f"{tag}.log", a.inductor_cache)
        return {**r, "cfg": cfg, "steps": steps}

    # 1. calibration: CPU-seconds of the fixed start-up and of a step, per side
    if a.steps:
        plan = {"nanochat": (a.steps[0], 0.0, a.cpu_seconds / a.steps[0]),
                "densetrain": (a.steps[1], 0.0, a.cpu_seconds / a.steps[1])}
        print(f"steps given: nanochat {a.steps[0]}, densetrain {a.steps[1]} for {a.cpu_seconds:g} CPU-s")
    else:
        n = a.calib_steps
        cal = _parallel({
            "nanochat": lambda: measured(nano_cmd + [f"--num-iterations={n}", "--model-tag=calib"], nenv,
                                         a.nanochat, work / "nanochat_calib.log", a.inductor_cache),
            "densetrain": lambda: dt_run(variants[0][0], n, "calib"),
        })
        plan = {k: steps_for(cal[k], n, a.cpu_seconds) for k in cal}
        for k, (steps, fixed, per) in plan.items():
            print(f"calibration {k}: fixed {fixed:.1f} CPU-s, {per:.2f} CPU-s/step -> {steps} steps for "
                  f"{a.cpu_seconds:g} CPU-s", flush=True)

    # 2. the runs, in parallel (each its own CPU time)
    fixed, per = plan["densetrain"][1:]
    nano_steps = plan["nanochat"][0]
    # Its warmup (40 steps by default, sized for thousands of steps) follows densetrain's rule for short runs.
    jobs = {"nanochat": lambda: measured(nano_cmd + [f"--num-iterations={nano_steps}",
                                                     f"--warmup-steps={max(1, min(40, nano_steps // 10))}"],
                                         nenv, a.nanochat, work / "nanochat_train.log", a.inductor_cache)}
    for name, frac in variants:
        tag = f"{name}_{frac:g}"
        jobs[tag] = (lambda name=name, frac=frac, tag=tag:
                     dt_run(name, max(10, int((frac * a.cpu_seconds - fixed) / per)), tag))
    res = _parallel(jobs)
    (work / "runs.json").write_text(json.dumps({k: {x: v[x] for x in ("cpu_s", "wall_s", "stamps")}
                                                for k, v in res.items()}, indent=1))
    print("runs: " + ", ".join(f"{k} {v['cpu_s']:.0f} CPU-s" for k, v in res.items()), flush=True)

    # 3. scores on the held-out documents, in parallel: nanochat's in its interpreter, densetrain's in threads
    def score_nanochat() -> dict:
        out = subprocess.run([str(py), "-c", _NANOCHAT_SCORE, str(a.nanochat), str(HERE), str(work / "heldout.jsonl"),
                              str(a.depth)], env=nenv, capture_output=True, text=True)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"scoring nanochat failed:\n{out.stderr[-3000:]}")
        return json.loads(line[7:])

    first_tag = f"{variants[0][0]}_{variants[0][1]:g}"
    jobs, ckpts = {"nanochat": score_nanochat}, {}
    for name, frac in variants:
        tag = f"{name}_{frac:g}"
        ckpts[tag] = sorted((Path(res[tag]["cfg"].train.run_dir) / "checkpoints").glob("step_*"))
        for c in ckpts[tag] if tag == first_tag else ckpts[tag][-1:]:
            jobs[f"{tag}/{c.name}"] = lambda cfg=res[tag]["cfg"], c=c: score_densetrain(cfg, c, docs)
    scores = _parallel(jobs)
    nano_bpb = bpb(scores["nanochat"]["nats"], nbytes)
    rows = [("nanochat", res["nanochat"], plan["nanochat"][0], scores["nanochat"]["params"], nano_bpb)]
    curve = []
    for name, frac in variants:
        tag = f"{name}_{frac:g}"
        r = res[tag]
        last = scores[f"{tag}/{ckpts[tag][-1].name}"]
        rows.append((f"densetrain {name} ({frac:g}x)", r, r["steps"], last["params"], bpb(last["nats"], nbytes)))
        if tag == first_tag:
            stamps = dict(r["stamps"])
            for c in ckpts[tag][:-1]:
                step = int(c.name.split("_")[1])
                curve.append((step, stamps.get(step, float("nan")), bpb(scores[f"{tag}/{c.name}"]["nats"], nbytes)))
            curve.append((r["steps"], r["cpu_s"], rows[-1][4]))

    print(f"\n== result: depth {a.depth}, d_model {d}, head dim 64, seq 512, vocab {a.vocab}, {a.batch_tokens} "
          f"tokens/step; held-out {len(docs)} documents, {nbytes:,} bytes")
    print(f"{'run':<26} {'steps':>6} {'CPU-s':>7} {'wall s':>7} {'tok/CPU-s':>10} {'tok/s':>7} {'params':>11} "
          f"{'bpb':>7}")
    table = []
    for label, r, steps, params, b in rows:
        toks = steps * a.batch_tokens
        print(f"{label:<26} {steps:>6} {r['cpu_s']:>7.0f} {r['wall_s']:>7.0f} {toks / r['cpu_s']:>10.0f} "
              f"{toks / r['wall_s']:>7.0f} {params:>11,} {b:>7.4f}")
        table.append({"run": label, "steps": steps, "cpu_s": r["cpu_s"], "wall_s": r["wall_s"], "params": params,
                      "bpb": b, "tokens": toks})
    print(f"{first_tag} checkpoints (step, CPU-s, bpb): "
          + ", ".join(f"({s}, {c:.0f}, {b:.4f})" for s, c, b in curve))
    reach = next(((s, c, b) for s, c, b in curve if b <= nano_bpb), None)
    nano_cpu = res["nanochat"]["cpu_s"]
    if reach:
        print(f"{first_tag} reaches nanochat's final bpb {nano_bpb:.4f} by step {reach[0]}: {reach[1]:.0f} CPU-s = "
              f"{reach[1] / nano_cpu:.2f}x nanochat's {nano_cpu:.0f} CPU-s (a checkpoint mid-schedule: an upper bound)")
    else:
        print(f"{first_tag} does not reach nanochat's final bpb {nano_bpb:.4f} within its run")
    (work / "result.json").write_text(json.dumps({"table": table, "curve": curve, "nanochat_bpb": nano_bpb},
                                                 indent=1))
    print(f"load at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}; scratch {work}")
    return 0
