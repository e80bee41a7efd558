"""``densetrain prepare``, the offline half of the data package: raw sources in, token shards and
manifests out. :mod:`.pipeline` runs it (:func:`prepare`, re-exported here), :mod:`.source` does one
source, :mod:`.process` the per-document work in worker processes, :mod:`.dedup` exact and MinHash
dedup, :mod:`.manifest` the up-to-date check; the rooms below hold the readers (``readers/``), the
quality filters (``filters/``), the evaluation-set decontamination (``decontam/``) and the datatrove
scale-out (``scale/``). Called by ``densetrain prepare`` (cli.py), the tests and the benchmarks; it may
import the tokenizer and the shard writer (data.tokenizer, data.shards), while training and evaluation
never import it (the import-linter contract in pyproject.toml).
"""

from densetrain.data.prepare.pipeline import prepare

__all__ = ["prepare"]
