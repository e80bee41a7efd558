"""Text units the quality filters count: words, sentences, lines, punctuation.

FineWeb's filters (datatrove 0.10, the implementation FineWeb ran: ``examples/fineweb.py``) count
*tokens* of a word tokenizer, not whitespace words: for English datatrove loads a blank spaCy
``en`` tokenizer (``datatrove/utils/word_tokenizers.py``, ``assets/tokenizer_assignment.csv``),
which splits punctuation, clitics and hyphens off words, and spaCy's rule-based ``sentencizer``
for sentences. Gopher's alpha-word and symbol ratios divide by that token count (a comma is a
"word"), and its stop words are matched on those tokens, so whitespace words would move the
decisions. :func:`split_words` re-implements the tokenizer's algorithm (Honnibal et al., spaCy 3
``Tokenizer``: split on whitespace, then peel prefixes and suffixes, keep special cases, split
infixes) with English's affix rules (``spacy/lang/punctuation.py``, ``char_classes.py``) in our own
code, with no spaCy dependency. Known differences, on purpose (rare, measured in
tests/test_filters_parity.py): spaCy's ~1,000 English special cases are reduced to the clitic rules
(``n't``, ``'re``, ``'ve``, ``'ll``, ``'m``, ``'d``) and the abbreviations that end in a period;
apostrophe-less forms ('dont', 'gonna', '10am') stay one word; URLs are recognised by '://' or a
'www.' start only.
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache

# --------------------------------------------------------------------------------------------------
# Character sets
# --------------------------------------------------------------------------------------------------


def _from_ranges(spec: str) -> frozenset[str]:
    """Characters of space-separated hex code points and ``A-B`` ranges."""
    out: set[str] = set()
    for part in spec.split():
        a, _, b = part.partition("-")
        out.update(map(chr, range(int(a, 16), int(b or a, 16) + 1)))
    return frozenset(out)


TERMINAL_PUNCTUATION: frozenset[str] = _from_ranges(
    "0021 002E 003F 0589 061D-061F 06D4 0700-0702 07F9 0837 0839 083D-083E 0964-0965 104A-104B 1362 "
    "1367-1368 166E 1735-1736 17D4-17D6 17D9-17DA 1803 1809 1944-1945 1AA8-1AAB 1B5A-1B5B 1B5E-1B5F "
    "1B7D-1B7E 1C3B-1C3C 1C7E-1C7F 203C-203D 2047-2049 2E2E 2E3C 2E53-2E54 3002 A4FF A60E-A60F A6F3 A6F7 "
    "A876-A877 A8CE-A8CF A92F A9C8-A9C9 AA5D-AA5F AAF0-AAF1 ABEB FE52 FE56-FE57 FF01 FF0E FF1F FF61 "
    "10A56-10A57 10F55-10F59 10F86-10F89 11047-11048 110BE-110C1 11141-11143 111C5-111C6 111CD "
    "111DE-111DF 11238-11239 1123B-1123C 112A9 1144B-1144C 115C2-115C3 115C9-115D7 11641-11642 "
    "1173C-1173E 11944 11946 11A42-11A43 11A9B-11A9C 11C41-11C42 11EF7-11EF8 11F43-11F44 16A6E-16A6F "
    "16AF5 16B37-16B38 16B44 16E98 1BC9F 1DA88")
"""Sentence-ending marks: Unicode 15.0's ``Sentence_Terminal`` property (PropList.txt) plus the
Khmer signs U+17D6, U+17D9, U+17DA, the set datatrove 0.10 uses (``TERMINAL_PUNCTUATION``) for
FineWeb's line-punctuation rule."""
TERMINAL_MARKS: tuple[str, ...] = tuple(sorted(TERMINAL_PUNCTUATION))
""":data:`TERMINAL_PUNCTUATION` as a tuple, for ``str.endswith``."""

SYMBOL_CHARS: frozenset[str] = frozenset(
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~«´»–—’“”„…∶━►、。〈〉《》「」【】！％（），．１：；？～"
    + "".join(map(chr, (*range(0, 9), 11, 12, *range(13, 32), *range(127, 160))))) | TERMINAL_PUNCTUATION
"""Characters a token may consist of and still not be a word (Gopher's word count and mean word
length count only tokens with another character): ASCII punctuation, common CJK and typographic
punctuation, C0/C1 controls and :data:`TERMINAL_PUNCTUATION`: datatrove 0.10's ``PUNCTUATION_SET``
(it includes the full-width digit '１'; '•', '©' and '€' are words there, and so here)."""

SENTENCE_MARKS: frozenset[str] = TERMINAL_PUNCTUATION - _from_ranges("17D6 17D9-17DA 1B7D-1B7E 2E53-2E54 11F43-11F44")
"""Tokens after which spaCy's ``sentencizer`` starts a sentence (its ``default_punct_chars``:
Unicode 13's Sentence_Terminal characters)."""

# --------------------------------------------------------------------------------------------------
# Word tokens (spaCy's English tokenizer algorithm)
# --------------------------------------------------------------------------------------------------

_PUNCT = "…,:;!?¿؟¡()[]{}<>_#*&。？！，、；：～·।،۔؛٪"
"""spaCy ``char_classes._punct``: split off either end of a word."""
_QUOTES = "'\"”“`‘´’‚,„»«「」『』（）〔〕【】《》〈〉〈〉⟦⟧"
"""spaCy ``char_classes._quotes``."""
_CURRENCY = "$£€¥฿₽﷼₴" + "".join(map(chr, range(0x20A0, 0x20C0)))
"""spaCy ``char_classes._currency`` (single characters; 'US$', 'C$', 'A$' end in '$')."""
_PREFIX_CHARS = frozenset(_PUNCT + _QUOTES + _CURRENCY + "§%=—–")
_SUFFIX_CHARS = frozenset(_PUNCT + _QUOTES + "—–")
_UNITS = sorted(("km km² km³ m m² m³ dm dm² dm³ cm cm² cm³ mm mm² mm³ ha µm nm yd in ft kg g mg µg t lb oz m/s "
                 "km/h kmh mph hPa Pa mbar mb MB kb KB gb GB tb TB T G M K % км км² км³ м м² м³ дм дм² дм³ "
                 "см см² см³ мм мм² мм³ нм кг г мг м/с км/ч кПа Па мбар Кб КБ кб Мб МБ мб Гб ГБ гб Тб ТБ тб "
                 "كم كم² كم³ م م² م³ سم سم² سم³ مم مم² مم³ كم غرام جرام جم كغ ملغ كوب اكواب").split(),
                key=len, reverse=True)
"""spaCy ``char_classes._units``: split off a number ('5km' -> '5', 'km'), longest first."""
_UNIT_SET = frozenset(_UNITS)
_ABBREVIATIONS = frozenset(
    "Adm. Ak. Ala. Apr. Ariz. Ark. Aug. Bros. Calif. Co. Colo. Conn. Corp. D.C. Dec. Del. Dr. E.G. E.g. Feb. Fla. "
    "Ga. Gen. Gov. I.E. I.e. Ia. Id. Ill. Inc. Ind. Jan. Jr. Jul. Jun. Kan. Kans. Ky. La. Ltd. Mar. Mass. Md. "
    "Messrs. Mich. Minn. Miss. Mo. Mont. Mr. Mrs. Ms. Mt. N.C. N.D. N.H. N.J. N.M. N.Y. Neb. Nebr. Nev. Nov. "
    "Oct. Okla. Ore. Pa. Ph.D. Prof. Rep. Rev. S.C. Sen. Sep. Sept. St. Tenn. Va. Wash. Wis. a.m. co. e.g. i.e. "
    "p.m. v.s. vs. ä. ö. ü.".split()) | {f"{c}." for c in "abcdefghijklmnopqrstuvwxyz"}
"""spaCy's English special cases that end in a period: kept whole ('Mr.' is one token, no
sentence ends there)."""
_WHOLE = frozenset(
    "'' ): (: (; (= )-: (-: (-; :) :( :* :/ :> :] :| :} :-) :-( :-* :-/ :-> :-] :-| :-} :)) :(( ;) ;-) ;_; "
    "=( =) =/ =[ =] =| [: [-: [= ]= ^_^ -_- ._. <.< >.< >.> @_@ :'( :') \\\") "
    "'s 'S 'd 'll 're 'em 'cause 'Cause 'bout 'nuff 'cos 'Cos 'coz 'Coz 'cuz 'Cuz "
    "doin' Doin' goin' Goin' havin' Havin' lovin' Lovin' nothin' Nothin' nuthin' Nuthin' somethin' Somethin' "
    "ol' Ol' and/or :P :p :x :o :O :D :-D :-P :-p 8) 8-) xD XD".split()) | _ABBREVIATIONS
_WHOLE = _WHOLE | {w.replace("'", "’") for w in _WHOLE}
"""spaCy's English special cases kept as one token: emoticons, clitics standing alone, dropped-g
forms ('doin'') and the abbreviations."""
_MERGE = frozenset(w for w in _WHOLE if not any(c.isalnum() for c in w) and len(w) > 1)
"""Special cases that spaCy 3 also re-forms from affix tokens ('f():' -> 'f', '(', '):')."""
_SPLIT = {w: (w[:-2], w[-2:]) for w in (
    "aint arent cant couldnt darent didnt doesnt dont hadnt hasnt havent isnt maynt mightnt mustnt neednt "
    "oughtnt shant shouldnt wasnt werent wont wouldnt").split()}
_SPLIT.update({w: (w[:-1], w[-1:]) for w in "im id hes shes thats whats theres heres".split()})
_SPLIT.update({w: (w[:-2], w[-2:]) for w in "ive youre theyre youve weve theyve youll theyll itll youd theyd".split()})
_SPLIT.update({"cannot": ("can", "not"), "gonna": ("gon", "na"), "gotta": ("got", "ta"), "yall": ("y", "all")})
"""spaCy's English special cases that split a word without an apostrophe ('dont' -> 'do', 'nt')."""
_AUX = "ai are ca could dare did does do had has have is may might must need ought sha should was were wo would"
_PRONOUNS = ("i you he she it we they that there here what who where when why how this these those "
             "could would should must might")  # the modals take "'ve": "would've" -> 'would', "'ve"
_CLITIC = re.compile(rf"(?i)^(?:({'|'.join(_AUX.split())})(n['’]t)"
                     rf"|({'|'.join(_PRONOUNS.split())})(['’](?:re|ve|ll|m|d)))$")
"""English clitics of spaCy's special cases: "n't" after an auxiliary, "'re", "'ve", "'ll", "'m",
"'d" after a pronoun ("don't" -> 'do', "n't"; "we'll" -> 'we', "'ll")."""
_DOT_AFTER = frozenset("0123456789%²-+" + _PUNCT + _QUOTES)
"""Characters after which spaCy splits a final '.' off (besides lowercase letters)."""


def _icon(ch: str) -> bool:
    """spaCy's ICONS (dingbats, emoji): Unicode category So."""
    return unicodedata.category(ch) == "So"


def _lower(ch: str) -> bool:
    """spaCy ALPHA_LOWER: lowercase letters and letters of scripts without case."""
    return ch.islower() or (ch.isalpha() and not ch.isupper())


def _upper(ch: str) -> bool:
    """spaCy ALPHA_UPPER: uppercase letters and letters of scripts without case."""
    return ch.isupper() or (ch.isalpha() and not ch.islower())


def _prefix_len(s: str) -> int:
    """Length of the prefix spaCy would split off ``s`` (0: none)."""
    c = s[0]
    if s.startswith(".."):
        return len(s) - len(s.lstrip("."))
    if s.startswith(("US$", "C$", "A$")):
        return 3 if s[0] == "U" else 2
    if c in _PREFIX_CHARS or _icon(c):
        return 1
    if c == "+" and not (len(s) > 1 and s[1].isdigit()):
        return 1
    return 0


def _suffix_len(s: str) -> int:
    """Length of the suffix spaCy would split off ``s`` (0: none)."""
    c = s[-1]
    if s.endswith(".."):
        return len(s) - len(s.rstrip("."))
    if c in _SUFFIX_CHARS or _icon(c):
        return 1
    if len(s) > 2 and s[-2] in "'’" and c in "sS":
        return 2
    prev = s[-2] if len(s) > 1 else ""
    if c == "+" and prev.isdigit():
        return 1
    if c == "." and len(s) > 2 and s[-3] == "°" and prev in "FfCcKk":
        return 1
    if prev.isdigit() and c in _CURRENCY:
        return 1
    if c == "." and len(s) > 1 and (prev in _DOT_AFTER or _lower(prev)
                                    or (len(s) > 2 and _upper(prev) and _upper(s[-3]))):
        return 1
    if c != ".":
        # the longest unit that follows a digit ends the string: the first digit whose tail is a unit
        for k, ch in enumerate(s[:-1]):
            if ch.isdigit() and s[k + 1:] in _UNIT_SET:
                return len(s) - k - 1
    return 0


_INFIX = re.compile(
    r"\.\.+|…"
    r"|(?<=[0-9])[+\-*^](?=[0-9-])"
    r"|(?<=[^\W_])(?:---|--|——|[-–—~])(?=[^\W\d_])"
    r"|(?<=[^\W\d_]),(?=[^\W\d_])"
    r"|(?<=[^\W_])[:<>=/](?=[^\W\d_])"
    r"|\.")
"""spaCy's English ``TOKENIZER_INFIXES``: ellipses, '+-*^' between digits, hyphens and ',' between
letters, ':<>=/' between a letter or digit and a letter; a bare '.' is kept only where spaCy splits
it (:func:`_infixes`); icons are found by :func:`_icon`."""
_QUOTE_CHARS = frozenset(_QUOTES)


def _infixes(s: str) -> list[str]:
    """``s`` split at spaCy's English infixes; each infix becomes a token of its own."""
    marks = [(m.start(), m.end()) for m in _INFIX.finditer(s)]
    marks += [(i, i + 1) for i, ch in enumerate(s) if _icon(ch)]
    pieces: list[str] = []
    start = 0
    for a, b in sorted(marks):
        if a < start:
            continue  # overlaps the previous infix
        if s[a:b] == "." and not (0 < a and b < len(s) and (_lower(s[a - 1]) or s[a - 1] in _QUOTE_CHARS)
                                  and (_upper(s[b]) or s[b] in _QUOTE_CHARS)):
            continue  # '.' splits only between a lowercase letter/quote and an uppercase letter/quote
        if a > start:
            pieces.append(s[start:a])
        pieces.append(s[a:b])
        start = b
    if start < len(s):
        pieces.append(s[start:])
    return pieces


def _split_chunk(chunk: str, out: list[str]) -> None:
    """Append the tokens of one whitespace-free ``chunk`` to ``out``."""
    suffixes: list[str] = []
    s = chunk
    while s:
        if s in _WHOLE or s.lower() in _SPLIT:
            break
        n = _prefix_len(s)
        if n and n < len(s) or n == len(s) and len(s) == 1:
            out.append(s[:n])
            s = s[n:]
            continue
        if n == len(s):  # an all-prefix chunk such as '...'
            out.append(s)
            s = ""
            break
        n = _suffix_len(s)
        if n and n < len(s):
            suffixes.append(s[-n:])
            s = s[:-n]
            continue
        break
    if s:
        pieces = [s] if s in _WHOLE or "://" in s or s.startswith("www.") else _infixes(s)
        if len(pieces) > 1:  # spaCy matches special cases on the whole string only, not on infix parts
            out.extend(pieces)
        elif (m := _CLITIC.match(s)) and not (s[1:].isupper() and len(s) > 3 and not s.isupper()):
            out.append(m.group(1) or m.group(3))
            out.append(m.group(2) or m.group(4))
        elif (low := s.lower()) in _SPLIT and (s.islower() or s[1:].islower()):
            a, _ = _SPLIT[low]
            out.append(s[:len(a)])
            out.append(s[len(a):])
        else:
            out.append(s)
    out.extend(reversed(suffixes))


_CHUNK_TOKENS: dict[str, tuple[str, ...]] = {}
"""Tokens of each whitespace-free chunk seen lately: web text repeats its words (Zipf), so most
chunks are split once per worker; cleared when it holds :data:`_CHUNK_CACHE_SIZE` chunks."""
_CHUNK_CACHE_SIZE = 1 << 18


def _chunk_tokens(chunk: str) -> tuple[str, ...]:
    """The tokens of one whitespace-free ``chunk`` (:func:`_split_chunk`, then special cases
    re-formed), cached in :data:`_CHUNK_TOKENS`."""
    if (chunk.isalpha() or chunk.isdigit()) and chunk.lower() not in _SPLIT:  # most words: nothing to split
        tokens: tuple[str, ...] = (chunk,)
    elif (len(chunk) > 1 and chunk[:-1].isalpha() and chunk not in _WHOLE
          and (chunk[-1] in _SUFFIX_CHARS or chunk[-1] == "." and _lower(chunk[-2]))):
        # a word and one mark ('word,' 'word.'): _split_chunk peels the mark (a suffix character, or a
        # '.' after a lowercase letter) and goes on with the word as if it were the chunk; the word's
        # tokens hold letters, so no special case forms across them and the mark
        tokens = (_CHUNK_TOKENS.get(chunk[:-1]) or _chunk_tokens(chunk[:-1])) + (chunk[-1],)
    else:
        out: list[str] = []
        _split_chunk(chunk, out)
        tokens = tuple(_merge_specials(out) if len(out) > 1 else out)
    if len(_CHUNK_TOKENS) >= _CHUNK_CACHE_SIZE:
        _CHUNK_TOKENS.clear()
    _CHUNK_TOKENS[chunk] = tokens
    return tokens


@lru_cache(maxsize=2)
def split_words(text: str) -> tuple[str, ...]:
    """The word tokens of ``text`` as datatrove's English tokenizer gives them (see the module
    docstring): ``"Don't stop... (yet)!"`` -> ``('Do', "n't", 'stop', '...', '(', 'yet', ')', '!')``.

    Cached for the last two documents: Gopher repetition, Gopher quality and FineWeb's newline
    rule tokenize the same text one after the other; each chunk between whitespace is split once
    (:data:`_CHUNK_TOKENS`), one dictionary look-up per chunk after that.
    """
    return tuple(_tokens(text))


def _tokens(text: str) -> list[str]:
    """:func:`split_words` uncached (for lines, which would push documents out of its cache)."""
    get = _CHUNK_TOKENS.get
    return [t for chunk in text.split() for t in (get(chunk) or _chunk_tokens(chunk))]


def count_words(text: str) -> int:
    """``len(split_words(text))`` without building the tuple (FineWeb's newline rule)."""
    get = _CHUNK_TOKENS.get
    return sum(len(get(chunk) or _chunk_tokens(chunk)) for chunk in text.split())


def _merge_specials(tokens: list[str]) -> list[str]:
    """Join runs of 2-3 punctuation tokens of one chunk that spell a special case ("''", '):')."""
    merged: list[str] = []
    i = 0
    while i < len(tokens):
        for k in (3, 2):
            if i + k <= len(tokens) and "".join(tokens[i:i + k]) in _MERGE:
                merged.append("".join(tokens[i:i + k]))
                i += k
                break
        else:
            merged.append(tokens[i])
            i += 1
    return merged


def is_punct_token(token: str) -> bool:
    """spaCy's ``is_punct``: every character is Unicode punctuation (category P*)."""
    return all(unicodedata.category(c).startswith("P") for c in token)


def count_sentences(line: str) -> int:
    """Sentences in one line as spaCy's ``sentencizer`` splits them (datatrove's English
    ``split_into_sentences``): a sentence ends at a token in :data:`SENTENCE_MARKS` and the next one
    starts at the next token that is not punctuation. 0 for a line without tokens."""
    tokens = _tokens(line)
    if not tokens:
        return 0
    n, seen_mark = 1, False
    for t in tokens:
        if t in SENTENCE_MARKS:
            seen_mark = True
        elif seen_mark and not is_punct_token(t):
            n += 1
            seen_mark = False
    return n
