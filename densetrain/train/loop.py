"""The training loop: one screen. Each iteration is

    stage -> lr -> step (loss, grads, global grad norm; nothing applied) -> one verdict (apply / skip /
    roll back) -> commit -> log -> evaluate -> checkpoint

and the explicit calls it makes are the functions below it. A stage with a layout of its own
(``stages[i].parallel``) moves the run onto it at its first step through one call,
:func:`densetrain.train.setup.switch_layout`. Setup lives in :mod:`densetrain.train.setup`,
the step in :mod:`densetrain.train.step`, the decision point in :mod:`densetrain.train.watchers`. A SIGTERM
or Ctrl-C stops the run at the next step boundary, or between two batches of an in-loop evaluation (which is
then abandoned), checkpointed (:mod:`densetrain.train.preempt`). An outage of the object store holding the
shards (a read past the retry budget, on any rank) stops it the same way before the step it could not read
(:func:`densetrain.train.step.fetch_batch`).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from densetrain.checkpoint import CheckpointCorruptError, list_complete, load_checkpoint
from densetrain.config import Config
from densetrain.errors import TrainError
from densetrain.evals.downstream import downstream_metrics
from densetrain.evals.position_loss import position_eval
from densetrain.evals.samples import source_samples
from densetrain.evals.stop import EvalStopped, StopCheck
from densetrain.evals.valloss import evaluate_val, val_overall, val_table
from densetrain.fileio import atomic_write_json, read_json
from densetrain.metrics import flops_per_token, format_rate, memory_stats, read_metrics
from densetrain.optim import set_lr
from densetrain.parallel import all_reduce_max, reshard
from densetrain.schedule import Stage, lr_for, stage_at
from densetrain.storage import counters as store_counters
from densetrain.train.preempt import OUTAGE, StopRequest, stop_run
from densetrain.train.rundir import set_aside_future, unlock_run_dir
from densetrain.train.setup import Run, probe_peak_flops, setup, switch_layout
from densetrain.train.step import ReadOutage, StepResult, compute_step
from densetrain.train.watchers import Verdict, decide


def train(cfg: Config, resume: bool = False, stop_after: int | None = None, rollback_to: int | None = None,
          skip_batches: int = 0, keep_layout_intent: bool = False) -> dict:
    """Run (or resume) the whole staged recipe described by ``cfg``; return the final summary.

    Args:
        resume: continue from the newest complete checkpoint in ``cfg.train.run_dir`` (fresh start
            when there is none).
        stop_after: stop after this many optimizer steps in total (for tests that interrupt a run);
            the schedule still refers to ``cfg.train.steps``.
        rollback_to, skip_batches: a manual rollback (see :func:`densetrain.train.setup.setup`).
        keep_layout_intent: on a world size the configured ``[parallel]`` degrees do not fit, pick a layout
            that keeps their intent (a plain ``--resume``; see :func:`densetrain.train.setup.setup`).
    Raises:
        TrainError: a one-line explanation (no data, batch not divisible by ranks, ...).
    """
    try:
        run = setup(cfg, resume, stop_after, rollback_to, skip_batches, keep_layout_intent)
    except BaseException:
        unlock_run_dir(Path(cfg.train.run_dir))
        raise
    try:
        return _train(run)
    finally:  # the next process may take the run (a subprocess --resume, a requeued job)
        unlock_run_dir(run.run_dir)


def _train(run: Run) -> dict:
    """The loop of :func:`train` over a set-up run."""
    cfg = run.cfg
    if run.state.step >= cfg.train.steps:
        return already_complete(run)
    stage = None
    stop = StopRequest(run.info.device)  # SIGTERM / Ctrl-C: stop at the next step boundary, checkpointed
    try:
        while run.state.step < run.last_step:
            t0 = time.perf_counter()
            run.checkpointer.poll(run.log)  # completes an async save whose background write has finished
            signum = stop.requested()  # the same answer on every rank (one all-reduce)
            if signum:
                stop_run(run, signum, noted_at=stop.noted_at)  # raises Preempted once the checkpoint is written
            st = stage_at(run.state.step, run.stages)
            if st != stage:
                switch_layout(run, st)  # a stage with a layout of its own: checkpoint, rebuild, reload
                enter_stage(run, st)
                stage = st
            for w in run.watchers:
                w.before_step(run)
            lr = lr_for(run.state.step, cfg, run.stages) * run.lr_scale
            set_lr(run.optimizer, lr)
            try:
                result = compute_step(run, st, lr)  # loss, gradients, global grad norm: nothing applied yet
            except ReadOutage as e:  # the shards' store did not answer a read: every rank stops here (exit 75)
                stop_run(run, 0, outage=(cfg.data.shards_dir, str(e)))
            verdict = decide(run.watchers, run, result)  # the one decision point: apply / skip / roll back
            commit(run, result, verdict)
            for w in run.watchers:
                w.after_step(run, result, verdict)
            if verdict == Verdict.ROLLBACK:
                continue
            log_step(run, result, time.perf_counter() - t0)
            evaluate(run, st, stop)  # a signal in it: the evaluation is abandoned, the step checkpointed
            run.checkpointer.save_if_due(run.state.step, run.model, run.optimizer, run.state_dict(), result.finite,
                                         run.log)
        signum = stop.requested()  # a signal during the last step: stop as promised (exit 75), before the
        if signum:                 # final evaluations, which the --resume of a complete run then does
            stop_run(run, signum, noted_at=stop.noted_at)
        stop.restore()  # the final evaluations can be interrupted: --resume then completes them
        return finish(run, stage)
    except BaseException:
        run.checkpointer.abandon_pending(run.log)  # an error with an async save in flight: no step_N.tmp
        raise
    finally:
        stop.restore()
        for w in run.watchers:
            w.close()


def enter_stage(run: Run, st: Stage) -> None:
    """Switch the model to a stage's RoPE base and log the stage's table row."""
    run.model.set_rope(st.rope_theta, st.rope_scaling)
    run.log.event(run.state.step, f"stage '{st.name}': seq_len {st.seq_len}, rope_theta {st.rope_theta:g}, "
                                  f"document mask {'on' if st.document_mask else 'off'}, "
                                  f"batch {st.batch_size} seqs ({st.batch_tokens} tokens), "
                                  + (f"lr re-warmup {st.rewarmup_steps} steps, " if st.rewarmup_steps else "")
                                  + f"mix {{{', '.join(f'{k}: {v:.2f}' for k, v in st.mix.items())}}}",
                  kind="stage", values={"stage": st.name, "index": st.index, "seq_len": st.seq_len})


def commit(run: Run, result: StepResult, verdict: Verdict) -> None:
    """Carry out ``verdict``: step the optimizer (APPLY), or not (SKIP: parameters and optimizer state,
    its step count included, stay exactly as they were), or go back to a checkpoint (ROLLBACK);
    clear gradients; count the step."""
    t0 = time.perf_counter()
    if verdict == Verdict.APPLY:
        run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.optimizer_seconds = time.perf_counter() - t0
    if verdict == Verdict.ROLLBACK:
        rollback(run, result)
        return
    if verdict == Verdict.SKIP:
        run.state.skipped_steps += 1
    if run.info.device.type == "cuda":  # step time below measures the work, not its launch
        torch.cuda.synchronize(run.info.device)
    run.state.step += 1
    run.state.tokens += result.stats.n_tokens
    run.state.stage = result.stage.name


def rollback(run: Run, result: StepResult) -> None:
    """Go back to the newest complete checkpoint at or before ``result.rollback_before`` (where the
    trouble began): model, optimizer, RNG and counters restored, later checkpoints (and summary, report,
    evaluations of later steps) set aside, the
    sampler left where it is, so the data that led to the trouble is skipped; the metrics past the
    checkpoint are rewritten, the event says what was skipped.

    A checkpoint that fails verification (its files differ from the save) or holds non-finite weights is
    never rolled back to: it is passed over, said in an event, for the next older one.

    Raises:
        TrainError: no checkpoint that old; CheckpointCorruptError: none that old is intact (the cause is
            the checkpoints, so no lr advice).
    """
    run.checkpointer.finish_pending(run.log)  # a save in flight is set aside below like any later one
    run.checkpointer.finish_pending(run.log)  # and its upload (started by the call above): none in flight below
    before = result.rollback_before if result.rollback_before is not None else result.index
    done = [(s, p) for s, p in list_complete(run.run_dir) if s <= before]
    if not done:
        raise TrainError(f"step {result.index}: trouble since step {before} and no checkpoint at or before it to "
                         f"roll back to; lower optim.peak_lr or save checkpoints more often (checkpoint.every)")
    for k, (step, path) in enumerate(reversed(done)):
        # and the files made from the steps after it, and their copies in checkpoint.dir
        set_aside_future(run.run_dir, step, run.info.is_main, run.checkpointer.remote)
        try:
            saved = load_checkpoint(path, run.model, run.optimizer)
            break
        except CheckpointCorruptError as e:
            if k == len(done) - 1:
                raise CheckpointCorruptError(f"{e}; no intact checkpoint at or before step {before} to roll back "
                                             "to") from None
            run.log.event(step, f"rollback: passed over {path.name} ({e})", kind="rollback", action="pass_over")
    skipped = [saved["sampler"]["samples_seen"], run.sampler.state["samples_seen"]]
    from_step = run.state.step
    run.state.load_state_dict(saved)
    run.log.rewind(step)
    run.log.event(step, f"rolled back from step {from_step} to checkpoint {path.name}; the data of samples "
                        f"{skipped[0]}..{skipped[1]} is skipped", kind="rollback", action="rollback",
                  values={"from_step": from_step, "to_step": step, "trouble_since": before,
                          "skipped_samples": skipped, **run.batch_documents(result)})


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
    if any(store_counters.values()):  # shards or checkpoints in object storage (densetrain/storage.py)
        metrics.update(store_counters)  # this rank's counts since start: retries, cache hits/misses, bytes
    for s, (lsum, ntok) in r.stats.per_source.items():
        metrics[f"train/{s}/loss"] = lsum / ntok
    if step % cfg.logging.mfu_every == 0 or step == 1 or step == run.last_step:  # the last: no peak goes unsampled
        achieved = flops_per_token(cfg.model, st.seq_len) * n / seconds
        metrics["mfu"] = achieved / (run.peak_flops * run.info.world_size)
        if metrics["mfu"] > 1.0:
            metrics["mfu"] = mfu_above_one(run, step, achieved / run.info.world_size)
        metrics.update(memory_stats(run.info.device))
    run.log.log(step, metrics)
    if step % cfg.logging.every == 0 or step == run.last_step:
        mfu = f" | mfu {metrics['mfu'] * 100:.1f}%" if "mfu" in metrics else ""
        run.log.console(f"step {step:>5}/{cfg.train.steps} | {st.name:<12} | loss {r.loss:.4f} | lr {r.lr:.2e} | "
                        f"grad_norm {r.grad_norm:.3f} | {format_rate(metrics['tokens_per_sec'])}{mfu}")


def mfu_above_one(run: Run, step: int, achieved: float) -> float:
    """A step reached more than the mfu denominator (``achieved`` FLOP/s per device). The first time, a measured
    peak is measured again and the larger one kept: the start-up probe reads low when the machine was busy then
    (a CPU shared with another process: one run printed 127% of it). A declared ``logging.peak_flops`` is kept and
    said once to be low. Returns the step's mfu against the peak in effect (later ones above 1 are logged as
    they are)."""
    if "peak_flops" in run.warned:
        return achieved / run.peak_flops
    run.warned.add("peak_flops")
    before = run.peak_flops
    if run.cfg.logging.peak_flops:
        run.log.event(step, f"mfu {achieved / before:.0%}: logging.peak_flops = {before:.3g} FLOP/s is below "
                            f"what this run reaches ({achieved:.3g} FLOP/s per device); declare the device's "
                            f"real peak", kind="mfu")
        return achieved / before
    again = probe_peak_flops(run.info.device, run.autocast)
    run.peak_flops = max(before, again)
    run.log.event(step, f"mfu above 100% ({achieved / before:.0%}): the start-up matmul probe read "
                        f"{before / 1e12:.3f} TFLOP/s (a busy machine then?); measured again "
                        f"{again / 1e12:.3f}, mfu now against {run.peak_flops / 1e12:.3f}", kind="mfu")
    return achieved / run.peak_flops


def evaluate(run: Run, st: Stage, stop: StopRequest | None = None) -> None:
    """Validation loss/bpb every ``eval.every`` steps and downstream tasks every ``eval.tasks_every``
    (both also at the last step of the schedule), and the loss by position when due; FSDP2's parameters
    gathered by them are freed after (:func:`densetrain.parallel.reshard`). With ``stop``, each
    evaluation asks it between forward batches (every rank at the same batches); a signal abandons the
    evaluation and stops the run with the step checkpointed (:func:`densetrain.train.preempt.stop_run`)."""
    cfg, step = run.cfg, run.state.step
    should_stop = stop.asked if stop is not None else None
    what = "validation"
    try:
        if (cfg.eval.every and step % cfg.eval.every == 0) or step == cfg.train.steps:
            t0 = time.perf_counter()
            val = run.last_val = validate(run, st, should_stop)
            vm = {f"val/{s}/{k}": v[k] for s, v in {**val, "all": val_overall(val)}.items() for k in ("loss", "bpb")}
            vm["time/eval_s"] = time.perf_counter() - t0
            run.eval_seconds += vm["time/eval_s"]
            run.log.log(step, vm, kind="eval")
            run.log.console("  val " + " ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in vm.items()
                                                if k.endswith("/loss")))
        what = "loss by position"
        pm = position_eval(run.dp_model, cfg, run.stages, run.val_streams, step, run.info.device, run.autocast,
                           should_stop)
        if pm:  # loss by position in long documents, before each long stage and at the end
            run.log.log(step, pm, kind="eval")
            run.position_loss[pm["position_eval"]] = {k[len("val_pos/"):]: v for k, v in pm.items()
                                                      if k.startswith("val_pos/")}
            run.log.console(f"  val by position ({pm['position_eval']}) " + " ".join(
                f"{k.split('/')[2]} {v:.3f}" for k, v in pm.items()
                if k.startswith("val_pos/all/") and k.endswith("loss")))
        what = "downstream tasks"
        if cfg.eval.tasks and ((cfg.eval.tasks_every and step % cfg.eval.tasks_every == 0)
                               or step == cfg.train.steps):
            t0 = time.perf_counter()
            dm = run_tasks(run, st, cfg.eval.tasks, cfg.eval.tasks_limit, should_stop)
            dm["time/tasks_s"] = time.perf_counter() - t0
            run.eval_seconds += dm["time/tasks_s"]
            run.log.log(step, dm, kind="eval")
            run.log.console("  tasks " + " ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in dm.items()
                                                   if k.endswith("/headline")))
    except EvalStopped:  # every rank got the same all-reduced answer at the same batch
        if stop.agreed == OUTAGE:  # a held-out read met the store's outage on some rank: the same stop (exit 75)
            stop_run(run, 0, abandoned=what, outage=(cfg.data.shards_dir, stop.outage or "another rank's read of "
                                                     "the held-out shards did not answer within the retry budget"))
        stop_run(run, stop.agreed, abandoned=what, noted_at=stop.noted_at)
    finally:  # FSDP2 keeps the parameters an evaluation gathered (no backward frees them): freed before the save
        reshard(run.dp_model)


def validate(run: Run, st: Stage, should_stop: StopCheck = None) -> dict:
    """Validation loss (and bpb) per source of the model as it is, with stage ``st``'s sequences."""
    return evaluate_val(run.dp_model, run.val_streams, st.seq_len, st.micro_batch_size, run.cfg.eval.max_batches,
                        run.info.device, run.autocast, run.tokenizer,
                        run.tokenizer.eos_id if st.document_mask else None, st.reset_positions, should_stop)


def run_tasks(run: Run, st: Stage, tasks: str, limit: int, should_stop: StopCheck = None) -> dict:
    """Downstream metrics of ``tasks``; each truncation warning is logged once per run."""
    dm, warnings = downstream_metrics(run.dp_model, run.tokenizer, tasks, limit, st.seq_len, run.info.device,
                                      run.autocast, should_stop)
    for line in sorted(set(warnings) - run.warned):
        run.log.event(run.state.step, line)
    run.warned |= set(warnings)
    return dm


def finish(run: Run, st: Stage) -> dict:
    """Wait for an async save in flight, final downstream tasks (when the schedule is done),
    ``summary.json``, close the sinks."""
    run.checkpointer.finish_pending(run.log)
    cfg, step = run.cfg, run.state.step
    summary = {"steps": step, "tokens": run.state.tokens, "skipped_steps": run.state.skipped_steps,
               "params": run.model.num_params(), "wall_s": time.perf_counter() - run.t_start}
    if run.last_val:
        summary["val"] = val_table(run.last_val, run.val_streams)
    if run.position_loss:
        summary["position_loss"] = run.position_loss
    if cfg.eval.final_tasks and step == cfg.train.steps:
        t0 = time.perf_counter()
        run.warned = set()  # the final evaluation reports its own truncations
        dm = run_tasks(run, st, cfg.eval.final_tasks, cfg.eval.final_limit)
        run.log.log(step, {**dm, "time/final_tasks_s": time.perf_counter() - t0}, kind="final_eval")
        summary["downstream"] = {k[len("eval/"):]: v for k, v in dm.items()}
        run.log.console("  final " + " ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in dm.items()
                                              if k.endswith("/headline")))
    if cfg.eval.samples and step == cfg.train.steps:
        summary["samples"] = source_samples(run.dp_model, run.tokenizer, run.val_streams, 24, cfg.eval.samples,
                                            run.info.device, run.autocast)
        for s, smp in summary["samples"].items():
            run.log.console(f"  sample [{s}] {smp['prompt']!r} -> {smp['continuation']!r}")
    reshard(run.dp_model)
    if run.info.is_main and step == cfg.train.steps:
        atomic_write_json(run.run_dir / "summary.json", summary)
    run.log.close()
    return summary


def already_complete(run: Run) -> dict:
    """A resume of a finished run: its summary. A run stopped between its final checkpoint and
    ``summary.json`` (killed during the final evaluation) gets the rest now: the final validation
    (recomputed; the stopped run logged it before the checkpoint), the loss by position (from its
    metrics.jsonl), the final tasks and samples, then ``summary.json``."""
    step, done = run.state.step, run.run_dir / "summary.json"
    # Rank 0's view (the run dir may be on its node only): every rank evaluates, or none does.
    missing = all_reduce_max(torch.tensor([int(run.info.is_main and not done.exists())], device=run.info.device))
    if not missing.item():
        run.log.event(step, f"run already complete ({step} steps); nothing to do")
        run.log.close()
        return read_json(done) if done.exists() else {"steps": step, "tokens": run.state.tokens}  # <= 16 MiB
    run.log.event(step, f"run complete ({step} steps) but without summary.json (stopped after its final "
                        "checkpoint): final evaluation and summary now", kind="resume")
    st = stage_at(step - 1, run.stages)
    run.model.set_rope(st.rope_theta, st.rope_scaling)
    run.last_val = validate(run, st)
    run.position_loss = {r["position_eval"]: {k[len("val_pos/"):]: v for k, v in r.items() if k.startswith("val_pos/")}
                         for r in read_metrics(run.run_dir) if r["kind"] == "eval" and "position_eval" in r}
    return finish(run, st)
