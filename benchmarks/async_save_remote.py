"""The asynchronous checkpoint save overlapping training when ``checkpoint.dir`` is in object storage, against the
same run with its checkpoints on local disk only; side by side in one process, alternating (local, remote,
local, remote, ...), the store a real S3-compatible server (moto's standalone server on localhost,
tests/store_server.py) spoken to through s3fs as a user's S3.

Each run is the real loop (:func:`densetrain.train.train`) of the preset with ``checkpoint.async_save``: the save
blocks the loop only while the state is staged to CPU memory, writes in the background, and (remote) uploads in a
background thread while later steps train. Printed, per kind: the median step time (steps with and without a
save or an upload in flight), the seconds a save blocks the loop, the background write and upload seconds and
the steps they overlapped, all as ratios to the median step time of the local runs; and the remote run's wall
time over the local run's.

    .venv/bin/python benchmarks/async_save_remote.py --preset tiny --steps 40 --every 10 \
        --shards /work/main/.cache/densetrain/shards model.d_model=256
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from store_server import environ_set, free_port, make_bucket, s3_env, start_moto  # noqa: E402

from densetrain import storage  # noqa: E402
from densetrain.config import load_config  # noqa: E402
from densetrain.metrics import read_events, read_metrics  # noqa: E402
from densetrain.train import train  # noqa: E402


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def one_run(args, tmp: Path, name: str, remote: str) -> dict:
    """Train once; return the step times (s), the per-save numbers and the wall time."""
    ov = [("train.run_dir", str(tmp / name)), ("train.steps", args.steps), ("checkpoint.every", args.every),
          ("checkpoint.keep", 2), ("checkpoint.async_save", True), ("checkpoint.dir", remote),
          ("eval.every", 0), ("eval.tasks", ""), ("eval.final_tasks", ""), ("eval.samples", 0),
          ("logging.tensorboard", False), ("watchdog.every", 0), ("probe.every", 0)]
    if args.shards:
        ov.append(("data.shards_dir", args.shards))
    ov += [tuple(o.lstrip("-").split("=", 1)) for o in args.overrides]
    cfg = load_config(args.preset, overrides=ov)
    t0 = time.perf_counter()
    train(cfg)
    wall = time.perf_counter() - t0
    run = tmp / name
    recs = [r for r in read_metrics(run) if r["kind"] == "train"]
    events = read_events(run)
    staged = [e for e in events if e.get("action") == "staged"]
    written = [e["values"] for e in events if e.get("action") == "written"]
    uploads = [e for e in events if e.get("action") == "uploaded"]
    # A save is in flight from its staging to its upload event (remote) or to its completion (local); both events
    # are logged at the poll after the background work ended, so the intervals are a little long, not short.
    ends = [e["time"] for e in events if e.get("action") == ("uploaded" if remote else "written")]
    busy = [(e["time"], min([t for t in ends if t >= e["time"]], default=e["time"])) for e in staged]
    steps = {"busy": [], "quiet": []}
    for r in recs[1:]:  # the first step compiles and warms up
        lo, hi = r["time"] - r["time/step_s"], r["time"]
        steps["busy" if any(a < hi and lo < b for a, b in busy) else "quiet"].append(r["time/step_s"])
    newest = sorted((run / "checkpoints").glob("step_*"))[-1]
    mib = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file()) / (1 << 20)
    return {"mib": mib, "steps": steps, "staged": [e["values"]["seconds"] for e in staged], "written": written,
            "uploads": [e["values"]["upload_seconds"] for e in uploads], "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2, help="pairs of runs (local, remote), alternating")
    ap.add_argument("--shards", default="", help="data.shards_dir (default: the preset's)")
    ap.add_argument("overrides", nargs="*", help="section.key=value")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        port = free_port()
        server = start_moto(port, tmp / "moto.log")
        try:
            environ_set(s3_env(f"http://127.0.0.1:{port}", str(tmp / "cache")))
            storage._fs_cache.clear()
            make_bucket("bench")
            t0 = time.perf_counter()
            for _ in range(50):
                storage.write_bytes("s3://bench/probe", b"x")
            put_ms = (time.perf_counter() - t0) / 50 * 1e3
            res: dict[str, list[dict]] = {"local": [], "remote": []}
            for k in range(args.rounds):
                res["local"].append(one_run(args, tmp, f"local{k}", ""))
                res["remote"].append(one_run(args, tmp, f"remote{k}", f"s3://bench/run{k}/checkpoints"))
        finally:
            server.kill()
            server.wait()
    base = statistics.median(t for r in res["local"] for t in r["steps"]["quiet"])
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    print(f"async save with checkpoint.dir local vs s3:// (moto on localhost, one small PUT {put_ms:.1f} ms); "
          f"preset {args.preset} {' '.join(args.overrides)}, {args.steps} steps, a save every {args.every}, "
          f"{args.rounds} runs each; checkpoint {res['local'][0]['mib']:.0f} MiB; CPU {_cpu()}")
    print(f"  median step of the local runs without a save in flight: {base * 1e3:.1f} ms = 1.00")
    for kind, runs in res.items():
        quiet = [t for r in runs for t in r["steps"]["quiet"]]
        busy = [t for r in runs for t in r["steps"]["busy"]]
        uploads = [x for r in runs for x in r["uploads"]]
        print(f"  {kind:>6}: steps without a save in flight {med(quiet) / base:.2f} (n={len(quiet)}), with one "
              f"(write or upload) {med(busy) / base:.2f} (n={len(busy)}); the save blocks the loop "
              f"{med([x for r in runs for x in r['staged']]) / base:.3f} (staging) + "
              f"{med([w['blocked_seconds'] for r in runs for w in r['written']]) / base:.3f} (completion); "
              f"background write {med([w['write_seconds'] for r in runs for w in r['written']]) / base:.2f}"
              + (f", upload {med(uploads) / base:.2f} ({len(uploads)} uploads)" if uploads else "")
              + f"; wall {med([r['wall'] for r in runs]):.1f} s")
    ratio = med([r["wall"] for r in res["remote"]]) / med([r["wall"] for r in res["local"]])
    print(f"  wall time remote / local: {ratio:.3f}")


if __name__ == "__main__":
    main()
