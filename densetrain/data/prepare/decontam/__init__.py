"""Decontamination: the index of evaluation-set n-grams that ``densetrain prepare`` drops training
documents by. :mod:`.build` builds and caches it (why these views and the normalisation rule are
explained there), :mod:`.index` holds and queries it, :mod:`.views` turns each task's rows into the
texts indexed, :mod:`.ngram` normalises words and hashes n-grams. Called by the preparation pipeline
(once per run) and its workers (per document).
"""
