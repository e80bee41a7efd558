"""Opening the prepared token streams of a config for training or evaluation, with the checks that
keep a run from training on the wrong data (missing shards, another tokenizer, changed files)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from densetrain.config import Config
from densetrain.data.shards import TokenFiles, check_shard_hashes
from densetrain.data.tokenizer import load_tokenizer
from densetrain.errors import DataError
from densetrain.fileio import MAX_JSON_BYTES
from densetrain.storage import canonical, exists, isfile, join, parent, read_json, stat
from densetrain.storage import name as file_name


def _manifest(path) -> dict:
    """A manifest written by ``densetrain prepare``: a regular file (fileio's bounded read) holding a JSON
    object. Raises: DataError, one line naming the file."""
    try:
        info = read_json(path, MAX_JSON_BYTES)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}; re-run "
                        "`densetrain prepare`") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read the manifest ({e})") from None
    if not isinstance(info, dict):
        raise DataError(f"{path}: expected a JSON object (a prepare manifest), got {type(info).__name__}")
    return info

def open_streams(cfg: Config, split: str) -> dict[str, TokenFiles]:
    """Token streams of the configured sources for ``split`` ('train' or 'val').

    Sources that ``prepare`` found empty (e.g. the demo's Debian sources on a machine without apt)
    are left out; the stage mixes drop them (see :func:`densetrain.schedule.resolve_stages`).

    Raises:
        DataError: shards are missing (``densetrain prepare`` not run), were made with another
            tokenizer, were edited after it (sha256, checked where the mtime changed), or the
            tokenizer's vocabulary is larger than model.vocab_size.
    """
    root = join(cfg.data.shards_dir)  # a local path or a URL (densetrain.storage)
    manifest = join(root, "manifest.json")
    if not exists(manifest):
        raise DataError(f"{manifest}: no prepared data; run `densetrain prepare` with the same config first")
    info = _manifest(manifest)
    tok = info.get("tokenizer", {})
    if tok.get("vocab_size", 0) > cfg.model.vocab_size:
        raise DataError(
            f"{manifest}: tokenizer vocab_size {tok['vocab_size']} > model.vocab_size {cfg.model.vocab_size}"
        )
    _check_tokenizer_identity(cfg, manifest, tok)
    prepared = info.get("sources", {})
    streams = {}
    for src in cfg.data.sources:
        if src.name not in prepared:
            raise DataError(f"{manifest}: source '{src.name}' was not prepared; re-run `densetrain prepare`")
        sub = join(root, prepared[src.name].get("manifest", f"{src.name}/manifest.json"))
        sub_manifest = _manifest(sub) if isfile(sub) else {}
        if sub_manifest:
            sub_sha = sub_manifest.get("tokenizer", {}).get("sha256")
            if tok.get("sha256") and sub_sha and sub_sha != tok["sha256"]:
                raise DataError(f"{sub}: source '{src.name}' was tokenized with tokenizer {sub_sha[:12]}, the other "
                                 f"sources with {tok['sha256'][:12]}; re-run `densetrain prepare`")
        entry = prepared[src.name].get(split, {})
        if entry.get("tokens", 0) == 0:
            continue
        # "dir" is relative to shards_dir, or absolute for a registered datatrove folder (read in place).
        where = entry.get("dir", f"{src.name}/{split}")
        stream = TokenFiles(where if str(where).startswith("/") else join(root, where))
        if len(stream) != entry["tokens"]:
            raise DataError(f"{parent(stream.files[0])}: {len(stream)} tokens but the manifest says {entry['tokens']}; "
                             f"the shards changed after `densetrain prepare`; re-run it")
        # Ids edited in place keep every size: the sha256s catch them (a stat per file unless one changed).
        shards = sub_manifest.get("splits", {}).get(split, {}).get("shards", [])
        check_shard_hashes(parent(sub), shards, sub)
        # An id past the embedding table would index out of bounds mid-run (or silently on GPU). A shard the
        # sha256 check vouched for (it has a sha256 and an mtime now) is what prepare wrote: its recorded
        # largest id answers without reading it; others (older manifests, datatrove folders) are read.
        known = {canonical(join(parent(sub), sh["path"])): sh["max_token"] for sh in shards
                 if "max_token" in sh and "sha256" in sh and "mtime_ns" in sh}
        stream.check_vocab(cfg.model.vocab_size, [known.get(canonical(f)) for f in stream.files])
        streams[src.name] = stream
    if not streams:
        raise DataError(f"{manifest}: no source has {split} tokens")
    return streams


def data_fingerprint(streams: dict[str, TokenFiles]) -> dict[str, str]:
    """Per source, a short hash of its train shard files (names, sizes, modification times): saved in
    checkpoints so that a resume notices shards rewritten underneath the sampler's positions."""
    out = {}
    for name, stream in streams.items():
        h = hashlib.sha256()
        for f in stream.files:
            size, version = stat(f)  # mtime_ns locally, the ETag of an object
            h.update(f"{file_name(f)}:{size}:{version}\n".encode())
        out[name] = h.hexdigest()[:16]
    return out


def _check_tokenizer_identity(cfg: Config, manifest: Path, tok: dict) -> None:
    """The tokenizer ``data.tokenizer`` names must be the one the shards were made with: the same content
    (sha256 of its definition), whatever it is called; token ids from another vocabulary would train
    silently on garbage.

    The same spec as the manifest's is taken as is (a trained BPE lives next to the shards); another spec
    naming the same content is accepted (``densetrain import-hf`` names the shards' BPE by the copy of its
    tokenizer.json in the run directory; a run saves a tokenizer path made absolute). A manifest without a
    sha256 (older shards) can only be matched by its spec.

    Raises:
        DataError: one line naming the manifest, both specs or both sha256s.
    """
    spec, want = tok.get("spec"), cfg.data.tokenizer
    same_spec = spec in (None, want)  # None: a manifest older than the spec field
    if same_spec and (want == "bpe" or not tok.get("sha256")):
        return
    if not same_spec and (want == "bpe" or not tok.get("sha256")):  # 'bpe' here: no tokenizer.json of its own
        raise DataError(f"{manifest}: shards were tokenized with '{spec}' but data.tokenizer is '{want}'"
                        + ("" if want == "bpe" else " (the manifest has no sha256 to compare them by)"))
    have = load_tokenizer(cfg.data.tokenizer, cfg.data.shards_dir).sha256
    if have != tok["sha256"]:
        raise DataError(f"{manifest}: shards were tokenized with tokenizer sha256 {tok['sha256'][:12]} but "
                         f"data.tokenizer='{cfg.data.tokenizer}' has {have[:12]}; re-run `densetrain prepare`")
