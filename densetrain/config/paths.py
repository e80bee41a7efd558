"""Local paths of a config that a run directory keeps: written absolute, read from anywhere.

A run's ``config.toml`` is read again by commands started elsewhere (``eval``, ``export``, ``blame``,
``replay``, ``train --resume``), so :func:`absolute_paths` makes every local relative path of a config
absolute (against the current directory, as the run itself reads them) before it is written. URLs
(``s3://...``), ``~`` paths and tokenizer names are left as they are; ``data.sources[i].paths`` stay
relative to ``data.corpus_dir`` as documented.

Run directories written before this kept the paths as given, relative to the directory the run was started
in. :func:`anchor_run_paths` reads them so: a relative path that exists from the current directory is used
as is (the old behaviour); one that does not is looked for under the start directory, known when the run
directory's own ``train.run_dir`` was relative (``runs/x`` kept in ``/home/u/proj/runs/x`` was started in
``/home/u/proj``); where neither holds the shards or the tokenizer file, one line names the key, the path
and both directories tried.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

from densetrain.config.schema import Config
from densetrain.errors import ConfigError

_DIR_KEYS = (("data", "corpus_dir"), ("data", "shards_dir"), ("train", "run_dir"), ("checkpoint", "dir"),
             ("eval", "ladder"))
"""(section, key) of the config fields that hold one local directory or a URL."""

_NEEDED = ("data.shards_dir", "data.tokenizer")
"""Keys whose path must exist for the commands that read a run's config (its shards and tokenizer)."""


def _relative(path: str) -> bool:
    """A local path that depends on the current directory ('' is unset; URLs and ``~`` paths do not)."""
    return bool(path) and "://" not in path and not path.startswith("~") and not os.path.isabs(path)


def _tokenizer_path(spec: str) -> tuple[str, str]:
    """``(prefix, path)`` of a ``data.tokenizer`` naming a local file that exists from here: ``('', spec)`` for a
    tokenizer.json or rank file path, ``('gpt2:', rest)`` for ``'gpt2:<path>'``; ``('', '')`` for a name
    ('bpe', 'gpt2', 'tiktoken:cl100k_base'), which names no file. A file that exists, named with a '/' or a
    suffix (a folder or file called 'gpt2' in the current directory stays a name), tells a path from a name
    without this leaf layer knowing the tokenizer registry (densetrain.data.tokenizer.load_tokenizer)."""
    def is_file(path: str) -> bool:
        return ("/" in path or Path(path).suffix != "") and os.path.isfile(os.path.expanduser(path))

    if is_file(spec):
        return "", spec
    prefix, sep, rest = spec.partition(":")
    if sep and "/" not in prefix and rest and is_file(rest):
        return prefix + sep, rest
    return "", ""


def absolute_paths(cfg: Config) -> Config:
    """A copy of ``cfg`` whose local relative directories (data.corpus_dir, data.shards_dir, train.run_dir,
    checkpoint.dir, eval.ladder) and tokenizer file path are absolute against the current directory."""
    cfg = copy.deepcopy(cfg)
    for section, key in _DIR_KEYS:
        value = getattr(getattr(cfg, section), key)
        if _relative(value):
            setattr(getattr(cfg, section), key, os.path.abspath(value))
    prefix, path = _tokenizer_path(cfg.data.tokenizer)
    if _relative(path):
        cfg.data.tokenizer = prefix + os.path.abspath(path)
    return cfg


def _start_dir(run_dir: Path, saved_run_dir: str) -> Path | None:
    """The directory a run was started in: ``run_dir`` (where its config.toml is now) less the relative
    ``train.run_dir`` it saved, when ``run_dir`` ends with it; None otherwise (moved, or saved absolute)."""
    if not _relative(saved_run_dir):
        return None
    here, saved = Path(os.path.abspath(run_dir)).parts, Path(os.path.normpath(saved_run_dir)).parts
    if ".." in saved or len(saved) >= len(here) or here[-len(saved):] != saved:
        return None
    return Path(*here[:-len(saved)])


def anchor_run_paths(cfg: Config, run_dir: str | os.PathLike, strict: bool = True) -> Config:
    """``cfg`` (read from ``run_dir/config.toml``) with the relative paths an older run kept made usable from
    the current directory (module docstring); a config saved with absolute paths comes back unchanged.
    ``strict=False`` (``train --resume``, whose arguments are checked after): what is found nowhere is left
    for the reader of that path to refuse.

    Raises:
        ConfigError: (strict) data.shards_dir or a data.tokenizer file path is relative and found neither
            from the current directory nor from the run's start directory (one line naming both).
    """
    start = _start_dir(Path(run_dir), cfg.train.run_dir)
    cfg = copy.deepcopy(cfg)
    fields = [(s, k, getattr(getattr(cfg, s), k), "") for s, k in _DIR_KEYS]
    prefix, tok_path = _tokenizer_path(cfg.data.tokenizer)
    if not tok_path and cfg.data.tokenizer.endswith((".json", ".tiktoken")):  # a file path missing from here
        scheme, sep, rest = cfg.data.tokenizer.partition(":")  # 'gpt2:<path>' (not a drive or URL: no '/')
        prefix, tok_path = (scheme + sep, rest) if sep and "/" not in scheme else ("", cfg.data.tokenizer)
    fields.append(("data", "tokenizer", tok_path, prefix))
    moved = []
    for section, key, path, pre in fields:
        if not _relative(path) or os.path.exists(path):
            continue
        if start is not None and (start / path).exists():
            setattr(getattr(cfg, section), key, pre + os.path.normpath(start / path))
            moved.append(f"{section}.{key}")
        elif strict and f"{section}.{key}" in _NEEDED:
            tried = f" nor from {start}, where the run was started" if start is not None else ""
            raise ConfigError(f"{run_dir}/config.toml: {section}.{key} = {pre + path!r} is relative to the directory "
                              f"the run was started in (an older densetrain kept it so) and is not found from "
                              f"{os.getcwd()}{tried}; run the command from that directory or write the absolute "
                              f"path into {run_dir}/config.toml")
    if moved:  # the decision is said once, as every decision that changes what a command reads
        print(f"densetrain: note: {run_dir}/config.toml keeps {', '.join(moved)} relative to the directory the run "
              f"was started in (an older densetrain): read from {start}", file=sys.stderr)
    return cfg
