"""Scale-out: one source's ``densetrain prepare`` as a datatrove pipeline (local, Slurm or Ray).

``densetrain prepare`` runs on one machine. Past it, the same work runs on datatrove's executors
(:func:`datatrove_pipeline`): each *stage* is a datatrove ``PipelineExecutor`` running ``tasks``
independent tasks (Slurm array jobs, Ray tasks, or local processes), and the stages depend on each
other in order. For one source ``data.sources[i]`` with exact and near dedup on::

    stage                tasks        steps (per task)
    map                  tasks        SourceReader -> DocumentMap -> ParquetWriter(work/documents)
                                      -> ExactDedupSignature
    exact_find           1            ExactFindDedups
    minhash_signatures   tasks        TaskFileReader(work/documents) -> ExactDedupFilter
                                      -> MinhashDedupSignature
    minhash_buckets      bands        MinhashDedupBuckets   (one task per LSH band)
    minhash_cluster      1            MinhashDedupCluster
    tokenize             tasks        TaskFileReader -> ExactDedupFilter -> MinhashDedupFilter
                                      -> HoldOut(val) -> DocumentTokenizer(output/train)

What stays ours: reading (:func:`densetrain.data.prepare.readers.sources.iter_documents`: every format, bad-record
handling, document ids and provenance), cleaning, the quality filters and decontamination
(:class:`DocumentMap`), the exact-dedup normalisation and the MinHash word splitting
(:mod:`densetrain.data.prepare.dedup`), and the tokenizer file. What is datatrove's: task scheduling,
retries and completion markers (re-running skips finished tasks), statistics, the exact and MinHash
dedup stages and the tokenizer writer. Only the per-document work is ours; dedup needs a global
view and therefore runs as datatrove's multi-stage dedup, never inside a task.

Reader. :class:`SourceReader` wraps ``iter_documents`` rather than using datatrove's
JsonlReader/ParquetReader: those would bypass our bad-input rules (a malformed line or invalid
UTF-8 is counted with ``file:line`` instead of stopping the task), our ``doc_id``/provenance and the
formats datatrove has no reader for (paragraphs, ``save_to_disk`` folders, zstd JSONL). Files are
split over tasks as datatrove's readers do (``files[rank::world_size]``).

Dedup differences from ``densetrain prepare`` (documented, measured in tests/test_scale.py):

* exact dedup hashes the same normalised text (:func:`densetrain.data.prepare.dedup.normalize`), so the
  same exact duplicates go; which copy is kept can differ (datatrove keeps one by hash order,
  ``prepare`` the first read).
* near dedup uses datatrove's own MinHash (sha1-64 shingles, its permutations) with our
  ``ngram`` / ``bands`` / ``rows`` / ``seed`` and our word splitting (:class:`DedupWordTokenizer`,
  so no spaCy/NLTK is needed). datatrove does not verify LSH candidates against
  ``data.dedup.threshold`` (every pair sharing a band is a duplicate, as in FineWeb) and does not
  sign documents with fewer than ``ngram`` words (exact dedup still covers those). It therefore
  removes more: on 16 MB of stdlib source files with 14 x 8 bands it removed 54 near duplicates
  where ``prepare`` removed 18, 63% of them below an estimated Jaccard of 0.8 (lowest 0.64); on
  the prose corpus of tests/test_scale.py 15 against 12. Filtered and exact-duplicate documents
  are identical between the two paths (tested).

Output (``output_dir``), a folder densetrain trains on as a ``format = "datatrove"`` source::

    output_dir/train/NNNNN_doc_shuffled.ds (+ .ds.index, .ds.metadata)   DocumentTokenizer, per task
    output_dir/val/...                                                   the held-out documents
    output_dir/tokenizer.identity.json                                   sha256 etc. of the tokenizer

Work files (``work_dir``, default ``output_dir/../<output name>.work``): the filtered documents
(``documents/``), removed documents with their reason (``removed/map``, ``removed/exact``,
``removed/near``), dedup signatures, and datatrove's logs, stats and completion markers
(``logs/<stage>/``). On a cluster, ``output_dir``, ``work_dir``, the corpus and the tokenizer file
must be on storage every node sees (a shared file system; datatrove also takes ``s3://`` etc. for
output and work folders).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from datatrove.pipeline.dedup import MinhashDedupBuckets, MinhashDedupCluster, MinhashDedupFilter, MinhashDedupSignature
from datatrove.pipeline.dedup.exact_dedup import (
    ExactDedupConfig,
    ExactDedupFilter,
    ExactDedupSignature,
    ExactFindDedups,
)

from densetrain.config import load_config, parse_overrides
from densetrain.data.prepare.decontam.build import build_index
from densetrain.data.prepare.process import ProcessSpec
from densetrain.data.prepare.readers.paths import resolve_paths
from densetrain.data.prepare.scale.steps import (
    HASH_CONFIG,
    DedupWordTokenizer,
    DocumentMap,
    HoldOut,
    SourceReader,
    TaskFileReader,
    TokenizeStep,
    document_template,
    document_writer,
    exact_content,
    minhash_config,
)
from densetrain.data.shards import SHARD_MAX_TOKENS, token_dtype, token_size_for
from densetrain.data.tokenizer import load_tokenizer
from densetrain.errors import ConfigError, DataError

EXECUTORS = ("local", "slurm", "ray")


@dataclass
class ScaleOutPipeline:
    """The configured stages of one source (see the module docstring).

    Attributes:
        stages: stage name -> datatrove executor, in run order; each depends on the previous one.
        output_dir: the tokenized folder (``train/``, ``val/``, identity file) to register as a
            ``format = "datatrove"`` source.
        work_dir: intermediate files, removed documents and datatrove logs (``logs/<stage>``).
    """

    stages: dict = field(default_factory=dict)
    output_dir: str = ""
    work_dir: str = ""

    def run(self):
        """Run every stage: locally in order, or submitted with dependencies (Slurm jobs, Ray).

        The last stage launches its dependencies first (datatrove's ``depends`` chain); finished
        tasks of an earlier run are skipped (completion markers in ``work_dir/logs``).
        """
        return list(self.stages.values())[-1].run()


def _executor_class(executor: str):
    # Imported on demand: the Slurm and Ray executors pull in their own optional dependencies (ray).
    if executor == "local":
        from datatrove.executor import LocalPipelineExecutor

        return LocalPipelineExecutor
    if executor == "slurm":
        from datatrove.executor import SlurmPipelineExecutor

        return SlurmPipelineExecutor
    if executor == "ray":
        from datatrove.executor import RayPipelineExecutor

        return RayPipelineExecutor
    raise ConfigError(f"executor must be one of {', '.join(EXECUTORS)}, got '{executor}'")


def datatrove_pipeline(
    cfg,
    source_index: int,
    output_dir: str,
    work_dir: str | None = None,
    tasks: int = 4,
    workers: int = -1,
    executor: str = "local",
    bucket_workers: int = 1,
    stage_kwargs: dict | None = None,
    **executor_kwargs,
) -> ScaleOutPipeline:
    """Map ``data.sources[source_index]`` of a prepare config onto datatrove executors.

    Args:
        cfg: a :class:`densetrain.config.Config`; reads ``data`` (corpus_dir, the source, filters,
            dedup, decontam, tokenizer, val_fraction, max_val_tokens, seed, max_document_bytes).
        source_index: which source.
        output_dir: where the token files go (``train/``, ``val/``); local path or fsspec URL.
        work_dir: intermediate files and logs; default ``<output_dir>.work`` next to it.
        tasks: tasks of the per-document stages (map, signatures, tokenize). Input files are split
            over tasks, so more tasks than files leaves tasks idle.
        workers: tasks run at once (local/Ray; -1 = all); on Slurm, the array's parallelism.
        executor: ``'local'`` (LocalPipelineExecutor), ``'slurm'`` (SlurmPipelineExecutor; pass
            ``time=`` and ``partition=``) or ``'ray'`` (RayPipelineExecutor; needs ``ray``).
        bucket_workers: tasks per LSH band in ``minhash_buckets`` (that stage has
            ``bands * bucket_workers`` tasks).
        stage_kwargs: per-stage overrides of executor arguments, e.g. ``{'minhash_cluster':
            {'mem_per_cpu_gb': 16}}``.
        **executor_kwargs: passed to every stage's executor (e.g. ``partition``, ``time``,
            ``cpus_per_task``, ``mem_per_cpu_gb``, ``venv_path``, ``start_method``).

    Returns:
        A :class:`ScaleOutPipeline`; nothing runs until its ``run()``.

    Raises:
        ConfigError: bad index, executor, task counts, or a tiktoken ``data.tokenizer``
            (datatrove's DocumentTokenizer runs HF tokenizer.json files only).
        DataError: the source's inputs or the tokenizer file are missing.
    """
    data = cfg.data
    if not 0 <= source_index < len(data.sources):
        raise ConfigError(f"source_index {source_index} out of range: data.sources has {len(data.sources)} entries")
    src = data.sources[source_index]
    key = f"data.sources[{source_index}]"
    if src.format == "datatrove":
        raise ConfigError(f"{key} ('{src.name}') is already tokenized (format 'datatrove'); nothing to run")
    if tasks < 1 or bucket_workers < 1:
        raise ConfigError(f"tasks and bucket_workers must be >= 1, got {tasks} and {bucket_workers}")
    cls = _executor_class(executor)
    missing = [k for k in ("time", "partition") if executor == "slurm" and k not in executor_kwargs]
    if missing:
        raise ConfigError(f"executor 'slurm' needs {' and '.join(missing)}= (e.g. time='4:00:00', partition='cpu')")
    tok = load_tokenizer(data.tokenizer, data.shards_dir)
    if tok.kind != "hf":
        raise ConfigError(f"data.tokenizer='{data.tokenizer}': the datatrove pipeline tokenizes with "
                          "DocumentTokenizer, which needs a tokenizer.json ('bpe' after a first prepare, or a path)")
    resolve_paths(src, Path(data.corpus_dir), source_index)  # missing inputs fail here, not in a task

    # Plain "/"-joined strings: local paths (made absolute: tasks may start in another directory)
    # and fsspec URLs (s3://...) alike.
    out = _absolute(output_dir)
    wd = _absolute(work_dir) if work_dir is not None else f"{out}.work"
    w = lambda sub: f"{wd}/{sub}"  # noqa: E731

    decontam = None
    if data.decontam.enabled:
        # Built once here; tasks load the cache file, so work_dir must be visible to every node.
        decontam = str(build_index(data.decontam.tasks, data.decontam.ngram, cache_dir=w("decontam")).path)
    spec = ProcessSpec(kind=src.kind, filters=list(src.filters), fix_text=src.fix_text, filter_params=data.filters,
                       dedup=None, decontam_path=decontam, tokenizer_spec=data.tokenizer,
                       shards_dir=str(data.shards_dir), token_dtype=token_dtype(token_size_for(tok.vocab_size)).str,
                       key=key)

    dcfg = data.dedup
    exact = src.dedup and dcfg.exact
    near = src.dedup and dcfg.near
    mh = minhash_config(dcfg) if near else None
    ex = ExactDedupConfig(content_getter=exact_content, hash_config=HASH_CONFIG) if exact else None
    words = DedupWordTokenizer()
    tok_path = str(Path(tok.name).resolve())  # tasks may run in another working directory

    documents = lambda: TaskFileReader(w("documents"))  # noqa: E731
    removed = lambda sub: document_writer(w(f"removed/{sub}"))  # noqa: E731
    map_steps = [
        SourceReader(src, _absolute(str(data.corpus_dir)), source_index, data.max_document_bytes),
        DocumentMap(spec, exclusion_writer=removed("map")),
        document_writer(w("documents")),
    ]
    plan: list[tuple[str, list, int]] = []
    if exact:
        map_steps.append(ExactDedupSignature(w("exact/signatures"), config=ex))
        find = ExactFindDedups(w("exact/signatures"), w("exact/duplicates"), config=ex)
        plan += [("map", map_steps, tasks), ("exact_find", [find], 1)]
        if near:
            sign = MinhashDedupSignature(w("minhash/signatures"), config=mh, language=words)
            plan.append(("minhash_signatures", [documents(), ExactDedupFilter(w("exact/duplicates"), config=ex), sign],
                         tasks))
    elif near:
        map_steps.append(MinhashDedupSignature(w("minhash/signatures"), config=mh, language=words))
        plan.append(("map", map_steps, tasks))
    else:
        plan.append(("map", map_steps, tasks))
    if near:
        plan += [("minhash_buckets", [MinhashDedupBuckets(w("minhash/signatures"), w("minhash/buckets"), config=mh)],
                  mh.num_buckets * bucket_workers),
                 ("minhash_cluster", [MinhashDedupCluster(w("minhash/buckets"), w("minhash/remove"), config=mh)], 1)]

    def tokenizer(sub: str, identity: bool) -> TokenizeStep:
        return TokenizeStep(f"{out}/{sub}", tokenizer_name_or_path=tok_path, eos_token=tok.eos_token, seed=data.seed,
                            post_processor=document_template(tok),
                            max_tokens_per_file=SHARD_MAX_TOKENS, identity=tok.identity() if identity else None,
                            identity_folder=out if identity else None)

    final = [documents()]
    if exact:
        final.append(ExactDedupFilter(w("exact/duplicates"), config=ex, exclusion_writer=removed("exact")))
    if near:
        final.append(MinhashDedupFilter(w("minhash/remove"), exclusion_writer=removed("near")))
    final += [HoldOut(tokenizer("val", False), data.val_fraction, data.max_val_tokens, data.seed),
              tokenizer("train", True)]
    plan.append(("tokenize", final, tasks))

    stage_kwargs = stage_kwargs or {}
    unknown = set(stage_kwargs) - {name for name, _, _ in plan}
    if unknown:
        raise ConfigError(f"stage_kwargs: unknown stage(s) {sorted(unknown)}; stages are {[n for n, _, _ in plan]}")
    stages, prev = {}, None
    for name, steps, n in plan:
        kw = {"logging_dir": w(f"logs/{name}"), "depends": prev, **executor_kwargs, **stage_kwargs.get(name, {})}
        if executor == "slurm":
            kw.setdefault("job_name", f"{src.name}-{name}")
        kw.setdefault("workers", min(workers, n) if workers > 0 else -1)
        prev = stages[name] = cls(steps, tasks=n, **kw)
    return ScaleOutPipeline(stages=stages, output_dir=out, work_dir=wd)


def _absolute(path: str) -> str:
    """A local path made absolute; a URL (``s3://...``) as is; no trailing slash."""
    return path.rstrip("/") if "://" in path else str(Path(path).expanduser().resolve())


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """``python -m densetrain.data.prepare.scale --config FILE --source NAME --output DIR [options] [overrides]``.

    Overrides: ``--section.key=value`` config overrides as for every densetrain command;
    ``--executor.KEY=VALUE`` executor arguments for every stage (``--executor.partition=cpu
    --executor.time=4:00:00``); ``--stage.NAME.KEY=VALUE`` for one stage
    (``--stage.minhash_cluster.mem_per_cpu_gb=16``). Values are TOML, else strings.
    """
    p = argparse.ArgumentParser(prog="python -m densetrain.data.prepare.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default=None, help="preset under the config file (default: tiny without --config; "
                                                  "with --config only when given, as for densetrain train)")
    p.add_argument("--config", help="TOML config file: the whole config, or over --preset when that is given")
    p.add_argument("--source", required=True, help="name of the data.sources entry to process")
    p.add_argument("--output", required=True, help="tokenized output folder (then a format='datatrove' source)")
    p.add_argument("--work", default=None, help="intermediate files and logs (default OUTPUT.work)")
    p.add_argument("--executor", default="local", choices=EXECUTORS)
    p.add_argument("--tasks", type=int, default=4)
    p.add_argument("--workers", type=int, default=-1)
    p.add_argument("--bucket-workers", type=int, default=1)
    a, rest = p.parse_known_args(argv)
    try:
        pairs = parse_overrides(rest)
        kw = {k.split(".", 1)[1]: v for k, v in pairs if k.startswith("executor.")}
        stage_kw: dict = {}
        for k, v in pairs:
            if k.startswith("stage."):
                name, _, arg = k[len("stage."):].partition(".")
                stage_kw.setdefault(name, {})[arg] = v
        cfg = load_config(preset=a.preset or (None if a.config else "tiny"), path=a.config,
                          overrides=[(k, v) for k, v in pairs if not k.startswith(("executor.", "stage."))])
        names = [s.name for s in cfg.data.sources]
        if a.source not in names:
            raise ConfigError(f"--source '{a.source}' is not among data.sources {names}")
        pipe = datatrove_pipeline(cfg, names.index(a.source), a.output, a.work, tasks=a.tasks, workers=a.workers,
                                  executor=a.executor, bucket_workers=a.bucket_workers, stage_kwargs=stage_kw, **kw)
    except (ConfigError, DataError) as e:  # one line and exit status 2, as the densetrain command
        print(f"densetrain: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"[scale] stages: {', '.join(f'{n} ({e.world_size} tasks)' for n, e in pipe.stages.items())}", flush=True)
    pipe.run()
    print(f"[scale] output: {pipe.output_dir}  (a source with format = \"datatrove\" and paths = [that folder])")

