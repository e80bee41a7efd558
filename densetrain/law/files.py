"""The ladder's files read back and checked: ``ladder.json`` (the plan), ``ladder.jsonl`` (the points),
a point run's ``summary.json`` and ``fit.json`` (``densetrain ladder fit``).

Every file goes through the bounded, regular readers of :mod:`densetrain.fileio` (a link to ``/dev/zero`` or a
FIFO is refused, nesting deeper than the parser follows is refused), then each value a fit or a prediction
uses is checked for its type and range: a bad value is one :class:`~densetrain.errors.DataError` line naming
the file, the line (``ladder.jsonl``) and the key, and what was expected. Python's JSON parser reads the
non-standard ``NaN`` and ``Infinity``; they are refused here where a finite number is expected (our writers
write ``null`` for a non-finite number, :func:`densetrain.fileio.json_text`). A point's final validation loss
may be ``null`` (a run that diverged): such a point is left out of the fit, which says so.

Used by ``densetrain ladder`` (plan, points, fit), ``plan --ladder`` and the training watcher (``fit.json``),
and the report's scaling panel.
"""

from __future__ import annotations

import math
from pathlib import Path

from densetrain.errors import DataError
from densetrain.fileio import MAX_LOG_BYTES, parse_json_line, read_json, read_text_bounded

PLAN, POINTS, FIT = "ladder.json", "ladder.jsonl", "fit.json"

_MISSING = object()


def _name(v) -> str:
    """``v`` as the error line shows it: JSON's spelling for the non-finite floats Python's parser admits."""
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _get(d: dict, key: str, where: str, prefix: str = ""):
    if not isinstance(d, dict) or key not in d:
        raise DataError(f"{where}: key '{prefix}{key}' missing; expected the file densetrain ladder writes")
    return d[key]


def number(v, where: str, key: str, lo: float = 0.0, lo_open: bool = True, hi: float = math.inf,
           integer: bool = False, null: bool = False) -> float | int | None:
    """``v`` checked: a JSON number (not a bool, not a string), finite, ``> lo`` (``>= lo`` unless
    ``lo_open``), ``<= hi``, a whole number with ``integer``, or None where ``null``.

    Raises:
        DataError: ``'WHERE: key 'KEY': got V, expected ...'``.
    """
    if v is None and null:
        return None
    kind = "a whole number" if integer else "a finite number"
    want = f"{kind} {'>' if lo_open else '>='} {lo:g}" + (f" and <= {hi:g}" if hi < math.inf else "") + (
        " (or null)" if null else "")
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (v > lo if lo_open else v >= lo) and v <= hi and (not integer or float(v).is_integer())
    if not ok:
        raise DataError(f"{where}: key '{key}': got {_name(v)}, expected {want}")
    return int(v) if integer else float(v)


def _numbers(v, where: str, key: str, **kw) -> list:
    if not isinstance(v, list) or not v:
        raise DataError(f"{where}: key '{key}': got {_name(v)}, expected a non-empty list of numbers")
    return [number(x, where, f"{key}[{i}]", **kw) for i, x in enumerate(v)]


def _object(v, where: str, key: str) -> dict:
    if not isinstance(v, dict):
        raise DataError(f"{where}: key '{key}': got {_name(v)}, expected a JSON object")
    return v


def load_json(path: Path, what: str):
    """The JSON value of ``path`` (:func:`densetrain.fileio.read_json`: regular, at most 16 MiB); ``what`` says
    which file was expected. Raises: DataError (not JSON, not UTF-8); ReadRefused / OSError (fileio)."""
    try:
        return read_json(path)
    except ValueError as e:  # json.JSONDecodeError (names line and column), UnicodeDecodeError
        raise DataError(f"{path}: not JSON ({e}); expected {what}") from None


def check_val(val, where: str, key: str = "val") -> dict:
    """A ``val`` table (per source ``{"loss", "bpb"}``, numbers > 0 or null) checked; returns it."""
    for src, v in _object(val, where, key).items():
        for k in ("loss", "bpb"):
            number(_object(v, where, f"{key}.{src}").get(k), where, f"{key}.{src}.{k}", null=True)
    return val


def check_point(rec, where: str) -> dict:
    """One ``ladder.jsonl`` record (:func:`densetrain.tools.ladder.launcher.point_record`) checked; returns it
    with ``curve`` and ``downstream`` defaulted to empty.

    Raises:
        DataError: a key missing or of the wrong type or range (``'WHERE: key 'KEY': got V, expected ...'``).
    """
    name = _get(rec, "name", where)
    if not isinstance(name, str) or not name:
        raise DataError(f"{where}: key 'name': got {_name(name)}, expected the point's name (d<d_model>_c<i>)")
    for k in ("d_model", "steps"):
        number(_get(rec, k, where), where, k, integer=True)
    number(rec.get("branch_from", 0), where, "branch_from", lo_open=False, integer=True)
    number(rec.get("seed", 0), where, "seed", lo_open=False, integer=True)
    for src, x in _object(rec.get("repeated_tokens", {}), where, "repeated_tokens").items():
        number(x, where, f"repeated_tokens.{src}", lo_open=False, integer=True)
    for k in ("budget", "params", "params_no_embed", "tokens"):
        number(_get(rec, k, where), where, k)
    val = check_val(_get(rec, "val", where), where)
    number(_get(_object(_get(val, "all", where, "val."), where, "val.all"), "loss", where, "val.all."),
           where, "val.all.loss", null=True)
    rec.setdefault("curve", [])
    if not isinstance(rec["curve"], list):
        raise DataError(f"{where}: key 'curve': got {_name(rec['curve'])}, expected a list of validations")
    for i, c in enumerate(rec["curve"]):
        key = f"curve[{i}]"
        number(_get(_object(c, where, key), "s1", where, key + "."), where, key + ".s1")
        number(_get(c, "s2", where, key + "."), where, key + ".s2", lo_open=False)
        for src, x in _object(_get(c, "loss", where, key + "."), where, key + ".loss").items():
            number(x, where, f"{key}.loss.{src}")
    for t, x in _object(rec.setdefault("downstream", {}), where, "downstream").items():
        number(x, where, f"downstream.{t}", lo=-math.inf, null=True)
    return rec


def read_points(path: Path) -> dict[str, dict]:
    """The checked records of ``ladder.jsonl`` (:func:`check_point`) by point name, in file order.

    Raises:
        ReadRefused: not a regular file, over 4 GiB, nested too deeply (``PATH:LINE``).
        DataError: a line not JSON, a record's bad key (``PATH:LINE: key ...``), or a point recorded twice.
    """
    out: dict[str, dict] = {}
    lines: dict[str, int] = {}
    try:
        text = read_text_bounded(path, MAX_LOG_BYTES)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 ({e}); expected the points densetrain ladder writes") from None
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            rec = parse_json_line(line, f"{path}:{n}")
        except ValueError as e:  # ladder.jsonl is rewritten whole, atomically: a bad line is damage, not a torn tail
            raise DataError(f"{path}:{n}: not JSON ({e}); expected one JSON object a line") from None
        rec = check_point(rec, f"{path}:{n}")
        if rec["name"] in out:
            raise DataError(f"{path}:{n}: point '{rec['name']}' recorded twice (first on line {lines[rec['name']]}); "
                            f"expected one record per point: delete one of the two lines")
        out[rec["name"]], lines[rec["name"]] = rec, n
    return out


def read_plan(path: Path) -> dict:
    """``ladder.json`` checked: ``sizes`` (whole numbers > 0), ``budgets`` (finite FLOPs > 0), ``protocol`` an
    object where present (its values: :meth:`densetrain.tools.ladder.grid.Protocol.from_dict`).

    Raises:
        DataError: not JSON, or a key missing or wrong (naming it); ReadRefused / OSError (fileio).
    """
    plan = load_json(path, "the plan densetrain ladder writes")
    where = str(path)
    _object(plan, where, "(top level)")
    plan["sizes"] = _numbers(_get(plan, "sizes", where), where, "sizes", integer=True)
    plan["budgets"] = _numbers(_get(plan, "budgets", where), where, "budgets")
    if "protocol" in plan:  # (ladders planned before the protocol have none: every size at every budget)
        _object(plan["protocol"], where, "protocol")
    return plan


def read_summary(path: Path) -> dict:
    """A run's ``summary.json`` as the ladder reads it: ``steps``, ``tokens``, ``val`` checked where present.

    Raises:
        DataError: not JSON, not an object, or a bad ``steps`` / ``tokens`` / ``val`` (naming the key).
    """
    s = load_json(path, "the summary.json a finished run writes")
    where = str(path)
    _object(s, where, "(top level)")
    if "steps" in s:
        number(s["steps"], where, "steps", integer=True)
    if "tokens" in s:
        number(s["tokens"], where, "tokens")
    check_val(s.get("val", {}), where)
    if s.get("prediction") is not None:
        _object(s["prediction"], where, "prediction")
    return s


_LAW = ("E", "A", "B", "alpha", "beta")
_CURVE = ("E", "A", "alpha", "B", "beta", "C", "scale")


def check_fit(fit, where: str) -> dict:
    """``fit.json``'s values that predictions and the watcher use, checked; returns ``fit``.

    Raises:
        DataError: a key missing or of the wrong type or range (naming it).
    """
    _object(fit, where, "(top level)")
    number(fit.get("level", 0.95), where, "level", hi=1.0 - 1e-9)
    number(fit.get("lam", 0.999), where, "lam", hi=1.0)
    number(_get(fit, "largest_budget", where), where, "largest_budget")
    _numbers(_get(fit, "budgets", where), where, "budgets")
    a3 = _object(_get(fit, "approach3", where), where, "approach3")
    law = _object(_get(a3, "law", where, "approach3."), where, "approach3.law")
    for k in _LAW:
        number(_get(law, k, where, "approach3.law."), where, f"approach3.law.{k}", lo=-math.inf)
    _refits(a3.get("bootstrap", []), where, "approach3.bootstrap", "[E, A, B, alpha, beta]")
    for key, c in _object(_get(fit, "curves", where), where, "curves").items():
        for k in _CURVE:
            number(_get(_object(c, where, f"curves.{key}"), k, where, f"curves.{key}."), where, f"curves.{key}.{k}",
                   lo=-math.inf)
    if fit.get("bpb_per_nat") is not None:
        number(fit["bpb_per_nat"], where, "bpb_per_nat")
    for t, s in _object(fit.get("downstream", {}), where, "downstream").items():
        for k in ("a", "k", "L0", "b"):
            number(_get(_object(s, where, f"downstream.{t}"), k, where, f"downstream.{t}."), where,
                   f"downstream.{t}.{k}", lo=-math.inf)
    if not isinstance(fit.get("degenerate", False), bool):
        raise DataError(f"{where}: key 'degenerate': got {_name(fit['degenerate'])}, expected true or false")
    for k in ("reasons", "next"):
        if not isinstance(fit.get(k, []), list) or not all(isinstance(x, str) for x in fit.get(k, [])):
            raise DataError(f"{where}: key '{k}': got {_name(fit[k])}, expected a list of strings")
    if "trajectory" in fit and "skipped" not in _object(fit["trajectory"], where, "trajectory"):
        check_trajectory(fit["trajectory"], where)
    rng = fit.get("loss_range")
    if rng is not None and (not isinstance(rng, list) or len(rng) != 2):
        raise DataError(f"{where}: key 'loss_range': got {_name(rng)}, expected [lowest, highest]")
    for i, x in enumerate(rng or []):
        number(x, where, f"loss_range[{i}]")
    return fit


_TRAJ = ("E", "A", "alpha", "B", "beta", "C", "scale")


def _refits(boot, where: str, key: str, names: str) -> None:
    """Check ``fit.json``'s list of bootstrap refits at ``key``: each a list of the numbers ``names`` lists.

    Raises:
        DataError: not a list, a refit of another length, a value that is not a number.
    """
    if not isinstance(boot, list):
        raise DataError(f"{where}: key '{key}': got {_name(boot)}, expected a list of laws")
    n = names.count(",") + 1
    for i, b in enumerate(boot):
        if not isinstance(b, list) or len(b) != n:
            raise DataError(f"{where}: key '{key}[{i}]': got {_name(b)}, expected {names}")
        for j, x in enumerate(b):
            number(x, where, f"{key}[{i}][{j}]", lo=-math.inf)


def check_trajectory(tr: dict, where: str) -> dict:
    """``fit.json``'s ``trajectory`` (the trajectory law, :func:`densetrain.tools.ladder.fit.trajectory_fit`)
    checked: its law's numbers, bootstrap refits of 6 numbers, ``n_range`` / ``s1_range``, ``degenerate``."""
    law = _object(_get(tr, "law", where, "trajectory."), where, "trajectory.law")
    for k in _TRAJ:
        number(_get(law, k, where, "trajectory.law."), where, f"trajectory.law.{k}", lo=-math.inf)
    _refits(tr.get("bootstrap", []), where, "trajectory.bootstrap", "[E, A, alpha, B, beta, C]")
    for k in ("n_range", "s1_range"):
        v = _get(tr, k, where, "trajectory.")
        if not isinstance(v, list) or len(v) != 2:
            raise DataError(f"{where}: key 'trajectory.{k}': got {_name(v)}, expected [lowest, highest]")
        _numbers(v, where, f"trajectory.{k}")
    if not isinstance(tr.get("degenerate", False), bool):
        raise DataError(f"{where}: key 'trajectory.degenerate': got {_name(tr['degenerate'])}, expected true or false")
    return tr


def read_fit(ladder_dir: Path) -> dict:
    """``LADDER_DIR/fit.json`` read and checked (:func:`check_fit`).

    Raises:
        FileNotFoundError: no fit there; DataError: not JSON or a bad key; ReadRefused / OSError (fileio).
    """
    path = Path(ladder_dir) / FIT
    return check_fit(load_json(path, f"the fit of a ladder (densetrain ladder fit {ladder_dir})"), str(path))
