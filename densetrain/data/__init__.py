"""The data package, in two halves. This folder itself holds what training and evaluation read: the
token shards in datatrove's layout (:mod:`.shards`), the prepared streams of a config with their checks
(:mod:`.streams`), the deterministic mixture sampler (:mod:`.mixture`), the document a token came from
(:mod:`.provenance`) and the budget splits shared with the demo corpus (:mod:`.sampling`); the
tokenizers are in ``tokenizer/``. The offline half that only ``densetrain prepare`` runs is
``prepare/`` (readers, filters, decontamination, dedup, the datatrove scale-out) with the demo corpus in
``corpus/``; an import-linter contract (pyproject.toml) keeps the training side from importing it.
"""
