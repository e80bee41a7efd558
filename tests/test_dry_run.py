"""The dry run of one rank of a large job (densetrain/tools/plan/rank.py) and the planner's pipeline terms
(densetrain/tools/plan/), on the llama3-405b preset: Meta's 16,384-GPU layout (TP 8, PP 16 interleaved
with 2 stages per rank, FSDP2 over 128), every rank built on a fake process group on the meta device."""

from __future__ import annotations

import pytest

from densetrain.cli import main
from densetrain.config import load_config
from densetrain.tools.plan import layout_plan
from densetrain.tools.plan.rank import dry_run_rank, parse_ranks
from densetrain.tools.plan.report import layout_plan_json, refusals


@pytest.fixture(scope="module")
def big():
    return load_config("llama3-405b")


def test_ranks_of_the_405b_layout_hold_their_stages_and_the_planned_bytes(big):
    first, middle, last = (dry_run_rank(big, 16384, r) for r in parse_ranks("0,8195,-1", 16384))
    # Rank 0: pipeline rank 0 holds stages 0 and 16 of 32 (4 layers each: the embedding + blocks 0-2, 63-66).
    assert first["coords"] == {"pp": 0, "dp": 0, "cp": 0, "tp": 0} and first["stages"] == [0, 16]
    assert first["embedding"] and not first["head"] and first["blocks"] == [0, 1, 2, *range(63, 67)]
    # 8195 = 8 * 1024 + 3: pipeline rank 8, tensor-parallel rank 3, blocks 31-34 and 95-98.
    assert middle["coords"] == {"pp": 8, "dp": 0, "cp": 0, "tp": 3} and middle["stages"] == [8, 24]
    assert middle["blocks"] == [*range(31, 35), *range(95, 99)] and not middle["embedding"] and not middle["head"]
    assert last["coords"] == {"pp": 15, "dp": 127, "cp": 0, "tp": 7} and last["head"] and len(last["blocks"]) == 7
    shapes = {name: (full, local) for name, full, local in middle["shards"]}
    # wq: column-wise over tp 8 (2048 rows), then FSDP2 over 128 ranks (16 rows); w2 row-wise (6656 columns).
    assert shapes["layers.31.attention.wq.weight"] == ((16384, 16384), (16, 16384))
    assert shapes["layers.31.feed_forward.w2.weight"] == ((16384, 53248), (128, 6656))
    for r in (first, middle, last):  # what the rank built is what the planner counts for that pipeline rank
        planned = r["planned"]["main"]
        if r is last:  # FSDP2 splits the head's 16032 rows per tp rank as torch.chunk: 126 per dp rank, 30 on the
            # last one; the planner counts the mean, 16032 / 128 = 125.25
            assert r["unpadded_bytes"] == pytest.approx(planned["params"] - 4 * (16032 / 128 - 30) * 16384, rel=1e-9)
            continue
        assert r["unpadded_bytes"] == pytest.approx(planned["params"], rel=0.001)
        assert r["optim_bytes"] == pytest.approx(planned["optim"], rel=0.001)
        assert planned["bubble"] == pytest.approx(15 / (2 * 16 + 15))  # 16 micro-batches, 2 stages per rank
        # The long stage is planned on its own layout (Meta's: CP 16, DP 8): 128 sequences of 128K over 8
        # data-parallel ranks, 16 micro-batches each; FSDP2 shards over dp_shard x cp = 128 ranks as before.
        long = r["planned"]["long_context"]
        assert long["layout"] == "pp=16 dp_replicate=1 dp_shard=8 cp=16 tp=8" and long["seq_len"] == 131072
        assert long["params"] == pytest.approx(planned["params"]) and long["bubble"] == planned["bubble"]
    # 1F1B: the first pipeline rank holds the most micro-batches in flight.
    assert first["planned"]["main"]["activations"] > middle["planned"]["main"]["activations"]


def test_a_layout_that_cannot_be_built_fails_with_the_launch_line(capsys):
    assert main(["train", "--preset", "llama3-405b", "--dry-run", "--world-size", "1000", "--rank", "0"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert "pp 16 x tp 8 = 128 processes per model replica does not divide 1000 processes; the nearest world sizes " \
        "that run it are 896 or 1024" in err[-1] and len(err) == 1, err


def test_the_405b_plan_finds_a_layout_and_prints_metas_beside(big):
    r = layout_plan(big, 16384, 80, preset="llama3-405b", sequence_parallel=True)
    assert r["suggested"] is not None and r["suggested"]["runs_all"]
    pub = r["published"]
    assert [str(x["layout"]) for x in pub["stages"]] == ["pp=16 dp_replicate=1 dp_shard=128 tp=8"] * 2 + [
        "pp=16 dp_replicate=1 dp_shard=8 cp=16 tp=8"]
    assert all(x["fits"] for x in pub["stages"]) and pub["days"] >= r["days"]  # the per-stage plan is the fastest
    assert any(x["layout"].pp > 1 for x in r["running"])  # pipelined layouts are searched and some run
    # the configured layouts, each stage on its own (long_context: stages[2].parallel's cp 16 over [parallel]), run
    assert [(c["layout"], c["own"], c["runs"]) for c in r["configured_stages"]] == [
        ("pp=16 dp_replicate=1 dp_shard=128 tp=8", False, True)] * 2 + [
        ("pp=16 dp_replicate=1 dp_shard=8 cp=16 tp=8", True, True)]
    assert refusals(r) == []


def test_the_405b_plan_on_8_gpus_gives_each_stage_its_reason_and_exits_2(big, capsys):
    d = layout_plan_json(layout_plan(big, 8, 80, preset="llama3-405b"))
    assert [s["reason"].split(" fits no layout")[0] for s in d["stages"]] == [
        "stage 'main'", "stage 'anneal'", "stage 'long_context'"]
    assert "shard them over more GPUs" in d["stages"][0]["reason"]
    assert d["stages"][2]["configured"]["reason"] == ("stage 'long_context' (stages[2].parallel): parallel.pp (16) "
                                                      "must divide the world size 8")
    assert len(d["refusals"]) == 6 and "warnings" in d
    assert main(["plan", "--preset", "llama3-405b", "--gpus", "8", "--json"]) == 2
