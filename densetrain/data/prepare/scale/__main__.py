"""``python -m densetrain.data.prepare.scale``: run a prepare config on datatrove
(:func:`densetrain.data.prepare.scale.pipeline.main`)."""

# main runs from the module imported under its package name, not from `__main__`: pipeline steps are
# pickled into datatrove's worker processes by reference to their module, and classes of `__main__`
# (pickled by value) hung the tokenize stage under the local executor's forkserver.
from densetrain.data.prepare.scale.pipeline import main

main()
