"""Run directories read from any directory (densetrain/config/paths.py) and an imported model evaluated on the
shards of the run it was exported from (densetrain/data/streams.py, the tokenizer compared by content)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import tomllib
from pathlib import Path

import pytest

from densetrain.cli import main
from densetrain.config import absolute_paths, load_config, save_config
from densetrain.metrics import read_metrics
from densetrain.train import train

QUIET = {"train.steps": 3, "checkpoint.every": 2, "checkpoint.keep": 0, "eval.every": 0, "logging.tensorboard": False,
         "stages": [{"name": "main", "start": 0.0}], "watchdog.every": 0, "probe.every": 0}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def started_in_a(prepared, tmp_path_factory):
    """(start dir A, absolute run dir, the config as given in A: shards_dir and run_dir relative to A)."""
    shards, make = prepared
    a = tmp_path_factory.mktemp("start_a")
    old = os.getcwd()
    os.chdir(a)
    try:
        cfg = make(a, **QUIET, **{"train.run_dir": "runs/r", "data.shards_dir": os.path.relpath(shards, a)})
        train(cfg)
    finally:
        os.chdir(old)
    return a, a / "runs" / "r", cfg


def _elsewhere(tmp_path: Path, monkeypatch) -> Path:
    """A current directory B deeper than A, so that no path relative to A names the same file from B."""
    b = tmp_path / "deeper" / "b"
    b.mkdir(parents=True)
    monkeypatch.chdir(b)
    return b


def _one_line(capsys, argv: list[str]) -> str:
    rc, err = main(argv), capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("densetrain: error: "), (rc, err)
    return err


def test_a_run_writes_its_paths_absolute_and_is_read_from_another_directory(started_in_a, tmp_path, monkeypatch,
                                                                            capsys):
    a, run, cfg = started_in_a
    saved = tomllib.loads((run / "config.toml").read_text())
    assert saved["data"]["shards_dir"] == os.path.normpath(a / cfg.data.shards_dir)
    assert saved["train"]["run_dir"] == str(run)
    assert saved["data"]["corpus_dir"] == cfg.data.corpus_dir  # already absolute: unchanged
    assert saved["data"]["tokenizer"] == "bpe"  # a name, not a path
    b = _elsewhere(tmp_path, monkeypatch)  # neither the shards' relative path nor runs/r exists from here
    assert not (b / cfg.data.shards_dir).exists()
    assert main(["eval", str(run)]) == 0
    assert "val" in capsys.readouterr().out
    assert main(["export", str(run), "--format", "hf", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (Path(saved["data"]["shards_dir"])
                                                                / "tokenizer.json").read_bytes()
    assert main(["replay", str(run), "3", "--json"]) == 0
    out = capsys.readouterr().out
    res = json.loads(out[out.rindex("\n{") + 1:] if "\n{" in out else out)
    assert res["step"] == 3 and res["replayed"]["loss"] == pytest.approx(res["logged"]["loss"], rel=1e-3)


def test_an_older_run_with_relative_paths(started_in_a, tmp_path, monkeypatch, capsys):
    """A config.toml as older versions wrote it (paths relative to the start directory A): read from B through
    the start directory its train.run_dir gives (eval, and a --resume that saves them absolute); moved elsewhere,
    one line names the key and the directory tried."""
    a, run, given = started_in_a
    cfg = copy.deepcopy(given)
    old = a / "runs" / "old"
    shutil.copytree(run, old, ignore=shutil.ignore_patterns(".lock"))
    cfg.train.run_dir = "runs/old"
    save_config(cfg, old / "config.toml")  # as given: relative
    assert tomllib.loads((old / "config.toml").read_text())["data"]["shards_dir"] == cfg.data.shards_dir
    moved = tmp_path / "elsewhere" / "old"
    shutil.copytree(old, moved)
    b = _elsewhere(tmp_path, monkeypatch)
    assert main(["eval", str(old)]) == 0
    err = capsys.readouterr().err
    assert "keeps data.shards_dir, train.run_dir relative to the directory the run was started in" in err
    assert f"read from {a}" in err
    assert main(["train", "--resume", str(old), "--train.steps=4"]) == 0
    assert f"{old}/config.toml keeps data.shards_dir, train.run_dir relative" in capsys.readouterr().err
    saved = tomllib.loads((old / "config.toml").read_text())
    assert (saved["data"]["shards_dir"], saved["train"]["run_dir"]) == (os.path.normpath(a / cfg.data.shards_dir),
                                                                         str(old))
    assert max(r["step"] for r in read_metrics(old) if r.get("kind") == "train") == 4
    for argv in (["eval", str(moved)], ["blame", str(moved), "3"], ["replay", str(moved), "3"]):
        err = _one_line(capsys, argv)
        assert (f"{moved}/config.toml: data.shards_dir = '{cfg.data.shards_dir}' is relative to the directory the run "
                f"was started in") in err and f"not found from {b}" in err, err
        assert "run `densetrain prepare`" not in err


def test_an_imported_model_evaluates_on_the_shards_of_its_tokenizer(started_in_a, tmp_path, monkeypatch, capsys):
    a, run, cfg = started_in_a
    hf = tmp_path / "hf"
    monkeypatch.chdir(a)
    assert main(["export", str(run), "--format", "hf", str(hf)]) == 0
    given, data = tmp_path / "given.toml", load_config(path=run / "config.toml")  # the run's shards, made with 'bpe'
    data.data.shards_dir = os.path.abspath(data.data.shards_dir)
    save_config(data, given)
    monkeypatch.chdir(tmp_path)
    assert main(["import-hf", str(hf), "--out", "runs/from-hf", "--config", str(given)]) == 0
    imported = tmp_path / "runs" / "from-hf"
    saved = tomllib.loads((imported / "config.toml").read_text())
    assert saved["data"]["tokenizer"] == str(imported / "tokenizer.json") and saved["train"]["run_dir"] == str(imported)
    capsys.readouterr()
    assert main(["eval", "runs/from-hf"]) == 0  # the shards' manifest says 'bpe': the same tokenizer.json content
    assert "val" in capsys.readouterr().out
    # Another tokenizer (two ids swapped: same size, other content) is still refused, in one line.
    tok = json.loads((imported / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    x, y = sorted(vocab)[300:302]
    vocab[x], vocab[y] = vocab[y], vocab[x]
    (imported / "tokenizer.json").write_text(json.dumps(tok))
    err = _one_line(capsys, ["eval", "runs/from-hf"])
    assert "shards were tokenized with tokenizer sha256" in err and f"data.tokenizer='{imported}/tokenizer.json'" in err


def test_absolute_paths_leaves_names_urls_and_home_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpt2").mkdir()  # a folder named like a tokenizer stays a name
    (tmp_path / "toks").mkdir()
    (tmp_path / "toks" / "r.tiktoken").write_text("x")
    cfg = load_config(preset="tiny", overrides=[("checkpoint.dir", "s3://bucket/ck"), ("eval.ladder", "lad"),
                                                ("data.corpus_dir", "~/corpus")])
    for spec, want in (("bpe", "bpe"), ("gpt2", "gpt2"), ("tiktoken:cl100k_base", "tiktoken:cl100k_base"),
                       ("gpt2:toks/r.tiktoken", f"gpt2:{tmp_path}/toks/r.tiktoken"),
                       ("toks/r.tiktoken", f"{tmp_path}/toks/r.tiktoken"), ("~/t.json", "~/t.json")):
        cfg.data.tokenizer = spec
        got = absolute_paths(cfg)
        assert got.data.tokenizer == want, spec
    assert (got.checkpoint.dir, got.eval.ladder, got.data.corpus_dir, got.data.shards_dir, got.train.run_dir) == (
        "s3://bucket/ck", f"{tmp_path}/lad", "~/corpus", f"{tmp_path}/.cache/densetrain/shards",
        f"{tmp_path}/runs/demo")
    assert cfg.data.shards_dir == ".cache/densetrain/shards"  # a copy: the config given is unchanged
