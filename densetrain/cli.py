"""Command line: ``densetrain prepare | train | eval | export | import-hf | report | demo | doctor``, plus
``mup-check | lr-sweep | plan`` (argument handling in :mod:`densetrain.tools.commands`).

Every command takes ``--preset NAME`` and/or ``--config FILE`` plus ``--section.key=value``
overrides (see ``densetrain train --help-config``), except ``report``, ``blame`` and ``replay``, which read
the run's own ``config.toml``; an override a command does not use is refused (:mod:`densetrain.tools.contexts`).
Errors in user input end with one line ``densetrain: error: ...`` and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from pathlib import Path

from densetrain.config import (
    Config,
    absolute_paths,
    anchor_run_paths,
    help_text,
    list_presets,
    load_config,
    parse_overrides,
)
from densetrain.config.smoke import scale_down
from densetrain.errors import (
    EXIT_PREEMPTED,
    EXIT_REPEATED,
    ConfigError,
    DataError,
    Preempted,
    TrainError,
    disk_full_error,
    is_disk_full,
)
from densetrain.fileio import json_text, mark_kind, recover_folder_swap
from densetrain.storage import StoreUnavailable
from densetrain.tools.contexts import (
    RUN_CONFIG_COMMANDS,
    check_path_arg,
    refuse_flags_out_of_context,
    refuse_unused_overrides,
)


def _is_main() -> bool:
    """Rank 0 (or no torchrun): the process that prints results; the others stay quiet (errors: :func:`say_error`)."""
    return int(os.environ.get("RANK", "0")) == 0


def say_error(text: str) -> None:
    """Print ``densetrain: error: TEXT`` to stderr at once, on every rank: under torchrun a failing rank may
    be stopped by the launcher before another rank prints, so each says its own first error (``[rank N]``
    tells them apart) and flushes before returning."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    where = f"[rank {os.environ.get('RANK', '0')}] " if world > 1 else ""
    print(f"densetrain: error: {where}{text}", file=sys.stderr, flush=True)


def _config_from(args: argparse.Namespace, rest: list[str]) -> Config:
    path = args.config
    preset = args.preset
    run_dir, strict = None, True  # the run whose own config.toml is read: an older run's relative paths anchored
    if getattr(args, "checkpoint", None) and not (path or preset):
        # `eval RUN_DIR` or `eval RUN_DIR/checkpoints/step_X`: use the run's resolved config.
        ck = Path(args.checkpoint)
        for cand in (ck / "config.toml", ck.parent.parent / "config.toml"):
            if cand.exists():
                path = run_dir = cand
                break
    if getattr(args, "resume", None):
        if "://" in args.resume:  # pathlib folded it into a local 's3:/...' that does not exist
            raise ConfigError(f"--resume {args.resume}: RUN_DIR is the local run directory (its checkpoints may live "
                              f"at checkpoint.dir's URL); a run whose directory is gone resumes with the command "
                              f"that started it and --train.resume=auto")
        if path or preset:  # before: read and silently ignored, so edits in that file never reached the run
            raise ConfigError(f"--resume {args.resume} continues the run's own config.toml; drop "
                              f"{'--config ' + str(path) if path else '--preset ' + preset} (change keys with "
                              f"--key=value flags, or start a new run with it)")
        run, resolved = Path(args.resume), Path(args.resume) / "config.toml"
        if not resolved.exists():  # the config is the first file a run writes: none yet, nothing to resume
            raise TrainError(f"{run}: {'no config.toml' if run.is_dir() else 'no such run directory'}, so no run "
                              f"to resume (one stopped during start-up has none yet): start it again with the "
                              f"command that started it, e.g. densetrain train --preset NAME --train.run_dir {run}")
        path, preset, run_dir, strict = resolved, None, resolved, False  # --resume's arguments are checked next
    if not (preset or path):
        # Without --config the tiny preset is the config. A --config file alone is the whole config (keys it
        # leaves out take the built-in defaults), as in torchtitan and OLMo-core: under a silent tiny preset a
        # user's file trained on the demo corpus (data.demo_corpus = true) with the preset's sources and stages.
        preset = "tiny"
    cfg = load_config(preset=preset, path=path, overrides=parse_overrides(rest))
    return anchor_run_paths(cfg, run_dir.parent, strict) if run_dir else cfg


def cmd_prepare(cfg: Config, args: argparse.Namespace) -> int:
    from densetrain.data.prepare import prepare

    summary = prepare(cfg, force=args.force, verify=args.verify)
    if _is_main():
        print(json_text({k: v for k, v in summary.items() if k != "sources"}, indent=1, default=str)[:2000])
    return 0


def cmd_train(cfg: Config, args: argparse.Namespace) -> int:
    if getattr(args, "dry_run", False):  # the memory and layout plan only: no data, no process group
        from densetrain.schedule import resolve_stages
        from densetrain.tools.commands import print_dry_run

        try:
            resolve_stages(cfg)  # the stage table's checks, as training would run them first
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return print_dry_run(cfg, args.world_size, args.rank, args.ranks, args.gpu_memory_gib)
    from densetrain.train import train
    from densetrain.train.rundir import end_attempt, stopped_job

    if (args.rollback_to is not None or args.skip_batches) and not args.resume:
        raise ConfigError("--rollback-to / --skip-batches need --resume RUN_DIR")
    if args.skip_batches < 0 or (args.skip_batches and args.rollback_to is None):  # else skipped silently
        raise ConfigError(f"--skip-batches {args.skip_batches}: expected a number of global batches >= 0, "
                          "with --rollback-to STEP")
    # A plain --resume keeps the run's layout intent at any world size; --parallel.* flags are obeyed as given.
    if args.stop_after is not None and args.stop_after < 1:
        raise ConfigError(f"--stop-after {args.stop_after}: expected a step >= 1")
    run_dir, rank = Path(cfg.train.run_dir), int(os.environ.get("RANK", "0"))
    stopped = stopped_job(run_dir)  # under torchrun: this job already failed the same way twice
    if stopped:
        end_attempt(run_dir, rank, "skipped")
        say_error(stopped)
        return EXIT_REPEATED
    try:
        summary = train(cfg, resume=bool(args.resume), rollback_to=args.rollback_to, skip_batches=args.skip_batches,
                        keep_layout_intent=bool(args.resume) and not args.layout_flags, stop_after=args.stop_after)
    except Preempted:
        end_attempt(run_dir, rank, "preempted")
        raise
    except Exception as e:  # every failure of the attempt (the CLI below turns it into its line and status)
        repeated = end_attempt(run_dir, rank, "failed", e)
        if repeated:
            say_error(repeated)
            return EXIT_REPEATED
        raise
    end_attempt(run_dir, rank, "done")
    if _is_main():  # torchrun: one summary, not one per rank
        print("\n".join(summary_lines(summary, Path(cfg.train.run_dir))))
    return 0


def summary_lines(summary: dict, run_dir: Path) -> list[str]:
    """The few lines ``densetrain train`` ends with: steps, the last train loss and the median throughput
    (from ``metrics.jsonl``: a resumed run's whole history), the final validation loss and bits per byte,
    and where the files are. The whole summary (per-source tables, tasks, samples: pages of JSON) is in
    ``summary.json``, which ``densetrain report`` shows."""
    from statistics import median

    from densetrain.metrics import format_rate, read_metrics

    # a skipped (non-finite) step's loss is null in the file
    recs = [r for r in read_metrics(run_dir) if r.get("kind") == "train" and isinstance(r.get("loss"), float)]
    lines = [f"done: {summary['steps']} steps, {summary['tokens']:,} tokens"
             + (f", {summary['skipped_steps']} skipped" if summary.get("skipped_steps") else "")]
    if recs:
        lines.append(f"final train loss {recs[-1]['loss']:.4f} (step {recs[-1]['step']}), "
                     f"median {format_rate(median(r['tokens_per_sec'] for r in recs))}")
    val = summary.get("val", {}).get("all", {})  # read back from summary.json on a resume: NaN is null there
    if isinstance(val.get("loss"), float):
        bpb = f", {val['bpb']:.4f} bits per byte" if isinstance(val.get("bpb"), float) else ""
        lines.append(f"val loss {val['loss']:.4f}{bpb}")
    have = [f for f in ("summary.json", "metrics.jsonl", "checkpoints") if (run_dir / f).exists()]
    lines.append(f"files: {run_dir}/ ({', '.join(have)}); densetrain report {run_dir} for the full report")
    return lines


def cmd_blame(cfg: Config, args: argparse.Namespace) -> int:
    """The documents of the global batch of one step (``densetrain.tools.blame``)."""
    from densetrain.tools.blame import blame, format_blame

    res = blame(Path(args.run_dir), args.step)
    if args.json:
        print(json_text({**res, "samples": [{k: v for k, v in s.items() if k != "tokens"} for s in res["samples"]]},
                        indent=1))
    else:
        print(format_blame(res))
    return 0


def cmd_replay(cfg: Config, args: argparse.Namespace) -> int:
    """Data or machine: recompute a step from the checkpoint before it (``densetrain.tools.replay``)."""
    from densetrain.tools.replay import append_event, replay

    try:
        res = replay(Path(args.run_dir), args.step, rtol=args.rtol)
    except (DataError, TrainError) as e:
        if args.auto:  # started by the guard: the failure belongs in the run's events too
            append_event(Path(args.run_dir), {"index": args.step - 1,
                                              "text": f"replay of step {args.step} failed: {e}"}, action="failed")
        raise
    append_event(Path(args.run_dir), res)
    print(json_text(res, indent=1) if args.json else res["text"])
    return 0


def cmd_eval(cfg: Config, args: argparse.Namespace) -> int:
    from densetrain.tools.offline_eval import evaluate_checkpoint

    if args.limit < 0:  # else a ValueError traceback from the task loader
        raise ConfigError(f"--limit {args.limit}: expected a number of examples per task >= 0 (0 = all)")
    if args.tasks:  # an unknown task name fails now, not after the model and checkpoint have loaded
        from densetrain.registry.tasks import parse_task_list, resolve_tasks

        resolve_tasks(parse_task_list(args.tasks))
    result = evaluate_checkpoint(cfg, Path(args.checkpoint), tasks=args.tasks, limit=args.limit)
    if _is_main():
        print(json_text(result, indent=1))
    return 0


def check_local_out(out: str) -> None:
    """``--out`` of export / import-hf is a local folder: a URL became a folder named ``s3:`` (pathlib folds
    ``//``) while the command said it had exported. Raises: ConfigError (one line)."""
    if "://" in out or re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:/", out):
        raise ConfigError(f"{out}: the output must be a local folder (export or import there, then copy it to the "
                          f"store, e.g. with `aws s3 cp --recursive`), got a URL")


def cmd_export(cfg: Config, args: argparse.Namespace) -> int:
    """Write a Hugging Face LlamaForCausalLM folder (config.json + safetensors + tokenizer) from a checkpoint
    of any layout, read one tensor at a time (files of at most 2 GiB, with an index when there are more)."""
    from densetrain.checkpoint import leased_checkpoint
    from densetrain.hf import check_export_target
    from densetrain.tools.offline_eval import find_checkpoint

    check_local_out(args.out)
    check_export_target(Path(args.out))  # before any work: an export never replaces a run or other files
    given = Path(args.checkpoint)
    # A read lease: the retention of a run still training keeps this checkpoint until the export is done.
    ckpt = find_checkpoint(given, "exporting")
    with leased_checkpoint(ckpt, None if (given / "COMPLETE").exists() else given) as path:
        return _export_checkpoint(cfg, args, path)


def _export_checkpoint(cfg: Config, args: argparse.Namespace, path: Path) -> int:
    from torch.distributed.checkpoint.api import CheckpointException

    from densetrain.checkpoint import describe_error, read_trainer_state
    from densetrain.data.tokenizer import load_tokenizer
    from densetrain.hf import check_checkpoint_matches, export_hf_from_checkpoint
    from densetrain.schedule import resolve_stages, stage_at

    state = read_trainer_state(path)
    # The exported RoPE base and context length are those of the stage the checkpoint was saved in.
    st = stage_at(max(state["step"] - 1, 0), resolve_stages(cfg))
    cfg.model.rope_theta, cfg.model.rope_scaling = st.rope_theta, st.rope_scaling
    try:  # the checkpoint must be this config's model before anything else (the tokenizer) matters
        check_checkpoint_matches(path, cfg.model)
    except ValueError as e:
        raise TrainError(str(e)) from None
    tok = load_tokenizer(cfg.data.tokenizer, cfg.data.shards_dir)
    from densetrain.hf import generation_config_file, special_token_ids, tokenizer_files

    try:  # tokenizer.json + tokenizer_config.json with the same ids in transformers
        files, note = tokenizer_files(tok, st.seq_len), ""
    except DataError as e:  # e.g. tiktoken:cl100k_base (gaps in its special ids)
        files, note = {}, f"; no tokenizer files ({e})"
    files["generation_config.json"] = generation_config_file(tok)
    try:
        out = export_hf_from_checkpoint(
            path, cfg.model, Path(args.out), max_position_embeddings=st.seq_len,
            extra_config=special_token_ids(tok), extra_files=files)
    except ValueError as e:  # the checkpoint was made for another model.* shape: one line, not a traceback
        raise TrainError(str(e)) from None
    except TrainError:  # already one line naming the file (damaged, unlisted, non-finite weights)
        raise
    except (RuntimeError, OSError, CheckpointException) as e:  # a truncated or corrupt shard file
        raise TrainError(f"{path}: cannot read the checkpoint ({describe_error(e)})") from None
    print(f"exported {path} -> {out} (rope_theta {st.rope_theta:g}, max_position_embeddings {st.seq_len}){note}")
    return 0


def _usable_tokenizer(path: Path, vocab_size: int) -> tuple[Path | None, str]:
    """(``path``, '') when the HF folder's ``tokenizer.json`` loads as a densetrain tokenizer (an EOS token
    found) with at most ``vocab_size`` ids, else (None, why not)."""
    from densetrain.data.tokenizer import Tokenizer

    if not path.exists() and not path.is_symlink():  # a FIFO or a link to /dev/zero: from_file says what it is
        return None, f"no tokenizer.json in {path.parent}"
    try:
        tok = Tokenizer.from_file(path)
    except (DataError, OSError) as e:  # OSError: not a regular file or over 1 GiB (fileio.ReadRefused), unreadable
        return None, str(e)
    if tok.vocab_size > vocab_size:
        return None, f"{path}: {tok.vocab_size} token ids, more than the model's vocab_size {vocab_size}"
    return path, ""


def cmd_import_hf(cfg: Config, args: argparse.Namespace) -> int:
    """Load a local HF Llama folder into a densetrain checkpoint (step 0) under --out RUN_DIR."""
    from densetrain.checkpoint import save_checkpoint
    from densetrain.config import save_config
    from densetrain.hf import import_hf
    from densetrain.model.llama import Transformer
    from densetrain.optim import build_optimizer

    check_local_out(args.out)
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: already exists and is not empty; import into a new run directory")
    mcfg, sd = import_hf(Path(args.hf_dir))
    cfg.model = mcfg
    model = Transformer(mcfg)
    model.load_state_dict(sd, strict=True)
    cfg.train.run_dir = args.out
    cfg = absolute_paths(cfg)  # the run's config.toml is read from any directory (densetrain/config/paths.py)
    # The model's own tokenizer, copied into the run (self-contained: the HF folder may go), is the run's
    # data.tokenizer: a run continued from the import tokenizes (and evaluates) with the ids it was trained on.
    tok_file, note = _usable_tokenizer(Path(args.hf_dir) / "tokenizer.json", mcfg.vocab_size)
    if tok_file:
        cfg.data.tokenizer = str(out.resolve() / "tokenizer.json")
    else:
        note = (f"; {note}: data.tokenizer stays {cfg.data.tokenizer!r} (set it in {out / 'config.toml'} to "
                "the model's tokenizer before training on)")
    # Written in .NAME.tmp-PID, then renamed to --out: a failure or a kill -9 leaves no half-made run
    # that blocks the re-run (which deletes the folder of a killed import).
    recover_folder_swap(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        tmp.mkdir(parents=True)
        mark_kind(tmp, "run")
        if tok_file:
            shutil.copyfile(tok_file, tmp / "tokenizer.json")
        save_config(cfg, tmp / "config.toml")
        path = save_checkpoint(tmp, 0, model, build_optimizer(model, cfg), {"step": 0, "tokens": 0}, keep=0)
        os.replace(tmp, out)  # onto a missing or empty --out (checked above)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e):
            raise disk_full_error(out, "the imported run") from None
        raise
    path = out / path.relative_to(tmp)
    print(f"imported {args.hf_dir} -> {path} ({model.num_params() / 1e6:.2f}M parameters, data.tokenizer "
          f"{cfg.data.tokenizer}){note}")
    return 0


def cmd_report(cfg: Config, args: argparse.Namespace) -> int:
    from densetrain.report import write_report

    print(write_report(Path(args.run_dir)))
    return 0


def cmd_ladder_report(args: argparse.Namespace) -> int:
    """``densetrain ladder report LADDER_DIR [--run RUN_DIR]``: the scaling panel (here: tools do not import report)."""
    from densetrain.report.ladder import write_ladder_report
    from densetrain.tools.ladder.command import ladder_dir_arg

    for path in write_ladder_report(ladder_dir_arg(args.ladder_dir), Path(args.run) if args.run else None):
        print(f"wrote {path}")
    return 0


def cmd_demo(cfg: Config, args: argparse.Namespace) -> int:
    """prepare -> train -> final evaluation -> report, in one go (what `make demo` runs)."""
    from densetrain.data.prepare import prepare
    from densetrain.report import write_report
    from densetrain.train import train

    prepare(cfg)
    train(cfg, resume=True)  # a re-run (or a run after kill -9) continues from the last checkpoint
    if _is_main():
        print(write_report(Path(cfg.train.run_dir)))
    return 0


def cmd_doctor(cfg: Config, args: argparse.Namespace) -> int:
    """Hardware health of every rank: :func:`densetrain.tools.doctor.doctor` (its verdict line, exit statuses)."""
    from densetrain.tools.doctor import doctor

    return doctor(cfg, args)


COMMANDS = {
    "prepare": (cmd_prepare, "clean, dedup and tokenize the configured sources into token shards"),
    "train": (cmd_train, "run the staged training recipe (or --resume RUN_DIR)"),
    "eval": (cmd_eval, "evaluate a checkpoint: validation loss per source and downstream tasks; the result "
                       "goes to RUN_DIR/evals/step_XXXXXXXX.json, which `densetrain report` shows"),
    "export": (cmd_export, "export a checkpoint as a Hugging Face LlamaForCausalLM folder"),
    "import-hf": (cmd_import_hf, "import a local Hugging Face Llama folder as a densetrain checkpoint"),
    "report": (cmd_report, "write RUN_DIR/report.html, report.png and summary"),
    "blame": (cmd_blame, "list the documents (source, file, line, id) whose tokens made the batch of a step"),
    "replay": (cmd_replay, "recompute a step from the checkpoint before it: did the data or the machine cause it?"),
    "demo": (cmd_demo, "prepare + train + report with the tiny preset on the demo corpus"),
    "doctor": (cmd_doctor, "hardware health of every rank (alone or under torchrun): matmul rate, memory and "
                           "collective bandwidth per rank against the median of the ranks (and a run's first "
                           "measurement with --train.run_dir), a busy host told from a faulty device; one verdict "
                           "line"),
}


DOCTOR_EPILOG = ("Exit status: 0 healthy; 1 unhealthy (a device or link named: a hardware outlier that stays one "
                 "per CPU-second and after a second measurement); 3 busy (only contention from other processes "
                 "found: judge the device again on a quiet host); 2 bad input (one line). Under torchrun every "
                 "rank exits 0 after a verdict (torchrun reports any other status as a failed child with its error "
                 "dump): read the verdict line, or --json.")
TRAIN_EPILOG = (f"SIGTERM, SIGUSR1 (Slurm's warning) or Ctrl-C (SIGINT): the current step finishes (an in-loop "
                f"evaluation stops after its current batch), a checkpoint is written and the run exits "
                f"with status {EXIT_PREEMPTED}; continue it with --resume RUN_DIR. A second signal exits at once "
                f"(status 143 / 130). Exit status 2: bad input (one line). Exit status {EXIT_REPEATED}: under "
                "torchrun, this attempt failed as the job's previous one did (same error, same step): do not retry "
                "(RUN_DIR/attempts/stop.json).")


class Parser(argparse.ArgumentParser):
    """argparse with the project's one-line errors, for the command and every subcommand (subparsers are
    made of the parent's class): ``densetrain: error: MESSAGE (see PROG --help)`` and exit status 2,
    instead of argparse's usage block (printed by rank 0 only under torchrun)."""

    def error(self, message: str):
        say_error(f"{message} (see {self.prog} --help)")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="densetrain",
        description="Pretrain dense decoder-only language models: data prep -> staged training -> evaluation.",
        epilog="Any config field can be overridden: --section.key=value (e.g. --optim.peak_lr=3e-4). "
        "List them with: densetrain train --help-config",
    )
    sub = p.add_subparsers(dest="command", required=True)
    for name, (_, help_) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_,
                            epilog={"train": TRAIN_EPILOG, "doctor": DOCTOR_EPILOG}.get(name))
        sp.add_argument("--preset", help=f"preset name ({', '.join(list_presets())}); "
                        + ("default: the checkpoint's run config (RUN_DIR/config.toml), tiny without one"
                           if name in ("eval", "export") else "default tiny, none with --config"))
        sp.add_argument("--config", help="TOML config file: the whole config, keys it leaves out at the built-in "
                        "defaults (densetrain train --help-config); with --preset NAME it is applied over that "
                        "preset instead")
        sp.add_argument("--help-config", action="store_true", help="list every config key with its meaning")
        if name == "train":
            sp.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its newest complete checkpoint, "
                            "on any number of processes (without --parallel.* flags the layout keeps the run's "
                            "intent and the one chosen is said)")
            sp.add_argument("--dry-run", action="store_true", help="resolve the config, build the model on the meta "
                            "device and print the memory and layout plan (densetrain plan); no data is read")
            sp.add_argument("--world-size", type=int, metavar="N", help="with --dry-run: the job's number of "
                            "processes (default: WORLD_SIZE, else 1)")
            sp.add_argument("--rank", type=int, metavar="R", help="with --dry-run: build rank R of the job on a fake "
                            "process group (meta device) and print its stage, shards and bytes")
            sp.add_argument("--ranks", metavar="R,R,..", help="with --dry-run: as --rank for each (e.g. 0,517,-1)")
            sp.add_argument("--gpu-memory-gib", type=float, metavar="GIB", help="with --dry-run: memory per GPU "
                            "(default: this GPU's, else 80); a stage over it exits 2")
            sp.add_argument("--rollback-to", type=int, metavar="STEP", help="with --resume: set the checkpoints "
                            "after STEP aside (moved to RUN_DIR/checkpoints_set_aside) and continue from STEP")
            sp.add_argument("--skip-batches", type=int, default=0, metavar="N",
                            help="with --rollback-to: skip the next N global batches of data")
            sp.add_argument("--stop-after", type=int, metavar="STEP", help="stop after STEP steps in total, with a "
                            "checkpoint there (the schedule still runs to train.steps; --resume continues): the "
                            "segments of a ladder's main run (densetrain ladder --print-commands)")
        if name in ("train", "prepare", "eval", "demo"):
            sp.add_argument("--smoke", action="store_true", help="the same recipe scaled down to a few CPU steps "
                            "with every stage (run dir gets a -smoke suffix): a check before a long run")
        if name == "blame":
            sp.add_argument("run_dir", help="run directory")
            sp.add_argument("step", type=int, help="step as in metrics.jsonl (the STEP-th optimizer update)")
            sp.add_argument("--json", action="store_true", help="print JSON instead of one line per document")
        if name == "replay":
            sp.add_argument("run_dir", help="run directory")
            sp.add_argument("step", type=int, help="step as in metrics.jsonl (the STEP-th optimizer update); a "
                            "guard event's [step N] is the update's index, STEP N+1, which the event's text names")
            sp.add_argument("--rtol", type=float, default=1e-3, help="relative difference still counted as "
                            "reproduced (fp32 noise; default 1e-3)")
            sp.add_argument("--json", action="store_true", help="print the verdict as JSON")
            sp.add_argument("--auto", action="store_true", help=argparse.SUPPRESS)  # started by guard.replay
        if name == "prepare":
            sp.add_argument("--force", action="store_true", help="redo sources whose shards are up to date")
            sp.add_argument("--verify", action="store_true", help="hash every shard of an up-to-date source against "
                            "its manifest (a full read; otherwise only shards whose mtime changed are hashed)")
        if name in ("eval", "export"):
            sp.add_argument("checkpoint", help="checkpoint directory (RUN_DIR/checkpoints/step_XXXXXXXX) or RUN_DIR")
        if name == "eval":
            sp.add_argument("--tasks", default="", help="downstream tasks: comma list of tasks or groups (light, all, "
                            "gold_bpb = gsm8k_bpb + humaneval_bpb, generative = gsm8k + humaneval); "
                            "TASK:K for K shots, e.g. mmlu_mc:5")
            sp.add_argument("--limit", type=int, default=0, help="examples per task (first N); 0 = all")
        if name == "export":
            sp.add_argument("--format", choices=["hf"], default="hf", help="output format")
            sp.add_argument("out", help="output directory")
        if name == "import-hf":
            sp.add_argument("hf_dir", help="local folder with config.json + *.safetensors")
            sp.add_argument("--out", required=True, help="run directory to create")
        if name == "report":
            sp.add_argument("run_dir", help="run directory")
        if name == "doctor":  # its flags, one line each
            sp.add_argument("--json", action="store_true", help="print the verdict, rows and outliers as JSON")
            sp.add_argument("--profile", metavar="FILE", help="also write this machine's hardware profile (.toml or "
                            ".json) from the measurements, for densetrain plan --hardware FILE")
    from densetrain.tools.commands import add_subcommands
    from densetrain.tools.ladder.command import add_ladder_command

    add_subcommands(sub)
    add_ladder_command(sub, cmd_ladder_report)
    p.commands = sub.choices  # name -> subparser (its error() names its own --help)
    return p


def entry() -> None:
    """The ``densetrain`` command and ``python -m densetrain``: :func:`main`, then exit with its code.

    Under torchrun (``WORLD_SIZE`` > 1) the process leaves with ``os._exit`` once the command has
    returned (its files written and closed, the process group destroyed): gloo's C++ threads sometimes
    abort the interpreter's own teardown ("terminate called without an active exception"), turning a
    finished run into a failed rank."""
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    """Run one command; user errors print one line (on every rank under torchrun: :func:`say_error`) and return 2."""
    import densetrain  # noqa: F401  (sets CPU threading defaults before torch loads)

    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    args.rest = rest  # the --section.key=value overrides as given (doctor: was --train.run_dir given?)
    args.layout_flags = [a for a in rest if a.startswith(("--parallel.dp_replicate", "--parallel.dp_shard",
                                                          "--parallel.tp", "--parallel.cp"))]
    cfg = None
    try:
        if hasattr(args, "func"):  # mup-check | lr-sweep | plan | ladder: own flags; plan and ladder take overrides
            if rest and args.command not in ("plan", "ladder"):
                parser.commands[args.command].error(f"unrecognized arguments: {' '.join(rest)}")
            args.overrides = parse_overrides(rest)  # --section.key=value, e.g. --parallel.tp=4
            return args.func(args)
        if getattr(args, "checkpoint", None) and not args.help_config:  # eval / export of a URL: a local copy
            from densetrain.checkpoint import localize

            args.checkpoint = str(localize(args.checkpoint))
        if not args.help_config:
            refuse_flags_out_of_context(args)
            check_path_arg(args)
        if not args.help_config:
            refuse_unused_overrides(args, rest)
        if args.command in RUN_CONFIG_COMMANDS and not args.help_config:
            return COMMANDS[args.command][0](None, args)
        cfg = _config_from(args, rest)
        if getattr(args, "smoke", False):
            cfg = scale_down(cfg)
        if args.help_config:  # the keys with the values of this preset / file / overrides
            print(help_text(cfg))
            return 0
        if getattr(args, "resume", None):
            cfg.train.run_dir = str(args.resume)
        try:
            return COMMANDS[args.command][0](cfg, args)
        finally:  # under torchrun: leave the process group cleanly on every rank (no teardown warnings)
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
    except (ConfigError, DataError, TrainError, FileNotFoundError) as e:
        # A config error is the user's key or flag: point at the subcommand's help, which lists them.
        see = f" (see {parser.commands[args.command].prog} --help)" if isinstance(e, ConfigError) else ""
        say_error(f"{e}{see}")
        return 2
    except Preempted as e:  # SIGTERM / Ctrl-C: stopped at a step boundary with a checkpoint (train/preempt.py)
        if _is_main():
            print(f"densetrain: {e}", file=sys.stderr)
        return EXIT_PREEMPTED
    except BrokenPipeError:  # `densetrain ... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        # but a training run stopped by it did not finish: the shell's SIGPIPE status, never 0 for a requeue
        trained = args.command == "train" and not (args.help_config or getattr(args, "dry_run", False))
        return 141 if trained else 0
    except StoreUnavailable as e:  # the object store did not answer (at a start, in eval / export): a temporary
        say_error(str(e))  # failure, as a stop on an outage is (exit 75): the same command works once it is back
        return EXIT_PREEMPTED
    except OSError as e:  # a full disk, a read-only or unwritable path in a writer without its own handling
        say_error(f"no space left on {e.filename or 'the device'} ({e.strerror})" if is_disk_full(e) else str(e))
        return 2
    except KeyboardInterrupt:
        if _is_main():
            print("densetrain: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:  # a collective that timed out (parallel.timeout_s) or lost a peer: one line per rank
        from densetrain.train.watch.watchdog import collective_failure_line  # that waited, exit 1: the agent restarts

        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        line = collective_failure_line(e, Path(cfg.train.run_dir), rank, world) if cfg is not None else None
        if line is None:
            raise
        say_error(line)
        return 1


if __name__ == "__main__":
    sys.exit(main())
