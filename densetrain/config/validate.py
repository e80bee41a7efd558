"""Cross-field checks of a :class:`Config`: :func:`validate` raises :class:`ConfigError` naming the key."""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing

from densetrain.config.filters import validate_filters
from densetrain.config.recovery import validate_health, validate_recovery
from densetrain.config.schema import Config, ParallelConfig
from densetrain.errors import ConfigError, check_config
from densetrain.registry.filters import resolve_filter_names
from densetrain.registry.gen_tasks import GEN_TASKS
from densetrain.registry.tasks import GROUPS, TASKS

# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


def validate(cfg: Config) -> None:
    """Check cross-field constraints; raise ConfigError naming the key on the first problem."""
    validate_finite(cfg)
    validate_bounds(cfg)
    m = cfg.model
    for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff"):
        check_config(getattr(m, k) > 0, f"model.{k} must be positive, got {getattr(m, k)}")
    check_config(m.d_model % m.n_heads == 0,
                 f"model.d_model ({m.d_model}) must be divisible by model.n_heads ({m.n_heads})")
    check_config(
        m.n_heads % m.n_kv_heads == 0,
        f"model.n_heads ({m.n_heads}) must be divisible by model.n_kv_heads ({m.n_kv_heads})",
    )
    check_config(m.head_dim % 2 == 0, f"model.d_model / model.n_heads = {m.head_dim} must be even for RoPE")
    check_config(m.rope_theta > 0, f"model.rope_theta must be positive, got {m.rope_theta}")
    validate_rope_scaling(m.rope_scaling, "model.rope_scaling", inherit=False)
    check_config(m.norm_eps > 0, f"model.norm_eps must be positive, got {m.norm_eps}")
    check_config(m.init in ("standard", "mup"), f"model.init must be 'standard' or 'mup', got '{m.init}'")
    check_config(m.init_std > 0, f"model.init_std must be positive, got {m.init_std}")
    check_config(m.base_d_model > 0, f"model.base_d_model must be positive, got {m.base_d_model}")
    check_config(m.logit_softcap >= 0, f"model.logit_softcap must be >= 0 (0 = off), got {m.logit_softcap}")

    # train's sizes before the checks that compare other keys with them: --train.steps=-5 names
    # train.steps, not schedule.warmup_steps (which must be shorter than it)
    t = cfg.train
    for k in ("steps", "seq_len", "batch_size", "micro_batch_size"):
        check_config(getattr(t, k) > 0, f"train.{k} must be a positive integer, got {getattr(t, k)}")

    o = cfg.optim
    check_config(0 < o.peak_lr < float("inf"), f"optim.peak_lr must be a positive finite number, got {o.peak_lr}")
    check_config(o.eps > 0, f"optim.eps must be positive (Adam divides by sqrt(v) + eps), got {o.eps}")
    check_config(0 <= o.min_lr <= o.peak_lr,
                 f"optim.min_lr must be in [0, optim.peak_lr={o.peak_lr}], got {o.min_lr}")
    check_config(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optim.beta1 and optim.beta2 must be in [0, 1)")
    for k in ("weight_decay", "grad_clip", "z_loss"):
        check_config(getattr(o, k) >= 0, f"optim.{k} must be >= 0, got {getattr(o, k)}")
    check_config(o.name in ("adamw", "muon"), f"optim.name must be 'adamw' or 'muon', got '{o.name}'")
    if o.name == "muon":
        check_config(0 < o.muon_lr < float("inf"), f"optim.muon_lr must be a positive finite number, got {o.muon_lr}")
        check_config(0 <= o.muon_momentum < 1, f"optim.muon_momentum must be in [0, 1), got {o.muon_momentum}")
        check_config(o.muon_weight_decay >= 0, f"optim.muon_weight_decay must be >= 0, got {o.muon_weight_decay}")
        check_config(1 <= o.muon_ns_steps < 100, f"optim.muon_ns_steps must be in [1, 100), got {o.muon_ns_steps}")
        check_config(o.muon_adjust_lr in ("original", "match_rms_adamw"),
                     f"optim.muon_adjust_lr must be 'original' or 'match_rms_adamw', got '{o.muon_adjust_lr}'")

    s = cfg.schedule
    check_config(s.kind in ("cosine", "wsd", "constant"),
                 f"schedule.kind must be cosine, wsd or constant, got '{s.kind}'")
    check_config(s.decay_shape in ("linear", "cosine", "1-sqrt"),
                 f"schedule.decay_shape must be linear, cosine or 1-sqrt, got '{s.decay_shape}'")
    check_config(0 < s.decay_fraction <= 1, f"schedule.decay_fraction must be in (0, 1], got {s.decay_fraction}")
    check_config(s.warmup_steps >= -1,
                 f"schedule.warmup_steps must be >= 0 (or -1 for warmup_fraction), got {s.warmup_steps}")
    check_config(s.warmup_steps < cfg.train.steps,
           f"schedule.warmup_steps ({s.warmup_steps}) must be shorter than train.steps ({cfg.train.steps})")
    check_config(0 <= s.warmup_fraction < 1, f"schedule.warmup_fraction must be in [0, 1), got {s.warmup_fraction}")
    check_config(s.unit in ("steps", "tokens"), f"schedule.unit must be steps or tokens, got '{s.unit}'")

    check_config(
        t.batch_size % t.micro_batch_size == 0,
        f"train.batch_size ({t.batch_size}) must be divisible by train.micro_batch_size ({t.micro_batch_size})",
    )
    check_config(t.device in ("auto", "cpu", "cuda"), f"train.device must be auto, cpu or cuda, got '{t.device}'")
    check_config(t.dtype in ("auto", "bf16", "fp32"), f"train.dtype must be auto, bf16 or fp32, got '{t.dtype}'")
    check_config(t.threads >= 0, f"train.threads must be >= 0 (0 keeps torch's default), got {t.threads}")
    check_config(t.resume in ("", "auto"), f"train.resume must be 'auto' or '' (off), got '{t.resume}'")
    e = cfg.eval
    check_config(e.position_buckets == sorted(set(e.position_buckets)) and e.position_buckets[:1] in ([], [0]),
                 f"eval.position_buckets must increase strictly from 0 (e.g. [0, 256, 1024]), got {e.position_buckets}")
    check_config(e.position_len >= 0 and e.position_docs >= 1,
                 f"eval.position_len must be >= 0 and eval.position_docs >= 1, got {e.position_len}, {e.position_docs}")
    check_config(t.gc_freq >= 0, f"train.gc_freq must be >= 0 (0: Python's automatic collection), got {t.gc_freq}")
    check_config(t.max_nonfinite_steps >= 1, f"train.max_nonfinite_steps must be >= 1, got {t.max_nonfinite_steps}")
    for k in ("every", "tasks_every", "tasks_limit", "final_limit", "samples"):  # 0 = at the end / all / none
        check_config(getattr(e, k) >= 0, f"eval.{k} must be >= 0, got {getattr(e, k)}")
    check_config(e.max_batches >= 1, f"eval.max_batches must be >= 1, got {e.max_batches}")
    check_config(e.off_curve_patience >= 1, f"eval.off_curve_patience must be >= 1, got {e.off_curve_patience}")
    check_config(0 <= e.off_curve_margin < 1, f"eval.off_curve_margin must be in [0, 1) (0: from the fit), got "
                                              f"{e.off_curve_margin}")
    for k in ("every", "mfu_every"):
        check_config(getattr(cfg.logging, k) >= 1, f"logging.{k} must be >= 1, got {getattr(cfg.logging, k)}")
    for k in ("every", "keep"):
        check_config(getattr(cfg.checkpoint, k) >= 0, f"checkpoint.{k} must be >= 0, got {getattr(cfg.checkpoint, k)}")
    validate_parallel(cfg)

    names = [src.name for src in cfg.data.sources]
    for i, src in enumerate(cfg.data.sources):
        check_config(bool(src.name) and src.name.replace("_", "").replace("-", "").isalnum(),
               f"data.sources[{i}].name must be non-empty letters/digits/_/-, got '{src.name}'")
        check_config(src.format in ("auto", "text", "paragraphs", "jsonl", "parquet", "arrow", "datatrove"),
               f"data.sources[{i}].format must be auto, text, paragraphs, jsonl, parquet, arrow or datatrove, "
               f"got '{src.format}'")
        check_config(src.format != "datatrove" or len(src.paths) == 1,
               f"data.sources[{i}].paths must name exactly one folder of .ds files for format 'datatrove', "
               f"got {src.paths}")
    check_config(len(set(names)) == len(names), f"data.sources: duplicate source names in {names}")
    check_config(not (cfg.data.demo_corpus and cfg.data.ladder_corpus),
                 "data.demo_corpus and data.ladder_corpus are both true: expected one (both write books.jsonl, ... "
                 "into data.corpus_dir)")
    check_config(0 < cfg.data.val_fraction < 1, f"data.val_fraction must be in (0, 1), got {cfg.data.val_fraction}")
    check_config(cfg.data.max_document_bytes > 0,
                 f"data.max_document_bytes must be positive, got {cfg.data.max_document_bytes}")
    check_config(cfg.data.workers >= 0, f"data.workers must be >= 0 (0 = all CPUs), got {cfg.data.workers}")

    dd = cfg.data.dedup
    for k in ("ngram", "num_perm", "bands", "rows"):
        check_config(getattr(dd, k) >= 1, f"data.dedup.{k} must be >= 1, got {getattr(dd, k)}")
    check_config(dd.bands * dd.rows == dd.num_perm,
           f"data.dedup.bands * data.dedup.rows ({dd.bands} * {dd.rows} = {dd.bands * dd.rows}) "
           f"must equal data.dedup.num_perm ({dd.num_perm})")
    check_config(0 < dd.threshold <= 1, f"data.dedup.threshold must be in (0, 1], got {dd.threshold}")
    check_config(0 <= dd.seed < 2**64, f"data.dedup.seed must be in [0, 2**64), got {dd.seed}")

    validate_filters(cfg.data.filters)
    for i, src in enumerate(cfg.data.sources):
        resolve_filter_names(src.filters, src.kind, key=f"data.sources[{i}].filters")
    validate_recovery(cfg.guard, cfg.watchdog, cfg.probe, cfg.faults, [s.name for s in cfg.data.sources])
    validate_health(cfg.health)
    dc = cfg.data.decontam
    check_config(dc.ngram >= 8,
                 f"data.decontam.ngram must be >= 8 (shorter n-grams match common phrases), got {dc.ngram}")
    if dc.enabled:
        check_config(bool(dc.tasks), "data.decontam.tasks is empty; name tasks or set data.decontam.enabled = false")
        valid = [*GROUPS, *TASKS, *GEN_TASKS]
        for name in dc.tasks:
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f" (valid: {', '.join(valid)})"
            check_config(name in valid, f"data.decontam.tasks: unknown task '{name}'{hint}")

    check_config(len(cfg.stages) > 0, "stages: at least one stage is required")
    check_config(cfg.stages[0].start == 0.0, f"stages[0].start must be 0, got {cfg.stages[0].start}")
    prev = -1.0
    batch_tokens, seq_len = t.batch_size * t.seq_len, t.seq_len  # inherited down the table
    for i, st in enumerate(cfg.stages):
        check_config(bool(st.name), f"stages[{i}].name must be set")
        check_config(st.name not in [s.name for s in cfg.stages[:i]],  # a run's state and events name its stage
                     f"stages[{i}].name '{st.name}' is already the name of an earlier stage; names must be unique")
        check_config(0 <= st.start < 1, f"stages[{i}].start must be a fraction in [0, 1), got {st.start}")
        check_config(st.start > prev, f"stages[{i}].start ({st.start}) must be after stages[{i - 1}].start ({prev})")
        prev = st.start
        check_config(st.seq_len >= 0 and st.rope_theta >= 0 and st.lr_mult > 0,
                     f"stages[{i}]: seq_len, rope_theta >= 0 and lr_mult > 0")
        for src, w in st.mix.items():
            check_config(w >= 0, f"stages[{i}].mix.{src}: weight must be >= 0, got {w}")
            if names:
                close = difflib.get_close_matches(src, names, n=1)
                hint = f"; did you mean '{close[0]}'?" if close else f"; sources are {names}"
                check_config(src in names, f"stages[{i}].mix: unknown source '{src}'{hint}")
        if st.mix:
            check_config(sum(st.mix.values()) > 0, f"stages[{i}].mix: weights sum to 0")
        check_config(st.batch_tokens >= 0,
                     f"stages[{i}].batch_tokens must be >= 0 (0 inherits), got {st.batch_tokens}")
        check_config(st.rewarmup_steps >= 0, f"stages[{i}].rewarmup_steps must be >= 0, got {st.rewarmup_steps}")
        validate_rope_scaling(st.rope_scaling, f"stages[{i}].rope_scaling", inherit=True)
        check_config(i > 0 or st.rewarmup_steps == 0,
               "stages[0].rewarmup_steps must be 0 (the first stage is warmed up by schedule.warmup_steps)")
        seq_len = st.seq_len or seq_len
        if st.batch_tokens:
            batch_tokens = st.batch_tokens
            check_config(batch_tokens % seq_len == 0,
                   f"stages[{i}].batch_tokens ({batch_tokens}) must be a multiple of the stage's seq_len ({seq_len})")
        elif st.seq_len:
            # The batch in tokens is inherited, so the batch in sequences must divide evenly at the new length.
            what = ("train.batch_size*train.seq_len" if batch_tokens == t.batch_size * t.seq_len
                    else "the inherited batch_tokens")
            check_config(batch_tokens % seq_len == 0 and batch_tokens // seq_len >= 1,
                   f"stages[{i}].seq_len ({st.seq_len}) must divide {what} ({batch_tokens})")


_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def closest_names(name: str, names: list[str]) -> list[str]:
    """``difflib.get_close_matches(name, names, n=1)`` with ties broken by the longer common prefix, not by the
    larger string (difflib's): ``cpp`` is as close to ``cp`` as to ``pp``, and a typo keeps the first letters."""
    close = difflib.get_close_matches(name, names, n=len(names))
    if not close:
        return []
    def rank(x: str) -> tuple[float, int]:  # difflib's score, then the common prefix's length
        return difflib.SequenceMatcher(None, name, x).ratio(), next(
            (i for i, (a, b) in enumerate(zip(name, x)) if a != b), min(len(name), len(x)))

    return [max(close, key=rank)]


def toml_words(value) -> str:
    """``value`` as a TOML file would spell it, for error messages: a boolean is ``true (a boolean)``, not
    Python's ``True``; anything else its ``repr``."""
    return f"{str(value).lower()} (a boolean)" if isinstance(value, bool) else repr(value)


def stage_parallel(cfg: Config, index: int) -> ParallelConfig:
    """The parallel layout stage ``index`` runs on: ``[parallel]`` with the stage's own ``parallel`` keys over it
    (``cfg.parallel`` itself when it sets none).

    Raises:
        ConfigError: an unknown key (with the closest one) or a value of the wrong type, naming
            ``stages[i].parallel.<key>``.
    """
    own = cfg.stages[index].parallel
    if not own:
        return cfg.parallel
    hints = typing.get_type_hints(ParallelConfig)
    for k, v in own.items():
        key = f"stages[{index}].parallel.{k}"
        if k not in hints:
            close = closest_names(k, list(hints))
            raise ConfigError(f"unknown config key '{key}'" + (f"; did you mean '{close[0]}'?" if close else
                                                                f"; valid keys: {', '.join(hints)}"))
        want = hints[k]
        ok = isinstance(v, want) and (want is bool or not isinstance(v, bool)) or (want is float and isinstance(
            v, int) and not isinstance(v, bool))
        check_config(ok, f"{key}: expected {_TYPE_WORDS[want]}, got {toml_words(v)}")
    return dataclasses.replace(cfg.parallel, **{k: float(v) if hints[k] is float else v for k, v in own.items()})


def stage_seq_lens(cfg: Config) -> list[tuple[str, int]]:
    """Each stage's sequence length, inherited down the table, with the key that set it (``train.seq_len`` or
    ``stages[i].seq_len``)."""
    out, key, t = [], "train.seq_len", cfg.train.seq_len
    for i, st in enumerate(cfg.stages):
        if st.seq_len:
            key, t = f"stages[{i}].seq_len", st.seq_len
        out.append((key, t))
    return out


def validate_parallel(cfg: Config) -> None:
    """The ``parallel`` section and each stage's own layout (:func:`stage_parallel`), each checked against the
    stages that run on it (the world size is checked at launch, where it is known). A stage's own layout is
    named in every message (``stage 'long_context': stages[2].parallel.cp ...``)."""
    lens = stage_seq_lens(cfg)
    own = {i for i, st in enumerate(cfg.stages) if st.parallel}
    seq_lens = {"train.seq_len": cfg.train.seq_len} if 0 not in own else {}
    seq_lens.update({k: t for i, (k, t) in enumerate(lens) if i not in own})
    _validate_layout(cfg, cfg.parallel, seq_lens, "parallel", "")
    for i in sorted(own):
        st, (key, t) = cfg.stages[i], lens[i]
        _validate_layout(cfg, stage_parallel(cfg, i), {key: t}, f"stages[{i}].parallel", f"stage '{st.name}': ",
                         st.parallel)


def _validate_layout(cfg: Config, p: ParallelConfig, seq_lens: dict[str, int], name: str, where: str,
                     own: dict | None = None) -> None:
    """One layout ``p`` (keys named ``<name>.<key>``, messages prefixed with ``where``; ``own``: the keys a stage
    sets itself, the others named as inherited from ``[parallel]``): degrees >= 1 or -1 (fill,
    at most one), tensor parallel dividing the head counts, d_ff and the vocabulary (each rank holds whole heads and
    equal slices), context parallel dividing each of ``seq_lens`` into ``2 cp`` equal chunks (the load-balanced
    split), the pipeline keys."""
    m = cfg.model

    def check(ok: bool, msg: str) -> None:
        check_config(ok, where + msg.replace("parallel.", f"{name}.") if name != "parallel" else msg)

    degrees = {"dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard, "cp": p.cp, "tp": p.tp}
    for k, v in degrees.items():
        check(v >= 1 or v == -1, f"parallel.{k} must be >= 1 or -1 (fill the world size), got {v}")
    # Upper bound: a week. torch turns the timeout into a timedelta (1e30 s overflows it at launch); no collective
    # of a healthy job waits anywhere near that long.
    check(0 < p.timeout_s <= 7 * 86400,
          f"parallel.timeout_s must be a number of seconds in (0, 604800] (a week), got {p.timeout_s}")
    fills = [k for k, v in degrees.items() if v == -1]
    if len(fills) > 1:
        # Name each -1 by the key the user would edit: a stage's layout inherits unset keys from [parallel]
        # (dp_replicate = -1 there by default), which a printed dict of merged degrees hid.
        keys = [f"{name}.{k}" if own is None or k in own else f"parallel.{k} (inherited from [parallel])"
                for k in fills]
        check_config(False, f"{where}{' and '.join(keys)} are {'both' if len(keys) == 2 else 'all'} -1: at most "
                            f"one degree may be -1 (it fills the world size); give the others a number")
    check(p.activation_checkpointing in ("none", "full", "selective"),
          f"parallel.activation_checkpointing must be none, full or selective, "
          f"got '{p.activation_checkpointing}'")
    if p.tp > 1:
        for k in ("n_heads", "n_kv_heads", "d_ff", "vocab_size"):
            check(getattr(m, k) % p.tp == 0,
                  f"parallel.tp ({p.tp}) must divide model.{k} ({getattr(m, k)}): each tensor-parallel rank "
                  f"holds whole heads and equal slices")
        check(p.activation_checkpointing != "full" or not (p.compile_blocks or cfg.train.compile),
              "parallel.activation_checkpointing = 'full' with parallel.compile_blocks (or train.compile) under "
              f"parallel.tp ({p.tp}) > 1 fails in torch 2.13's backward (a DeviceMesh saved for the recomputation); "
              "use 'selective' (which keeps the matmuls and collectives) or compile_blocks = false")
    if p.tp > 1 and p.sequence_parallel:
        e = cfg.eval
        for k, v in (("eval.tasks", e.tasks), ("eval.final_tasks", e.final_tasks), ("eval.samples", e.samples)):
            check(not v, f"parallel.sequence_parallel runs only forwards whose length is a multiple of "
                         f"parallel.tp; {k} ({v!r}) scores or generates texts of any length: set it empty/0 "
                         f"or turn sequence_parallel off")
        for k, t in seq_lens.items():
            n = p.tp * max(p.cp, 1)
            check(t % n == 0, f"parallel.sequence_parallel needs {k} ({t}) divisible by parallel.tp * cp "
                              f"({n}): each rank holds seq_len / (cp * tp) tokens between blocks")
    if p.cp > 1:
        for k, t in seq_lens.items():
            check(t % (2 * p.cp) == 0,
                  f"parallel.cp ({p.cp}) needs {k} ({t}) divisible by 2 * cp = {2 * p.cp}: each rank holds "
                  f"two of 2 * cp equal chunks of every sequence")
    validate_pipeline(cfg, p, check)


PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
PP_GRAD_SYNC = ("last", "microbatch")  # parallel.pp_grad_sync (densetrain.parallel.pipeline.GRAD_SYNC_MODES)


def validate_pipeline(cfg: Config, p: ParallelConfig | None = None, check=check_config) -> None:
    """The ``parallel.pp*`` keys of ``p`` (``cfg.parallel`` by default): a known schedule, virtual stages only with
    the interleaved one, a stage split that gives every stage at least one layer, and the features pipeline stages
    do not run (refused here, one line each, rather than failing mid-run). ``check``: how a failed condition is
    said (:func:`_validate_layout` names a stage's own layout)."""
    p, m = p or cfg.parallel, cfg.model
    check(p.pp >= 1, f"parallel.pp must be >= 1, got {p.pp}")
    check(p.pp_schedule in PP_SCHEDULES,
          f"parallel.pp_schedule must be one of {', '.join(PP_SCHEDULES)}, got '{p.pp_schedule}'")
    interleaved = p.pp_schedule == "interleaved_1f1b"
    check(p.pp_virtual_stages >= 2 if interleaved else p.pp_virtual_stages == 1,
          f"parallel.pp_virtual_stages ({p.pp_virtual_stages}) must be >= 2 with pp_schedule "
          f"'interleaved_1f1b' and 1 with '{p.pp_schedule}'")
    check(p.pp_microbatches >= 0,
          f"parallel.pp_microbatches must be >= 0 (0: automatic), got {p.pp_microbatches}")
    check(p.pp_layers_per_stage >= 0, f"parallel.pp_layers_per_stage must be >= 0, got {p.pp_layers_per_stage}")
    check(p.pp_grad_sync in PP_GRAD_SYNC, f"parallel.pp_grad_sync must be one of {', '.join(PP_GRAD_SYNC)}, "
                                          f"got '{p.pp_grad_sync}'")
    if p.pp == 1:
        return
    stages, units = p.pp * p.pp_virtual_stages, m.n_layers + 2
    check(units >= stages, f"parallel.pp * pp_virtual_stages = {stages} stages need at least as many layers; "
                           f"model.n_layers + 2 (embedding and head) is {units}")
    if p.pp_layers_per_stage:
        check(p.pp_layers_per_stage * stages == units,
              f"parallel.pp_layers_per_stage ({p.pp_layers_per_stage}) times {stages} stages must be "
              f"model.n_layers + 2 = {units} (the embedding and the head count as one layer each)")
    check(p.pp_microbatches == 0 or p.pp_microbatches >= p.pp,
          f"parallel.pp_microbatches ({p.pp_microbatches}) must be >= parallel.pp ({p.pp}): fewer micro-batches "
          f"than stages leave a stage idle the whole step")
    refused = (("model.tie_embeddings", m.tie_embeddings, "the embedding and the head sit on different stages"),
               ("train.compile", cfg.train.compile, "whole-model compile cannot see a stage; use "
                                                    "parallel.compile_blocks"),
               ("eval.samples", cfg.eval.samples, "generation (KV cache) does not run through pipeline stages"),
               *((key, generative_tasks(text), "its generative tasks (" + ", ".join(generative_tasks(text)) + ") run "
                  "the KV cache or chunked head, which pipeline stages do not; multiple-choice tasks do run")
                 for key, text in (("eval.tasks", cfg.eval.tasks), ("eval.final_tasks", cfg.eval.final_tasks))))
    for key, on, why in refused:
        check(not on, f"parallel.pp ({p.pp}) > 1 cannot run with {key} set: {why}; set it off or pp = 1")


def generative_tasks(text: str) -> list[str]:
    """The :data:`~densetrain.registry.gen_tasks.GEN_TASKS` names a task list (``eval.tasks``) asks for, groups
    expanded (shot counts dropped); unknown names are left to the task check."""
    names = [t.split(":")[0].strip() for t in text.split(",") if t.strip()]
    return [m for n in names for m in GROUPS.get(n, (n,)) if m in GEN_TASKS]


ROPE_SCALING_TYPES = ("none", "linear", "llama3", "yarn")


def validate_rope_scaling(rs, key: str, inherit: bool) -> None:
    """One ``rope_scaling`` table (a :class:`RopeScalingConfig`); ``inherit``: type '' is allowed (a stage)."""
    types = ("", *ROPE_SCALING_TYPES) if inherit else ROPE_SCALING_TYPES
    check_config(rs.type in types, f"{key}.type must be one of {', '.join(repr(t) for t in types)}, got '{rs.type}'")
    if rs.type in ("", "none"):
        return
    check_config(rs.factor >= 1, f"{key}.factor must be >= 1 (a context extension), got {rs.factor}")
    check_config(rs.original_max_position_embeddings > 0,
                 f"{key}.original_max_position_embeddings must be positive, got {rs.original_max_position_embeddings}")
    if rs.type == "llama3":
        check_config(0 < rs.low_freq_factor < rs.high_freq_factor,
                     f"{key}: need 0 < low_freq_factor < high_freq_factor, "
                     f"got {rs.low_freq_factor}, {rs.high_freq_factor}")
    if rs.type == "yarn":
        check_config(0 < rs.beta_slow < rs.beta_fast,
                     f"{key}: need 0 < beta_slow < beta_fast, got {rs.beta_slow}, {rs.beta_fast}")
        check_config(rs.attention_factor >= 0,
                     f"{key}.attention_factor must be >= 0 (0: YaRN's default), got {rs.attention_factor}")


def _non_finite(obj, key: str):
    """``(key, value)`` of the first NaN or infinite float under ``obj`` (dataclasses, lists, dicts), or None."""
    if isinstance(obj, float):
        return None if math.isfinite(obj) else (key, obj)
    if dataclasses.is_dataclass(obj):
        items = ((f"{key}.{f.name}" if key else f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj))
    elif isinstance(obj, dict):
        items = ((f"{key}.{k}", v) for k, v in obj.items())
    elif isinstance(obj, list):
        items = ((f"{key}[{i}]", v) for i, v in enumerate(obj))
    else:
        return None
    for k, v in items:
        bad = _non_finite(v, k)
        if bad:
            return bad
    return None


def validate_finite(cfg) -> None:
    """Every float of the config tree (any section, list item or table value) is finite: ``nan`` fails every
    comparison and ``inf`` passes every ``> 0``, so each later range check would let them through (a NaN
    norm eps or Adam eps trains on NaN; an infinite soft-cap or lr_mult is silently a different run)."""
    bad = _non_finite(cfg, "")
    check_config(bad is None, f"{bad[0]} must be a finite number, got {bad[1]}" if bad else "")


MAX_PARAMS = 10**13
"""Largest model (parameters) a config may describe. 10^13 is 40 TB of fp32 weights (plus 80 TB of AdamW
state), ten times the largest dense models trained to date (~10^12); a larger count is a typo or a crafted
file, refused from the arithmetic before a layer is built (building 10^8 layers, even on the meta device,
loops for hours)."""

MAX_LAYERS = 1000
"""Most transformer blocks a config may describe: the deepest published transformer has 1,000 layers
(DeepNet, Wang et al. 2022); Llama 3 405B has 126. Blocks are built one by one in Python (~4 ms each even
on the meta device), so 10^8 layers of a tiny width, under :data:`MAX_PARAMS`, would loop for days."""

SEED_RANGE = 2**64
"""Seeds are in [0, 2**64): torch.manual_seed and numpy's SeedSequence take 64-bit values."""


def model_params(m) -> int:
    """Parameters of a :class:`ModelConfig` (Python ints, no overflow): embeddings, the output head unless
    tied, per block the q/k/v/o projections (k and v of width n_kv_heads * head_dim), the three SwiGLU
    matrices and two RMSNorm gains, and the final norm. Equals ``Transformer(cfg).num_params()``."""
    kv = m.n_kv_heads * (m.d_model // max(m.n_heads, 1))
    block = 2 * m.d_model * m.d_model + 2 * m.d_model * kv + 3 * m.d_model * m.d_ff + 2 * m.d_model
    return m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2) + m.n_layers * block + m.d_model


_ONE_SLASH = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/(?!/)")


def check_local_or_url(value: str, key: str) -> None:
    """``value`` of ``key`` (a path or an fsspec URL) is not a URL with one slash after its protocol (``s3:/bucket``:
    a local folder named ``s3:`` would take the run's files while the log says "uploaded to s3:/bucket") nor with a
    protocol in capitals (fsspec's are lower case). Raises: ConfigError naming the key."""
    m = _ONE_SLASH.match(value or "")
    check_config(m is None, f"{key} = '{value}' looks like a URL with one slash after '{m and m.group(1)}:'; "
                            f"expected '{m and m.group(1)}://...' (or a local path without the colon)")
    # storage takes file:// for a path of its own ("file:/x" relative to the current folder): a prepare wrote there
    check_config(not (value or "").startswith("file://"), f"{key} = '{value}': give a local folder as its path "
                                                         f"('{(value or '')[len('file://'):]}'), not a file:// URL")
    proto = value.split("://", 1)[0] if "://" in (value or "") else ""
    check_config(proto == proto.lower(), f"{key} = '{value}': fsspec protocols are lower case, expected "
                                         f"'{proto.lower()}://...'")


def validate_bounds(cfg) -> None:
    """Bounds a value can break without failing a type check: an empty run directory (the current folder,
    whose files a run would overwrite), a negative held-out cap, seeds outside the generators' range, a
    negative peak FLOP/s, and a model too large or too deep to exist (:data:`MAX_PARAMS`, :data:`MAX_LAYERS`)."""
    t, d = cfg.train, cfg.data
    check_config(t.run_dir.strip() != "", "train.run_dir must name a directory, got ''")
    check_config("://" not in t.run_dir, f"train.run_dir must be a local directory (logs, metrics, the checkpoints' "
                                         f"staging), got the URL '{t.run_dir}': put checkpoints in a store with "
                                         f"checkpoint.dir")
    for key, value in (("train.run_dir", t.run_dir), ("data.shards_dir", d.shards_dir),
                       ("checkpoint.dir", cfg.checkpoint.dir)):
        check_local_or_url(value, key)
    check_config(d.max_val_tokens >= 0, f"data.max_val_tokens must be >= 0, got {d.max_val_tokens}")
    for key, seed in (("train.seed", t.seed), ("data.seed", d.seed)):
        check_config(0 <= seed < SEED_RANGE, f"{key} must be in [0, 2**64), got {seed}")
    check_config(cfg.logging.peak_flops >= 0,
                 f"logging.peak_flops must be >= 0 (0 measures it), got {cfg.logging.peak_flops}")
    m = cfg.model
    check_config(m.n_layers <= MAX_LAYERS, f"model.n_layers must be at most {MAX_LAYERS} (the deepest published "
                                           f"transformer, DeepNet 2022), got {m.n_layers}")
    if min(m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.d_ff) > 0:  # else named below
        n = model_params(m)
        check_config(n <= MAX_PARAMS, f"model: {n:.3g} parameters (vocab_size {m.vocab_size}, d_model {m.d_model}, "
                                      f"n_layers {m.n_layers}, d_ff {m.d_ff}) exceed the limit of {MAX_PARAMS:.0e}")
