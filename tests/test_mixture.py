"""Mixture sampler: realised proportions, resumable state, rank slicing, epoch wrap-around."""

import numpy as np
import pytest

from densetrain.data.mixture import MixtureSampler
from densetrain.data.shards import TokenFiles, write_shard


def _streams(tmp_path, sizes):
    out = {}
    for k, (name, n) in enumerate(sizes.items()):
        d = tmp_path / name
        d.mkdir()
        # Distinct token ranges per source so a window's origin is visible in its values.
        docs = [np.arange(k * 10_000, k * 10_000 + n // 2), np.arange(k * 10_000 + n // 2, k * 10_000 + n)]
        write_shard(d / "000000", docs, token_size=4)
        out[name] = TokenFiles(d)
    return out


def test_realised_mix_within_one_percent_over_a_million_tokens(tmp_path):
    streams = _streams(tmp_path, {"a": 9000, "b": 9000, "c": 9000})
    s = MixtureSampler(streams)
    mix = {"a": 0.5, "b": 0.3, "c": 0.2}
    seq_len = 128
    counts = {k: 0 for k in mix}
    n = 1_000_000 // seq_len
    for _ in range(n // 64):
        for smp in s.next_samples(64, "main", mix, seq_len):
            counts[smp.source] += 1
            assert smp.tokens.shape == (seq_len + 1,)
    total = sum(counts.values())
    for k, w in mix.items():
        assert abs(counts[k] / total - w) < 0.01
    # Small sources were re-read (upsampled); each wrap is reported.
    assert s.state["epoch"]["a"] > 0
    assert any("source 'a' starts epoch 1" in e for e in s.events)


def test_state_restore_continues_the_same_stream(tmp_path):
    streams = _streams(tmp_path, {"a": 5000, "b": 3000})
    mix = {"a": 0.7, "b": 0.3}
    ref = MixtureSampler(streams)
    first = ref.next_samples(13, "main", mix, 64)
    state = ref.state_dict()
    cont = ref.next_samples(40, "main", mix, 64)
    other = MixtureSampler(streams)
    other.load_state_dict(state)
    again = other.next_samples(40, "main", mix, 64)
    assert [x.index for x in again] == list(range(13, 53))
    assert [x.source for x in again] == [x.source for x in cont]
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(again, cont))
    assert first[0].index == 0


def test_rank_slices_partition_the_global_batch(tmp_path):
    streams = _streams(tmp_path, {"a": 5000, "b": 3000})
    mix = {"a": 0.5, "b": 0.5}
    full = MixtureSampler(streams).next_samples(8, "main", mix, 32)
    r0 = MixtureSampler(streams).next_samples(8, "main", mix, 32, keep=range(0, 4))
    r1 = MixtureSampler(streams).next_samples(8, "main", mix, 32, keep=range(4, 8))
    assert [x.index for x in r0 + r1] == [x.index for x in full]
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(r0 + r1, full))


def test_consecutive_windows_overlap_by_one_token(tmp_path):
    streams = _streams(tmp_path, {"a": 1000})
    a, b = MixtureSampler(streams).next_samples(2, "main", {"a": 1.0}, 16)
    assert a.tokens[-1] == b.tokens[0]
    assert np.array_equal(a.tokens, np.arange(17))


def test_unknown_source_in_mix(tmp_path):
    s = MixtureSampler(_streams(tmp_path, {"a": 1000}))
    with pytest.raises(ValueError, match="without data"):
        s.next_samples(1, "main", {"zz": 1.0}, 8)
