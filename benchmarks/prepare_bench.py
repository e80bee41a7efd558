"""Data preparation throughput: densetrain vs datatrove, in MB of input per CPU-second.

Both pipelines clean, filter, deduplicate and tokenize the same JSONL input (~50 MB; ``--small``
~5 MB) with the same thresholds and the same ``tokenizer.json``, each in a fresh subprocess with
``--workers`` processes, and the table gives MB in, documents in/out, tokens, wall seconds,
CPU seconds and MB per CPU-second, then the ratio densetrain / datatrove and the documents each
stage removed on both sides.

densetrain
    :func:`densetrain.data.prepare.prepare` on one source of kind ``web`` with
    ``filters = [gopher_repetition, gopher_quality, c4, fineweb]``, ``data.workers = --workers``
    and the default dedup (exact + MinHash LSH, 5-word shingles, 16 bands x 7 rows, verified at
    Jaccard 0.8). Per document, in the worker processes: ftfy + NFC -> the four filters -> dedup
    fingerprints -> tokens + EOS; then exact and near dedup, shuffle, train/val shards, manifest,
    provenance. Decontamination is OFF (datatrove's pipeline has no such step);
    ``--with-decontam`` adds a row with it on (13-gram index of the six default evaluation
    sets, built before the clock starts).

datatrove (``LocalPipelineExecutor``, ``tasks = workers = --workers``, FineWeb's stage layout)
    1. ``JsonlReader -> FTFYFormatter -> GopherRepetitionFilter -> GopherQualityFilter ->
       C4QualityFilter -> FineWebQualityFilter -> JsonlWriter -> MinhashDedupSignature``
    2. ``MinhashDedupBuckets`` (one task per bucket), 3. ``MinhashDedupCluster`` (one task),
    4. ``JsonlReader -> MinhashDedupFilter -> DocumentTokenizer(tokenizer.json path, EOS)``.

    The filter thresholds are densetrain's defaults (the published ones), passed explicitly:
    C4 with 3 sentences / 5 words per line (datatrove's defaults are 5 / 3), FineWeb's
    duplicated-line ratio 0.1 (datatrove's default 0.01). FTFYFormatter gets densetrain's ftfy
    settings (``densetrain.data.prepare.filters.chain.FTFY_CONFIG``, NFC). MinHash: 14 buckets x 8 hashes
    (FineWeb's, 112 hashes like densetrain's 16 x 7), 5-grams, no verification. What remains
    different: densetrain's word tokens are its own re-implementation of the tokenizer datatrove
    loads (spaCy's blank English one), it also removes exact duplicates (normalised text) and
    holds out a val split; and its ``gopher_quality`` / ``fineweb`` read the rules as FineWeb's
    2024 code did (ratios over words; ASCII line stops with quotes), while datatrove 0.10 counts
    punctuation tokens in the Gopher alpha-words denominator (< 80% of tokens with a letter), which
    drops 16% of FineWeb's own pages and most dictionary and documentation text, so datatrove then
    dedups and tokenizes fewer documents; ``--dt-no-alpha-rule`` adds a datatrove row without that
    rule. (densetrain's ``gopher_quality_datatrove010`` / ``fineweb_datatrove010`` are datatrove
    0.10's reading, decision for decision: tests/test_filters_parity.py.)
    Start method ``fork`` instead of datatrove's default ``forkserver``: forkserver workers are
    not children of the measured process, so their CPU time would not be counted.

Input. Documents come from the demo corpus (``densetrain.data.corpus.build.build_demo_corpus`` into
``<work-dir>/corpus``, English sources ``books, reference, technical, web`` by default, all their
text (~53 MB), reusing the ``.deb`` cache of ``make demo`` when present) and from
``--input`` files (any format densetrain reads: JSONL with ``--text-field``, Parquet, text;
``.gz``/``.zst`` fine). Each origin gets an equal share of the target bytes (a smaller one is taken
whole), documents picked evenly through it; the selection is shuffled (seeded) and written as
``4 * workers`` equal-size JSONL files (``text``, ``id``), so that datatrove's file-per-task split
is balanced. Nothing is repeated: with less text available the run is smaller, and says so.

Measurement. Each side runs in a fresh subprocess; the clock and ``resource.getrusage``
(``RUSAGE_SELF + RUSAGE_CHILDREN``, user + system) are read just before and after the pipeline
call, so imports and setup (decontamination index) are excluded and every worker process, which
has ended and been reaped by then, is included. ``RAYON_NUM_THREADS=1`` is set on both sides
(one tokenizer thread per worker process; densetrain's workers set it themselves). CPU seconds
hardly depend on other load on the machine; wall seconds do.

Usage (datatrove and spaCy go into a separate virtualenv, not densetrain's)::

    python3 -m venv /work/bench-venv && /work/bench-venv/bin/pip install 'datatrove[processing]==0.10.1' spacy orjson
    .venv/bin/python benchmarks/prepare_bench.py --datatrove-python /work/bench-venv/bin/python
    .venv/bin/python benchmarks/prepare_bench.py --small --datatrove-python /work/bench-venv/bin/python
    .venv/bin/python benchmarks/prepare_bench.py --input my.jsonl --no-demo --sides densetrain

Results go to ``<work-dir>/results-<size>MB.json``, logs of each side to
``<work-dir>/run-<side>/log.txt``.
Only the densetrain environment needs densetrain; the datatrove subprocess runs this file with
the other interpreter and imports nothing of densetrain.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FILTERS = ("gopher_repetition", "gopher_quality", "c4", "fineweb")
"""The filter chain of both sides, in FineWeb's order."""
DEMO_ENGLISH = ("books", "reference", "technical", "web")
"""Demo sources used by default: English text, what the Gopher/C4/FineWeb rules were made for."""
EOS = "<|endoftext|>"
BPE_VOCAB = 8192
BPE_SAMPLE_BYTES = 5_000_000
INPUT_VERSION = 1
DEMO_CAP = 64_000_000
"""Per-source cap of the benchmark's demo corpus build (bytes): all the text of the English sources."""


def _log(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


# ==================================================================================================
# Parent: input, tokenizer, the two subprocesses, the report (runs in densetrain's environment)
# ==================================================================================================


def _origins(args, work: Path) -> list[tuple[str, object, Path]]:
    """``(name, SourceConfig, corpus_dir)`` of every text origin: the demo sources and ``--input``s."""
    from densetrain.config import SourceConfig

    out = []
    if not args.no_demo:
        from densetrain.data.corpus.build import build_demo_corpus

        demo_dir = work / "corpus"
        debs = REPO / ".cache/densetrain/corpus/.cache/debs"  # where `make demo` keeps its downloads
        names = [s for s in args.demo_sources.split(",") if s]
        # One cap for every run size, so that --small and the full run share one built corpus.
        build_demo_corpus(demo_dir, max(args.target_bytes, DEMO_CAP), sources=names,
                          cache_dir=debs if debs.is_dir() else None)
        for n in names:
            out.append((f"demo:{n}", SourceConfig(name=n, paths=[f"{n}.jsonl"], format="jsonl"), demo_dir))
    for i, p in enumerate(args.input):
        path = Path(p).expanduser().resolve()
        out.append((f"input:{path.name}", SourceConfig(name=f"input{i}", paths=[str(path)], format="auto",
                                                       text_field=args.text_field), path.parent))
    if not out:
        sys.exit("prepare_bench: no input: give --input FILE or drop --no-demo")
    return out


def build_input(args, work: Path) -> dict:
    """Write the benchmark input (see the module docstring) into ``<work>/input-<key>/`` once.

    Returns:
        ``{'dir', 'files', 'documents', 'bytes', 'origins': {name: {'documents', 'bytes'}}}``
        (bytes = UTF-8 bytes of the raw texts).
    """
    from densetrain.data.prepare.readers.documents import SkipLog
    from densetrain.data.prepare.readers.paths import resolve_paths
    from densetrain.data.prepare.readers.sources import iter_documents
    from densetrain.data.sampling import fair_shares, spread

    origins = _origins(args, work)
    n_files = 4 * args.workers
    fp = []
    for name, src, base in origins:
        fp.append([name, [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in resolve_paths(src, base)]])
    params = {"version": INPUT_VERSION, "target_bytes": args.target_bytes, "n_files": n_files, "seed": args.seed,
              "text_field": args.text_field, "origins": fp}
    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]
    out = work / f"input-{key}"
    marker = out / ".bench_input.json"
    if marker.is_file():
        info = {**json.loads(marker.read_text()), "dir": str(out)}
        _log(f"input: {info['bytes'] / 1e6:.1f} MB, {info['documents']:,} documents in {out} (cached)")
        return info

    # Read each origin up to the whole target (a big --input is not read to its end).
    texts: list[list[str]] = []
    for _, src, base in origins:
        got, n = [], 0
        skips = SkipLog(print_first=3)
        for doc in iter_documents(src, base, skips):
            if doc.text.strip():
                got.append(doc.text)
                n += len(doc.text.encode("utf-8"))
            if n >= args.target_bytes:
                break
        texts.append(got)
    pool = [[(f"{name.split(':', 1)[1]}-{k}", t, len(t.encode("utf-8"))) for k, t in enumerate(ts)]
            for (name, _, _), ts in zip(origins, texts)]
    shares = fair_shares([sum(d[2] for d in p) for p in pool], args.target_bytes)
    docs, per_origin = [], {}
    for (name, _, _), p, share in zip(origins, pool, shares):
        picked = spread(p, share, size=lambda d: d[2])  # evenly through the origin
        docs.extend(picked)
        per_origin[name] = {"documents": len(picked), "bytes": sum(d[2] for d in picked)}
    del texts, pool
    random.Random(args.seed).shuffle(docs)
    total = sum(n for _, _, n in docs)
    if not docs:
        sys.exit("prepare_bench: the inputs hold no text")

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files, f, done, j = [], None, 0, -1
    for doc_id, text, n in docs:
        # Equal byte boundaries: document d goes to file floor(bytes before d * n_files / total).
        want = min(n_files - 1, done * n_files // total)
        while j < want:
            if f:
                f.close()
            j += 1
            files.append(f"part-{j:05d}.jsonl")
            f = open(tmp / files[-1], "w", encoding="utf-8")
        f.write(json.dumps({"text": text, "id": doc_id}, ensure_ascii=False) + "\n")
        done += n
    f.close()
    info = {"dir": str(out), "files": files, "documents": len(docs), "bytes": total, "origins": per_origin,
            "params": params}
    (tmp / marker.name).write_text(json.dumps(info, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    _log(f"input: {total / 1e6:.1f} MB, {len(docs):,} documents, {len(files)} files in {out}")
    for name, c in per_origin.items():
        _log(f"  {name}: {c['documents']:,} documents, {c['bytes'] / 1e6:.1f} MB")
    if total < 0.9 * args.target_bytes:
        _log(f"NOTE: only {total / 1e6:.1f} MB of text available (target {args.target_bytes / 1e6:.0f} MB); "
             "add --input files or --demo-sources for a bigger run")
    return info


def get_tokenizer(args, work: Path, inp: dict) -> tuple[str, int]:
    """``(path, vocab_size)`` of the tokenizer.json both sides use: ``--tokenizer``, or a byte-level
    BPE (vocab 8192, densetrain's default) trained once on the first 5 MB of the input."""
    from densetrain.data.tokenizer import Tokenizer, train_bpe

    if args.tokenizer:
        tok = Tokenizer.from_file(args.tokenizer)
        if tok.eos_token != EOS:
            sys.exit(f"prepare_bench: {args.tokenizer}: EOS is {tok.eos_token!r}; datatrove's side needs {EOS!r}")
        return str(Path(args.tokenizer).resolve()), tok.vocab_size
    path = work / f"tokenizer-bpe{BPE_VOCAB}.json"
    if path.is_file():
        return str(path), Tokenizer.from_file(path).vocab_size
    sample, n = [], 0
    for name in inp["files"]:
        for line in open(Path(inp["dir"]) / name, encoding="utf-8"):
            sample.append(json.loads(line)["text"])
            n += len(sample[-1])
            if n >= BPE_SAMPLE_BYTES:
                break
        if n >= BPE_SAMPLE_BYTES:
            break
    _log(f"tokenizer: training a byte-level BPE (vocab {BPE_VOCAB}) on {len(sample)} documents -> {path}")
    tok = train_bpe(sample, BPE_VOCAB, path, length=len(sample))
    return str(path), tok.vocab_size


def datatrove_filter_args() -> dict:
    """densetrain's default filter thresholds as keyword arguments of datatrove's filters."""
    from densetrain.config import FiltersConfig
    from densetrain.data.prepare.filters.chain import FTFY_CONFIG

    p = FiltersConfig()
    q, r, c, f = p.gopher_quality, p.gopher_repetition, p.c4, p.fineweb
    assert q.max_hash_ratio == q.max_ellipsis_ratio, "datatrove has one symbol-to-word ratio for both"
    return {
        "ftfy": {k: getattr(FTFY_CONFIG, k) for k in (
            "unescape_html", "remove_terminal_escapes", "fix_encoding", "restore_byte_a0", "replace_lossy_sequences",
            "decode_inconsistent_utf8", "fix_c1_controls", "fix_latin_ligatures", "fix_character_width",
            "uncurl_quotes", "fix_line_breaks", "fix_surrogates", "remove_control_chars", "normalization")},
        "gopher_repetition": {
            "dup_line_frac": r.max_dup_line_frac, "dup_para_frac": r.max_dup_para_frac,
            "dup_line_char_frac": r.max_dup_line_char_frac, "dup_para_char_frac": r.max_dup_para_char_frac,
            "top_n_grams": [[n, getattr(r, f"max_top_{n}gram_char_frac")] for n in (2, 3, 4)],
            "dup_n_grams": [[n, getattr(r, f"max_dup_{n}gram_char_frac")] for n in range(5, 11)],
        },
        "gopher_quality": {
            "min_doc_words": q.min_words, "max_doc_words": q.max_words,
            "min_avg_word_length": q.min_mean_word_length, "max_avg_word_length": q.max_mean_word_length,
            "max_symbol_word_ratio": q.max_hash_ratio, "max_bullet_lines_ratio": q.max_bullet_lines,
            "max_ellipsis_lines_ratio": q.max_ellipsis_lines, "max_non_alpha_words_ratio": q.min_alpha_words,
            "min_stop_words": q.min_stop_words, "stop_words": list(q.stop_words),
        },
        "c4": {
            "remove_citations": c.remove_citations, "filter_no_terminal_punct": c.remove_no_terminal_punct,
            "min_num_sentences": c.min_sentences, "min_words_per_line": c.min_words_per_line,
            "max_word_length": c.max_word_length or -1, "filter_lorem_ipsum": c.drop_lorem_ipsum,
            "filter_javascript": c.remove_javascript_lines, "filter_curly_bracket": c.drop_curly_brace,
            "filter_policy": c.remove_policy_lines,
        },
        "fineweb": {
            "line_punct_thr": f.min_line_punct_ratio, "short_line_thr": f.max_short_line_ratio,
            "short_line_length": f.short_line_length, "char_duplicates_ratio": f.max_dup_line_char_ratio,
        },
    }


def datatrove_available(python: str) -> tuple[bool, str]:
    """Whether ``python`` imports datatrove with spaCy (its English word tokenizer); the reason if not."""
    # Instantiating the readers/writers checks their optional dependencies (orjson, xxhash, ...).
    code = ("import tempfile, datatrove, spacy; from importlib.metadata import version; "
            "from datatrove.utils.word_tokenizers import load_word_tokenizer; "
            "from datatrove.pipeline.readers import JsonlReader; from datatrove.pipeline.writers import JsonlWriter; "
            "from datatrove.pipeline.formatters import FTFYFormatter; "
            "from datatrove.pipeline.dedup import MinhashDedupSignature; d = tempfile.mkdtemp(); "
            "JsonlReader(d); JsonlWriter(d); FTFYFormatter(); MinhashDedupSignature(d); "
            "load_word_tokenizer('en').word_tokenize('a test'); "
            "print(version('datatrove'), version('spacy'))")
    try:
        p = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    if p.returncode != 0:
        return False, (p.stderr.strip().splitlines() or ["failed"])[-1]
    return True, p.stdout.strip()


def run_side(name: str, side: str, python: str, spec: dict, work: Path) -> dict | None:
    """Run one side in a fresh subprocess; its result dict, or None when it failed (log tail shown)."""
    run_dir = work / f"run-{name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    spec = {**spec, "out": str(run_dir / "out"), "result": str(run_dir / "result.json")}
    (run_dir / "spec.json").write_text(json.dumps(spec, indent=1))
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    _log(f"{name}: running ({python}); log: {run_dir / 'log.txt'}")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(run_dir / "log.txt", "w") as log:
        cmd = [python, str(Path(__file__).resolve()), "--side", side, "--spec", str(run_dir / "spec.json")]
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO)).returncode
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if rc != 0 or not (run_dir / "result.json").is_file():
        tail = (run_dir / "log.txt").read_text(errors="replace").splitlines()[-15:]
        _log(f"{name}: FAILED (exit {rc}); last lines of the log:\n    " + "\n    ".join(tail))
        return None
    res = json.loads((run_dir / "result.json").read_text())
    res["process_wall_s"] = wall
    res["process_cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    _log(f"{name}: {res['cpu_s']:.1f} CPU s, {res['wall_s']:.1f} s wall (whole process incl. start-up: "
         f"{res['process_cpu_s']:.1f} CPU s, {wall:.1f} s)")
    return res


def report(rows: dict[str, dict], inp: dict) -> str:
    """The throughput table, the ratio and the per-stage table, as text."""
    lines = []
    hdr = (f"{'side':<22}{'MB in':>8}{'docs in':>10}{'docs out':>10}{'tokens':>13}{'wall s':>9}{'CPU s':>9}"
           f"{'MB/CPU-s':>10}")
    lines += [hdr, "-" * len(hdr)]
    for name, r in rows.items():
        mb = inp["bytes"] / 1e6
        lines.append(f"{name:<22}{mb:>8.1f}{r['docs_in']:>10,}{r['docs_out']:>10,}{r['tokens']:>13,}"
                     f"{r['wall_s']:>9.1f}{r['cpu_s']:>9.1f}{mb / r['cpu_s']:>10.3f}")
    for name, t in rows.items():
        if name.startswith("datatrove") and "densetrain" in rows:
            d = rows["densetrain"]
            lines.append(f"ratio densetrain / {name}: {t['cpu_s'] / d['cpu_s']:.2f}x MB per CPU-second "
                         f"({t['wall_s'] / d['wall_s']:.2f}x wall; wall depends on other load on the machine)")
    # Per-stage removals, aligned by stage name.
    stages: list[str] = []
    for r in rows.values():
        for s in r["stages"]:
            if s[0] not in stages:
                stages.append(s[0])
    lines += ["", "documents removed per stage (in pipeline order; '-' = no such stage):"]
    hdr = f"{'stage':<28}" + "".join(f"{n:>22}" for n in rows)
    lines += [hdr, "-" * len(hdr)]
    for st in stages:
        cells = []
        for r in rows.values():
            hit = next((s for s in r["stages"] if s[0] == st), None)
            cells.append(f"{hit[1]:>22,}" if hit else f"{'-':>22}")
        lines.append(f"{st:<28}" + "".join(cells))
    lines.append(f"{'documents out':<28}" + "".join(f"{r['docs_out']:>22,}" for r in rows.values()))
    lines += ["", "rules that removed documents (top 4 per stage):"]
    for name, r in rows.items():
        for st, _, reasons in r["stages"]:
            if reasons:
                top = sorted(reasons.items(), key=lambda kv: -kv[1])[:4]
                lines.append(f"  {name:<20} {st:<20} " + ", ".join(f"{k} {v:,}" for k, v in top))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=50.0, help="target input size in MB (default 50)")
    ap.add_argument("--small", action="store_true", help="a quick run on ~5 MB (same as --mb 5)")
    ap.add_argument("--input", action="append", default=[],
                    help="extra input file/dir/glob (JSONL, Parquet, text; repeatable)")
    ap.add_argument("--text-field", default="text", help="text field of --input JSONL/Parquet (default text)")
    ap.add_argument("--no-demo", action="store_true", help="do not use the demo corpus")
    ap.add_argument("--demo-sources", default=",".join(DEMO_ENGLISH),
                    help=f"demo sources to use (default {','.join(DEMO_ENGLISH)}; also: zh, code)")
    ap.add_argument("--workers", type=int, default=2, help="worker processes / datatrove tasks (default 2)")
    ap.add_argument("--tokenizer", help="tokenizer.json for both sides (default: a BPE trained once on the input)")
    ap.add_argument("--datatrove-python", help="python of a virtualenv with datatrove[processing] and spacy")
    ap.add_argument("--sides", default="densetrain,datatrove", help="which sides to run (default both)")
    ap.add_argument("--with-decontam", action="store_true", help="also run densetrain with decontamination on")
    ap.add_argument("--dt-no-alpha-rule", action="store_true",
                    help="also run datatrove without Gopher's alpha-words rule, which (counting spaCy's punctuation "
                         "tokens as words) drops most dictionary and documentation text: a row with survivors "
                         "comparable to densetrain's")
    ap.add_argument("--dt-buckets", type=int, default=14, help="datatrove MinHash buckets (default 14, FineWeb)")
    ap.add_argument("--dt-hashes", type=int, default=8, help="datatrove MinHash hashes per bucket (default 8)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the input shuffle")
    ap.add_argument("--work-dir", default=str(REPO / ".cache/densetrain/bench"),
                    help="where input, outputs and logs go (default .cache/densetrain/bench)")
    ap.add_argument("--side", choices=["densetrain", "datatrove"], help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.side:
        return side_main(args.side, args.spec)

    sys.path.insert(0, str(REPO))
    args.target_bytes = int((5.0 if args.small else args.mb) * 1e6)
    if args.workers < 1:
        ap.error("--workers must be >= 1")
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    sides = [s for s in args.sides.split(",") if s]
    bad = [s for s in sides if s not in ("densetrain", "datatrove")]
    if bad:
        ap.error(f"--sides: unknown {bad}")

    dt_python = None
    if "datatrove" in sides:
        dt_python = args.datatrove_python or sys.executable
        ok, why = datatrove_available(dt_python)
        if ok:
            _log(f"datatrove side: {dt_python} (datatrove, spacy {why})")
        else:
            _log(f"datatrove side UNAVAILABLE with {dt_python}: {why}\n"
                 "    install it in a separate virtualenv and pass its python, e.g.\n"
                 "    python3 -m venv ../bench-venv && "
                 "../bench-venv/bin/pip install 'datatrove[processing]==0.10.1' spacy orjson\n"
                 "    then: --datatrove-python ../bench-venv/bin/python")
            sides.remove("datatrove")

    inp = build_input(args, work)
    tok_path, vocab = get_tokenizer(args, work, inp)
    spec = {"input_dir": inp["dir"], "input_bytes": inp["bytes"], "tokenizer": tok_path, "vocab_size": vocab,
            "workers": args.workers, "decontam": False, "buckets": args.dt_buckets, "hashes": args.dt_hashes,
            "datatrove_filters": datatrove_filter_args()}
    _log(f"tokenizer: {tok_path} (vocab {vocab}); workers: {args.workers}; CPUs here: {os.cpu_count()}")

    rows: dict[str, dict] = {}
    for side in sides:
        python = sys.executable if side == "densetrain" else dt_python
        res = run_side(side, side, python, spec, work)
        if res:
            rows[side] = res
    extra = []
    if args.with_decontam and "densetrain" in sides:
        extra.append(("densetrain+decontam", "densetrain", sys.executable, {**spec, "decontam": True}))
    if args.dt_no_alpha_rule and "datatrove" in sides:
        fa = json.loads(json.dumps(spec["datatrove_filters"]))
        fa["gopher_quality"]["max_non_alpha_words_ratio"] = None
        extra.append(("datatrove-noalpha", "datatrove", dt_python, {**spec, "datatrove_filters": fa}))
    for name, side, python, sp in extra:
        res = run_side(name, side, python, sp, work)
        if res:
            rows[name] = res
    if not rows:
        return 1
    text = report(rows, inp)
    print("\n" + text, flush=True)
    out = {"input": {k: v for k, v in inp.items() if k != "params"}, "tokenizer": tok_path, "workers": args.workers,
           "cpus": os.cpu_count(), "sides": rows, "table": text}
    path = work / f"results-{args.target_bytes / 1e6:g}MB.json"
    path.write_text(json.dumps(out, indent=1))
    _log(f"results: {path}")
    return 0 if len(rows) == len(sides) + len(extra) else 1


# ==================================================================================================
# Child: one side, timed (densetrain's side in densetrain's environment, datatrove's in its own)
# ==================================================================================================


def _cpu() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def side_main(side: str, spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    run, collect = (_densetrain if side == "densetrain" else _datatrove)(spec, out)  # imports + setup, untimed
    cpu0, t0 = _cpu(), time.perf_counter()
    state = run()
    wall, cpu = time.perf_counter() - t0, _cpu() - cpu0
    res = collect(state)
    res.update({"wall_s": wall, "cpu_s": cpu, "bytes_in": spec["input_bytes"]})
    Path(spec["result"]).write_text(json.dumps(res, indent=1))
    print(f"[bench] {side}: {cpu:.1f} CPU s, {wall:.1f} s wall", flush=True)
    return 0


def _densetrain(spec: dict, out: Path):
    sys.path.insert(0, str(REPO))
    from densetrain.config import Config, SourceConfig, validate
    from densetrain.data.prepare import prepare

    cfg = Config()
    d = cfg.data
    d.corpus_dir, d.shards_dir = spec["input_dir"], str(out)
    d.tokenizer, d.workers = spec["tokenizer"], spec["workers"]
    d.sources = [SourceConfig(name="bench", kind="web", paths=["part-*.jsonl"], format="jsonl",
                              filters=list(FILTERS))]
    d.decontam.enabled = bool(spec["decontam"])
    cfg.model.vocab_size = max(cfg.model.vocab_size, spec["vocab_size"])
    validate(cfg)
    if d.decontam.enabled:  # the index is built once per machine and cached: not part of the per-MB cost
        from densetrain.data.prepare.decontam.build import build_index

        build_index(d.decontam.tasks, d.decontam.ngram, cache_dir=out / ".decontam")

    def run():
        return prepare(cfg, force=True)

    def collect(summary):
        m = json.loads((out / "bench" / "manifest.json").read_text())
        st = m["stats"]
        stages = [("clean (empty)", st["empty_after_cleaning"], {})]
        for name in FILTERS:
            f = st["filters"].get(name, {"documents_removed": 0, "reasons": {}})
            stages.append((name, f["documents_removed"], {k: v["documents"] for k, v in f["reasons"].items()}))
        if st["decontamination"]:
            dc = st["decontamination"]
            stages.append(("decontamination", dc["documents_removed"], dc["per_task"]))
        dd = st["dedup"] or {}
        stages.append(("dedup: exact", dd.get("exact_duplicates_removed", 0), {}))
        stages.append(("dedup: MinHash", dd.get("near_duplicates_removed", 0), {}))
        src = summary["sources"]["bench"]
        return {"docs_in": st["documents_read"], "docs_out": st["documents_kept"],
                "tokens": src["train"]["tokens"] + src["val"]["tokens"], "stages": stages,
                "c4_documents_modified": st["filters"].get("c4", {}).get("documents_modified"),
                "skipped": st["skipped"], "timings": summary["timings"]}

    return run, collect


def _dt_counts(stats_file: Path) -> list[tuple[str, dict]]:
    """``(step name, counters)`` of every step in a datatrove ``stats.json``."""
    steps = json.loads(stats_file.read_text())
    out = []
    for s in steps:
        counters = {k: (v["total"] if isinstance(v, dict) else v) for k, v in s.get("stats", {}).items()}
        out.append((s["name"], counters))
    return out


def _datatrove(spec: dict, out: Path):
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import (
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )
    from datatrove.pipeline.formatters import FTFYFormatter
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens import DocumentTokenizer
    from datatrove.pipeline.writers import JsonlWriter

    fa = spec["datatrove_filters"]
    rep = {**fa["gopher_repetition"], "top_n_grams": tuple(map(tuple, fa["gopher_repetition"]["top_n_grams"])),
           "dup_n_grams": tuple(map(tuple, fa["gopher_repetition"]["dup_n_grams"]))}
    mh = MinhashConfig(n_grams=5, num_buckets=spec["buckets"], hashes_per_bucket=spec["hashes"])
    w = spec["workers"]
    filtered, sigs, buckets, remove, tokens, logs = (
        out / n for n in ("filtered", "signatures", "buckets", "remove_ids", "tokens", "logs"))

    def executor(name, pipeline, tasks):
        return LocalPipelineExecutor(pipeline=pipeline, tasks=tasks, workers=min(w, tasks),
                                     logging_dir=str(logs / name), skip_completed=False, start_method="fork")

    stages = [
        executor("1_filter_signature", [
            JsonlReader(spec["input_dir"], glob_pattern="part-*.jsonl", text_key="text", id_key="id"),
            FTFYFormatter(**fa["ftfy"]),
            GopherRepetitionFilter(**rep),
            GopherQualityFilter(**fa["gopher_quality"]),
            C4QualityFilter(**fa["c4"]),
            FineWebQualityFilter(**fa["fineweb"]),
            JsonlWriter(str(filtered), compression=None),
            MinhashDedupSignature(output_folder=str(sigs), config=mh),
        ], w),
        executor("2_buckets", [MinhashDedupBuckets(input_folder=str(sigs), output_folder=str(buckets), config=mh)],
                 mh.num_buckets),
        executor("3_cluster", [MinhashDedupCluster(input_folder=str(buckets), output_folder=str(remove), config=mh)],
                 1),
        executor("4_dedup_tokenize", [
            JsonlReader(str(filtered), glob_pattern="*.jsonl", text_key="text", id_key="id"),
            MinhashDedupFilter(input_folder=str(remove)),
            DocumentTokenizer(output_folder=str(tokens), tokenizer_name_or_path=spec["tokenizer"], eos_token=EOS),
        ], w),
    ]

    def run():
        for ex in stages:
            ex.run()
        return None

    def collect(_):
        s1 = _dt_counts(logs / "1_filter_signature" / "stats.json")
        s4 = _dt_counts(logs / "4_dedup_tokenize" / "stats.json")
        if len(list(filtered.glob("*.jsonl"))) != w:
            raise RuntimeError(f"{filtered}: expected {w} files (one per task) for the MinhashDedupFilter stage")
        expected = ("Jsonl", "FTFY", "Gopher Repetition", "Gopher Quality", "C4 Quality", "FineWeb Quality")
        if not all(e in name for e, (name, _) in zip(expected, s1)):
            raise RuntimeError(f"unexpected datatrove step order in stats.json: {[n for n, _ in s1]}")
        reader = s1[0][1]  # its documents are counted after empty texts are skipped (none here)
        stages_out = []
        for label, (_, c) in zip(FILTERS, s1[2:6]):  # s1[1] is FTFYFormatter, which drops nothing
            reasons = {k[len("dropped_"):]: v for k, v in c.items() if k.startswith("dropped_")}
            stages_out.append((label, c.get("dropped", 0), reasons))
        dedup, tok = s4[1][1], s4[2][1]
        stages_out.append(("dedup: MinHash", dedup.get("dropped", 0), {}))
        return {"docs_in": reader.get("documents", 0), "docs_out": dedup.get("forwarded", 0),
                "tokens": tok.get("tokens", 0), "stages": stages_out,
                "c4_lines": {k: v for k, v in s1[4][1].items() if k.startswith("line-")}}

    return run, collect


if __name__ == "__main__":
    sys.exit(main())
