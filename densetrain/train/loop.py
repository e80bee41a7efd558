"""The training loop: one screen. Each iteration is

    stage -> lr -> step (loss, grads, global grad norm; nothing applied) -> one verdict (apply / skip /
    roll back) -> commit -> log -> evaluate -> checkpoint

and the explicit calls it makes are the functions below it. Setup lives in :mod:`densetrain.train.setup`,
the step in :mod:`densetrain.train.step`, the decision point in :mod:`densetrain.train.watchers`.
"""

from __future__ import annotations

import json
import time

import torch

from densetrain.config import Config
from densetrain.evals.downstream import downstream_metrics
from densetrain.evals.valloss import evaluate_val, val_overall, val_table
from densetrain.fileio import atomic_write_json
from densetrain.metrics import flops_per_token, memory_stats
from densetrain.optim import set_lr
from densetrain.schedule import Stage, lr_for, stage_at
from densetrain.train.setup import Run, setup
from densetrain.train.step import StepResult, compute_step
from densetrain.train.watchers import Verdict, decide


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
    run = setup(cfg, resume, stop_after)
    if run.state.step >= cfg.train.steps:
        return already_complete(run)
    stage = None
    while run.state.step < run.last_step:
        t0 = time.perf_counter()
        st = stage_at(run.state.step, run.stages)
        if st != stage:
            enter_stage(run, st)
            stage = st
        lr = lr_for(run.state.step, cfg, run.stages)
        set_lr(run.optimizer, lr)
        for w in run.watchers:
            w.before_step(run)
        result = compute_step(run, st, lr)
        verdict = decide(run.watchers, run, result)
        commit(run, result, verdict)
        for w in run.watchers:
            w.after_step(run, result, verdict)
        log_step(run, result, time.perf_counter() - t0)
        evaluate(run, st)
        run.checkpointer.save_if_due(run.state.step, run.model, run.optimizer, run.state_dict(), result.finite, run.log)
    return finish(run, stage)


def enter_stage(run: Run, st: Stage) -> None:
    """Switch the model to a stage's RoPE base and log the stage's table row."""
    run.model.set_rope_theta(st.rope_theta)
    run.log.event(run.state.step, f"stage '{st.name}': seq_len {st.seq_len}, rope_theta {st.rope_theta:g}, "
                                  f"batch {st.batch_size} seqs ({st.batch_tokens} tokens), "
                                  + (f"lr re-warmup {st.rewarmup_steps} steps, " if st.rewarmup_steps else "")
                                  + f"mix {{{', '.join(f'{k}: {v:.2f}' for k, v in st.mix.items())}}}")


def commit(run: Run, result: StepResult, verdict: Verdict) -> None:
    """Carry out ``verdict``: step the optimizer (APPLY) or not (SKIP); clear gradients; count the step."""
    if verdict == Verdict.APPLY:
        run.optimizer.step()
    elif verdict == Verdict.SKIP:
        run.state.skipped_steps += 1
    else:
        raise NotImplementedError(f"verdict {verdict.name}")  # rollback arrives with the recovery watchers
    run.optimizer.zero_grad(set_to_none=True)
    if run.info.device.type == "cuda":  # step time below measures the work, not its launch
        torch.cuda.synchronize(run.info.device)
    run.state.step += 1
    run.state.tokens += result.stats.n_tokens
    run.state.stage = result.stage.name


def log_step(run: Run, r: StepResult, seconds: float) -> None:
    """One ``train`` record (and a console line every ``logging.every`` steps)."""
    cfg, st, step, n = run.cfg, r.stage, run.state.step, r.stats.n_tokens
    metrics = {
        "loss": r.loss, "grad_norm": r.grad_norm, "sample_index": r.first_sample, "lr": r.lr,
        "tokens_per_sec": n / seconds, "tokens": run.state.tokens, "stage": st.name, "stage_index": st.index,
        "seq_len": st.seq_len, "batch_tokens": st.batch_tokens, "rope_theta": st.rope_theta,
        "time/step_s": seconds, "time/data_wait_s": r.data_s,
    }
    if r.stats.z_loss_sum:
        metrics["z_loss"] = r.stats.z_loss_sum / max(n, 1)
    for s, (lsum, ntok) in r.stats.per_source.items():
        metrics[f"train/{s}/loss"] = lsum / ntok
    if step % cfg.logging.mfu_every == 0 or step == 1:
        achieved = flops_per_token(cfg.model, st.seq_len) * n / seconds
        metrics["mfu"] = achieved / (run.peak_flops * run.info.world_size)
        metrics.update(memory_stats(run.info.device))
    run.log.log(step, metrics)
    if step % cfg.logging.every == 0 or step == run.last_step:
        mfu = f" | mfu {metrics['mfu'] * 100:.1f}%" if "mfu" in metrics else ""
        run.log.console(f"step {step:>5}/{cfg.train.steps} | {st.name:<12} | loss {r.loss:.4f} | lr {r.lr:.2e} | "
                        f"grad_norm {r.grad_norm:.3f} | {metrics['tokens_per_sec'] / 1e3:.1f}k tok/s{mfu}")


def evaluate(run: Run, st: Stage) -> None:
    """Validation loss/bpb every ``eval.every`` steps and downstream tasks every ``eval.tasks_every``
    (both also at the last step of the schedule)."""
    cfg, step = run.cfg, run.state.step
    if (cfg.eval.every and step % cfg.eval.every == 0) or step == cfg.train.steps:
        t0 = time.perf_counter()
        val = run.last_val = evaluate_val(run.model, run.val_streams, st.seq_len, st.micro_batch_size,
                                          cfg.eval.max_batches, run.info.device, run.autocast, run.tokenizer)
        vm = {f"val/{s}/{k}": v[k] for s, v in {**val, "all": val_overall(val)}.items() for k in ("loss", "bpb")}
        vm["time/eval_s"] = time.perf_counter() - t0
        run.log.log(step, vm, kind="eval")
        run.log.console("  val " + " ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in vm.items() if k.endswith("/loss")))
    if cfg.eval.tasks and ((cfg.eval.tasks_every and step % cfg.eval.tasks_every == 0) or step == cfg.train.steps):
        t0 = time.perf_counter()
        dm = run_tasks(run, st, cfg.eval.tasks, cfg.eval.tasks_limit)
        dm["time/tasks_s"] = time.perf_counter() - t0
        run.log.log(step, dm, kind="eval")
        run.log.console("  tasks " + " ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in dm.items()
                                               if k.endswith("/headline")))


def run_tasks(run: Run, st: Stage, tasks: str, limit: int) -> dict:
    """Downstream metrics of ``tasks``; each truncation warning is logged once per run."""
    dm, warnings = downstream_metrics(run.model, run.tokenizer, tasks, limit, st.seq_len, run.info.device,
                                      run.autocast)
    for line in sorted(set(warnings) - run.warned):
        run.log.event(run.state.step, line)
    run.warned |= set(warnings)
    return dm


def finish(run: Run, st: Stage) -> dict:
    """Final downstream tasks (when the schedule is done), ``summary.json``, close the sinks."""
    cfg, step = run.cfg, run.state.step
    summary = {"steps": step, "tokens": run.state.tokens, "skipped_steps": run.state.skipped_steps,
               "params": run.model.num_params(), "wall_s": time.perf_counter() - run.t_start}
    if run.last_val:
        summary["val"] = val_table(run.last_val, run.val_streams)
    if cfg.eval.final_tasks and step == cfg.train.steps:
        t0 = time.perf_counter()
        run.warned = set()  # the final evaluation reports its own truncations
        dm = run_tasks(run, st, cfg.eval.final_tasks, cfg.eval.final_limit)
        run.log.log(step, {**dm, "time/final_tasks_s": time.perf_counter() - t0}, kind="final_eval")
        summary["downstream"] = {k[len("eval/"):]: v for k, v in dm.items()}
        run.log.console("  final " + " ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in dm.items()
                                              if k.endswith("/headline")))
    if run.info.is_main and step == cfg.train.steps:
        atomic_write_json(run.run_dir / "summary.json", summary)
    run.log.close()
    return summary


def already_complete(run: Run) -> dict:
    """A resume of a finished run: nothing to do; its summary."""
    run.log.event(run.state.step, f"run already complete ({run.state.step} steps); nothing to do")
    run.log.close()
    done = run.run_dir / "summary.json"
    return json.loads(done.read_text()) if done.exists() else {"steps": run.state.step, "tokens": run.state.tokens}
