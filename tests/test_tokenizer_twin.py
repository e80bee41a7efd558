"""The tiktoken twin of a byte-level BPE tokenizer.json (``Tokenizer.tiktoken_twin``): used only where it
gives HF ``tokenizers``' ids, refused where it does not, and ``encode_batch`` giving HF's ids either way."""

from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path

import pytest

from densetrain.data.tokenizer import Tokenizer, load_tokenizer, train_bpe
from densetrain.data.tokenizer.twin import CHECK_EVERY, TWIN_PROBE, checked_twins, trust_twins

STDLIB = Path(sysconfig.get_paths()["stdlib"])
FINEWEB = next((p / "shared/data/fineweb_sample" for p in Path(__file__).resolve().parents[1:4]
                if (p / "shared/data/fineweb_sample").is_dir()), Path("absent"))

RANGES = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF), (0x900, 0x97F),
          (0xE00, 0xE7F), (0x1100, 0x11FF), (0x2000, 0x206F), (0x3000, 0x30FF), (0x4E00, 0x4FFF),
          (0xAC00, 0xAD00), (0xFE00, 0xFFFD), (0x1F300, 0x1F6FF), (0x1D400, 0x1D7FF), (0xE0000, 0xE007F)]


def random_texts(n: int, seed: int = 0) -> list[str]:
    """Mixed-script strings with every kind of whitespace, apostrophes and digits between the letters."""
    rng = random.Random(seed)
    extra = list(" \t\n\r\x0b\x0c\x85\u00a0\u2028\u3000'’0123456789") + ["'s", "'LL", " 's", "\r\n"]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 40)):
            if rng.random() < 0.3:
                parts.append(rng.choice(extra))
            else:
                a, b = rng.choice(RANGES)
                parts.append("".join(chr(rng.randint(a, b)) for _ in range(rng.randint(1, 6))))
        out.append("".join(parts))
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Tokenizer:
    """A byte-level BPE (vocab 2048) trained on Python's email and json packages."""
    texts = [p.read_text(encoding="utf-8", errors="replace") for d in ("email", "json")
             for p in sorted((STDLIB / d).rglob("*.py"))]
    return train_bpe(texts, 2048, tmp_path_factory.mktemp("twin") / "tokenizer.json")


def hf_ids(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [tok.encode(t) for t in texts]


def test_trained_bpe_has_a_twin_with_hf_ids(trained):
    assert trained.tiktoken_twin is not None
    texts = [TWIN_PROBE, *random_texts(400), "<|endoftext|> is text here", "",
             (STDLIB / "json" / "decoder.py").read_text(encoding="utf-8")]
    got = trained.encode_batch(texts)
    assert got == hf_ids(trained, texts)
    assert got[0] == trained.tiktoken_twin.encode_ordinary(TWIN_PROBE)  # the twin's own ids, not a fallback
    assert trained.decode(got[0]) == TWIN_PROBE


@pytest.mark.skipif(not FINEWEB.is_dir(), reason="the shared FineWeb sample is not on this machine")
def test_twin_gives_hf_ids_on_fineweb(trained):
    import pyarrow.parquet as pq

    texts = pq.read_table(sorted(FINEWEB.glob("*.parquet"))[0], columns=["text"]).column("text").to_pylist()
    twin = trained.tiktoken_twin
    assert [twin.encode_ordinary(t) for t in texts] == trained._hf_batch(texts)


@pytest.fixture(scope="module")
def exported_gpt2(tmp_path_factory) -> Tokenizer:
    """The tokenizer.json densetrain writes for GPT-2's rank file (Split + ByteLevel, ignore_merges)."""
    path = tmp_path_factory.mktemp("gpt2") / "tokenizer.json"
    path.write_text(load_tokenizer("gpt2", ".").hf_json(), encoding="utf-8")
    return Tokenizer.from_file(path)


def test_exported_tokenizer_json_has_a_twin(exported_gpt2):
    """The tokenizer.json densetrain writes for a tiktoken file; GPT-2's (Llama 3's also has one, measured
    by hand: its 128,256-token probe takes ~10 s here)."""
    name, tok = "gpt2", exported_gpt2
    assert tok.tiktoken_twin is not None
    texts = random_texts(100, seed=1)
    assert tok.encode_batch(texts) == hf_ids(tok, texts) == load_tokenizer(name, ".").encode_batch(texts)


def _edited(trained: Tokenizer, tmp_path: Path, edit) -> Tokenizer:
    d = json.loads(Path(trained.name).read_text(encoding="utf-8"))
    edit(d)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(d), encoding="utf-8")
    return Tokenizer.from_file(path)


def ghost(d: dict, x: str = "x", q: str = "q", z: str = "z") -> None:
    """A merge list where tiktoken joins a pair that HF has no merge for: 'xq' + 'z' makes 'xqz', but
    'qz' is merged first, so HF stops at 'x', 'qz' while tiktoken takes the token 'xqz' whole."""
    vocab, merges = d["model"]["vocab"], d["model"]["merges"]
    n = max(vocab.values()) + 1
    vocab.update({q + z: n, x + q: n + 1, x + q + z: n + 2})
    merges += [[q, z], [x, q], [x + q, z]]


def test_twin_refused_where_tiktoken_would_differ(trained, tmp_path):
    tok = _edited(trained, tmp_path, ghost)
    assert tok.encode("xqz") == [tok._impl.token_to_id("x"), tok._impl.token_to_id("qz")]
    assert tok.tiktoken_twin is None  # the vocabulary probe found it
    texts = ["xqz xqz", *random_texts(20)]
    assert tok.encode_batch(texts) == hf_ids(tok, texts)


@pytest.mark.parametrize("edit", [
    lambda d: d.update(normalizer={"type": "NFC"}),
    lambda d: d["model"].update(end_of_word_suffix="</w>"),
    lambda d: d["model"]["merges"].reverse(),  # merges out of id order
    lambda d: d["model"]["vocab"].update({"Ġzqxj": max(d["model"]["vocab"].values()) + 1}),  # made by no merge
    lambda d: d.update(pre_tokenizer={"type": "Whitespace"}),
])
def test_twin_refused_for_other_tokenizers(trained, tmp_path, edit):
    tok = _edited(trained, tmp_path, edit)
    assert tok.tiktoken_twin is None
    texts = random_texts(10, seed=2)
    assert tok.encode_batch(texts) == hf_ids(tok, texts)


def test_a_batch_that_disagrees_in_its_spot_check_is_encoded_by_hf(trained):
    """Whatever the twin says, a batch whose sampled texts differ from HF's ids is HF's: here the twin is
    swapped for GPT-2's tiktoken encoding, which gives other ids for everything."""
    tok = Tokenizer.from_file(trained.name)
    tok._twin = load_tokenizer("gpt2", ".")._impl
    texts = random_texts(2 * CHECK_EVERY, seed=3)
    assert tok.encode_batch(texts) == hf_ids(tok, texts)


def test_a_parent_checked_twin_skips_the_probe_and_the_spot_check_still_holds(trained, tmp_path):
    """Workers trust their parent's probe (``checked_twins`` -> ``trust_twins``): a file trusted wrongly
    (the ghost merge above, which the probe refuses) gets a twin, and batches still come out as HF's."""
    assert trained.tiktoken_twin is not None and trained.sha256 in checked_twins()
    tok = _edited(trained, tmp_path, lambda d: ghost(d, "j", "v", "k"))  # another file than the test above's
    trust_twins([tok.sha256])
    assert tok.tiktoken_twin is not None  # no probe: built as trusted
    assert tok.tiktoken_twin.encode_ordinary("jvk") != tok.encode("jvk")  # and wrong
    texts = ["jvk " * 3] * CHECK_EVERY
    assert tok.encode_batch(texts) == hf_ids(tok, texts)


CONTEXTS = ("a{c}b {c}1{c}'{c}s {c}{c} x{c}\u0301 {c}  {c}\n{c}'S{c}\t", "{c}", " {c} ", "٣{c}²{c}Ⅻ{c}〇{c}一")


def adversarial_texts(seed: int = 0, per_category: int = 25) -> list[str]:
    """Code points of every Unicode general category (unassigned ones too: newer than a regex engine's
    tables) next to letters, digits, marks, apostrophes and whitespace, and texts at the regexes' edges."""
    import unicodedata

    rng = random.Random(seed)
    by_cat: dict[str, list[int]] = {}
    for c in range(0, 0x110000, 7):  # every 7th code point: all 30 categories, in ~0.1 s
        by_cat.setdefault(unicodedata.category(chr(c)), []).append(c)
    picks = [c for cat in sorted(by_cat) for c in rng.sample(by_cat[cat], min(per_category, len(by_cat[cat])))]
    texts = [form.format(c=chr(c)) for c in picks for form in CONTEXTS if not 0xD800 <= c < 0xE000]
    return texts + [
        "", " ", "  ", "a ", "a  ", "a \n", " \n ", "\n\n \n", "a\u00a0 b", "x" * 5000, "ab" * 3000, "é" * 2000,
        "1" * 3000, " " * 3000 + "a", "\t\n " * 500, "<|endoftext|>", "a<|endoftext|>b", "</s><s> <|end_of_text|>",
        "\x00\x01\x02 \x00", "'S 'LL 'Ve 'RE 'D 'M 'T 'ſ", "’s ’S", "👨‍👩‍👧‍👦 ❤️ ☺︎ 🏳️‍🌈", "e\u0301\u0301\u0301",
        "9\u0301", "'\u0301s", " '\u0301s", "a\u2028b\u2029c\u3000d\u200be", " \u0301 \u0301\u0301", "\u00a0\u00a0x",
    ]


@pytest.mark.parametrize("which", ["trained", "gpt2"])
def test_twin_gives_hf_ids_on_every_unicode_category(request, which):
    """The twin alone (no spot check) against HF on adversarial texts (all 1.1M code points in these
    contexts gave HF's ids on the prepare demo's BPE 8192)."""
    tok = request.getfixturevalue("exported_gpt2" if which == "gpt2" else "trained")
    texts = adversarial_texts()
    assert [tok.tiktoken_twin.encode_ordinary(t) for t in texts] == tok._hf_batch(texts)


def byte_pair_tokenizer(path: Path, pre_tokenizer: str) -> Tokenizer:
    """A BPE of every byte pair around the ASCII context bytes of :data:`CONTEXTS` (and of any two non-ASCII
    bytes), merged in a random order: a piece boundary that differs between HF's and the twin's split regex
    shows in the ids, where a trained vocabulary rarely has a token across it."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    from densetrain.data.tokenizer.hf import bytes_to_unicode
    from densetrain.data.tokenizer.named import SCHEMES

    bu = bytes_to_unicode()
    ctx = set(b"abxsS1'\n\t \xcc\x81")
    pairs = [(x, y) for x in range(256) for y in range(256) if x in ctx or y in ctx or min(x, y) >= 0x80]
    random.Random(0).shuffle(pairs)
    vocab = {bu[b]: b for b in range(256)} | {bu[x] + bu[y]: 256 + i for i, (x, y) in enumerate(pairs)}
    hf = HFTokenizer(models.BPE(vocab, [(bu[x], bu[y]) for x, y in pairs]))
    if pre_tokenizer == "bytelevel":  # the trained BPE's: HF's own GPT-2 regex
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:  # the exported tokenizer.json's (and Meta's Llama 3 one's)
        hf.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SCHEMES[pre_tokenizer].pat_str), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<|endoftext|>"])
    hf.save(str(path))
    return Tokenizer.from_file(path)


@pytest.mark.parametrize("pre_tokenizer", ["bytelevel", "gpt2", "llama3"])
def test_twin_splits_as_hf_on_every_unicode_category(tmp_path, pre_tokenizer):
    """The regexes' character classes (``\\p{L}``, ``\\p{N}``, ``\\s``, ``(?i:'s)``) in Oniguruma and fancy-regex,
    seen through the byte-pair vocabulary (scanned by hand on every code point of planes 0-1 and every 16th
    / 64th above: no difference; it does see a character moved into another class)."""
    tok = byte_pair_tokenizer(tmp_path / "tokenizer.json", pre_tokenizer)
    assert tok.tiktoken_twin is not None
    texts = adversarial_texts(seed=6, per_category=5)
    assert [tok.tiktoken_twin.encode_ordinary(t) for t in texts] == tok._hf_batch(texts)


def test_lone_surrogates_encode_as_tiktoken_does_wherever_they_are_in_a_batch(trained):
    """json.loads gives a str with a lone surrogate for '"a\\ud800b"'; HF refuses it (TypeError), tiktoken
    encodes U+FFFD. Either way a text's ids must not depend on whether the spot check sampled it."""
    odd = ["a\ud800b", "\udc00", "x\udfff y", "\ud83d\ude00 ok", "\ude00\ud83d"]
    fixed = ["a\ufffdb", "\ufffd", "x\ufffd y", "\U0001f600 ok", "\ufffd\ufffd"]
    want = [trained.encode(t) for t in fixed]
    assert [trained.encode(t) for t in odd] == want
    assert [trained.tiktoken_twin.encode_ordinary(t) for t in odd] == want
    got = trained.encode_batch(odd + ["plain"] * CHECK_EVERY + odd)  # sampled at 0, not at CHECK_EVERY + 5
    assert got[:5] == got[-5:] == want
    gpt2 = load_tokenizer("gpt2", ".")  # the other kind: tiktoken itself
    assert gpt2.encode("a\ud800b") == gpt2.encode("a\ufffdb")


def test_twin_refused_for_a_split_regex_the_engines_read_differently(tmp_path):
    """``$`` is a line anchor in HF's Oniguruma, a text anchor in tiktoken's fancy-regex: the same Split regex
    gives other pieces, which no probe of this vocabulary would show."""
    import tiktoken
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    from densetrain.data.tokenizer.hf import bytes_to_unicode

    bu = bytes_to_unicode()
    pat = r"[ab]+$|.|\n"
    hf = HFTokenizer(models.BPE({**{bu[b]: b for b in range(256)}, "ab": 256}, [("a", "b")]))
    hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pat), "isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<|endoftext|>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_file(tmp_path / "tokenizer.json")
    naive = tiktoken.Encoding("naive", pat_str=pat, special_tokens={},
                              mergeable_ranks={**{bytes([b]): b for b in range(256)}, b"ab": 256})
    texts = ["ab\nab", *random_texts(2 * CHECK_EVERY, seed=4)]
    assert tok.encode("ab\nab") == [256, 10, 256] != naive.encode_ordinary("ab\nab") == [97, 98, 10, 256]
    assert tok.tiktoken_twin is None
    assert tok.encode_batch(texts) == hf_ids(tok, texts)


def test_twin_refused_where_hf_takes_a_special_token_spelled_by_a_piece(trained, tmp_path):
    """With ``ignore_merges`` HF's BPE looks a whole piece up in the vocabulary, special tokens included."""
    def add(d):
        n = max(d["model"]["vocab"].values()) + 1
        d["model"].update(ignore_merges=True)
        d["model"]["vocab"]["zzzz"] = n
        d["added_tokens"].append({"id": n, "content": "zzzz", "single_word": False, "lstrip": False,
                                  "rstrip": False, "normalized": False, "special": True})
    tok = _edited(trained, tmp_path, add)
    assert tok.encode("(zzzz") == [tok._impl.token_to_id("("), tok._impl.token_to_id("zzzz")]
    assert tok.tiktoken_twin is None
    texts = ["zzzz", *random_texts(10, seed=5)]
    assert tok.encode_batch(texts) == hf_ids(tok, texts)


def test_truncation_and_padding_in_the_file_are_ignored(trained, tmp_path):
    """A tokenizer.json saved with truncation (max_length 4) and padding: HF would cut every document to 4
    tokens and pad the short ones; densetrain encodes them whole, on the twin as for the plain file."""
    def cut_and_pad(d):
        d["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
        d["padding"] = {"strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                        "pad_type_id": 0, "pad_token": "<|endoftext|>"}
    tok = _edited(trained, tmp_path, cut_and_pad)
    texts = ["a text that is longer than four tokens for sure", "a", *random_texts(CHECK_EVERY, seed=7)]
    assert tok.tiktoken_twin is not None
    assert tok.encode_batch(texts) == trained.encode_batch(texts) == hf_ids(trained, texts)
    assert len(tok.encode(texts[0])) > 4


def test_the_scale_path_ignores_them_too(trained, tmp_path):
    """datatrove's DocumentTokenizer (the scale path, :class:`TokenizeStep`) encodes with the file as saved:
    a tokenizer.json with truncation (max_length 4) cut every document there to 4 tokens + EOS."""
    pytest.importorskip("datatrove")
    from densetrain.data.prepare.scale.steps import TokenizeStep

    def cut_and_pad(d):
        d["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
        d["padding"] = {"strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                        "pad_type_id": 0, "pad_token": "<|endoftext|>"}
    edited = _edited(trained, tmp_path, cut_and_pad)
    texts = ["a text that is longer than four tokens for sure", "a"]

    def ids(path):
        step = TokenizeStep(str(tmp_path / "out"), tokenizer_name_or_path=str(path), eos_token=trained.eos_token)
        return [e.ids for e in step.tokenizer.encode_batch(texts)]

    got = ids(edited.name)
    assert got == ids(trained.name)
    assert got == [[*t, trained.eos_id] for t in hf_ids(trained, texts)] and len(got[0]) > 5
