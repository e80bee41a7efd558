"""How far the golden trajectory (tests/test_golden.py) drifts under other CPU kernels, and how far a small
change of the math moves it: the measurement behind the test's tolerance.

    PYTHONPATH=. .venv/bin/python benchmarks/golden_tolerance.py

Each variant runs the golden config in its own process: other ATen kernel sets (``ATEN_CPU_CAPABILITY=avx2``,
``=default``: what another CPU generation or vendor dispatches to), another thread count, and deliberate math
changes (RMSNorm eps, peak_lr, AdamW eps). Printed: the largest relative difference from the recorded
trajectory in loss and grad_norm over the 24 steps, and how many values fail the test's tolerance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = [  # (name, environment, overrides); the first group is noise, the second must fail
    ("avx2 kernels", {"ATEN_CPU_CAPABILITY": "avx2"}, {}),
    ("default kernels", {"ATEN_CPU_CAPABILITY": "default"}, {}),
    ("2 threads", {"OMP_NUM_THREADS": "2"}, {"train.threads": 2}),
    ("RMSNorm eps 1.1e-5", {}, {"model.norm_eps": 1.1e-5}),
    ("peak_lr +1%", {}, {"optim.peak_lr": 3.03e-3}),
    ("AdamW eps 1.1e-8", {}, {"optim.eps": 1.1e-8}),
]
_RUN = r"""
import json, sys
from pathlib import Path
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
from conftest import small_config
from test_golden import SETTINGS
from densetrain.data.prepare import prepare
from densetrain.metrics import read_metrics
from densetrain.train import train
if __name__ == "__main__":
    tmp, overrides = Path(sys.argv[2]), json.loads(sys.argv[3])
    shards = tmp / "shards"
    if not (shards / "manifest.json").exists():
        prepare(small_config(tmp, shards))
    run = tmp / "variant"
    train(small_config(run, shards, **{**SETTINGS, **overrides}))
    recs = [r for r in read_metrics(run / "run") if r["kind"] == "train"]
    print(json.dumps([{k: r[k] for k in ("step", "loss", "grad_norm", "lr")} for r in recs]))
"""


def main() -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from test_golden import GOLDEN, off_tolerance

    want = json.loads(GOLDEN.read_text())["steps"]
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "run.py"
        script.write_text(_RUN)
        for name, env, overrides in VARIANTS:
            subprocess.run(["rm", "-rf", f"{tmp}/variant"], check=True)
            out = subprocess.run([sys.executable, str(script), str(ROOT), tmp, json.dumps(overrides)],
                                 env={**os.environ, "OMP_NUM_THREADS": "1", **env}, check=True,
                                 capture_output=True, text=True).stdout
            got = json.loads(out.strip().splitlines()[-1])
            rel = {k: max(abs(g[k] - w[k]) / abs(w[k]) for g, w in zip(got, want)) for k in ("loss", "grad_norm")}
            print(f"{name:20s} loss {rel['loss']:.1e}  grad_norm {rel['grad_norm']:.1e}  "
                  f"beyond tolerance: {len(off_tolerance(got, want))}", flush=True)


if __name__ == "__main__":
    main()
