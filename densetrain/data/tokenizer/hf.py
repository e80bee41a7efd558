"""A tiktoken encoding (ranks, split regex, special tokens) as a HF ``tokenizer.json`` that gives the same ids.

tiktoken and HF ``tokenizers`` both run byte-level BPE but describe it differently:

* tiktoken keeps *ranks* (token bytes -> id) and, within a piece of the split, repeatedly joins the
  adjacent pair whose joined bytes have the lowest rank; a piece that is itself a token is taken whole.
* HF BPE keeps a *vocab* (token string -> id) over GPT-2's byte-to-unicode alphabet and an ordered list of
  *merges*; ``ignore_merges=True`` takes a pre-token that is in the vocab whole, like tiktoken.

tiktoken may join *any* adjacent pair whose bytes form a token, so every split of a token into two tokens
is listed as a merge, all of them at the token's rank (merges in rank order; within one token, by the ranks
of the halves): HF then joins, at each step, a pair of the same lowest rank as tiktoken does. This is the
construction of transformers' ``convert_slow_tokenizer.TikTokenConverter`` (written anew here: transformers
is not a dependency). Only a tie can differ — two overlapping pairs that make the same token, where tiktoken
takes the left one — and none showed up when this was written: 20 MB of Python source and 3,000 random
mixed-script strings (Latin, Greek, Cyrillic, Hebrew/Arabic, Devanagari, Thai, kana, CJK, Hangul, emoji)
gave the same ids for GPT-2 (108,299 merges) and Llama 3 (280,147); tests/test_tokenizer.py keeps a
multilingual sample of that check.

The pipeline: ``Split`` with the encoding's own regex (``isolated``; HF's Oniguruma accepts tiktoken's
possessive quantifiers), then ``ByteLevel`` without its own regex or prefix space; ``ByteLevel`` decoder;
the special tokens as added tokens at their ids; no normalizer. A tokenizer with a BOS (Llama 3) gets
Meta's post-processor, which starts every encoding with it (as densetrain's shards start every document);
one without (GPT-2) gets none. :class:`densetrain.data.tokenizer.Tokenizer` itself never adds anything:
it encodes without the post-processor and the shard writer places BOS and EOS.
"""

from __future__ import annotations


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (openai/gpt-2 ``src/encoder.py``, also HF ByteLevel).

    The 188 bytes that are printable Latin-1 (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) stand for themselves;
    the other 68, in byte order, become ``chr(256)``, ``chr(257)``, ... (so a space, byte 32, is ``Ġ``).
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def tiktoken_to_hf_json(ranks: dict[bytes, int], special_tokens: dict[str, int], pat_str: str,
                        bos_token: str | None = None) -> str:
    """The HF ``tokenizer.json`` text of a tiktoken encoding.

    Args:
        ranks: token bytes -> rank (tiktoken's ``mergeable_ranks``); all 256 single bytes must be there.
        special_tokens: token -> id; ids follow the ranks without gaps (ours: GPT-2, Llama 3, cl100k-style
            encodings with gaps are refused).
        pat_str: the split regex.
        bos_token: the beginning-of-text token (one of ``special_tokens``) that every encoding starts
            with, as Meta's Llama 3 ``tokenizer.json`` does (a ``TemplateProcessing`` post-processor:
            ``<|begin_of_text|> $A``, a pair ``<|begin_of_text|> $A <|begin_of_text|> $B``), so that
            transformers' ``encode`` gives what densetrain's shards train on; None (GPT-2): no
            post-processor, nothing added.

    Raises:
        ValueError: a single byte has no rank, the special ids do not continue the ranks, or
            ``bos_token`` is not a special token.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    if any(bytes([b]) not in ranks for b in range(256)):
        raise ValueError("every single byte needs a rank for a byte-level BPE")
    n, n_special = len(ranks), len(special_tokens)
    if sorted(ranks.values()) != list(range(n)) or sorted(special_tokens.values()) != list(range(n, n + n_special)):
        raise ValueError("ranks must be 0..n-1 and special token ids must follow them without gaps")
    table = bytes_to_unicode()
    text = lambda b: "".join(table[x] for x in b)
    vocab = {text(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        halves = [(tok[:i], tok[i:]) for i in range(1, len(tok)) if tok[:i] in ranks and tok[i:] in ranks]
        merges += [(text(a), text(b)) for a, b in sorted(halves, key=lambda ab: (ranks[ab[0]], ranks[ab[1]]))]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pat_str), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # Added in id order, each takes the next id: n, n+1, ... (checked below).
    ordered = sorted(special_tokens.items(), key=lambda kv: kv[1])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, _ in ordered])
    if any(tok.token_to_id(t) != i for t, i in ordered):
        raise ValueError("special tokens did not land on their ids")
    if bos_token is not None:
        if bos_token not in special_tokens:
            raise ValueError(f"BOS {bos_token!r} is not one of the special tokens")
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token}:1 $B:1",
            special_tokens=[(bos_token, special_tokens[bos_token])])
    return tok.to_str(pretty=False)
