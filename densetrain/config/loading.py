"""Building a :class:`Config`: TOML presets, ``--a.b=value`` overrides, saving, ``--help-config``.

Every field carries a docstring (the string literal right under it); ``densetrain train --help-config``
prints them. A config is built in three layers, later ones winning:

1. the dataclass defaults below,
2. a TOML preset (``densetrain/presets/<name>.toml``) or a TOML file given with ``--config``,
3. command-line overrides ``--section.field=value`` (value parsed as a TOML value; bare words are
   strings), e.g. ``--optim.peak_lr=3e-4 --schedule.kind=wsd``.

Unknown keys and bad values raise :class:`ConfigError` with a one-line message naming the key
(and a close match for typos) before any compute starts. Config text is parsed with ``tomllib``;
nothing is ever ``eval``-ed.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import os
import textwrap
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

import tomli_w

from densetrain.config.schema import Config
from densetrain.config.validate import closest_names, toml_words, validate
from densetrain.errors import ConfigError
from densetrain.fileio import ReadRefused, atomic_write_bytes, read_toml

PRESET_DIR = Path(__file__).resolve().parents[1] / "presets"


def _field_docs(cls: type) -> dict[str, str]:
    """Field docstrings: the string literal placed right below each field in the class body."""
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(src).body[0].body
    docs: dict[str, str] = {}
    for prev, node in zip(body, body[1:]):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


# --------------------------------------------------------------------------------------------------
# Building from dicts (TOML) and overrides
# --------------------------------------------------------------------------------------------------


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Check/convert one TOML value to the annotated type; raise ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {type(value).__name__}")
        return _from_dict(tp, value, key)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {toml_words(value)}")
        return [_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {toml_words(value)}")
        return {str(k): _convert(v, val_tp, f"{key}.{k}") for k, v in value.items()}
    if origin in (typing.Union, types.UnionType):  # e.g. a stage's parallel table: int | float | str | bool
        for member in typing.get_args(tp):
            try:
                return _convert(value, member, key)
            except ConfigError:
                continue
        names = " or ".join(getattr(m, "__name__", str(m)) for m in typing.get_args(tp))
        raise ConfigError(f"{key}: expected {names}, got {toml_words(value)}")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {toml_words(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {toml_words(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {toml_words(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {toml_words(value)}")
        return value
    raise ConfigError(f"{key}: unsupported type {tp}")  # pragma: no cover - programming error


def _unknown_key(cls: type, name: str, prefix: str) -> ConfigError:
    names = [f.name for f in dataclasses.fields(cls)]
    close = closest_names(name, names)
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {', '.join(names)}"
    return ConfigError(f"unknown config key '{prefix}{name}'{hint}")


def _from_dict(cls: type, d: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in d.items():
        if k not in names:
            raise _unknown_key(cls, k, f"{prefix}." if prefix else "")
        kwargs[k] = _convert(v, hints[k], f"{prefix}.{k}" if prefix else k)
    return cls(**kwargs)


def _merge(base: dict, over: dict) -> dict:
    """Deep-merge TOML tables; lists (sources, stages) are replaced whole."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "mix" else v
    return out


def _parse_value(text: str) -> Any:
    """Parse an override value as a TOML value; anything that is not valid TOML is a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    except RecursionError:  # nested deeper than tomllib recurses: no config value is
        raise ConfigError(f"override value {text[:40]}... is nested too deeply") from None


def _set_path(d: dict, dotted: str, value: Any) -> None:
    """Set ``a.b.c = value`` in a nested dict; ``stages.2.seq_len`` indexes into a list."""
    parts = dotted.split(".")
    cur: Any = d
    for i, p in enumerate(parts[:-1]):
        if isinstance(cur, list):
            if not p.isdigit() or int(p) >= len(cur):
                raise ConfigError(f"--{dotted}: '{p}' is not an index of {'.'.join(parts[:i])} (0..{len(cur) - 1})")
            cur = cur[int(p)]
        else:
            cur = cur.setdefault(p, {})
    last = parts[-1]
    if isinstance(cur, list):
        raise ConfigError(f"--{dotted}: cannot set a whole list item; name a field of it")
    cur[last] = value


_TOP_LEVEL_LISTS = tuple(f.name for f in dataclasses.fields(Config) if typing.get_origin(f.type) is list
                         or str(f.type).startswith("list"))
"""Config fields that are lists of tables (``stages``, ``faults``): overridable whole, ``--faults=[...]``."""


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """Turn ``['--optim.peak_lr=3e-4', '--train.steps', '10']`` into ``[(key, value), ...]``.

    Raises:
        ConfigError: an argument is not of the form ``--section.key=value`` / ``--section.key value``.
    """
    out = []
    i = 0
    while i < len(args):
        a = args[i]
        key = a.split("=", 1)[0][2:]
        if not a.startswith("--") or ("." not in key and key not in _TOP_LEVEL_LISTS):
            raise ConfigError(f"unexpected argument '{a}': overrides look like --section.key=value "
                              f"(or --{'/--'.join(_TOP_LEVEL_LISTS)}=[...] for a whole table list)")
        if "=" in a:
            k, v = a[2:].split("=", 1)
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"{a}: missing value")
            k, v = a[2:], args[i + 1]
            i += 1
        out.append((k, _parse_value(v)))
        i += 1
    return out


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def _read_toml(path: Path) -> dict:
    try:
        return read_toml(path)  # a regular file of at most 16 MiB; too deep a nesting is one line too
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory; --config expects a TOML file (e.g. RUN_DIR/config.toml)") from None
    except ReadRefused as e:
        hint = "; --config expects a TOML file (e.g. RUN_DIR/config.toml)" if "directory" in e.strerror else ""
        raise ConfigError(f"{e}{hint}") from None
    except OSError as e:  # permission denied, an I/O error
        raise ConfigError(f"{path}: cannot read the config file ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    except UnicodeDecodeError as e:  # TOML is UTF-8 (tomllib decodes before parsing)
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); a TOML config file is expected") from None


def load_config(
    preset: str | None = None, path: str | os.PathLike | None = None, overrides: list[tuple[str, Any]] = ()
) -> Config:
    """Build and validate a :class:`Config` from a preset name and/or TOML file plus overrides.

    Raises:
        ConfigError: unknown preset, unreadable TOML, unknown key, wrong type or failed validation.
    """
    d: dict = {}
    if preset:
        p = PRESET_DIR / f"{preset}.toml"
        if not p.exists():
            close = difflib.get_close_matches(preset, list_presets(), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"unknown preset '{preset}' (available: {', '.join(list_presets())}){hint}")
        d = _read_toml(p)
    if path:
        d = _merge(d, _read_toml(Path(path)))
    for k, v in overrides:
        _set_path(d, k, v)
    cfg = _from_dict(Config, d)
    validate(cfg)
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved config as TOML (atomically), loadable again with ``--config``."""
    atomic_write_bytes(Path(path), tomli_w.dumps(to_dict(cfg)).encode())


def help_text(cfg: Config | None = None) -> str:
    """Every key with its value in ``cfg`` (the defaults when None) and its docstring, for ``--help-config``;
    list tables (sources, stages) are shown item by item (``--stages.2.seq_len``)."""
    lines = []

    def walk(cls: type, prefix: str, obj) -> None:
        docs = _field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp, val = hints[f.name], getattr(obj, f.name)
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.", val)
                continue
            (item,) = typing.get_args(tp) if typing.get_origin(tp) is list else (None,)
            if dataclasses.is_dataclass(item):  # list of tables: each item's keys, or the keys of an item
                lines.append(f"--{prefix}{f.name}=[{len(val)} tables]\n      {docs.get(f.name, '')}")
                for i, v in enumerate(val or [item()]):
                    walk(item, f"{prefix}{f.name}.{i if val else 'N'}.", v)
                continue
            lines.append(f"--{prefix}{f.name}={json.dumps(val)}\n      {docs.get(f.name, '')}")

    walk(Config, "", cfg if cfg is not None else Config())
    return "\n".join(lines)
