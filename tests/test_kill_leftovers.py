"""kill -9 at the worst moment of a writer: what is left must be a complete old or new result, and the
next run sweeps the temporary files of the killed process (its PID is dead)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import densetrain.hf.export as hf  # the module whose exchange_paths the export calls
from densetrain.config import ModelConfig
from densetrain.model.llama import Transformer

ROOT = Path(__file__).resolve().parents[1]


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


def test_a_rerun_of_prepare_removes_the_full_size_temp_shard_of_a_killed_one(tmp_path, capsys):
    from conftest import one_source_config

    from densetrain.data.prepare import prepare
    from densetrain.data.shards import write_shard

    cfg = one_source_config(tmp_path, tmp_path / "shards")
    prepare(cfg)
    train = tmp_path / "shards" / "email" / "train"
    tokens = np.fromfile(train / "000000.ds", dtype="<u2")

    def rewrite_and_die_at_the_rename():
        os.replace = lambda a, b: _die()  # the temp file is complete, the rename never comes
        write_shard(train / "000000", [tokens], 2)

    assert killed_child(rewrite_and_die_at_the_rename) == signal.SIGKILL
    (tmp,) = [p for p in train.iterdir() if p.name.startswith(".000000.ds.tmp")]
    assert tmp.stat().st_size == tokens.nbytes
    capsys.readouterr()
    assert prepare(cfg)["sources"]["email"]["status"] == "up-to-date"
    assert "removed 1 temporary files of killed runs" in capsys.readouterr().out
    assert sorted(p.name for p in train.iterdir()) == ["000000.ds", "000000.ds.index", "000000.ds.metadata"]


_POOL_SCRIPT = """
import os, sys, time
from densetrain.data.prepare.process import worker_pool
pool = worker_pool(2)  # what prepare starts for its first source
print(*sorted({pool.submit(os.getpid).result() for _ in range(8)}), flush=True)
time.sleep(120)
"""


def test_killing_prepare_kills_its_worker_processes(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _POOL_SCRIPT], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    workers = [int(p) for p in proc.stdout.readline().split()]
    assert workers and proc.pid not in workers
    proc.kill()  # kill -9: no cleanup of its own runs
    proc.wait()
    deadline = time.time() + 10
    while time.time() < deadline and any(_running(p) for p in workers):
        time.sleep(0.05)
    alive = [p for p in workers if _running(p)]
    for p in alive:  # clean up before failing
        os.kill(p, signal.SIGKILL)
    assert not alive, f"worker processes {alive} outlived the killed prepare"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (dead, not yet reaped by init) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def test_import_hf_killed_before_it_finishes_leaves_no_run_that_blocks_the_rerun(tmp_path, capsys):
    from densetrain.cli import main

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)
    src = hf.export_hf(Transformer(cfg), cfg, tmp_path / "hf")
    run = tmp_path / "run"

    def import_and_die_at_the_last_rename():
        real_replace = os.replace
        # the config and the checkpoint are written (their own renames run); the kill comes at the one
        # rename that would make the run appear at --out
        os.replace = lambda a, b: _die() if Path(b) == run else real_replace(a, b)
        main(["import-hf", str(src), "--out", str(run)])

    assert killed_child(import_and_die_at_the_last_rename) == signal.SIGKILL
    assert not run.exists()
    assert main(["import-hf", str(src), "--out", str(run)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]  # the killed one's folder is gone
    assert (run / "checkpoints" / "step_00000000" / "COMPLETE").is_file()
    assert "imported" in capsys.readouterr().out
