"""``--smoke``: the same recipe, scaled down to a few steps on a laptop, as a check before a long run.

Kept: the data sources and their mixes, the tokenizer (so ``vocab_size``), the stage table (every stage
runs, in order, with its mix, RoPE base and scaling, document masking and re-warmup), the schedule's
kind, the optimizer, the ratio of query to KV heads, the ratio of ``d_ff`` to ``d_model``, and each
stage's sequence length relative to the first. Shrunk: depth 2, width 64 (4 heads of 16), the first
stage's ``seq_len`` to at most 64, 4 sequences per step per stage, 3 steps per stage, warmup of 2
steps, evals on 2 batches, downstream tasks off, a checkpoint at the middle and the end, the parallel
layout one process (no pipeline, tensor or context split, no stage's own layout: a recipe's layout is for its
GPUs), and the
run directory gets a ``-smoke`` suffix so a real run is never touched.
"""

from __future__ import annotations

import copy
import dataclasses

from densetrain.config.schema import Config
from densetrain.config.validate import validate

SMOKE_STEPS_PER_STAGE = 3
SMOKE_SEQUENCES = 4


def scale_down(cfg: Config) -> Config:
    """A copy of ``cfg`` scaled down as the module docstring says; validated.

    Raises:
        ConfigError: the scaled config is invalid (it names the key).
    """
    out = copy.deepcopy(cfg)
    m = out.model
    group = max(1, m.n_heads // m.n_kv_heads)
    ratio = m.d_ff / m.d_model
    m.n_layers, m.n_heads, m.d_model = 2, 4, 64
    m.n_kv_heads = max(1, 4 // group)
    m.base_d_model = min(m.base_d_model, m.d_model)
    m.d_ff = max(8, int(round(ratio * m.d_model / 8)) * 8)
    t = out.train
    base_seq = t.seq_len
    t.seq_len = min(t.seq_len, 64)
    t.batch_size = t.micro_batch_size = SMOKE_SEQUENCES
    seqs, prev = [], base_seq
    for st in out.stages:  # each stage's length relative to the first, as in the full recipe
        prev = st.seq_len or prev
        st.seq_len = max(8, prev * t.seq_len // base_seq) if st.seq_len else 0
        seqs.append(max(8, prev * t.seq_len // base_seq))
        st.rewarmup_steps = min(st.rewarmup_steps, 1)
    # One batch size in tokens for every stage (enough for SMOKE_SEQUENCES of the longest), so stage
    # starts land on the same steps in either schedule.unit.
    for st in out.stages:
        st.batch_tokens = SMOKE_SEQUENCES * max(seqs)
    t.batch_size = SMOKE_SEQUENCES * max(seqs) // t.seq_len
    out.stages[0].batch_tokens = 0
    # The fewest steps (at least SMOKE_STEPS_PER_STAGE per stage) at which every stage gets a step.
    t.steps = SMOKE_STEPS_PER_STAGE * len(out.stages)
    while not _every_stage_runs([st.start for st in out.stages], t.steps):
        t.steps += 1
    t.run_dir = t.run_dir.rstrip("/") + "-smoke"
    out.schedule.warmup_steps = 2
    out.checkpoint.every = max(1, t.steps // 2)
    out.checkpoint.keep = 2
    out.eval = dataclasses.replace(out.eval, every=t.steps, max_batches=2, tasks="", final_tasks="")
    out.logging.every = 1
    out.logging.mfu_every = 1
    out.parallel = dataclasses.replace(out.parallel, dp_replicate=-1, dp_shard=1, tp=1, cp=1, pp=1,
                                       pp_schedule="1f1b", pp_virtual_stages=1, pp_microbatches=0,
                                       pp_layers_per_stage=0)
    for st in out.stages:  # one process: no stage keeps a layout of its own (llama3-405b's CP 16 stage)
        st.parallel = {}
    validate(out)
    return out


def _every_stage_runs(starts: list[float], steps: int) -> bool:
    first = [round(f * steps) for f in starts]
    return all(a < b for a, b in zip(first, first[1:])) and first[-1] < steps
