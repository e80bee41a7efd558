"""Training: :func:`train` runs the staged recipe of a config (:mod:`.loop`), built by :mod:`.setup`,
one step at a time (:mod:`.step`), with a decision point (:mod:`.watchers`) and counters (:mod:`.state`)."""

from densetrain.train.loop import train

__all__ = ["train"]
