"""Datatrove-tokenized folders (``format = "datatrove"`` sources): the check of the token files before
training on them (:func:`check_datatrove_folder`) and their registration as a prepared source
(:func:`register_datatrove_source`). Pure Python: reading the folder needs no datatrove; writing it
is :mod:`densetrain.data.prepare.scale.pipeline` (docs/scale-out.md).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from densetrain.data.prepare.manifest import PREPARE_VERSION, fingerprint, log, up_to_date
from densetrain.data.shards import TokenFiles, sha256_file, token_dtype
from densetrain.data.tokenizer import Tokenizer
from densetrain.errors import DataError
from densetrain.fileio import MAX_CONFIG_BYTES, atomic_write_json, read_json, read_text_bounded

IDENTITY_FILE = "tokenizer.identity.json"
"""Written next to ``train/`` by :class:`TokenizeStep`: the tokenizer's :meth:`Tokenizer.identity`,
so a folder is matched to ``data.tokenizer`` by content hash, wherever the tokenizer file was."""


def datatrove_split_dirs(folder: Path) -> dict[str, Path | None]:
    """``{'train': dir, 'val': dir or None}`` of a tokenized folder.

    With a ``train/`` subfolder (what :func:`datatrove_pipeline` writes): ``train/`` and, when it
    holds ``.ds`` files, ``val/``. Otherwise the folder itself is the train split (plain
    ``DocumentTokenizer`` output) and there is no validation split.
    """
    if (folder / "train").is_dir():
        val = folder / "val"
        return {"train": folder / "train", "val": val if val.is_dir() and any(val.glob("*.ds")) else None}
    return {"train": folder, "val": None}


def _same_tokenizer(name: str, tok: Tokenizer, spec: str) -> bool:
    """Whether a ``.ds.metadata`` tokenizer name denotes ``tok``: the same name or spec, the same
    resolved path, or a readable file with the same sha256."""
    if name in (tok.name, spec):
        return True
    p = Path(name).expanduser()
    try:
        return p.is_file() and (p.resolve() == Path(tok.name).resolve() or sha256_file(p) == tok.sha256)
    except OSError:
        return False


def _check_files(d: Path, tok: Tokenizer, spec: str, vocab_size: int, identity_ok: bool) -> dict:
    files = sorted(f for f in d.glob("*.ds") if f.is_file() and not f.name.startswith("."))
    if not files:
        raise DataError(f"{d}: no .ds token files (format 'datatrove')")
    for f in files:
        meta, idx = f.with_name(f.name + ".metadata"), f.with_name(f.name + ".index")
        if not meta.is_file():
            raise DataError(f"{meta}: missing; without it the tokenizer cannot be checked (datatrove writes it)")
        if not idx.is_file():
            raise DataError(f"{idx}: missing; the document boundaries are needed (DocumentTokenizer save_index=True)")
        lines = read_text_bounded(meta, MAX_CONFIG_BYTES, errors="replace").splitlines()  # one short line
        name, _, size = (lines[0] if lines else "").rpartition("|")
        if size.strip() not in ("2", "4"):
            raise DataError(f"{meta}:1: expected '<tokenizer>|<2 or 4>', got '{lines[0] if lines else ''}'")
        if not identity_ok and not _same_tokenizer(name, tok, spec):
            raise DataError(f"{meta}:1: tokenized with '{name}' but data.tokenizer is '{spec}' ({tok.name}); "
                            "set data.tokenizer to the tokenizer that made these files")
        n = f.stat().st_size // int(size)
        if len(lines) > 1 and lines[1].strip().isdigit() and int(lines[1]) != n:
            raise DataError(f"{meta}:2: token count {int(lines[1])} but {f.name} holds {n} tokens (truncated?)")
    stream = TokenFiles(files)  # token sizes agree, index ends increase up to each file's size
    stream.check_vocab(vocab_size)
    shards = []
    # The document ends and token maps TokenFiles has already read and checked, file by file.
    for f, ends, tokens in zip(files, stream._ends, stream._maps):
        idx = f.with_name(f.name + ".index")
        if ends.size:
            # Every document must end with our EOS (DocumentTokenizer eos_token=...): without it the
            # model would never see where one document ends. The first 65536 per file are read.
            last = tokens[ends[: 1 << 16] - 1]
            bad = np.flatnonzero(last != tok.eos_id)
            if bad.size:
                raise DataError(f"{f}: document {int(bad[0])} does not end with EOS id {tok.eos_id} ({tok.eos_token}); "
                                "tokenize with DocumentTokenizer(eos_token=...)")
        shards.append({"path": str(f), "tokens": int(ends[-1]) if ends.size else 0, "documents": int(ends.size),
                       "index_sha256": sha256_file(idx)})
    return {"tokens": len(stream), "documents": stream.n_docs, "token_size": stream.token_size, "shards": shards}


def check_datatrove_folder(folder: str | Path, tok: Tokenizer, spec: str, vocab_size: int,
                           key: str = "data.sources") -> dict:
    """Check a datatrove-tokenized folder before training on it.

    Checks, per split (:func:`datatrove_split_dirs`): every ``.ds`` has a ``.ds.metadata`` (token
    size 2 or 4, token count = file size) and a ``.ds.index`` consistent with it; the tokenizer is
    ``tok`` (``IDENTITY_FILE`` sha256 when present, else the metadata's tokenizer name: the same
    name/path or a file with the same sha256); every id < ``vocab_size``
    (:meth:`TokenFiles.check_vocab`); documents end with ``tok.eos_id`` (the first 65536).

    Args:
        folder: the tokenized folder.
        tok: the tokenizer of ``data.tokenizer``; spec: ``data.tokenizer`` as written.
        vocab_size: ``model.vocab_size``.
        key: config key for messages.

    Returns:
        ``{'train': {'dir', 'tokens', 'documents', 'token_size', 'shards'}, 'val': {...} or None}``.

    Raises:
        DataError: one line naming the file (and line of a metadata file) and what is wrong.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{folder}: no such folder of datatrove token files ({key}.paths)")
    identity_ok = False
    ident = folder / IDENTITY_FILE
    if ident.is_file():
        try:
            sha = read_json(ident).get("sha256")  # a few hundred bytes: a regular file of <= 16 MiB
        except (OSError, ValueError, AttributeError) as e:
            raise DataError(f"{ident}: unreadable ({type(e).__name__})") from None
        if sha != tok.sha256:
            raise DataError(f"{ident}: tokenized with tokenizer sha256 {str(sha)[:12]} but data.tokenizer='{spec}' "
                            f"has {tok.sha256[:12]}")
        identity_ok = True
    out = {}
    for split, d in datatrove_split_dirs(folder).items():
        if d is not None:
            out[split] = {"dir": str(d.resolve()), **_check_files(d, tok, spec, vocab_size, identity_ok)}
        else:
            out[split] = None
    return out


def register_datatrove_source(i, src, cfg, tok: Tokenizer, corpus_dir: Path, shards_dir: Path, force: bool) -> dict:
    """Check a folder of datatrove token files and describe it in ``<source>/manifest.json``.

    Nothing is copied or re-tokenized: training reads the folder in place (the split ``dir`` and
    shard ``path`` entries are absolute). The folder is ``src.paths[0]`` (relative to
    ``data.corpus_dir``). Splits: ``train/`` and ``val/`` subfolders as written by
    :func:`densetrain.data.prepare.scale.pipeline.datatrove_pipeline`; otherwise the whole folder is train and the
    source has no val split (it is left out of the validation loss). Checks:
    :func:`check_datatrove_folder` (metadata, index, tokenizer identity,
    ids < model.vocab_size, EOS). Skipped when the files (size, mtime), the tokenizer and
    model.vocab_size are unchanged; unlike our own shards, no sha256 of the .ds files is taken
    (only of the indexes): the files are the producer's, and a full read is already spent on the
    vocabulary check.

    Raises:
        DataError: one line naming the file and the problem.
    """
    key = f"data.sources[{i}]"
    folder = Path(os.path.expanduser(src.paths[0]))
    folder = (folder if folder.is_absolute() else corpus_dir / folder).resolve()
    src_dir = shards_dir / src.name
    manifest_path = src_dir / "manifest.json"
    if not folder.is_dir():
        raise DataError(f"{folder}: not a folder of datatrove token files ({key}.paths, format 'datatrove')")
    files = [f for d in datatrove_split_dirs(folder).values() if d is not None for f in sorted(d.iterdir())
             if f.name.endswith((".ds", ".ds.index", ".ds.metadata"))]
    files += [folder / IDENTITY_FILE] if (folder / IDENTITY_FILE).is_file() else []
    inputs = fingerprint(files, corpus_dir)
    params = {"prepare_version": PREPARE_VERSION, "format": "datatrove", "folder": str(folder),
              "model_vocab_size": cfg.model.vocab_size}
    if not force and (prev := up_to_date(src_dir, tok, inputs, params)) is not None:
        log(f"{src.name}: up to date (datatrove folder, {prev['splits']['train']['tokens']:,} train tokens)")
        return {"status": "up-to-date", "manifest": prev}
    if manifest_path.exists():
        manifest_path.unlink()
    checked = check_datatrove_folder(folder, tok, cfg.data.tokenizer, cfg.model.vocab_size, key)
    splits = {split: ({k: c[k] for k in ("dir", "tokens", "documents", "shards")} if c else
                      {"dir": split, "tokens": 0, "documents": 0, "shards": []})
              for split, c in checked.items()}
    token_size = checked["train"]["token_size"]
    documents = sum(sp["documents"] for sp in splits.values())
    manifest = {
        "format_version": 1,
        "source": {"name": src.name, "kind": src.kind, "long_docs": src.long_docs, "paths": list(src.paths),
                   "format": src.format},
        "tokenizer": tok.identity(),
        "token_size": token_size,
        "dtype": token_dtype(token_size).name,
        "layout": "datatrove folder registered in place: <dir>/*.ds read in sorted name order as one stream per "
                  "split; .ds.index = uint64 LE cumulative document ends; EOS ends every document",
        "params": params,
        "inputs": inputs,
        "splits": splits,
        "stats": {"documents_read": documents, "documents_kept": documents, "registered": True},
    }
    src_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(manifest_path, manifest)
    log(f"{src.name}: registered datatrove folder {folder}: {splits['train']['tokens']:,} train / "
        f"{splits['val']['tokens']:,} val tokens, {documents:,} documents")
    return {"status": "registered", "manifest": manifest}
