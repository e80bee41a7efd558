"""Reading a source: which files (:mod:`.paths`), which format and how records become documents
(:mod:`.sources`, the dispatcher :func:`~.sources.iter_documents`), the text and JSONL readers
(:mod:`.text`), Parquet and Arrow (:mod:`.columnar`), and the :class:`~.documents.Document` /
:class:`~.documents.SkipLog` every reader yields and records skips into (:mod:`.documents`). Called by
the preparation pipeline, its worker processes and the datatrove reader step (``scale/``).
"""
