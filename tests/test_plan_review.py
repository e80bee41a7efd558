"""What a new user's review of ``densetrain plan`` found (issue 41, session 16 review): the printed ``train``
commands run the layouts the plan chose, bad hardware files and flags are one-line errors, non-power-of-two
pipelines, like-for-like ``--params`` scaling, the pipeline link of a cp group, an honest MFU on a measured
profile."""

from __future__ import annotations

import dataclasses
import re

import pytest

from densetrain.cli import main
from densetrain.config import load_config
from densetrain.config.loading import parse_overrides
from densetrain.cost import flops_per_token, parallel_of, step_time
from densetrain.cost.hardware import load_hardware, measured_hardware, write_hardware
from densetrain.errors import ConfigError
from densetrain.parallel.mesh import Layout
from densetrain.parallel.stage_layout import stage_layouts
from densetrain.schedule import resolve_stages
from densetrain.tools.plan import format_layout_plan, layout_plan, model_counts
from densetrain.tools.plan.layouts import model_counts_flops
from densetrain.tools.plan.memory import layout_memory, pipeline_fit, pipeline_ranks
from densetrain.tools.plan.verdict import configured_stages


def _commands(text: str) -> list[str]:
    """The flags of every ``densetrain train ...`` command the plan prints."""
    return [m.group(1) for m in re.finditer(r"densetrain train \.\.\. (.*)$", text, re.M)]


def _planned(r: dict, line: str) -> list[tuple[str, str]]:
    """Per stage, the layout and checkpointing a printed command was meant to run: the stage's best, or the one
    layout for every stage."""
    if line.startswith("one layout"):
        x = r["suggested"]
        return [(str(x["layout"]), x["stages"][i]["ac"], x) for i in range(len(r["stages"]))]
    return [(str(s["ranked"][0]["layout"]), s["ranked"][0]["stages"][i]["ac"], s["ranked"][0])
            for i, s in enumerate(r["stages"])]


@pytest.mark.parametrize("preset, gpus", [("llama3-405b", 2048), ("llama3-8b", 8), ("llama3-8b", 16),
                                          ("llama3-70b", 64), ("gpt2-124m", 4),
                                          ("llama3-8b", 24), ("gpt2-124m", 3)])
def test_every_printed_train_command_runs_the_planned_layout(preset, gpus):
    """Each ``densetrain train ...`` line, applied to the preset as ``train --dry-run --world-size N`` applies it,
    resolves every stage to exactly the layout, schedule and checkpointing the plan printed, and fits (review
    item 1: the main stage's flags ran into the long_context stage's own layout; full checkpointing was not
    printed)."""
    cfg = load_config(preset=preset)
    r = layout_plan(cfg, gpus, hardware="h100-sxm", sequence_parallel=cfg.parallel.sequence_parallel)
    text = format_layout_plan(r)
    lines = [ln for ln in text.splitlines() if "densetrain train ..." in ln]
    if all(s["ranked"] for s in r["stages"]):
        assert lines, text
    for line, flags in zip(lines, _commands("\n".join(lines))):
        run = load_config(preset=preset, overrides=parse_overrides(flags.split()))
        stages = resolve_stages(run)
        got = stage_layouts(run, stages, gpus)
        for (par, lay), (want, ac, x), st in zip(got, _planned(r, line.strip()), stages):
            assert str(lay) == want and par.activation_checkpointing == ac, (st.name, flags)
            if lay.pp > 1:
                assert (par.pp_schedule, par.pp_virtual_stages) == (x["schedule"], x["virtual"])
        usable = r["usable_bytes"]
        verdict = configured_stages(run, gpus, model_counts(run.model), usable)
        assert all(v["runs"] for v in verdict), [v["reason"] for v in verdict]


@pytest.mark.parametrize("text", ["[1, 2]", '[{"a": 1}]', "null", "5"])
def test_a_json_hardware_file_that_is_not_an_object_is_one_line(tmp_path, capsys, text):
    """Review item 2: a JSON profile holding a list, null or a number gave a traceback (rc 1)."""
    f = tmp_path / "hw.json"
    f.write_text(text)
    assert main(["plan", "--preset", "tiny", "--gpus", "1", "--hardware", str(f)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "expected an object of keys" in err and str(f) in err


@pytest.mark.parametrize("key, value", [("peak_bf16_flops", 1e-300), ("gpus_per_node", 1e300),
                                        ("hbm_bytes_per_s", 1e-300), ("memory_gib", 1e-9),
                                        # optional figures: FlexAttention 1e300x SDPA made attention free
                                        ("flex_forward_rate", 1e300), ("dtensor_op_s", 1e300),
                                        ("nvls_bus_bytes_per_s", 1e300)])
def test_physically_impossible_profile_values_are_refused(tmp_path, capsys, key, value):
    """Review item 2: 1e-300 FLOP/s gave rc 0 and nan everywhere, 1e300 GPUs a node passed, 1e-9 GiB printed
    "usable -1.0 GiB": each is one line naming the key."""
    hw = dataclasses.replace(load_hardware("h100-sxm"), **{key: value})
    f = write_hardware(hw, tmp_path / "hw.toml")
    assert main(["plan", "--preset", "tiny", "--gpus", "1", "--hardware", str(f)]) == 2
    captured = capsys.readouterr()
    assert "nan" not in captured.out and len(captured.err.strip().splitlines()) == 1
    assert f"{key} = " in captured.err


@pytest.mark.parametrize("argv", [["plan", "--preset", "tiny", "--gpus", "1", "--gpu-memory-gib", "0.5"],
                                  ["train", "--preset", "tiny", "--dry-run", "--gpu-memory-gib", "0.5"]])
def test_a_memory_that_leaves_nothing_usable_is_an_error(capsys, argv):
    """Review item 2: ``--gpu-memory-gib 0.5`` printed "usable -0.5 GiB" and planned on."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--gpu-memory-gib 0.5: leaves no usable memory" in err


def test_a_non_finite_step_time_is_an_error_never_printed():
    """Review item 2: a step time of nan or inf (a profile whose rates underflow) is refused, not printed. The
    profile's ranges stop it at load; a Hardware built in code reaches the planner's own check."""
    hw = dataclasses.replace(load_hardware("h100-sxm"), peak_bf16_flops=1e-300, peak_fp8_flops=1e-300)
    with pytest.raises(ConfigError, match="step time .* is (nan|inf)"):
        layout_plan(load_config(preset="tiny"), 1, hardware=hw)


@pytest.mark.parametrize("preset, gpus, pp", [("llama3-8b", 24, 3), ("llama3-8b", 5, 5)])
def test_a_gpu_count_with_an_odd_factor_pipelines_over_it(preset, gpus, pp):
    """Review item 3: only power-of-two pipelines were tried, so 24 GPUs (batch 2048: data parallelism a power of
    two) found no layout while the verdict named --parallel.pp=3."""
    r = layout_plan(load_config(preset=preset), gpus)
    main_stage = r["stages"][0]
    assert main_stage["ranked"], format_layout_plan(r)
    assert main_stage["best"].pp == pp and main_stage["best"].world == gpus


def test_a_stage_no_layout_runs_names_the_nearest_gpu_counts_that_do():
    """Review item 3: when nothing fits, the nearest GPU counts that run the stage, in the same one line."""
    r = layout_plan(load_config(preset="llama3-8b"), 3)
    long_context = r["stages"][2]
    assert not long_context["ranked"] and long_context["nearest_gpus"] == (None, 4)
    (why,) = [ln for ln in format_layout_plan(r).splitlines() if "fits no layout" in ln]
    assert why.endswith("the nearest GPU counts that run it: 4")
    assert any(x["stages"][2]["fits"] for x in layout_plan(load_config(preset="llama3-8b"), 4)["layouts"])


def test_tied_embeddings_are_never_pipelined():
    """gpt2-124m ties its embedding to its head, which densetrain cannot pipeline (config/validate.py): on 3 GPUs
    (batch 64 x micro 16: data parallelism 1, 2 or 4) nothing runs, and 2 or 4 do."""
    r = layout_plan(load_config(preset="gpt2-124m"), 3)
    assert all(x["layout"].pp == 1 for x in r["layouts"])
    assert [s["nearest_gpus"] for s in r["stages"]] == [(2, 4)] * 3


@pytest.mark.parametrize("flag, value, want", [("--tokens", "-5", "tokens must be a positive finite number"),
                                                ("--tokens", "nan", "tokens must be a positive finite number"),
                                                ("--tokens", "0", "tokens must be a positive finite number"),
                                                ("--mfu", "2", "--mfu: expected a fraction in (0, 1]"),
                                                ("--tokens-per-param", "-1", "--tokens-per-param: expected a "
                                                                             "positive finite number")])
def test_bad_numbers_of_the_memory_plan_are_one_line_errors(capsys, flag, value, want):
    """Review item 4: ``--tokens -5`` / ``nan`` printed negative steps, ``--tokens 0`` was ignored, ``--mfu 2`` and
    ``--tokens-per-param -1`` were accepted."""
    assert main(["plan", "--preset", "tiny", "--gpus", "1", flag, value]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and want in captured.err and len(captured.err.strip().splitlines()) == 1


def test_params_equal_to_the_shapes_own_count_change_nothing():
    """Review item 5: ``--params`` with the preset's own 8,030,261,248 (all parameters, the input embedding too)
    made the step 5.4% slower, compared with the 6 N count that leaves the input embedding out."""
    cfg = load_config(preset="llama3-8b")
    own = model_counts(cfg.model)["params"]
    assert own == 8_030_261_248
    base, same = layout_plan(cfg, 8), layout_plan(cfg, 8, params=own)
    assert [s["step_s"] for s in same["stages"]] == pytest.approx([s["step_s"] for s in base["stages"]], rel=1e-12)
    # twice the parameters: the 6 N part of the FLOPs per token doubles, attention's stays (the same layout's
    # compute compared: its checkpointing may change with the memory)
    double = layout_plan(cfg, 8, params=2 * own)
    key = lambda x: (x["layout"], x["schedule"], x["virtual"])  # noqa: E731
    x2 = double["stages"][0]["ranked"][0]
    (x1,) = [x for x in base["layouts"] if key(x) == key(x2)]
    fpt, six_n = flops_per_token(cfg.model, 8192), 6 * model_counts_flops(cfg.model)
    compute = [x["stages"][0]["time"]["parts"]["compute"] for x in (x1, x2)]
    assert compute[1] == pytest.approx(compute[0] * (fpt + six_n) / fpt, rel=1e-9)


def test_a_pipeline_of_pp_2_by_cp_4_on_one_node_sends_over_nvlink():
    """Review item 7: the pipeline's link counted cp twice in the stride of its group (``n_sh`` is already
    dp_shard x cp), so pp 2 x cp 4 on one 8-GPU node was charged over the network."""
    cfg = load_config(preset="llama3-8b")
    hw = load_hardware("h100-sxm")
    t = step_time(cfg.model, parallel_of(Layout(1, 1, 1, 4, 2)), hw, 8192, 8, 1, "full")
    assert t["links"]["pp"] == "nvlink" and t["links"]["cp"] == "nvlink"
    # one node further out the pipeline crosses nodes: 2 x 8 ranks
    t = step_time(cfg.model, parallel_of(Layout(1, 2, 1, 4, 2)), hw, 8192, 16, 1, "full")
    assert t["links"]["pp"] == "network"


def test_a_stage_layout_error_under_pipelining_names_the_ranks_of_a_pipeline_stage(capsys):
    """Review item 8: with ``--world-size 16384`` the dry run said "the world size is 1024" (the ranks of one
    pipeline stage of pp 16)."""
    assert main(["train", "--preset", "llama3-405b", "--dry-run", "--world-size", "16384", "--rank", "0",
                 "--parallel.dp_replicate=2", "--parallel.dp_shard=64"]) == 2
    err = capsys.readouterr().err
    assert "= 16384, but the world size 16384 / pp 16 leaves 1024 ranks a pipeline stage;" in err
    assert "world size is 1024" not in err


def test_mfu_on_a_measured_profile_says_it_is_near_100_percent_by_construction():
    """Review item 9: ``plan --preset tiny --gpus 1 --hardware <doctor --profile>`` printed MFU 98-111% without a
    word. A measured profile's GEMMs run at its peak (efficiency 1), and MFU counts causal attention whole while the
    kernel runs half: the figure says so; a datasheet profile's does not need to."""
    hw = measured_hardware(8.6e10, 2.5e10, None, 1, 16.0, "this CPU")
    r = layout_plan(load_config(preset="tiny"), 1, hardware=hw)
    mfus = [s["time"]["mfu"] for s in r["stages"]]
    assert 0.9 < min(mfus) and max(mfus) > 1.0  # the figure the review saw: over 100% at seq_len 1024
    text = format_layout_plan(r)
    assert "note: MFU here is against this CPU's measured matmul rate (86 GFLOP/s), not a datasheet peak" in text
    assert "note: MFU" not in format_layout_plan(layout_plan(load_config(preset="tiny"), 1))


def test_plan_help_lists_every_shipped_profile(capsys):
    """Review item 8: ``plan --help`` left out h100-96gb-500w."""
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(a100-80gb, b200, h100-96gb-500w, h100-sxm, h200)" in text


@pytest.mark.parametrize("pp_rank", [0, 1])
def test_a_pipelined_fsdp_rank_holds_its_gradients_unsharded_in_fp32(pp_rank):
    """Review item 6: under pipelining torch's ``PipelineStage`` turns FSDP2's gradient sync and resharding off for
    every backward but the step's last, so a rank holds all of its parameters gathered (bf16) and all of their
    gradients unsharded (fp32) at once; the planner charged one block's gradients."""
    cfg = load_config(preset="tiny", overrides=[("train.batch_size", 8), ("train.micro_batch_size", 1)])
    m, lay = cfg.model, Layout(1, 2, 1, 1, 2)
    pipe, _ = pipeline_fit(lay, 8, 1, cfg.parallel)
    counts = model_counts(m)
    mem = layout_memory(counts, m, 256, 1, lay, "none", pipeline=pipe, pp_rank=pp_rank)
    rank = pipeline_ranks(counts, m, 2)[pp_rank]
    assert mem["transient"] == pytest.approx((2 + 4) * rank["params"])  # tp 1: the rank's whole parameters
