"""The BOS of a tokenizer.json, so that evaluation requests start with it (not with the EOS): named by a
``tokenizer_config.json`` next to it, by the post-processor (Hugging Face's Llama 3 tokenizer.json), or
a known BOS special token. densetrain's own llama3 export round trip is in tests/test_tokenizer.py."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from densetrain.data.tokenizer import load_tokenizer
from densetrain.evals.scoring import encode_pair, start_token

TEXT = "The capital of France is"
EOS, BOS = "<|end_of_text|>", "<|begin_of_text|>"


def _save(tmp_path, specials: list[str], post=None) -> str:
    """A small real byte-level BPE (trained on a few sentences) with ``specials`` at ids 0.., saved as
    tmp_path/tokenizer.json."""
    t = HFTokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator([TEXT, "Paris is the capital of France.", "Rome is the capital of Italy."] * 5,
                          trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if post is not None:
        t.post_processor = post(t)
    t.save(str(tmp_path / "tokenizer.json"))
    return str(tmp_path / "tokenizer.json")


def test_bos_from_a_llama3_style_post_processor(tmp_path):
    # Meta's Llama 3 tokenizer.json: Sequence[ByteLevel, TemplateProcessing "<|begin_of_text|> $A"].
    path = _save(tmp_path, ["<|reserved|>", EOS, "<|later|>", BOS], post=lambda t: processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                      special_tokens=[(BOS, t.token_to_id(BOS))])]))
    assert json.loads(open(path).read())["post_processor"]["type"] == "Sequence"
    tok = load_tokenizer(path, tmp_path)
    assert (tok.bos_id, tok.bos_token, tok.eos_id) == (3, BOS, 1)
    req = encode_pair(tok, TEXT, " Paris")
    assert req.tokens[0] == start_token(tok) == 3
    assert 3 not in tok.encode(TEXT)  # the post-processor's BOS is never added to documents


@pytest.mark.parametrize("bos_entry", ["<s>", {"content": "<s>", "special": True}])
def test_bos_from_tokenizer_config_json_wins(tmp_path, bos_entry):
    path = _save(tmp_path, ["</s>", "<unk>", "<s>"])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos_entry, "eos_token": "</s>"}))
    tok = load_tokenizer(path, tmp_path)
    assert (tok.bos_id, tok.eos_id) == (2, 0) and encode_pair(tok, TEXT, " Paris").tokens[0] == 2


def test_a_tokenizer_json_without_bos_still_starts_with_eos(tmp_path):
    tok = load_tokenizer(_save(tmp_path, ["<|endoftext|>", "<pad>"]), tmp_path)
    assert tok.bos_id is None and start_token(tok) == tok.eos_id == 0
    assert "bos_id" not in tok.identity()  # the identity of a BOS-less tokenizer is what it always was
    (tmp_path / "tokenizer_config.json").write_text("{not json")  # only consulted for the BOS: ignored
    assert load_tokenizer(str(tmp_path / "tokenizer.json"), tmp_path).bos_id is None
