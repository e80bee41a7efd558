"""train/watch/probe.py: the duplicate rate is counted over the global batch, each window with its own epoch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import forked
import numpy as np
from conftest import gloo_env

from densetrain.config.recovery import ProbeConfig
from densetrain.data.mixture import MixtureSampler
from densetrain.data.shards import TokenFiles, write_shard
from densetrain.train.watch.probe import DataProbe

ROOT = Path(__file__).resolve().parents[1]
T = 16  # seq_len; the probe hashes whole samples (window_tokens = T + 1)


def _source(tmp_path: Path, tokens: np.ndarray) -> dict[str, TokenFiles]:
    (tmp_path / "a").mkdir()
    write_shard(tmp_path / "a" / "000000", [tokens], token_size=4)
    return {"a": TokenFiles(tmp_path / "a")}


def _duplicated_across_ranks(n_batches: int) -> np.ndarray:
    """A stream whose window 4k + 2 repeats window 4k (a dedup bug): in global batches of 4 over 2 ranks the
    copy is row 2, on rank 1, of the row 0 that rank 0 holds; neither rank sees a window twice itself."""
    s = np.arange(4 * n_batches * T + 1)
    for k in range(n_batches):
        s[(4 * k + 2) * T : (4 * k + 3) * T + 1] = s[4 * k * T : (4 * k + 1) * T + 1]
    return s


def _probe_counts(streams, batches: int, keep: range, shuffle_seed=None, every: int = 5) -> list:
    sampler, probe = MixtureSampler(streams), DataProbe(ProbeConfig(window_tokens=T + 1), ["a"])
    out = []
    for b in range(batches):
        first = sampler.state["samples_seen"]
        probe.add_batch(sampler.next_samples(4, "main", {"a": 1.0}, T, keep, shuffle_seed=shuffle_seed), first, 4, T)
        if (b + 1) % every == 0:
            out.append(probe.count()[0].tolist())
    return out


def test_an_epoch_that_wraps_inside_a_batch_raises_no_false_duplicates(tmp_path):
    # 11 windows read in file order, batches of 4: the epoch wraps inside most batches. Tagging every window
    # with the sampler's epoch after the draw (before) counted the old epoch's last windows as the new
    # epoch's and then again: 1 or 2 "duplicates" in every check of 20 windows.
    streams = _source(tmp_path, np.arange(11 * T + 1))
    assert _probe_counts(streams, 40, range(4)) == [[0.0, 20.0]] * 8
    assert _probe_counts(streams, 40, range(4), shuffle_seed=3) == [[0.0, 20.0]] * 8


def test_a_real_duplicate_is_counted(tmp_path):
    streams = _source(tmp_path, _duplicated_across_ranks(10))
    assert _probe_counts(streams, 10, range(4), every=10) == [[10.0, 40.0]]


_WORKER = r"""
import json, os, sys
import torch.distributed as dist
sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "tests")]
from test_probe import _probe_counts
from densetrain.data.shards import TokenFiles
dist.init_process_group("gloo")
r = int(os.environ["RANK"])
res = _probe_counts({"a": TokenFiles(sys.argv[2])}, 10, range(2 * r, 2 * r + 2), every=10)
open(f"{sys.argv[3]}.{r}", "w").write(json.dumps(res))
dist.destroy_process_group()
"""


def test_a_duplicate_on_another_rank_is_seen_by_every_rank(tmp_path):
    streams = _source(tmp_path, _duplicated_across_ranks(10))
    script, out = tmp_path / "worker.py", tmp_path / "counts"
    script.write_text(_WORKER)
    env = gloo_env(2)
    procs = [forked.Popen([sys.executable, str(script), str(ROOT), str(tmp_path / "a"), str(out)],
                          env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    # every rank counts the global batch: 10 copies in 40 windows (before: 0 on each rank, its own 20)
    got = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    assert got == [[[10.0, 40.0]]] * 2 == [_probe_counts(streams, 10, range(4), every=10)] * 2
