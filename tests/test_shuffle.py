"""Shuffled data order (densetrain/data/mixture.py): every window once per epoch, epochs differ, the tail
rotates, resume and rank slices give the identical sequence, the realised mix stays within one sample."""

from __future__ import annotations

import json

import numpy as np
import pytest

from densetrain.data.mixture import MixtureSampler, WindowPermutation
from densetrain.data.shards import TokenFiles, write_shard

SEED = 7


def streams(tmp_path, sizes: dict[str, int]) -> dict[str, TokenFiles]:
    out = {}
    for k, (name, n) in enumerate(sizes.items()):
        (tmp_path / name).mkdir()
        # token value = offset in the source (+ 1e5 per source): a window's start is its first token
        write_shard(tmp_path / name / "000000", [np.arange(n) + 100_000 * k], token_size=4)
        out[name] = TokenFiles(tmp_path / name)
    return out


@pytest.mark.parametrize("size", [1, 2, 3, 5, 17, 64, 1000, 4097])
def test_window_permutation_is_a_bijection(size):
    p = WindowPermutation(size, f"k{size}")
    assert sorted(p(i) for i in range(size)) == list(range(size))
    if size >= 17:
        assert [p(i) for i in range(size)] != list(range(size))


def test_two_epochs_every_window_once_epochs_differ_tail_rotates(tmp_path):
    n, seq = 1000, 32  # 31 windows of 32 targets; R = 999 - 992 = 7 tokens left out per epoch
    s = MixtureSampler(streams(tmp_path, {"a": n}))
    got = [smp.tokens for smp in s.next_samples(62, "main", {"a": 1.0}, seq, shuffle_seed=SEED)]
    epochs = [got[:31], got[31:]]
    orders = []
    for ep in epochs:
        starts = [int(t[0]) for t in ep]
        offset = min(starts) % seq
        assert sorted(starts) == [offset + j * seq for j in range(31)]  # every window exactly once
        targets = np.concatenate([t[1:] for t in ep])
        assert np.array_equal(np.sort(targets), np.arange(offset + 1, offset + 1 + 31 * seq))  # each token once
        orders.append([(x - offset) // seq for x in starts])
    assert orders[0] != orders[1]
    assert s.state["epoch"]["a"] == 1 and any("source 'a' starts epoch 1" in e for e in s.events)
    # over epochs the offset takes several values in 0..7, so no tail token is left out for good
    offsets = set()
    for _ in range(12):  # epochs 2..13
        offsets.add(min(int(x.tokens[0]) for x in s.next_samples(31, "main", {"a": 1.0}, seq, shuffle_seed=SEED)))
    assert len(offsets) > 1 and offsets <= set(range(8))
    assert all(np.array_equal(t, np.arange(t[0], t[0] + seq + 1)) for t in got)  # contiguous windows


def test_file_order_is_unchanged_without_a_seed(tmp_path):
    s = MixtureSampler(streams(tmp_path, {"a": 200}))
    starts = [int(x.tokens[0]) for x in s.next_samples(8, "main", {"a": 1.0}, 32)]
    assert starts == [0, 32, 64, 96, 128, 160, 0, 32]


def test_resume_mid_epoch_and_two_ranks_give_the_identical_sequence(tmp_path):
    src = streams(tmp_path, {"a": 5000, "b": 3000})
    mix = {"a": 0.7, "b": 0.3}
    ref = MixtureSampler(src)
    whole = [ref.next_samples(8, "main", mix, 64, shuffle_seed=SEED) for _ in range(20)]
    # resume mid-epoch from a JSON round trip of the state after 7 batches
    first = MixtureSampler(src)
    for _ in range(7):
        first.next_samples(8, "main", mix, 64, shuffle_seed=SEED)
    again = MixtureSampler(src)
    again.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert len(json.dumps(again.state_dict())) < 400  # O(1): a few integers per source
    for batch in whole[7:]:
        got = again.next_samples(8, "main", mix, 64, shuffle_seed=SEED)
        assert [(x.index, x.source) for x in got] == [(x.index, x.source) for x in batch]
        assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(got, batch))
    # two ranks, each keeping its half of every global batch
    r0, r1 = MixtureSampler(src), MixtureSampler(src)
    for batch in whole:
        h0 = r0.next_samples(8, "main", mix, 64, keep=range(0, 4), shuffle_seed=SEED)
        h1 = r1.next_samples(8, "main", mix, 64, keep=range(4, 8), shuffle_seed=SEED)
        assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(h0 + h1, batch))
    assert r0.state_dict() == r1.state_dict() == ref.state_dict()


def test_realised_mix_within_one_sample_over_every_prefix(tmp_path):
    src = streams(tmp_path, {"a": 3000, "b": 2000, "c": 700})
    mix = {"a": 0.5, "b": 0.3, "c": 0.2}
    s = MixtureSampler(src)
    counts = dict.fromkeys(mix, 0)
    for n in range(1, 601):
        (smp,) = s.next_samples(1, "main", mix, 16, shuffle_seed=SEED)
        counts[smp.source] += 1
        assert all(abs(counts[k] - w * n) <= 1 for k, w in mix.items()), (n, counts)
    assert s.state["epoch"]["c"] >= 2  # the small source wrapped and kept its share


def test_seq_len_change_starts_a_new_grid_and_a_changed_seed_is_refused(tmp_path):
    s = MixtureSampler(streams(tmp_path, {"a": 4000}))
    s.next_samples(10, "main", {"a": 1.0}, 32, shuffle_seed=SEED)
    long = s.next_samples(3, "long", {"a": 1.0}, 128, shuffle_seed=SEED)
    assert all(len(x.tokens) == 129 for x in long)
    assert s.state["grid"]["a"] == 128 and s.state["epoch"]["a"] == 1 and s.state["window"]["a"] == 3
    assert any("window length 32 -> 128" in e for e in s.events)
    with pytest.raises(ValueError, match="shuffle seed"):
        s.next_samples(1, "long", {"a": 1.0}, 128, shuffle_seed=SEED + 1)
    with pytest.raises(ValueError, match="shuffle seed"):
        s.next_samples(1, "long", {"a": 1.0}, 128)


def test_a_global_batch_never_holds_a_window_twice_and_ranks_agree_on_the_epoch(tmp_path):
    # 89 windows of 16 tokens (+ 5 tokens the grid leaves out) drawn in global batches of 4 over 200 batches
    # (9 epochs): before, an epoch that wrapped inside a batch let the next permutation repeat a window of that
    # batch (seed 0: [644, 260, 228, 644]), and a batch's rows, split over 2 ranks, came from two epochs
    src = streams(tmp_path, {"a": 89 * 16 + 1 + 5})
    mix = {"a": 1.0}
    for seed in range(4):
        r0, r1 = MixtureSampler(src), MixtureSampler(src)
        per_epoch: dict[int, list[int]] = {}
        for _ in range(200):
            h0 = r0.next_samples(4, "main", mix, 16, keep=range(0, 2), shuffle_seed=seed)
            h1 = r1.next_samples(4, "main", mix, 16, keep=range(2, 4), shuffle_seed=seed)
            starts = [x.start for x in h0 + h1]
            assert len(set(starts)) == 4, (seed, starts)
            assert len({x.epoch for x in h0 + h1}) == 1  # both ranks tag the step's rows with one epoch
            per_epoch.setdefault(h0[0].epoch, []).extend(starts)
        assert r0.state_dict() == r1.state_dict()
        assert any("windows left for later epochs" in e for e in r0.events)
        # an epoch ends early only by what a batch could not take: 88 of 89 windows, each once
        for ep, got in list(per_epoch.items())[:-1]:
            assert len(set(got)) == len(got) == 88, (seed, ep, len(got))


def test_a_source_smaller_than_a_batch_still_wraps_inside_it(tmp_path):
    s = MixtureSampler(streams(tmp_path, {"a": 3 * 16 + 1}))  # 3 windows, batches of 8: repeats are unavoidable
    got = s.next_samples(8, "main", {"a": 1.0}, 16, shuffle_seed=SEED)
    assert [x.epoch for x in got] == [0, 0, 0, 1, 1, 1, 2, 2]
    assert sorted(x.start for x in got[:3]) == [0, 16, 32]
