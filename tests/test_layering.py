"""The package's layering and lint, enforced: import-linter's contracts (pyproject.toml) and ruff.

The contracts forbid every import cycle the engine redesign removed (config <-> data.filters /
evals.tasks / evals.generative, evals.valloss <-> train, evals.generative <-> evals.downstream,
data.prepare <-> data.scale) by forbidding upward imports altogether; the second test shows that
one new upward import makes the check fail.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "lint-imports"), "--no-cache"], cwd=cwd, capture_output=True, text=True,
                          env={"PYTHONPATH": str(cwd), "PATH": str(BIN)})


def test_import_contracts_are_kept():
    r = _lint_imports(ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "2 kept, 0 broken" in r.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / "densetrain", tmp_path / "densetrain", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    schema = tmp_path / "densetrain" / "config" / "schema.py"
    schema.write_text(schema.read_text() + "\nfrom densetrain.train.state import TrainState  # noqa\n")
    r = _lint_imports(tmp_path)
    assert r.returncode != 0
    assert "densetrain.config is not allowed to import densetrain.train" in r.stdout


def test_ruff_is_clean():
    r = subprocess.run([str(BIN / "ruff"), "check", "densetrain", "tests", "benchmarks"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:]
