"""kill -9 at the worst moment of a writer: what is left must be a complete old or new result, and the
next run sweeps the temporary files of the killed process (its PID is dead)."""

from __future__ import annotations

import json
import os
import signal

import pytest

import densetrain.hf as hf
from densetrain.config import ModelConfig
from densetrain.model.llama import Transformer


def killed_child(fn) -> int:
    """Run ``fn()`` in a forked child (torch is already imported: fast) and return the signal that ended
    it (``fn`` SIGKILLs it at its chosen moment); an exception in ``fn`` ends the child with status 1."""
    pid = os.fork()
    if pid == 0:
        try:
            fn()
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status)


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("where, left_at_target", [("before_swap", "old"), ("after_swap", "new"),
                                                   ("between_renames", None)])
def test_export_killed_at_its_swap_leaves_an_export_or_one_the_next_export_restores(tmp_path, where, left_at_target):
    target = tmp_path / "hf"
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)
    model = Transformer(cfg)
    hf.export_hf(model, cfg, target, extra_config={"which": "old"})

    def export_new_and_die_at_the_swap():  # the real renames run; the kill comes just before or after one
        real_exchange, real_replace = hf.exchange_paths, os.replace
        if where == "before_swap":
            hf.exchange_paths = lambda a, b: _die()
        elif where == "after_swap":
            hf.exchange_paths = lambda a, b: (real_exchange(a, b), _die())
        else:  # a file system without RENAME_EXCHANGE: two renames, killed between them
            hf.exchange_paths = lambda a, b: False
            hf.os.replace = lambda a, b: (real_replace(a, b), _die())
        hf.export_hf(model, cfg, target, extra_config={"which": "new"})

    assert killed_child(export_new_and_die_at_the_swap) == signal.SIGKILL
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name != "hf")
    assert leftovers and all(n.startswith(".hf.") for n in leftovers), leftovers
    if left_at_target:  # one atomic exchange: the target is always a whole export
        assert json.loads((target / "config.json").read_text())["which"] == left_at_target
        assert (target / "model.safetensors").is_file()
    else:  # killed between the fallback's two renames: the target is missing until the next export
        assert not target.exists()
    hf.check_export_target(target)  # what `densetrain export` runs first: restore and sweep
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert json.loads((target / "config.json").read_text())["which"] == (left_at_target or "old")
    assert (target / "model.safetensors").is_file()
