"""Document boundaries per named tokenizer, end to end: what ``prepare`` writes into the shards, what
document masking makes of it, what evaluation feeds the model and what an HF export encodes.

GPT-2 has no BOS: EOS (``<|endoftext|>``) ends every document and starts every evaluation context.
Llama 3 starts every document with ``<|begin_of_text|>`` (Meta's tokenizer and training) and ends it
with ``<|end_of_text|>``; evaluation contexts start with the same BOS, and the exported
``tokenizer.json`` adds it on encode as Meta's does (checked in transformers by
tests/test_tokenizer.py::test_exported_tokenizer_json_gives_our_ids_in_transformers).
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from densetrain.config import Config, DataConfig, SourceConfig
from densetrain.data.prepare import prepare
from densetrain.data.shards import TokenFiles
from densetrain.data.tokenizer import load_tokenizer
from densetrain.errors import DataError
from densetrain.evals.scoring import build_requests
from densetrain.evals.valloss import text_bytes
from densetrain.model.masks import document_ids

STDLIB = Path(sysconfig.get_paths()["stdlib"])
BOS = {"gpt2": None, "llama3": "<|begin_of_text|>"}


def _named(name: str):
    try:
        return load_tokenizer(name, ".")
    except DataError as e:  # the rank files come with `make install`
        pytest.skip(f"tokenizer {name} unavailable: {e}")


def _documents() -> list[str]:
    """Small real prose: the paragraphs of four standard-library docstrings."""
    out = []
    for mod in ("json/__init__.py", "textwrap.py", "heapq.py", "difflib.py"):
        doc = (STDLIB / mod).read_text().split('"""')[1]
        out += [p.strip() for p in doc.split("\n\n") if len(p.strip()) > 40]
    return out


@pytest.mark.parametrize("name", ["gpt2", "llama3"])
def test_shards_evaluation_and_masks_agree_on_document_starts(tmp_path, name):
    tok = _named(name)
    assert tok.bos_token == BOS[name] and (tok.bos_id is None) == (BOS[name] is None)
    docs = _documents()
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "d.jsonl").write_text("".join(json.dumps({"text": t, "id": f"d{i}"}) + "\n" for i, t in enumerate(docs)))
    cfg = Config()
    cfg.data = DataConfig(corpus_dir=str(root), shards_dir=str(tmp_path / "shards"), tokenizer=name, val_fraction=0.1,
                          seed=3, sources=[SourceConfig(name="d", kind="code", paths=["d.jsonl"], dedup=False)])
    cfg.data.decontam.enabled = False
    cfg.model.vocab_size = tok.vocab_size
    prepare(cfg)
    stream = TokenFiles(Path(cfg.data.shards_dir) / "d" / "train")
    ids = stream.read(0, len(stream))
    n_docs = stream.n_docs
    assert n_docs >= 10
    texts = set(docs)
    for k in range(n_docs):
        d = stream.document(k)
        assert d[-1] == tok.eos_id
        if tok.bos_id is None:  # GPT-2: the text, then EOS; the previous EOS is what precedes it
            assert tok.decode(d[:-1]) in texts
        else:  # Llama 3: BOS, the text, EOS
            assert d[0] == tok.bos_id and tok.bos_id not in d[1:].tolist()
            assert tok.decode(d[1:-1]) in texts
    # The token the model sees before a document's first text token in training is the one every
    # evaluation context starts with.
    (req,) = build_requests(tok, [("The json module", " encodes objects.")])
    first = stream.document(1)
    before_text = first[0] if tok.bos_id is not None else stream.document(0)[-1]
    assert req.tokens[0] == before_text == (tok.eos_id if tok.bos_id is None else tok.bos_id)
    assert list(req.tokens[1:req.n_ctx]) == tok.encode("The json module")
    # Document masking: a window over two documents puts a BOS at position 0 of its own document.
    window = np.concatenate([stream.document(0), stream.document(1)])[None, :]
    doc, pos = document_ids(window, tok.eos_id)
    n0 = len(stream.document(0))
    assert doc[0, :n0].tolist() == [0] * n0 and doc[0, n0:].tolist() == [1] * (window.shape[1] - n0)
    assert pos[0, n0] == 0 and pos[0, -1] == window.shape[1] - n0 - 1
    if tok.bos_id is not None:
        assert window[0, 0] == window[0, n0] == tok.bos_id and pos[0, 0] == 0
    # Bits per byte count text only: BOS and EOS are 0 bytes.
    assert text_bytes(tok, ids) == sum(len(tok.decode(stream.document(k)[1 if tok.bos_id is not None else 0:-1])
                                           .encode()) for k in range(n_docs))


@pytest.mark.parametrize("name", ["gpt2", "llama3"])
def test_scale_out_tokenize_step_places_bos_and_eos_as_prepare_does(name):
    pytest.importorskip("datatrove", reason="the scale-out runs on datatrove (test extra)")
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers

    from densetrain.data.prepare.scale.steps import document_template

    tok = _named(name)
    template = document_template(tok)
    if tok.bos_id is None:
        assert template is None  # datatrove's own "$A <EOS>"
        return
    vocab = {"hello": 0, "world": 1, tok.bos_token: tok.bos_id, tok.eos_token: tok.eos_id}
    hf = HF(models.WordLevel(vocab, unk_token="hello"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.post_processor = template
    assert hf.encode("hello world").ids == [tok.bos_id, 0, 1, tok.eos_id]
