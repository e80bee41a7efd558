"""Everything a run needs before its first step, checked before any compute: config, process group,
data, model, optimizer, resume point, metrics sinks, watchers. :func:`setup` returns one :class:`Run`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from densetrain.checkpoint import (
    Checkpointer,
    CheckpointReadError,
    list_complete,
    load_checkpoint,
    open_store,
    save_checkpoint,
)
from densetrain.config import Config, ParallelConfig, absolute_paths, save_config
from densetrain.data.mixture import MixtureSampler
from densetrain.data.provenance import window_documents
from densetrain.data.shards import TokenFiles
from densetrain.data.streams import data_fingerprint, open_streams
from densetrain.data.tokenizer import Tokenizer, load_tokenizer
from densetrain.errors import ConfigError, TrainError
from densetrain.fileio import mark_kind
from densetrain.metrics import MetricsLogger, measure_peak_flops, read_metrics
from densetrain.model.compiling import pin_inductor_cache
from densetrain.model.llama import Transformer
from densetrain.optim import build_optimizer
from densetrain.parallel import DistInfo, autocast_for, build_parallel_model, init_distributed
from densetrain.parallel.mesh import Layout, keep_intent
from densetrain.parallel.pipeline import resolve_microbatches
from densetrain.parallel.stage_layout import layouts_that_fit, stage_layouts
from densetrain.registry.tasks import data_root, parse_task_list, resolve_tasks
from densetrain.schedule import Stage, resolve_stages, stage_at
from densetrain.train.rundir import (
    check_same_run,
    claim_run_dir,
    configured_steps,
    keep_started_dtype,
    lock_run_dir,
    refuse_existing_run,
    refuse_model_change,
    refuse_other_kind,
    set_aside_future,
)
from densetrain.train.startlog import layout_words, log_decisions, log_layout, log_restart, log_resume, warn_repeats
from densetrain.train.state import TrainState
from densetrain.train.step import draw_samples, keep_freed_memory
from densetrain.train.watch.collect import GarbageCollection
from densetrain.train.watch.curve import OffCurve
from densetrain.train.watch.faults import FaultInjector
from densetrain.train.watch.guard import Guard
from densetrain.train.watch.health import HealthWatch
from densetrain.train.watch.probe import DataProbe
from densetrain.train.watch.replicas import ReplicaCheck, replica_groups
from densetrain.train.watch.updates import UpdateNorms
from densetrain.train.watch.watchdog import Watchdog
from densetrain.train.watchers import Watcher


@dataclass
class Run:
    """A run in progress: what the loop and the watchers read and update."""

    cfg: Config
    info: DistInfo
    run_dir: Path
    stages: list[Stage]
    train_streams: dict[str, TokenFiles]
    val_streams: dict[str, TokenFiles]
    sampler: MixtureSampler
    model: Transformer  # the plain module: evals, checkpoints, stage changes
    dp_model: torch.nn.Module  # the module the step runs (DDP / compiled wrapper)
    optimizer: torch.optim.Optimizer
    tokenizer: Tokenizer
    log: MetricsLogger
    checkpointer: Checkpointer
    watchers: list[Watcher]
    autocast: contextlib.AbstractContextManager | None
    peak_flops: float
    last_step: int
    state: TrainState = field(default_factory=TrainState)
    data_id: dict[str, str] = field(default_factory=dict)
    last_val: dict[str, dict] = field(default_factory=dict)
    warned: set[str] = field(default_factory=set)  # truncation warnings already logged
    t_start: float = field(default_factory=time.perf_counter)
    position_loss: dict[str, dict] = field(default_factory=dict)  # 'before <stage>' / 'final' -> bucket losses
    lr_scale: float = 1.0  # set by the guard after a rollback (guard.lr_factor)
    optimizer_seconds: float = 0.0  # the last step's optimizer time (the watchdog's 'optimizer' phase)
    eval_seconds: float = 0.0  # total time in in-loop evals (the watchdog's 'eval' phase)
    layouts: list[tuple[ParallelConfig, Layout]] = field(default_factory=list)  # per stage (stage_layouts)
    parallel: ParallelConfig | None = None  # the layout in force: cfg.parallel, or the stage's own (switch_layout)

    def batch_documents(self, result, source: str | None = None, limit: int = 20) -> dict:
        """Provenance of a step's batch for events: the global sample range, and the documents of this
        rank's samples (all of them in one process; ``densetrain blame`` lists the whole batch)."""
        docs = []
        for smp in result.samples:
            if source is None or smp.source == source:
                docs += window_documents(self.cfg.data.shards_dir, smp.source, self.train_streams[smp.source],
                                         smp.start, len(smp.tokens))
        return {"samples": [result.first_sample, result.first_sample + result.stage.batch_size],
                "documents": docs[:limit], "more": max(0, len(docs) - limit)}

    @property
    def source_names(self) -> list[str]:
        return [s.name for s in self.cfg.data.sources]

    def state_dict(self) -> dict:
        """The checkpoint's ``trainer_state.json``: counters, sampler position, data fingerprint, watchers."""
        return {**self.state.state_dict(), "data": self.data_id, "sampler": self.sampler.state_dict(),
                "world_size": self.info.world_size, "layout": dataclasses.asdict(self.info.layout),
                "dtype": "bf16" if self.autocast else "fp32",  # what train.dtype = 'auto' keeps on resume
                "watchers": {w.name: w.state_dict() for w in self.watchers}}

    def load_state_dict(self, d: dict) -> None:
        """Take a checkpoint's ``trainer_state.json`` (checked by ``dcp_read.check_trainer_state``), checked against
        this run's config: stage names, source names, seq_len grids, the data order, watcher windows.

        Raises:
            ConfigError: this config draws the data in another order (``train.seed``, ``data.shuffle``).
            ValueError: ``<key>: expected ..., got ...`` (setup names the file).
        """
        names = {st.name for st in self.stages}
        if d.get("stage", "") not in ("", *names):
            raise ValueError(f"stage: expected '' or a stage name ({sorted(names)}), got {d['stage']!r}")
        self.state.load_state_dict(d)
        self.sampler.load_state_dict(d["sampler"], seq_lens={st.seq_len for st in self.stages}, stages=names,
                                     sources=set(self.source_names), shuffle_seed=self.stages[0].shuffle_seed)
        for w in self.watchers:
            w.load_state_dict(d.get("watchers", {}).get(w.name, {}))


def check_stages(stages: list[Stage], streams: dict[str, TokenFiles], info: DistInfo, model,
                 parallel=None, layouts: list[tuple[ParallelConfig, Layout]] | None = None,
                 own: frozenset[int] = frozenset()) -> None:
    """Every stage can draw a full sequence from each source of its mix and splits over the ranks (and,
    under pipeline parallelism, gives every rank enough micro-batches for the stages: ``parallel``), each
    on its own layout when ``layouts`` (:func:`stage_layouts`) gives them, else on ``info``'s. ``own``: the
    indices of stages that set their own layout (``stages[i].parallel``), whose advice names those keys.

    Raises:
        TrainError: a source shorter than one sequence, or a batch that does not divide over the
            data-parallel ranks; the message names the layouts (``parallel.tp``) that would run it.
        ConfigError: a stage with fewer micro-batches per rank than pipeline stages.
    """
    for st in stages:
        for name in st.mix:
            if len(streams[name]) < st.seq_len + 1:
                raise TrainError(f"source '{name}' has {len(streams[name])} train tokens, fewer than one "
                                 f"sequence of stage '{st.name}' (seq_len {st.seq_len} + 1)")
        par, dp, pp = (parallel, info.dp_size, info.pp_size) if not layouts else \
            (layouts[st.index][0], layouts[st.index][1].dp_size, layouts[st.index][1].pp)
        if st.batch_size % (dp * st.micro_batch_size):
            raise TrainError(f"stage '{st.name}': batch of {st.batch_size} sequences does not split into "
                             f"{dp} data-parallel ranks x micro_batch_size {st.micro_batch_size}; "
                             + layouts_that_fit(info.world_size, st, model, par,
                                                f"--stages.{st.index}.parallel." if st.index in own else "--parallel."))
        if par is not None and pp > 1:
            resolve_microbatches(par.pp_microbatches, pp, par.pp_virtual_stages,
                                 st.batch_size // (dp * st.micro_batch_size), f" at stage '{st.name}'")


def start_step(run_dir: Path, resume: bool, rollback_to: int | None) -> int:
    """The step this launch starts at, before anything is loaded: ``rollback_to``, else (resuming) the newest
    complete checkpoint's, else 0. It decides the first layout (the stage at that step has it); when the
    resume then passes over that checkpoint for an older one, the loop's first :func:`switch_layout` moves."""
    if rollback_to is not None:
        return rollback_to
    done = list_complete(run_dir) if resume else []
    return done[-1][0] if done else 0


def switch_layout(run: Run, st: Stage) -> None:
    """Entering stage ``st``: when its layout (:func:`stage_layouts`) differs from the one in force, move the run
    onto it in the same processes: write the step's checkpoint (unless it has one), drop the model, its
    wrappers and the optimizer, build the new device mesh, model and optimizer as :func:`setup` builds them
    (without initial weights), load the checkpoint resharded (DCP), and rebuild the watchers that depend on
    the layout (their state kept). One ``parallel`` event (action ``switch``) says old -> new and the seconds
    taken. Every rank calls it at the same step (the loop, at each stage's first step, and after a rollback
    into another stage); a stage on the layout in force costs nothing.

    Why a checkpoint and not an in-memory reshard: DCP already maps any layout's state onto any other (as a
    resume on other degrees does), and the switch leaves a resumable point exactly at the boundary.
    """
    par, lay = run.layouts[st.index] if run.layouts else (run.cfg.parallel, run.info.layout)
    if par == run.parallel:
        return
    t0, step, old = time.perf_counter(), run.state.step, run.info.layout
    run.checkpointer.finish_pending(run.log)  # an async save in flight completes first
    path = dict(list_complete(run.run_dir)).get(step)
    if path is None:
        path = save_checkpoint(run.run_dir, step, run.model, run.optimizer, run.state_dict(), run.checkpointer.keep,
                               run.checkpointer.on_written)
    t_saved = time.perf_counter()
    # The old mesh's process groups stay registered with torch.distributed (a dimension spanning the world may
    # be the default group itself): only the modules, their hooks and the optimizer state are dropped.
    run.model = run.dp_model = run.optimizer = None
    gc.collect()
    run.info = init_distributed(run.cfg.train.device, par)
    # No initial weights: the checkpoint fills them (no full copy of the model on the CPU per rank).
    run.model, run.dp_model, run.optimizer = build_model_and_optimizer(run.cfg, run.info, par, run.layouts,
                                                                       init=False)
    t_built = time.perf_counter()
    load_checkpoint(path, run.model, run.optimizer)
    run.watchers = make_watchers(run.cfg, run.info, run.run_dir, old=run.watchers)
    dt = time.perf_counter() - t0
    # the keys that differ, said: the degrees may be equal (a stage changing only e.g. parallel.pp_grad_sync)
    keys = {f.name: (getattr(run.parallel, f.name), getattr(par, f.name)) for f in dataclasses.fields(par)
            if getattr(run.parallel, f.name) != getattr(par, f.name)}
    run.parallel, why = par, ", ".join(f"parallel.{k} {a!r} -> {b!r}" for k, (a, b) in keys.items())
    run.log.event(step, f"layout: stage '{st.name}' switches {old} -> {lay} ({layout_words(lay)}; {why}) in "
                        f"{dt:.2f}s (checkpoint {path.name}, new mesh, wrappers and optimizer, resharded reload)",
                  kind="parallel", action="switch",
                  values={"stage": st.name, "from": dataclasses.asdict(old), "to": dataclasses.asdict(lay),
                          "changed": {k: list(v) for k, v in keys.items()},
                          "seconds": dt, "checkpoint": path.name, "checkpoint_s": t_saved - t0,
                          "rebuild_s": t_built - t_saved, "load_s": time.perf_counter() - t_built})


def build_model_and_optimizer(cfg: Config, info: DistInfo, par: ParallelConfig,
                              layouts: list[tuple[ParallelConfig, Layout]], init: bool = True):
    """``(model, step_model, optimizer)`` of ``cfg`` on layout ``par`` (meta -> TP -> AC -> compile -> FSDP2 ->
    init, or DDP: :func:`build_parallel_model`), the sequence lengths checked being those of the stages that run
    on it; ``init=False``: weights left for a checkpoint to fill (sharded layouts)."""
    lens = {f"stages[{i}].seq_len": st.seq_len for i, st in enumerate(cfg.stages)
            if st.seq_len and layouts and layouts[i][0] == par}
    if layouts and layouts[0][0] == par:
        lens["train.seq_len"] = cfg.train.seq_len
    cfg = dataclasses.replace(cfg, parallel=par)
    model, dp_model = build_parallel_model(cfg, info, seq_lens=lens if layouts else None, init=init)
    return model, dp_model, build_optimizer(model, cfg)


def probe_peak_flops(device: torch.device, autocast) -> float:
    """The mfu denominator measured on ``device`` in the dtype the run's matmuls use (bf16 under ``autocast``)."""
    return measure_peak_flops(device, torch.bfloat16 if autocast else torch.float32)


def make_watchers(cfg: Config, info: DistInfo, run_dir: Path, old: list[Watcher] = ()) -> list[Watcher]:
    """The watchers of a run (the decision point's inputs); fault injection only when faults are configured.
    ``old``: the watchers of the layout :func:`switch_layout` leaves: each kept as it is, except those built from
    the layout (the replica check, the update norms), built for ``info`` and given the old one's state."""
    kept = {type(w): w for w in old}

    def get(cls, build, per_layout: bool = False) -> Watcher:
        if cls in kept and not per_layout:
            return kept[cls]
        w = build()
        if cls in kept:
            w.load_state_dict(kept[cls].state_dict())
        return w

    # Faults first: the others must see the batch and gradients as the fault left them.
    watchers: list[Watcher] = [get(FaultInjector, lambda: FaultInjector(cfg.faults, info.rank))] if cfg.faults else []
    watchers.append(get(Guard, lambda: Guard(cfg.guard, cfg.train.max_nonfinite_steps)))
    if cfg.guard.replica_every and replica_groups(info.layout):  # after the guard: it sets run.lr_scale first
        watchers.append(get(ReplicaCheck, lambda: ReplicaCheck(cfg.guard, info), per_layout=True))
    if cfg.guard.update_every:
        watchers.append(get(UpdateNorms, lambda: UpdateNorms(cfg.guard, extra_group=info.pp_group), per_layout=True))
    if cfg.watchdog.every or cfg.watchdog.hang_seconds:
        watchers.append(get(Watchdog, lambda: Watchdog(cfg.watchdog, info.rank, info.world_size, run_dir)))
    if cfg.probe.every:
        watchers.append(get(DataProbe, lambda: DataProbe(cfg.probe, [s.name for s in cfg.data.sources])))
    if cfg.train.gc_freq:
        watchers.append(get(GarbageCollection, lambda: GarbageCollection(cfg.train.gc_freq)))
    if cfg.eval.ladder or cfg.eval.every > 0:  # every run forecasts its final loss (issue 42, item 4)
        watchers.append(get(OffCurve, lambda: OffCurve(cfg, info.rank)))
    if cfg.health.every:  # last: its checks run after the watchdog has timed the step
        watchers.append(get(HealthWatch, lambda: HealthWatch(
            cfg.health, next((w for w in watchers if isinstance(w, Watchdog)), None))))
    for w in old:
        if w not in watchers:
            w.close()  # replaced (or no longer wanted on this layout, e.g. no replicas left to compare)
    return watchers


def setup(cfg: Config, resume: bool = False, stop_after: int | None = None, rollback_to: int | None = None,
          skip_batches: int = 0, keep_layout_intent: bool = False) -> Run:
    """Build the :class:`Run` of ``cfg``; with ``resume``, restored from the newest loadable checkpoint
    (a fresh start when there is none; ``train.resume = 'auto'`` is ``resume`` after :func:`check_same_run`).
    ``stop_after`` ends this invocation after that many steps in
    total (the schedule still refers to ``cfg.train.steps``). ``rollback_to`` (with ``resume``): set the
    checkpoints after that step aside (moved, not deleted; with the files made from them:
    :func:`set_aside_future`) and resume from it; ``skip_batches``: then
    advance the sampler past that many global batches without training on them. ``keep_layout_intent``
    (a plain ``--resume``, no ``--parallel.*`` flags): on a world size the configured degrees do not fit,
    lay the processes out as :func:`layout_keeping_intent` says, and say so in one event.

    Raises:
        TrainError / DataError: one line (no data, batch not divisible by ranks, existing run, no
            checkpoint at ``rollback_to``, ...).
    """
    run_dir = Path(cfg.train.run_dir)
    try:
        stages = resolve_stages(cfg)
    except ValueError as e:
        raise TrainError(str(e)) from None
    adapted: list[str] = []  # a plain resume lays each stage's own degrees out as [parallel]'s (logged below)
    layouts = stage_layouts(cfg, stages, int(os.environ.get("WORLD_SIZE", "1")),
                            layout_keeping_intent(cfg) if keep_layout_intent else None,
                            adapt=adapted if keep_layout_intent else None)
    # The stage at the step this launch starts from decides the first layout (a resume lands on its stage's).
    parallel = layouts[stage_at(start_step(run_dir, resume or cfg.train.resume == "auto", rollback_to),
                                stages).index][0]
    info = init_distributed(cfg.train.device, parallel)
    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    if cfg.train.keep_freed_memory and info.device.type == "cpu":
        keep_freed_memory()
    pin_inductor_cache()  # before anything compiles (train.compile, compile_blocks, bf16 cross-entropy)
    train_streams = open_streams(cfg, "train")
    try:
        stages = resolve_stages(cfg, available=set(train_streams))
    except ValueError as e:
        raise TrainError(str(e)) from None
    check_stages(stages, train_streams, info, cfg.model, parallel, layouts,
                 frozenset(i for i, s in enumerate(cfg.stages) if s.parallel))
    refuse_other_kind(run_dir, info)  # before anything there is read or written
    if cfg.train.resume == "auto":  # the same command restarts the job: continue the run dir's own run
        check_same_run(run_dir, cfg, info)
        resume = True
    elif resume:
        refuse_model_change(run_dir, cfg, info)  # before a checkpoint is tried, fetched or set aside
    open_store(run_dir, cfg.checkpoint.dir, resume, rollback_to)  # checkpoint.dir: a resume fetches what the run
    # dir lacks (the newest, or the --rollback-to step)
    saved_cfg = absolute_paths(cfg)  # config.toml keeps the user's train.dtype ('auto' stays 'auto'), its paths
    # absolute: eval, export, blame, replay and --resume read it from any directory (densetrain/config/paths.py)
    cfg, dtype_note = keep_started_dtype(cfg, run_dir, rollback_to, info.device) if resume else (cfg, None)
    model, dp_model, optimizer = build_model_and_optimizer(cfg, info, parallel, layouts)
    last = min(cfg.train.steps, stop_after) if stop_after else cfg.train.steps
    checkpointer = Checkpointer(run_dir, cfg.checkpoint.every, cfg.checkpoint.keep, last, cfg.checkpoint.async_save,
                                cfg.checkpoint.dir)
    lock_run_dir(run_dir, info)  # before anything in the run dir is read, moved or written
    if rollback_to is not None:
        if rollback_to not in [s for s, _ in list_complete(run_dir)]:
            raise TrainError(f"{run_dir}: no complete checkpoint at step {rollback_to} to roll back to "
                             f"(have: {[s for s, _ in list_complete(run_dir)]})")
        set_aside_future(run_dir, rollback_to, info.is_main, cfg.checkpoint.dir)
    ckpt, saved = checkpointer.load_latest(model, optimizer) if resume else (None, None)
    if not resume:
        refuse_existing_run(run_dir, info)  # (resume without a checkpoint yet, e.g. killed early: start over)
    if info.is_main:
        claim_run_dir(run_dir)
    old_steps = configured_steps(run_dir) if saved and info.is_main else None
    started = (run_dir / "config.toml").exists()  # an earlier attempt, before this one writes it
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not (resume and started):  # a resumed run's config.toml is replaced last, once every check passed
            save_config(saved_cfg, run_dir / "config.toml")  # the first file (a full disk names it)
        mark_kind(run_dir, "run")  # an older run without the marker gets it now
    step = saved["step"] if saved else 0
    # The last step the previous attempt recorded, before the logger rewinds metrics.jsonl to the checkpoint.
    logged = max((r["step"] for r in read_metrics(run_dir) if r.get("kind") == "train"), default=None) \
        if resume and info.is_main else None
    log = MetricsLogger(run_dir, info.rank, cfg.logging.tensorboard, resume_step=step if resume else None,
                        wandb=cfg if cfg.logging.wandb else None)
    if old_steps is not None and old_steps != cfg.train.steps:
        # The lr curve and the stage starts are fractions of train.steps: a resume with another total
        # recomputes both from here on (e.g. a finished cosine run climbs back above min_lr).
        log.event(step, f"WARNING: train.steps changed from {old_steps} to {cfg.train.steps} on resume: the lr "
                        f"schedule and the stage starts are recomputed over {cfg.train.steps} steps from step {step}")
    if dtype_note:
        log.event(step, dtype_note, kind="resume")
    for note in checkpointer.notes:  # newer checkpoint directories the resume passed over (partial saves)
        log.event(step, note, kind="resume", action="pass_over")
    autocast = autocast_for(cfg.train.dtype, info.device)
    run = Run(cfg=cfg, info=info, run_dir=run_dir, stages=stages, train_streams=train_streams,
              val_streams=open_streams(cfg, "val"), sampler=MixtureSampler(train_streams), model=model,
              dp_model=dp_model, optimizer=optimizer,
              tokenizer=load_tokenizer(cfg.data.tokenizer, cfg.data.shards_dir),  # val bpb, downstream tasks
              log=log, checkpointer=checkpointer, watchers=make_watchers(cfg, info, run_dir), autocast=autocast,
              peak_flops=cfg.logging.peak_flops or probe_peak_flops(info.device, autocast),
              last_step=last, data_id=data_fingerprint(train_streams), layouts=layouts, parallel=parallel)
    if saved:
        try:
            run.load_state_dict(saved)
        except ConfigError as e:  # the launch's config, not the file, is at fault: no 'crafted file' wording
            raise ConfigError(f"{ckpt}: {e}") from None
        except ValueError as e:  # a crafted or foreign trainer_state.json: one line naming it and the key
            raise CheckpointReadError(f"{ckpt}/trainer_state.json: {e}") from None
        log_resume(run, ckpt, saved)
        if keep_layout_intent:
            log_layout(run, saved)
    elif resume and started:  # stopped before its first checkpoint (e.g. a second signal): say it starts over
        how = "train.resume=auto" if cfg.train.resume == "auto" else "--resume"
        run.log.event(0, f"{run_dir}: no checkpoint yet, so {how} starts the run from step 0", kind="resume")
    elif resume:  # nothing there yet (`make demo` on a fresh clone resumes whatever it finds)
        run.log.event(0, f"{run_dir}: a new run (nothing to resume there yet)", kind="resume")
    if resume:
        log_restart(run, logged)
    for line in adapted:
        log.event(step, line, kind="parallel", action="adapt")
    if rollback_to is not None:
        skip_data(run, skip_batches, f"manual rollback to step {rollback_to}")
    if cfg.eval.tasks or cfg.eval.final_tasks:
        # Fail now, not after hours of training: unknown task names or missing task data.
        resolve_tasks(parse_task_list(f"{cfg.eval.tasks},{cfg.eval.final_tasks}"))
        data_root()
    missing = sorted(set(run.source_names) - set(train_streams))
    if missing:
        log.event(step, f"WARNING: sources without data left out of every mix: {missing}")
    if ckpt is None:
        warn_repeats(run, cfg.train.steps)
    log_decisions(run, saved, ckpt, keep_layout_intent)
    if info.is_main and ckpt is None:
        where = f" in rank 0's pipeline stages (pp {info.layout.pp})" if info.layout.pp > 1 else ""
        log.event(step, f"model: {model.num_params() / 1e6:.2f}M parameters{where}; "
                        f"{'bf16 autocast' if autocast else 'fp32'} (train.dtype={cfg.train.dtype}); peak "
                        f"{run.peak_flops / 1e12:.3f} TFLOP/s per device "
                        f"({'declared' if cfg.logging.peak_flops else 'measured by matmul probe'})")
    if info.is_main and resume and started:
        # Only now: a resume whose overrides a check refused (another seq_len, train.seed, ...) must leave the
        # run's config.toml as it was, or every later plain --resume would fail on the refused value.
        save_config(saved_cfg, run_dir / "config.toml")
    return run


def skip_data(run: Run, n_batches: int, why: str) -> None:
    """Advance the sampler past ``n_batches`` global batches of the current stage without reading them."""
    first = run.sampler.state["samples_seen"]
    st = stage_at(run.state.step, run.stages)
    for _ in range(n_batches):
        draw_samples(run.sampler, st, keep=range(0))
    run.sampler.events.clear()
    run.log.event(run.state.step, f"{why}: skipped {n_batches} batches (samples {first}.."
                                  f"{run.sampler.state['samples_seen']})", kind="rollback", action="skip_data",
                  values={"skipped_samples": [first, run.sampler.state["samples_seen"]]})


def layout_keeping_intent(cfg: Config):
    """``cfg.parallel`` with the degrees of :func:`densetrain.parallel.mesh.keep_intent` for this launch's
    world size (``WORLD_SIZE``, as torchrun sets it): the configured layout where it fits, else one that
    shards, replicates and splits tensors as the run asked, whose data-parallel ranks divide every
    stage's batch. ``config.toml`` keeps the configured degrees, so every later resume sees the same intent.

    Raises:
        ConfigError: no such layout; the line names the ``--parallel.*`` flags of layouts that run.
    """
    p, m = cfg.parallel, cfg.model
    try:  # the stages that run on [parallel] (a stage's own layout is resolved as it says: stage_layouts)
        stages = [st for st in resolve_stages(cfg) if not cfg.stages[st.index].parallel]
    except ValueError:
        stages = []  # the stage table's own error comes, as one line, from setup's checks

    def runs(lay) -> bool:
        return (all(getattr(m, k) % lay.tp == 0 for k in ("n_heads", "n_kv_heads", "d_ff", "vocab_size"))
                and all(st.batch_size % (lay.dp_size * st.micro_batch_size) == 0 for st in stages)
                and all(st.seq_len % (2 * lay.cp) == 0 for st in stages)  # cp's 2*cp load-balanced chunks
                and all(st.batch_size // (lay.dp_size * st.micro_batch_size) >= lay.pp for st in stages))

    lay = keep_intent(p.dp_replicate, p.dp_shard, p.tp, int(os.environ.get("WORLD_SIZE", "1")), runs, cp=p.cp,
                      pp=p.pp)
    return dataclasses.replace(p, dp_replicate=lay.dp_replicate, dp_shard=lay.dp_shard, tp=lay.tp, cp=lay.cp,
                               pp=lay.pp)
