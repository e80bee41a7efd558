"""The package's layering and lint, enforced: import-linter's contracts (pyproject.toml) and ruff.

The contracts forbid every import cycle the engine redesign removed (config <-> data.filters /
evals.tasks / evals.generative, evals.valloss <-> train, evals.generative <-> evals.downstream,
data.prepare <-> data.scale) by forbidding upward imports altogether, and keep the training side
of data/ (and train, evals, parallel, model, ...) out of the preparation pipeline and the demo corpus;
the second and third tests show that one new upward import makes each check fail.
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
    assert "4 kept, 0 broken" in r.stdout


def _with_import(tmp_path: Path, module: str, line: str) -> Path:
    """A copy of the package (and pyproject.toml) with ``line`` appended to ``module`` (a path under densetrain/)."""
    shutil.copytree(ROOT / "densetrain", tmp_path / "densetrain", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    f = tmp_path / "densetrain" / module
    f.write_text(f.read_text() + f"\n{line}  # noqa\n")
    return tmp_path


def test_an_upward_import_breaks_the_contract(tmp_path):
    r = _lint_imports(_with_import(tmp_path, "config/schema.py", "from densetrain.train.state import TrainState"))
    assert r.returncode != 0
    assert "densetrain.config is not allowed to import densetrain.train" in r.stdout


def test_the_training_reader_importing_preparation_breaks_the_contract(tmp_path):
    # data.streams and data.prepare share the layer `densetrain.data`: only the data contract sees this.
    r = _lint_imports(_with_import(tmp_path, "data/streams.py",
                                   "from densetrain.data.prepare.filters.chain import clean_text"))
    assert r.returncode != 0
    assert "Layers import only downward KEPT" in r.stdout
    assert "densetrain.data.streams is not allowed to import densetrain.data.prepare" in r.stdout


def test_ruff_is_clean():
    r = subprocess.run([str(BIN / "ruff"), "check", "densetrain", "tests", "benchmarks"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:]


def test_the_command_line_module_imports_no_torch():
    """Spawned ``densetrain prepare`` workers re-import the console script's module (``densetrain.cli``) as
    their ``__main__``; with torch imported at its top each worker paid ~2.7 CPU-s before its first document
    (17.3 vs 11.9 CPU-s for one prepare run), so the CLI imports torch, the HF export and the trainer only in the
    commands that use them."""
    code = ("import sys, densetrain.cli; heavy = sorted(m for m in ('torch', 'densetrain.hf', 'densetrain.train',"
            " 'pyarrow', 'tokenizers') if m in sys.modules); print(heavy)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", r.stdout
