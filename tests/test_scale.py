"""Scale-out (densetrain/data/prepare/scale/pipeline.py): a prepare config run on datatrove's local executor, trained
on directly as a ``format = "datatrove"`` source, and compared with densetrain's own prepare.

The corpus is real English prose: docstrings of the Python standard library (60+ words), with
planted exact copies, near copies (3 words changed), documents the filters must drop, a
hellaswag item for decontamination, a ``<|endoftext|>`` inside a text, and a malformed JSONL line.
"""

from __future__ import annotations

import ast
import json
import math
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import STDLIB, small_config

pytest.importorskip("datatrove")

TASKS = 2  # per-document stages run as 2 datatrove tasks (the 3 input files are split over them)
N_EXACT, N_NEAR = 12, 10


def _docstrings(limit: int = 240, min_words: int = 60) -> list[tuple[str, str]]:
    """(id, text) of stdlib module/class/function docstrings with >= min_words words, in file order."""
    out: list[tuple[str, str]] = []
    for f in sorted(STDLIB.glob("*.py")):
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc.split()) >= min_words:
                    out.append((f"{f.stem}.{getattr(node, 'name', 'module')}:{getattr(node, 'lineno', 0)}", doc))
        if len(out) >= limit:
            return out[:limit]
    return out


def _near_copy(text: str, k: int) -> str:
    """``text`` with 2 words replaced (5-word shingle Jaccard >= 0.87 for a 150+-word text)."""
    words = text.split(" ")
    for j in (len(words) // 3, 2 * len(words) // 3):
        words[j] = f"changed{k}x{j}"
    return " ".join(words)


def _write_corpus(root: Path) -> dict:
    from densetrain.config import FiltersConfig
    from densetrain.data.prepare.filters.chain import FilterStats, apply_filters, build_filters, clean_text
    from densetrain.registry.tasks import load_examples

    docs = _docstrings()
    # Copies are planted of documents the filters keep, so that every copy reaches dedup.
    filters = build_filters(["auto"], "reference", FiltersConfig())
    def passes(text: str) -> bool:
        return apply_filters(clean_text(text), filters, FilterStats()) is not None

    keep = [d for d in docs if passes(d[1]) and passes(d[1].lower())]  # the copies are lowercased too
    long_docs = [d for d in keep if len(d[1].split()) >= 150]
    # The special document must not also be the source of a planted copy (it would be deduplicated).
    others = [d for d in keep if d not in long_docs]  # exact copies of these; near copies of the long ones
    copied = {others[3 * k][0] for k in range(N_EXACT)} | {d[0] for d in long_docs[:N_NEAR]}
    special_id, special = next((i, t.replace(". ", ". <|endoftext|> ", 1)) for i, t in reversed(keep)
                               if i not in copied and ". " in t)
    rows = [{"id": i, "text": special if i == special_id else t} for i, t in docs]
    exact = [{"id": f"exact{k}", "text": others[3 * k][1] if k % 2 else others[3 * k][1].lower()}
             for k in range(N_EXACT)]
    near = [{"id": f"near{k}", "text": _near_copy(t, k)} for k, (_, t) in enumerate(long_docs[:N_NEAR])]
    ex = load_examples("hellaswag", limit=1)[0]
    hella = ex.contexts[ex.label] + ex.continuations[ex.label]
    planted = [
        {"id": "short", "text": "Too short to be a document."},
        {"id": "blank", "text": "   \n\t "},
        {"id": "repeated", "text": "\n".join(["The same line is repeated here many times over."] * 40)},
        {"id": "contaminated", "text": keep[5][1] + "\n\n" + hella + "\n"},
    ]
    rows = rows + exact + near + planted
    corpus = root / "corpus"
    corpus.mkdir()
    for j in range(3):
        with open(corpus / f"part{j}.jsonl", "w", encoding="utf-8") as f:
            for r in rows[j::3]:
                f.write(json.dumps(r) + "\n")
            if j == 1:
                f.write('{"id": "broken", "text": "no closing quote}\n')
    return {"texts": [r["text"] for r in rows], "special": special, "exact_base": exact[0]["text"],
            "near_pairs": [(t, r["text"]) for (_, t), r in zip(long_docs, near)]}


@pytest.fixture(scope="module")
def scale_run(tmp_path_factory):
    """Run the datatrove pipeline once, then prepare (datatrove source + the same raw source)."""
    from densetrain.data.prepare import prepare
    from densetrain.data.prepare.scale.pipeline import datatrove_pipeline
    from densetrain.data.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("scale")
    corpus = _write_corpus(root)
    tok = train_bpe(corpus["texts"], 512, root / "tokenizer.json")
    out = root / "dt"
    cfg = small_config(root, root / "shards", **{
        "data.corpus_dir": str(root / "corpus"), "data.tokenizer": str(root / "tokenizer.json"), "data.workers": 1,
        "data.decontam.tasks": ["hellaswag"],
        "data.sources": [{"name": "dt", "kind": "reference", "paths": [str(out)], "format": "datatrove"},
                         {"name": "ref", "kind": "reference", "paths": ["."], "format": "jsonl"}],
        "stages": [{"name": "main", "start": 0.0, "mix": {"dt": 0.5, "ref": 0.5}}],
        "train.steps": 4, "eval.every": 4, "checkpoint.every": 0})
    pipe = datatrove_pipeline(cfg, 1, str(out), tasks=TASKS, workers=1)
    pipe.run()
    summary = prepare(cfg)
    return {"root": root, "cfg": cfg, "tok": tok, "pipe": pipe, "out": out, "summary": summary, **corpus}


def _decoded(tok, folder: Path) -> list[str]:
    """Decoded documents of every .ds file in ``folder``; each must end with EOS."""
    from densetrain.data.shards import TokenFiles

    tf = TokenFiles(folder)
    texts = []
    for k in range(tf.n_docs):
        ids = tf.document(k)
        assert ids[-1] == tok.eos_id
        texts.append(tok.decode(ids[:-1]))
    return texts


def _parquet_rows(folder: Path) -> list[dict]:
    rows = []
    for f in sorted(folder.glob("*.parquet")):
        for r in pq.read_table(f).to_pylist():
            rows.append({**r, "metadata": json.loads(r["metadata"])})
    return rows


def _stats(work: Path, stage: str) -> dict:
    """datatrove's merged stats of one stage: step name -> {stat: total}."""
    out = {}
    for step in json.loads((work / "logs" / stage / "stats.json").read_text()):
        name = step["name"].split(": ", 1)[-1]  # stats names are "<type>: <name>"
        out[name] = {k: (v["total"] if isinstance(v, dict) else v) for k, v in step["stats"].items()}
    return out


def test_datatrove_output_is_the_cleaned_deduplicated_corpus(scale_run):
    from densetrain.data.prepare import dedup
    from densetrain.data.prepare.scale.folder import IDENTITY_FILE

    tok, out, work = scale_run["tok"], scale_run["out"], Path(scale_run["pipe"].work_dir)
    got = _decoded(tok, out / "train") + _decoded(tok, out / "val")
    # Every kept document decodes back to its cleaned text (what the map step passed on), in some order.
    cleaned = _parquet_rows(work / "documents")
    gone = {r["id"] for sub in ("exact", "near") for r in _parquet_rows(work / "removed" / sub)}
    assert Counter(got) == Counter(r["text"] for r in cleaned if r["id"] not in gone)
    # Duplicates removed: no two kept documents share a normalised text; no planted copy survives twice.
    assert len({dedup.normalize(t) for t in got}) == len(got)
    assert sum(dedup.normalize(t) == dedup.normalize(scale_run["exact_base"]) for t in got) == 1
    kept = {dedup.normalize(t) for t in got}
    assert not any(dedup.normalize(a) in kept and dedup.normalize(b) in kept for a, b in scale_run["near_pairs"])
    # Removals carry our reasons and provenance, and datatrove's stats count them.
    removed = {r["id"]: r["metadata"] for r in _parquet_rows(work / "removed" / "map")}
    # Gopher repetition runs first: its top-2-gram share (datatrove's rule counts a single occurrence)
    # already rejects a 5-word text, before gopher_quality's word count would.
    assert removed["short"]["removed_reason"] == "gopher_repetition:top_2gram_char_frac"
    assert removed["blank"]["removed_reason"] == "empty"
    assert removed["repeated"]["removed_reason"].startswith("gopher_repetition:")
    assert removed["contaminated"]["removed_reason"] == "contaminated:hellaswag"
    assert removed["short"]["source_file"].startswith("part") and removed["short"]["line"] >= 1
    st = _stats(work, "map")
    mapped = st["densetrain clean/filter/decontaminate"]
    assert mapped["dropped"] == len(removed) and mapped["dropped_contaminated:hellaswag"] == 1
    assert mapped["forwarded"] + mapped["dropped"] == st["densetrain reader"]["total"]
    assert st["densetrain reader"]["skipped_malformed JSON"] == 1
    exact_dropped = _stats(work, "tokenize")["💥 exact-deduplication stage 3"]["dropped"]
    assert exact_dropped >= N_EXACT  # the planted copies, and any copies the stdlib itself holds
    # "<|endoftext|>" inside a text is plain text: only the appended EOS is the special id.
    special = next(t for t in got if "<|endoftext|>" in t)
    assert special == scale_run["special"].strip()
    assert json.loads((out / IDENTITY_FILE).read_text())["sha256"] == tok.sha256


def test_datatrove_path_agrees_with_prepare(scale_run):
    from densetrain.data.prepare import dedup

    tok, root, work = scale_run["tok"], scale_run["root"], Path(scale_run["pipe"].work_dir)
    shards = root / "shards"
    ours = _decoded(tok, shards / "ref" / "train") + _decoded(tok, shards / "ref" / "val")
    theirs = _decoded(tok, scale_run["out"] / "train") + _decoded(tok, scale_run["out"] / "val")
    removed = json.loads((shards / "ref" / "removed.json").read_text())
    ours_reason = dict(zip(removed["doc_id"], removed["reason"]))
    # Filtered, empty and contaminated documents: exactly the same ones.
    filtered_ours = {i: r for i, r in ours_reason.items() if not r.startswith("duplicate:")}
    filtered_theirs = {r["id"]: r["metadata"]["removed_reason"] for r in _parquet_rows(work / "removed" / "map")}
    assert filtered_ours == filtered_theirs
    # Exact duplicates: the same number, of the same normalised texts.
    exact_ours = sum(r.startswith("duplicate:exact") for r in ours_reason.values())
    assert exact_ours == len(_parquet_rows(work / "removed" / "exact")) >= N_EXACT
    # Near duplicates: other hash functions and no verification on datatrove's side, so only close.
    near_ours = sum(r.startswith("duplicate:near") for r in ours_reason.values())
    near_theirs = len(_parquet_rows(work / "removed" / "near"))
    # Compared by normalised text: which copy of an exact-duplicate cluster is kept does not matter.
    ours_n, theirs_n = {dedup.normalize(t) for t in ours}, {dedup.normalize(t) for t in theirs}
    both = len(ours_n & theirs_n)
    agreement = both / len(ours_n | theirs_n)
    print(f"\nkept: prepare {len(ours)}, datatrove {len(theirs)}, both {both} (agreement {agreement:.3f}); "
          f"near duplicates removed: prepare {near_ours}, datatrove {near_theirs}")
    assert near_ours >= N_NEAR and near_theirs >= N_NEAR
    assert agreement >= 0.9  # ~64 kept documents: two near-duplicate calls of other hash functions cost 0.06


def test_prepare_registers_and_train_reads_datatrove_folder(scale_run):
    from densetrain.data.shards import TokenFiles
    from densetrain.data.streams import open_streams
    from densetrain.train import train

    cfg, out, summary = scale_run["cfg"], scale_run["out"], scale_run["summary"]
    dt = summary["sources"]["dt"]
    assert dt["status"] == "registered"
    assert dt["train"]["dir"] == str((out / "train").resolve())
    train_files = TokenFiles(out / "train")
    assert dt["train"]["tokens"] == len(train_files) and dt["train"]["documents"] == train_files.n_docs
    assert dt["val"]["tokens"] == len(TokenFiles(out / "val")) > 0
    assert not list((Path(cfg.data.shards_dir) / "dt").glob("**/*.ds"))  # nothing copied or re-tokenized
    assert len(open_streams(cfg, "train")["dt"]) == len(train_files)
    assert train(cfg)["steps"] == 4
    rec = [json.loads(x) for x in (Path(cfg.train.run_dir) / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rec if "loss" in r]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert any("train/dt/loss" in r for r in rec) and any(math.isfinite(r.get("val/dt/loss", math.nan)) for r in rec)
    # A second prepare recognises the unchanged folder.
    from densetrain.data.prepare import prepare

    assert prepare(cfg)["sources"]["dt"]["status"] == "up-to-date"


def _tokenized_folder(path: Path, tokenizer_name: str, docs: list[list[int]]) -> Path:
    """A folder written by datatrove's own TokenizedFile (index + metadata), as DocumentTokenizer does."""
    from datatrove.pipeline.tokens.tokenizer import TokenizedFile

    f = TokenizedFile(str(path), "00000.ds", tokenizer_name_or_path=tokenizer_name, save_final_metadata=True)
    for d in docs:
        f.write(d, None)
    f.close()
    return path


@pytest.mark.parametrize("case", ["vocab", "tokenizer", "eos"])
def test_bad_datatrove_folder_is_a_one_line_error(scale_run, tmp_path, case):
    from densetrain.data.prepare import prepare
    from densetrain.errors import DataError

    tok, root = scale_run["tok"], scale_run["root"]
    eos = tok.eos_id
    name = str(root / "tokenizer.json") if case != "tokenizer" else "gpt2"
    docs = [[5, 6, 7, eos], [8, 600 if case == "vocab" else 9, eos if case != "eos" else 10]]
    folder = _tokenized_folder(tmp_path / "bad", name, docs)
    cfg = small_config(tmp_path, tmp_path / "shards", **{
        "data.corpus_dir": str(root / "corpus"), "data.tokenizer": str(root / "tokenizer.json"),
        "data.sources": [{"name": "bad", "kind": "web", "paths": [str(folder)], "format": "datatrove"}],
        "stages": [{"name": "main", "start": 0.0, "mix": {"bad": 1.0}}]})
    with pytest.raises(DataError) as e:
        prepare(cfg)
    msg = str(e.value)
    assert "\n" not in msg and "00000.ds" in msg
    assert {"vocab": "token id 600 >= vocabulary size 512", "tokenizer": "tokenized with 'gpt2'",
            "eos": "does not end with EOS"}[case] in msg


def test_cluster_executors_wiring(scale_run, tmp_path):
    from datatrove.executor import RayPipelineExecutor, SlurmPipelineExecutor

    from densetrain.data.prepare.scale.pipeline import datatrove_pipeline
    from densetrain.errors import ConfigError

    cfg = scale_run["cfg"]
    bands = cfg.data.dedup.bands
    names = ["map", "exact_find", "minhash_signatures", "minhash_buckets", "minhash_cluster", "tokenize"]
    slurm = datatrove_pipeline(cfg, 1, str(tmp_path / "out"), tasks=64, executor="slurm", bucket_workers=2,
                               time="4:00:00", partition="cpu", cpus_per_task=2,
                               stage_kwargs={"minhash_cluster": {"mem_per_cpu_gb": 16}})
    ray = datatrove_pipeline(cfg, 1, str(tmp_path / "out"), tasks=64, workers=16, executor="ray")
    for pipe, cls in ((slurm, SlurmPipelineExecutor), (ray, RayPipelineExecutor)):
        assert list(pipe.stages) == names
        ex = list(pipe.stages.values())
        assert all(isinstance(e, cls) for e in ex)
        assert [e.world_size for e in ex] == [64, 1, 64, bands * (2 if pipe is slurm else 1), 1, 64]
        assert ex[0].depends is None and all(b.depends is a for a, b in zip(ex, ex[1:]))
        assert all(e.logging_dir.path.endswith(f"out.work/logs/{n}") for n, e in zip(names, ex))
    assert [e.job_name for e in slurm.stages.values()] == [f"ref-{n}" for n in names]
    assert slurm.stages["minhash_cluster"].mem_per_cpu_gb == 16 and slurm.stages["map"].mem_per_cpu_gb == 2
    assert slurm.stages["map"].cpus_per_task == 2 and slurm.stages["map"].partition == "cpu"
    assert ray.stages["map"].workers == 16 and ray.stages["exact_find"].workers == 1
    with pytest.raises(ConfigError, match="partition"):
        datatrove_pipeline(cfg, 1, str(tmp_path / "o2"), executor="slurm", time="1:00:00")
