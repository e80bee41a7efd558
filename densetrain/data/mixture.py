"""Deterministic, resumable mixture sampler over per-source token streams.

Each source is one concatenated token stream (its ``train`` shards, documents separated by EOS).
A *sample* is a window of ``seq_len + 1`` tokens (inputs are the first ``seq_len``, targets the
last ``seq_len``); consecutive windows of a source overlap by one token, so every token of the
stream is a target exactly once per epoch. Windows cross document boundaries (standard packing, as
in GPT-2 / nanoGPT); the EOS token tells the model a new document starts.

Which source sample ``n`` of a stage comes from is chosen by deficit scheduling: the source with the
largest ``weight * (n + 1) - drawn_so_far`` wins (ties by name order). The realised mix therefore
never differs from the weights by more than one sample per source, over any prefix, and no random
draw is needed: the whole state is a handful of integers that go into checkpoints as JSON.

Global samples are numbered 0, 1, 2, ... in consumption order independent of the number of ranks:
every rank runs the same sampler and keeps its own contiguous slice of each global batch, so a
1-process and an N-process run see exactly the same data per optimizer step.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from densetrain.data.shards import TokenFiles


@dataclass
class Sample:
    """One training sequence. ``tokens``: int64 array of shape ``(seq_len + 1,)``."""

    index: int
    source: str
    tokens: np.ndarray


class MixtureSampler:
    """Draws samples from named token streams with a per-stage mix.

    Args:
        streams: source name -> :class:`TokenFiles` (train split).

    State (``state_dict()``; plain ints, JSON-serialisable):
        ``samples_seen``: global samples drawn so far.
        ``cursor[src]``: token offset of the next window in each source; ``epoch[src]``: completed passes.
        ``stage``: stage the per-stage counts refer to; ``stage_drawn[src]`` / ``stage_total``:
        samples drawn in that stage (the deficit scheduler's memory).
    """

    def __init__(self, streams: dict[str, TokenFiles]):
        self.streams = streams
        names = sorted(streams)
        self.state = {
            "samples_seen": 0,
            "cursor": {n: 0 for n in names},
            "epoch": {n: 0 for n in names},
            "stage": None,
            "stage_drawn": {n: 0 for n in names},
            "stage_total": 0,
        }
        self.events: list[str] = []  # human-readable notes (epoch wrap-arounds), drained by the loop

    def state_dict(self) -> dict:
        return copy.deepcopy(self.state)

    def load_state_dict(self, state: dict) -> None:
        missing = set(self.streams) - set(state["cursor"])
        if missing:
            raise ValueError(f"sampler state has no position for sources {sorted(missing)} (config changed?)")
        self.state = copy.deepcopy(state)

    def _choose(self, mix: dict[str, float]) -> str:
        st = self.state
        n = st["stage_total"]
        best, best_deficit = None, None
        for name in sorted(mix):
            deficit = mix[name] * (n + 1) - st["stage_drawn"].get(name, 0)
            if best_deficit is None or deficit > best_deficit + 1e-12:
                best, best_deficit = name, deficit
        return best

    def _advance(self, name: str, seq_len: int) -> int:
        """Reserve the next window of ``name``; return its start offset (tokens)."""
        stream = self.streams[name]
        st = self.state
        if len(stream) < seq_len + 1:
            raise ValueError(f"source '{name}' has {len(stream)} tokens, fewer than one sequence of {seq_len + 1}")
        if st["cursor"][name] + seq_len + 1 > len(stream):
            # Out of data: start the next epoch of this source (upsampling); logged by the loop.
            st["cursor"][name] = 0
            st["epoch"][name] += 1
            self.events.append(f"source '{name}' starts epoch {st['epoch'][name]} at sample {st['samples_seen']}")
        start = st["cursor"][name]
        st["cursor"][name] = start + seq_len
        return start

    def next_samples(
        self, n: int, stage_name: str, mix: dict[str, float], seq_len: int, keep: range | None = None
    ) -> list[Sample]:
        """Draw the next ``n`` global samples for stage ``stage_name`` with weights ``mix``.

        All ``n`` samples advance the state; only those whose position in this draw is in ``keep``
        (default: all) are read from disk and returned, so each rank reads just its own slice.

        Raises:
            ValueError: a mix names an unknown source, or a source is shorter than one sequence.
        """
        unknown = set(mix) - set(self.streams)
        if unknown:
            raise ValueError(f"mix names sources without data: {sorted(unknown)}")
        st = self.state
        if st["stage"] != stage_name:  # new stage: the deficit scheduler starts afresh
            st["stage"] = stage_name
            st["stage_drawn"] = {k: 0 for k in st["stage_drawn"]}
            st["stage_total"] = 0
        out = []
        keep = range(n) if keep is None else keep
        for i in range(n):
            name = self._choose(mix)
            start = self._advance(name, seq_len)
            if i in keep:
                out.append(Sample(st["samples_seen"], name, self.streams[name].read(start, seq_len + 1)))
            st["stage_drawn"][name] = st["stage_drawn"].get(name, 0) + 1
            st["stage_total"] += 1
            st["samples_seen"] += 1
        return out
