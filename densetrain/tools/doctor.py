"""``densetrain doctor``: the hardware health check of every rank (:mod:`densetrain.health`) as a command:
the table, the verdict line, ``--json``, the comparison with a run's first measurement and the exit statuses.
Its flags are declared in :func:`densetrain.cli.build_parser` (``if name == "doctor"``), one line each."""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import torch

from densetrain.config import Config, parse_overrides
from densetrain.cost import measured_hardware, write_hardware
from densetrain.errors import ConfigError
from densetrain.fileio import json_text
from densetrain.health import check, format_table, read_first, rows_json, verdict
from densetrain.parallel import init_distributed


def doctor(cfg: Config, args: argparse.Namespace) -> int:
    """Hardware health of every rank (:mod:`densetrain.health`), alone or under torchrun: one table row per
    rank, then one verdict line (``healthy``, ``unhealthy: <rank, figure, why>`` or ``busy: ...`` when only
    contention from other processes was found), or with ``--json`` one JSON object (verdict, status, line, note,
    rows, outliers). With ``--train.run_dir RUN_DIR`` each rank is also compared with that run's first
    measurement (``RUN_DIR/health_first.json``). The matmul dtype: bf16 with ``train.dtype = 'bf16'`` (or 'auto'
    on a GPU), else fp32. Exit status (``densetrain doctor --help``): 0 healthy, 1 unhealthy, 3 busy, 2 bad input;
    under torchrun 0 after any verdict."""
    if getattr(args, "profile", None):
        check_profile_path(args.profile)  # before minutes of measuring, not after
    info = init_distributed(cfg.train.device, cfg.parallel)
    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    first, note = None, ""
    if any(k == "train.run_dir" for k, _ in parse_overrides(args.rest)):  # given: compare with that run's first
        path = Path(cfg.train.run_dir) / "health_first.json"
        first, note = read_first(path)
        note = note or ("" if first else f"{path}: no such file (that run has no first check yet)")
        note = note and f"{note}: compared across the ranks only"
    bf16 = cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and info.device.type == "cuda")
    rows, outliers = check(info.device, torch.bfloat16 if bf16 else torch.float32, info.mesh, cfg.health, first)
    status, line = verdict(rows, outliers)
    if int(os.environ.get("RANK", "0")) == 0:  # one verdict, not one per rank
        if args.json:
            print(json_text({"verdict": line.split(":")[0], "status": status, "line": line, "note": note,
                             "rows": rows_json(rows), "outliers": outliers}, indent=1))
        else:
            print(format_table(rows, outliers))
            if note:
                print(f"note: {note}")
            print(line)
        if getattr(args, "profile", None):
            print(f"wrote this machine's hardware profile to {write_profile(rows, info, args.profile)} "
                  "(densetrain plan --hardware FILE)")
            if not any(k.endswith("/all_reduce") for k in rows[0].figures):
                print("note: one rank measured no collective, so the profile's nvlink and net bandwidth are its "
                      "memory bandwidth; run doctor under torchrun --nproc-per-node N to measure them")
    # torchrun reports any other status of a rank as a failed child, with its whole error dump: a verdict is
    # a result, not a failure, so under torchrun it is read from the line (or --json)
    return 0 if int(os.environ.get("WORLD_SIZE", "1")) > 1 else status


def check_profile_path(path: str) -> None:
    """``--profile FILE`` names a file doctor can write: not a directory (nor another non-file), in an
    existing directory.

    Raises:
        ConfigError: one line naming ``--profile`` and what was expected."""
    p = Path(path)
    if p.exists() and not p.is_file():
        raise ConfigError(f"--profile {path}: is {'a directory' if p.is_dir() else 'not a regular file'}; expected "
                          "the hardware profile file to write (.toml or .json)")
    if not p.parent.is_dir():
        raise ConfigError(f"--profile {path}: {p.parent} is not a directory; expected the hardware profile file "
                          "to write (.toml or .json) in an existing directory")


def write_profile(rows, info, path: str) -> str:
    """``doctor --profile FILE``: a :class:`densetrain.cost.Hardware` profile of this machine from the ranks'
    median matmul rate and memory bandwidth and the slowest group's all-reduce bus bandwidth; returns the path."""
    def med(k):
        return statistics.median(r.figures[k] for r in rows)

    links = [med(k) for k in rows[0].figures if k.endswith("/all_reduce")]
    memory = (torch.cuda.get_device_properties(info.device).total_memory if info.device.type == "cuda"
              else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / 1024**3
    hw = measured_hardware(med("matmul"), med("memory"), min(links) if links else None,
                           int(os.environ.get("LOCAL_WORLD_SIZE", "1")), round(memory, 1),
                           f"this machine ({rows[0].host}, {info.device.type}, {len(rows)} rank(s))")
    return str(write_hardware(hw, path))
