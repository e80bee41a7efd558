"""The ladder protocol (issue 42 item 2): densetrain ladder's defaults span >= 10x in N and >= 30x in compute with
sizes on a staircase, seeds of the largest rung, the lr rule and exact FLOPs; bad protocol values are one line;
seed replicas enter the fit as their mean; a run's repeated tokens are counted from its sampler state."""

from __future__ import annotations

import json
import re
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from densetrain.cli import main
from densetrain.config import load_config
from densetrain.data.prepare import prepare
from densetrain.errors import ConfigError
from densetrain.law import Law
from densetrain.metrics import flops_per_token, read_events
from densetrain.tools.ladder.fit import fit_records, merge_seeds
from densetrain.tools.ladder.grid import N_KEY, build_grid, param_counts, placement, point_config
from densetrain.tools.ladder.launcher import head_note, open_ladder, repeated_tokens
from densetrain.tools.ladder.protocol import DEFAULT_BUDGETS, DEFAULT_SIZES, PROTOCOL, Protocol
from densetrain.train import train

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "benchmarks" / "ladder_protocol.toml"


def protocol_config():
    """The protocol's recipe (benchmarks/ladder_protocol.toml over the ladder-corpus preset): no data is read."""
    return load_config(preset="ladder-corpus", path=RECIPE)


def test_the_defaults_span_sizes_budgets_and_seed_the_largest_rung():
    cfg = protocol_config()
    grid = build_grid(cfg, list(DEFAULT_SIZES), list(DEFAULT_BUDGETS), PROTOCOL)
    configs = {p.name: point_config(cfg, grid, p, f"runs/{p.name}") for p in grid.points}
    n = {p.name: param_counts(configs[p.name])[N_KEY] for p in grid.points}
    assert max(n.values()) / min(n.values()) >= 10  # sizes span >= 10x in N (no input embedding, head counted)
    assert max(DEFAULT_BUDGETS) / min(DEFAULT_BUDGETS) >= 30
    assert len(DEFAULT_SIZES) >= 4 and len({p.d_model for p in grid.points}) == len(DEFAULT_SIZES)
    # the staircase: no budget trains every size, the smallest budget the smallest sizes, the largest the largest
    by_budget = {c: sorted(p.d_model for p in grid.points if p.budget == c and not p.seed) for c in grid.budgets}
    assert all(len(v) <= PROTOCOL.per_budget for v in by_budget.values())
    assert min(DEFAULT_SIZES) in by_budget[min(grid.budgets)] and max(DEFAULT_SIZES) in by_budget[max(grid.budgets)]
    assert max(DEFAULT_SIZES) not in by_budget[min(grid.budgets)]
    # the largest rung at 3 seeds: the same length, train.seed 0, 1, 2
    rung = [p for p in grid.points if p.d_model == max(DEFAULT_SIZES) and p.budget == max(grid.budgets)]
    assert sorted(configs[p.name].train.seed for p in rung) == [0, 1, 2] and len({p.steps for p in rung}) == 1
    # exact FLOPs: each main run trains budget / flops_per_token tokens (plan's count), to a whole step
    for p in grid.points:
        c = configs[p.name]
        if not p.branch_from:
            tokens = p.steps * c.train.batch_size * c.train.seq_len
            assert abs(tokens * flops_per_token(c.model, c.train.seq_len) / p.budget - 1) < 0.1
    # lr x 1/width from the config's (base) width; heads of 16
    for p in grid.points:
        c = configs[p.name]
        assert c.optim.peak_lr == pytest.approx(cfg.optim.peak_lr * cfg.model.d_model / p.d_model)
        assert c.model.d_model // c.model.n_heads == 16
    # the held-out run at 12x the largest budget costs at least twice the whole ladder (exact FLOPs)
    ladder = sum(flops_per_token(configs[p.name].model, cfg.train.seq_len) * cfg.train.batch_size * cfg.train.seq_len
                 * (p.steps - p.branch_from) for p in grid.points)
    assert ladder <= 0.5 * 12 * max(grid.budgets)


def test_a_ladder_whose_n_spans_less_than_10x_says_so_and_names_the_head():
    # The defaults on the tiny preset (BPE 8192): the head is most of N at d_model 16 and N spans 4.6x, which the
    # ladder's first line now says (before: nothing, and the fit's exponents came from a head-dominated N).
    tiny = load_config(preset="tiny")
    grid = build_grid(tiny, list(DEFAULT_SIZES), list(DEFAULT_BUDGETS), PROTOCOL)
    n = [param_counts(point_config(tiny, grid, p, "r"))[N_KEY] for p in grid.points]
    note = head_note(tiny, grid)
    assert f"N spans {max(n) / min(n):.1f}x over the sizes (the protocol asks >= 10x" in note and max(n) < 10 * min(n)
    head = tiny.model.vocab_size * 16
    assert f"at d_model 16 the output head (vocab_size 8192 x d_model) is {head / min(n):.0%} of N" in note
    assert head_note(protocol_config(), build_grid(protocol_config(), list(DEFAULT_SIZES), list(DEFAULT_BUDGETS),
                                                   PROTOCOL)) == ""  # the recipe's BPE 512: 10.8x


def test_placement_moves_up_the_sizes():
    sizes, budgets = [1, 2, 3, 4, 5, 6], [1.0, 2.0, 3.0]
    assert placement(sizes[:5], budgets, 3) == {1.0: [1, 2, 3], 2.0: [2, 3, 4], 3.0: [3, 4, 5]}
    assert placement(sizes, budgets + [4.0], 3) == {1.0: [1, 2, 3], 2.0: [2, 3, 4], 3.0: [3, 4, 5], 4.0: [4, 5, 6]}
    assert placement(sizes, budgets, 0) == {c: sizes for c in budgets}
    assert placement(sizes, [1.0], 2) == {1.0: [5, 6]}


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "0"], "argument --seeds: expected 1 to 10 seeds, got 0"),
    (["--per-budget", "x"], "argument --per-budget: expected a whole number of sizes per budget, got 'x'"),
    (["--lr-rule", "sqrt"], "argument --lr-rule: invalid choice: 'sqrt'"),
    (["--sizes", "24", "--head-dim", "16"], "ladder size d_model=24: expected a multiple of the head dimension 16"),
])
def test_bad_protocol_flags_are_one_line(argv, message, tmp_path, capsys):
    try:  # argparse's errors exit, the protocol's are returned: both as one line and status 2
        rc = main(["ladder", "--preset", "ladder-corpus", "--config", str(RECIPE), "--out", str(tmp_path / "L"),
                   "--print-commands", *argv])
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_a_ladder_continues_only_with_its_protocol(tmp_path):
    cfg = protocol_config()
    open_ladder(tmp_path / "L", cfg, list(DEFAULT_SIZES), list(DEFAULT_BUDGETS), PROTOCOL)
    _, grid = open_ladder(tmp_path / "L")  # read back: the protocol too
    assert grid.protocol == PROTOCOL and any(p.seed == 2 for p in grid.points)
    with pytest.raises(ConfigError, match=r"a ladder of protocol .* is there; expected the same protocol"):
        open_ladder(tmp_path / "L", cfg, list(DEFAULT_SIZES), list(DEFAULT_BUDGETS), Protocol(seeds=2))
    plan = json.loads((tmp_path / "L" / "ladder.json").read_text())
    plan["protocol"]["colour"] = 1
    (tmp_path / "L" / "ladder.json").write_text(json.dumps(plan))
    with pytest.raises(ConfigError, match=r"ladder.json: protocol key 'colour' unknown"):
        open_ladder(tmp_path / "L")
    with pytest.raises(ConfigError, match="ladder protocol: seeds 11: expected 1 to 10"):
        Protocol(seeds=11).check()


def test_seed_replicas_enter_the_fit_as_their_mean():
    law = Law(E=1.8, A=400.0, B=400.0, alpha=0.34, beta=0.28)
    recs = []
    for c in (1e17, 1e18, 1e19):
        for f in (1 / 4, 1, 4):
            n = law.optimal(c)[0] * f
            loss = float(law.loss(n, c / (6 * n)))
            recs.append({"name": f"p{len(recs)}", "budget": c, N_KEY: n, "tokens": c / (6 * n), "curve": [],
                         "seed": 0, "val": {"all": {"loss": loss, "bpb": None}}})
    top = recs[-1]
    reps = [dict(top, name=f"{top['name']}_s{k}", seed=k, val={"all": {"loss": top["val"]["all"]["loss"] + dx,
                                                                      "bpb": None}})
            for k, dx in ((1, 0.03), (2, -0.01))]
    merged, spread = merge_seeds(recs + reps)
    assert len(merged) == len(recs) and len(spread) == 1
    losses = [top["val"]["all"]["loss"], top["val"]["all"]["loss"] + 0.03, top["val"]["all"]["loss"] - 0.01]
    assert spread[0]["losses"] == pytest.approx(losses) and spread[0]["seeds"] == [0, 1, 2]
    assert spread[0]["sd"] == pytest.approx(np.std(losses, ddof=1))
    assert [m for m in merged if m["name"] == top["name"]][0]["val"]["all"]["loss"] == pytest.approx(np.mean(losses))
    fit = fit_records(recs + reps, samples=2)
    assert fit["points"] == 9 and fit["seed_spread"][0]["name"] == top["name"]


def test_repeated_tokens_count_a_small_source_that_ran_out(tmp_path):
    """A source far smaller than the run's draws from it: its second pass is counted token for token (against
    the epoch event's own account of where the first pass ended); the large source repeated nothing."""
    cfg = load_config(preset="tiny", overrides=[
        ("data.demo_corpus", False), ("data.corpus_dir", sysconfig.get_paths()["stdlib"]),
        ("data.shards_dir", str(tmp_path / "shards")), ("data.tokenizer", "bpe"), ("data.tokenizer_vocab_size", 300),
        ("data.val_fraction", 0.1),
        ("data.sources", [{"name": "small", "kind": "code", "paths": ["json"], "format": "text", "filters": ["none"]},
                          {"name": "big", "kind": "code", "paths": ["email"], "format": "text", "filters": ["none"]}]),
        ("stages", [{"name": "main", "start": 0.0, "mix": {"small": 0.75, "big": 0.25}}]),
        ("model.vocab_size", 300), ("model.d_model", 16), ("model.n_layers", 1), ("model.n_heads", 1),
        ("model.n_kv_heads", 1), ("model.d_ff", 32), ("train.seq_len", 256), ("train.batch_size", 8),
        ("train.micro_batch_size", 8), ("train.threads", 1), ("train.dtype", "fp32"), ("train.run_dir",
                                                                                          str(tmp_path / "run")),
        ("schedule.warmup_steps", 1), ("checkpoint.every", 0), ("eval.every", 0), ("eval.max_batches", 1),
        ("eval.tasks", ""), ("eval.final_tasks", ""), ("health.every", 0), ("logging.tensorboard", False)])
    prepare(cfg)
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())["sources"]
    windows = (manifest["small"]["train"]["tokens"] - 1) // 256
    per_step = 6  # 0.75 of 8 sequences
    cfg.train.steps = windows // per_step + 3  # past one pass of the small source, short of two
    train(cfg)
    starts = [e for e in read_events(tmp_path / "run") if e.get("kind") == "epoch"]
    assert len(starts) == 1 and "source 'small' starts epoch 1" in starts[0]["text"], starts
    m = re.search(r"\((\d+) of (\d+) windows left", starts[0]["text"])
    first_pass = windows - int(m.group(1)) if m else windows
    expected = (cfg.train.steps * per_step - first_pass) * 256
    counted = repeated_tokens(tmp_path / "run", cfg)
    assert counted == {"small": expected, "big": 0} and expected > 0
