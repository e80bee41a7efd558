"""The datatrove scale-out (docs/scale-out.md): a prepare config mapped onto a datatrove pipeline
(:mod:`.pipeline`, run as ``python -m densetrain.data.prepare.scale``), its steps that reuse our
readers, filters, dedup keys and tokenizer (:mod:`.steps`), and the check and registration of the
tokenized folder it writes as a ``format = "datatrove"`` source (:mod:`.folder`, pure Python, called by
``densetrain prepare``). Only :mod:`.pipeline` and :mod:`.steps` import datatrove.
"""
