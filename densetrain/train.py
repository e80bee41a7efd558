"""The training loop: one loop for CPU and GPU, single process or torchrun.

Reading order: :func:`train` sets up (config, process group, data, model, optimizer, resume), then
runs one iteration per optimizer step: stage lookup -> lr -> draw the global batch (the stage's
``batch_tokens`` as ``batch_tokens / seq_len`` sequences) -> forward/backward
over micro-batches (:func:`forward_backward`) -> clip -> update -> metrics -> eval -> checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException

from densetrain.checkpoint import list_complete, load_checkpoint, save_checkpoint
from densetrain.config import Config, save_config
from densetrain.data.mixture import MixtureSampler, Sample
from densetrain.data.streams import data_fingerprint, open_streams
from densetrain.errors import TrainError
from densetrain.evals.downstream import downstream_metrics
from densetrain.fileio import atomic_write_json
from densetrain.loss import IGNORE_INDEX, token_losses
from densetrain.metrics import MetricsLogger, flops_per_token, measure_peak_flops, memory_stats
from densetrain.model.init import build_model
from densetrain.optim import build_optimizer, set_lr
from densetrain.parallel import all_reduce_sum, autocast_for, init_distributed, parallelize
from densetrain.schedule import Stage, lr_for, resolve_stages, stage_at

# --------------------------------------------------------------------------------------------------
# Loss and one optimizer step's forward/backward
# --------------------------------------------------------------------------------------------------


@dataclass
class StepStats:
    """Sums over one optimizer step (this rank's part until reduced): loss in nats, tokens counted."""

    loss_sum: float = 0.0
    z_loss_sum: float = 0.0
    n_tokens: int = 0
    per_source: dict[str, list[float]] = field(default_factory=dict)  # name -> [loss_sum, n_tokens]


def forward_backward(
    model: torch.nn.Module,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor, list[str]]],
    n_tokens_global: int,
    world_size: int = 1,
    z_loss: float = 0.0,
    autocast: contextlib.AbstractContextManager | None = None,
) -> StepStats:
    """Accumulate gradients of one optimizer step over ``micro_batches``.

    The objective is the sum of all target-token losses of the step, over every micro-batch and every
    rank, divided by ``n_tokens_global`` (the step's total target tokens): each micro-batch's loss sum
    is divided by that global count, not averaged per micro-batch, so a micro-batch with few targets
    weighs no more per token than one with many. DDP averages gradients over ranks, so each rank's
    objective is multiplied by ``world_size`` to turn that mean back into the global sum.

    Args:
        micro_batches: list of (inputs (b, T) int64, targets (b, T) int64, source name per row).
        n_tokens_global: number of targets != IGNORE_INDEX in the whole step (all ranks).
        z_loss: coefficient of ``log(Z)^2`` per token (PaLM, Chowdhery et al. 2022, sec. 5).
    Returns:
        This rank's :class:`StepStats` (not reduced).
    """
    scale = world_size / max(n_tokens_global, 1)
    n_micro = len(micro_batches)
    # Per-row sums stay on the device until the end of the step: one host sync per step, not per
    # micro-batch (each .tolist()/float() on a GPU tensor waits for the GPU).
    row_losses, row_tokens, z_sums, row_sources = [], [], [], []
    for i, (x, y, sources) in enumerate(micro_batches):
        # DDP: all-reduce gradients only after the last micro-batch.
        sync = contextlib.nullcontext()
        if i < n_micro - 1 and hasattr(model, "no_sync"):
            sync = model.no_sync()
        with sync:
            with autocast or contextlib.nullcontext():
                logits = model(x)
            losses = token_losses(logits, y)
            mask = y != IGNORE_INDEX
            objective = losses.sum()
            if z_loss > 0:
                zl = (torch.logsumexp(logits.float(), dim=-1) ** 2 * mask).sum()
                objective = objective + z_loss * zl
                z_sums.append(zl.detach())
            (objective * scale).backward()
        row_losses.append(losses.detach().sum(dim=1).double())
        row_tokens.append(mask.sum(dim=1))
        row_sources += sources
    stats = StepStats()
    if z_sums:
        stats.z_loss_sum = float(torch.stack(z_sums).sum())
    for src, lsum, ntok in zip(row_sources, torch.cat(row_losses).tolist(), torch.cat(row_tokens).tolist()):
        acc = stats.per_source.setdefault(src, [0.0, 0])
        acc[0] += lsum
        acc[1] += ntok
        stats.loss_sum += lsum
        stats.n_tokens += ntok
    return stats


def reduce_stats(stats: StepStats, sources: list[str], device: torch.device) -> StepStats:
    """Sum :class:`StepStats` over ranks (identity in a single process)."""
    vec = [stats.loss_sum, stats.z_loss_sum, float(stats.n_tokens)]
    for s in sources:
        vec += stats.per_source.get(s, [0.0, 0])
    t = all_reduce_sum(torch.tensor(vec, dtype=torch.float64, device=device)).tolist()
    per = {s: [t[3 + 2 * i], int(t[4 + 2 * i])] for i, s in enumerate(sources) if t[4 + 2 * i] > 0}
    return StepStats(t[0], t[1], int(t[2]), per)


# --------------------------------------------------------------------------------------------------
# Set-up helpers
# --------------------------------------------------------------------------------------------------


def _resume_point(run_dir: Path, model, optimizer) -> tuple[Path | None, dict | None]:
    """Load the newest complete checkpoint that loads cleanly; fall back to older ones, saying why.

    Raises:
        TrainError: checkpoints exist but none can be loaded (corrupt, or made for another model shape).
    """
    done = list_complete(run_dir)
    errors = []
    for _, path in reversed(done):
        try:
            return path, load_checkpoint(path, model, optimizer)
        # A corrupt file or a shape mismatch after a model.* change; DCP wraps failures in
        # CheckpointException, which derives from BaseException, hence listed explicitly.
        except (Exception, CheckpointException) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            errors.append(f"{path.name}: {type(e).__name__}: {first}")
            print(f"densetrain: warning: cannot load {path} ({type(e).__name__}: {first}); trying an older one")
    if done:
        raise TrainError(f"{run_dir}: no checkpoint could be loaded ({'; '.join(errors)}); "
                         f"model.* settings cannot change on --resume")
    return None, None


def make_micro_batches(samples: list[Sample], micro: int, device: torch.device):
    """Group samples into (inputs, targets, sources) micro-batches of ``micro`` rows on ``device``."""
    out = []
    for i in range(0, len(samples), micro):
        chunk = samples[i : i + micro]
        t = torch.from_numpy(np.stack([s.tokens for s in chunk])).to(device, non_blocking=True)
        out.append((t[:, :-1], t[:, 1:], [s.source for s in chunk]))
    return out


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


def train(cfg: Config, resume: bool = False, stop_after: int | None = None) -> dict:
    """Run (or resume) the whole staged recipe described by ``cfg``; return the final summary.

    Args:
        resume: continue from the newest complete checkpoint in ``cfg.train.run_dir`` (fresh start
            when there is none).
        stop_after: stop after this many optimizer steps in total (for tests that interrupt a run);
            the schedule still refers to ``cfg.train.steps``.
    Raises:
        TrainError: a one-line explanation (no data, batch not divisible by ranks, ...).
    """
    from densetrain.evals.valloss import evaluate_val, val_overall

    info = init_distributed(cfg.train.device)
    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    run_dir = Path(cfg.train.run_dir)
    train_streams = open_streams(cfg, "train")
    try:
        stages = resolve_stages(cfg, available=set(train_streams))
    except ValueError as e:
        raise TrainError(str(e)) from None
    for st in stages:
        for name in st.mix:
            if len(train_streams[name]) < st.seq_len + 1:
                raise TrainError(f"source '{name}' has {len(train_streams[name])} train tokens, fewer than one "
                                 f"sequence of stage '{st.name}' (seq_len {st.seq_len} + 1)")
    for st in stages:
        if st.batch_size % (info.world_size * st.micro_batch_size):
            raise TrainError(
                f"stage '{st.name}': batch of {st.batch_size} sequences does not split into "
                f"{info.world_size} ranks x micro_batch_size {st.micro_batch_size}"
            )

    sampler = MixtureSampler(train_streams)
    val_streams = open_streams(cfg, "val")
    model = build_model(cfg.model, cfg.train.seed, info.device)
    dp_model = parallelize(model, info)
    if cfg.train.compile:
        dp_model = torch.compile(dp_model)
    optimizer = build_optimizer(model, cfg)

    step, tokens_seen, skipped, nonfinite_run = 0, 0, 0, 0
    ckpt, state = _resume_point(run_dir, model, optimizer) if resume else (None, None)
    if ckpt is not None:
        step, tokens_seen, skipped = state["step"], state["tokens"], state.get("skipped_steps", 0)
        sampler.load_state_dict(state["sampler"])
    elif not resume:
        # Refuse to mix a new run into an old one's metrics and checkpoints. Rank 0 looks (the run
        # dir may be on its node only) and every rank learns the answer, so none is left waiting.
        # (With resume but no complete checkpoint yet, e.g. killed before the first save: start over.)
        taken = info.is_main and ((run_dir / "metrics.jsonl").exists() or bool(list_complete(run_dir)))
        if all_reduce_sum(torch.tensor([int(taken)], device=info.device)).item():
            raise TrainError(f"{run_dir} already holds a run; continue it with --resume {run_dir} "
                             f"or choose another --train.run_dir")
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.toml")
    log = MetricsLogger(run_dir, info.rank, cfg.logging.tensorboard, resume_step=step if resume else None)
    data_id = data_fingerprint(train_streams)
    if ckpt is not None:
        log.event(step, f"resumed from {ckpt} (step {step}, {tokens_seen} tokens)")
        changed = sorted(k for k, v in state.get("data", {}).items() if data_id.get(k) != v)
        if changed:  # the sampler's positions now point into other documents: never let that pass unseen
            log.event(step, f"WARNING: the training shards of {changed} changed since {ckpt.name} (re-prepared?); "
                            "the run continues at the saved positions, which now index different text")
    autocast = autocast_for(cfg.train.dtype, info.device)
    from densetrain.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.data.tokenizer, Path(cfg.data.shards_dir))  # val bits per byte, downstream tasks
    if cfg.eval.tasks or cfg.eval.final_tasks:
        from densetrain.registry.tasks import data_root, resolve_tasks

        # Fail now, not after hours of training: unknown task names or missing task data.
        resolve_tasks([t.strip() for t in f"{cfg.eval.tasks},{cfg.eval.final_tasks}".split(",") if t.strip()])
        data_root()
    peak_flops = cfg.logging.peak_flops or measure_peak_flops(info.device, torch.bfloat16 if autocast else torch.float32)
    source_names = [s.name for s in cfg.data.sources]
    n_params = model.num_params()
    missing = sorted({s.name for s in cfg.data.sources} - set(train_streams))
    if missing:
        log.event(step, f"WARNING: sources without data left out of every mix: {missing}")
    if info.is_main and ckpt is None:
        log.event(step, f"model: {n_params / 1e6:.2f}M parameters; peak {peak_flops / 1e12:.3f} TFLOP/s per device "
                        f"({'declared' if cfg.logging.peak_flops else 'measured by matmul probe'})")

    last = min(cfg.train.steps, stop_after) if stop_after else cfg.train.steps
    if step >= cfg.train.steps:
        log.event(step, f"run already complete ({step} steps); nothing to do")
        log.close()
        done = run_dir / "summary.json"
        return json.loads(done.read_text()) if done.exists() else {"steps": step, "tokens": tokens_seen}
    stage: Stage | None = None
    last_val: dict[str, dict] = {}
    warned: set[str] = set()  # truncation warnings already logged
    t_run = time.perf_counter()
    while step < last:
        t0 = time.perf_counter()
        st = stage_at(step, stages)
        if st != stage:
            model.set_rope_theta(st.rope_theta)
            log.event(step, f"stage '{st.name}': seq_len {st.seq_len}, rope_theta {st.rope_theta:g}, "
                            f"batch {st.batch_size} seqs ({st.batch_tokens} tokens), "
                            + (f"lr re-warmup {st.rewarmup_steps} steps, " if st.rewarmup_steps else "")
                            + f"mix {{{', '.join(f'{k}: {v:.2f}' for k, v in st.mix.items())}}}")
            stage = st
        lr = lr_for(step, cfg, stages)
        set_lr(optimizer, lr)

        per_rank = st.batch_size // info.world_size
        keep = range(info.rank * per_rank, (info.rank + 1) * per_rank)
        first_sample = sampler.state["samples_seen"]
        samples = sampler.next_samples(st.batch_size, st.name, st.mix, st.seq_len, keep)
        for ev in sampler.events:
            log.event(step, ev)
        sampler.events.clear()
        micro_batches = make_micro_batches(samples, st.micro_batch_size, info.device)
        # Counted on the host copy: counting on the device would wait for the GPU once per micro-batch.
        n_local = sum(int((smp.tokens[1:] != IGNORE_INDEX).sum()) for smp in samples)
        n_global = int(all_reduce_sum(torch.tensor([n_local], device=info.device)).item())
        t_data = time.perf_counter() - t0

        stats = forward_backward(dp_model, micro_batches, n_global, info.world_size, cfg.optim.z_loss, autocast)
        clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        stats = reduce_stats(stats, source_names, info.device)
        loss = stats.loss_sum / max(stats.n_tokens, 1)
        if math.isfinite(loss) and math.isfinite(grad_norm):
            optimizer.step()
            nonfinite_run = 0
        else:  # never apply a non-finite update; count it and go on
            skipped += 1
            nonfinite_run += 1
            log.event(step, f"non-finite loss {loss} / grad_norm {grad_norm}: update skipped ({skipped} so far)")
            if nonfinite_run >= cfg.train.max_nonfinite_steps:
                log.close()
                raise TrainError(
                    f"{nonfinite_run} consecutive steps with non-finite loss/gradients (last at step {step}): the "
                    f"weights or the lr are broken; resume from an earlier checkpoint with a lower optim.peak_lr")
        optimizer.zero_grad(set_to_none=True)
        if info.device.type == "cuda":
            torch.cuda.synchronize(info.device)
        dt = time.perf_counter() - t0
        step += 1
        tokens_seen += stats.n_tokens

        metrics = {
            "loss": loss, "grad_norm": grad_norm, "sample_index": first_sample, "lr": lr, "tokens_per_sec": stats.n_tokens / dt,
            "tokens": tokens_seen, "stage": st.name, "stage_index": st.index, "seq_len": st.seq_len,
            "batch_tokens": st.batch_tokens,
            "rope_theta": st.rope_theta, "time/step_s": dt, "time/data_wait_s": t_data,
        }
        if stats.z_loss_sum:
            metrics["z_loss"] = stats.z_loss_sum / max(stats.n_tokens, 1)
        for s, (lsum, ntok) in stats.per_source.items():
            metrics[f"train/{s}/loss"] = lsum / ntok
        if step % cfg.logging.mfu_every == 0 or step == 1:
            achieved = flops_per_token(cfg.model, st.seq_len) * stats.n_tokens / dt
            metrics["mfu"] = achieved / (peak_flops * info.world_size)
            metrics.update(memory_stats(info.device))
        log.log(step, metrics)
        if step % cfg.logging.every == 0 or step == last:
            mfu = f" | mfu {metrics['mfu'] * 100:.1f}%" if "mfu" in metrics else ""
            log.console(f"step {step:>5}/{cfg.train.steps} | {st.name:<12} | loss {loss:.4f} | lr {lr:.2e} | "
                        f"grad_norm {grad_norm:.3f} | {metrics['tokens_per_sec'] / 1e3:.1f}k tok/s{mfu}")

        if (cfg.eval.every and step % cfg.eval.every == 0) or step == cfg.train.steps:
            t_eval = time.perf_counter()
            val = last_val = evaluate_val(model, val_streams, st.seq_len, st.micro_batch_size,
                                          cfg.eval.max_batches, info.device, autocast, tokenizer)
            vm = {f"val/{s}/{k}": v[k] for s, v in {**val, "all": val_overall(val)}.items() for k in ("loss", "bpb")}
            vm["time/eval_s"] = time.perf_counter() - t_eval
            log.log(step, vm, kind="eval")
            log.console("  val " + " ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in vm.items() if k.endswith("/loss")))
        if cfg.eval.tasks and ((cfg.eval.tasks_every and step % cfg.eval.tasks_every == 0) or step == cfg.train.steps):
            t_eval = time.perf_counter()
            dm, warnings = downstream_metrics(model, tokenizer, cfg.eval.tasks, cfg.eval.tasks_limit, st.seq_len, info.device,
                                          autocast)
            for line in set(warnings) - warned:  # once per run, not at every eval
                log.event(step, line)
            warned |= set(warnings)
            dm["time/tasks_s"] = time.perf_counter() - t_eval
            log.log(step, dm, kind="eval")
            log.console("  tasks " + " ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in dm.items() if k.endswith("/headline")))
        if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == last:
            if nonfinite_run:
                log.event(step, "checkpoint not saved: the last step was non-finite")
            else:
                t_ck = time.perf_counter()
                trainer_state = {"step": step, "tokens": tokens_seen, "stage": st.name, "skipped_steps": skipped,
                                 "data": data_id, "sampler": sampler.state_dict(), "world_size": info.world_size}
                path = save_checkpoint(run_dir, step, model, optimizer, trainer_state, cfg.checkpoint.keep)
                log.event(step, f"checkpoint {path.name} ({time.perf_counter() - t_ck:.2f}s)")

    summary = {"steps": step, "tokens": tokens_seen, "skipped_steps": skipped, "params": n_params,
               "wall_s": time.perf_counter() - t_run}
    if last_val:
        from densetrain.evals.valloss import val_table

        summary["val"] = val_table(last_val, val_streams)
    if cfg.eval.final_tasks and step == cfg.train.steps:
        t_eval = time.perf_counter()
        dm, warnings = downstream_metrics(model, tokenizer, cfg.eval.final_tasks, cfg.eval.final_limit, st.seq_len,
                                      info.device, autocast)
        for line in warnings:
            log.event(step, line)
        log.log(step, {**dm, "time/final_tasks_s": time.perf_counter() - t_eval}, kind="final_eval")
        summary["downstream"] = {k[len("eval/"):]: v for k, v in dm.items()}
        log.console("  final " + " ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in dm.items() if k.endswith("/headline")))
    if info.is_main and step == cfg.train.steps:
        atomic_write_json(run_dir / "summary.json", summary)
    log.close()
    return summary
