"""A command writes only into a directory that is new, empty or of its own kind (issue 44 item 9): a
``.densetrain-kind`` file names what a directory holds (run, shards, ladder), and a directory made before it
is recognised by its files. ``--train.resume=auto --train.run_dir=SHARDS_DIR`` started "a new run" inside the
shards; ``ladder --out RUN_DIR`` wrote a ladder plan into a training run."""

from __future__ import annotations

import shutil

from densetrain.cli import main
from densetrain.config import save_config
from densetrain.fileio import KIND_FILE


def _snapshot(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def _one_line(capsys, argv) -> str:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("densetrain: error: "), err
    return err


def test_each_command_refuses_a_directory_of_another_kind(prepared, stopped_run, tmp_path, capsys):
    shards, make = prepared
    assert (shards / KIND_FILE).read_text() == "shards\n" and (stopped_run[0] / KIND_FILE).read_text() == "run\n"
    config = tmp_path / "c.toml"
    save_config(make(tmp_path), config)
    sh, run = tmp_path / "shards", tmp_path / "run"
    shutil.copytree(shards, sh)
    shutil.copytree(stopped_run[0], run)
    for unmarked in (False, True):  # by the marker; then as a directory made before markers, by its files
        if unmarked:
            (sh / KIND_FILE).unlink()
            (run / KIND_FILE).unlink()
        why_sh = "it holds manifest.json" if unmarked else f"its {KIND_FILE} says so"
        why_run = "it holds config.toml" if unmarked else f"its {KIND_FILE} says so"
        before = _snapshot(sh), _snapshot(run)
        err = _one_line(capsys, ["train", "--config", str(config), "--train.resume=auto", f"--train.run_dir={sh}"])
        assert err.startswith(f"densetrain: error: {sh}: holds prepared shards ({why_sh}), not a training run; "
                              "train.run_dir takes a new or empty directory, or one of a training run"), err
        err = _one_line(capsys, ["ladder", "--sizes", "32", "--budgets", "2.5e9", "--out", str(run),
                                 "--print-commands"])
        assert err.startswith(f"densetrain: error: {run}: holds a training run ({why_run}), not a scaling ladder; "
                              "ladder --out takes"), err
        err = _one_line(capsys, ["prepare", "--config", str(config), f"--data.shards_dir={run}"])
        assert err.startswith(f"densetrain: error: {run}: holds a training run ({why_run}), not prepared shards"), err
        assert (_snapshot(sh), _snapshot(run)) == before  # nothing written into either
    # A run directory from before the marker keeps working (recognised by its files) and gets the marker.
    assert main(["train", "--resume", str(run)]) == 0
    assert (run / KIND_FILE).read_text() == "run\n"
    # A ladder directory is marked as one (and a re-run into it is accepted).
    for _ in range(2):
        assert main(["ladder", "--sizes", "32", "--budgets", "2.5e9", "--out", str(tmp_path / "L"),
                     "--print-commands", "--config", str(config)]) == 0
    assert (tmp_path / "L" / KIND_FILE).read_text() == "ladder\n"


def test_run_dir_that_is_a_file_or_a_runs_checkpoints_is_refused(prepared, stopped_run, tmp_path, capsys):
    """Review of issue 44 item 9: ``train.run_dir`` at another run's ``checkpoints/`` trained and wrote
    config.toml beside its step dirs; at a regular file it printed ``[Errno 17] File exists``."""
    _, make = prepared
    config = tmp_path / "c.toml"
    save_config(make(tmp_path), config)
    run = tmp_path / "run"
    shutil.copytree(stopped_run[0], run)
    ckpts = run / "checkpoints"
    step = sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_"))[0]
    before = _snapshot(run)
    err = _one_line(capsys, ["train", "--config", str(config), f"--train.run_dir={ckpts}"])
    assert err == (f"densetrain: error: train.run_dir: {ckpts} holds checkpoint step directories ({step}): "
                   "a training run's checkpoints, not a training run; train.run_dir takes a new or empty "
                   "directory, or one of a training run\n"), err
    # An empty folder inside a run (no step dirs yet) is refused as lying inside the run.
    err = _one_line(capsys, ["train", "--config", str(config), f"--train.run_dir={run / 'sub'}"])
    assert err.startswith(f"densetrain: error: train.run_dir: {run / 'sub'} is inside a training run at {run} "
                          f"(its {KIND_FILE} says so), not a training run;"), err
    assert _snapshot(run) == before
    afile = tmp_path / "x.toml"
    afile.write_text("a = 1\n")
    err = _one_line(capsys, ["train", "--config", str(config), f"--train.run_dir={afile}"])
    assert err == (f"densetrain: error: train.run_dir: {afile} is a regular file, not a directory; train.run_dir "
                   "takes a new or empty directory, or one of a training run\n"), err
    assert afile.read_text() == "a = 1\n"
