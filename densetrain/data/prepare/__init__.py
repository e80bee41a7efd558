"""``densetrain prepare``, the offline half of the data package: raw sources in, token shards and
manifests out. :mod:`.pipeline` runs it (:func:`prepare`, re-exported here), :mod:`.source` does one
source, :mod:`.process` the per-document work in worker processes, :mod:`.dedup` exact and MinHash
dedup, :mod:`.manifest` the up-to-date check; the rooms below hold the readers (``readers/``), the
quality filters (``filters/``), the evaluation-set decontamination (``decontam/``) and the datatrove
scale-out (``scale/``). Called by ``densetrain prepare`` (cli.py), the tests and the benchmarks; it may
import the tokenizer and the shard writer (data.tokenizer, data.shards), while training and evaluation
never import it (the import-linter contract in pyproject.toml).

:func:`prepare` is imported on first use (PEP 562 ``__getattr__``): a worker process imports
:mod:`.process`, and with it this package, and should not pay for the whole pipeline (readers,
pyarrow, decontamination index building: ~0.4 CPU-s per spawned worker).
"""

__all__ = ["prepare"]


def __getattr__(name: str):
    if name == "prepare":
        from densetrain.data.prepare.pipeline import prepare

        return prepare
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
