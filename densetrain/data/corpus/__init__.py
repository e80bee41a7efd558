"""The demo corpus: six small JSONL sources of real text (books, reference, technical, web, zh, code)
taken from Debian packages and the Python standard library (:mod:`.packages`, :mod:`.stdlib`), parsed
into documents (:mod:`.texts`) and capped per source (:mod:`.build`); and the ladder corpus
(:mod:`.ladder`): four sources of >= 100M tokens from the same registry, for ``densetrain ladder``.
Only ``densetrain prepare`` calls them (``data.demo_corpus`` / ``data.ladder_corpus``); training and
evaluation never import them (the import-linter contract in pyproject.toml).
"""

from densetrain.data.corpus.build import build_demo_corpus, demo_sources
from densetrain.data.corpus.ladder import build_ladder_corpus, ladder_sources

__all__ = ["build_demo_corpus", "demo_sources", "build_ladder_corpus", "ladder_sources"]
