"""Checkpoint writes under real faults: a full disk (a small tmpfs), a read-only file system, and a
kill -9 in the middle of retention. Each must end with a one-line error (or nothing listed that is
half-deleted), the previous checkpoints intact and no temporary directory left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import forked
import pytest
import torch

from densetrain.checkpoint import CheckpointError, list_complete, load_checkpoint, save_checkpoint
from densetrain.config import load_config
from densetrain.model.init import build_model
from densetrain.optim import build_optimizer

ROOT = Path(__file__).resolve().parents[1]


def _model():
    cfg = load_config("tiny", overrides=[("model.vocab_size", 300), ("model.d_model", 32), ("model.n_layers", 2),
                                         ("model.n_heads", 4), ("model.n_kv_heads", 2), ("model.d_ff", 64)])
    model = build_model(cfg.model, cfg.train.seed)
    opt = build_optimizer(model, cfg)
    x = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(0))
    model(x).logsumexp(-1).mean().backward()
    opt.step()
    return cfg, model, opt


def _assert_loads_equal(path: Path, model) -> None:
    cfg, fresh, fresh_opt = _model()
    load_checkpoint(path, fresh, fresh_opt)
    for (n, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert torch.equal(a, b), n


def _leftovers(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir() if not p.name.startswith("step_") or "." in p.name)


@pytest.mark.parametrize("room", ["tiny", "half"])
def test_disk_full_is_one_line_and_keeps_the_previous_checkpoint(tmpfs, room):
    """Full disk, with room for a few files ('tiny': a write fails with ENOSPC) or for half a checkpoint
    ('half': torch's zip writer fails on a short write with only 'inline_container.cc ... unexpected pos')."""
    _, model, opt = _model()
    first = save_checkpoint(tmpfs, 1, model, opt, {"step": 1}, keep=3)
    size = sum(f.stat().st_size for f in first.iterdir())
    # Fill the file system, leaving less than a checkpoint needs.
    with open(tmpfs / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass
    os.truncate(tmpfs / "filler", os.path.getsize(tmpfs / "filler") - (20000 if room == "tiny" else size // 2))
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(tmpfs, 2, model, opt, {"step": 2}, keep=3)
    msg = str(e.value)
    assert "\n" not in msg and "step_00000002.tmp" in msg and f"no space left on {tmpfs}/checkpoints: " in msg, msg
    assert "inline_container" not in msg, msg
    assert [s for s, _ in list_complete(tmpfs)] == [1]
    assert _leftovers(tmpfs) == []
    _assert_loads_equal(list_complete(tmpfs)[0][1], model)


def test_read_only_file_system_is_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    _, model, opt = _model()
    run = tmp_path / "run"
    save_checkpoint(run, 1, model, opt, {"step": 1}, keep=3)
    ckpts = run / "checkpoints"
    remounted = False
    if os.geteuid() == 0:  # root ignores permission bits: make the directory a read-only bind mount
        remounted = subprocess.run(["mount", "--bind", "-o", "ro", str(ckpts), str(ckpts)],
                                   capture_output=True).returncode == 0
        if not remounted:
            pytest.skip("root without mount rights: cannot make a directory read-only for root")
    else:
        ckpts.chmod(0o555)
    try:
        with pytest.raises(CheckpointError) as e:
            save_checkpoint(run, 2, model, opt, {"step": 2}, keep=3)
    finally:
        if remounted:
            subprocess.run(["umount", str(ckpts)], check=True)
        else:
            ckpts.chmod(0o755)
    msg = str(e.value)
    assert "\n" not in msg and ("Read-only file system" in msg or "Permission denied" in msg), msg
    assert [s for s, _ in list_complete(run)] == [1]
    assert _leftovers(run) == []
    _assert_loads_equal(list_complete(run)[0][1], model)


_KILLER = textwrap.dedent("""
    import os, shutil, signal, sys
    sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "tests")]
    from test_checkpoint_faults import _model
    from densetrain.checkpoint import save_checkpoint
    run = sys.argv[2]
    _, model, opt = _model()
    for step in (1, 2):
        save_checkpoint(run, step, model, opt, {"step": step}, keep=2)
    real = shutil.rmtree
    def rmtree_then_die(path, *a, **k):
        # Delete part of the directory (its first file), then die as a kill -9 would.
        if str(path).endswith(".retired") and os.path.isdir(path):
            files = sorted(p for p in os.listdir(path) if os.path.isfile(os.path.join(path, p)))
            os.remove(os.path.join(path, files[0]))
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path, *a, **k)
    shutil.rmtree = rmtree_then_die
    save_checkpoint(run, 3, model, opt, {"step": 3}, keep=2)   # retention of step 1 is killed
""")


def test_kill_during_retention_never_lists_a_half_deleted_checkpoint(tmp_path):
    script = tmp_path / "killer.py"
    script.write_text(_KILLER)
    run = tmp_path / "run"
    r = forked.run([sys.executable, str(script), str(ROOT), str(run)], capture_output=True, text=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == -9, r.stderr[-2000:]
    # Step 1 was being deleted when the process died: it is not listed; 2 and 3 are, and load.
    assert [s for s, _ in list_complete(run)] == [2, 3]
    assert any(p.name.endswith(".retired") for p in (run / "checkpoints").iterdir())
    _, model, _ = _model()
    for _, path in list_complete(run):
        _assert_loads_equal(path, model)
    # The next save sweeps what the killed retention left.
    _, model, opt = _model()
    save_checkpoint(run, 4, model, opt, {"step": 4}, keep=2)
    assert [s for s, _ in list_complete(run)] == [3, 4] and _leftovers(run) == []
