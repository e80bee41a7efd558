"""The inductor cache directory a run gives torch.compile (:func:`densetrain.model.compiling.pin_inductor_cache`):
one per torch version and CPU capability under torch's default, so kernels built under AVX-512 are never
loaded under ATEN_CPU_CAPABILITY=avx2 from a shared /tmp or home; a directory the user set is kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from densetrain.model.compiling import pin_inductor_cache

ROOT = Path(__file__).resolve().parents[1]

# A fresh process under ATEN_CPU_CAPABILITY (ATen reads it once, at start): the directory pinned and the capability.
_PIN = """
import json, torch
from densetrain.model.compiling import pin_inductor_cache
print(json.dumps({"pinned": pin_inductor_cache(), "cap": torch.backends.cpu.get_cpu_capability()}))
"""


def _fresh_at_default_capability(code: str) -> dict:
    """The JSON last printed by ``python -c code`` in a fresh process under ``ATEN_CPU_CAPABILITY=default``
    (ATen reads it once, at start) with ``TORCHINDUCTOR_CACHE_DIR`` unset."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**env, "PYTHONPATH": str(ROOT), "ATEN_CPU_CAPABILITY": "default"})
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_inductor_cache_is_per_cpu_capability_unless_the_user_set_one(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    # This process, as a run starts it (the variable unset; restored afterwards): under torch's own default
    # directory, named by the torch version and the capability ATen runs (before: the default itself,
    # whatever the capability), and inductor compiles into it.
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cap = torch.backends.cpu.get_cpu_capability()
    native = pin_inductor_cache()
    assert native == os.path.join(default_cache_dir(), f"{torch.__version__}-{cap.lower()}") == cache_dir()
    low = _fresh_at_default_capability(_PIN)
    assert low == {"pinned": os.path.join(default_cache_dir(), f"{torch.__version__}-default"), "cap": "DEFAULT"}
    if cap != "DEFAULT":  # every x86-64 CPU with AVX2 or better
        assert native != low["pinned"]
    # torch's own default, as inductor leaves it in the environment after a compile elsewhere, is no choice:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    assert pin_inductor_cache() == native
    # A directory the user chose stands.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert pin_inductor_cache() == str(tmp_path / "mine") == os.environ["TORCHINDUCTOR_CACHE_DIR"]


# The compiled cross-entropy called directly, with no run set up (as an offline eval or a test does): the first
# compile of the process pins the directory itself.
_DIRECT = """
import json, os, torch
from densetrain.train.step import training_token_losses
logits = torch.randn(1, 4, 16).to(torch.bfloat16)
training_token_losses(logits, torch.tensor([[1, 2, 3, 4]]))
print(json.dumps({"dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"), "cap": torch.backends.cpu.get_cpu_capability()}))
"""


def test_a_compile_outside_a_run_pins_the_directory_first():
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    got = _fresh_at_default_capability(_DIRECT)
    assert got == {"dir": os.path.join(default_cache_dir(), f"{torch.__version__}-default"), "cap": "DEFAULT"}
