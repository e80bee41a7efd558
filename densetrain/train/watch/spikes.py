"""What a spike event carries so that ``densetrain replay`` can tell data from hardware.

Each rank's own part of a step (its local loss sum and target count, before the reduction over
ranks, and the gradient norm it computed) is gathered into the guard's ``loss_spike`` and
``nonfinite`` events as ``values["ranks"]``. Nothing is gathered on ordinary steps: the local numbers
are kept as floats and one all-reduce runs only when an event is written (every rank writes the same
events, as every rank reaches the same verdict). Under DDP each rank's gradient norm is that of its
own copy of the reduced gradient, so a rank whose gradient was corrupted after the reduction shows
another norm; under FSDP the norm is already global and names no rank.

With ``guard.replay``, rank 0 then starts ``densetrain replay RUN_DIR STEP`` in the background.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import torch
import torch.distributed as dist

FIELDS = ("dp_rank", "loss_sum", "n_tokens", "grad_norm")


def rank_partials(run, local: tuple[float, int], grad_norm: float) -> list[dict]:
    """Every rank's ``{"rank", "dp_rank", "loss_sum", "n_tokens", "loss", "grad_norm"}`` (rank order);
    ``local`` is this rank's (loss sum in nats, target tokens) before the reduction. A collective: every
    rank must call it."""
    world = run.info.world_size
    table = torch.zeros(world, len(FIELDS), dtype=torch.float64, device=run.info.device)
    table[run.info.rank] = torch.tensor([run.info.dp_rank, local[0], local[1], grad_norm], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(table)  # each rank fills its own row, the others add zeros
    out = []
    for r, (dp, lsum, ntok, gn) in enumerate(table.tolist()):
        out.append({"rank": r, "dp_rank": int(dp), "loss_sum": lsum, "n_tokens": int(ntok),
                    "loss": lsum / ntok if ntok else math.nan, "grad_norm": gn})
    return out


def start_replay(run, index: int) -> subprocess.Popen | None:
    """On rank 0: start ``densetrain replay RUN_DIR STEP --auto`` for update ``index`` (STEP = index + 1,
    as in metrics.jsonl) in a background process on this node; its verdict is appended to
    ``events_replay.jsonl``, its messages to ``replay.log``."""
    if not run.info.is_main:
        return None
    cmd = [sys.executable, "-m", "densetrain", "replay", str(run.run_dir), str(index + 1), "--auto"]
    # One process of its own, not a rank of this job (torchrun's variables would make it join the group).
    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}
    with open(run.run_dir / "replay.log", "a") as err:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
