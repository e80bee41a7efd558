"""Every ladder file and flag read back through the bounded, checked readers (densetrain.law.files): a bad value in
ladder.jsonl, ladder.json, a point's summary.json or fit.json, a bad --samples or budget, is one line naming the
file, line and key (issue 44, item 11); plan --ladder never prints NaN or an absurd prediction; ladder report --run
of a run trained without the ladder says so. No training: the points are generated from a known law."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from densetrain.cli import main
from densetrain.config import load_config
from densetrain.fileio import atomic_write_json, json_text
from densetrain.law import Law
from densetrain.tools.ladder.fit import fit_ladder
from densetrain.tools.ladder.grid import N_KEY, param_counts, scaled_model
from densetrain.tools.ladder.launcher import open_ladder

LAW = Law(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)  # Chinchilla's (Hoffmann et al. 2022, eq. 10)
SIZES, BUDGETS = [32, 64, 128], [1e12, 4e12, 1.6e13]


def point(cfg, p, noise: float) -> dict:
    """The record densetrain.tools.ladder.launcher.point_record keeps, its loss from LAW times ``1 + noise``."""
    counts = param_counts(scaled_model(cfg, p.d_model))
    d = p.budget / (6 * counts[N_KEY])
    loss = float(LAW.loss(counts[N_KEY], d)) * (1 + noise)
    return {"name": p.name, "d_model": p.d_model, "n_layers": 1, "budget": p.budget, "steps": p.steps,
            "branch_from": p.branch_from, **counts, "tokens": d, "val": {"all": {"loss": loss, "bpb": loss / 2.5}},
            "downstream": {}, "curve": [], "run_dir": ""}


@pytest.fixture(scope="module")
def ladder(tmp_path_factory) -> Path:
    """A 3 sizes x 3 budgets ladder directory of the tiny preset, every point recorded, fitted."""
    out = tmp_path_factory.mktemp("inputs") / "L"
    cfg, grid = open_ladder(out, load_config(preset="tiny"), SIZES, BUDGETS)
    noise = np.random.default_rng(0).normal(0, 0.003, len(grid.points))  # seed noise: distinct bootstrap refits
    (out / "ladder.jsonl").write_text("".join(json_text(point(cfg, p, e)) + "\n" for p, e in zip(grid.points, noise)))
    fit_ladder(out, samples=14)
    return out


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def set_record(key: str, value: str, line: int = 2):
    """A change of ladder.jsonl: record ``line``'s ``key`` (dotted) set to the JSON text ``value``."""
    def change(d: Path):
        text = (d / "ladder.jsonl").read_text().splitlines()
        rec = json.loads(text[line - 1])
        *path, last = key.split(".")
        target = rec
        for k in path:
            target = target[k]
        if value == "DELETE":
            del target[last]
        else:
            target[last] = "@@"
        text[line - 1] = json.dumps(rec).replace('"@@"', value)
        (d / "ladder.jsonl").write_text("\n".join(text) + "\n")
    return change


def duplicate_first(d: Path):
    text = (d / "ladder.jsonl").read_text()
    (d / "ladder.jsonl").write_text(text + text.splitlines()[0] + "\n")


def write(name: str, text: str):
    return lambda d: (d / name).write_text(text)


def run_elsewhere(d: Path):
    """Point d32_c0's record dropped and its run's summary.json damaged: `ladder fit` collects it from there."""
    text = (d / "ladder.jsonl").read_text().splitlines()
    (d / "ladder.jsonl").write_text("\n".join(t for t in text if '"d32_c0"' not in t) + "\n")
    (d / "runs" / "d32_c0").mkdir(parents=True)
    (d / "runs" / "d32_c0" / "summary.json").write_text('{"steps": 148, "tokens": ')


def fit_edit(**law):
    """fit.json with approach 3's law changed (``bootstrap=[]``: no refits)."""
    def change(d: Path):
        fit = json.loads((d / "fit.json").read_text())
        if "bootstrap" in law:
            fit["approach3"]["bootstrap"] = law["bootstrap"]
        fit["approach3"]["law"].update({k: v for k, v in law.items() if k != "bootstrap"})
        atomic_write_json(d / "fit.json", fit)
    return change


FIT = ["ladder", "fit", "{L}", "--samples", "20"]
PLAN = ["plan", "--preset", "tiny", "--ladder", "{L}"]
# (id, change to the ladder directory, command, expected status, what the one error line (or the output) says)
ROWS = [
    ("nan loss", set_record("val.all.loss", "NaN"), FIT, 2, ["ladder.jsonl:2", "'val.all.loss'", "got NaN"]),
    ("infinite loss", set_record("val.all.loss", "Infinity"), FIT, 2, ["ladder.jsonl:2", "got Infinity"]),
    ("string loss", set_record("val.all.loss", '"2.5"'), FIT, 2, ["ladder.jsonl:2", "'val.all.loss'", "'2.5'"]),
    ("negative tokens", set_record("tokens", "-5", line=3), FIT, 2, ["ladder.jsonl:3", "'tokens'", "got -5"]),
    ("no val", set_record("val", "DELETE"), FIT, 2, ["ladder.jsonl:2", "key 'val' missing"]),
    ("nan in a curve", set_record("curve", '[{"s1": 1.0, "s2": 0, "loss": {"all": NaN}}]'), FIT, 2,
     ["ladder.jsonl:2", "'curve[0].loss.all'"]),
    ("duplicate point", duplicate_first, FIT, 2, ["ladder.jsonl:10", "'d32_c0' recorded twice", "line 1"]),
    ("ladder.json not JSON", write("ladder.json", "{"), FIT, 2, ["ladder.json: not JSON"]),
    ("ladder.json budgets", write("ladder.json", '{"sizes": [32], "budgets": ["1e12"]}'), FIT, 2,
     ["ladder.json", "'budgets[0]'"]),
    ("summary.json not JSON", run_elsewhere, FIT, 2, ["d32_c0/summary.json: not JSON"]),
    ("samples 0", None, FIT[:-1] + ["0"], "usage", ["expected 20 to 10000 bootstrap resamples, got 0"]),
    ("samples -5", None, FIT[:-1] + ["-5"], "usage", ["got -5"]),
    ("samples 1e9", None, FIT[:-1] + ["1000000000"], "usage", ["got 1000000000"]),
    ("budget 1e30", None, ["ladder", "--preset", "tiny", "--sizes", "32", "--budgets", "1e30", "--out", "{L}/x",
                           "--print-commands"], 2, ["budget 1e+30 FLOPs; expected at most 1e+27"]),
    ("fit.json not JSON (plan)", write("fit.json", "[1, 2"), PLAN, 2, ["fit.json: not JSON"]),
    ("fit.json not JSON (report)", write("fit.json", "nope"), ["ladder", "report", "{L}"], 2, ["fit.json: not JSON"]),
    ("fit.json nan law", write("fit.json", '{"largest_budget": 1e13, "budgets": [1e13], "curves": {}, '
                                           '"approach3": {"law": {"E": NaN, "A": 1, "B": 1, "alpha": 1, "beta": 1}}}'),
     PLAN, 2, ["fit.json: key 'approach3.law.E': got NaN"]),
    ("plan: no bootstrap", fit_edit(bootstrap=[]), PLAN, 0, ["no prediction: the prediction or its interval is not "]),
    ("plan: absurd", fit_edit(A=1e30, alpha=0.01), PLAN, 0, ["no prediction: the law's loss or its interval lies "
                                                              "outside (0, "]),
]


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_bad_ladder_input_is_one_line(ladder, tmp_path, capsys, row):
    _, change, argv, status, says = row
    d = tmp_path / "L"
    shutil.copytree(ladder, d)
    if change:
        change(d)
    argv = [a.replace("{L}", str(d)) for a in argv]
    if status == "usage":  # argparse: the usage line and one error line, exit 2
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert all(s in err for s in says), err
        return
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == status, (out, err)
    if status == 2:
        assert err.count("\n") == 1 and err.startswith("densetrain: error: ") and "Traceback" not in err, err
        assert all(s in err for s in says), err
    else:  # plan prints no number it cannot stand behind: no nan, no 1e+23
        assert all(s in out for s in says), out
        assert "nan" not in out.lower() and "e+2" not in out and "predicted final val loss" not in out, out


def test_report_run_without_the_ladder_says_so(ladder, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    atomic_write_json(run / "summary.json", {"steps": 10, "tokens": 2560, "val": {"all": {"loss": 5.0, "bpb": 2.0}}})
    assert main(["ladder", "report", str(ladder), "--run", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"--run {run}: that run was trained without eval.ladder" in err and err.count("\n") == 1, err
    assert main(["ladder", "report", str(ladder), "--run", str(tmp_path / "nothing")]) == 2
    assert "no summary.json there" in capsys.readouterr().err
