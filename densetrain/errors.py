"""The error types users see: each carries a one-line message naming the file, line or key and what
was expected, and the CLI prints it without a traceback (exit status 2)."""


class ConfigError(ValueError):
    """A configuration problem, with a one-line message that names the offending key."""


class DataError(ValueError):
    """A data problem (missing input, bad shard, tokenizer mismatch) with a one-line message."""


class TrainError(RuntimeError):
    """A problem that stops training, with a one-line message (missing data, bad resume, ...)."""


def check_config(cond: bool, msg: str) -> None:
    """Raise :class:`ConfigError` with ``msg`` (which names the key) unless ``cond`` holds."""
    if not cond:
        raise ConfigError(msg)
