"""Distributed bug classes other frameworks shipped (torchtitan, OLMo-core, Megatron-LM user reports), checked against
densetrain where no other test did (docs/training_bugs.md, the "Distributed" table; its number in brackets):

- [7] a rank that raises alone (an out-of-memory error mid-step; FSDP2, pp 2) ends every rank at once, its error said
  once, the waiting rank in one line (under pp a traceback before);
- [6] activation checkpointing inside compiled blocks gives the plain gradients ('full' crashed in dynamo), and
  'full' in compiled tensor-parallel blocks, which torch cannot run, is refused in one line;
- [4] which rows of a global batch each rank reads, against its real mesh groups (ddp, fsdp x tp, cp x dp, pp x dp);
- [3] the loop's evaluation under FSDP2 leaves no parameter gathered and no gradient (it left 12 gathered).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import forked
import pytest
import torch
from conftest import gloo_env, run_script_ranks
from test_resume import OV, fresh

from densetrain.config import load_config, save_config
from densetrain.errors import ConfigError
from densetrain.model.init import build_model
from densetrain.parallel import build_parallel_model, init_distributed

ROOT = Path(__file__).resolve().parents[1]

# The CLI on one rank whose model forward raises torch's out-of-memory error at its ``n``-th call (a rank that
# fails alone while the others are in, or on their way to, a collective).
_RAISING_RANK = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
import torch
from densetrain.model.llama import Transformer
if os.environ["RANK"] == sys.argv[2]:
    forward, calls, at = Transformer.forward, [0], int(sys.argv[3])
    def failing(self, *a, **k):
        calls[0] += 1
        if calls[0] == at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return forward(self, *a, **k)
    Transformer.forward = failing
sys.argv = ["densetrain", "train", *sys.argv[4:]]
from densetrain.cli import entry
entry()
"""


@pytest.mark.parametrize("layout", [{"parallel.dp_shard": 2},
                                    {"parallel.pp": 2, "model.tie_embeddings": False, "eval.samples": 0}],
                         ids=["fsdp2", "pp2"])
def test_a_rank_that_raises_alone_ends_every_rank_and_names_its_error_once(layout, prepared, tmp_path):
    _, make = prepared
    cfg = make(tmp_path, **{**OV, "train.steps": 6, "parallel.dp_replicate": 1, **layout, "parallel.timeout_s": 300})
    script = tmp_path / "raising.py"
    script.write_text(_RAISING_RANK)
    env = {**gloo_env(2), "PYTHONPATH": str(ROOT)}
    procs = [forked.Popen([sys.executable, str(script), str(ROOT), "1", "5", *fresh(cfg, tmp_path)], cwd=ROOT,
                          env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, text=True, stdout=forked.PIPE,
                          stderr=forked.PIPE) for r in range(2)]
    # Not a timed test: a rank left waiting would wait parallel.timeout_s (300 s), past communicate's 120 s.
    outs = [p.communicate(timeout=120) for p in procs]
    (out0, err0), (out1, err1) = outs
    assert [p.returncode for p in procs] == [1, 1], [e[-3000:] for _, e in outs]
    # said once, by its rank (under pp as the cause of torch's "[Stage 1] failed to run forward")
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB" in err1.splitlines()
    assert sum((o + e).count("OutOfMemoryError: CUDA") for o, e in outs) == 1
    last = err0.strip().splitlines()[-1]
    # pp: a traceback before (a pipeline's send/recv was no collective the line knew)
    assert re.fullmatch(r"densetrain: error: \[rank 0\] collective .+ in \w+\.py:\d+ \w+\(\) failed: "
                        r"connection closed by peer; rank\(s\) not arriving: 1 \(host \S+, pid "
                        rf"{procs[1].pid}: the process is dead .*\)", last), err0[-3000:]
    assert "Traceback" not in err0


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_inside_compiled_blocks_gives_the_plain_gradients(mode):
    # 'full' with compile_blocks raised in dynamo ("checkpoint not implemented for LazyVariableTracker context_fn")
    cfg = load_config(preset="tiny", overrides=[("model.vocab_size", 64), ("model.d_model", 32), ("model.n_layers", 2),
                                                ("model.n_heads", 4), ("model.n_kv_heads", 2), ("model.d_ff", 64),
                                                ("train.device", "cpu"), ("train.dtype", "fp32"),
                                                ("parallel.activation_checkpointing", mode),
                                                ("parallel.compile_blocks", True)])
    plain = build_model(cfg.model, cfg.train.seed, "cpu")
    model, step_model = build_parallel_model(cfg, init_distributed("cpu", cfg.parallel))
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    for m in (plain, step_model):
        m(x).logsumexp(-1).mean().backward()
    grads = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None and grads[name].grad.abs().max() > 0, name
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-7, msg=name)


def test_full_recomputation_inside_compiled_tensor_parallel_blocks_is_refused_in_one_line():
    with pytest.raises(ConfigError) as e:
        load_config(preset="tiny", overrides=[("parallel.dp_replicate", 1), ("parallel.tp", 2),
                                              ("parallel.activation_checkpointing", "full"),
                                              ("parallel.compile_blocks", True)])
    assert str(e.value).startswith("parallel.activation_checkpointing = 'full' with parallel.compile_blocks (or "
                                   "train.compile) under parallel.tp (2) > 1 fails") and "\n" not in str(e.value)


# Each layout of 4 ranks in turn, in the same processes (as a stage's layout switch builds them): this rank's rows of
# a global batch of 8 (what compute_step reads) and the members of each of its mesh groups.
_ROWS = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
import torch.distributed as dist
from densetrain.config.schema import ParallelConfig
from densetrain.parallel import init_distributed
from densetrain.train.step import batch_rows
res = {}
for name, degrees in json.loads(sys.argv[2]).items():
    info = init_distributed("cpu", ParallelConfig(**degrees))
    groups = {d: dist.get_process_group_ranks(info.mesh[d].get_group()) for d in info.mesh.mesh_dim_names}
    res[name] = {"rows": list(batch_rows(info, 8)), "groups": groups}
with open(f"{sys.argv[3]}.{dist.get_rank()}", "w") as f:
    json.dump(res, f)
dist.destroy_process_group()
"""
ROW_LAYOUTS = {"ddp": {"dp_replicate": 4}, "fsdp2_tp2": {"dp_replicate": 1, "dp_shard": 2, "tp": 2},
               "cp2_dp2": {"dp_replicate": 2, "cp": 2}, "pp2_dp2": {"dp_replicate": 2, "pp": 2}}


def test_data_parallel_ranks_read_different_rows_and_their_tp_cp_pp_peers_the_same(tmp_path):
    out = run_script_ranks(_ROWS, tmp_path, "rows", world=4, args=(json.dumps(ROW_LAYOUTS),))
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(4)]
    for name in ROW_LAYOUTS:
        got = [r[name] for r in ranks]
        for me, mine in enumerate(got):
            for dim, members in mine["groups"].items():
                rows = [got[m]["rows"] for m in members]
                if dim in ("dp_replicate", "dp_shard"):  # gradients averaged over these: different rows each
                    assert len({tuple(x) for x in rows}) == len(members), (name, me, dim, rows)
                else:  # tp, cp, pp: one data-parallel rank's share, the same rows
                    assert all(x == mine["rows"] for x in rows), (name, me, dim, rows)
        # every row of the batch is read, by as many ranks as share a data-parallel rank
        shares = {tuple(g["rows"]) for g in got}
        assert sorted(i for s in shares for i in s) == list(range(8)), (name, shares)
        assert len(shares) == {"ddp": 4, "fsdp2_tp2": 2, "cp2_dp2": 2, "pp2_dp2": 2}[name]


# The loop's evaluation of a set-up FSDP2 run at step 0 (validation is due), then which parameters are still gathered.
_EVAL = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
import torch
from torch.distributed.tensor import DTensor
from densetrain.config import load_config
from densetrain.metrics import read_metrics
from densetrain.schedule import stage_at
from densetrain.train.loop import enter_stage, evaluate
from densetrain.train.setup import setup
run = setup(load_config(path=sys.argv[2]))
st = stage_at(0, run.stages)
enter_stage(run, st)
evaluate(run, st)
res = {"gathered": [n for n, p in run.model.named_parameters() if not isinstance(p, DTensor)],
       "grads": [n for n, p in run.model.named_parameters() if p.grad is not None],
       "val": [r for r in read_metrics(run.run_dir) if r["kind"] == "eval"]}
run.log.close()
with open(f"{sys.argv[3]}.{run.info.rank}", "w") as f:
    json.dump(res, f)
torch.distributed.destroy_process_group()
sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
"""


def test_an_evaluation_under_fsdp2_leaves_no_gathered_parameters_and_no_gradients(prepared, tmp_path):
    _, make = prepared
    cfg = make(tmp_path, **{**OV, "parallel.dp_replicate": 1, "parallel.dp_shard": 2, "eval.every": 5,
                            "eval.max_batches": 2})
    path = tmp_path / "cfg.toml"
    save_config(cfg, path)
    out = run_script_ranks(_EVAL, tmp_path, "eval", world=2, args=(str(path),))
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    assert ranks[0]["val"] and ranks[0]["val"][0]["step"] == 0  # the validation ran (rank 0 writes metrics)
    for r in ranks:
        # before: the root group (embedding, final norm, head) and the last block stayed gathered on every rank
        assert r["gathered"] == [] and r["grads"] == [], r
