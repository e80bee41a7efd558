"""Checkpoints in ``checkpoint.dir`` (a URL such as ``s3://bucket/run1/checkpoints``, or another folder): the
run directory's ``checkpoints/`` stays the staging area, written with the local protocol (temp dir, fsync,
marker, rename), and each complete checkpoint is then uploaded with its ``COMPLETE`` marker last
(:func:`sync_up`), so a remote ``step_N`` without a marker is an upload a kill cut short: never listed, never
read, deleted by the next upload. Retention keeps the newest ``keep`` complete ones in the store (counted there: a
run directory may hold fewer); a rollback sets
aside the later ones (``checkpoint.dir/set_aside/``, :func:`set_aside_remote`) as it sets aside local ones.

A resume fetches the newest remote checkpoint when the run directory has none as new (:func:`fetch_newest`:
a new machine, a wiped disk); ``eval`` and ``export`` of a URL read a local copy in the cache
(:func:`localize`), made of the checkpoint and the run's ``config.toml`` (uploaded beside the checkpoints);
``replay`` and ``blame`` of a run directory find its checkpoints in both places (:func:`run_checkpoints`).
The marker's digests are checked on every read as for any local checkpoint (:mod:`densetrain.dcp_read`).

Chosen over DCP's fsspec writer: the local staging keeps the write protocol, the digests (hashed from local
files), the async save and the trust rules exactly as they are; the upload is one more copy of each file.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from densetrain import storage
from densetrain.checkpoint.common import _agree, _rank, checkpoint_dir, list_complete
from densetrain.errors import TrainError
from densetrain.fileio import atomic_write_bytes, atomic_write_json, fsync_dir, read_json

_STEP = re.compile(r"^step_(\d{8})$")
SET_ASIDE = "set_aside"
"""``checkpoint.dir/set_aside/``: the remote copies of checkpoints a rollback set aside (as the run directory's
``checkpoints_set_aside/``): kept, never listed, never resumed from, never counted nor deleted by retention."""


PENDING = "remote_set_aside.json"
"""``RUN_DIR/checkpoints_set_aside/remote_set_aside.json``: ``{"after_step": S}``, written before a rollback sets
anything aside and deleted once ``checkpoint.dir`` has had its checkpoints after S set aside too; while it is
there (the store was down, or the run was killed in between), the next upload or resume does that first
(:func:`settle`), so no checkpoint a rollback abandoned is ever fetched, kept or counted in the store."""


OWNER = "OWNER"
"""``checkpoint.dir/OWNER``: the token of the run that writes there (also in ``RUN_DIR/store_owner``). Written at a
fresh start, checked before every upload: a second run started on the same ``checkpoint.dir`` (at the same time,
before either had a checkpoint there) claims it, and the first run's next upload stops with one line instead of
the two runs replacing and setting aside each other's checkpoints while both say "uploaded"."""
LOCAL_OWNER = "store_owner"


def _owner(root) -> str:
    """The token in ``root/OWNER`` ('' when there is none). Raises: StoreUnavailable."""
    path = storage.join(root, OWNER)
    return storage.read_bytes(path, 256).decode(errors="replace").strip() if storage.exists(path) else ""


def claim(run_dir: Path, root, resume: bool) -> str:
    """Rank 0 at a run's start: make ``root`` this run's (:data:`OWNER`). A fresh run takes a new token unless
    another run holds ``root``; a resume keeps its token, or (a run directory that lost it: a new machine) takes
    the store's. Returns: an error line ('' when claimed). Raises: StoreUnavailable."""
    local = Path(run_dir) / LOCAL_OWNER
    mine = local.read_text().strip() if local.is_file() else ""
    theirs = _owner(root)
    if theirs and theirs != mine and (mine or not resume):
        return (f"checkpoint.dir {root} belongs to another run ({OWNER} {theirs}, this run's "
                f"{mine or 'none'}): two runs writing there would replace each other's checkpoints; choose another "
                f"checkpoint.dir (or delete {storage.join(root, OWNER)} if that run is gone)")
    token = mine or theirs or os.urandom(8).hex()
    if not mine:
        local.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(local, token.encode())
    if theirs != token:
        storage.write_bytes(storage.join(root, OWNER), token.encode())
    return ""


def check_owner(run_dir: Path, root) -> None:
    """Before an upload: ``root`` is still this run's (a run directory from before :data:`OWNER` has no token and is
    not checked). Raises: TrainError (one line) when another run has claimed it; StoreUnavailable."""
    local = Path(run_dir) / LOCAL_OWNER
    if not local.is_file():
        return
    mine, theirs = local.read_text().strip(), _owner(root)
    if theirs and theirs != mine:
        raise TrainError(f"checkpoint.dir {root} was claimed by another run ({OWNER} {theirs}, this run's {mine}) "
                         f"while this run wrote there: nothing uploaded; the checkpoints are in {run_dir}/checkpoints"
                         f"; continue with another checkpoint.dir")


def note_set_aside(run_dir: Path, after_step: int) -> None:
    """Record that ``checkpoint.dir``'s checkpoints after ``after_step`` are to be set aside (:data:`PENDING`;
    the lowest step when one is pending already). Rank 0."""
    path = Path(run_dir) / "checkpoints_set_aside" / PENDING
    try:
        after_step = min(after_step, int(read_json(path)["after_step"]))
    except FileNotFoundError:
        pass
    except (OSError, ValueError, TypeError, KeyError):  # unreadable: this rollback's step is the one known
        pass
    atomic_write_json(path, {"after_step": after_step})


def settle(run_dir: Path, root) -> list[str]:
    """Set aside in ``root`` what a rollback of this run directory left there (:data:`PENDING`), then forget it.
    Rank 0. Returns: the new URLs. Raises: StoreUnavailable (the record stays for the next try); OSError."""
    path = Path(run_dir) / "checkpoints_set_aside" / PENDING
    try:
        after_step = int(read_json(path)["after_step"])
    except FileNotFoundError:
        return []
    except (OSError, ValueError, TypeError, KeyError):  # unreadable: the safe reading is "nothing after step 0"
        after_step = 0
    moved = set_aside_remote(root, after_step)
    path.unlink()
    return moved


def set_aside_remote(root, after_step: int) -> list[str]:
    """A rollback to ``after_step``: move ``root``'s complete checkpoints after it into
    ``root/set_aside/`` (a second one past the same step adds ``.1``, ``.2``, ...), marker deleted first and
    written last (:func:`densetrain.storage.move_tree`): from the first request on they are not listed, so a
    resume never fetches them and retention neither counts nor deletes them. Rank 0 only.

    Returns: the new URLs. Raises: StoreUnavailable; OSError."""
    moved = []
    for step, url in remote_complete(root):
        if step <= after_step:
            continue
        dest, k = storage.join(root, SET_ASIDE, storage.name(url)), 1
        while storage.exists(dest):
            dest, k = storage.join(root, SET_ASIDE, f"{storage.name(url)}.{k}"), k + 1
        storage.move_tree(url, dest, last=("COMPLETE",))
        moved.append(dest)
    return moved


def remote_complete(root) -> list[tuple[int, str]]:
    """Complete checkpoints under ``root`` as ``[(step, path), ...]`` sorted by step (``COMPLETE`` present)."""
    out = []
    for name in storage.listdir(root):
        m = _STEP.match(name)
        if m and storage.isfile(storage.join(root, name, "COMPLETE")):
            out.append((int(m.group(1)), storage.join(root, name)))
    return sorted(out)


def sync_up(run_dir: Path, root, keep: int) -> list[str]:
    """Upload the run's complete local checkpoints that ``root`` lacks (the newest ``keep`` of them; 0: all),
    each with its marker last; delete the partial uploads of killed runs and the remote complete ones past the
    newest ``keep`` complete in the store (so never the store's newest complete one); set aside
    (:func:`set_aside_remote`) those newer than the local newest and, first, those a rollback here left in the
    store (:func:`settle`). Rank 0 only.

    A local checkpoint deleted while it is uploaded (an upload in the background meets retention or a rollback)
    is left out. Returns: the names uploaded. Raises: StoreUnavailable (the store did not answer); OSError."""
    local = list_complete(run_dir)
    if not local:
        return []
    check_owner(run_dir, root)  # before anything is written or set aside there
    config = Path(run_dir) / "config.toml"
    if config.is_file():  # eval / export of the URL read it (localize)
        storage.write_bytes(storage.join(root, "config.toml"), config.read_bytes())
    wanted = local[-keep:] if keep > 0 else local
    settle(run_dir, root)  # a rollback's set-aside the store did not take then: before a new step_N goes up
    remote = remote_complete(root)
    if any(s > local[-1][0] for s, _ in remote):  # newer than the local newest: abandoned here, kept aside there
        set_aside_remote(root, local[-1][0])
    have = {s for s, _ in remote if s <= local[-1][0]}
    uploaded = []
    for step, path in wanted:
        if step not in have:
            target = storage.join(root, path.name)
            storage.remove_tree(target)  # a partial upload of the same step by a killed run
            try:
                storage.put_tree(path, target, last=("COMPLETE",))
            except FileNotFoundError:  # deleted while uploaded (retention, a rollback): not wanted any more
                storage.remove_tree(target)
                continue
            uploaded.append(path.name)
    # Retention counts what the store holds complete now, as the local one counts local checkpoints: not the local
    # list, which after a fetch onto a new machine lacks the older ones (keep = 0 deleted all of them) and lacks a
    # checkpoint deleted locally while it was uploaded (with keep = 1 that deleted the store's only complete one).
    complete = [s for s, _ in remote_complete(root)]
    keep_steps = set(complete[-keep:] if keep > 0 else complete)
    for name in storage.listdir(root):
        m = _STEP.match(name)
        if m and int(m.group(1)) not in keep_steps:
            storage.remove_tree(storage.join(root, name))
    return uploaded


def fetch_newest(run_dir: Path, root, at: int | None = None) -> str | None:
    """Before a resume: copy ``root``'s newest complete checkpoint into the run directory when the run directory
    has none as new (a fresh machine, a wiped disk; a local one is newer when the store was down at the last
    save); with ``at`` (``--rollback-to``), checkpoint ``step_<at>`` when the run directory lacks it. What a
    rollback here left in the store is set aside there first (:func:`settle`), never fetched. Downloaded into
    ``step_N.tmp`` (swept if killed), then renamed. Rank 0 only.

    Returns: the name fetched, or None. Raises: StoreUnavailable; OSError."""
    settle(run_dir, root)
    remote = remote_complete(root)
    local = list_complete(run_dir)
    if at is not None:
        remote = [(s, url) for s, url in remote if s == at and at not in {s2 for s2, _ in local}]
    elif local and remote and local[-1][0] >= remote[-1][0]:
        return None
    if not remote:
        return None
    step, url = remote[-1]
    final = checkpoint_dir(run_dir) / storage.name(url)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    storage.get_tree(url, tmp)
    if final.exists():  # without a marker (else it would be listed): the remains of a killed save
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return final.name


def open_store(run_dir: Path, root, resume: bool, at: int | None = None) -> str | None:
    """At the start of a run with ``checkpoint.dir`` = ``root`` (nothing when ''); all ranks call it, rank 0
    works. A resume fetches what the run directory lacks (:func:`fetch_newest`; ``at``: the ``--rollback-to``
    step); a fresh run refuses a ``root`` that already holds checkpoints (another run's: its uploads would
    replace them).

    Returns: the name fetched, or None. Raises: TrainError (one line); StoreUnavailable."""
    if not root:
        return None
    error, fetched = "", None
    if _rank() == 0:
        done = remote_complete(root)
        if resume:
            error = claim(run_dir, root, resume)
            fetched = None if error else fetch_newest(run_dir, root, at)
        elif done:
            error = (f"checkpoint.dir {root} already holds checkpoints ({storage.name(done[-1][1])}, ...) of another "
                     "run: continue it with --resume, or choose another checkpoint.dir")
        else:
            try:
                error = claim(run_dir, root, resume)
            except (FileNotFoundError, PermissionError) as e:  # at the start, not at the first upload hours later
                error = (f"checkpoint.dir {root}: cannot write there ({type(e).__name__}: {e}); expected an existing "
                         f"bucket and prefix this run may write to")
    if not _agree(not error):
        raise TrainError(error or f"checkpoint.dir {root}: refused on rank 0")
    return fetched


def run_checkpoints(run_dir: Path, root) -> list[tuple[int, Path | str]]:
    """The complete checkpoints of run ``run_dir`` as ``[(step, path), ...]`` sorted by step: its own, and with
    ``checkpoint.dir`` = ``root`` ('' none) those of the store that it lacks (their URLs; :func:`localize` one to
    read it). For ``replay`` and ``blame``, whose run directory may keep only the metrics.

    Raises: StoreUnavailable; OSError."""
    local = dict(list_complete(run_dir))
    remote = {s: url for s, url in remote_complete(root) if s not in local} if root else {}
    return sorted({**remote, **local}.items())


def localize(path, names: tuple[str, ...] | None = None) -> str | Path:
    """``eval`` / ``export``'s checkpoint argument as a local path: itself when local; for a URL of one
    checkpoint (``.../step_XXXXXXXX``) or of a ``checkpoint.dir`` (its newest complete one), a copy in the
    cache laid out as a run directory (``config.toml`` + ``checkpoints/step_XXXXXXXX``), the checkpoint's
    path returned. Fetched once per checkpoint (the copy is kept while complete). With ``names``, only those
    files and the marker (``blame`` reads the sampler state, not the weights), in ``partial/step_XXXXXXXX``.

    Raises: TrainError: the URL holds no complete checkpoint. StoreUnavailable; OSError."""
    if not storage.is_remote(path):
        return path
    path = str(path).rstrip("/")
    if _STEP.match(storage.name(path)):
        if not storage.isfile(storage.join(path, "COMPLETE")):
            raise TrainError(f"{path}: no COMPLETE marker (an upload cut short, or not a checkpoint)")
        root, url = storage.parent(path), path
    else:
        done = remote_complete(path)
        if not done:
            raise TrainError(f"{path}: no complete checkpoint (no step_XXXXXXXX/COMPLETE); expected a "
                             "checkpoint.dir URL or one checkpoint in it")
        root, url = path, done[-1][1]
    marker = storage.read_bytes(storage.join(url, "COMPLETE"), 16 << 20)
    run = storage.cache_dir() / "runs" / storage.cache_key(root, "run")
    local = run / ("checkpoints" if names is None else "partial") / storage.name(url)
    same = (local / "COMPLETE").is_file() and (local / "COMPLETE").read_bytes() == marker
    if names is not None:  # the files asked for that are not there yet, each written whole, the marker last
        if not same:
            shutil.rmtree(local, ignore_errors=True)
        for n in (*names, "COMPLETE"):
            if not (local / n).is_file() and storage.isfile(storage.join(url, n)):
                atomic_write_bytes(local / n, storage.read_bytes(storage.join(url, n), 1 << 30))
    elif not same:
        shutil.rmtree(local, ignore_errors=True)
        tmp = local.with_name(local.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        storage.get_tree(url, tmp)
        os.replace(tmp, local)
    config = storage.join(root, "config.toml")
    if storage.isfile(config):
        atomic_write_bytes(run / "config.toml", storage.read_bytes(config, 16 << 20))
    return local
