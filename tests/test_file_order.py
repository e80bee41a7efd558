"""File order (data.shuffle = false, densetrain/data/mixture.py): epochs end at global-batch boundaries as in
the shuffled order, while the stream is still read front to back, wrapping where it ends."""

from __future__ import annotations

from test_shuffle import streams

from densetrain.data.mixture import MixtureSampler


def test_file_order_epochs_end_at_batch_boundaries_and_the_stream_order_is_kept(tmp_path):
    # 11 windows of 16 tokens (+ 3 the grid leaves out), batches of 4 over 2 ranks, 2 sources mixed 3:1 so a
    # batch takes 3 windows of 'a': before, the epoch of 'a' wrapped inside every fourth batch and the ranks
    # tagged one step's rows with two epochs
    src = streams(tmp_path, {"a": 11 * 16 + 1 + 3, "b": 40 * 16 + 1})
    mix = {"a": 0.75, "b": 0.25}
    r0, r1 = MixtureSampler(src), MixtureSampler(src)
    a_starts, a_epochs = [], []
    for _ in range(30):
        h0 = r0.next_samples(4, "main", mix, 16, keep=range(0, 2))
        h1 = r1.next_samples(4, "main", mix, 16, keep=range(2, 4))
        rows = [x for x in h0 + h1 if x.source == "a"]
        assert len({x.epoch for x in rows}) == 1, [(x.start, x.epoch) for x in rows]
        assert len({x.start for x in rows}) == len(rows)
        a_starts += [x.start for x in rows]
        a_epochs += [x.epoch for x in rows]
    assert r0.state_dict() == r1.state_dict()
    # the data is what it always was: windows front to back, wrapping at the stream's end, nothing skipped
    assert a_starts == [16 * (i % 11) for i in range(len(a_starts))]
    # an epoch is at most one pass (11 windows), each window once; it ends where a batch could not take 3
    runs = [a_epochs.count(e) for e in sorted(set(a_epochs))]
    assert runs[:-1] == [9] * (len(runs) - 1) and a_epochs == sorted(a_epochs)
    assert any("source 'a' starts epoch 1 at sample" in e and "goes on from token 144" in e for e in r0.events)
