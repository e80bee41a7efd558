"""The error types users see: each carries a one-line message naming the file, line or key and what
was expected, and the CLI prints it without a traceback (exit status 2)."""

import errno


class ConfigError(ValueError):
    """A configuration problem, with a one-line message that names the offending key."""


class DataError(ValueError):
    """A data problem (missing input, bad shard, tokenizer mismatch) with a one-line message."""


EXIT_PREEMPTED = 75  # EX_TEMPFAIL (sysexits.h): stopped on SIGTERM/SIGINT with a checkpoint; --resume continues
EXIT_REPEATED = 78  # EX_CONFIG (sysexits.h): under torchrun, an attempt failed as the one before it did: do not retry


class Preempted(Exception):
    """The run stopped on a signal (or an object-store outage) after ``step`` with checkpoint ``checkpoint`` (a
    directory name, or '' when the run had not taken a step yet; ``where``: e.g. ' to local disk only'); the
    message is one line saying how to continue."""

    def __init__(self, signame: str, step: int, checkpoint: str, run_dir, where: str = ""):
        self.signame, self.step, self.checkpoint = signame, step, checkpoint
        saved = f"checkpoint {checkpoint} written{where}" if checkpoint else "no step taken, nothing to save"
        super().__init__(f"stopped by {signame} after step {step} ({saved}); continue with: "
                         f"densetrain train --resume {run_dir}")


class TrainError(RuntimeError):
    """A problem that stops training, with a one-line message (missing data, bad resume, ...)."""


def check_config(cond: bool, msg: str) -> None:
    """Raise :class:`ConfigError` with ``msg`` (which names the key) unless ``cond`` holds."""
    if not cond:
        raise ConfigError(msg)


def is_disk_full(e: BaseException) -> bool:
    """Whether ``e`` (or an error it wraps) is a full disk or an exhausted quota: ENOSPC/EDQUOT on an
    OSError, or the same OS error quoted in the text of a library's own error type (safetensors'
    SafetensorError "os error 28", torch's "[Errno 28]", a CheckpointError's message)."""
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e)
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def disk_full_error(path, what: str) -> DataError:
    """The one line of a write of ``what`` under ``path`` that ran out of disk space (the caller has
    removed what it had half-written)."""
    return DataError(f"no space left on {path}: {what} was not written (nothing half-written is left); "
                     "free some space and re-run")
