"""The demo corpus: six small JSONL sources of real text (books, reference, technical, web, zh, code)
taken from Debian packages and the Python standard library (:mod:`.packages`, :mod:`.stdlib`), parsed
into documents (:mod:`.texts`) and capped per source (:mod:`.build`). Only ``densetrain prepare``
calls it, when no ``data.sources`` are configured; training and evaluation never import it (the
import-linter contract in pyproject.toml).
"""

from densetrain.data.corpus.build import build_demo_corpus, demo_sources

__all__ = ["build_demo_corpus", "demo_sources"]
