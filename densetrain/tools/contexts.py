"""Which flag and override acts in which command's context (:mod:`densetrain.cli` calls these before a command
runs): the directory argument each command names, the overrides a command never reads, and the flags that act only
beside another one. Anything given outside its context is refused in one line, not ignored."""

from __future__ import annotations

import argparse
from pathlib import Path

from densetrain.config import parse_overrides
from densetrain.errors import ConfigError

CHECKPOINT_ARG = "a run directory with checkpoints (RUN_DIR) or one checkpoint (RUN_DIR/checkpoints/step_XXXXXXXX)"
RUN_ARG = "a run directory of densetrain train"
RUN_DIR_ARGS = {  # command -> (positional argument, the file it reads first there or None, what it must name)
    "eval": ("checkpoint", None, CHECKPOINT_ARG),
    "export": ("checkpoint", None, CHECKPOINT_ARG),
    "blame": ("run_dir", "config.toml", RUN_ARG),
    "replay": ("run_dir", "config.toml", RUN_ARG),
    "report": ("run_dir", "metrics.jsonl", RUN_ARG),
    "import-hf": ("hf_dir", "config.json", "a local Hugging Face Llama folder (config.json + *.safetensors)"),
}


RUN_CONFIG_COMMANDS = ("report", "blame", "replay")  # read RUN_DIR/config.toml as the run wrote it: no overrides
UNUSED_SECTIONS = {  # command -> config sections it never reads (it works on one checkpoint, in this process)
    "eval": ("optim", "checkpoint", "logging", "parallel", "guard", "watchdog", "probe", "faults"),
    "export": ("optim", "checkpoint", "logging", "eval", "parallel", "guard", "watchdog", "probe", "faults"),
}
USED_KEYS = {  # command -> the only config keys (or "section." prefixes) it reads
    "doctor": ("train.device", "train.threads", "train.dtype", "train.run_dir", "parallel.", "health."),
}


def refuse_unused_overrides(args: argparse.Namespace, rest: list[str]) -> None:
    """An override the command would not use is refused, not ignored: ``report``, ``blame`` and ``replay``
    take none (nor ``--preset`` / ``--config``), ``eval`` and ``export`` none of the sections they never read
    (``--parallel.*`` among them: a checkpoint of any layout is read whole, in one process), ``doctor`` only
    the keys of :data:`USED_KEYS` (``--faults`` was accepted and ignored).

    Raises:
        ConfigError: one line naming the first such argument.
    """
    if args.command in RUN_CONFIG_COMMANDS:
        given = rest + [f"--{k}" for k in ("preset", "config") if getattr(args, k, None)]
        if given:
            raise ConfigError(f"{given[0]}: densetrain {args.command} reads the run's own config.toml and takes no "
                              "--preset, --config or --section.key=value overrides")
    for key, _ in parse_overrides(rest) if args.command in USED_KEYS else []:
        used = USED_KEYS[args.command]
        if not any(key == k or (k.endswith(".") and key.startswith(k)) for k in used):
            raise ConfigError(f"--{key}: densetrain {args.command} does not use it (it reads only "
                              f"{', '.join(k + '*' if k.endswith('.') else k for k in used)}); leave it out")
    for key, _ in parse_overrides(rest) if args.command in UNUSED_SECTIONS else []:
        if key.split(".")[0] in UNUSED_SECTIONS[args.command]:
            raise ConfigError(f"--{key}: densetrain {args.command} does not use [{key.split('.')[0]}] (it reads one "
                              "checkpoint of any layout in this process); leave it out")


_TORCHRUN = "a training run's processes are those torchrun starts (torchrun --nproc-per-node N -m densetrain train ...)"
FLAG_CONTEXTS = (  # (command, flag, attribute, given, out of the context where it acts, why): refused, not ignored
    ("train", "--world-size", "world_size", lambda a: a.world_size is not None, lambda a: not a.dry_run,
     f"acts only with --dry-run (the plan of a job of N processes); {_TORCHRUN}"),
    ("train", "--rank", "rank", lambda a: a.rank is not None, lambda a: not a.dry_run,
     f"acts only with --dry-run (builds that rank of the job on a fake process group); {_TORCHRUN}"),
    ("train", "--ranks", "ranks", lambda a: a.ranks is not None, lambda a: not a.dry_run,
     f"acts only with --dry-run; {_TORCHRUN}"),
    ("train", "--gpu-memory-gib", "gpu_memory_gib", lambda a: a.gpu_memory_gib is not None, lambda a: not a.dry_run,
     "acts only with --dry-run (the memory a stage's rank may use)"),
    ("train", "--rank", "rank", lambda a: a.rank is not None, lambda a: a.ranks is not None,
     "given with --ranks, which would replace it: name every rank in --ranks"),
    ("train", "--stop-after", "stop_after", lambda a: a.stop_after is not None, lambda a: a.dry_run,
     "a dry run takes no step; leave out --dry-run to train"),
    ("train", "--rollback-to", "rollback_to", lambda a: a.rollback_to is not None, lambda a: a.dry_run,
     "a dry run rolls nothing back; leave out --dry-run"),
    ("train", "--skip-batches", "skip_batches", lambda a: a.skip_batches != 0, lambda a: a.dry_run,
     "a dry run reads no data; leave out --dry-run"),
    ("train", "--smoke", "smoke", lambda a: a.smoke, lambda a: a.resume is not None,
     "a smoke run is a new run of the scaled-down recipe in RUN_DIR-smoke, not a continuation: leave out --resume"),
    ("eval", "--limit", "limit", lambda a: a.limit > 0, lambda a: not a.tasks,
     "the examples per downstream task, so it acts only with --tasks (validation loss reads eval.max_batches)"),
    ("prepare", "--verify", "verify", lambda a: a.verify, lambda a: a.force,
     "hashes the shards of up-to-date sources, and --force redoes every source: give one of them"),
)
"""Each flag of :func:`build_parser` that acts only in some context, with the context: a flag given outside it
is refused in one line (issue 44: ``train --world-size 2`` without ``--dry-run`` trained one process, exit 0)."""


def refuse_flags_out_of_context(args: argparse.Namespace) -> None:
    """Refuse the first flag of :data:`FLAG_CONTEXTS` given where it would be ignored.

    Raises:
        ConfigError: ``FLAG VALUE: why`` (one line).
    """
    for command, flag, attr, given, outside, why in FLAG_CONTEXTS:
        if args.command == command and given(args) and outside(args):
            value = getattr(args, attr)
            raise ConfigError(f"{flag}{'' if value is True else f' {value}'}: {why}")


def check_path_arg(args: argparse.Namespace) -> None:
    """The command's directory argument is a directory holding the file the command reads first, else one
    line naming it and what was expected (eval/export: :func:`densetrain.tools.offline_eval.find_checkpoint`
    says which checkpoint is missing)."""
    if args.command not in RUN_DIR_ARGS:
        return
    arg, needs, expected = RUN_DIR_ARGS[args.command]
    path = Path(getattr(args, arg))
    if not path.is_dir():
        why = "not a directory" if path.exists() else "no such directory"
    elif needs and not (path / needs).exists():
        why = f"no {needs} here"
    else:
        return
    raise ConfigError(f"{path}: {why}; densetrain {args.command} expects {expected}")
