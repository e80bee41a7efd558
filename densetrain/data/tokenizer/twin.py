"""The tiktoken twin of a byte-level BPE tokenizer.json: a tiktoken ``Encoding`` built from the file's
vocabulary and merges that encodes batches 4-6x faster than HF ``tokenizers`` (0.07 vs 0.37 CPU-s per
MB of FineWeb text, one thread), used by :class:`densetrain.data.tokenizer.core.Tokenizer` only where
the checks of :func:`tiktoken_twin` find it gives HF's ids. Also the per-process record of which files'
twins passed their probe (:func:`checked_twins`, :func:`trust_twins`), which the prepare workers inherit.
"""

from __future__ import annotations

import hashlib
import json

from densetrain.data.tokenizer.named import SCHEMES

_CHECKED_TWINS: set[str] = set()
"""sha256 of the tokenizer.json files whose twin passed the probe (step 3 of :func:`tiktoken_twin`) in
this process, or in the parent that started it (:func:`trust_twins`): a twin built again skips it."""


def checked_twins() -> tuple[str, ...]:
    """The tokenizer.json sha256s whose tiktoken twin passed its probe in this process (for workers)."""
    return tuple(sorted(_CHECKED_TWINS))


def trust_twins(sha256s) -> None:
    """Take the probe of these tokenizer.json files' twins as passed (a worker told by its parent,
    :func:`checked_twins`): the probe of a 128k vocabulary costs ~1.8 CPU-s per process."""
    _CHECKED_TWINS.update(sha256s)

CHECK_EVERY = 32
"""With a tiktoken twin, :meth:`densetrain.data.tokenizer.core.Tokenizer.encode_batch` re-encodes every
32nd text with HF and compares (~3% of HF's cost; the twin is 4-6x faster than HF on FineWeb's pages)."""

TWIN_PROBE = (
    "Hello world! It's, isn't, we'll, they've, I'm, she'd, 'S 'LL ’s O'Neil's rock 'n' roll.\n"
    "  two  spaces,\ttab,\t\ttabs, trailing   \n\n\nthree newlines\r\n\r\nCRLF \x0b\x0c\x1c\x1d\x1e\x1f\x85 "
    "nbsp\u00a0x \u2000\u2009\u200a\u2028\u2029\u202f\u205f\u3000 zero\u200bwidth \u200c\u200d\ufeff\u180e\n"
    "3.14159 1,000,000 ١٢٣ ४५६ ௧௨ 一二三 ⅓ ² ①  Ⅻ 0x1F 1e-9 $5 €5 50% #hash @at <|endoftext|> </s>\n"
    "机器学习，中文标点！日本語のテキスト、カタカナ。한국어 문장. Привет, мир! Ελληνικά. مرحبا بالعالم. हिन्दी पाठ। "
    "ภาษาไทย ქართული Հայերեն ትግርኛ ᏣᎳᎩ ꦗꦮ 𓀀𓁐 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟘𝟙\n"
    "e\u0301 a\u0308\u0323 \u0915\u094d\u0937 emoji 🙂🦙👍🏽 👨‍👩‍👧 🇫🇷 #️⃣ Ꙋ🦙 🫠🪿 \U000e0041 \ue000 \U0010fffd \ufffd\n"
    "def f(x):\n    return x**2  # comment\n\tif a != b: pass\n{\"json\": [1, 2.5, null]}\n"
    "... …… --- — – ‘quoted’ “double” «guillemets» (paren) [bracket] {brace} a/b\\c |pipe| ~tilde^ `tick`"
)
"""Text the twin must encode as HF does before it is used: contractions (the regex's case-sensitive
``'s``), every kind of Unicode whitespace (where regex engines' ``\\s`` differ), digits of other
scripts, combining marks, emoji sequences, astral and private-use characters, code."""


TWIN_SPLIT_REGEXES = frozenset(sc.pat_str for sc in SCHEMES.values())
"""The ``Split`` regexes a twin may have: GPT-2's and Llama 3's (:data:`densetrain.data.tokenizer.named.SCHEMES`),
whose pieces in HF's Oniguruma and tiktoken's fancy-regex agree on every code point of planes 0-1 and a
sample above, in contexts of letters, digits, marks, apostrophes and spaces (tests/test_tokenizer_twin.py,
``byte_pair_tokenizer``). Another regex is refused, not probed: the engines read the same text
differently (``$`` and ``^`` are line anchors in Oniguruma, text anchors in fancy-regex: ``[ab]+$|.|\\n``
splits ``"ab\\nab"`` into ``ab|\\n|ab`` in one, ``a|b|\\n|ab`` in the other), and a probe shows that only
where the vocabulary has a token across the difference."""


def tiktoken_twin(tok, data: bytes, probe: bool = True):
    """A tiktoken ``Encoding`` that gives the ids of the HF tokenizer ``tok`` (its tokenizer.json
    ``data``), or None where the checks below find a difference or do not apply.

    tiktoken runs byte-level BPE as "within each piece of the split regex, join the adjacent pair whose
    joined bytes have the lowest rank" (a piece that is a token is taken whole); HF BPE joins the pair
    that comes first in its merge list. With ranks = ids and merges listed in id order the two agree
    except where tiktoken could join two tokens whose concatenation is a token made from another pair
    (HF never does). Rather than assume, the twin is used only when, in this order:

    1. the file is plain byte-level BPE: no normalizer; the pre-tokenizer GPT-2's ``ByteLevel``
       (``use_regex``, no prefix space: the regex :data:`densetrain.data.tokenizer.named.GPT2_PAT`
       matches the same pieces) or a ``Split`` regex (isolated) of :data:`TWIN_SPLIT_REGEXES` followed by
       ``ByteLevel`` without its regex (the tokenizer.json densetrain exports for tiktoken files); BPE
       without dropout, unknown token, subword prefix/suffix or byte fallback; every added token special
       (they are plain text here: ``encode_special_tokens``);
    2. every vocab entry maps to bytes, all 256 bytes are tokens, every longer token is made by a
       merge, and the merges come in non-decreasing id order;
    3. (``probe``) it gives HF's ids for every vocab token that is valid UTF-8, on its own (where a joined pair
       makes a token that HF makes from another pair, the token itself usually shows it:
       tests/test_tokenizer_twin.py), special tokens of the model's vocabulary included (HF's BPE with
       ``ignore_merges`` gives a piece spelling one its id), and for :data:`TWIN_PROBE`.

    These checks find differences, they do not prove there are none (a neighbour can take a
    token's first bytes in a longer piece), so
    :meth:`densetrain.data.tokenizer.core.Tokenizer.encode_batch` still checks a sample of every batch.
    """
    try:
        import tiktoken
    except ImportError:  # pragma: no cover - tiktoken is a dependency
        return None
    from densetrain.data.tokenizer.hf import bytes_to_unicode
    from densetrain.data.tokenizer.named import GPT2_PAT

    try:
        d = json.loads(data)
        model, pre = d.get("model") or {}, d.get("pre_tokenizer") or {}
        if d.get("normalizer") is not None or model.get("type") != "BPE":
            return None
        if model.get("dropout") or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix") \
                or model.get("byte_fallback"):
            return None
        if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
            pat = GPT2_PAT
        elif (pre.get("type") == "Sequence" and len(pre.get("pretokenizers") or []) == 2
              and pre["pretokenizers"][0].get("type") == "Split"
              and pre["pretokenizers"][0].get("behavior") == "Isolated" and not pre["pretokenizers"][0].get("invert")
              and "Regex" in (pre["pretokenizers"][0].get("pattern") or {})
              and pre["pretokenizers"][1].get("type") == "ByteLevel"
              and not pre["pretokenizers"][1].get("use_regex", True)
              and not pre["pretokenizers"][1].get("add_prefix_space")):
            pat = pre["pretokenizers"][0]["pattern"]["Regex"]
            if pat not in TWIN_SPLIT_REGEXES:
                return None
        else:
            return None
        added = d.get("added_tokens") or []
        if not all(t.get("special") for t in added):
            return None
        specials = {t["content"] for t in added}
        to_byte = {c: b for b, c in bytes_to_unicode().items()}
        vocab = {t: i for t, i in model["vocab"].items() if t not in specials}
        # a special token in the model's vocabulary: HF's BPE takes a piece that spells it whole (ignore_merges)
        special_pieces = [bytes(to_byte[c] for c in t) for t in model["vocab"]
                          if t in specials and all(c in to_byte for c in t)]
        ranks = {bytes(to_byte[c] for c in t): i for t, i in vocab.items()}
        if len(ranks) != len(vocab) or any(bytes([b]) not in ranks for b in range(256)):
            return None
        made, last = set(), -1
        for m in model.get("merges") or []:
            a, b = m.split(" ", 1) if isinstance(m, str) else m
            i = vocab.get(a + b)
            if i is None or i < last:
                return None
            made.add(i)
            last = i
        if any(len(t) > 1 and i not in made for t, i in ranks.items()):
            return None
        enc = tiktoken.Encoding(f"twin:{hashlib.sha256(data).hexdigest()[:12]}", pat_str=pat,
                                mergeable_ranks=ranks, special_tokens={})
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if not probe:
        return enc
    pieces = [t.decode("utf-8") for t in (*ranks, *special_pieces) if _utf8(t)]
    probe = [TWIN_PROBE, *TWIN_PROBE.split("\n"), *pieces]
    fn = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
    want = [e.ids for e in fn(probe, add_special_tokens=False)]
    if [enc.encode_ordinary(t) for t in probe] != want:
        return None
    return enc


def twin_for(tok, data: bytes, sha256: str):
    """:func:`tiktoken_twin` of ``tok`` (its tokenizer.json ``data``, whose hash is ``sha256``), probed only
    the first time this process (or its parent, :func:`trust_twins`) builds a twin of that file."""
    twin = tiktoken_twin(tok, data, probe=sha256 not in _CHECKED_TWINS)
    if twin is not None:
        _CHECKED_TWINS.add(sha256)
    return twin


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
