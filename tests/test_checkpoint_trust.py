"""The checkpoint trust rule: reading a checkpoint never runs code that a file in it holds.

A ``.metadata`` crafted to run a command when unpickled, and a payload entry whose pickle does the same,
are refused with one line naming the file by every command that reads checkpoints (``train --resume``,
``eval``, ``export``, ``blame``), through the real CLI entry point; the command's marker file never
appears. A missing or garbage ``.metadata`` is one line too, without DCP's tracebacks."""

from __future__ import annotations

import io
import logging
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import forge_marker
from torch.distributed.checkpoint.state_dict import get_state_dict

from densetrain.checkpoint import list_complete, load_checkpoint
from densetrain.cli import main
from densetrain.dcp_read import _ALLOWED, _MetadataUnpickler, read_metadata
from densetrain.model.init import build_model
from densetrain.optim import build_optimizer
from densetrain.train import train


class _RunsCode:
    """Unpickling this runs ``touch MARKER`` (pickle stores os.system and its argument, not this class)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def honest_run(prepared, tmp_path_factory):
    """A run stopped after step 3 of 4 with checkpoints of steps 2 and 3, and its config."""
    _, make = prepared
    tmp = tmp_path_factory.mktemp("trust")
    cfg = make(tmp, **{"train.steps": 4, "checkpoint.every": 2, "eval.every": 0, "logging.tensorboard": False,
                       "stages": [{"name": "main", "start": 0.0}]})
    train(cfg, stop_after=3)
    return tmp / "run", cfg


def _copy(honest_run, tmp_path) -> tuple[Path, list[Path]]:
    """A copy of the run and its checkpoints, oldest first (the crafted files go into each: resume, eval and
    export read the newest, blame of step 3 the one of step 2)."""
    run = tmp_path / "run"
    shutil.copytree(honest_run[0], run)
    return run, [p for _, p in list_complete(run)]


def _craft_metadata(ckpt: Path, marker: Path) -> Path:
    (ckpt / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    forge_marker(ckpt)
    return ckpt / ".metadata"


def _craft_payload(ckpt: Path, cfg, marker: Path) -> None:
    """Re-save the honest checkpoint with the embedding replaced by a code-running object (an honest
    ``.metadata`` that lists it as a non-tensor entry, as DCP writes one for any Python object)."""
    model = build_model(cfg.model, cfg.train.seed, torch.device("cpu"))
    opt = build_optimizer(model, cfg)
    load_checkpoint(ckpt, model, opt)
    model_sd, optim_sd = get_state_dict(model, opt)
    model_sd["tok_embeddings.weight"] = _RunsCode(marker)
    for f in ckpt.glob("*.distcp"):
        f.unlink()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed.*|Detected an existing checkpoint")
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(ckpt))
    forge_marker(ckpt)


def _commands(run: Path, ckpt: Path, out: Path) -> dict[str, list[str]]:
    return {"train --resume": ["train", "--resume", str(run)], "eval": ["eval", str(ckpt)],
            "export": ["export", str(ckpt), "--format", "hf", str(out)], "blame": ["blame", str(run), "3"]}


def _one_line_error(capsys, argv: list[str], caplog=None) -> str:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("densetrain: error: "), err
    if caplog is not None:  # DCP logs its tracebacks (warnings with exc_info) through logging, not print
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text[:2000]
        caplog.clear()
    return err


def test_metadata_that_runs_code_is_refused_by_every_command(honest_run, tmp_path, capsys):
    run, ckpts = _copy(honest_run, tmp_path)
    marker = tmp_path / "pwned"
    first, newest = (_craft_metadata(c, marker) for c in ckpts)
    for name, argv in _commands(run, ckpts[-1], tmp_path / "hf").items():
        err = _one_line_error(capsys, argv)
        meta = first if name == "blame" else newest
        assert f"{meta}: refused: it would build posix.system" in err, (name, err)
        assert not marker.exists(), name
    assert not (tmp_path / "hf").exists()


def test_payload_entry_that_runs_code_is_refused(honest_run, tmp_path, capsys):
    run, ckpts = _copy(honest_run, tmp_path)
    marker, ckpt = tmp_path / "pwned", ckpts[-1]
    for c in ckpts:
        _craft_payload(c, honest_run[1], marker)
    cmds = _commands(run, ckpt, tmp_path / "hf")
    for name in ("train --resume", "eval"):
        err = _one_line_error(capsys, cmds[name])
        assert f"{ckpt}/__0_0.distcp: refused entry model.tok_embeddings.weight: not plain data" in err, (name, err)
        assert "posix.system" in err and not marker.exists(), name
    # export reads tensors only, by the metadata: the embedding is not one, so it is a mismatch, not a load.
    err = _one_line_error(capsys, cmds["export"])
    assert f"{ckpt}: the checkpoint's model tensors do not match" in err and "tok_embeddings.weight" in err, err
    # blame reads the sampler state from trainer_state.json (JSON) and no payload: it works, nothing runs.
    assert main(cmds["blame"]) == 0
    assert "step 3 (stage main)" in capsys.readouterr().out
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["missing", "garbage"])
def test_missing_or_garbage_metadata_is_one_line_everywhere(honest_run, tmp_path, capsys, caplog, damage):
    run, ckpts = _copy(honest_run, tmp_path)
    for c in ckpts:
        meta = c / ".metadata"
        meta.unlink() if damage == "missing" else meta.write_bytes(b"\x80\x04garbage, not a pickle")
        forge_marker(c)
    for name in ("eval", "export"):
        err = _one_line_error(capsys, _commands(run, ckpts[-1], tmp_path / "hf")[name], caplog)
        assert f"{meta}: " in err and ("missing" in err if damage == "missing" else "not DCP metadata" in err), err
    # resume: no checkpoint loads, so it says so in one line for each, without DCP's tracebacks before.
    err = _one_line_error(capsys, ["train", "--resume", str(run)], caplog)
    assert "no checkpoint could be loaded" in err and str(meta) in err, err


def test_honest_metadata_uses_only_the_allowed_types(honest_run):
    """Every global in a real .metadata is on the allow-list, and the restricted unpickler reads it like
    pickle does (so the list is neither too short for DCP nor wider than needed)."""
    ckpt = list_complete(honest_run[0])[-1][1]
    data = (ckpt / ".metadata").read_bytes()
    seen = []

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            seen.append((module, name))
            return super().find_class(module, name)

    plain = Recording(io.BytesIO(data)).load()
    assert {g for g in seen if g[0] != "torch" or g[1] == "Size"} <= _ALLOWED
    assert {g for g in seen if g[0] == "torch" and g[1] != "Size"} == {("torch", "float32")}  # the dtypes
    ours = _MetadataUnpickler(io.BytesIO(data)).load()
    assert ours.state_dict_metadata == plain.state_dict_metadata and ours.storage_data == plain.storage_data
    assert read_metadata(ckpt).state_dict_metadata.keys() == plain.state_dict_metadata.keys()
