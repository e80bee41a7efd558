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

**Order within a source.** Without a shuffle seed a source is read front to back (window ``k``
starts at token ``k * seq_len``), wrapping to its front where the stream ends; an epoch is a pass of
``W = (n - 1) // seq_len`` windows from where the last one stopped (the first starts at token 0).
With ``shuffle_seed`` (the default ``data.shuffle = true``; the seed is ``train.seed``) an epoch of
a source is one pass over its grid of ``W = (n - 1 - o) // seq_len`` windows, with window ``j`` of the epoch starting at
``o + perm(j) * seq_len``, where ``perm`` is a pseudo-random permutation of ``0 .. W-1`` (a
balanced Feistel network with cycle walking, :class:`WindowPermutation`) and ``o`` a start offset,
both keyed by (seed, source, epoch, seq_len) and computed on demand, so the state stays a few
integers per source. Every window is drawn exactly once per epoch and each epoch has another
permutation. The grid leaves ``R = (n - 1) - W * seq_len`` tokens out (``R < seq_len``); the offset
``o`` is drawn from ``0 .. R`` per epoch, so which tokens are left out changes with the epoch and no
token is lost for good (in file order the same tail is never a target).

Windows, not documents, are permuted: a window is still a contiguous span of the stream (documents
inside it stay whole and in order, and document masking sees real boundaries), consecutive samples
of a source come from unrelated places (a 100k-token book is spread over the whole epoch, not fed as
100 consecutive windows), and nothing per document is needed (permuting documents, then packing
them, needs the prefix sums of the permuted lengths: O(documents) memory per source). The price is
the grid: it depends on seq_len, so a stage that changes a source's seq_len ends that source's
current epoch early (logged; its unvisited windows come back in the next epochs' permutations),
whereas a document-level order would carry a token cursor across the change.

**Epochs end at global-batch boundaries** (both orders). A global batch that took the last
windows of one epoch and the first of the next could hold the same window twice (the next
permutation may start with a window the batch already has), and its rows, split over ranks, would
come from two epochs. So before a batch is drawn, a source whose current epoch has fewer windows
left than the batch takes from it starts its next epoch first. Shuffled, the few windows skipped
come back in later permutations, as at a seq_len change; in file order nothing is skipped: the new
epoch goes on from the window where the last stopped (so the stream wraps inside an epoch, not
between two, and no tail is left out for good). Only a source with fewer windows than one batch
takes from it wraps its epoch inside the batch (a repeat is then unavoidable). A seq_len change
starts a new epoch in both orders (in file order the read position stays where it was).
Each :class:`Sample` carries the epoch of its source it was drawn in.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass

import numpy as np

from densetrain.data.shards import TokenFiles
from densetrain.errors import ConfigError


@dataclass
class Sample:
    """One training sequence. ``tokens``: int64 array of shape ``(seq_len + 1,)``; ``start``: token
    offset of the window in its source's train stream (provenance: ``densetrain blame``); ``epoch``:
    the pass over its source the window was drawn in (0-based; the same for every row of a source in
    a global batch, so every rank tags its rows alike)."""

    index: int
    source: str
    tokens: np.ndarray
    start: int = -1
    epoch: int = 0


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finaliser (Steele et al. 2014): a bijective 64-bit avalanche mix."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


class WindowPermutation:
    """A pseudo-random permutation of ``0 .. size-1`` evaluated one index at a time, nothing stored.

    A balanced Feistel network (Luby & Rackoff 1988) on ``2b``-bit integers, ``4^b >= size``, with
    six rounds whose round function is :func:`_mix64` of the half and a round key, is a bijection of
    ``0 .. 4^b - 1``; *cycle walking* (apply it again while the result is ``>= size``; Black &
    Rogaway 2002) restricts it to a bijection of ``0 .. size-1``, in fewer than 4 applications on
    average since ``4^b < 4 size``. Keys come from blake2b of ``key`` (a str), so the permutation is
    the same in every process and Python version.
    """

    ROUNDS = 6

    def __init__(self, size: int, key: str):
        if size < 1:
            raise ValueError(f"cannot permute {size} windows")
        self.size = size
        self.half = max(1, ((size - 1).bit_length() + 1) // 2)  # bits per half: 4^half >= size
        digest = hashlib.blake2b(key.encode(), digest_size=8 * (self.ROUNDS + 1)).digest()
        words = [int.from_bytes(digest[8 * i : 8 * i + 8], "little") for i in range(self.ROUNDS + 1)]
        self.keys, self.extra = words[: self.ROUNDS], words[self.ROUNDS]  # extra: free bits for the caller

    def _feistel(self, x: int) -> int:
        m = (1 << self.half) - 1
        left, right = x >> self.half, x & m
        for k in self.keys:
            left, right = right, left ^ (_mix64(right ^ k) & m)
        return (left << self.half) | right

    def __call__(self, i: int) -> int:
        """The image of ``i`` (``0 <= i < size``)."""
        x = self._feistel(i)
        while x >= self.size:
            x = self._feistel(x)
        return x


UNCHECKED = object()
"""``shuffle_seed`` of :meth:`MixtureSampler.load_state_dict` when the caller has no run order to check (blame)."""


def _order_changed(was: int | None, now: int | None) -> str:
    """The line of a resume whose config draws in another order than the run's sampler state: the key,
    both values, and what to do (the positions are only meaningful in the order they were drawn in)."""
    def order(seed):
        return "in file order (data.shuffle = false)" if seed is None else f"shuffled with train.seed {seed}"

    key = "train.seed" if was is not None and now is not None else "data.shuffle"
    return (f"{key}: the run's data was drawn {order(was)}, this config draws {order(now)}; a run keeps its data "
            f"order: resume without changing {key}, or start a new run (another --train.run_dir) to use it")


class MixtureSampler:
    """Draws samples from named token streams with a per-stage mix.

    Args:
        streams: source name -> :class:`TokenFiles` (train split).

    State (``state_dict()``; plain ints, JSON-serialisable):
        ``samples_seen``: global samples drawn so far.
        ``cursor[src]``: file order: token offset of the next window; shuffled: unused (0).
        ``epoch[src]``: completed passes. ``window[src]`` / ``grid[src]``: windows drawn in the
        current epoch and the seq_len of its window grid (0: none yet).
        ``shuffle_seed``: the order of the draws so far (None: file order; set by the first draw).
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
            "window": {n: 0 for n in names},
            "grid": {n: 0 for n in names},
            "shuffle_seed": None,
            "stage": None,
            "stage_drawn": {n: 0 for n in names},
            "stage_total": 0,
        }
        self.events: list[str] = []  # human-readable notes (epoch wrap-arounds), drained by the loop
        self._perms: dict[tuple, tuple[WindowPermutation, int]] = {}

    def state_dict(self) -> dict:
        return copy.deepcopy(self.state)

    def load_state_dict(self, state: dict, seq_lens: set[int] | None = None, stages: set[str] | None = None,
                        sources: set[str] | None = None, shuffle_seed: int | None | object = UNCHECKED) -> None:
        """Take ``state`` (a :meth:`state_dict`, its types checked by ``dcp_read.check_trainer_state``), checked
        against this run: a position for each source with data and none for a source that is not
        ``sources`` (the configured names; default: those with data); a window grid 0 (none yet) or one of
        ``seq_lens`` (the stages' seq_len) with no more windows drawn than it has; a cursor inside its source;
        a ``stage`` that is null or one of ``stages``; once samples were drawn, the order they were drawn in
        equal to ``shuffle_seed`` (the run's: ``train.seed`` when ``data.shuffle``, None for file order;
        :data:`UNCHECKED`, the default: not checked), which :meth:`next_samples` requires for the rest of the run.

        Raises:
            ConfigError: ``shuffle_seed`` is not the state's order: the line names ``train.seed`` or
                ``data.shuffle``, both values, and that another order needs a new run.
            ValueError: ``sampler.<key>: expected ..., got ...`` (the caller names the file).
        """
        if shuffle_seed is not UNCHECKED and state["samples_seen"] and state.get("shuffle_seed") != shuffle_seed:
            raise ConfigError(_order_changed(state.get("shuffle_seed"), shuffle_seed))
        missing = set(self.streams) - set(state["cursor"])
        if missing:
            raise ValueError(f"sampler state has no position for sources {sorted(missing)} (config changed?)")
        known = set(self.streams) | (sources or set())
        for name in sorted(set(state["cursor"]) - known):
            raise ValueError(f"sampler.cursor.{name}: expected a source of this run ({sorted(known)}), got a "
                             "position for a source it does not have")
        if stages is not None and state.get("stage") not in (None, *stages):
            raise ValueError(f"sampler.stage: expected null or a stage name ({sorted(stages)}), got {state['stage']!r}")
        for name, stream in self.streams.items():
            grid, window = state.get("grid", {}).get(name, 0), state.get("window", {}).get(name, 0)
            if grid and seq_lens is not None and grid not in seq_lens:
                raise ValueError(f"sampler.grid.{name}: expected 0 or a stage's seq_len ({sorted(seq_lens)}), "
                                 f"got {grid}")
            if not grid and window:
                raise ValueError(f"sampler.window.{name}: expected 0 while sampler.grid.{name} is 0 (no window drawn), "
                                 f"got {window}")
            if grid and window > (len(stream) - 1) // grid:
                raise ValueError(f"sampler.window.{name}: expected at most the {(len(stream) - 1) // grid} windows "
                                 f"of {grid} tokens of source '{name}', got {window}")
            if state["cursor"][name] > len(stream):
                raise ValueError(f"sampler.cursor.{name}: expected a token offset 0..{len(stream)}, got "
                                 f"{state['cursor'][name]}")
        state = copy.deepcopy(state)
        for key in ("window", "grid"):  # checkpoints from before shuffling: file order, nothing drawn shuffled
            state.setdefault(key, {n: 0 for n in state["cursor"]})
        state.setdefault("shuffle_seed", None)
        self.state = state

    def epoch_order(self, name: str, epoch: int, seq_len: int, seed: int) -> tuple[WindowPermutation, int]:
        """(permutation of the window indices, start offset) of epoch ``epoch`` of source ``name``
        on the grid of ``seq_len``-token windows: window ``j`` of the epoch starts at token
        ``offset + perm(j) * seq_len`` (module docstring)."""
        key = (name, epoch, seq_len, seed)
        if key not in self._perms:
            n = len(self.streams[name])
            n_windows = (n - 1) // seq_len
            perm = WindowPermutation(n_windows, f"densetrain-order:{seed}:{name}:{epoch}:{seq_len}")
            offset = perm.extra % (n - 1 - n_windows * seq_len + 1)  # 0 .. R, the tokens the grid leaves out
            if len(self._perms) > 64:
                self._perms.clear()
            self._perms[key] = (perm, offset)
        return self._perms[key]

    def _choose(self, mix: dict[str, float], drawn: dict[str, int] | None = None, n: int | None = None) -> str:
        """The source of the next sample (deficit scheduling, module docstring) after ``n`` samples of the
        stage with ``drawn`` per source (default: the state's counts)."""
        st = self.state
        drawn = st["stage_drawn"] if drawn is None else drawn
        n = st["stage_total"] if n is None else n
        best, best_deficit = None, None
        for name in sorted(mix):
            deficit = mix[name] * (n + 1) - drawn.get(name, 0)
            if best_deficit is None or deficit > best_deficit + 1e-12:
                best, best_deficit = name, deficit
        return best

    def _batch_sources(self, n: int, mix: dict[str, float]) -> list[str]:
        """The sources of the next ``n`` samples, in draw order, without drawing them."""
        drawn, total, out = dict(self.state["stage_drawn"]), self.state["stage_total"], []
        for _ in range(n):
            name = self._choose(mix, drawn, total)
            drawn[name] = drawn.get(name, 0) + 1
            total += 1
            out.append(name)
        return out

    def _end_epochs_before_batch(self, names: list[str], seq_len: int, shuffled: bool) -> None:
        """Start the next epoch of each source whose current epoch (on the ``seq_len`` grid) has fewer
        windows left than the coming batch takes from it (module docstring: epochs end at batch boundaries)."""
        st = self.state
        for name in sorted(set(names)):
            need, n_windows = names.count(name), (len(self.streams[name]) - 1) // seq_len
            drawn = st["window"][name]
            if st["grid"][name] == seq_len and 0 < drawn < n_windows and n_windows - drawn < need <= n_windows:
                st["epoch"][name] += 1
                st["window"][name] = 0
                left = (f"{n_windows - drawn} of {n_windows} windows left for later epochs" if shuffled else
                        f"it goes on from token {st['cursor'][name]}, {n_windows - drawn} windows before its pass "
                        f"of {n_windows} was done")
                self.events.append(f"source '{name}' starts epoch {st['epoch'][name]} at sample {st['samples_seen']} "
                                   f"({left}: a global batch holds no window twice and one epoch of a source)")

    def _start_window(self, name: str, seq_len: int) -> None:
        """Epoch bookkeeping before a window of ``name`` is drawn, in either order: a new ``seq_len`` grid
        starts a new epoch (one that was under way ends early), and so does a finished pass (every window of
        the grid drawn: inside a batch only for a source with fewer windows than the batch takes from it)."""
        stream, st = self.streams[name], self.state
        if len(stream) < seq_len + 1:
            raise ValueError(f"source '{name}' has {len(stream)} tokens, fewer than one sequence of {seq_len + 1}")
        grid = st["grid"][name]
        if grid != seq_len:
            if grid:  # a stage changed the window length mid-epoch: a new grid, a new epoch
                n_windows = (len(stream) - 1) // grid
                st["epoch"][name] += 1
                self.events.append(f"source '{name}': window length {grid} -> {seq_len}; epoch "
                                   f"{st['epoch'][name] - 1} ends after {st['window'][name]} of {n_windows} windows, "
                                   f"epoch {st['epoch'][name]} starts at sample {st['samples_seen']}")
            st["grid"][name], st["window"][name] = seq_len, 0
        elif st["window"][name] == (len(stream) - 1) // seq_len:  # every window of the epoch drawn
            st["epoch"][name] += 1
            st["window"][name] = 0
            self.events.append(f"source '{name}' starts epoch {st['epoch'][name]} at sample {st['samples_seen']}")

    def _advance(self, name: str, seq_len: int) -> int:
        """Reserve the next window of ``name`` in file order; return its start offset (tokens)."""
        st = self.state
        self._start_window(name, seq_len)
        if st["cursor"][name] + seq_len + 1 > len(self.streams[name]):
            st["cursor"][name] = 0  # the stream ends: the pass goes on from its front (epochs: _start_window)
        start = st["cursor"][name]
        st["cursor"][name] = start + seq_len
        st["window"][name] += 1
        return start

    def _advance_shuffled(self, name: str, seq_len: int, seed: int) -> int:
        """Reserve the next window of ``name`` in its epoch's permutation; return its start offset."""
        st = self.state
        self._start_window(name, seq_len)
        perm, offset = self.epoch_order(name, st["epoch"][name], seq_len, seed)
        start = offset + perm(st["window"][name]) * seq_len
        st["window"][name] += 1
        return start

    def next_samples(
        self, n: int, stage_name: str, mix: dict[str, float], seq_len: int, keep: range | None = None,
        shuffle_seed: int | None = None,
    ) -> list[Sample]:
        """Draw the next ``n`` global samples for stage ``stage_name`` with weights ``mix``.

        All ``n`` samples advance the state; only those whose position in this draw is in ``keep``
        (default: all) are read from disk and returned, so each rank reads just its own slice.
        ``shuffle_seed`` None reads each source in file order, an int in seeded per-epoch
        permutations (module docstring); it must stay the same for the whole run.

        Raises:
            ValueError: a mix names an unknown source, a source is shorter than one sequence, or
                ``shuffle_seed`` differs from the one the state was drawn with.
        """
        before = copy.deepcopy(self.state)
        drawn = self._draw(n, stage_name, mix, seq_len, keep, shuffle_seed)
        try:
            out = [Sample(index, name, self.streams[name].read(start, seq_len + 1), start, epoch)
                   for index, name, start, epoch in drawn]
        except BaseException:  # a read failed (a store outage, a bad shard): the batch is not drawn
            self.state = before
            raise
        if any(getattr(s, "prefetches", False) for s in self.streams.values()):
            self._hint_next(n, stage_name, mix, seq_len, keep, shuffle_seed)
        return out

    def _draw(self, n: int, stage_name: str, mix: dict[str, float], seq_len: int, keep: range | None,
              shuffle_seed: int | None) -> list[tuple[int, str, int, int]]:
        """The state change of :meth:`next_samples` without its reads: ``(index, source, start, epoch)`` of the
        kept samples. Raises: as next_samples."""
        unknown = set(mix) - set(self.streams)
        if unknown:
            raise ValueError(f"mix names sources without data: {sorted(unknown)}")
        st = self.state
        if st["samples_seen"] == 0:
            st["shuffle_seed"] = shuffle_seed
        elif st["shuffle_seed"] != shuffle_seed:
            raise ValueError(f"the sampler state was drawn with shuffle seed {st['shuffle_seed']}, not {shuffle_seed} "
                             "(data.shuffle or train.seed changed since the checkpoint?)")
        if st["stage"] != stage_name:  # new stage: the deficit scheduler starts afresh
            st["stage"] = stage_name
            st["stage_drawn"] = {k: 0 for k in st["stage_drawn"]}
            st["stage_total"] = 0
        out = []
        keep = range(n) if keep is None else keep
        self._end_epochs_before_batch(self._batch_sources(n, mix), seq_len, shuffle_seed is not None)
        for i in range(n):
            name = self._choose(mix)
            if shuffle_seed is None:
                start = self._advance(name, seq_len)
            else:
                start = self._advance_shuffled(name, seq_len, shuffle_seed)
            if i in keep:
                out.append((st["samples_seen"], name, start, st["epoch"][name]))
            st["stage_drawn"][name] = st["stage_drawn"].get(name, 0) + 1
            st["stage_total"] += 1
            st["samples_seen"] += 1
        return out

    def _hint_next(self, *args) -> None:
        """Tell the streams which windows the next :meth:`next_samples` with the same arguments (the same stage)
        will read, so that a stream of remote shards fetches them in the background while this batch trains
        (:meth:`TokenFiles.prefetch`); drawn on a copy of the state, which stays as it is."""
        ghost = copy.copy(self)
        ghost.state, ghost.events = copy.deepcopy(self.state), []
        try:
            drawn = ghost._draw(*args)
        except ValueError:  # the next call will say it
            return
        for _, name, start, _ in drawn:
            self.streams[name].prefetch(start, args[3] + 1)
