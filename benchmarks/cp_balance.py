"""Load imbalance of context parallelism's head-tail split under document masking, on real document lengths.

    .venv/bin/python benchmarks/cp_balance.py                                   # FineWeb sample, GPT-2 tokens
    .venv/bin/python benchmarks/cp_balance.py --data DIR --seq-lens 8192 --cp 2 4 8

The split (:func:`densetrain.parallel.context.chunk_index`: ``2 cp`` chunks, rank ``i`` holding chunks
``i`` and ``2 cp - 1 - i``) gives every rank the same causal attention work, but with a document mask a
query sees only its own document's earlier keys, so a rank's work depends on where documents begin.
This script packs real documents as training does (each document's tokens then EOS, concatenated, cut
into windows of ``seq_len + 1`` tokens at a stride of ``seq_len``; document ids and positions from
:func:`densetrain.model.masks.document_ids`), counts each rank's query-key pairs per micro-batch
(:func:`densetrain.parallel.context.attention_work`) and prints the ratio of the busiest rank to the
mean: for the attention alone, and for the whole step of a model (``--preset``), whose matmuls are the
same on every rank (``T / cp`` tokens each), with :func:`densetrain.metrics.flops_per_token`'s
convention (``12 * n_layers * d_model`` FLOPs per query-key pair). The causal split's ratio is 1 by
construction; a ratio r means the ranks wait for the busiest one, so the step takes r times the
balanced time (where masked pairs are skipped: FlexAttention's block mask on CUDA; the CPU path's SDPA
computes every pair, balanced or not).

Input: Parquet files with a ``text`` column (default: the FineWeb sample at ``../shared/data/fineweb_sample``,
1,400 documents, not shipped with densetrain), tokenized with ``--tokenizer`` (``gpt2``, offline).

Measured (2026-12-05, AMD EPYC, 2 shared cores, ~12 s; 1,400 FineWeb documents, 2.23M GPT-2 tokens, document
length with its EOS: median 1,080, mean 1,594, p90 3,380): docs/distributed.md, "Load balance with document
masks", has the table this prints (e.g. seq_len 8192, cp 8, one row per micro-batch: attention 1.647 mean,
2.753 worst; a llama3-8b step 1.024 mean, 1.081 worst).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def token_stream(data: Path, tokenizer: str) -> tuple[np.ndarray, int, np.ndarray]:
    """All documents' tokens, each followed by EOS, concatenated: (stream (N,) int64, eos id, document lengths)."""
    import pyarrow.parquet as pq

    from densetrain.data.tokenizer import load_tokenizer

    files = sorted(data.glob("*.parquet"))
    if not files:
        raise SystemExit(f"{data}: no .parquet files (pass --data DIR of Parquet files with a 'text' column)")
    tok = load_tokenizer(tokenizer, ROOT)
    texts = [t for f in files for t in pq.read_table(f, columns=["text"])["text"].to_pylist()]
    docs = tok.encode_batch(texts)
    stream = np.fromiter((i for d in docs for i in (*d, tok.eos_id)), dtype=np.int64)
    return stream, tok.eos_id, np.array([len(d) + 1 for d in docs])


def rank_work(stream: np.ndarray, eos_id: int, seq_len: int, cp: int, micro: int) -> np.ndarray:
    """Query-key pairs per rank and micro-batch: (cp, micro-batches) int64, document-masked."""
    from densetrain.model.masks import document_ids
    from densetrain.parallel.context import attention_work

    n = (len(stream) - 1) // seq_len
    n -= n % micro
    rows = np.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])
    _, pos = document_ids(rows[:, :-1], eos_id)
    work = np.stack([attention_work(pos, r, cp) for r in range(cp)])  # (cp, rows)
    return work.reshape(cp, -1, micro).sum(axis=2)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "fineweb_sample")
    p.add_argument("--tokenizer", default="gpt2")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--micro", type=int, nargs="+", default=[1, 4], help="rows per micro-batch")
    p.add_argument("--preset", default="llama3-8b", help="the model whose step FLOPs weigh the attention")
    a = p.parse_args(argv)

    from densetrain.config import load_config
    from densetrain.metrics import flops_per_token

    model = load_config(preset=a.preset).model
    matmul_per_token = flops_per_token(model, 0)  # the seq_len term is attention's: counted per pair below
    per_pair = 12.0 * model.n_layers * model.d_model
    stream, eos_id, lengths = token_stream(a.data, a.tokenizer)
    print(f"{len(lengths)} documents, {len(stream)} tokens ({a.tokenizer}), document length median "
          f"{int(np.median(lengths))}, mean {lengths.mean():.0f}, p90 {int(np.percentile(lengths, 90))}")
    print(f"busiest rank / mean rank, per micro-batch (mean, p95, worst); causal split: 1.000; step: {a.preset}")
    print(f"{'seq_len':>7} {'cp':>3} {'micro':>5} {'batches':>7}  {'attention mean/p95/max':>24}  "
          f"{'step mean/p95/max':>20}")
    for seq_len in a.seq_lens:
        for cp in a.cp:
            for micro in a.micro:
                work = rank_work(stream, eos_id, seq_len, cp, micro)  # (cp, batches)
                attn = work.max(axis=0) / work.mean(axis=0)
                flops = matmul_per_token * micro * seq_len / cp + per_pair * work
                step = flops.max(axis=0) / flops.mean(axis=0)
                print(f"{seq_len:>7} {cp:>3} {micro:>5} {work.shape[1]:>7}  "
                      f"{attn.mean():>8.3f}{np.percentile(attn, 95):>8.3f}{attn.max():>8.3f}  "
                      f"{step.mean():>7.3f}{np.percentile(step, 95):>7.3f}{step.max():>7.3f}")


if __name__ == "__main__":
    main()
