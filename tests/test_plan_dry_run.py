"""What ``train --dry-run`` prints is what a launch builds (issue 44 item 6): FSDP2's padded shards, the process
groups and their nodes, no PyTorch warnings about the fake process group, the nearest world sizes in words, and a
pipeline layout named as one."""

from __future__ import annotations

import math
import warnings

import pytest

from densetrain.cli import main
from densetrain.config import load_config
from densetrain.parallel.mesh import Layout
from densetrain.tools.plan.rank import dry_run_rank, format_rank
from densetrain.train.startlog import layout_words


def _cfg(*overrides):
    return load_config("tiny", overrides=[("eval.samples", 0), ("eval.final_tasks", ""), *overrides])


def test_fsdp2_rank_bytes_count_the_padding_to_the_largest_shard():
    cfg = _cfg(("parallel.dp_replicate", 1), ("parallel.dp_shard", -1), ("train.micro_batch_size", 1),
               ("train.batch_size", 24))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        last = dry_run_rank(cfg, 3, 2)
    # each parameter's dim 0 is split into ceil(rows / 3)-row shards; the last rank's shard is shorter, padded
    want = sum(4 * math.ceil(full[0] / 3) * math.prod(full[1:]) for _, full, _ in last["shards"])
    assert last["params_bytes"] == want == 3_789_836 and last["unpadded_bytes"] == 3_762_664
    assert "27,172 of them FSDP2's padding to the largest shard" in format_rank(last)
    assert not [w for w in caught if "timeout" in str(w.message).lower()], [str(w.message) for w in caught]


def test_groups_members_and_nodes_are_printed():
    cfg = _cfg(("parallel.dp_replicate", 1), ("parallel.dp_shard", -1), ("parallel.tp", 2), ("parallel.pp", 2),
               ("train.micro_batch_size", 1), ("train.batch_size", 32))
    r = dry_run_rank(cfg, 16, 5, gpus_per_node=8)
    # mesh (pp 2, dp_shard 4, tp 2), tp innermost: rank 5 = pp 0, dp 2, tp 1
    assert r["groups"] == {"pp": [5, 13], "dp_shard": [1, 3, 5, 7], "tp": [4, 5]}
    text = format_rank(r)
    assert "pp group: ranks 5, 13 on nodes 0-1" in text and "tp group: ranks 4-5 on node 0" in text
    assert "dp_shard group: ranks 1, 3, ..., 7 (stride 2) on node 0" in text
    assert "pipeline parallel: 2 stages" in text.splitlines()[0] and "node 0 (8 GPUs a node)" in text


def test_pipeline_layout_is_not_one_process():
    assert layout_words(Layout(1, 1, 1, 1, 4)) == "pipeline parallel: 4 stages"
    assert layout_words(Layout(1, 1, 1)) == "one process, no parallelism"


@pytest.mark.parametrize("args, want", [
    (["--world-size", "3", "--rank", "0"], "tp 2 = 2 processes per model replica does not divide 3 processes; the "
                                           "nearest world sizes that run it are 2 or 4"),
    (["--world-size", "7", "--ranks", "0,1"], "does not divide 7 processes; the nearest world sizes that run it are 6 "
                                              "or 8"),
])
def test_a_world_size_that_does_not_divide_the_layout_names_the_nearest(capsys, args, want):
    assert main(["train", "--preset", "tiny", "--dry-run", "--parallel.tp=2", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and want in err[0] and "{" not in err[0], err


def test_dry_run_plan_without_a_world_size_says_it_is_one_process(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", "--preset", "tiny", "--dry-run", "--parallel.tp=2"]) == 2  # it cannot run as one process
    cap = capsys.readouterr()
    out = cap.out
    assert "densetrain: error: stage 'main' ([parallel]): " in cap.err
    line = next(x for x in out.splitlines() if x.startswith("configured layout"))
    assert "does not divide 1 process (no --world-size or WORLD_SIZE given" in line and "{" not in line
    assert "nearest world sizes that run it are 2" in line


# Issue 40 item 4: plan and the dry run refuse, after printing the plan, what the configured layouts cannot run.

_OWN_LAYOUT = """
[eval]
samples = 0
final_tasks = ""

[[stages]]
name = "main"
start = 0.0

[[stages]]
name = "anneal"
start = 0.85

[[stages]]
name = "long_context"
start = 0.95
seq_len = 1024
parallel = { pp = 4, dp_replicate = 1 }
"""


def test_plan_judges_each_stage_on_its_own_layout(capsys, tmp_path):
    path = tmp_path / "own.toml"
    path.write_text(_OWN_LAYOUT)
    assert main(["plan", "--preset", "tiny", "--config", str(path), "--gpus", "2"]) == 2
    cap = capsys.readouterr()
    assert "configured layout of stage 'main' ([parallel], dp_replicate=2 dp_shard=1 tp=1): runs" in cap.out
    assert cap.err.strip().splitlines() == [
        "densetrain: error: stage 'long_context' (stages[2].parallel): parallel.pp (4) must divide the world size 2"]
    assert main(["plan", "--preset", "tiny", "--config", str(path), "--gpus", "2", "--json"]) == 2
    import json

    d = json.loads(capsys.readouterr().out)
    assert [s["configured"]["runs"] for s in d["stages"]] == [True, True, False]
    assert d["refusals"] == ["stage 'long_context' (stages[2].parallel): parallel.pp (4) must divide the world size 2"]


def test_plan_refuses_as_the_dry_run_does_a_pipeline_with_too_few_micro_batches(capsys):
    flags = ["--parallel.pp=2", "--parallel.dp_replicate=1", "--train.batch_size=4", "--train.micro_batch_size=4",
             "--eval.samples=0", "--eval.final_tasks="]
    assert main(["train", "--preset", "tiny", "--dry-run", "--world-size", "2", *flags]) == 2
    dry = capsys.readouterr().err.strip().splitlines()
    assert main(["plan", "--preset", "tiny", "--gpus", "2", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and err[0] == dry[0].removesuffix(" (see densetrain train --help)"), (err, dry)
    assert "stage 'main' ([parallel]): pp=2 dp_replicate=1 dp_shard=1 tp=1 cannot run it: parallel.pp (2) needs " \
        "at least 2 micro-batches per rank and step; a rank has 1" in err[0]


def test_a_rank_over_the_device_memory_exits_2_naming_the_stage(capsys):
    cfg = _cfg(("parallel.dp_replicate", 1), ("parallel.dp_shard", -1))
    need = dry_run_rank(cfg, 2, 0)["planned"]["main"]["total"] / 2**30
    run = ["train", "--preset", "tiny", "--dry-run", "--world-size", "2", "--rank", "0", "--parallel.dp_replicate=1",
           "--parallel.dp_shard=-1", "--eval.samples=0", "--eval.final_tasks="]
    # usable = 0.92 x memory - 1 GiB (the planner's budget): a device just over the need runs, just under refuses
    fits = (need + 1.0) / 0.92 * 1.001
    assert main([*run, "--gpu-memory-gib", str(fits)]) == 0
    capsys.readouterr()
    assert main([*run, "--gpu-memory-gib", str(fits / 1.002)]) == 2
    cap = capsys.readouterr()
    assert "planned at stage 'main'" in cap.out  # the plan is printed before the refusal
    assert f"densetrain: error: rank 0, stage 'main': needs {need:.2f} GiB, over the device's" in cap.err


def test_the_8b_preset_on_8_ranks_refuses_its_ddp_rank(capsys):
    # the review's case: every rank holds the whole 8B model's fp32 state and AdamW moments (DDP, the preset's
    # [parallel] before it became FSDP2); the preset's own layout fits
    assert main(["train", "--preset", "llama3-8b", "--dry-run", "--world-size", "8", "--rank", "0",
                 "--gpu-memory-gib", "80"]) == 0
    capsys.readouterr()
    assert main(["train", "--preset", "llama3-8b", "--dry-run", "--world-size", "8", "--rank", "0",
                 "--gpu-memory-gib", "80", "--parallel.dp_replicate=-1", "--parallel.dp_shard=1"]) == 2
    err = capsys.readouterr().err
    assert "rank 0, stage 'main': needs 172.53 GiB, over the device's 80 GiB (72.6 GiB usable)" in err
