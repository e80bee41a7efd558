"""Bad input on the command line, as a hostile user gives it: each is one line ``densetrain: error: ...``
naming the file or key and what was expected, exit status 2, and nothing left behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from densetrain.cli import main
from densetrain.config import ModelConfig, load_config, save_config
from densetrain.hf import export_hf
from densetrain.model.llama import Transformer


def _run(capsys, *argv: str) -> str:
    """stderr of ``densetrain argv`` run in this process, checked to be one error line with exit 2."""
    rc = main(list(argv))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("densetrain: error: "), (rc, err)
    return err


@pytest.fixture
def hf_dir(tmp_path) -> Path:
    """A real (untrained) Llama export: config.json + model.safetensors."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)
    torch.manual_seed(0)
    return export_hf(Transformer(cfg), cfg, tmp_path / "hf")


def test_config_that_is_a_directory_or_not_text_is_one_line(tmp_path, capsys):
    err = _run(capsys, "train", "--config", str(tmp_path))
    assert f"{tmp_path}: is a directory" in err and "TOML file" in err
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe[train]\n")
    assert "bin.toml: not UTF-8" in _run(capsys, "train", "--config", str(tmp_path / "bin.toml"))


def _edit(path: Path, change) -> None:
    conf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(change(conf)))


@pytest.mark.parametrize("change, expected", [
    (lambda c: {**c, "model_type": "gpt2"}, "model_type is 'gpt2', expected 'llama'"),
    (lambda c: {k: v for k, v in c.items() if k != "num_hidden_layers"}, "missing key 'num_hidden_layers'"),
    (lambda c: [c], "expected a JSON object"),
    (lambda c: {**c, "hidden_size": "32"}, "hidden_size must be a positive integer, got '32'"),
    (lambda c: {**c, "rms_norm_eps": "tiny"}, "rms_norm_eps must be a number"),
    (lambda c: {**c, "num_attention_heads": 2, "num_key_value_heads": 3}, "must be divisible by model.n_kv_heads"),
    (lambda c: {**c, "rope_parameters": "abc"}, "rope_parameters / rope_scaling must be an object"),
])
def test_import_hf_of_a_config_json_that_is_not_a_llama_one(hf_dir, tmp_path, capsys, change, expected):
    _edit(hf_dir, change)
    err = _run(capsys, "import-hf", str(hf_dir), "--out", str(tmp_path / "run"))
    assert f"{hf_dir / 'config.json'}: " in err and expected in err, err
    assert not (tmp_path / "run").exists()


def test_import_hf_of_invalid_json_names_line_and_column(hf_dir, tmp_path, capsys):
    (hf_dir / "config.json").write_text('{"model_type": "llama",\n  "vocab_size": 64,,\n}')
    err = _run(capsys, "import-hf", str(hf_dir), "--out", str(tmp_path / "run"))
    assert "config.json: invalid JSON at line 2 column 20" in err, err


def test_import_hf_of_tensors_that_do_not_fit_the_config(hf_dir, tmp_path, capsys):
    out = str(tmp_path / "run")
    weights = hf_dir / "model.safetensors"
    good = load_file(str(weights))
    _edit(hf_dir, lambda c: {**c, "intermediate_size": 48})  # config.json says d_ff 48, the tensors have 64
    err = _run(capsys, "import-hf", str(hf_dir), "--out", out)
    assert "model.safetensors: tensor 'model.layers.0.mlp." in err and "has shape [" in err and "implies" in err, err
    _edit(hf_dir, lambda c: {**c, "intermediate_size": 64})
    save_file({**good, "../x": torch.zeros(2)}, str(weights))
    err = _run(capsys, "import-hf", str(hf_dir), "--out", out)
    assert "model.safetensors: unexpected tensor '../x'" in err, err
    weights.write_bytes(weights.read_bytes()[:500])  # truncated download
    assert "model.safetensors: not a readable safetensors file" in _run(capsys, "import-hf", str(hf_dir), "--out", out)
    assert not Path(out).exists()
    save_file(good, str(weights))
    assert main(["import-hf", str(hf_dir), "--out", out]) == 0  # the same folder, repaired, imports


@pytest.mark.parametrize("argv", [["eval", "{}"], ["export", "{}", "{}/../hf"], ["blame", "{}", "3"],
                                  ["replay", "{}", "3"], ["report", "{}"], ["import-hf", "{}", "--out", "{}/../r"]])
def test_a_directory_argument_that_does_not_exist_names_it_and_what_was_expected(tmp_path, capsys, argv):
    missing = tmp_path / "no-such-run"
    err = _run(capsys, *[a.format(missing) for a in argv])
    assert err.startswith(f"densetrain: error: {missing}: no such directory; densetrain {argv[0]} expects a "), err
    assert ("checkpoint" if argv[0] in ("eval", "export") else "config.json" if argv[0] == "import-hf"
            else "run directory") in err, err


def test_a_directory_that_is_not_what_the_command_reads_says_what_was_expected(tmp_path, capsys):
    err = _run(capsys, "eval", str(tmp_path))
    assert f"{tmp_path}: no complete checkpoint" in err and "expected a run directory with checkpoints" in err, err
    for argv, needs in ((["blame", str(tmp_path), "3"], "config.toml"), (["report", str(tmp_path)], "metrics.jsonl"),
                        (["import-hf", str(tmp_path), "--out", str(tmp_path / "r")], "config.json")):
        err = _run(capsys, *argv)
        assert err.startswith(f"densetrain: error: {tmp_path}: no {needs} here; densetrain {argv[0]} expects "), err


def _argparse_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("densetrain: error: "), (argv, err)
    return err


def test_argparse_errors_are_one_line_for_the_command_and_every_subcommand(capsys):
    from densetrain.cli import build_parser

    assert _argparse_error(capsys, ["bogus"]).endswith("(see densetrain --help)\n")
    for name, sub in build_parser().commands.items():
        # An option that takes a value, given without one; and a positional of the wrong type where it has one.
        opt = next(a.option_strings[0] for a in sub._actions if a.option_strings and a.nargs is None
                   and a.const is None and not isinstance(a.default, bool) and a.dest != "help")
        err = _argparse_error(capsys, [name, opt])
        assert "expected one argument" in err and err.endswith(f"(see densetrain {name} --help)\n"), (name, err)
    assert "argument step: invalid int value: 'x'" in _argparse_error(capsys, ["blame", "runs/demo", "x"])


def test_skip_batches_must_be_a_count_used_with_rollback(tmp_path, capsys):
    save_config(load_config(preset="tiny"), tmp_path / "config.toml")
    for extra in (["--rollback-to", "2", "--skip-batches", "-3"], ["--skip-batches", "3"]):
        err = _run(capsys, "train", "--resume", str(tmp_path), *extra)
        assert "--skip-batches" in err and ">= 0" in err and "--rollback-to" in err, err


def test_eval_limit_below_zero_and_an_export_below_a_file(tmp_path, capsys):
    assert "--limit -1: expected a number of examples per task >= 0" in _run(capsys, "eval", str(tmp_path),
                                                                              "--limit", "-1")
    from densetrain.errors import DataError
    from densetrain.hf import check_export_target

    (tmp_path / "afile").write_text("x")
    with pytest.raises(DataError, match=r"afile is a file, not a directory"):
        check_export_target(tmp_path / "afile" / "hf")


def test_an_unwritable_run_dir_is_one_line(prepared, tmp_path, capsys):
    """Found by a new user: a run dir below a file (NotADirectoryError) was an 18-line traceback."""
    from densetrain.cli import main
    from densetrain.config import save_config

    (tmp_path / "afile").write_text("x")
    _, make = prepared
    save_config(make(tmp_path, **{"train.run_dir": str(tmp_path / "afile" / "run")}), tmp_path / "c.toml")
    assert main(["train", "--config", str(tmp_path / "c.toml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("densetrain: error: ") and "Not a directory" in err[0], err
