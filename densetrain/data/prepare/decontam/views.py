"""The benchmark text of evaluation examples, as the decontamination index sees it: the views of a
multiple-choice example (:func:`example_views`: ``gold``, ``question``, ``choices``, ``lettered``)
and of a GSM8K / HumanEval problem (:func:`problem_text`), for every shipped evaluation split of a
task (:func:`split_sources`). Why these views: :mod:`densetrain.data.prepare.decontam.build`.
"""

from __future__ import annotations

import os
import re
import string
from pathlib import Path

from densetrain.data.prepare.decontam.index import VIEW_NAMES
from densetrain.registry import gen_tasks, prompts, task_files, tasks
from densetrain.registry.gen_tasks import GEN_TASKS
from densetrain.registry.prompts import question_answer
from densetrain.registry.task_files import data_root, read_rows
from densetrain.registry.tasks import TASKS, load_examples

FORMATTING_SOURCES = tuple(Path(m.__file__) for m in (gen_tasks, prompts, task_files, tasks))
"""The registry modules whose code shapes the texts above (prompts, rows, problems): part of the index's
cache key, so that an edit of a prompt rebuilds the index instead of reusing a stale one."""


def template_parts() -> tuple[str, str]:
    """The words our prompt template puts around a question (``'Question: '``, ``'\\nAnswer:'``)."""
    pre, post = question_answer("\0").split("\0")
    return pre, post


def _strip_template(context: str, template: tuple[str, str]) -> str:
    pre, post = template
    if context.startswith(pre) and context.endswith(post):
        return context[len(pre) : len(context) - len(post)]
    return context


def example_text(ex, template: tuple[str, str] | None = None) -> str:
    """The benchmark text of one :class:`~densetrain.registry.tasks.Example`: the gold choice's context
    and continuation, without the ``Question: ... \\nAnswer:`` template words (the ``gold`` view)."""
    return _strip_template(ex.contexts[ex.label], template or template_parts()) + ex.continuations[ex.label]


_TRAILING_WORD = re.compile(r"[^\W_]*$")


def question_and_choices(ex, template: tuple[str, str] | None = None) -> tuple[str, tuple[str, ...]]:
    """The question of one :class:`~densetrain.registry.tasks.Example` as the benchmark writes it, and its
    choices in order (stripped).

    The question is the shared context without the template words; for partial scoring (Winogrande:
    context ``i`` = the sentence up to the blank + option ``i``, one shared continuation = the rest
    of the sentence) it is the sentence with the blank left out, i.e. the raw row's sentence with
    ``_`` removed, and the options are what follows the contexts' common prefix cut back to a word
    start. (Options that begin with the same whole word would leave that word in the sentence; none of
    the 1,267 shipped Winogrande rows do.)
    """
    template = template or template_parts()
    if len(set(ex.contexts)) == 1:
        return _strip_template(ex.contexts[0], template), tuple(c.strip() for c in ex.continuations)
    cut = _TRAILING_WORD.search(os.path.commonprefix(ex.contexts)).start()
    return ex.contexts[0][:cut].rstrip() + ex.continuations[0], tuple(c[cut:].strip() for c in ex.contexts)


def example_views(ex, template: tuple[str, str] | None = None) -> dict[str, str]:
    """The :data:`VIEWS` of one :class:`~densetrain.registry.tasks.Example`: ``gold`` (:func:`example_text`),
    ``question`` and its ``choices`` (:func:`question_and_choices`) as ``question + "\\n" + one choice
    per line``, and the same with ``"A. "``, ``"B. "``, ... before each choice (``lettered``)."""
    template = template or template_parts()
    question, choices = question_and_choices(ex, template)
    return {
        "gold": example_text(ex, template),
        "question": question,
        "choices": question + "\n" + "\n".join(choices),
        "lettered": question + "\n" + "\n".join(f"{letter}. {c}" for letter, c in zip(string.ascii_uppercase, choices)),
    }


def problem_text(problem, template: tuple[str, str] | None = None) -> str:
    """The benchmark text of one GSM8K / HumanEval :class:`~densetrain.registry.gen_tasks.Problem`:
    HumanEval's prompt and canonical solution; GSM8K's question (the last block of the shipped
    context, after the 8 exemplar shots, without the template words) and worked answer."""
    if problem.entry_point:
        return problem.prompt + problem.continuation
    pre, post = template or template_parts()
    question = problem.context.rsplit("\n\n", 1)[-1].removeprefix(pre).removesuffix(post)
    return question + problem.continuation


EVAL_SPLITS = ("validation", "test", "dev")
"""Splits indexed when the package ships them next to a task's folders (never ``train``: training on
a benchmark's training split is allowed)."""


def split_sources(name: str) -> list[tuple[str, dict[str, list[str]], list[tuple[tuple[str, ...], int]] | None]]:
    """[(split, {view: one text per example}, [(choices, gold label)] or None)] of one task: for a
    multiple-choice task its :data:`VIEWS` but ``nearby`` and each example's choices, the scored
    split first (``load_examples`` order), then the other :data:`EVAL_SPLITS` shipped next to all of
    its folders (rows in folder order); for GSM8K / HumanEval the ``gold`` view of their test
    problems (file order).

    A lettered task ``<task>_mc`` whose cloze twin ``<task>`` reads the same folders is viewed through
    the twin's examples: the benchmark rows are the same, and the twin's contexts hold the question
    and choices apart, where the ``_mc`` prompt already mixes in our letters and ``Answer:``.
    """
    template = template_parts()
    if name not in TASKS:  # resolve_tasks vetted it: a GSM8K / HumanEval task
        return [("test", {"gold": [problem_text(p, template) for p in GEN_TASKS[name].load()]}, None)]
    twin = name.removesuffix("_mc")
    if twin in TASKS and (TASKS[twin].folders, TASKS[twin].interleave) == (TASKS[name].folders, TASKS[name].interleave):
        name = twin
    task = TASKS[name]

    def views(examples) -> tuple[dict[str, list[str]], list[tuple[tuple[str, ...], int]]]:
        examples = list(examples)
        per_example = [example_views(ex, template) for ex in examples]
        items = [(question_and_choices(ex, template)[1], ex.label) for ex in examples]
        return {v: [d[v] for d in per_example] for v in VIEW_NAMES if v != "nearby"}, items

    scored = Path(task.folders[0]).name
    out = [(scored, *views(load_examples(name)))]
    root = data_root()
    for split in EVAL_SPLITS:
        if split == scored:
            continue
        folders = [str(Path(f).parent / split) for f in task.folders]
        if all((root / f).is_dir() for f in folders):
            out.append((split, *views(task.make(r) for f in folders for r in read_rows(f))))
    return out
