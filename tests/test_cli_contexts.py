"""Every flag acts or is refused in its context (issue 44 item 8): ``train --world-size 2`` or ``--rank 1``
without ``--dry-run`` trained one process with exit 0. One row per flag of ``tools.contexts.FLAG_CONTEXTS``: the
refusal is one line naming the flag and its value, before any work (no run directory is made)."""

from __future__ import annotations

import pytest

from densetrain.cli import main
from densetrain.tools.contexts import FLAG_CONTEXTS

CASES = [  # (argv after the command's own path arguments, the line's start after 'densetrain: error: ')
    (["train", "--world-size", "2"], "--world-size 2: acts only with --dry-run"),
    (["train", "--rank", "1"], "--rank 1: acts only with --dry-run"),
    (["train", "--ranks", "0,1"], "--ranks 0,1: acts only with --dry-run"),
    (["train", "--gpu-memory-gib", "40"], "--gpu-memory-gib 40.0: acts only with --dry-run"),
    (["train", "--dry-run", "--world-size", "4", "--rank", "1", "--ranks", "0,2"],
     "--rank 1: given with --ranks, which would replace it"),
    (["train", "--dry-run", "--stop-after", "3"], "--stop-after 3: a dry run takes no step"),
    (["train", "--dry-run", "--resume", "RUN", "--rollback-to", "2"], "--rollback-to 2: a dry run rolls nothing back"),
    (["train", "--dry-run", "--resume", "RUN", "--rollback-to", "2", "--skip-batches", "1"],
     "--rollback-to 2: a dry run rolls nothing back"),
    (["train", "--dry-run", "--skip-batches", "1"], "--skip-batches 1: a dry run reads no data"),
    (["train", "--resume", "RUN", "--smoke"], "--smoke: a smoke run is a new run"),
    (["eval", "RUN", "--limit", "5"], "--limit 5: the examples per downstream task, so it acts only with --tasks"),
    (["prepare", "--force", "--verify"], "--verify: hashes the shards of up-to-date sources"),
]


def test_the_table_covers_every_rule():
    assert {(c, f) for c, f, *_ in FLAG_CONTEXTS} == {(a[0], line.split(":")[0].split()[0]) for a, line in CASES}


@pytest.mark.parametrize("argv,line", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_a_flag_outside_its_context_is_refused_in_one_line(argv, line, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the tiny preset's run and data directories would be relative to here
    run = tmp_path / "run"
    run.mkdir()
    argv = [str(run) if a == "RUN" else a for a in argv]
    assert main(argv + [f"--train.run_dir={tmp_path / 'new'}", f"--data.shards_dir={tmp_path / 'shards'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"densetrain: error: {line}"), err
    assert f"(see densetrain {argv[0]} --help)" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"] and not any(run.iterdir())  # nothing written
