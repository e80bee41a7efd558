"""Every writer on a real full disk (a 2 MiB tmpfs filled up): one line "no space left on <path>",
exit status 2 from the command line, what was there before intact, nothing half-written left, and a
re-run works once space is free again."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from densetrain.cli import main
from densetrain.config import ModelConfig
from densetrain.errors import DataError
from densetrain.hf import export_hf
from densetrain.model.llama import Transformer


def fill(mnt: Path, leave: int = 20000) -> Path:
    """Fill the file system of ``mnt`` up to ``leave`` free bytes with one file (returned; delete it to
    free the space)."""
    filler = mnt / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    os.truncate(filler, max(os.path.getsize(filler) - leave, 0))
    return filler


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _model(vocab_size: int = 256) -> tuple[Transformer, ModelConfig]:
    cfg = ModelConfig(vocab_size=vocab_size, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)
    torch.manual_seed(0)
    return Transformer(cfg), cfg


def test_export_on_a_full_disk_keeps_the_previous_export_and_leaves_no_temp(tmpfs):
    model, cfg = _model()
    target = export_hf(model, cfg, tmpfs / "hf")
    before = _tree(target)
    filler = fill(tmpfs)
    with torch.no_grad():
        model.norm.weight.add_(1.0)
    with pytest.raises(DataError) as e:
        export_hf(model, cfg, target)
    assert str(e.value).startswith(f"no space left on {target}: ") and "\n" not in str(e.value), e.value
    assert sorted(p.name for p in tmpfs.iterdir()) == ["filler", "hf"]  # no .hf.tmp-PID
    assert _tree(target) == before
    filler.unlink()
    export_hf(model, cfg, target)  # space again: the re-run writes the new weights
    assert torch.equal(load_file(str(target / "model.safetensors"))["model.norm.weight"], model.norm.weight)
    assert sorted(p.name for p in tmpfs.iterdir()) == ["hf"]


def test_import_hf_on_a_full_disk_leaves_no_run_that_blocks_a_rerun(tmpfs, tmp_path, capsys):
    model, cfg = _model()
    src = export_hf(model, cfg, tmp_path / "hf")
    filler = fill(tmpfs)
    run = tmpfs / "run"
    assert main(["import-hf", str(src), "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"densetrain: error: no space left on {run}: ") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmpfs.iterdir()) == ["filler"]
    filler.unlink()
    assert main(["import-hf", str(src), "--out", str(run)]) == 0
    assert (run / "config.toml").is_file() and (run / "checkpoints" / "step_00000000" / "COMPLETE").is_file()


def test_prepare_on_a_full_disk_is_one_line_and_leaves_no_temp_or_shard(tmpfs, tmp_path, capsys):
    from conftest import one_source_config

    from densetrain.config import save_config

    shards = tmpfs / "shards"
    save_config(one_source_config(tmp_path, shards), tmp_path / "cfg.toml")
    filler = fill(tmpfs, leave=150_000)  # the email source's train shard alone is ~290 kB
    assert main(["prepare", "--config", str(tmp_path / "cfg.toml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"densetrain: error: no space left on {shards / 'email'}: ") and err.count("\n") == 1, err
    left = [p for p in shards.rglob("*") if p.is_file()]
    assert not [p for p in left if ".tmp" in p.name or p.name.endswith((".ds", ".ds.index", ".json"))], left
    filler.unlink()
    assert main(["prepare", "--config", str(tmp_path / "cfg.toml")]) == 0
    assert json.loads((shards / "email" / "manifest.json").read_text())["splits"]["train"]["tokens"] > 100_000


def test_a_writer_without_its_own_handling_is_still_one_line(prepared, tmpfs, tmp_path, capsys):
    """train writes its config.toml (then metrics, checkpoints) into the run directory: on a full disk
    the command line says so in one line naming the file (cli.main's fallback for any full-disk OSError)."""
    from densetrain.config import save_config

    _, make = prepared
    save_config(make(tmp_path, **{"train.run_dir": str(tmpfs / "run")}), tmp_path / "cfg.toml")
    fill(tmpfs, leave=3000)
    assert main(["train", "--config", str(tmp_path / "cfg.toml")]) == 2
    err = capsys.readouterr().err
    assert err == f"densetrain: error: no space left on {tmpfs / 'run' / 'config.toml'} (No space left on device)\n"
    assert not [p for p in (tmpfs / "run").iterdir() if ".tmp" in p.name]
