"""benchmarks/speedrun.py --nanochat: the bits-per-byte scorer both sides share, and the skip without inputs."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import forked
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bpb_stream import bpb, stream_nats  # noqa: E402


@pytest.mark.parametrize("n", [2, 9, 10, 11, 37])
def test_every_token_after_the_first_is_a_target_once(n):
    ids = list(range(100, 100 + n))
    seen = []

    def loss_sum(x, y):
        assert x.shape == y.shape and torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
        seen.extend(y.flatten().tolist())
        return torch.tensor(float(y.numel()) * math.log(4.0))  # a uniform model over 4 tokens

    nats, count = stream_nats(loss_sum, ids, window=4, batch=2)
    assert sorted(seen) == ids[1:] and count == n - 1
    assert bpb(nats, nbytes=n - 1) == pytest.approx(2.0)  # log2(4) bits per target, one byte each


def test_skips_with_a_message_when_inputs_are_absent(tmp_path, capsys):
    from speedrun_nanochat import main

    for fineweb in (tmp_path, tmp_path / "none"):
        assert main(["--nanochat", str(tmp_path), "--fineweb", str(fineweb)]) == 0
        assert capsys.readouterr().out.startswith("SKIPPED: no FineWeb sample")
    fineweb = tmp_path / "fw"
    fineweb.mkdir()
    for i in range(3):
        (fineweb / f"part_{i}.parquet").write_bytes(b"")  # only their names are looked at before the skip
    assert main(["--nanochat", str(tmp_path / "nc"), "--fineweb", str(fineweb)]) == 0
    assert capsys.readouterr().out.startswith("SKIPPED: nanochat checkout or its Python absent")
    # benchmarks/speedrun.py hands --nanochat to it.
    r = forked.run([sys.executable, str(ROOT / "benchmarks" / "speedrun.py"), "--nanochat", str(tmp_path / "nc"),
                    "--fineweb", str(fineweb)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.startswith("SKIPPED: nanochat checkout or its Python absent"), r.stdout
