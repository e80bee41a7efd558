"""Greedy samples per source at the end of a run: does the model write text that looks like each
source? The prompt is the start of the first held-out document of the source (``prompt_tokens``
tokens after the start token, as documents follow an EOS in training); the continuation is greedy
(:func:`densetrain.evals.generative.greedy_generate`, KV cache), ``new_tokens`` long."""

from __future__ import annotations

import contextlib

import torch

from densetrain.data.shards import TokenFiles
from densetrain.evals.generative import greedy_generate
from densetrain.evals.scoring import eval_mode, start_token


@torch.no_grad()
def source_samples(model: torch.nn.Module, tokenizer, streams: dict[str, TokenFiles], prompt_tokens: int,
                   new_tokens: int, device: torch.device,
                   autocast: contextlib.AbstractContextManager | None = None) -> dict[str, dict[str, str]]:
    """``{source: {"prompt": text, "continuation": text}}`` for every source with a held-out document.

    Every rank computes the same (the same prompts, the same greedy decoding), so callers may run it on
    every rank without collectives; only rank 0 prints.
    """
    names = [s for s in sorted(streams) if streams[s].n_docs]
    prompts = []
    for s in names:
        doc = streams[s].document(0)[:-1].tolist()  # without its EOS
        prompts.append([start_token(tokenizer), *doc[:prompt_tokens]])
    with eval_mode(model) as m:
        outs = greedy_generate(m, prompts, new_tokens, device, tokenizer.eos_id, batch_size=len(prompts) or 1,
                               autocast=autocast, vocab_size=tokenizer.vocab_size)
    return {s: {"prompt": tokenizer.decode(p[1:]), "continuation": tokenizer.decode(o)}
            for s, p, o in zip(names, prompts, outs)}
