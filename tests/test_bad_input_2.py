"""Bad input, second round (issue 37): numbers that pass a ``> 0`` check but are not numbers (inf, nan),
sizes that would never finish building, files that are not files (a link to /dev/zero, a FIFO) or nest
too deeply, a tokenizer that panics, a W&B that is not logged in, a shard id past the vocabulary, and
errors of ranks other than 0. Each is one line naming the key or file, exit status 2."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import small_config

from densetrain.cli import main
from densetrain.config import Config, ModelConfig
from densetrain.data.shards import TokenFiles, write_shard
from densetrain.data.tokenizer import Tokenizer
from densetrain.errors import ConfigError, DataError
from densetrain.hf import export_hf
from densetrain.model.llama import Transformer


def _run(capsys, *argv: str) -> str:
    """stderr of ``densetrain argv`` run in this process, checked to be one error line with exit 2."""
    with _deadline(30):  # a read that blocks (a FIFO) or a loop that never ends fails instead of hanging
        rc = main(list(argv))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("densetrain: error: "), (rc, err)
    return err


class DeadlineExpired(BaseException):
    """A block of :func:`_deadline` ran too long. Not an Exception (TimeoutError is an OSError): no reader's
    ``except OSError`` / ``except Exception`` can swallow it and let a reader that waited pass."""


@contextlib.contextmanager
def _deadline(seconds: int):
    def expired(*_):
        raise DeadlineExpired(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# --------------------------------------------------------------------------------------------------
# 37.2: every number validated
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("override, expected", [
    ("model.norm_eps=nan", "model.norm_eps must be a finite number, got nan"),
    ("optim.eps=inf", "optim.eps must be a finite number, got inf"),
    ("model.logit_softcap=inf", "model.logit_softcap must be a finite number, got inf"),
    ("stages.0.lr_mult=inf", "stages[0].lr_mult must be a finite number, got inf"),
    ("optim.weight_decay=inf", "optim.weight_decay must be a finite number, got inf"),
    ("model.rope_theta=inf", "model.rope_theta must be a finite number, got inf"),
    ("model.rope_scaling.factor=inf", "model.rope_scaling.factor must be a finite number, got inf"),
    ("model.rope_scaling.attention_factor=nan", "model.rope_scaling.attention_factor must be a finite number"),
    ("stages.0.mix={web = inf}", "stages[0].mix.web must be a finite number, got inf"),
    ("guard.spike_zscore=-inf", "guard.spike_zscore must be a finite number, got -inf"),
    ('train.run_dir=""', "train.run_dir must name a directory, got ''"),
    ("data.max_val_tokens=-1", "data.max_val_tokens must be >= 0, got -1"),
    ("train.seed=-1", "train.seed must be in [0, 2**64), got -1"),
    ("train.seed=18446744073709551616", "train.seed must be in [0, 2**64), got 18446744073709551616"),
    ("data.seed=-7", "data.seed must be in [0, 2**64), got -7"),
    ("logging.peak_flops=-1.0", "logging.peak_flops must be >= 0 (0 measures it), got -1.0"),
    ("model.d_ff=1000000000000", "model: 1.54e+15 parameters (vocab_size 8192, d_model 128, n_layers 4, d_ff "
                                 "1000000000000) exceed the limit of 1e+13"),
])
def test_a_value_that_passes_a_comparison_but_breaks_a_run_is_one_line(capsys, override, expected):
    err = _run(capsys, "train", "--preset", "tiny", "--dry-run", f"--{override}")
    assert expected in err, err


@pytest.mark.parametrize("argv, expected", [
    (["train", "--preset", "tiny", "--dry-run", "--parallel.timeout_s=1e30"],
     "parallel.timeout_s must be a number of seconds in (0, 604800] (a week), got 1e+30"),
    (["train", "--preset", "tiny", "--dry-run", "--health.copy_mib=1000000000"],
     "health: need seconds in (0, 60], trials in [1, 100], copy_mib in [1, 65536]"),
    (["train", "--preset", "tiny", "--dry-run", "--world-size", "0"],
     "--world-size: expected a number of processes >= 1, got 0"),
    # A stage's layout inherits dp_replicate = -1 from [parallel]: the message named neither key (a dict of the
    # merged degrees); a --rank outside a plain run's one process did not say why the world was 1.
    (["train", "--preset", "tiny", "--dry-run", "--stages.0.parallel={cp=-1}"],
     "stage 'main': parallel.dp_replicate (inherited from [parallel]) and stages[0].parallel.cp are both -1"),
    (["train", "--preset", "tiny", "--dry-run", "--parallel.cp=-1", "--parallel.tp=-1"],
     "parallel.dp_replicate and parallel.cp and parallel.tp are all -1: at most one degree may be -1"),
    (["train", "--preset", "tiny", "--dry-run", "--rank", "1"],
     "--rank: 1 is not a rank of --world-size 1 (no --world-size or WORLD_SIZE given: a plain run is one process)"),
    # Found trying object storage as a user: a URL where only a local folder works, or with one slash or a capital
    # protocol, became a local folder named 's3:' (the log said "uploaded to s3:/...") or a ValueError traceback.
    (["train", "--preset", "tiny", "--dry-run", "--train.run_dir=s3://b/runs/x"],
     "train.run_dir must be a local directory (logs, metrics, the checkpoints' staging), got the URL 's3://b/runs/x'"),
    (["train", "--preset", "tiny", "--dry-run", "--checkpoint.dir=s3:/b/ck"],
     "checkpoint.dir = 's3:/b/ck' looks like a URL with one slash after 's3:'; expected 's3://...'"),
    (["train", "--preset", "tiny", "--dry-run", "--data.shards_dir=S3://b/shards"],
     "data.shards_dir = 'S3://b/shards': fsspec protocols are lower case, expected 's3://...'"),
    (["train", "--preset", "tiny", "--dry-run", "--data.shards_dir=file:///data/shards"],  # was a folder 'file:'
     "data.shards_dir = 'file:///data/shards': give a local folder as its path ('/data/shards'), not a file:// URL"),
    (["train", "--resume", "s3://b/run"],
     "--resume s3://b/run: RUN_DIR is the local run directory (its checkpoints may live at checkpoint.dir's URL)"),
    # --resume with --config or --preset: the file was read and silently ignored (the run's config.toml wins)
    (["train", "--preset", "tiny", "--resume", "runs/x"],
     "--resume runs/x continues the run's own config.toml; drop --preset tiny (change keys with --key=value flags"),
    # Two stages of one name: the run's state and its events name the stage, so a resume or the loss guard could
    # not tell them apart (found by the recovery sweep).
    (["train", "--preset", "tiny", "--dry-run", "--stages.1.name=main"],
     "stages[1].name 'main' is already the name of an earlier stage; names must be unique"),
    (["ladder", "--preset", "tiny", "--sizes", "32,64", "--budgets", "nan", "--out", "unused"],
     "argument --budgets: expected comma-separated FLOP budgets, got 'nan'"),
    (["ladder", "--preset", "tiny", "--sizes", "32,64", "--budgets", "inf", "--out", "unused"],
     "argument --budgets: expected comma-separated FLOP budgets, got 'inf'"),
])
def test_an_absurd_value_of_a_new_key_or_flag_is_one_line(capsys, argv, expected):
    # Before: a timeout of 1e30 s overflowed torch's timedelta at launch, a 1 PiB copy buffer was accepted,
    # --world-size 0 was ignored (exit 0), and --budgets nan / inf were tracebacks (int(nan), int(inf)).
    if argv[0] == "ladder":  # its own argparse parser: a bad flag ends in SystemExit(2), as on the command line
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("densetrain: error: "), err
    else:
        err = _run(capsys, *argv)
    assert expected in err, err


def test_a_preset_override_of_a_hundred_million_layers_is_refused_at_once(capsys):
    err = _run(capsys, "train", "--preset", "tiny", "--dry-run", "--model.n_layers=100000000")
    assert "model.n_layers must be at most 1000" in err and "got 100000000" in err, err
    err = _run(capsys, "train", "--preset", "tiny", "--dry-run", "--model.vocab_size=10000000000000")
    assert "model: 2.56e+15 parameters (vocab_size 10000000000000" in err, err


@pytest.fixture
def hf_dir(tmp_path) -> Path:
    """A real (untrained) Llama export: config.json + model.safetensors."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)
    torch.manual_seed(0)
    return export_hf(Transformer(cfg), cfg, tmp_path / "hf")


def _edit(path: Path, change) -> None:
    conf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(change(conf)))


@pytest.mark.parametrize("change, expected", [
    ({"num_hidden_layers": 10**8}, "model.n_layers must be at most 1000 (the deepest published transformer"),
    ({"rms_norm_eps": float("nan")}, "model.norm_eps must be a finite number, got nan"),
    ({"initializer_range": float("inf")}, "model.init_std must be a finite number, got inf"),
])
def test_import_hf_of_an_impossible_size_or_a_non_finite_number(hf_dir, tmp_path, capsys, change, expected):
    _edit(hf_dir, lambda c: {**c, **change})
    err = _run(capsys, "import-hf", str(hf_dir), "--out", str(tmp_path / "run"))
    assert f"{hf_dir / 'config.json'}: " in err and expected in err, err
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------------------------------
# 37.3: bounded, regular reads
# --------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _memory_cap(extra: int = 1 << 30):
    """Address space capped at its current size + ``extra`` bytes while the block runs: a reader that reads
    /dev/zero to its end fails with MemoryError here instead of exhausting the machine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    used = int(next(line for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith("VmSize:")).split()[1]) << 10
    resource.setrlimit(resource.RLIMIT_AS, (used + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _not_a_file(tmp_path: Path, kind: str, name: str) -> Path:
    path = tmp_path / name
    if kind == "zero":
        path.symlink_to("/dev/zero")
    else:
        os.mkfifo(path)
    return path


@pytest.mark.parametrize("kind, expected", [("zero", "is a character device, expected a regular file "
                                                     "(a link to /dev/zero)"),
                                            ("fifo", "is a FIFO, expected a regular file")])
def test_a_config_that_is_not_a_regular_file(tmp_path, capsys, kind, expected):
    path = _not_a_file(tmp_path, kind, "c.toml")
    with _memory_cap():
        err = _run(capsys, "train", "--config", str(path))
    assert f"{path}: {expected}" in err, err


def test_a_config_larger_than_any_config_is_refused_before_it_is_read(tmp_path, capsys):
    big = tmp_path / "big.toml"
    with open(big, "wb") as f:
        f.truncate(17 << 20)  # sparse: 17 MiB of size, nothing written
    err = _run(capsys, "train", "--config", str(big))
    assert f"{big}: 17825792 bytes, larger than the 16777216-byte limit for this file" in err, err


@pytest.mark.parametrize("kind", ["zero", "fifo"])
def test_import_hf_of_a_config_json_that_is_not_a_regular_file(hf_dir, tmp_path, capsys, kind):
    (hf_dir / "config.json").unlink()
    path = _not_a_file(hf_dir, kind, "config.json")
    with _memory_cap():
        err = _run(capsys, "import-hf", str(hf_dir), "--out", str(tmp_path / "run"))
    assert f"{path}: is a " in err and "expected a regular file" in err, err


def test_nesting_deeper_than_the_parsers_follow_is_one_line(hf_dir, tmp_path, capsys):
    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / "deep.toml").write_text(f"[train]\nsteps = {deep}\n")
    err = _run(capsys, "train", "--config", str(tmp_path / "deep.toml"))
    assert f"{tmp_path / 'deep.toml'}: nested too deeply" in err, err
    assert "nested too deeply" in _run(capsys, "train", "--preset", "tiny", "--dry-run", f"--train.steps={deep}")
    (hf_dir / "config.json").write_text(f'{{"model_type": "llama", "x": {deep}}}')
    err = _run(capsys, "import-hf", str(hf_dir), "--out", str(tmp_path / "run"))
    assert f"{hf_dir / 'config.json'}: nested too deeply" in err, err


# Run files, logs, HF side files, task data: every reader a user or a crafted run dir can point at.

@pytest.fixture
def fifo():
    """``fifo(path)`` makes a FIFO at ``path``. A reader that blocks on it (a regression; inside a Rust library
    that holds the GIL no Python signal or thread reaches it) is released after 20 s: a separate process then
    opens and closes the write end, so the reader sees end-of-file and the test fails instead of hanging the
    suite. The processes are ended with the test."""
    procs = []

    def make(path: Path) -> Path:
        os.mkfifo(path)
        procs.append(subprocess.Popen(["sh", "-c", 'sleep 20; exec timeout 20 sh -c \': > "$0"\' "$1"', "sh",
                                       str(path)], start_new_session=True))
        return path

    yield make
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _crafted(stopped_run, tmp_path: Path) -> Path:
    """A copy of the tiny real run of ``stopped_run`` (conftest) to craft files in."""
    run = tmp_path / "run"
    shutil.copytree(stopped_run[0], run)
    return run


@pytest.mark.parametrize("name, kind, expected", [
    ("metrics.jsonl", "fifo", "is a FIFO, expected a regular file"),
    ("events.jsonl", "zero", "is a character device, expected a regular file (a link to /dev/zero)"),
    ("summary.json", "fifo", "is a FIFO, expected a regular file"),
])
def test_report_of_a_run_file_that_is_not_a_regular_file(fifo, stopped_run, tmp_path, capsys, name, kind, expected):
    run = _crafted(stopped_run, tmp_path)
    (run / name).unlink(missing_ok=True)
    (run / name).symlink_to("/dev/zero") if kind == "zero" else fifo(run / name)
    with _memory_cap():
        err = _run(capsys, "report", str(run))
    assert f"{run / name}: {expected}" in err, err


def test_resume_with_a_metrics_log_that_is_a_fifo_is_one_line(fifo, stopped_run, tmp_path, capsys):
    run = _crafted(stopped_run, tmp_path)
    (run / "metrics.jsonl").unlink()
    fifo(run / "metrics.jsonl")
    err = _run(capsys, "train", "--resume", str(run))
    assert f"{run / 'metrics.jsonl'}: is a FIFO, expected a regular file" in err, err


def test_report_skips_and_counts_malformed_log_lines_and_an_eval_file_fifo(fifo, stopped_run, tmp_path, capsys):
    from densetrain.report import load_run

    run = _crafted(stopped_run, tmp_path)
    deep = "[" * 100_000 + "]" * 100_000
    n_train = len(load_run(run).train)
    with open(run / "metrics.jsonl", "a") as f:  # three bad lines, then a good one after them
        f.write(f'{{"kind": "train", "step": 3, "x": {deep}}}\n[1, 2]\n{{"kind": "train", "step": "x"}}\n'
                '{"kind": "eval", "step": 3, "val/all/loss": 9.5}\n')
    with open(run / "events.jsonl", "a") as f:
        f.write(f"{deep}\n")
    (run / "evals").mkdir()
    fifo(run / "evals" / "step_00000003.json")
    with _deadline(60):
        assert main(["report", str(run)]) == 0
    err = capsys.readouterr().err
    assert f"skipped 3 malformed line(s) of {run / 'metrics.jsonl'} (first: {run / 'metrics.jsonl'}:" in err, err
    assert f"skipped 1 malformed line(s) of {run / 'events.jsonl'}" in err and "nested too deeply" in err, err
    assert f"skipped {run / 'evals' / 'step_00000003.json'} ({run / 'evals' / 'step_00000003.json'}: is a FIFO" in err
    data = load_run(run)
    assert len(data.train) == n_train and data.evals[-1]["val/all/loss"] == 9.5


def test_checkpoint_marker_and_unhashed_trainer_state_that_are_fifos(fifo, stopped_run, tmp_path):
    from densetrain.checkpoint import list_complete
    from densetrain.checkpoint.common import CheckpointError
    from densetrain.checkpoint.load import read_trainer_state
    from densetrain.dcp_read import CheckpointReadError, read_marker

    run = _crafted(stopped_run, tmp_path)
    old, new = [p for _, p in list_complete(run)][-2:]
    (new / "COMPLETE").unlink()
    fifo(new / "COMPLETE")
    with _deadline(30), pytest.raises(CheckpointReadError, match=r"COMPLETE: cannot read the completion marker "
                                                                 r"\(ReadRefused: .*COMPLETE: is a FIFO"):
        read_marker(new)
    (old / "COMPLETE").write_text(json.dumps({"step": read_marker(old)["step"]}))  # an older save: no digests
    (old / "trainer_state.json").unlink()
    fifo(old / "trainer_state.json")
    with _deadline(30), pytest.raises(CheckpointError, match=r"trainer_state\.json: cannot read \(ReadRefused: .*"
                                                             r"is a FIFO"):
        read_trainer_state(old)


def test_ladder_points_file_that_is_a_fifo_or_holds_a_line_nested_too_deeply(fifo, tmp_path):
    from densetrain.fileio import ReadRefused
    from densetrain.tools.ladder.launcher import finished

    fifo(tmp_path / "ladder.jsonl")
    with _deadline(30), pytest.raises(ReadRefused, match=r"ladder\.jsonl: is a FIFO, expected a regular file"):
        finished(tmp_path)
    (tmp_path / "ladder.jsonl").unlink()
    (tmp_path / "ladder.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ReadRefused, match=r"ladder\.jsonl:1: nested too deeply"):
        finished(tmp_path)


def test_import_hf_of_a_safetensors_file_that_is_a_fifo(fifo, hf_dir, tmp_path, capsys):
    (hf_dir / "model.safetensors").unlink()
    fifo(hf_dir / "model.safetensors")
    err = _run(capsys, "import-hf", str(hf_dir), "--out", str(tmp_path / "run"))
    assert f"{hf_dir / 'model.safetensors'}: is a FIFO, expected a regular file" in err, err


@pytest.mark.parametrize("craft, expected", [
    ("oversized", "1073741825 bytes, larger than the 1073741824-byte limit for this file"),
    ("config_fifo", "96 token ids, more than the model's vocab_size 64"),  # tokenizer_config.json ignored
])
def test_import_hf_does_not_adopt_an_unreadable_tokenizer_and_goes_on(fifo, hf_dir, tmp_path, capsys, craft, expected):
    if craft == "oversized":
        with open(hf_dir / "tokenizer.json", "wb") as f:
            f.truncate((1 << 30) + 1)  # sparse
    else:
        _tokenizer_json(hf_dir / "tokenizer.json", r"\s+")
        fifo(hf_dir / "tokenizer_config.json")
    with _deadline(15):  # before the FIFO's writer comes (20 s): a reader waiting for it fails
        assert main(["import-hf", str(hf_dir), "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert expected in out and "data.tokenizer stays 'bpe'" in out, out


@pytest.mark.parametrize("craft, expected", [
    ("fifo", r"requests\.jsonl\.gz: unreadable \(.*requests\.jsonl\.gz: is a FIFO, expected a regular file"),
    ("deep", r"requests\.jsonl\.gz:2: nested too deeply"),
])
def test_task_requests_that_are_a_fifo_or_nest_too_deeply(fifo, tmp_path, monkeypatch, craft, expected):
    import gzip

    from densetrain.registry import gen_tasks
    from densetrain.registry.task_files import TaskDataError

    folder = tmp_path / craft  # its own folder: load_problems caches by folder name
    folder.mkdir()
    if craft == "fifo":
        fifo(folder / "requests.jsonl.gz")
    else:
        row = {"doc": {"id": 1, "short_answer": "2"}, "request": {"context": "1+1=", "continuation": "2"}}
        with gzip.open(folder / "requests.jsonl.gz", "wt") as f:
            f.write(json.dumps(row) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    monkeypatch.setattr(gen_tasks, "oe_eval_tasks_root", lambda: tmp_path)  # the package's folder, moved here
    with _deadline(30), pytest.raises(TaskDataError, match=expected):
        gen_tasks.load_problems(str(folder.name))


def test_a_tiktoken_rank_file_that_is_not_a_regular_file_is_one_line(tmp_path):
    from densetrain.data.tokenizer import load_tokenizer

    link = _not_a_file(tmp_path, "zero", "ranks.tiktoken")
    with _memory_cap(), pytest.raises(DataError, match=r"ranks\.tiktoken: is a character device, expected a regular "
                                                       r"file \(a link to /dev/zero\) \(data\.tokenizer\)"):
        load_tokenizer(str(link), tmp_path)


def test_a_shard_that_is_a_fifo_is_refused_by_its_hash_check(fifo, tmp_path):
    from densetrain.data.shards import sha256_file
    from densetrain.fileio import ReadRefused

    with _deadline(15), pytest.raises(ReadRefused, match=r"a\.ds: is a FIFO, expected a regular file"):
        sha256_file(fifo(tmp_path / "a.ds"))


def test_a_ladder_fit_and_a_prepare_manifest_nested_too_deeply(tmp_path):
    from densetrain.data.prepare.manifest import up_to_date
    from densetrain.train.watch.curve import read_fit

    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / "fit.json").write_text(deep)
    with pytest.raises(ConfigError, match=r"eval\.ladder: .*fit\.json: nested too deeply"):
        read_fit(tmp_path)
    (tmp_path / "manifest.json").write_text(deep)
    assert up_to_date(tmp_path, None, [], {}) is None  # not a manifest: the source is redone, no traceback


# --------------------------------------------------------------------------------------------------
# 37.5: tokenizers that cannot crash or stall a run
# --------------------------------------------------------------------------------------------------

def _tokenizer_json(path: Path, pattern: str) -> Path:
    """A tokenizer.json (HF tokenizers' own writer) whose pre-tokenizer splits on ``pattern``."""
    from tokenizers import Regex, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {chr(c): i for i, c in enumerate(range(32, 127))}
    vocab["<|endoftext|>"] = len(vocab)
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), "isolated")
    path.write_text(tok.to_str())
    return path


BACKTRACKING = r"(\w+\s?)*$"  # exponential on a sentence that ends in punctuation: Oniguruma's retry limit
ONLY_ON_Z = r"(z+)+y"  # the same, but only on a long run of z without a y (no probe text has one)


def test_a_tokenizer_that_panics_on_an_ordinary_sentence_is_refused_when_loaded(tmp_path, capfd):
    path = _tokenizer_json(tmp_path / "tokenizer.json", BACKTRACKING)
    with pytest.raises(DataError) as e:
        Tokenizer.from_file(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: the tokenizer library panicked while encoding (") and "\n" not in msg, msg
    assert "panicked at" not in capfd.readouterr().err  # the library's Rust backtrace is not shown


def test_a_library_panic_later_is_one_line_naming_the_tokenizer(tmp_path):
    path = _tokenizer_json(tmp_path / "tokenizer.json", ONLY_ON_Z)
    tok = Tokenizer.from_file(path)  # the probe's ordinary texts encode
    assert tok.encode("The quick brown fox.") == [tok.eos_id]  # WordLevel: one unknown word
    with pytest.raises(DataError, match=rf"^{path}: the tokenizer library panicked while encoding"):
        tok.encode("z" * 60 + "!")


def test_import_hf_does_not_adopt_a_tokenizer_that_fails_its_probe(hf_dir, tmp_path, capsys):
    _tokenizer_json(hf_dir / "tokenizer.json", BACKTRACKING)
    assert main(["import-hf", str(hf_dir), "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "the tokenizer library panicked" in out and "data.tokenizer stays 'bpe'" in out, out
    assert not (tmp_path / "run" / "tokenizer.json").exists()


def test_a_stalling_tokenizer_fails_the_probe_within_its_limit():
    import threading

    from densetrain.data.tokenizer.probe import probe_encoder

    release = threading.Event()
    with pytest.raises(DataError, match=r"^slow\.json: the tokenizer did not encode 9 short ordinary texts within "
                                        r"0\.2 s"):
        probe_encoder(lambda texts: [[1]] if release.wait(30) else [], "slow.json", timeout_s=0.2)
    release.set()  # lets the abandoned probe thread finish


# --------------------------------------------------------------------------------------------------
# 37.8: every failure said once, by every launcher
# --------------------------------------------------------------------------------------------------

def test_a_config_error_on_a_rank_other_than_0_is_said_by_that_rank(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    err = _run(capsys, "train", "--preset", "tiny", "--model.n_kv_heads=3")
    assert err.startswith("densetrain: error: [rank 1] model.n_heads (4) must be divisible"), err


def test_wandb_with_a_garbage_run_id_or_not_logged_in_is_one_line(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from densetrain.metrics import WandbSink

    (tmp_path / "wandb_run_id").write_text("../../etc/passwd\n")
    with pytest.raises(DataError, match=r"wandb_run_id: not a W&B run id \(1-64 letters, digits, _ or -\), got "
                                        r"'\.\./\.\./etc/passwd'; delete the file"):
        WandbSink(tmp_path, Config())
    (tmp_path / "wandb_run_id").write_text("abc123")
    for var in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: not logged in
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    try:
        with pytest.raises(ConfigError) as e:
            WandbSink(tmp_path, Config())
    finally:  # W&B keeps its settings (online, this HOME) for the process: a later offline test must not get them
        import wandb

        wandb.teardown()
    msg = str(e.value)
    assert msg.startswith("logging.wandb: W&B could not start the run (") and "wandb login" in msg, msg
    assert "WANDB_MODE=offline" in msg and "\n" not in msg


def test_a_shard_id_past_the_vocabulary_that_its_manifest_vouched_for_is_one_line(tmp_path):
    ids = np.arange(100, dtype=np.int64) % 50
    ids[70] = 900  # edited after prepare recorded the file's largest id as 49
    write_shard(tmp_path / "a", [ids], token_size=2)
    stream = TokenFiles(tmp_path)
    stream.check_vocab(64, recorded=[49])  # the manifest's word: the file is not read
    assert stream.read(0, 64).max() == 49  # reads below the bad id are unaffected
    with pytest.raises(DataError, match=r"a\.ds: token id 900 >= vocabulary size 64 at token offset 70, though its "
                                        r"manifest records a smaller largest id"):
        stream.read(60, 20)


def test_a_corpus_jsonl_line_nested_too_deeply_is_skipped_and_a_fifo_is_refused(tmp_path, capsys):
    from densetrain.data.prepare.readers.documents import SkipLog
    from densetrain.data.prepare.readers.text import iter_jsonl
    from densetrain.fileio import ReadRefused

    path = tmp_path / "web.jsonl"
    path.write_text('{"text": "kept"}\n{"text": "x", "meta": ' + "[" * 100_000 + "]" * 100_000 + '}\n')
    skips = SkipLog()
    assert [d.text for d in iter_jsonl(path, "web.jsonl", "text", 1 << 24, skips)] == ["kept"]
    assert skips.examples == ["web.jsonl:2: malformed JSON: nested too deeply"]
    os.mkfifo(tmp_path / "pipe.jsonl")
    with _deadline(30), pytest.raises(ReadRefused, match=r"pipe\.jsonl: is a FIFO, expected a regular file"):
        list(iter_jsonl(tmp_path / "pipe.jsonl", "pipe.jsonl", "text", 1 << 24, SkipLog()))


def test_a_prepare_manifest_that_is_not_a_regular_file_or_not_an_object(tmp_path):
    from densetrain.data.streams import open_streams

    shards = tmp_path / "shards"
    shards.mkdir()
    cfg = small_config(tmp_path, shards)
    os.mkfifo(shards / "manifest.json")
    with _deadline(30), pytest.raises(DataError, match=r"manifest\.json: cannot read the manifest \(.*manifest"
                                                       r"\.json: is a FIFO, expected a regular file\)"):
        open_streams(cfg, "train")
    (shards / "manifest.json").unlink()
    (shards / "manifest.json").write_text("[1, 2]")
    with pytest.raises(DataError, match=r"manifest\.json: expected a JSON object \(a prepare manifest\), got list"):
        open_streams(cfg, "train")


def test_an_async_save_on_a_full_disk_says_so_and_leaves_no_tmp(prepared, tmpfs, tmp_path, capsys):
    from test_full_disk import fill

    from densetrain.config import save_config

    _, make = prepared
    cfg = make(tmp_path, **{"train.run_dir": str(tmpfs / "run"), "checkpoint.async_save": True,
                            "checkpoint.every": 5, "logging.tensorboard": False, "eval.every": 0})
    save_config(cfg, tmp_path / "c.toml")
    (tmpfs / "run").mkdir()
    fill(tmpfs, leave=60000)  # the first checkpoint's write (and the metrics after it) run out of space
    err = _run(capsys, "train", "--config", str(tmp_path / "c.toml"))
    assert "no space left" in err, err
    assert not list((tmpfs / "run" / "checkpoints").glob("*.tmp")), sorted((tmpfs / "run").rglob("*"))


def test_import_hf_to_a_url_is_refused_in_one_line(hf_dir, capsys):
    # pathlib folded s3://b/imported into a local folder s3:/b/imported, and the command said it had imported there
    err = _run(capsys, "import-hf", str(hf_dir), "--out", "s3://b/imported")
    assert "s3://b/imported: the output must be a local folder" in err, err
    assert not Path("s3:").exists()
