"""Validation loss and bits per byte (densetrain/evals/valloss.py) on real token shards."""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from densetrain.config import ModelConfig
from densetrain.data.shards import TokenFiles, write_shard
from densetrain.data.tokenizer import load_tokenizer, train_bpe
from densetrain.evals.valloss import evaluate_val, text_bytes, val_table
from densetrain.model.llama import Transformer

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _token_bytes(tokenizer_json: Path) -> np.ndarray:
    """UTF-8 bytes of every token of a byte-level BPE, read from its vocabulary (special tokens 0):
    an independent count, no decoding involved."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte <-> symbol table

    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    spec = json.loads(tokenizer_json.read_text())
    special = {t["content"] for t in spec["added_tokens"]}
    table = np.zeros(max(spec["model"]["vocab"].values()) + 1, dtype=np.int64)
    for piece, i in spec["model"]["vocab"].items():
        table[i] = 0 if piece in special else len(piece)  # one symbol per byte
        assert piece in special or all(c in to_byte for c in piece)
    return table


def test_bpb_equals_loss_times_tokens_over_bytes(prepared):
    shards, _ = prepared
    tok = load_tokenizer("bpe", shards)
    stream = TokenFiles(shards / "email" / "val")
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=512, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)).eval()
    seq_len, mbs = 128, 4
    max_batches = int(stream.doc_ends()[0]) // (seq_len * mbs) + 1  # the span crosses the first document end
    res = evaluate_val(model, {"email": stream}, seq_len, mbs, max_batches, torch.device("cpu"), tokenizer=tok)["email"]

    # independently: the same windows scored by hand, bytes from the vocabulary
    n_win = min(mbs * max_batches, (len(stream) - 1) // seq_len)
    nats, n_tok = 0.0, 0
    with torch.no_grad():
        for k in range(n_win):
            w = torch.from_numpy(stream.read(k * seq_len, seq_len + 1))[None]
            nats += F.cross_entropy(model(w[:, :-1])[0].double(), w[0, 1:], reduction="sum").item()
            n_tok += seq_len
    scored = stream.read(1, n_win * seq_len)  # the targets of all windows: one contiguous span
    assert (tok.eos_id == scored).sum() >= 1  # the span crosses a document end (EOS counts 0 bytes)
    independent = int(_token_bytes(Path(shards) / "tokenizer.json")[scored].sum())
    assert res["tokens"] == n_tok == n_win * seq_len
    assert res["loss"] * res["tokens"] == pytest.approx(nats, rel=1e-6)
    # decoding can only over-count a character split at the span's two ends (module docstring)
    assert 0 <= res["bytes"] - independent <= 8
    assert res["bpb"] == pytest.approx(res["loss"] * res["tokens"] / (math.log(2) * res["bytes"]), rel=1e-12)
    assert res["bpb"] == pytest.approx(nats / math.log(2) / independent, rel=1e-3)
    # the table's 'all' row is byte-weighted over sources
    table = val_table({"email": res, "copy": dict(res)}, {"email": stream, "copy": stream})
    assert table["all"]["bytes"] == 2 * res["bytes"] and table["all"]["bpb"] == pytest.approx(res["bpb"], rel=1e-12)


class Unigram(torch.nn.Module):
    """A language model that ignores context: log-probabilities from token counts (add-1/2)."""

    def __init__(self, counts: np.ndarray):
        super().__init__()
        self.logp = torch.log(torch.as_tensor(counts, dtype=torch.float64) + 0.5)

    def forward(self, tokens):
        return self.logp.expand(*tokens.shape, -1)


def test_bpb_is_comparable_across_tokenizers(tmp_path):
    train = [p.read_text(encoding="utf-8") for d in ("json", "email") for p in sorted((STDLIB / d).rglob("*.py"))]
    held = [(STDLIB / name).read_text(encoding="utf-8") for name in ("textwrap.py", "colorsys.py")]
    n_bytes = sum(len(t.encode("utf-8")) for t in held)
    out = {}
    for vocab in (300, 2048):
        tok = train_bpe(train, vocab, tmp_path / f"tok{vocab}.json")
        docs = [np.array([*ids, tok.eos_id]) for ids in tok.encode_batch(held)]
        write_shard(tmp_path / f"v{vocab}" / "000000", docs, 2)
        stream = TokenFiles(tmp_path / f"v{vocab}")
        counts = np.bincount(np.concatenate([np.array(x, dtype=np.int64) for x in tok.encode_batch(train)]),
                             minlength=tok.vocab_size)
        # one window over the whole stream: every token but the first is scored
        whole = (len(stream), 1, 1, "cpu")
        uniform = evaluate_val(Unigram(np.zeros(tok.vocab_size)), {"h": stream}, *whole, tokenizer=tok)["h"]
        unigram = evaluate_val(Unigram(counts), {"h": stream}, *whole, tokenizer=tok)["h"]
        # the same text has the same bytes whatever the tokenizer (EOS is no text)
        assert uniform["bytes"] == n_bytes - len(tok.decode(stream.read(0, 1)).encode("utf-8"))
        assert uniform["bytes"] == text_bytes(tok, stream.read(1, len(stream) - 1))
        uniform_bits = math.log2(tok.vocab_size) * uniform["tokens"]
        assert uniform["bpb"] == pytest.approx(uniform_bits / uniform["bytes"], rel=1e-9)
        out[vocab] = (uniform["tokens"], unigram["loss"], unigram["bpb"])
    (t300, loss300, bpb300), (t2048, loss2048, bpb2048) = out[300], out[2048]
    assert t300 > 1.5 * t2048  # the larger vocabulary needs far fewer tokens for the same text ...
    assert loss2048 > 1.3 * loss300  # ... so its per-token losses are not comparable ...
    assert 1 / 1.4 < bpb300 / bpb2048 < 1.4  # ... but bits per byte are of the same size


class Confident(torch.nn.Module):
    """A model sure of token 0 by ~1e37 nats: every other target costs ~1e37 nats, finite in fp32."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.logits = torch.zeros(vocab_size)
        self.logits[0] = 1e37

    def forward(self, tokens):
        return self.logits.expand(*tokens.shape, -1)


def test_large_finite_losses_stay_finite_in_the_validation_sum(prepared):
    """Issue 19's overflow, validation side: 512 tokens of ~1e37 nats sum past fp32's 3.4e38; the sum is
    taken in float64, so the mean is the (finite) per-token loss, not inf."""
    shards, _ = prepared
    stream = TokenFiles(shards / "email" / "val")
    res = evaluate_val(Confident(512), {"email": stream}, 128, 4, 1, torch.device("cpu"))["email"]
    targets = np.concatenate([stream.read(k * 128 + 1, 128) for k in range(4)])
    expected = 1e37 * float((targets != 0).mean())  # log-sum-exp is 1e37; a target 0 costs 0
    assert math.isfinite(res["loss"]) and res["loss"] == pytest.approx(expected, rel=1e-5)
