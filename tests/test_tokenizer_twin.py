"""The tiktoken twin of a byte-level BPE tokenizer.json (``Tokenizer.tiktoken_twin``): used only where it
gives HF ``tokenizers``' ids, refused where it does not, and ``encode_batch`` giving HF's ids either way."""

from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path

import pytest

from densetrain.data.tokenizer import Tokenizer, load_tokenizer, train_bpe
from densetrain.data.tokenizer.core import CHECK_EVERY, TWIN_PROBE, checked_twins, trust_twins

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


def test_exported_tokenizer_json_has_a_twin(tmp_path):
    """The tokenizer.json densetrain writes for a tiktoken file (Split + ByteLevel, ignore_merges); GPT-2's
    (Llama 3's also has one, measured by hand: its 128,256-token probe takes ~10 s here)."""
    name = "gpt2"
    path = tmp_path / "tokenizer.json"
    path.write_text(load_tokenizer(name, ".").hf_json(), encoding="utf-8")
    tok = Tokenizer.from_file(path)
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
