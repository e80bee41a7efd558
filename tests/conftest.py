"""Shared fixtures: a small real-text corpus (Python standard-library sources, present on every
machine that runs these tests) prepared once per session with a real trained BPE tokenizer."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

STDLIB = Path(sysconfig.get_paths()["stdlib"])


# Test files in decreasing order of their run time (measured with --durations on 2 cores): `make test`'s
# `--dist loadfile --no-loadscope-reorder` hands files to the two workers in collection order, so the long
# ones start first and no long file is left to run alone at the end. Files not listed follow in name order.
SLOW_FILES_FIRST = [
    "test_cli.py", "test_recipe_matrix.py",
    "test_parallel_layouts.py", "test_resume.py", "test_restart.py", "test_context_parallel.py",
    "test_recovery.py", "test_health.py", "test_storage.py",
    "test_filters_parity.py", "test_parallel_train.py", "test_data.py", "test_checkpoint_async.py", "test_sdc.py",
    "test_tools_mup.py", "test_watchdog.py", "test_export_sharded.py", "test_train.py", "test_tools_plan.py",
    "test_tokenizer.py", "test_probe.py", "test_eval_parallel.py", "test_scale.py", "test_stage_layout.py",
    "test_sweep_parallel.py",
]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


def pytest_sessionfinish(session, exitstatus):
    import forked

    forked.stop()


def small_config(tmp: Path, shards_dir: Path, **overrides):
    """A seconds-scale config over two stdlib sources with a 3-stage table (main, anneal, long); fp32, so
    that code paths compared by the tests (ranks, layouts, resumes) agree to fp32 precision."""
    from densetrain.config import load_config

    base = {
        "data.demo_corpus": False,
        "data.corpus_dir": str(STDLIB),
        "data.shards_dir": str(shards_dir),
        "data.tokenizer": "bpe",
        "data.tokenizer_vocab_size": 512,
        "data.val_fraction": 0.1,
        "data.sources": [
            {"name": "email", "kind": "code", "paths": ["email"], "format": "text"},
            {"name": "json", "kind": "code", "paths": ["json", "http"], "format": "text"},
        ],
        "stages": [
            {"name": "main", "start": 0.0, "mix": {"email": 0.5, "json": 0.5}},
            {"name": "anneal", "start": 0.5, "mix": {"email": 1.0}},
            {"name": "long_context", "start": 0.8, "seq_len": 64, "rope_theta": 100000.0},
        ],
        "model.vocab_size": 512, "model.d_model": 64, "model.n_layers": 2, "model.n_heads": 4,
        "model.n_kv_heads": 2, "model.d_ff": 128,
        "train.run_dir": str(tmp / "run"), "train.steps": 10, "train.seq_len": 32, "train.batch_size": 8,
        "train.micro_batch_size": 2, "train.threads": 1, "train.dtype": "fp32",
        "optim.peak_lr": 3e-3, "optim.min_lr": 3e-4, "schedule.warmup_steps": 2,
        "checkpoint.every": 5, "checkpoint.keep": 2, "eval.every": 5, "eval.max_batches": 2,
        "logging.mfu_every": 2, "logging.peak_flops": 1e11, "eval.tasks": "", "eval.final_tasks": "",
        "health.every": 0,  # no hardware checks (~0.4-0.6 s a run); tests/test_health.py turns them on
    }
    base.update(overrides)
    return load_config(preset="tiny", overrides=list(base.items()))


@pytest.fixture(scope="session")
def prepared(tmp_path_factory, request):
    """(shards_dir, config factory) with the two stdlib sources tokenized once: once per pytest run, the
    xdist workers sharing one copy in their common temporary directory (the first one to get the lock
    prepares it; tests only read it)."""
    import fcntl

    from densetrain.data.prepare import prepare

    if hasattr(request.config, "workerinput"):  # an xdist worker: basetemp is <run's dir>/popen-gwN
        root = tmp_path_factory.getbasetemp().parent / "prepared"
        root.mkdir(exist_ok=True)
    else:
        root = tmp_path_factory.mktemp("prepared")
    shards = root / "shards"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "done").exists():
            prepare(small_config(root, shards))
            (root / "done").touch()
    return shards, lambda tmp, **ov: small_config(tmp, shards, **ov)


def tiny_eval_model(vocab_size: int):
    """The model of the distributed evaluation tests: seeded, so every process builds the same weights."""
    import torch

    from densetrain.config import ModelConfig
    from densetrain.model.llama import Transformer

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=vocab_size, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)
    return Transformer(cfg).double()


_EVAL_WORKER = r"""
import importlib, json, os, sys, torch, torch.distributed as dist
root, tokenizer_file, call, call_args, out = sys.argv[1:]
sys.path[:0] = [root, os.path.join(root, "tests")]
from densetrain.data.tokenizer import Tokenizer
from conftest import tiny_eval_model
torch.set_num_threads(1)
if int(os.environ["WORLD_SIZE"]) > 1:
    dist.init_process_group("gloo")
module, name = call.split(":")
args, kwargs = json.loads(call_args)
tok = Tokenizer.from_file(tokenizer_file)
res = getattr(importlib.import_module(module), name)(tiny_eval_model(tok.vocab_size), tok, *args, **kwargs)
with open(f"{out}.{os.environ['RANK']}", "w") as f:
    json.dump(res, f)
if dist.is_initialized():
    dist.destroy_process_group()
"""


def gloo_env(world: int) -> dict:
    """Environment of a ``world``-rank gloo job with env:// rendezvous on a free local port, one thread per
    rank; each rank adds ``RANK`` and ``LOCAL_RANK``."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1"}


@pytest.fixture
def tmpfs(tmp_path):
    """A 2 MiB tmpfs mounted at a fresh directory (needs root and mount rights; skips without them)."""
    import subprocess

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root and CAP_SYS_ADMIN; this machine has neither")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def run_script_ranks(source: str, tmp: Path, name: str, world: int = 2, timeout: int = 120,
                     args: tuple[str, ...] = ()) -> Path:
    """Write ``source`` to ``tmp/name.py`` and run it as ``world`` ranks of one gloo job (:func:`gloo_env`),
    each with argv ``[repo root, *args, out]``; assert every rank exits 0 (their stderr tails otherwise). Returns
    ``out`` (``tmp/name``): rank r writes its results to ``out.r``."""
    import sys

    import forked

    script, out = tmp / f"{name}.py", tmp / name
    script.write_text(source)
    env = gloo_env(world)
    procs = [forked.Popen([sys.executable, str(script), str(Path(__file__).resolve().parents[1]), *args, str(out)],
                          env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stderr=forked.PIPE, text=True)
             for r in range(world)]
    errs = [p.communicate(timeout=timeout)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(e[-3000:] for e in errs)
    return out


def start_eval_ranks(call: str, tokenizer_file: str, args: list, kwargs: dict, tmp: Path, world: int = 2):
    """Start ``world`` processes, ranks of one gloo torch.distributed job (env:// rendezvous on a free
    local port, one thread each), that each return ``call(tiny_eval_model(V), tokenizer, *args, **kwargs)``
    (``call`` is ``'module:function'``; args and kwargs JSON values). Returns ``collect()``: waits for
    the ranks, asserts they succeeded, and returns each rank's result (JSON-decoded), rank order."""
    import json
    import sys

    import forked

    script, out = tmp / "eval_worker.py", tmp / "eval_result"
    script.write_text(_EVAL_WORKER)
    env = gloo_env(world)
    argv = [sys.executable, str(script), str(Path(__file__).resolve().parents[1]), str(tokenizer_file), call,
            json.dumps([args, kwargs]), str(out)]
    procs = [forked.Popen(argv, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(world)]

    def collect() -> list:
        assert all(p.wait(timeout=120) == 0 for p in procs)
        return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]

    return collect


def crosscheck_module():
    """``benchmarks/eval_crosscheck.py`` imported as a module (the olmo_eval reference and its helpers)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "eval_crosscheck.py"
    spec = importlib.util.spec_from_file_location("eval_crosscheck", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def one_source_config(tmp: Path, shards_dir: Path, **overrides):
    """:func:`small_config` cut to a seconds-scale ``prepare``: the ``email`` stdlib package alone,
    tokenized with tiktoken's gpt2 (no BPE to train), no decontamination index, one worker."""
    base = {"data.sources": [{"name": "email", "kind": "code", "paths": ["email"], "format": "text"}],
            "stages": [{"name": "main", "start": 0.0}], "data.tokenizer": "gpt2", "model.vocab_size": 50304,
            "data.decontam.enabled": False, "data.workers": 1}
    return small_config(tmp, shards_dir, **{**base, **overrides})


@pytest.fixture(scope="session")
def stopped_run(prepared, tmp_path_factory):
    """(run dir, config) of a run stopped after step 3 of 4 with checkpoints of steps 2 and 3 (read only: copy
    it before crafting files in it)."""
    from densetrain.train import train

    _, make = prepared
    tmp = tmp_path_factory.mktemp("stopped")
    cfg = make(tmp, **{"train.steps": 4, "checkpoint.every": 2, "checkpoint.keep": 0, "eval.every": 0,
                       "logging.tensorboard": False, "stages": [{"name": "main", "start": 0.0}]})
    train(cfg, stop_after=3)
    return tmp / "run", cfg


def forge_marker(ckpt: Path) -> None:
    """Rewrite checkpoint ``ckpt``'s completion marker with the digests of its files as they are now, as a
    forger would (the digests find damage, not intent): tests of crafted files reach the validation behind."""
    import json

    from densetrain.dcp_read import hash_file, read_marker

    files = {p.name: hash_file(p) for p in sorted(ckpt.iterdir()) if p.is_file() and p.name != "COMPLETE"}
    (ckpt / "COMPLETE").write_text(json.dumps({"step": read_marker(ckpt)["step"], "hash": "xxh3_64", "files": files}))
