"""Reading a checkpoint: verified against its marker, with trusted readers only, under a read lease
where a run may be deleting it (:mod:`densetrain.checkpoint`)."""

from __future__ import annotations

import base64
import contextlib
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from densetrain.checkpoint.common import (
    _STEP_DIR,
    CheckpointError,
    _agree,
    _causes,
    _rank,
    describe_error,
    latest_checkpoint,
    state_dict_options,
)
from densetrain.dcp_read import (
    CheckpointCorruptError,
    CheckpointReadError,
    PlainDataPlanner,
    TrustedReader,
    check_trainer_state,
    first_nonfinite,
    nonfinite_error,
    parse_run_json,
    read_marker,
    verify_checkpoint,
)
from densetrain.fileio import MAX_CONFIG_BYTES, read_bytes_bounded, read_json, release_lease, take_lease


@contextlib.contextmanager
def leased_checkpoint(path: Path, newest_of: Path | None = None):
    """Hold a read lease on checkpoint ``path`` while the ``with`` block reads it: retention of a run still
    training keeps it until the lease is dropped (:func:`_retire`). ``newest_of``: the run directory
    ``path`` was chosen from as its newest checkpoint; if retention deleted it before the lease was taken,
    the newest one now is read instead, said on stderr. Yields the checkpoint read.

    Raises:
        CheckpointError: ``path`` was deleted before it could be read (and no other one, or not a run's newest).
    """
    path = Path(path)
    for _ in range(10):  # retention deletes one checkpoint per save: a few tries always find one
        lease = take_lease(path) if _STEP_DIR.match(path.name) else None
        if (path / "COMPLETE").exists():  # looked for after the lease exists (see _retire)
            try:
                yield path
            finally:
                release_lease(lease)
            return
        release_lease(lease)
        newer = latest_checkpoint(newest_of) if newest_of is not None else None
        if newer is None:
            raise CheckpointError(f"{path}: deleted (by the run's checkpoint retention?) before it could be read")
        print(f"densetrain: note: {path.name} was deleted by the running job's retention before it could be read; "
              f"reading {newer.name}, the newest now", file=sys.stderr, flush=True)
        path = newer
    raise CheckpointError(f"{path}: checkpoints keep being deleted before they can be read")


def _verify(path: Path) -> None:
    """Verify checkpoint ``path`` against its marker, the files split over the ranks; every rank raises
    the first rank's failure (so every rank names the file). All ranks must call it."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problem: tuple[str, str] | None = None
    try:
        verify_checkpoint(path, part=(rank, world))
    except CheckpointReadError as e:
        problem = (type(e).__name__, str(e))
    if world > 1:
        problems: list = [None] * world
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p), None)
    if problem:
        raise (CheckpointCorruptError if problem[0] == "CheckpointCorruptError" else CheckpointReadError)(problem[1])


def _set_rng_state(state: dict) -> None:
    import numpy as np

    def dec(s: str) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(base64.b64decode(s), dtype=np.uint8).copy())

    torch.set_rng_state(dec(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([dec(s) for s in state["cuda"]])


class CheckpointMismatchError(CheckpointError):
    """The checkpoint holds another model: its model tensors' names or shapes differ from the model's
    (a ``model.*`` setting changed since it was saved)."""


def _model_mismatch(model_sd: dict, saved: dict, elsewhere: frozenset = frozenset()) -> str:
    """The first tensors whose shape differs between the model's state dict (global shapes, also of
    DTensors) and the ``model.*`` tensors of checkpoint metadata ``saved``, or that only one of them
    has, as ``name: SHAPE saved, SHAPE in the model``; '' when they agree. ``elsewhere``: names the
    whole model has that this rank does not hold (a pipeline stage's model: the other stages check theirs)."""
    want = {k: tuple(v.shape) for k, v in model_sd.items() if isinstance(v, torch.Tensor)}
    got = {k[len("model."):]: tuple(v.size) for k, v in saved.items() if k.startswith("model.") and hasattr(v, "size")}
    # An entry saved as something else than a tensor is not a shape question: the load refuses it by name.
    other = {k[len("model."):] for k in saved if k.startswith("model.")} - set(got)
    names = sorted(n for n in set(got) | set(want)
                   if n not in other and got.get(n) != want.get(n) and not (n not in want and n in elsewhere))
    return ", ".join(f"{n}: {list(got[n]) if n in got else 'none'} saved, "
                     f"{list(want[n]) if n in want else 'none'} in the model" for n in names[:3])


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """Load model (and optimizer) state from checkpoint directory ``path``; return its trainer_state.

    Restores this rank's RNG state when the checkpoint has one for it.

    Raises:
        FileNotFoundError: ``path`` is not a complete checkpoint (no COMPLETE marker).
        CheckpointReadError: a file is missing or unreadable (one line naming it); UntrustedCheckpointError
            (a subclass): a file would build anything but plain data (nothing is run); CheckpointCorruptError
            (a subclass): a file differs from its digest in the marker, or a weight is not finite.
        CheckpointMismatchError: the checkpoint's model tensors have other names or shapes than ``model``'s.
        CheckpointError: anything else (a truncated shard, a torn RNG file).
    """
    path = Path(path)
    if not (path / "COMPLETE").exists():
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no COMPLETE marker)")
    _verify(path)
    trainer_state = read_trainer_state(path)
    try:
        reader = TrustedReader(path, verify=False)  # just verified, split over the ranks
        saved = reader.read_metadata().state_dict_metadata  # a missing, torn or crafted file: one line, here
        if optimizer is not None:
            opts = state_dict_options(model, saved)
            model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)
            _keep_saved_optimizer_state(optim_sd, saved)
            state = {"model": model_sd, "optim": optim_sd}
        else:
            state = {"model": get_model_state_dict(model)}
        diff = _model_mismatch(state["model"], saved, getattr(model, "full_state_names", frozenset()))
        if diff:
            raise CheckpointMismatchError(f"{path}: the checkpoint's model tensors do not match the model ({diff})")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed.*")
            dcp.load(state, storage_reader=reader, planner=PlainDataPlanner(path))
        bad = first_nonfinite(state["model"])
        if not _agree(not bad):  # an honest save never holds one (the checkpointer vetoes non-finite steps)
            raise nonfinite_error(path, bad or "on another rank")
        set_model_state_dict(model, state["model"])  # strict: every tensor of the model was read
        if optimizer is not None:  # not strict: parameters without saved state start afresh (see above)
            set_optimizer_state_dict(model, optimizer, state["optim"], options=StateDictOptions(
                strict=False, flatten_optimizer_state_dict=opts.flatten_optimizer_state_dict))
        rng = path / f"rng_{_rank()}.json"
        if rng.exists():
            # A few KiB (torch's generator states as lists); not a regular file, too large or too deep: one line.
            _set_rng_state(read_json(rng, MAX_CONFIG_BYTES))
    except (CheckpointMismatchError, CheckpointCorruptError):
        raise
    except (Exception, CheckpointException) as e:  # a truncated shard, another model shape, a torn RNG file
        ours = next((x for x in _causes(e) if isinstance(x, CheckpointReadError)), None)
        if ours is not None:  # already one line naming the file (dcp_read)
            raise ours from None
        raise CheckpointError(f"{path}: cannot load ({describe_error(e)})") from None
    return trainer_state


def _keep_saved_optimizer_state(optim_sd: dict, saved: dict) -> None:
    """Drop from ``optim_sd`` (``get_state_dict``'s optimizer half, which holds state for every parameter)
    the parameters that have no state in the checkpoint: AdamW makes none for a parameter that never had a
    gradient, and such a parameter then starts from fresh state, as it would have without the save. A
    parameter with some of its state saved keeps all of it, so a torn entry is still an error."""
    for fqn in list(optim_sd.get("state", {})):
        if not any(f"optim.state.{fqn}.{k}" in saved for k in optim_sd["state"][fqn]):
            del optim_sd["state"][fqn]
    flat = [k for k in optim_sd if k.startswith("state.")]  # the flattened form: state.<fqn>.<key>
    for fqn in {k[len("state."):].rsplit(".", 1)[0] for k in flat}:
        keys = [k for k in flat if k.rsplit(".", 1)[0] == f"state.{fqn}"]
        if not any(f"optim.{k}" in saved for k in keys):
            for k in keys:
                del optim_sd[k]


def read_trainer_state(path: Path) -> dict:
    """``trainer_state.json`` of checkpoint ``path``, verified against its digest in the marker and checked
    against its schema (:func:`densetrain.dcp_read.check_trainer_state`: types, bounds, the step of the
    directory).

    Raises:
        CheckpointError: missing or unreadable (one line). CheckpointReadError: not strict JSON, or a key
            of the wrong type or out of bounds (one line naming the key); CheckpointCorruptError: the
            file differs from the save.
    """
    path = Path(path)
    where = path / "trainer_state.json"
    verify_checkpoint(path, names=["trainer_state.json"])
    try:
        data = read_bytes_bounded(where, MAX_CONFIG_BYTES)  # a few KiB; an unhashed older save is not checked above
    except OSError as e:
        raise CheckpointError(f"{where}: cannot read ({type(e).__name__}: {e})") from None
    m = _STEP_DIR.match(path.name)
    step = read_marker(path)["step"] if (path / "COMPLETE").exists() else int(m.group(1)) if m else None
    return check_trainer_state(parse_run_json(data, where), where, step)
