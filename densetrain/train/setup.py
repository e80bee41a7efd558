"""Everything a run needs before its first step, checked before any compute: config, process group,
data, model, optimizer, resume point, metrics sinks, watchers. :func:`setup` returns one :class:`Run`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from densetrain.checkpoint import Checkpointer, list_complete
from densetrain.config import Config, save_config
from densetrain.data.mixture import MixtureSampler
from densetrain.data.shards import TokenFiles
from densetrain.data.streams import data_fingerprint, open_streams
from densetrain.data.tokenizer import Tokenizer, load_tokenizer
from densetrain.errors import TrainError
from densetrain.metrics import MetricsLogger, measure_peak_flops
from densetrain.model.llama import Transformer
from densetrain.optim import build_optimizer
from densetrain.parallel import DistInfo, all_reduce_sum, autocast_for, build_parallel_model, init_distributed
from densetrain.registry.tasks import data_root, resolve_tasks
from densetrain.schedule import Stage, resolve_stages
from densetrain.train.state import TrainState
from densetrain.train.watchers import Watcher, default_watchers


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

    @property
    def source_names(self) -> list[str]:
        return [s.name for s in self.cfg.data.sources]

    def state_dict(self) -> dict:
        """The checkpoint's ``trainer_state.json``: counters, sampler position, data fingerprint, watchers."""
        return {**self.state.state_dict(), "data": self.data_id, "sampler": self.sampler.state_dict(),
                "world_size": self.info.world_size, "watchers": {w.name: w.state_dict() for w in self.watchers}}

    def load_state_dict(self, d: dict) -> None:
        self.state.load_state_dict(d)
        self.sampler.load_state_dict(d["sampler"])
        for w in self.watchers:
            w.load_state_dict(d.get("watchers", {}).get(w.name, {}))


def check_stages(stages: list[Stage], streams: dict[str, TokenFiles], dp_size: int) -> None:
    """Every stage can draw a full sequence from each source of its mix and splits over the ranks.

    Raises:
        TrainError: a source shorter than one sequence, or a batch that does not divide.
    """
    for st in stages:
        for name in st.mix:
            if len(streams[name]) < st.seq_len + 1:
                raise TrainError(f"source '{name}' has {len(streams[name])} train tokens, fewer than one "
                                 f"sequence of stage '{st.name}' (seq_len {st.seq_len} + 1)")
        if st.batch_size % (dp_size * st.micro_batch_size):
            raise TrainError(f"stage '{st.name}': batch of {st.batch_size} sequences does not split into "
                             f"{dp_size} ranks x micro_batch_size {st.micro_batch_size}")


def _refuse_existing_run(run_dir: Path, info: DistInfo) -> None:
    """Refuse to mix a new run into an old one's metrics and checkpoints. Rank 0 looks (the run dir
    may be on its node only) and every rank learns the answer, so none is left waiting."""
    taken = info.is_main and ((run_dir / "metrics.jsonl").exists() or bool(list_complete(run_dir)))
    if all_reduce_sum(torch.tensor([int(taken)], device=info.device)).item():
        raise TrainError(f"{run_dir} already holds a run; continue it with --resume {run_dir} "
                         f"or choose another --train.run_dir")


def setup(cfg: Config, resume: bool = False, stop_after: int | None = None) -> Run:
    """Build the :class:`Run` of ``cfg``; with ``resume``, restored from the newest loadable checkpoint
    (a fresh start when there is none). ``stop_after`` ends this invocation after that many steps in
    total (the schedule still refers to ``cfg.train.steps``).

    Raises:
        TrainError / DataError: one line (no data, batch not divisible by ranks, existing run, ...).
    """
    info = init_distributed(cfg.train.device, cfg.parallel)
    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    run_dir = Path(cfg.train.run_dir)
    train_streams = open_streams(cfg, "train")
    try:
        stages = resolve_stages(cfg, available=set(train_streams))
    except ValueError as e:
        raise TrainError(str(e)) from None
    check_stages(stages, train_streams, info.dp_size)
    model, dp_model = build_parallel_model(cfg, info)  # meta -> TP -> AC -> compile -> FSDP2 -> init (or DDP)
    optimizer = build_optimizer(model, cfg)
    last = min(cfg.train.steps, stop_after) if stop_after else cfg.train.steps
    checkpointer = Checkpointer(run_dir, cfg.checkpoint.every, cfg.checkpoint.keep, last)
    ckpt, saved = checkpointer.load_latest(model, optimizer) if resume else (None, None)
    if not resume:
        _refuse_existing_run(run_dir, info)  # (resume without a checkpoint yet, e.g. killed early: start over)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.toml")
    step = saved["step"] if saved else 0
    log = MetricsLogger(run_dir, info.rank, cfg.logging.tensorboard, resume_step=step if resume else None)
    autocast = autocast_for(cfg.train.dtype, info.device)
    run = Run(cfg=cfg, info=info, run_dir=run_dir, stages=stages, train_streams=train_streams,
              val_streams=open_streams(cfg, "val"), sampler=MixtureSampler(train_streams), model=model,
              dp_model=dp_model, optimizer=optimizer,
              tokenizer=load_tokenizer(cfg.data.tokenizer, Path(cfg.data.shards_dir)),  # val bpb, downstream tasks
              log=log, checkpointer=checkpointer, watchers=default_watchers(cfg), autocast=autocast,
              peak_flops=cfg.logging.peak_flops or measure_peak_flops(info.device,
                                                                      torch.bfloat16 if autocast else torch.float32),
              last_step=last, data_id=data_fingerprint(train_streams))
    if saved:
        run.load_state_dict(saved)
        _log_resume(run, ckpt, saved)
    if cfg.eval.tasks or cfg.eval.final_tasks:
        # Fail now, not after hours of training: unknown task names or missing task data.
        resolve_tasks([t.strip() for t in f"{cfg.eval.tasks},{cfg.eval.final_tasks}".split(",") if t.strip()])
        data_root()
    missing = sorted(set(run.source_names) - set(train_streams))
    if missing:
        log.event(step, f"WARNING: sources without data left out of every mix: {missing}")
    if info.is_main and ckpt is None:
        log.event(step, f"model: {model.num_params() / 1e6:.2f}M parameters; peak {run.peak_flops / 1e12:.3f} "
                        f"TFLOP/s per device ({'declared' if cfg.logging.peak_flops else 'measured by matmul probe'})")
    return run


def _log_resume(run: Run, ckpt: Path, saved: dict) -> None:
    step = run.state.step
    run.log.event(step, f"resumed from {ckpt} (step {step}, {run.state.tokens} tokens)")
    changed = sorted(k for k, v in saved.get("data", {}).items() if run.data_id.get(k) != v)
    if changed:  # the sampler's positions now point into other documents: never let that pass unseen
        run.log.event(step, f"WARNING: the training shards of {changed} changed since {ckpt.name} (re-prepared?); "
                            "the run continues at the saved positions, which now index different text")
