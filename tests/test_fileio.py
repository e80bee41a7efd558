"""Strict JSON everywhere: every JSON file and printout goes through densetrain.fileio.json_text, which
writes a non-finite float as null (Python's NaN / Infinity are not JSON; browsers, jq and pandas refuse them)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from densetrain.fileio import atomic_write_json, json_text

PKG = Path(__file__).resolve().parents[1] / "densetrain"


def _strict(text: str):
    def refuse(name):
        raise AssertionError(f"not strict JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_are_written_as_null(tmp_path):
    obj = {"loss": math.nan, "grad_norm": math.inf, "nested": [1.5, -math.inf, (math.nan, 2)], "ok": 0.25, "n": 3}
    want = {"loss": None, "grad_norm": None, "nested": [1.5, None, [None, 2]], "ok": 0.25, "n": 3}
    atomic_write_json(tmp_path / "summary.json", obj)
    assert _strict((tmp_path / "summary.json").read_text()) == want
    assert _strict(json_text(obj, indent=1)) == want
    assert math.isnan(obj["loss"])  # the caller's object is left as it was


def test_every_json_writer_uses_the_strict_encoder():
    """No module encodes JSON itself (json.dumps / json.dump allow NaN by default), outside data/
    (the preparation's own files) and the TOML values of --help-config."""
    allowed = {"fileio.py", "config/loading.py"}
    found = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel in allowed or rel.startswith("data/"):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\bjson\.dumps?\(", line):
                found.append(f"{rel}:{i}: {line.strip()}")
    assert not found, "\n".join(found)
