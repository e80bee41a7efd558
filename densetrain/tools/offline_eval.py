"""``densetrain eval CKPT``: evaluate a saved checkpoint outside the training loop."""

from __future__ import annotations

import sys
from pathlib import Path

from densetrain.checkpoint import latest_checkpoint, leased_checkpoint, load_checkpoint, passed_over
from densetrain.config import Config
from densetrain.data.streams import open_streams
from densetrain.data.tokenizer import load_tokenizer
from densetrain.evals.downstream import downstream_metrics
from densetrain.evals.valloss import evaluate_val, val_table
from densetrain.fileio import atomic_write_json, sweep_stale_temps
from densetrain.model.init import build_model
from densetrain.parallel import autocast_for, init_distributed
from densetrain.schedule import resolve_stages, stage_at


def find_checkpoint(path: Path, doing: str = "evaluating") -> Path:
    """``path`` itself when it is a complete checkpoint, else the newest complete one of run dir ``path``;
    newer directories passed over (no completion marker, a ``step_N.tmp``) are said on stderr, one line each,
    as a resume says them (:func:`~densetrain.checkpoint.passed_over`; ``doing``: ``evaluating``, ``exporting``).

    Raises:
        FileNotFoundError: neither.
    """
    path = Path(path)
    if (path / "COMPLETE").exists():
        return path
    ckpt = latest_checkpoint(path)
    for note in passed_over(path, int(ckpt.name[len("step_"):]) if ckpt else -1, doing):
        print(f"densetrain: warning: {note}", file=sys.stderr)
    if ckpt is None:
        raise FileNotFoundError(f"{path}: no complete checkpoint (no COMPLETE marker here nor in "
                                f"{path / 'checkpoints'}/step_*); expected a run directory with checkpoints "
                                f"(RUN_DIR) or one checkpoint (RUN_DIR/checkpoints/step_XXXXXXXX)")
    return ckpt


def eval_path(checkpoint: Path) -> Path:
    """Where the evaluation of ``checkpoint`` is written: ``RUN_DIR/evals/<checkpoint name>.json`` for a
    checkpoint in ``RUN_DIR/checkpoints/`` (one file per checkpoint; evaluating it again replaces it),
    else ``<checkpoint>/eval.json``."""
    checkpoint = Path(checkpoint)
    if checkpoint.parent.name == "checkpoints":
        return checkpoint.parent.parent / "evals" / f"{checkpoint.name}.json"
    return checkpoint / "eval.json"


def evaluate_checkpoint(cfg: Config, path: Path, tasks: str = "", limit: int = 0) -> dict:
    """Validation loss and bits per byte per source of checkpoint ``path`` (a ``step_XXXXXXXX``
    directory or a run directory, meaning its newest complete checkpoint), at the sequence length
    and RoPE base of the stage the checkpoint was saved in (and, for ``train.dtype = 'auto'``, in the dtype it
    was trained in: ``trainer_state.json`` ``dtype``), plus downstream ``tasks`` (comma list or
    group, ``task:k`` for k shots; first ``limit`` examples each, 0 = all). Writes the result to
    :func:`eval_path` (``RUN_DIR/evals/step_XXXXXXXX.json``, which ``densetrain report`` shows and
    checkpoint retention does not delete) and returns the same dict (non-finite numbers are ``null``
    in the file). Tasks whose prompts were cut on the left to
    fit the stage's ``seq_len`` (their shots partly or wholly lost) get a one-line warning, printed
    to stderr and kept in the result's ``warnings`` list
    (:func:`densetrain.evals.downstream.truncation_warnings`).

    Raises:
        FileNotFoundError: no complete checkpoint at ``path``.
    """

    given, path = Path(path), find_checkpoint(path)
    info = init_distributed(cfg.train.device)
    model = build_model(cfg.model, cfg.train.seed, info.device)
    # A read lease: the retention of a run still training keeps the checkpoint until it is loaded (a run
    # directory's newest, deleted before the lease: the newest then, said out loud).
    with leased_checkpoint(path, None if (given / "COMPLETE").exists() else given) as path:
        state = load_checkpoint(path, model, None)
    st = stage_at(max(state["step"] - 1, 0), resolve_stages(cfg))
    model.set_rope(st.rope_theta, st.rope_scaling)
    tok = load_tokenizer(cfg.data.tokenizer, cfg.data.shards_dir)
    streams = open_streams(cfg, "val")
    # 'auto' evaluates in the dtype the checkpoint was trained in (as a resume keeps it), not a new measurement.
    dtype = state.get("dtype", "auto") if cfg.train.dtype == "auto" else cfg.train.dtype
    autocast = autocast_for(dtype, info.device)
    val = evaluate_val(model, streams, st.seq_len, st.micro_batch_size, cfg.eval.max_batches, info.device,
                       autocast, tok, tok.eos_id if st.document_mask else None, st.reset_positions)
    result = {
        "checkpoint": str(path), "step": state["step"], "stage": st.name, "seq_len": st.seq_len,
        "val": val_table(val, streams), "warnings": [],
    }
    if tasks:
        dm, result["warnings"] = downstream_metrics(model, tok, tasks, limit, st.seq_len, info.device, autocast)
        result["downstream"] = {k[len("eval/"):]: v for k, v in dm.items()}
    if info.is_main:
        for line in result["warnings"]:
            print(line, file=sys.stderr, flush=True)
        out = eval_path(path)
        out.parent.mkdir(exist_ok=True)
        sweep_stale_temps(out.parent)  # what killed evaluations left (.step_N.json.tmpPID of a dead PID)
        atomic_write_json(out, result)
    return result
