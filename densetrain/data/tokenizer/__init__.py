"""The tokenizers: a trained byte-level BPE, any ``tokenizer.json``, the named ``gpt2`` and ``llama3``
(rank files installed by ``python -m densetrain.data.tokenizer``, :mod:`.named`), tiktoken rank files
and encodings, all behind one :class:`Tokenizer` (:mod:`.core`), plus the tiktoken -> ``tokenizer.json``
conversion the Hugging Face export writes (:mod:`.hf`) and the fast tiktoken twin of a byte-level BPE
tokenizer.json (:mod:`.twin`). Both halves call it: ``densetrain prepare``
trains or loads the tokenizer and encodes documents; training, evaluation and export load the same
file (:func:`load_tokenizer`) to decode samples, score tasks and save it next to the weights.
"""

from densetrain.data.tokenizer.core import Tokenizer, load_tokenizer, train_bpe, usable_cpus

__all__ = ["Tokenizer", "load_tokenizer", "train_bpe", "usable_cpus"]
